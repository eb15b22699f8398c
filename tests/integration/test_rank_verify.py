"""The ranks of one job on one box resume from one checkpoint and hash it once in all.

Real processes started together, as torchrun starts them (LOCAL_RANK, LOCAL_WORLD_SIZE, under
the agent's RGT_RUN_DIR and RGT_ATTEMPT), each loading the same real checkpoint through
``Checkpointer.load``. Who hashed is read from each process's own ``rchar`` (/proc/self/io: the
bytes its read calls returned) around the load: the checkpoint carries a blob listed in its
marker that the load verifies but never loads, so a process read it exactly when it hashed it.

What a user relies on: every rank resumes the same step, a damaged checkpoint is still refused
by every rank, a file altered in place after a rank verified it (same inode, same size, its
mtime put back) is still caught, and a memo torn by a kill is never trusted.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest

from onbox.common.durable import sha256_file
from onbox.train.rankverify import memo_name
from tests.conftest import ROOT, require

_MISSING = [m for m in ("torch", "numpy") if importlib.util.find_spec(m) is None]
if not _MISSING:
    import torch

RANKS = 4
BLOB = 24 << 20  # larger than anything else a load reads (torch's own files are imported before)
# A checkpoint's files count as verified for the other ranks only once their ctime is older than
# a filesystem's timestamp tick (onbox/train/rankverify.py RACY, 2 s): the ranks start after that.
SETTLE = 2.5
WAIT = 120.0  # the most any process of a test may take

_RANK = """
import os, sys, time
sys.path.insert(0, {root!r})
import torch
from onbox.train import Checkpointer

ckpt_dir, go, ready = sys.argv[1:4]
model = torch.nn.Linear(4, 4)
ck = Checkpointer(ckpt_dir, handle_signals=False, model=model)
open(ready, "w").close()
deadline = time.monotonic() + {wait}
while not os.path.exists(go):
    if time.monotonic() > deadline:
        sys.exit(3)
    time.sleep(0.01)

def rchar():
    with open("/proc/self/io") as f:
        return int(next(l for l in f if l.startswith("rchar:")).split()[1])

