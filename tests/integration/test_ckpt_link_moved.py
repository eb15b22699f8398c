"""A checkpoint dir's link the job moves on while the seal of its checkpoint is in progress.

Lightning's ``save_last="link"`` points ``last.ckpt`` at each new checkpoint as soon as it is
written. A job that checkpoints more often than a seal takes (a big checkpoint, a slow store) has
moved ``last.ckpt`` to a newer, unsealed checkpoint by the time the MANIFEST of the one being
sealed is written: recorded only as the dir stood then, no MANIFEST had ``last.ckpt``, and after
a preemption ``trainer.fit(ckpt_path="last")`` on the restored dir trained from step 0.

A real sealer process seals to a real ``file://`` store, held in its copy of the checkpoint
(``RGT_HOLD_AT=copy.after_piece``, onbox/common/faults.py) while the job (a real Lightning run,
or the test as the job) writes the next checkpoint and moves the link; then the box is gone
(one pass, no more), and a real restore into an empty directory, and a real resume, follow.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from typing import Any, Dict, List

from onbox.sealing import manifest as mf
from onbox.sealing.restore import restore_latest
from onbox.sealing.stores import open_store
from tests.conftest import require
from tests.integration.test_ckpt_dir_links import _SCRIPT, _lightning

# One pass of a real sealer over the dir, as an agent's: what it sealed is printed.
_SEAL = """
import sys
from onbox.sealing.epochs import take_epoch
from onbox.sealing.sealer import Sealer
from onbox.sealing.stores import open_store
url, run, ckpt, tmp, passes = sys.argv[1:6]
store = open_store(url)
s = Sealer(run, ckpt, store, tmp + "/stage", epoch=take_epoch(store, run),
           event=lambda *a, **kw: None, state_path=tmp + "/seq.json")
