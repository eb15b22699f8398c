"""Sealing checkpoints to a durable directory, with real agents, real jobs and real faults.

What a user relies on: the newest checkpoint verified before a fault survives it; LATEST names
only verified checkpoints and never moves back; nothing torn is sealed or visible under a final
name; one writer per run; a fresh box resumes from the newest sealed step.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional

import pytest

from controller.registry import RunRecord
from controller.results.pull import pull
from controller.target import Target
from onbox.common.errors import PermanentStoreError, TransientStoreError
from onbox.common.sealtime import event_time
from onbox.sealing.epochs import take_epoch
from onbox.sealing.fetch import STAGE_PREFIX
from onbox.sealing.restore import restore_latest
from onbox.sealing.sealer import Sealer
from onbox.sealing.stores import open_store
from onbox.sealing.stores.base import ObjectInfo, Store
from onbox.sealing.stores.local import LocalStore
from tests.conftest import ROOT, Cli, fixture, require
from tests.dirsync import DirSyncSpy
from tests.mounts import tmpfs
from tests.polling import wait

WRITER = fixture("ckpt_writer.py")


def _store_root(tmp_path: Any) -> str:
    root = str(tmp_path / "durable")
    os.makedirs(root, exist_ok=True)
    return root


def _latest(root: str, run: str) -> Dict[str, Any]:
    with open(os.path.join(root, run, "LATEST.json")) as f:
        out: Dict[str, Any] = json.load(f)
    return out


def _manifests(root: str, run: str) -> Dict[int, Dict[str, Any]]:
    out = {}
    base = os.path.join(root, run, "checkpoints")
    for step in os.listdir(base) if os.path.isdir(base) else []:
        path = os.path.join(base, step, "MANIFEST.json")
        if os.path.exists(path):
            with open(path) as f:
                out[int(step)] = json.load(f)
    return out


def _sealer(
    store: Any, run: str, ckpt: str, tmp_path: Any, events: Optional[List[Dict[str, Any]]] = None
) -> Sealer:
    """The real Sealer of ``run`` for ``ckpt`` into ``store``, in this process, loaded; its
    events appended to ``events`` when given."""
    got = [] if events is None else events
    s = Sealer(
        run,
        ckpt,
        store,
        str(tmp_path / "stage"),
        epoch=take_epoch(store, run),
        event=lambda kind, reason, **kw: got.append(dict(kw, kind=kind, reason=reason)),
        state_path=str(tmp_path / "seq.json"),
    )
    s.load()
    return s


def _wrote(cli: Cli, name: str) -> Dict[str, List[str]]:
    """sha256 of every version the job reported complete, by file name."""
    out: Dict[str, List[str]] = {}
    for m in re.finditer(
        r"wrote (\S+) version \d+ sha256 ([0-9a-f]{64})", cli("logs", name, check=True).stdout
    ):
        out.setdefault(m.group(1), []).append(m.group(2))
    return out


def _check_invariants(root: str, run: str) -> None:
    """LATEST names a MANIFEST whose files are all there with their sha256; no temporary
    file is left by a writer that is gone (``.rgt-tmp.PID.HEX``: one whose PID lives is a
    write in flight, e.g. a live agent's mirror of its events)."""
    latest = _latest(root, run)
    with open(os.path.join(root, latest["manifest"])) as f:
        doc = json.load(f)
    for entry in doc["files"]:
        with open(os.path.join(root, entry["key"]), "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == entry["sha256"], entry
    for dirpath, _, files in os.walk(os.path.join(root, run)):
        litter = [n for n in files if ".rgt-tmp." in n and not _writer_alive(n)]
        assert not litter, (dirpath, litter)


def _writer_alive(tmp_name: str) -> bool:
    m = re.search(r"\.rgt-tmp\.(\d+)\.", tmp_name)
    return m is not None and os.path.exists(f"/proc/{m.group(1)}")


def _text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return ""


def test_a_checkpoint_open_for_writing_is_sealed_only_once_complete(
    cli: Cli, tmp_path: Any
) -> None:
    root = _store_root(tmp_path)
    cli(
        "start",
        "--name",
        "s1",
        "--store",
        "file://" + root,
        "--",
        *WRITER,
        "slow",
        "10",
        check=True,
    )
    ckpt = os.path.join(cli.home, "runs", "s1", "ckpt")
    wait(lambda: os.path.exists(os.path.join(ckpt, "step_10.pt")), 30, "the write to begin")
    time.sleep(1.5)  # the sealer has scanned while the file was half written and open
    assert not _manifests(root, "s1")
    wait(lambda: 10 in _manifests(root, "s1"), 30, "step 10 sealed")
    sealed = _manifests(root, "s1")[10]["files"][0]["sha256"]
    assert [sealed] == _wrote(cli, "s1")["step_10.pt"]
    _check_invariants(root, "s1")
    cli("stop", "s1", "--grace", "1", check=True)


def test_a_torn_checkpoint_left_by_a_killed_job_is_never_sealed(cli: Cli, tmp_path: Any) -> None:
    root = _store_root(tmp_path)
    job = os.path.join(cli.home, "torn.toml")
    with open(job, "w") as f:
        f.write(
            f'command = {json.dumps([*WRITER, "torn", "20"])}\nstore = "file://{root}"\n'
            "[restart]\nmax_preempt_restarts = 0\n"
        )
    cli("start", job, "--name", "s2", check=True)
    cli.wait_state("s2", "FAILED")
    assert os.path.exists(os.path.join(cli.home, "runs", "s2", "ckpt", "step_20.pt"))
    time.sleep(1)
    assert not _manifests(root, "s2")
    assert "torn_checkpoint" in [e["kind"] for e in cli.events("s2")]


def test_a_file_rewritten_in_place_every_300ms_is_sealed_whole(cli: Cli, tmp_path: Any) -> None:
    root = _store_root(tmp_path)
    cli(
        "start",
        "--name",
        "s3",
        "--store",
        "file://" + root,
        "--",
        *WRITER,
        "inplace",
        "12",
        "0.3",
        check=True,
    )
    cli.wait_state("s3", "SUCCEEDED", timeout=60)
    complete = set(_wrote(cli, "s3")["ckpt.pt"])
    manifests = _manifests(root, "s3")
    assert manifests
    for doc in manifests.values():
        assert doc["files"][0]["sha256"] in complete  # never a half-written version
    assert (
        manifests[_latest(root, "s3")["step"]]["files"][0]["sha256"]
        == _wrote(cli, "s3")["ckpt.pt"][-1]
    )  # the last version is sealed at the end
    _check_invariants(root, "s3")
    assert os.path.exists(os.path.join(root, "s3", "DONE.json"))


def test_a_job_deleting_old_checkpoints_while_they_are_sealed_is_normal(
    cli: Cli, tmp_path: Any
) -> None:
    root = _store_root(tmp_path)
    cli(
        "start",
        "--name",
        "s4",
        "--store",
        "file://" + root,
        "--",
        *WRITER,
        "rotate",
        "40",
        check=True,
    )
    cli.wait_state("s4", "SUCCEEDED", timeout=60)
    kinds = [e["kind"] for e in cli.events("s4")]
    assert "seal_error" not in kinds and "seal_bug" not in kinds
    assert _latest(root, "s4")["step"] == 40
    steps = [e["step"] for e in cli.events("s4") if e["kind"] == "latest"]
    assert steps == sorted(steps)  # LATEST only moved forward
    _check_invariants(root, "s4")


def test_finished_run_is_not_trained_again(cli: Cli, tmp_path: Any) -> None:
    root = _store_root(tmp_path)
    cli(
        "start",
        "--name",
        "s5",
        "--store",
        "file://" + root,
        "--",
        *WRITER,
        "rotate",
        "2",
        check=True,
    )
    cli.wait_state("s5", "SUCCEEDED", timeout=60)
    p = cli("start", "--name", "s5", check=True)
    assert "is finished" in p.stdout and "DONE.json" in p.stdout
    assert cli.status("s5")["attempt"] == 1


def test_an_output_whose_name_pull_would_refuse_is_left_out_and_the_rest_is_pulled(
    cli: Cli, tmp_path: Any, controller_env: Dict[str, str]
) -> None:
    """An output named with a CR would make DONE.json, and so every pull of the run, refused:
    that one file is left out with a usage event, and the rest of the result comes home."""
    root = _store_root(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    (work / "job.py").write_text(
        "import os\nos.makedirs('out')\n"
        "for n in ('good.txt', 'bad\\rname.txt'):\n"
        "    open(os.path.join('out', n), 'w').write(n)\n"
    )
    (work / "job.toml").write_text(
        f'name = "outs"\ncommand = {json.dumps([sys.executable, "job.py"])}\n'
        f'outputs = ["out/"]\nstore = "file://{root}"\n'
    )
    cli("start", str(work / "job.toml"), check=True, cwd=str(work))
    cli.wait_state("outs", "SUCCEEDED", timeout=60)
    wait(lambda: os.path.exists(os.path.join(root, "outs", "DONE.json")), 30, "DONE.json")
    with open(os.path.join(root, "outs", "DONE.json")) as f:
        keys = [e["key"] for e in json.load(f)["files"]]
    assert "outs/outputs/out/good.txt" in keys and not [k for k in keys if "\r" in k]
    [ev] = [e for e in cli.events("outs") if e["kind"] == "unsafe_name"]
    assert ev["class"] == "usage" and ev["path"] == "out/bad\rname.txt"
    assert "output 'out/bad\\rname.txt' is not sealed" in ev["reason"]
    rec = RunRecord(
        "outs", Target("local"), profile="local", store=f"file://{root}", box_home=cli.home
    )
    receipt = pull(rec, str(tmp_path / "dest"), "store")
    assert "outputs/out/good.txt" in {f.path for f in receipt.files}


@pytest.mark.parametrize("grace,final_sealed", [("5", True), ("0", False)])
def test_sigterm_seals_the_final_checkpoint_only_when_it_fits(
    cli: Cli, tmp_path: Any, grace: str, final_sealed: bool
) -> None:
    root = _store_root(tmp_path)
    job = os.path.join(cli.home, "sig.toml")
    with open(job, "w") as f:
        f.write(
            f"command = {json.dumps([*WRITER, 'on_signal', '4'])}\n"
            f'store = "file://{root}"\n[checkpoint]\ntrigger = "signal:USR2"\n'
        )
    cli("start", job, "--name", "s6", "--grace", grace, check=True)
    st = cli.wait_state("s6", "RUNNING", "STARTING")
    cli.wait_output("s6", "ready")  # its USR2 handler is in place
    os.kill(st["pid"], signal.SIGUSR2)  # a first checkpoint, sealed in the normal way
    wait(lambda: os.path.exists(os.path.join(root, "s6", "LATEST.json")), 30, "step 1 sealed")
    os.kill(st["agent"]["pid"], signal.SIGTERM)
    wait(lambda: not cli.peek("s6")["agent"]["alive"], 15, "the agent to exit")
    assert cli.status("s6")["state"] == "PREEMPTED"
    # The agent's own record: from the SIGTERM it took to PREEMPTED written (the job stopped,
    # what fit sealed) within its budget. Read from its events, not from this test's clock,
    # whose polling and the interpreter's exit on a loaded 2-core machine add a second or so.
    events = cli.events("s6")
    [term] = [e for e in events if e["kind"] == "preempt"]
    [done] = [e for e in events if e["kind"] == "state" and e["state"] == "PREEMPTED"]
    took = event_time(done) - event_time(term)  # type: ignore[operator]
    assert took < max(float(grace), 0) + 1.0, events  # within its budget (+ margin)
    latest = _latest(root, "s6")["step"]
    if final_sealed:
        assert latest == 2  # the job's answer to the preemption's request, sealed in time
    else:
        assert latest == 1  # no time: LATEST stays on the previous verified checkpoint
        # and the job is not asked for a checkpoint that could not be sealed in time
        kinds = [e["kind"] for e in cli.events("s6")]
        assert "checkpoint_not_asked" in kinds and "checkpoint_asked" not in kinds[-5:], kinds
    _check_invariants(root, "s6")


def test_stale_epoch_cannot_move_latest(tmp_path: Any) -> None:
    root = _store_root(tmp_path)
    store = open_store("file://" + root)
    ckpt = str(tmp_path / "ckpt")
    os.makedirs(ckpt)
    events: List[str] = []

    def sealer(epoch: int, name: str) -> Sealer:
        s = Sealer(
            "r",
            ckpt,
            store,
            str(tmp_path / f"stage-{name}"),
            epoch=epoch,
            event=lambda kind, reason, **kw: events.append(kind),
            state_path=str(tmp_path / f"seq-{name}.json"),
        )
        s.load()
        return s

    old = sealer(take_epoch(store, "r"), "old")
    with open(os.path.join(ckpt, "step_5.pt"), "wb") as f:
        f.write(b"five")
    assert old.seal_pending() == 1 and _latest(root, "r")["step"] == 5
    new = sealer(take_epoch(store, "r"), "new")  # the box came back: a newer agent writes
    assert new.epoch == old.epoch + 1
    with open(os.path.join(ckpt, "step_9.pt"), "wb") as f:
        f.write(b"nine")
    old.seal_pending()
    assert _latest(root, "r")["step"] == 5 and "stale_epoch" in events
    new.load()
    new.seal_pending()
    assert _latest(root, "r")["step"] == 9


def test_a_directory_whose_marker_is_still_being_written_is_not_sealed(tmp_path: Any) -> None:
    """Transformers writes checkpoint-N/trainer_state.json in place, last: while it is open
    for writing, or cut off mid-write, the directory is not a checkpoint yet."""
    root = _store_root(tmp_path)
    store = open_store("file://" + root)
    ckpt = str(tmp_path / "ckpt")
    d = os.path.join(ckpt, "checkpoint-5")
    os.makedirs(d)
    with open(os.path.join(d, "model.safetensors"), "wb") as f:
        f.write(os.urandom(4096))
    s = _sealer(store, "hf", ckpt, tmp_path)
    marker = open(os.path.join(d, "trainer_state.json"), "w")  # noqa: SIM115 (held open)
    marker.write('{"global_step": 5, "log_hist')
    marker.flush()
    assert s.seal_pending() == 0  # open for writing
    marker.close()
    assert s.seal_pending() == 0  # closed, but cut off: not JSON
    with open(os.path.join(d, "trainer_state.json"), "w") as f:
        f.write('{"global_step": 5, "log_history": []}')
    assert s.seal_pending() == 1 and _latest(root, "hf")["step"] == 5


def test_every_directory_a_seal_or_restore_makes_is_durable_before_it_is_relied_on(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A seal into a durable directory that does not exist yet (its root, the run, the step,
    a shard directory inside the checkpoint) fsyncs each new directory into its parent before
    LATEST names the checkpoint; a restore into a new nested target does the same before it
    returns. Otherwise power lost on the box could keep LATEST and lose the step it names."""
    mnt = str(tmp_path / "mnt")
    root = os.path.join(mnt, "proj", "durable")  # made by the first put, under a mount
    ckpt = str(tmp_path / "ckpt")
    d = os.path.join(ckpt, "checkpoint-5")
    os.makedirs(os.path.join(d, "shards", "rank0"))
    with open(os.path.join(d, "shards", "rank0", "model.bin"), "wb") as f:
        f.write(os.urandom(3 << 20))
    with open(os.path.join(d, "trainer_state.json"), "w") as f:
        f.write('{"global_step": 5, "log_history": []}')
    with tmpfs(mnt, "size=64m"):
        store = open_store("file://" + root)
        spy = DirSyncSpy(monkeypatch)
        s = _sealer(store, "r", ckpt, tmp_path)
        assert s.seal_pending() == 1 and _latest(root, "r")["step"] == 5
        made = spy.made(mnt)
        assert made[:3] == [os.path.realpath(p) for p in (mnt + "/proj", root, root + "/r")]
        assert made[-1].endswith("/r/checkpoints/5/e1/checkpoint-5/shards/rank0"), made
        latest = os.path.join(root, "r", "LATEST.json")
        assert spy.not_durable(mnt, before=latest) == []
        _restore_made_durable(store, tmp_path, spy)


def _restore_made_durable(store: Store, tmp_path: Any, spy: DirSyncSpy) -> None:
    """A restore into a new nested target fsyncs each directory it makes."""
    fresh = str(tmp_path / "box2" / "work" / "ckpt")
    doc = restore_latest(store, "r", fresh, lambda kind, reason, **kw: None)
    assert doc is not None and doc["step"] == 5
    assert os.path.isfile(os.path.join(fresh, "checkpoint-5", "shards", "rank0", "model.bin"))
    made = spy.made(str(tmp_path / "box2"))
    assert len(made) >= 6  # box2, work, ckpt, checkpoint-5, shards, rank0 (and the stage)
    assert spy.not_durable(str(tmp_path / "box2"), skip=STAGE_PREFIX) == []


def test_a_many_file_seal_makes_every_name_durable_before_its_manifest(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint of many small files in two directories, some of one size (hashed first,
    put from memory) and some of sizes of their own (hashed while copied), sealed into a
    file:// store by the pool of puts: each file is renamed into place and its directory
    fsynced after that rename and before the MANIFEST that names them (power lost before
    then loses nothing the MANIFEST names). The checkpoint restores whole."""
    root = _store_root(tmp_path)
    store = open_store("file://" + root)
    ckpt = str(tmp_path / "ckpt")
    d = os.path.join(ckpt, "checkpoint-7")
    os.makedirs(os.path.join(d, "shards"))
    files = {f"shards/s{i:03d}.bin": os.urandom(4096) for i in range(120)}  # sizes shared
    files.update({f"t{i:02d}.json": os.urandom(1000 + i) for i in range(30)})  # sizes unique
    for rel, data in files.items():
        with open(os.path.join(d, *rel.split("/")), "wb") as f:
            f.write(data)
    with open(os.path.join(d, "trainer_state.json"), "w") as f:
        f.write('{"global_step": 7, "log_history": []}')
    spy = DirSyncSpy(monkeypatch)
    s = _sealer(store, "r", ckpt, tmp_path)
    assert s.seal_pending() == 1
    step_dir = os.path.join(root, "r", "checkpoints", "7", "e1", "checkpoint-7")
    manifest = os.path.join(root, "r", "checkpoints", "7", "MANIFEST.json")
    assert os.path.isfile(manifest), os.listdir(os.path.dirname(manifest))
    renamed = [p for k, p in spy.events if k == "rename" and p.startswith(step_dir + os.sep)]
    assert len(renamed) == len(files) + 1  # every file (and trainer_state.json) put
    assert spy.unsynced_names(step_dir, before=manifest) == []

    fresh = str(tmp_path / "box2")
    doc = restore_latest(store, "r", fresh, lambda kind, reason, **kw: None)
    assert doc is not None and doc["step"] == 7
    for rel, data in files.items():
        with open(os.path.join(fresh, "checkpoint-7", *rel.split("/")), "rb") as f:
            assert f.read() == data


def test_a_checkpoint_whose_name_restore_would_refuse_is_reported_once_and_never_sealed(
    tmp_path: Any,
) -> None:
    """A CR, a backslash or an escape in a checkpoint's name (its own or a file's inside it):
    restore and `rgt pull` refuse such a name, so sealing it would put in the store a
    checkpoint that never comes back. It gets one usage event naming it by repr, is never
    uploaded, is not retried at every scan, and the good checkpoints around it are sealed."""
    root = _store_root(tmp_path)
    store = open_store("file://" + root)
    ckpt = str(tmp_path / "ckpt")
    os.makedirs(ckpt)
    events: List[Dict[str, Any]] = []
    s = Sealer(
        "names",
        ckpt,
        store,
        str(tmp_path / "stage"),
        epoch=take_epoch(store, "names"),
        event=lambda kind, reason, **kw: events.append(dict(kw, kind=kind, reason=reason)),
        state_path=str(tmp_path / "seq.json"),
    )
    s.load()
    bad = ["step_2\r.pt", "step_3\\x.pt", "step_4/w\x1b[2J.bin"]
    for rel in ["step_1.pt", *bad, "step_5.pt"]:
        path = os.path.join(ckpt, *rel.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as fb:
            fb.write(f"weights of {rel!r}".encode())
    with open(os.path.join(ckpt, "step_4", ".rgt-complete"), "w") as f:
        json.dump({"step": 4}, f)

    assert s.seal_pending() == 2
    for _ in range(3):  # later scans: nothing new, and no new event either
        assert s.seal_pending() == 0
    assert sorted(_manifests(root, "names")) == [1, 5]
    assert _latest(root, "names")["step"] == 5
    refused = [e for e in events if e["kind"] == "unsafe_name"]
    assert sorted(e["path"] for e in refused) == bad
    for e in refused:
        name = e["path"].split("/")[0]
        assert e["klass"] == "usage" and "rename it" in e["remedy"]
        assert f"checkpoint {name!r} is not sealed: the name {e['path']!r}" in e["reason"]
    uploaded = [f for _, _, files in os.walk(os.path.join(root, "names")) for f in files]
    assert not [f for f in uploaded if "\r" in f or "\\" in f or "\x1b" in f]
    # Renamed, it is an ordinary checkpoint again (step 6 > LATEST, so it is sealed).
    os.rename(os.path.join(ckpt, "step_2\r.pt"), os.path.join(ckpt, "step_6.pt"))
    assert s.seal_pending() == 1 and _latest(root, "names")["step"] == 6
    assert len([e for e in events if e["kind"] == "unsafe_name"]) == 3


def _dir_ckpt(ckpt: str, name: str, step: int, files: Dict[str, bytes]) -> str:
    """A complete directory checkpoint ``ckpt/name`` of ``files`` (rgt's marker, ``step``)."""
    path = os.path.join(ckpt, name)
    os.makedirs(path, exist_ok=True)
    for rel, data in files.items():
        with open(os.path.join(path, rel), "wb") as fb:
            fb.write(data)
    with open(os.path.join(path, ".rgt-complete"), "w") as f:
        json.dump({"step": step}, f)
    return path


def _bounded(fn: Callable[[], Any], seconds: float = 20) -> Any:
    """``fn()`` in a thread, failing the test (not hanging it) when it is still running after
    ``seconds``: a seal that reads a FIFO would wait forever."""
    out: List[Any] = []

    def call() -> None:
        try:
            out.append(("ok", fn()))
        except BaseException as e:  # raised again in the test's thread
            out.append(("raised", e))

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds}s (hung)"
    how, value = out[0]
    if how == "raised":
        raise value
    return value


def test_links_fifos_and_sockets_in_a_checkpoint_are_left_out_reported_once_and_never_read(
    tmp_path: Any,
) -> None:
    """A checkpoint dir may hold a symlink (a ``latest`` link, a tokenizer file linked from a
    cache), a FIFO or a socket. The seal never reads one: a FIFO would hang it forever (holding
    the lock the SIGTERM seal needs), a link to a file outside the checkpoint would put that
    file in the store as part of the checkpoint. The regular files are sealed, one usage event
    names what was left out, and a checkpoint after it is sealed too."""
    root = _store_root(tmp_path)
    store = open_store("file://" + root)
    ckpt = str(tmp_path / "ckpt")
    secret = str(tmp_path / "outside.txt")
    with open(secret, "w") as f:
        f.write("not part of any checkpoint")
    d = _dir_ckpt(ckpt, "step_1", 1, {"model.bin": b"w" * 100})
    os.symlink(secret, os.path.join(d, "tokenizer.json"))
    os.symlink("/dev/zero", os.path.join(d, "zero"))
    os.symlink(str(tmp_path), os.path.join(d, "dirlink"))
    os.mkfifo(os.path.join(d, "pipe"))
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(os.path.join(d, "sock"))
    _dir_ckpt(ckpt, "step_2", 2, {"model.bin": b"v" * 100})
    os.symlink("step_2", os.path.join(ckpt, "latest"))  # a link in the checkpoint dir itself
    os.symlink(str(tmp_path), os.path.join(ckpt, "away"))  # and one out of it
    events: List[Dict[str, Any]] = []
    s = _sealer(store, "links", ckpt, tmp_path, events)
    try:
        assert _bounded(s.seal_pending) == 2
        assert _bounded(s.seal_pending) == 0
    finally:
        sock.close()
    doc = _manifests(root, "links")[1]
    assert sorted(f["path"] for f in doc["files"]) == ["step_1/.rgt-complete", "step_1/model.bin"]
    stored = [f for _, _, files in os.walk(os.path.join(root, "links")) for f in files]
    assert not {"tokenizer.json", "zero", "pipe", "sock"} & set(stored)
    top, ev = [e for e in events if e["kind"] == "left_out"]
    assert top["paths"] == ["away"] and "is a symlink out of it" in top["reason"]
    # A link to a checkpoint in the dir loses nothing: said once, at info level.
    (link,) = [e for e in events if e["kind"] == "ckpt_link"]
    assert (link["path"], link["target"], link.get("klass")) == ("latest", "step_2", None), link
    assert ev["klass"] == "usage" and ev["paths"] == [
        "step_1/dirlink",
        "step_1/pipe",
        "step_1/sock",
        "step_1/tokenizer.json",
        "step_1/zero",
    ]
    assert "'step_1/pipe' (a FIFO)" in ev["reason"] and "(a symlink (not followed" in ev["reason"]
    assert _latest(root, "links")["step"] == 2
    assert _manifests(root, "links")[2]["root"] == "step_2"


def test_a_file_swapped_for_a_fifo_after_the_scan_is_not_read(tmp_path: Any) -> None:
    """Between the scan and the read the job may replace a file: the read opens it without
    following a link and without blocking, and finds it is no regular file any more, so the
    seal ends as 'changed while sealed' (retried on the next pass), instead of hanging."""
    root = _store_root(tmp_path)
    store = open_store("file://" + root)
    ckpt = str(tmp_path / "ckpt")
    d = _dir_ckpt(ckpt, "step_1", 1, {"model.bin": b"w" * 100})
    events: List[Dict[str, Any]] = []
    s = _sealer(store, "swap", ckpt, tmp_path, events)
    [cand] = s.scan()
    os.unlink(os.path.join(d, "model.bin"))
    os.mkfifo(os.path.join(d, "model.bin"))
    assert _bounded(lambda: s.seal(cand)) is None
    assert [e["kind"] for e in events] == ["seal_skipped"]
    assert not _manifests(root, "swap")


def test_a_checkpoint_that_fails_for_good_is_reported_once_and_does_not_block_newer_ones(
    tmp_path: Any,
) -> None:
    """Oldest first, a checkpoint the store refuses for good (an object it will never take)
    must not block every newer checkpoint for the rest of the run. Alone, its failure is
    raised (it could as well be the store's state: a full mount); once a newer one is sealed
    after it, it is known to be its own: one permanent event names it, and it is not retried
    while it is unchanged."""
    root = _store_root(tmp_path)
    tried: List[str] = []

    class Refusing(LocalStore):
        """A file:// store that refuses, for good, any object of step_1 (the seam: the store)."""

        def put_file(self, key: str, path: str, *, sha256: Any, size: int) -> Any:
            tried.append(key)
            if "/step_1/" in key:
                raise PermanentStoreError(f"{key}: refused", "it never takes this object")
            return super().put_file(key, path, sha256=sha256, size=size)

    store = Refusing(root)
    ckpt = str(tmp_path / "ckpt")
    _dir_ckpt(ckpt, "step_1", 1, {"model.bin": b"w" * (2 << 20)})
    events: List[Dict[str, Any]] = []
    s = _sealer(store, "stuck", ckpt, tmp_path, events)
    with pytest.raises(PermanentStoreError, match="refused"):
        s.seal_pending()  # step 1 alone: nothing tells its failure from the store's
    assert not [e for e in events if e["kind"] == "seal_failed"]
    _dir_ckpt(ckpt, "step_2", 2, {"model.bin": b"v" * (2 << 20)})
    _dir_ckpt(ckpt, "step_3", 3, {"model.bin": b"u" * (2 << 20)})
    assert s.seal_pending() == 2
    assert sorted(_manifests(root, "stuck")) == [2, 3] and _latest(root, "stuck")["step"] == 3
    attempts = len(tried)
    assert s.seal_pending() == 0 and len(tried) == attempts  # not retried while unchanged
    [ev] = [e for e in events if e["kind"] == "seal_failed"]
    assert ev["klass"] == "permanent" and ev["step"] == 1
    assert "checkpoint step_1 (step 1) cannot be sealed" in ev["reason"]
    assert ev["remedy"] == "it never takes this object"


def test_a_file_rewritten_while_it_is_uploaded_is_a_skipped_seal_not_a_bug(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job rewrites a file (same size) while the file:// store copies it with no hash of
    ours first: the store refuses the copy (IntegrityError), and the seal must read that as
    'changed while sealing' (seal_skipped, the next pass seals the new bytes), not as a bug
    that escapes the pass (it was a seal_bug event and no seal at all)."""
    import onbox.sealing.stores.local as local

    root = _store_root(tmp_path)
    store = open_store("file://" + root)
    ckpt = str(tmp_path / "ckpt")
    d = _dir_ckpt(ckpt, "step_1", 1, {"big.bin": os.urandom(5 << 20)})
    big = os.path.join(d, "big.bin")
    real_copy = local.copy_file  # type: ignore[attr-defined]

    def copy_then_rewrite(f: Any, fd: int, **kw: Any) -> Any:
        out = real_copy(f, fd, **kw)
        if os.fstat(f.fileno()).st_ino == os.stat(big).st_ino:  # the job writes meanwhile
            with open(big, "r+b") as w:
                w.write(b"Z" * 100)
        return out

    monkeypatch.setattr(local, "copy_file", copy_then_rewrite)
    events: List[Dict[str, Any]] = []
    s = _sealer(store, "torn", ckpt, tmp_path, events)
    assert s.seal_pending() == 0
    assert [e["kind"] for e in events] == ["seal_skipped"] and not _manifests(root, "torn")
    monkeypatch.setattr(local, "copy_file", real_copy)
    assert s.seal_pending() == 1
    [f] = [f for f in _manifests(root, "torn")[1]["files"] if f["path"] == "step_1/big.bin"]
    with open(big, "rb") as fb:
        assert f["sha256"] == hashlib.sha256(fb.read()).hexdigest()


@pytest.mark.parametrize("store_is", ["slow", "failing"])
def test_a_seal_with_a_deadline_stops_within_one_checkpoint_and_writes_no_manifest(
    tmp_path: Any, store_is: str
) -> None:
    """The final seal at SIGTERM has a grace to fit in. Inside one checkpoint, no new file and
    no retry starts once it would end past the deadline (a slow store: 1.5 s a put; a failing
    one: retries for 7.5 s), so the seal returns in time; the checkpoint gets no MANIFEST (a
    partial one would be restored as whole), and a later seal with time seals it whole."""
    root = _store_root(tmp_path)
    state = {"store_is": store_is}

    class Hindered(LocalStore):
        parallel_puts = 1

        def put_file(self, key: str, path: str, *, sha256: Any, size: int) -> Any:
            if state["store_is"] == "slow":
                time.sleep(1.5)
            elif state["store_is"] == "failing":
                raise TransientStoreError(f"{key}: the network is away")
            return super().put_file(key, path, sha256=sha256, size=size)

    store = Hindered(root)
    ckpt = str(tmp_path / "ckpt")
    _dir_ckpt(ckpt, "step_1", 1, {f"{n}.bin": b"x" * n for n in (10, 20, 30)})
    events: List[Dict[str, Any]] = []
    s = _sealer(store, "cut", ckpt, tmp_path, events)
    t0 = time.monotonic()
    assert s.seal_pending(t0 + 1.0) == 0
    assert time.monotonic() - t0 < 2.5  # one put in flight ends; none starts after
    assert not _manifests(root, "cut") and s.latest is None
    [ev] = [e for e in events if e["kind"] == "seal_cut"]
    assert "checkpoint step_1 (step 1) was not sealed in the time left" in ev["reason"]
    state["store_is"] = "fine"
    assert s.seal_pending() == 1 and _latest(root, "cut")["step"] == 1


def test_a_rewrite_in_place_that_restores_mtime_during_the_upload_is_not_sealed(
    tmp_path: Any,
) -> None:
    """A store that hashes while it sends (S3) gets no sha256 of ours to check against: the
    seal tells a file rewritten under the upload by its stat before and after. ``cp -p``,
    ``rsync -t`` or ``os.utime`` put the mtime back, same size, same inode; only ctime tells.
    The torn object (half old bytes, half new) must not be sealed: seal_skipped, and the next
    pass seals the new bytes whole."""
    root = _store_root(tmp_path)
    state = {"rewrite": True}

    class HashingWhileSending(LocalStore):
        """Reads the source in two halves, the way a hash-while-sending upload streams it; the
        job rewrites the second half in between (the seam: the moment of the job's write)."""

        def put_file(self, key: str, path: str, *, sha256: Any, size: int) -> Any:
            with open(path, "rb", buffering=0) as f:
                data = f.read(size // 2)
                if state["rewrite"] and path.endswith("w.bin"):
                    st = os.stat(path)
                    with open(path, "r+b") as w:
                        w.seek(size // 2)
                        w.write(b"N" * (size - size // 2))
                    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
                data += f.read()
            info = super().put_bytes(key, data)
            return ObjectInfo(key, len(data), info.sha256)

    store = HashingWhileSending(root)
    ckpt = str(tmp_path / "ckpt")
    d = _dir_ckpt(ckpt, "step_1", 1, {"w.bin": b"O" * 1000})
    time.sleep(0.05)  # the kernel's timestamps tick coarsely (a jiffy): the rewrite is later
    events: List[Dict[str, Any]] = []
    s = _sealer(store, "utime", ckpt, tmp_path, events)
    assert s.seal_pending() == 0
    assert [e["kind"] for e in events] == ["seal_skipped"] and not _manifests(root, "utime")
    state["rewrite"] = False
    assert s.seal_pending() == 1
    [f] = [f for f in _manifests(root, "utime")[1]["files"] if f["path"] == "step_1/w.bin"]
    with open(os.path.join(d, "w.bin"), "rb") as fb:
        assert (
            f["sha256"]
            == hashlib.sha256(fb.read()).hexdigest()
            == hashlib.sha256(b"O" * 500 + b"N" * 500).hexdigest()
        )


def test_a_checkpoint_with_a_name_that_is_not_utf8_is_reported_once_and_never_sealed(
    tmp_path: Any,
) -> None:
    """POSIX names are bytes; a store's keys are UTF-8 text (S3 raised UnicodeEncodeError on
    such a name, an error of no store's, every pass). A checkpoint holding such a name, or
    named so, gets one unsafe_name event and is never uploaded, on every store alike; the
    others are sealed."""
    root = _store_root(tmp_path)
    store = open_store("file://" + root)
    ckpt = str(tmp_path / "ckpt")
    d = _dir_ckpt(ckpt, "step_1", 1, {"model.bin": b"w" * 10})
    with open(os.fsencode(d) + b"/vocab\xff.txt", "wb") as fb:
        fb.write(b"bytes")
    with open(os.fsencode(ckpt) + b"/step_2\xfe.pt", "wb") as fb:
        fb.write(b"weights")
    _dir_ckpt(ckpt, "step_3", 3, {"model.bin": b"v" * 10})
    events: List[Dict[str, Any]] = []
    s = _sealer(store, "bytes", ckpt, tmp_path, events)
    assert s.seal_pending() == 1
    assert s.seal_pending() == 0
    assert sorted(_manifests(root, "bytes")) == [3]
    refused = [e for e in events if e["kind"] == "unsafe_name"]
    assert sorted(e["path"] for e in refused) == ["step_1/vocab\udcff.txt", "step_2\udcfe.pt"]
    for e in refused:
        assert e["klass"] == "usage" and "is refused: it is not UTF-8" in e["reason"]
        assert "every store's keys are UTF-8 text" in e["reason"]


def test_of_two_checkpoints_with_one_step_only_the_sealed_one_counts(tmp_path: Any) -> None:
    """``checkpoint-100/`` and ``x_step100.pt`` name the same step: one is sealed, and the
    other must not be counted as sealed too (it is in no MANIFEST)."""
    root = _store_root(tmp_path)
    store = open_store("file://" + root)
    ckpt = str(tmp_path / "ckpt")
    _dir_ckpt(ckpt, "checkpoint-100", 100, {"model.bin": b"w" * 10})
    with open(os.path.join(ckpt, "x_step100.pt"), "wb") as fb:
        fb.write(b"weights")
    s = _sealer(store, "twice", ckpt, tmp_path)
    assert s.seal_pending() == 1
    assert _manifests(root, "twice")[100]["root"] == "checkpoint-100"


def test_a_marker_that_is_a_symlink_or_nested_past_the_parser_makes_no_checkpoint(
    tmp_path: Any,
) -> None:
    """A directory whose .rgt-complete is a symlink (to a marker outside it) is not complete:
    the link is never sealed, so the checkpoint would come back without its marker; one whose
    marker is JSON nested past the parser's depth is not either, and does not stop the scan
    (RecursionError ended every pass). The complete one beside them is sealed."""
    root = _store_root(tmp_path)
    ckpt = str(tmp_path / "ckpt")
    linked = _dir_ckpt(ckpt, "step_1", 1, {"model.bin": b"a" * 4096})
    os.replace(os.path.join(linked, ".rgt-complete"), str(tmp_path / "elsewhere.json"))
    os.symlink(str(tmp_path / "elsewhere.json"), os.path.join(linked, ".rgt-complete"))
    nested = _dir_ckpt(ckpt, "step_2", 2, {"model.bin": b"b" * 4096})
    with open(os.path.join(nested, ".rgt-complete"), "w") as f:
        f.write("[" * 200_000)
    _dir_ckpt(ckpt, "step_3", 3, {"model.bin": b"c" * 4096})
    s = _sealer(open_store("file://" + root), "marks", ckpt, tmp_path)
    assert s.seal_pending() == 1
    assert sorted(_manifests(root, "marks")) == [3]


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_corrupt_checkpoint_in_the_store_is_quarantined_and_the_previous_used(
    tmp_path: Any, damage: str
) -> None:
    root = _store_root(tmp_path)
    store = open_store("file://" + root)
    ckpt = str(tmp_path / "ckpt")
    os.makedirs(ckpt)
    s = Sealer(
        "r",
        ckpt,
        store,
        str(tmp_path / "stage"),
        epoch=take_epoch(store, "r"),
        event=lambda *a, **k: None,
        state_path=str(tmp_path / "seq.json"),
    )
    s.load()
    for step in (10, 20):
        with open(os.path.join(ckpt, f"step_{step}.pt"), "wb") as f:
            f.write(os.urandom(4096))
        s.seal_pending()
    with open(os.path.join(root, "r", "checkpoints", "20", "MANIFEST.json")) as f:
        victim = os.path.join(root, json.load(f)["files"][0]["key"])
    with open(victim, "r+b") as f:
        if damage == "truncate":
            f.truncate(1000)
        else:
            f.seek(4095)
            last = f.read(1)
            f.seek(4095)
            f.write(bytes([last[0] ^ 1]))
    fresh = str(tmp_path / "fresh-box")
    os.makedirs(fresh)
    events: List[Dict[str, Any]] = []
    doc = restore_latest(
        store,
        "r",
        fresh,
        lambda kind, reason, **kw: events.append({"kind": kind, "reason": reason, **kw}),
    )
    assert doc is not None and doc["step"] == 10
    assert os.path.exists(os.path.join(fresh, "step_10.pt"))
    assert not os.path.exists(os.path.join(fresh, "step_20.pt"))  # nothing torn put in place
    assert os.path.exists(os.path.join(root, "r", "quarantine", "20.json"))
    assert os.path.exists(victim)  # kept for a person to look at
    assert [e["kind"] for e in events] == ["quarantined", "restored"]
    assert _latest(root, "r")["step"] == 20  # LATEST is not rewritten backwards


def _tmpfs(path: str, opts: str) -> bool:
    os.makedirs(path, exist_ok=True)
    return (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", path], capture_output=True
        ).returncode
        == 0
    )


@pytest.mark.parametrize(
    "opts,kind",
    [("size=4m,nr_inodes=1000", "disk_full"), ("size=64m,nr_inodes=12", "inodes_exhausted")],
)
def test_disk_or_inodes_running_out_while_checkpointing(
    cli: Cli, tmp_path: Any, opts: str, kind: str
) -> None:
    root = _store_root(tmp_path)
    small = str(tmp_path / "small")
    require(_tmpfs(small, opts), "root, to mount a small tmpfs")
    try:
        job = os.path.join(cli.home, "fill.toml")
        with open(job, "w") as f:
            f.write(
                f'command = {json.dumps([*WRITER, "fill"])}\nstore = "file://{root}"\n'
                f'[checkpoint]\ndir = "{small}"\n[restart]\nmax_error_restarts = 0\n'
            )
        cli("start", job, "--name", "s7", check=True)
        st = cli.wait_for(
            "s7",
            lambda s: s["state"] == "FAILED" and not s["agent"]["alive"],
            timeout=60,
            what="FAILED and the agent gone",
        )
        assert st["last_exit"]["kind"] == kind, st["last_exit"]
        time.sleep(1)
        for doc in _manifests(root, "s7").values():  # what was sealed is whole
            assert doc["files"][0]["size"] > (1 << 20)
        if _manifests(root, "s7"):
            _check_invariants(root, "s7")
    finally:
        cli("stop", "s7", "--grace", "0")
        subprocess.run(["umount", "-l", small])


def test_fresh_box_resumes_a_real_pytorch_training_from_the_sealed_step(
    cli: Cli, tmp_path: Any
) -> None:
    require(__import__("importlib").util.find_spec("torch") is not None, "torch")
    root = _store_root(tmp_path)
    example = os.path.join(ROOT, "examples", "train_tiny.py")
    args = ["--steps", "80", "--ckpt-every", "10", "--sleep", "0.05"]
    cli(
        "start",
        "--name",
        "fb",
        "--store",
        "file://" + root,
        "--",
        sys.executable,
        example,
        *args,
        check=True,
    )
    wait(
        lambda: (
            os.path.exists(os.path.join(root, "fb", "LATEST.json"))
            and _latest(root, "fb")["step"] >= 20
        ),
        120,
        "a sealed step >= 20",
    )
    cli("stop", "fb", "--grace", "1", check=True)
    sealed = _latest(root, "fb")["step"]
    # The box is gone: its run directory and checkpoints with it.
    subprocess.run(["rm", "-rf", os.path.join(cli.home, "runs")], check=True)
    cli(
        "start",
        "--name",
        "fb",
        "--store",
        "file://" + root,
        "--",
        sys.executable,
        example,
        *args,
        check=True,
    )
    cli.wait_state("fb", "SUCCEEDED", timeout=240)
    out = cli("logs", "fb", check=True).stdout
    assert f"resumed from step_{sealed}.pt at step {sealed}" in out
    first = re.search(r"^step (\d+) ", out, re.M)
    assert first is not None and int(first.group(1)) == sealed + 1  # the counter continues
    assert "restored" in [e["kind"] for e in cli.events("fb")]
    _check_invariants(root, "fb")


@pytest.mark.parametrize(
    "url,field",
    [
        ("s3:/bucket", "store"),
        ("s3://", "store"),
        ("s3://Bad_Bucket/x", "store"),
        ("ftp://host/x", "store"),
        ("file://relative/path", "store"),
        ("hf://onlyuser", "store"),
        ("file:///x/../y", "store"),
    ],
)
def test_malformed_store_urls_start_nothing(cli: Cli, url: str, field: str) -> None:
    p = cli("start", "--name", "bad", "--store", url, "--", "true")
    assert p.returncode == 2 and field in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert not os.path.exists(os.path.join(cli.home, "runs", "bad", "spec.json"))


def test_a_read_only_durable_dir_fails_the_preflight(cli: Cli, tmp_path: Any) -> None:
    ro = str(tmp_path / "ro")
    require(_tmpfs(ro, "ro,size=1m"), "root, to mount a read-only tmpfs")
    try:
        p = cli("start", "--name", "rodur", "--store", "file://" + ro, "--", "true")
        assert p.returncode == 14, (p.stdout, p.stderr)
        assert "store preflight failed at 'create the run directory'" in p.stderr
        assert "read-only" in p.stderr.lower()
        assert not os.path.exists(os.path.join(cli.home, "runs", "rodur", "state.json"))
    finally:
        subprocess.run(["umount", ro])


def test_sync_restore_and_checkpoints_commands(cli: Cli, tmp_path: Any) -> None:
    root = _store_root(tmp_path)
    cli.env["RGT_AGENT_RESPAWN_DELAY"] = "1000"
    cli(
        "start",
        "--name",
        "cmd",
        "--store",
        "file://" + root,
        "--",
        *WRITER,
        "on_signal",
        "0.1",
        check=True,
    )
    st = cli.wait_state("cmd", "STARTING", "RUNNING")
    cli.wait_output("cmd", "ready")  # its USR2 handler is in place
    os.kill(st["pid"], signal.SIGUSR2)
    wait(lambda: "wrote step_1.pt" in _text(st["log"]), 30, "step 1 written")
    p = cli("sync", "cmd", check=True)  # a live agent seals on request, and says when done
    assert "LATEST is step 1" in p.stdout
    os.kill(st["agent"]["pid"], signal.SIGKILL)  # no agent: sync seals from the command itself
    os.kill(st["pid"], signal.SIGUSR2)
    wait(lambda: "wrote step_2.pt" in _text(st["log"]), 30, "step 2 written")
    assert "LATEST is step 2" in cli("sync", "cmd", check=True).stdout
    rows = json.loads(
        cli("checkpoints", "--store", f"file://{root}/cmd", "--json", check=True).stdout
    )
    assert [(r["step"], r["verified"], r["latest"]) for r in rows] == [
        (1, True, False),
        (2, True, True),
    ]
    dest = str(tmp_path / "restored")
    out = cli(
        "restore", "--store", f"file://{root}", "--name", "cmd", "--to", dest, check=True
    ).stdout
    assert out.strip().endswith(os.path.join(dest, "step_2.pt"))
    with open(os.path.join(dest, "step_2.pt"), "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == _wrote(cli, "cmd")["step_2.pt"][0]
    p = cli("restore", "--store", f"file://{root}", "--to", dest)  # the root read as a run
    assert p.returncode == 8 and "has no sealed checkpoint" in p.stderr
    cli("stop", "cmd", "--grace", "0", check=True)


def test_a_low_disk_frees_only_sealed_local_copies_oldest_first(tmp_path: Any) -> None:
    small = str(tmp_path / "small")
    require(_tmpfs(small, "size=4m"), "root, to mount a small tmpfs")
    try:
        store = open_store("file://" + _store_root(tmp_path))
        events: List[str] = []
        s = Sealer(
            "r",
            small,
            store,
            str(tmp_path / "stage"),
            epoch=take_epoch(store, "r"),
            keep=5,
            event=lambda kind, reason, **kw: events.append(kind),
            state_path=str(tmp_path / "seq.json"),
        )
        s.load()
        for step in (1, 2, 3):  # about 3.9 of 4 MiB: under 5 % free once the last is written
            with open(os.path.join(small, f"step_{step}.pt"), "wb") as f:
                f.write(os.urandom(1300 << 10))
        s.seal_pending()
        left = sorted(os.listdir(small))
        assert "step_3.pt" in left  # the newest sealed copy stays
        assert "step_1.pt" not in left and "freed_local" in events
        assert sorted(s.manifests) == [1, 2, 3]  # all sealed before anything was freed
    finally:
        subprocess.run(["umount", "-l", small])


# A job that rewrites one file in place, and before the next rewrite waits (60 s at most) until
# the sealer has sealed the last one: a rewrite sooner than the sealer can stage the file loses
# that version by nature (the job wrote over it), and a loaded machine can make the sealer that
# slow; what is checked is that each version it had time for is a sealed step of its own.
TORCH_INPLACE = """
import glob, hashlib, os, sys, time, torch
torch.manual_seed(0)
model = torch.nn.Linear(256, 256)
sealed = os.path.join(sys.argv[1], "*", "MANIFEST.json")
saves = 0
for step in range(1, 41):
    with torch.no_grad():
        model.weight.add_(0.01)
    if step % 5 == 0:  # the common naive pattern: one file, rewritten in place
        torch.save({"step": step, "model": model.state_dict()}, "ckpt.pt")
        with open("ckpt.pt", "rb") as f:
            print("saved", step, hashlib.sha256(f.read()).hexdigest(), flush=True)
        saves += 1
        deadline = time.monotonic() + 60
        while len(glob.glob(sealed)) < saves and time.monotonic() < deadline:
            time.sleep(0.05)
    time.sleep(0.1)
"""


def test_a_plain_torch_save_in_place_script_gets_every_checkpoint_sealed(
    cli: Cli, tmp_path: Any
) -> None:
    require(__import__("importlib").util.find_spec("torch") is not None, "torch")
    root = _store_root(tmp_path)
    work = str(tmp_path / "work")
    os.makedirs(work)
    script = os.path.join(work, "train.py")
    with open(script, "w") as f:
        f.write(TORCH_INPLACE)
    job = os.path.join(work, "job.toml")
    argv = [sys.executable, script, os.path.join(root, "tp", "checkpoints")]  # where it waits
    with open(job, "w") as f:  # keep them all, to compare every one with what the job saved
        f.write(
            f'command = {json.dumps(argv)}\nstore = "file://{root}"\n'
            '[checkpoint]\ndir = "."\nkeep = 20\n'
        )
    cli("start", job, "--name", "tp", check=True)
    cli.wait_state("tp", "SUCCEEDED", timeout=120)
    saved = re.findall(r"saved (\d+) ([0-9a-f]{64})", cli("logs", "tp", check=True).stdout)
    assert len(saved) == 8
    sealed = {d["files"][0]["sha256"] for d in _manifests(root, "tp").values()}
    assert sealed == {sha for _, sha in saved}  # every complete one, and nothing else
    for doc in _manifests(root, "tp").values():  # and each loads as torch would load it
        import torch

        state = torch.load(os.path.join(root, doc["files"][0]["key"]), weights_only=True)
        assert isinstance(state["step"], int)
    _check_invariants(root, "tp")


def test_the_job_is_asked_to_checkpoint_on_a_timer(cli: Cli, tmp_path: Any) -> None:
    root = _store_root(tmp_path)
    script = os.path.join(cli.home, "on_request.py")
    with open(script, "w") as f:
        f.write(
            "import os, time\n"
            "req = os.path.join(os.environ['RGT_RUN_DIR'], 'checkpoint.request')\n"
            "ck = os.environ['RGT_CKPT_DIR']\n"
            "n = 0\n"
            "while n < 3:\n"
            "    if os.path.exists(req):\n"
            "        n += 1\n"
            "        with open(os.path.join(ck, f'step_{n}.pt.tmp'), 'wb') as f:\n"
            "            f.write(os.urandom(1000))\n"
            "        tmp = os.path.join(ck, f'step_{n}.pt.tmp')\n"
            "        os.replace(tmp, os.path.join(ck, f'step_{n}.pt'))\n"
            "        os.unlink(req)\n"
            "    time.sleep(0.05)\n"
        )
    job = os.path.join(cli.home, "timer.toml")
    with open(job, "w") as f:
        f.write(
            f'command = ["python3", "{script}"]\nstore = "file://{root}"\n'
            '[checkpoint]\ntrigger = "file"\ninterval = "1s"\nscan = "0.5s"\n'
        )
    cli("start", job, "--name", "tm", check=True)
    cli.wait_state("tm", "SUCCEEDED", timeout=60)
    asked = [e for e in cli.events("tm") if e["kind"] == "checkpoint_asked"]
    assert len(asked) >= 3 and all("timer" in e["reason"] for e in asked)
    assert _latest(root, "tm")["step"] == 3


def test_a_pinned_checkpoint_outlives_pruning(cli: Cli, tmp_path: Any) -> None:
    root = _store_root(tmp_path)
    store = open_store("file://" + root)
    ckpt = str(tmp_path / "ckpt")
    os.makedirs(ckpt)
    s = Sealer(
        "r",
        ckpt,
        store,
        str(tmp_path / "stage"),
        epoch=take_epoch(store, "r"),
        keep=2,
        event=lambda *a, **k: None,
        state_path=str(tmp_path / "seq.json"),
    )
    s.load()
    with open(os.path.join(ckpt, "step_1.pt"), "wb") as f:
        f.write(os.urandom(100))
    s.seal_pending()
    p = cli("checkpoints", "--store", f"file://{root}/r", "--pin", "1", "--json", check=True)
    assert json.loads(p.stdout)[0]["pinned"] is True
    assert cli("checkpoints", "--store", f"file://{root}/r", "--pin", "7").returncode == 8
    for step in (2, 3, 4):
        with open(os.path.join(ckpt, f"step_{step}.pt"), "wb") as f:
            f.write(os.urandom(100))
        s.seal_pending()
    assert sorted(_manifests(root, "r")) == [1, 3, 4]  # keep 2, plus the pinned one
    cli("checkpoints", "--store", f"file://{root}/r", "--unpin", "1", check=True)
    with open(os.path.join(ckpt, "step_5.pt"), "wb") as f:
        f.write(os.urandom(100))
    s.seal_pending()
    assert sorted(_manifests(root, "r")) == [4, 5]


def test_kill9_of_the_agent_mid_copy_to_a_durable_dir(cli: Cli, tmp_path: Any) -> None:
    root = _store_root(tmp_path)
    cli.env["RGT_AGENT_RESPAWN_DELAY"] = "1000"
    job = os.path.join(cli.home, "big.toml")
    with open(job, "w") as f:
        f.write(
            f"command = {json.dumps([*WRITER, 'on_signal', '700'])}\n"
            f'store = "file://{root}"\n[checkpoint]\ntrigger = "signal:USR2"\n'
        )
    cli("start", job, "--name", "kd", check=True)
    st = cli.wait_state("kd", "STARTING", "RUNNING")
    cli.wait_output("kd", "ready")  # its USR2 handler is in place
    os.kill(st["pid"], signal.SIGUSR2)

    def copying() -> bool:
        for _, _, files in os.walk(os.path.join(root, "kd")):
            if any(".rgt-tmp." in n for n in files):
                return True
        return False

    wait(copying, 120, "the copy into the store to begin")
    os.kill(st["agent"]["pid"], signal.SIGKILL)
    time.sleep(0.3)
    for dirpath, _, files in os.walk(os.path.join(root, "kd", "checkpoints")):
        assert "step_1.pt" not in files, dirpath  # under its final name (any epoch's prefix)
    assert not os.path.exists(os.path.join(root, "kd", "LATEST.json"))
    cli("start", "--name", "kd", check=True)
    wait(
        lambda: os.path.exists(os.path.join(root, "kd", "LATEST.json")),
        120,
        "the next agent to seal step 1",
    )
    _check_invariants(root, "kd")  # the dead agent's temporary file is gone too
    assert _latest(root, "kd")["step"] == 1
    assert "uploads_aborted" in [e["kind"] for e in cli.events("kd")]
    cli("stop", "kd", "--grace", "1", check=True)