before = rchar()
step = ck.load()
print("step", step, "read", rchar() - before, flush=True)
"""


@pytest.fixture(autouse=True)
def _needs_torch() -> None:
    require(not _MISSING, f"{', '.join(_MISSING)} (pip install -e '.[train]' torch==2.13.0)")


def _checkpoints(d: str, steps: Tuple[int, ...] = (1, 2)) -> None:
    """Checkpoints ``steps`` in ``d``; the newest also holds blob.bin, listed in its marker."""
    from onbox.train import Checkpointer

    ck = Checkpointer(d, keep=10, handle_signals=False, model=torch.nn.Linear(4, 4))
    for s in steps:
        ck.save(s)
    newest = os.path.join(d, f"step_{max(steps)}")
    with open(os.path.join(newest, "blob.bin"), "wb") as f:
        f.write(os.urandom(BLOB))
    path = os.path.join(newest, ".rgt-complete")
    with open(path) as f:
        marker = json.load(f)
    sha, size = sha256_file(os.path.join(newest, "blob.bin"))
    marker["files"]["blob.bin"] = {"size": size, "sha256": sha}
    with open(path, "w") as f:
        json.dump(marker, f)


def _settle(d: str) -> None:
    """Wait until every file under ``d`` was last changed SETTLE seconds ago."""
    newest = 0
    for here, _, files in os.walk(d):
        for f in files:
            newest = max(newest, os.stat(os.path.join(here, f)).st_ctime_ns)
    while time.time_ns() - newest < SETTLE * 1e9:
        time.sleep(0.05)


def _run_dir(tmp_path: Any) -> str:
    run = str(tmp_path / "home" / "runs" / "r")
    os.makedirs(run, mode=0o700)
    return run


def _env(run_dir: Optional[str], rank: Optional[int], **more: str) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RGT_")}
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        env.pop(k, None)
    if run_dir is not None:
        env.update(RGT_RUN_DIR=run_dir, RGT_ATTEMPT="1")
    if rank is not None:
        n = str(RANKS)
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=n, LOCAL_WORLD_SIZE=n)
    env.update(PYTHONPATH=ROOT, **more)
    return env


def _kill(procs: List[subprocess.Popen[str]]) -> None:
    for p in procs:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
            p.wait()
        if p.stdout is not None:
            p.stdout.close()


def _start(
    tmp_path: Any,
    d: str,
    envs: List[Dict[str, str]],
    before_go: Callable[[], None] = lambda: None,
) -> List[subprocess.Popen[str]]:
    """One process per environment, each loading ``d`` once all have imported torch (and
    ``before_go`` has run)."""
    tag = os.urandom(3).hex()
    go = str(tmp_path / f"go.{tag}")
    code = _RANK.format(root=ROOT, wait=WAIT)
    procs: List[subprocess.Popen[str]] = []
    ready = [str(tmp_path / f"ready.{tag}.{i}") for i in range(len(envs))]
    try:
        for env, r in zip(envs, ready):
            cmd = [sys.executable, "-c", code, d, go, r]
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
        deadline = time.monotonic() + WAIT
        while not all(os.path.exists(r) for r in ready):
            assert all(p.poll() is None for p in procs), "a rank ended before it was ready"
            assert time.monotonic() < deadline, "the ranks never got ready"
            time.sleep(0.05)
        before_go()
        open(go, "w").close()  # all at once: they meet at the lock
    except BaseException:
        _kill(procs)
        raise
    return procs


def _results(procs: List[subprocess.Popen[str]]) -> List[Tuple[int, int]]:
    """(step, bytes read by the load) of each process, once all have ended."""
    out = []
    try:
        for p in procs:
            stdout, _ = p.communicate(timeout=WAIT)
            assert p.returncode == 0, stdout
            words = stdout.split()
            out.append((int(words[words.index("step") + 1]), int(words[words.index("read") + 1])))
    finally:
        _kill(procs)
    return out


def _resume(tmp_path: Any, d: str, envs: List[Dict[str, str]]) -> Tuple[List[int], int]:
    """The step each process resumed, and how many of them read (hashed) the blob."""
    got = _results(_start(tmp_path, d, envs))
    return [s for s, _ in got], sum(1 for _, read in got if read >= BLOB)


def _ranks(run_dir: Optional[str]) -> List[Dict[str, str]]:
    return [_env(run_dir, r) for r in range(RANKS)]


def test_the_ranks_on_one_box_hash_a_checkpoint_once_and_resume_the_same_step(
    tmp_path: Any,
) -> None:
    d = str(tmp_path / "ck")
    _checkpoints(d)
    run = _run_dir(tmp_path)
    _settle(d)
    steps, hashed = _resume(tmp_path, d, _ranks(run))
    assert steps == [2] * RANKS
    assert hashed == 1, f"{hashed} of {RANKS} ranks hashed the checkpoint"
    memos = os.path.join(run, "verified")
    assert stat.S_IMODE(os.stat(memos).st_mode) == 0o700
    # Nothing of the memo went into the checkpoint dir, which the sealer seals as it is.
    assert sorted(os.listdir(os.path.join(d, "step_2"))) == [
        ".rgt-complete",
        "blob.bin",
        "state.pt",
    ]


_TORCHRUN_JOB = """
import os, sys
sys.path.insert(0, {root!r})
import torch
from onbox.train import Checkpointer

def rchar():
    with open("/proc/self/io") as f:
        return int(next(l for l in f if l.startswith("rchar:")).split()[1])

ck = Checkpointer(sys.argv[1], handle_signals=False, model=torch.nn.Linear(4, 4))
before = rchar()
step = ck.load()
with open(os.path.join(sys.argv[2], os.environ["RANK"]), "w") as f:
    f.write(f"{{step}} {{rchar() - before}}")
