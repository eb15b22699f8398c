"""The training-side API (onbox.train) with real PyTorch, real writer processes, real signals,
a real full tmpfs and a real 64 MiB /dev/shm.

What a user relies on: a save restores exactly what was saved; loading never runs a pickle that
is not plain data and never accepts a truncated or altered file; a background write that is
killed never leaves a checkpoint that loads, and one that fails raises in the training loop at
its next call; the agent's requests and a preemption are heard.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any, Dict, Iterator, List, Tuple

import pytest

from onbox.common.durable import sha256_file
from onbox.train import Checkpointer, CheckpointError, CheckpointWriteFailed, ckptdir
from tests.conftest import ROOT, require

# Imported only where installed, so that a missing one is the fixture's skip (or, under CI=true,
# its failure) below and not a collection error.
_MISSING = [m for m in ("torch", "numpy") if importlib.util.find_spec(m) is None]
if not _MISSING:
    import numpy as np
    import torch


@pytest.fixture(autouse=True)
def _needs_torch() -> None:
    require(not _MISSING, f"{', '.join(_MISSING)} (pip install -e '.[train]' torch==2.13.0)")


def _objects(seed: int = 0, width: int = 64) -> Dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3)
    return {"model": model, "optimizer": opt, "scheduler": sched}


def _train(objs: Dict[str, Any], steps: int) -> None:
    for _ in range(steps):
        x = torch.randn(8, objs["model"][0].in_features) * (1 + random.random())
        loss = objs["model"](x).pow(2).mean() * float(np.random.rand())
        objs["optimizer"].zero_grad()
        loss.backward()
        objs["optimizer"].step()
        objs["scheduler"].step()


def _fingerprint(objs: Dict[str, Any]) -> Tuple[Any, ...]:
    params = [p.detach().clone() for p in objs["model"].parameters()]
    return (
        [p.numpy().tobytes() for p in params],
        repr(objs["optimizer"].state_dict()["param_groups"]),
        objs["scheduler"].state_dict()["last_epoch"],
        torch.rand(3).tolist(),
        random.random(),
        float(np.random.rand()),
    )


@pytest.mark.parametrize("mode", ["sync", "async", "async-safetensors"])
def test_a_save_resumes_exactly(tmp_path: Any, mode: str) -> None:
    """Train 5 steps, save, train 5 more: a fresh process state loaded from the save and
    trained the same 5 steps ends bitwise equal, RNGs included."""
    d = str(tmp_path / "ck")
    random.seed(1)
    np.random.seed(2)
    objs = _objects()
    _train(objs, 5)
    with Checkpointer(
        d,
        async_save=mode != "sync",
        safetensors=mode.endswith("safetensors"),
        handle_signals=False,
        **objs,
    ) as ck:
        saved = ck.save(5, extra={"epoch": 3, "note": "x", "t": torch.arange(4)})
        if mode == "sync":  # written when save returns: its path
            assert saved == os.path.join(d, "step_5")
            assert ckptdir.complete(d) == [(5, saved)]
        else:  # staged when save returns; the write goes on in the background
            assert saved is None
    assert ckptdir.complete(d) == [(5, os.path.join(d, "step_5"))]  # whole once closed
    _train(objs, 5)
    expected = _fingerprint(objs)

    random.seed(99)  # whatever the new process's generators hold, load replaces it
    np.random.seed(99)
    fresh = _objects(seed=42)
    ck = Checkpointer(d, handle_signals=False, **fresh)
    assert ck.load() == 5
    assert ck.extra["epoch"] == 3 and ck.extra["note"] == "x"
    assert torch.equal(ck.extra["t"], torch.arange(4))
    _train(fresh, 5)
    assert _fingerprint(fresh) == expected
    names = sorted(os.listdir(os.path.join(d, "step_5")))
    assert ("model.safetensors" in names) == mode.endswith("safetensors")


def test_nothing_to_resume_returns_step_zero(tmp_path: Any) -> None:
    ck = Checkpointer(str(tmp_path / "empty"), handle_signals=False, **_objects())
    assert ck.load() == 0 and ck.latest() is None


def _saved(tmp_path: Any, steps: Tuple[int, ...] = (1, 2)) -> str:
    d = str(tmp_path / "ck")
    ck = Checkpointer(d, handle_signals=False, keep=5, **_objects())
    for s in steps:
        ck.save(s)
    return d


def test_latest_names_the_checkpoint_load_uses(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """latest() took the newest name: a link out of the dir, or a cut-off newest, that load
    skips. It now applies load's rule (sizes, not sha256) and names what load then loads."""
    monkeypatch.delenv("RGT_RESUME_FROM", raising=False)
    d = _saved(tmp_path, (1, 2, 3))
    elsewhere = str(tmp_path / "elsewhere")
    Checkpointer(elsewhere, handle_signals=False, **_objects()).save(9)
    os.symlink(os.path.join(elsewhere, "step_9"), os.path.join(d, "step_9"))
    with open(os.path.join(d, "step_3", ckptdir.STATE), "r+b") as f:
        f.truncate(10)
    ck = Checkpointer(d, handle_signals=False, **_objects())
    assert ck.latest() == os.path.join(d, "step_2")
    assert ck.load() == 2
    monkeypatch.setenv("RGT_RESUME_FROM", os.path.join(d, "step_1", ckptdir.STATE))
    assert ck.latest() == os.path.join(d, "step_1") and ck.load() == 1