s.load()
print("sealed", [s.seal_pending() for _ in range(int(passes))], sorted(s.manifests), flush=True)
"""
MIB = 5 << 20  # past filecopy.SMALL_FILE: copied in pieces, so the copy holds after one


def _held_seal(
    tmp_path: Any, url: str, run: str, ckpt: str, passes: int = 1, work: Any = None
) -> subprocess.Popen[str]:
    """A sealer process (``passes`` of them, then the box is gone) held in its first copy of a
    big file until ``tmp_path/release``; its state in ``work`` (an agent's run dir), a new one
    unless given."""
    if work is None:
        work = tmp_path / f"sealer-{time.monotonic_ns()}"
        work.mkdir()
    env = dict(
        os.environ,
        RGT_HOLD_AT="copy.after_piece",
        RGT_HOLD_UNTIL=str(tmp_path / "release"),
        PYTHONUNBUFFERED="1",
    )
    return subprocess.Popen(
        [sys.executable, "-c", _SEAL, url, run, ckpt, str(work), str(passes)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_copying(p: subprocess.Popen[str], root: str) -> None:
    """Until the sealer is in its copy into the store (its temporary file is there), held."""
    deadline = time.monotonic() + 120
    while not any(f.startswith(".rgt-tmp.") for _, _, fs in os.walk(root) for f in fs):
        if p.poll() is not None or time.monotonic() > deadline:
            p.kill()  # by its PID
            out, err = p.communicate()
            raise AssertionError(f"the seal was never held in its copy: {out}\n{err}")
        time.sleep(0.05)


def _finish(tmp_path: Any, p: subprocess.Popen[str]) -> str:
    (tmp_path / "release").touch()
    try:
        out, err = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        p.kill()  # by its PID
        out, err = p.communicate()
        raise AssertionError(f"the sealer did not end: {out}\n{err}") from None
    assert p.returncode == 0, out + err
    return out


def _links(root: str, run: str, step: int) -> List[Dict[str, str]]:
    with open(os.path.join(root, mf.manifest_key(run, step)), "rb") as f:
        links: List[Dict[str, str]] = json.loads(f.read()).get("links", [])
    return links


def _restore(store: Any, run: str, dest: str) -> Dict[str, Any]:
    said: List[str] = []
    doc = restore_latest(store, run, dest, lambda kind, reason, **kw: said.append(reason))
    assert doc is not None, said
    return doc


def test_last_moved_on_during_the_seal_comes_back_and_lightning_resumes_from_it(
    tmp_path: Any,
) -> None:
    missing = [m for m in ("torch", "lightning") if importlib.util.find_spec(m) is None]
    require(not missing, f"{', '.join(missing)} (pip install -e '.[train,frameworks]')")
    root = tmp_path / "durable"
    root.mkdir()
    store = open_store(f"file://{root}")
    ckpt = str(tmp_path / "old-box" / "ckpt")
    pad = MIB // 4 + 1  # float32s: a checkpoint past SMALL_FILE
    (tmp_path / "train.py").write_text(_SCRIPT)
    with open(tmp_path / "job.err", "w") as log:  # Lightning's warnings: more than a pipe
        _job_goes_on_during_the_seal(tmp_path, ckpt, pad, log, str(root), store.url)
    assert os.readlink(os.path.join(ckpt, "last.ckpt")) == "epoch=0-step=4.ckpt"

    new = str(tmp_path / "new-box" / "ckpt")
    assert _restore(store, "lit", new)["step"] == 2
    assert sorted(os.listdir(new)) == ["epoch=0-step=2.ckpt", "last.ckpt"]
    assert os.readlink(os.path.join(new, "last.ckpt")) == "epoch=0-step=2.ckpt"
    resumed = _lightning(tmp_path, new, 4, resume=True, pad=pad)
    assert "training from step 2" in resumed, resumed[-2000:]


def _job_goes_on_during_the_seal(
    tmp_path: Any, ckpt: str, pad: int, log: Any, root: str, url: str
) -> None:
    """The job (to step 4) waits at its gate once step 2 is written; a held seal of step 2
    starts; the job goes on (step 4, last.ckpt moved on) and ends; the seal is let go."""
    gate = tmp_path / "go-on"
    job = subprocess.Popen(
        [sys.executable, str(tmp_path / "train.py"), ckpt, "4", "new", str(pad), str(gate)],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        cwd=str(tmp_path),
    )
    sealer = None
    try:
        assert job.stdout is not None
        said = [job.stdout.readline() for _ in range(2)]  # each ends when written, or the job
        assert said[-1].startswith("checkpointed step 2"), said + [_tail(tmp_path / "job.err")]
        assert os.readlink(os.path.join(ckpt, "last.ckpt")) == "epoch=0-step=2.ckpt"
        sealer = _held_seal(tmp_path, url, "lit", ckpt)
        _wait_copying(sealer, root)
        gate.touch()
        job.communicate(timeout=300)
        assert job.returncode == 0, _tail(tmp_path / "job.err")
    finally:
        job.kill()  # by its PID; ended already unless the test failed
        job.wait()
        if sealer is not None and job.returncode != 0:
            sealer.kill()  # by its PID
            sealer.wait()
    assert sealer is not None
    out = _finish(tmp_path, sealer)
    assert "[2]" in out, out  # one pass sealed step 2, then the box was preempted


def _tail(path: Any) -> str:
    with open(path) as f:
        return f.read()[-3000:]


def _ckpt(d: Any, step: int, size: int) -> str:
    name = f"epoch=0-step={step}.ckpt"
    (d / f".{name}.part").write_bytes(os.urandom(size))
    os.replace(str(d / f".{name}.part"), str(d / name))
    return name


def _point(d: Any, link: str, name: str) -> None:
    """Move ``link`` on to ``name`` in one rename, as a job does."""
    os.symlink(name, str(d / ".link.part"))
    os.replace(str(d / ".link.part"), str(d / link))


def test_a_link_is_recorded_with_each_checkpoint_it_led_to_and_never_with_another(
    tmp_path: Any,
) -> None:
    """The held seal of step 2 records ``last.ckpt`` though it leads to step 4 by then, not
    ``best.ckpt`` (step 1's throughout); the next seal records ``last.ckpt`` with step 4; a
    restore that falls back from a damaged step 4 makes ``last.ckpt`` lead to step 2."""
    root = tmp_path / "durable"
    root.mkdir()
    store = open_store(f"file://{root}")
    d = tmp_path / "ckpt"
    d.mkdir()
    _point(d, "best.ckpt", _ckpt(d, 1, 1000))
    _point(d, "last.ckpt", _ckpt(d, 2, MIB))
    sealer = _held_seal(tmp_path, store.url, "own", str(d))
    _wait_copying(sealer, str(root))
    _point(d, "last.ckpt", _ckpt(d, 4, MIB))
    assert "[1, 2]" in _finish(tmp_path, sealer)
    assert _links(str(root), "own", 1) == [{"name": "best.ckpt", "target": "epoch=0-step=1.ckpt"}]
    assert _links(str(root), "own", 2) == [{"name": "last.ckpt", "target": "epoch=0-step=2.ckpt"}]

    first = tmp_path / "box-1"
    assert _restore(store, "own", str(first))["step"] == 2
    assert sorted(os.listdir(first)) == ["epoch=0-step=2.ckpt", "last.ckpt"]

    (tmp_path / "release").touch()  # no hold from here on
    assert "[1, 2, 4]" in _finish(tmp_path, _held_seal(tmp_path, store.url, "own", str(d)))
    assert _links(str(root), "own", 4) == [{"name": "last.ckpt", "target": "epoch=0-step=4.ckpt"}]
    second = tmp_path / "box-2"
    assert _restore(store, "own", str(second))["step"] == 4
    assert os.readlink(str(second / "last.ckpt")) == "epoch=0-step=4.ckpt"

    _damage(str(root), "own", 4)  # the store lost step 4's bytes
    third = tmp_path / "box-3"
    assert _restore(store, "own", str(third))["step"] == 2
    assert sorted(os.listdir(third)) == ["epoch=0-step=2.ckpt", "last.ckpt"]
    assert os.readlink(str(third / "last.ckpt")) == "epoch=0-step=2.ckpt"


def _damage(root: str, run: str, step: int) -> None:
    """Overwrite the start of the first file of ``step`` in the file:// store at ``root``."""
    with open(os.path.join(root, mf.manifest_key(run, step)), "rb") as f:
        key = json.loads(f.read())["files"][0]["key"]
    with open(os.path.join(root, key), "r+b") as f:
        f.write(b"\0" * 64)


def _remembered(work: Any, p: subprocess.Popen[str], name: str, target: str) -> None:
    """Until the sealer's memory of the links (``seq-links.json`` in its run dir, written by a
    look that saw a new pair) holds ``name`` leading to ``target``: the look is over, not only
    begun (a look that opened the dir may read the link after the job moved it on again)."""
    path = work / "seq-links.json"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            pairs = json.loads(path.read_text())["pairs"]
        except (OSError, ValueError):
            pairs = []
        if any(pair[:2] == [name, target] for pair in pairs):
            return
        if p.poll() is not None:
            break
        time.sleep(0.05)
    p.kill()  # by its PID
    out, err = p.communicate()
    raise AssertionError(f"the sealer never saw {name} -> {target} while held: {out}\n{err}")


def test_a_link_moved_on_past_a_backlog_during_a_seal_is_recorded_with_each_checkpoint(
    tmp_path: Any,
) -> None:
    """Steps 4 and 6 written, and last.ckpt moved on to each, while step 2 is sealed: the
    next pass seals 4 and 6 with last.ckpt at 6 already, and 4's MANIFEST still has it (the
    sealer looked at the links during step 2's upload, with last.ckpt at 4). A box preempted
    with 6 lost (damaged in the store) restores 4, with last.ckpt."""
    root = tmp_path / "durable"
    root.mkdir()
    store = open_store(f"file://{root}")
    d = tmp_path / "ckpt"
    d.mkdir()
    _point(d, "last.ckpt", _ckpt(d, 2, MIB))
    work = tmp_path / "run-dir"
    work.mkdir()
    sealer = _held_seal(tmp_path, store.url, "own", str(d), passes=2, work=work)
    _wait_copying(sealer, str(root))
    _point(d, "last.ckpt", _ckpt(d, 4, 1000))
    _remembered(work, sealer, "last.ckpt", "epoch=0-step=4.ckpt")
    _point(d, "last.ckpt", _ckpt(d, 6, 1000))
    assert "[2, 4, 6]" in _finish(tmp_path, sealer)
    for step in (2, 4, 6):
        want = [{"name": "last.ckpt", "target": f"epoch=0-step={step}.ckpt"}]
        assert _links(str(root), "own", step) == want, step

    _damage(str(root), "own", 6)  # the store lost step 6's bytes
    box = tmp_path / "box"
    assert _restore(store, "own", str(box))["step"] == 4
    assert sorted(os.listdir(box)) == ["epoch=0-step=4.ckpt", "last.ckpt"]
    assert os.readlink(str(box / "last.ckpt")) == "epoch=0-step=4.ckpt"


def test_a_link_seen_before_the_sealer_was_killed_is_recorded_by_the_next_one(
    tmp_path: Any,
) -> None:
    """A sealer process saw ``last.ckpt`` lead to step 2 while step 2 waited, and is killed
    (SIGKILL: a crash, an agent upgraded or adopted) before step 2's MANIFEST; the job moves
    ``last.ckpt`` on to step 4; a new sealer process of the same run dir seals 2 and 4. Step
    2's MANIFEST has ``last.ckpt``: the memory of the links outlived the process, and a
    restore that falls back to step 2 makes it again."""
    root = tmp_path / "durable"
    root.mkdir()
    store = open_store(f"file://{root}")
    d = tmp_path / "ckpt"
    d.mkdir()
    work = tmp_path / "run-dir"
    work.mkdir()
    _point(d, "last.ckpt", _ckpt(d, 2, MIB))
    first = _held_seal(tmp_path, store.url, "own", str(d), work=work)
    try:
        _wait_copying(first, str(root))
        # Its copy may begin before its first look at the dir's links: killed only once that
        # look has put last.ckpt -> step 2 in its durable memory (what the test is about).
        _remembered(work, first, "last.ckpt", "epoch=0-step=2.ckpt")
    finally:
        first.kill()  # by its PID: SIGKILL, before step 2's MANIFEST
        first.communicate()  # its pipes closed
    assert not os.path.exists(os.path.join(root, mf.manifest_key("own", 2)))
    _point(d, "last.ckpt", _ckpt(d, 4, 1000))

    (tmp_path / "release").touch()  # no hold from here on
    assert "[2, 4]" in _finish(tmp_path, _held_seal(tmp_path, store.url, "own", str(d), 1, work))
    assert _links(str(root), "own", 2) == [{"name": "last.ckpt", "target": "epoch=0-step=2.ckpt"}]
    assert _links(str(root), "own", 4) == [{"name": "last.ckpt", "target": "epoch=0-step=4.ckpt"}]
    box = tmp_path / "box"
    kept = json.loads((work / "seq-links.json").read_text())["pairs"]
    assert not [p for p in kept if p[1] == "epoch=0-step=2.ckpt"], kept  # sealed: forgotten
    _damage(str(root), "own", 4)  # the store lost step 4's bytes
    assert _restore(store, "own", str(box))["step"] == 2
    assert os.readlink(str(box / "last.ckpt")) == "epoch=0-step=2.ckpt"