"""


def test_the_ranks_of_a_real_torchrun_hash_a_checkpoint_once(tmp_path: Any) -> None:
    """The same under torchrun itself (its own LOCAL_WORLD_SIZE, RANK, TORCHELASTIC_*): the
    environment the gate reads is the one it sets."""
    d, out = str(tmp_path / "ck"), tmp_path / "out"
    _checkpoints(d)
    out.mkdir()
    run = _run_dir(tmp_path)
    job = tmp_path / "job.py"
    job.write_text(_TORCHRUN_JOB.format(root=ROOT))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS)]
    cmd += ["--master-addr", "127.0.0.1", "--master-port", port, str(job), d, str(out)]
    _settle(d)
    p = subprocess.Popen(cmd, env=_env(run, None), start_new_session=True)
    try:
        assert p.wait(timeout=WAIT) == 0
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)  # torchrun and its workers: its session
            p.wait()
    got = [(out / str(r)).read_text().split() for r in range(RANKS)]
    assert [int(step) for step, _ in got] == [2] * RANKS
    assert sum(1 for _, read in got if int(read) >= BLOB) == 1, got


def test_ranks_that_waited_on_the_lock_past_a_files_tick_record_it(tmp_path: Any) -> None:
    """Every file's ctime is moved (a chmod) just before the ranks check, and the lock is held
    (here by the test, as by a first rank slow to hash) until that is SETTLE seconds old. The
    rank that gets it then hashes, now past the tick, and records; the others use its memo.
    Timed from before its wait, each rank found the files racy and hashed, one after another."""
    d = str(tmp_path / "ck")
    _checkpoints(d)
    run = _run_dir(tmp_path)
    memos = os.path.join(run, "verified")
    os.mkdir(memos, 0o700)
    lock = os.open(
        os.path.join(memos, memo_name(os.path.join(d, "step_2")) + ".lock"),
        os.O_RDWR | os.O_CREAT,
        0o600,
    )
    procs: List[subprocess.Popen[str]] = []
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        procs = _start(tmp_path, d, _ranks(run), before_go=lambda: _chmod_all(d))
        _settle(d)
    except BaseException:
        _kill(procs)
        raise
    finally:
        os.close(lock)  # the ranks go on
    got = _results(procs)
    assert [s for s, _ in got] == [2] * RANKS
    assert sum(1 for _, read in got if read >= BLOB) == 1, got


def _chmod_all(d: str) -> None:
    for here, _, files in os.walk(d):
        for f in files:
            os.chmod(os.path.join(here, f), 0o644)


def test_a_damaged_checkpoint_is_refused_by_every_rank_after_one_hash(tmp_path: Any) -> None:
    """step_2's blob has one bit flipped (its size kept): every rank skips it for step 1, and the
    rank that found it damaged spares the others hashing it, one after another, under the lock."""
    d = str(tmp_path / "ck")
    _checkpoints(d)
    blob = os.path.join(d, "step_2", "blob.bin")
    _flip(blob)
    run = _run_dir(tmp_path)
    _settle(d)
    steps, hashed = _resume(tmp_path, d, _ranks(run))
    assert steps == [1] * RANKS
    assert hashed == 1, f"{hashed} of {RANKS} ranks hashed the damaged checkpoint"


def _flip(path: str) -> None:
    """Flip one bit in the middle of ``path``, in place."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x01]))


def test_a_file_altered_in_place_after_it_was_verified_is_caught(tmp_path: Any) -> None:
    """The ranks verified step_2; then its blob is altered in place: same inode, same size, its
    mtime set back by os.utime. Only ctime tells, and a later resume of the same attempt (whose
    memo would otherwise stand) hashes it again and refuses it."""
    d = str(tmp_path / "ck")
    _checkpoints(d)
    run = _run_dir(tmp_path)
    _settle(d)
    assert _resume(tmp_path, d, _ranks(run)) == ([2] * RANKS, 1)
    blob = os.path.join(d, "step_2", "blob.bin")
    before = os.stat(blob)
    _flip(blob)
    os.utime(blob, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(blob)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        before.st_ino,
        before.st_size,
        before.st_mtime_ns,
    )
    _settle(d)
    steps, hashed = _resume(tmp_path, d, _ranks(run))
    assert steps == [1] * RANKS
    assert hashed == 1