def test_a_pickle_that_is_not_plain_data_is_refused_and_never_run(tmp_path: Any) -> None:
    """A state.pt carrying an arbitrary object (with a correct marker, so only the unpickler
    can catch it) is refused; its payload never runs."""
    d = _saved(tmp_path, (1,))
    step = os.path.join(d, "step_1")
    canary = str(tmp_path / "payload-ran")
    evil = {"format": ckptdir.FORMAT, "step": 1, "objects": {}, "x": _Payload(canary)}
    torch.save(evil, os.path.join(step, ckptdir.STATE))
    _remark(step)
    ck = Checkpointer(d, handle_signals=False, **_objects())
    with pytest.raises(CheckpointError, match="weights-only"):
        ck.load(step)
    assert not os.path.exists(canary)


class _Payload:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Tuple[Any, ...]:
        return (open, (self.path, "w"))


def _remark(step_dir: str) -> None:
    """Rewrite the marker to match the files as they are now (a forger's marker)."""
    from onbox.common.durable import sha256_file

    path = os.path.join(step_dir, ckptdir.MARKER)
    with open(path) as f:
        marker = json.load(f)
    for name in marker["files"]:
        sha, size = sha256_file(os.path.join(step_dir, name))
        marker["files"][name] = {"size": size, "sha256": sha}
    with open(path, "w") as f:
        json.dump(marker, f)