def test_a_memo_cut_off_by_a_kill_is_not_trusted(tmp_path: Any) -> None:
    """A rank is SIGKILLed with half its memo written: nothing is under the memo's name. The
    half is then put there by hand, as a writer that wrote in place would have left it: the
    next rank hashes the checkpoint again, resumes, and leaves a whole memo, the kill's leftover
    gone."""
    d = str(tmp_path / "ck")
    _checkpoints(d)
    run = _run_dir(tmp_path)
    memos = os.path.join(run, "verified")
    _settle(d)
    held = _start(tmp_path, d, [_env(run, 0, RGT_HOLD_AT="memo.half_written")])
    try:
        deadline = time.monotonic() + WAIT
        while not _leftovers(memos):
            assert held[0].poll() is None, "the rank ended before it wrote its memo"
            assert time.monotonic() < deadline, "the rank never wrote its memo"
            time.sleep(0.02)
    finally:
        _kill(held)
    assert held[0].returncode == -signal.SIGKILL
    (tmp,) = _leftovers(memos)
    assert [n for n in os.listdir(memos) if n.endswith(".json")] == []
    torn = os.path.join(memos, tmp.split(".json.tmp.")[0].lstrip(".") + ".json")
    with open(os.path.join(memos, tmp), "rb") as f:
        half = f.read()
    assert half and not _parses(half)
    with open(torn, "wb") as f:
        f.write(half)
    steps, hashed = _resume(tmp_path, d, [_env(run, 1)])
    assert (steps, hashed) == ([2], 1)
    with open(torn, "rb") as f:
        assert _parses(f.read())
    assert _leftovers(memos) == []


def _leftovers(memos: str) -> List[str]:
    """The memo files under a temporary name in ``memos`` that hold something."""
    try:
        names = os.listdir(memos)
    except FileNotFoundError:
        return []
    return [n for n in names if ".json.tmp." in n and os.path.getsize(os.path.join(memos, n))]


def _parses(data: bytes) -> bool:
    try:
        json.loads(data)
    except ValueError:
        return False
    return True


def test_a_single_process_hashes_as_before_and_writes_no_memo(tmp_path: Any) -> None:
    """No LOCAL_WORLD_SIZE nor WORLD_SIZE: one process alone, which hashes the checkpoint each
    time it resumes and leaves nothing in the run dir; nor does a job of several ranks outside
    rgt (no RGT_RUN_DIR), each of which hashes as it always did."""
    d = str(tmp_path / "ck")
    _checkpoints(d)
    run = _run_dir(tmp_path)
    _settle(d)
    assert _resume(tmp_path, d, [_env(run, None)]) == ([2], 1)
    assert _resume(tmp_path, d, [_env(run, None)]) == ([2], 1)
    assert "verified" not in os.listdir(run)
    assert _resume(tmp_path, d, [_env(None, 0), _env(None, 1)]) == ([2, 2], 2)


@pytest.mark.parametrize("where", ["group-writable", "in the checkpoint dir"])
def test_a_memo_dir_others_could_write_or_the_sealer_would_take_is_not_used(
    tmp_path: Any, where: str
) -> None:
    """The memo dir was made group-writable, or the run dir is the checkpoint dir (the sealer
    would take the memos for part of it): no memo is written or read there, and each rank hashes
    the checkpoint (one after the other here, each of which would have used a memo)."""
    d = str(tmp_path / "ck")
    _checkpoints(d)
    run = _run_dir(tmp_path)
    memos = os.path.join(run, "verified")
    more = {}
    if where == "group-writable":
        os.mkdir(memos, 0o700)
        os.chmod(memos, 0o770)
    else:
        more["RGT_CKPT_DIR"] = run
    _settle(d)
    assert _resume(tmp_path, d, [_env(run, 0, **more)]) == ([2], 1)
    assert _resume(tmp_path, d, [_env(run, 1, **more)]) == ([2], 1)
    assert (os.listdir(memos) if os.path.isdir(memos) else None) == (
        [] if where == "group-writable" else None
    )