@pytest.mark.parametrize("damage", ["truncated", "bit-flipped"])
def test_a_damaged_checkpoint_is_refused_by_path_and_skipped_by_scan(
    tmp_path: Any, damage: str, capfd: pytest.CaptureFixture[str]
) -> None:
    d = _saved(tmp_path)
    target = os.path.join(d, "step_2", ckptdir.STATE)
    size = os.path.getsize(target)
    with open(target, "r+b") as f:
        if damage == "truncated":
            f.truncate(size // 2)
        else:
            f.seek(size // 2)
            b = f.read(1)
            f.seek(size // 2)
            f.write(bytes([b[0] ^ 0x10]))
    ck = Checkpointer(d, handle_signals=False, **_objects())
    with pytest.raises(CheckpointError, match="truncated|sha256"):
        ck.load(os.path.join(d, "step_2"))
    # Scanning on its own, the damaged newest one is skipped, loudly, for the one before.
    assert ck.load() == 1
    assert "skipping checkpoint step 2" in capfd.readouterr().err


def test_the_marker_hashes_the_bytes_on_disk_and_stock_torch_loads_them(tmp_path: Any) -> None:
    # The state file is hashed as it is written (no read-back) and without torch's zip CRC32s:
    # the marker must still name exactly the bytes on disk, records larger than the hashing
    # piece included, and a plain torch.load (not rgt's reader) must still read the file.
    big = torch.arange(3 * (1 << 20) + 7, dtype=torch.float32)  # 12 MiB: many pieces, a tail
    path, nbytes = ckptdir.write(str(tmp_path), 5, {"big": big, "small": torch.ones(3)})
    with open(os.path.join(path, ckptdir.MARKER)) as f:
        marker = json.load(f)
    on_disk = os.path.join(path, ckptdir.STATE)
    sha, size = sha256_file(on_disk)
    assert marker["files"][ckptdir.STATE] == {"size": size, "sha256": sha}
    assert nbytes == size == os.path.getsize(on_disk)
    loaded = torch.load(on_disk, weights_only=True)
    assert torch.equal(loaded["big"], big) and torch.equal(loaded["small"], torch.ones(3))


def test_a_missing_marker_means_no_checkpoint(tmp_path: Any) -> None:
    d = _saved(tmp_path)
    os.unlink(os.path.join(d, "step_2", ckptdir.MARKER))
    ck = Checkpointer(d, handle_signals=False, **_objects())
    assert ck.load() == 1
    with pytest.raises(CheckpointError, match="not a complete"):
        ck.load(os.path.join(d, "step_2"))


def test_loading_into_different_objects_names_what_is_missing(tmp_path: Any) -> None:
    d = _saved(tmp_path)
    objs = _objects()
    ck = Checkpointer(d, handle_signals=False, model=objs["model"], ema=objs["scheduler"])
    with pytest.raises(CheckpointError, match="no state for ema"):
        ck.load()


def _big_objects(mib: int) -> Dict[str, Any]:
    n = mib * (1 << 20) // 4 // 2
    model = torch.nn.Linear(1, 1)
    model.big = torch.nn.Parameter(torch.randn(n))
    model.big2 = torch.nn.Parameter(torch.randn(n))
    return {"model": model}


def test_a_killed_background_write_never_leaves_a_checkpoint_that_loads(tmp_path: Any) -> None:
    """SIGKILL the writer at random moments of a 256 MiB write: afterwards the step either
    does not exist or verifies and loads; the loop hears of the kill; the next save works."""
    d = str(tmp_path / "ck")
    objs = _big_objects(256)
    ck = Checkpointer(d, async_save=True, handle_signals=False, keep=10, **objs)
    rnd = random.Random()
    outcomes = []
    for step in range(1, 5):
        ck.save(step)
        assert ck._writer is not None and ck._writer.proc is not None
        time.sleep(rnd.uniform(0.0, 1.5))
        os.kill(ck._writer.proc.pid, signal.SIGKILL)
        try:
            ck.wait()
            outcomes.append("finished first")
        except CheckpointWriteFailed as e:
            assert "died" in str(e)
            outcomes.append("killed")
        for name in os.listdir(d) if os.path.isdir(d) else []:
            if not name.startswith("."):  # a final name: whole, or it would not be there
                ckptdir.verify(os.path.join(d, name))
    assert "killed" in outcomes
    ck.save(9)
    ck.wait()
    ckptdir.verify(os.path.join(d, "step_9"))
    ck.close()
    fresh = Checkpointer(d, handle_signals=False, **_big_objects(1))
    with contextlib.suppress(RuntimeError):  # shapes differ: what matters is it verified
        fresh.load()


@contextlib.contextmanager
def _tmpfs(path: str, size: str) -> Iterator[str]:
    require(os.geteuid() == 0, "root (to mount a small tmpfs)")
    os.makedirs(path, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], check=True)


def test_a_failed_background_write_raises_in_the_loop_at_its_next_call(tmp_path: Any) -> None:
    """The checkpoint disk fills up during the write: the next should_checkpoint() raises
    CheckpointWriteFailed naming the cause; nothing sits under a final name; the previous
    checkpoint still loads."""
    with _tmpfs(str(tmp_path / "small"), "6m") as d:
        ck = Checkpointer(d, async_save=True, handle_signals=False, **_big_objects(1))
        ck.save(1)
        ck.wait()
        ck.objects = _big_objects(8)  # now the state no longer fits
        ck.save(2)
        deadline = time.monotonic() + 60
        with pytest.raises(CheckpointWriteFailed, match="space"):
            while time.monotonic() < deadline:
                ck.should_checkpoint(2)
                time.sleep(0.05)
        assert sorted(os.listdir(d)) == ["step_1"]
        ckptdir.verify(os.path.join(d, "step_1"))
        ck.should_checkpoint(3)  # raised once, not forever
        ck.close()


def test_async_save_works_where_dev_shm_is_64_mib(tmp_path: Any) -> None:
    """Inside a mount namespace whose /dev/shm is a 64 MiB tmpfs (a Docker default), a
    200 MiB state is saved in the background and loads."""
    require(os.geteuid() == 0, "root (unshare -m)")
    d = str(tmp_path / "ck")
    script = textwrap.dedent(
        f"""
        import os, sys, torch
        sys.path.insert(0, {ROOT!r})
        assert os.statvfs('/dev/shm').f_blocks * os.statvfs('/dev/shm').f_frsize <= 64 << 20
        from onbox.train import Checkpointer
        m = torch.nn.Linear(1, 1)
        m.big = torch.nn.Parameter(torch.randn(50 << 20))
        ck = Checkpointer({d!r}, async_save=True, handle_signals=False, model=m)
        ck.save(1)
        ck.close()
        want = m.big.detach().clone()
        torch.nn.init.zeros_(m.big)
        assert Checkpointer({d!r}, handle_signals=False, model=m).load() == 1
        assert torch.equal(m.big.detach(), want)
        print("ok")
        """
    )
    p = subprocess.run(
        [
            "unshare",
            "-m",
            "--propagation",
            "private",
            "sh",
            "-c",
            'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$0" -c "$1"',
            sys.executable,
            script,
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr[-3000:]


def test_requests_signals_and_interval_make_a_checkpoint_due(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    monkeypatch.setenv("RGT_RUN_DIR", run_dir)
    monkeypatch.setenv("RGT_CKPT_TRIGGER", "file")
    ck = Checkpointer(str(tmp_path / "ck"), handle_signals=False, **_objects())
    assert not ck.should_checkpoint(1)
    request = os.path.join(run_dir, "checkpoint.request")
    with open(request, "w") as f:
        json.dump({"why": "timer"}, f)
    assert ck.should_checkpoint(1)
    ck.save(1)
    assert not os.path.exists(request)  # answered
    assert not ck.should_checkpoint(2) and not ck.preempted
    with open(request, "w") as f:
        json.dump({"why": "preemption"}, f)
    ck.exit_on_preempt = False
    assert ck.should_checkpoint(2) and ck.preempted
    from onbox.common import progress

    doc = progress.read(run_dir)
    assert doc is not None and doc["step"] >= 1
    # the save's cost, for the agent's auto interval: step 1's save held the loop this long
    assert progress.last_save(doc) == (1, pytest.approx(ck.cost, abs=1e-6))
    from onbox.train.phase import phase

    with phase("eval"):  # a phase rewrites the report and keeps the save in it
        doc = progress.read(run_dir)
        assert doc is not None and doc["phase"] == "eval" and progress.last_save(doc) is not None

    os.unlink(request)
    timed = Checkpointer(str(tmp_path / "ck2"), interval=0.2, handle_signals=False, **_objects())
    assert not timed.should_checkpoint()
    time.sleep(0.25)
    assert timed.should_checkpoint()


def test_sigterm_makes_the_next_save_the_last(tmp_path: Any) -> None:
    """Under rgt (RGT_RUN set), SIGTERM makes should_checkpoint true; the save that follows
    is written whole and the process ends with status 143; SIGUSR2 asks for a checkpoint."""
    d = str(tmp_path / "ck")
    script = textwrap.dedent(
        f"""
        import os, signal, sys, time, torch
        sys.path.insert(0, {ROOT!r})
        from onbox.train import Checkpointer
        ck = Checkpointer({d!r}, async_save=True, model=torch.nn.Linear(4, 4))
        os.kill(os.getpid(), signal.SIGUSR2)
        assert ck.should_checkpoint(1)
        ck.save(1)
        ck.wait()
        print("ready", flush=True)
        step = 1
        while True:
            step += 1
            time.sleep(0.01)
            if ck.should_checkpoint(step):
                print("saving", step, flush=True)
                ck.save(step)
        """
    )
    env = dict(os.environ, RGT_RUN="t", RGT_CKPT_TRIGGER="signal:USR2")
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    assert p.stdout is not None
    assert p.stdout.readline().strip() == "ready"
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 143, out
    last = int(out.split()[-1])
    ckptdir.verify(os.path.join(d, f"step_{last}"))


def test_auto_interval_follows_daly(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("RGT_MTBF", "7200")
    ck = Checkpointer(str(tmp_path / "ck"), interval="auto", handle_signals=False, **_objects())
    assert ck.current_interval() == 120.0  # before any cost is known
    ck.cost, ck.write_seconds = 2.0, 2.0
    ck._choose_interval()
    # Daly, higher order: sqrt(2 * 2 * 7200) * (1 + sqrt(2 / 14400) / 3 + 2 / 129600) - 2 = 168.37 s
    # (Young's first order, sqrt(2 * 2 * 7200) - 2, would be 167.7 s)
    assert abs((ck.current_interval() or 0) - 168.37) < 0.01
    err = capfd.readouterr().err
    assert "Daly:" in err and "168 s" in err and "RGT_MTBF" in err


@pytest.mark.parametrize(
    "mtbf, started",
    [("0", None), ("-5", None), ("nan", None), ("inf", None), ("1e999", None), ("soon", None)]
    + [("", "-Infinity"), ("", "-1e308"), ("", "NaN"), ("", '"x"'), ("", "1e300")],
)
def test_an_unusable_mtbf_never_ends_the_training(
    tmp_path: Any,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
    mtbf: str,
    started: Any,
) -> None:
    """RGT_MTBF comes from the user's environment and state.json from the agent: a value no
    run could have (0, negative, nan, inf; a start at -inf or in the future) is passed over for
    the next source, said once on stderr where it is RGT_MTBF, and every save returns with the
    checkpoint written and an interval between 10 s and a day (the formula raised out of
    save() before, after the checkpoint was written: the training died of a setting)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "state.json").write_text('{"started_ts": %s, "restarts": 2}' % (started or "1"))
    monkeypatch.setenv("RGT_MTBF", mtbf)
    monkeypatch.setenv("RGT_RUN_DIR", str(run_dir))
    monkeypatch.setenv("RGT_ATTEMPT", "3")
    ck = Checkpointer(str(tmp_path / "ck"), interval="auto", handle_signals=False, **_objects())
    for step in (1, 2, 3):
        ck.save(step)
        assert 10.0 <= (ck.current_interval() or 0) <= 86400.0
    assert sorted(os.listdir(tmp_path / "ck")) == ["step_1", "step_2", "step_3"]
    err = capfd.readouterr().err
    assert err.count("RGT_MTBF=") == (1 if mtbf else 0), err
    assert "default; set RGT_MTBF" in err  # the next source: state.json's start is unusable


def test_auto_observes_the_restarts_of_this_incarnation_only(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """M observed is the time since the incarnation began (state.json's started_ts) over its
    restarts, not over every attempt of the run: a run stopped and started again 30 s ago at
    its third attempt has seen no failure since (it was given M = 60 s, a 10 s interval)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    monkeypatch.delenv("RGT_MTBF", raising=False)
    monkeypatch.setenv("RGT_RUN_DIR", str(run_dir))
    monkeypatch.setenv("RGT_ATTEMPT", "3")
    state = {"started_ts": time.time() - 30, "restarts": 0, "attempt": 3, "incarnation": 2}
    (run_dir / "state.json").write_text(json.dumps(state))
    ck = Checkpointer(str(tmp_path / "ck"), interval="auto", handle_signals=False)
    assert ck._mtbf() == (4 * 3600.0, "default; set RGT_MTBF")
    state.update(started_ts=time.time() - 3600, restarts=2)  # two failures in its hour
    (run_dir / "state.json").write_text(json.dumps(state))
    m, source = ck._mtbf()
    assert m == pytest.approx(1800.0, rel=1e-3) and source.startswith("observed: 2 restarts")


# torchdata 0.11 calls torch.set_vital, which torch 2.13 deprecates: theirs, not ours.
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
def test_a_registered_stateful_loader_resumes_mid_epoch_exactly(tmp_path: Any) -> None:
    """A StatefulDataLoader registered with the Checkpointer, a model with dropout: resumed
    mid-epoch from a save, the batches, the dropout masks and the weights continue exactly as
    in the uninterrupted run (making the loader's iterator draws from the global RNG after
    the restore; load() puts the restored state back behind that draw)."""
    require(
        importlib.util.find_spec("torchdata") is not None,
        "torchdata (pip install -e '.[lightning]')",
    )
    import torchdata.stateful_dataloader as sdl

    data = torch.arange(64, dtype=torch.float32).reshape(32, 2)

    def setup() -> Tuple[Any, Any, Any]:
        torch.manual_seed(3)
        model = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Dropout(0.5))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = sdl.StatefulDataLoader(data, batch_size=4, shuffle=True)
        return model, opt, loader

    def steps(model: Any, opt: Any, loader: Any, n: int, it: Any = None) -> Tuple[Any, List[float]]:
        seen = []
        it = it or iter(loader)
        for _ in range(n):
            batch = next(it)
            seen.append(batch.sum().item())
            loss = model(batch).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        return it, seen

    model, opt, loader = setup()
    it, _ = steps(model, opt, loader, 3)
    d = str(tmp_path / "ck")
    Checkpointer(d, handle_signals=False, model=model, optimizer=opt, loader=loader).save(3)
    _, want = steps(model, opt, loader, 4, it)
    want_w = [p.detach().clone() for p in model.parameters()]

    torch.manual_seed(99)  # a new process: whatever its RNG holds
    model2, opt2, loader2 = setup()
    ck = Checkpointer(d, handle_signals=False, model=model2, optimizer=opt2, loader=loader2)
    assert ck.load() == 3
    _, got = steps(model2, opt2, loader2, 4)
    assert got == want
    assert all(torch.equal(a, b) for a, b in zip(model2.parameters(), want_w))


def test_the_api_imports_with_only_the_standard_library(tmp_path: Any) -> None:
    """The job's Python may have nothing but torch: importing onbox.train pulls in none of the
    agent's dependencies (and not even torch until a save or load needs it)."""
    code = (
        "import sys; import onbox.train, onbox.common.progress\n"
        "heavy = ('click', 'boto3', 'botocore', 'psutil', 'watchdog', 'huggingface_hub',\n"
        "         'setproctitle', 'torch', 'numpy')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    p = subprocess.run(
        [sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {ROOT!r})\n" + code],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"


def test_the_background_writer_adds_nothing_to_the_jobs_output(tmp_path: Any) -> None:
    """The writer was started as `python -m onbox.train.writer`, a module the package had
    already imported: every job with async_save printed Python's RuntimeWarning about it into
    its log (and `rgt logs`), as if something were wrong."""
    d = str(tmp_path / "ck")
    script = (
        "import torch\nfrom onbox.train import Checkpointer\n"
        f"c = Checkpointer({d!r}, async_save=True, handle_signals=False, "
        "model=torch.nn.Linear(4, 4))\nc.save(1)\nc.close()\n"
    )
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr
    assert p.stderr == "" and p.stdout == "", (p.stdout, p.stderr)
    ckptdir.verify(os.path.join(d, "step_1"))
