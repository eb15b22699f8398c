"""The disk and memory probes against real conditions: a tmpfs of our own filled until its
inodes run out while bytes remain (and until its bytes do), the training API's save held back by
the hold file, real tagged processes holding real memory, a real cgroup v1 memory limit.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Iterator, List, Optional, Tuple

import psutil
import pytest

from onbox.health.config import DiskConfig, HealthConfig, MemoryConfig
from onbox.health.disk import DiskProbe
from onbox.health.memory import MemoryProbe
from onbox.health.verdict import Context, SealView
from onbox.health.watcher import HealthWatcher
from tests import mounts
from tests.conftest import require
from tests.polling import wait

# Unique to this process: the probe scans every process on the host for the attempt's tag, so
# a second test run beside this one (another checkout's, another xdist worker) holding the
# same tag would have its holders counted as this attempt's.
RUN = f"memrun{os.getpid()}"


def _ctx(now: float = 0.0, **kw: Any) -> Context:
    base: dict[str, Any] = {
        "now": now,
        "wall": time.time(),
        "state": "RUNNING",
        "attempt": 1,
        "attempt_started": None,
        "job_pid": None,
        "tag": None,
        "sealing": None,
    }
    base.update(kw)
    return Context(**base)


@pytest.fixture
def tmpfs(tmp_path: Any) -> Iterator[str]:
    """A 64 MiB tmpfs with 2000 inodes, mounted for real; unmounted at the end."""
    with mounts.tmpfs(str(tmp_path / "fs"), "size=64m,nr_inodes=2000", "rgt-disk-test") as path:
        yield path


def _fill_inodes(path: str) -> List[str]:
    """Empty files until the filesystem says ENOSPC (bytes to spare: they hold none)."""
    made: List[str] = []
    for n in range(100000):  # bounded: nr_inodes is far below this
        name = os.path.join(path, f"f{n}")
        try:
            with open(name, "w"):
                pass
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
            return made
        made.append(name)
    raise AssertionError(f"{path} never ran out of inodes")


def _fill_bytes(path: str, fraction: float) -> str:
    """One file holding ``fraction`` of the filesystem's bytes."""
    st = os.statvfs(path)
    name = os.path.join(path, "big")
    with open(name, "wb") as f:
        f.write(b"x" * int(st.f_blocks * st.f_frsize * fraction))
    return name


def test_inodes_run_out_with_bytes_to_spare_alert_hold_then_release(tmpfs: str) -> None:
    # The run dir (where the hold file goes) is on the full filesystem itself: the usual case.
    run_dir = os.path.join(tmpfs, "run")
    ckpt = os.path.join(tmpfs, "ckpt")
    os.makedirs(run_dir)
    hold = os.path.join(run_dir, "checkpoint.hold")
    probe = DiskProbe(DiskConfig(scratch=1 << 20), {"run": run_dir, "ckpt": ckpt}, hold, False)
    first = probe.check(_ctx())
    assert first.verdict.level == "ok", first.verdict
    made = _fill_inodes(os.path.join(tmpfs))
    r = probe.check(_ctx(now=10))
    v = r.verdict
    assert (v.level, v.code) == ("alert", "inodes_full"), v
    assert tmpfs in v.reason and "run" in v.reason and "ckpt" in v.reason
    assert "bytes to spare" in v.reason and "held back" in v.reason
    assert "inodes" in v.remedy
    assert r.sample["ckpt.inodes_used"] == 1.0 and r.sample["ckpt.bytes_used"] < 0.5
    assert r.sample["run.free_bytes"] > 32 << 20
    with open(hold) as f:
        doc = json.load(f)
    assert "inodes" in doc["reason"] and doc["since"] > 0
    assert v.data["hold"] is True
    # Some room again, still above warn_at: the hold stays.
    for name in made[:150]:
        os.unlink(name)
    assert probe.check(_ctx(now=20)).verdict.level == "warn"
    assert os.path.exists(hold)
    for name in made[150:]:
        os.unlink(name)
    after = probe.check(_ctx(now=30))
    assert after.verdict.level == "ok", after.verdict
    assert not os.path.exists(hold)
    assert os.listdir(tmpfs) == ["run"]  # the probe deleted nothing of the job's
    # A second crossing holds again, with the inode the release kept.
    made = _fill_inodes(tmpfs)
    assert probe.check(_ctx(now=40)).verdict.code == "inodes_full"
    assert os.path.exists(hold)


def test_bytes_full_is_said_as_bytes_and_free_room_is_asked_once_per_crossing(tmpfs: str) -> None:
    cfg = DiskConfig(prune_at=0.5, warn_at=0.9, hold_at=0.95, scratch=1 << 20)
    hold = os.path.join(tmpfs, "checkpoint.hold")
    probe = DiskProbe(cfg, {"ckpt": tmpfs}, hold, True)
    big = _fill_bytes(tmpfs, 0.6)
    r = probe.check(_ctx(now=0))
    assert r.verdict.level == "ok" and [a.kind for a in r.actions] == ["free_room"]
    assert probe.check(_ctx(now=5)).actions == []  # not every tick
    assert [a.kind for a in probe.check(_ctx(now=70)).actions] == ["free_room"]
    os.unlink(big)
    assert probe.check(_ctx(now=71)).actions == []
    big = _fill_bytes(tmpfs, 0.97)
    r = probe.check(_ctx(now=72))  # a new crossing: at once
    assert [a.kind for a in r.actions] == ["free_room"]
    assert (r.verdict.level, r.verdict.code) == ("alert", "bytes_full"), r.verdict
    assert "inodes" not in r.verdict.reason and "of bytes used" in r.verdict.reason
    assert os.path.exists(hold)
    # Without a store there is nothing verified to prune: never asked.
    bare = DiskProbe(cfg, {"ckpt": tmpfs}, os.path.join(tmpfs, "h2"), False)
    assert bare.check(_ctx()).actions == []


def test_budget_needs_two_checkpoints_and_scratch_once_one_is_sealed(tmpfs: str) -> None:
    hold = os.path.join(tmpfs, "checkpoint.hold")
    probe = DiskProbe(DiskConfig(scratch=8 << 20), {"ckpt": tmpfs}, hold, True)
    assert probe.check(_ctx()).verdict.level == "ok"  # 64 MiB free, 8 MiB scratch
    sealed = SealView(ckpt_bytes=30 << 20)  # 2 x 30 + 8 > 64
    v = probe.check(_ctx(sealing=sealed)).verdict
    assert (v.level, v.code) == ("warn", "budget"), v
    assert "68.0 MiB" in v.reason and "64.0 MiB" in v.reason  # need vs have
    assert probe.check(_ctx(sealing=SealView(ckpt_bytes=20 << 20))).verdict.level == "ok"
    tight = DiskProbe(DiskConfig(scratch=100 << 20), {"ckpt": tmpfs}, hold, True)
    assert tight.check(_ctx()).verdict.code == "budget"  # before any seal: scratch alone


def test_a_full_disk_without_the_checkpoints_alerts_but_neither_holds_nor_prunes_them(
    tmpfs: str, tmp_path: Any
) -> None:
    # The checkpoints (and the run dir, the sealer's staging) on a disk of their own with room;
    # the cache's disk (a real tmpfs) full. Holding the saves would leave the run with no new
    # checkpoint exactly when the job may die of the full cache; pruning frees nothing there.
    with mounts.tmpfs(str(tmp_path / "ckfs"), "size=64m", "rgt-disk-ckpt") as ckfs:
        run, ckpt = os.path.join(ckfs, "run"), os.path.join(ckfs, "ckpt")
        os.makedirs(run)
        hold = os.path.join(run, "checkpoint.hold")
        cfg = DiskConfig(scratch=1 << 20)
        paths = {"run": run, "ckpt": ckpt, "cache": tmpfs}
        probe = DiskProbe(cfg, paths, hold, True)
        _fill_bytes(tmpfs, 0.97)
        r = probe.check(_ctx(now=0))
        assert (r.verdict.level, r.verdict.code) == ("alert", "bytes_full"), r.verdict
        assert tmpfs in r.verdict.reason and "cache" in r.verdict.reason
        assert "held back" not in r.verdict.reason
        assert not os.path.exists(hold) and r.actions == []
        # The checkpoints' own disk full: held, and the sealer asked for room.
        _fill_bytes(ckfs, 0.97)
        r = probe.check(_ctx(now=1))
        assert os.path.exists(hold) and [a.kind for a in r.actions] == ["free_room"]
        assert "held back" in r.verdict.reason
        # Room again there, the cache still full: released.
        os.unlink(os.path.join(ckfs, "big"))
        r = probe.check(_ctx(now=2))
        assert not os.path.exists(hold) and r.verdict.code == "bytes_full", r.verdict


def test_paths_missing_are_skipped_and_none_readable_is_unknown(tmp_path: Any) -> None:
    hold = str(tmp_path / "checkpoint.hold")
    probe = DiskProbe(DiskConfig(), {"cache": str(tmp_path / "nope")}, hold, False)
    assert probe.check(_ctx()).verdict.level == "unknown"
    probe = DiskProbe(
        DiskConfig(scratch=1), {"cache": str(tmp_path / "nope"), "run": str(tmp_path)}, hold, False
    )
    r = probe.check(_ctx())
    assert r.verdict.level == "ok" and "cache.bytes_used" not in r.sample
    assert "run.bytes_used" in r.sample


def _hold_now(tmp_path: Any) -> Tuple[DiskProbe, HealthWatcher, List[Tuple[str, str]], str]:
    """A probe that holds at once (watermarks at 0) on tmp_path's filesystem, in a watcher whose
    events are kept; and the hold file's path."""
    hold = str(tmp_path / "checkpoint.hold")
    cfg = DiskConfig(prune_at=0.0, warn_at=0.0, hold_at=0.0, scratch=1)
    probe = DiskProbe(cfg, {"run": str(tmp_path)}, hold, False)
    events: List[Tuple[str, str]] = []
    watcher = HealthWatcher(
        HealthConfig(), [probe], _ctx, lambda kind, reason, **kw: events.append((kind, reason))
    )
    return probe, watcher, events, hold


def test_a_fifo_planted_as_the_spare_neither_blocks_the_watcher_nor_is_written(
    tmp_path: Any,
) -> None:
    _, watcher, events, hold = _hold_now(tmp_path)
    spare = hold + ".spare"
    os.unlink(spare)
    os.mkfifo(spare)  # what a job can do: the run dir is its to write
    ticked = threading.Thread(target=watcher.tick, daemon=True)
    ticked.start()
    ticked.join(30)  # a bound on a hang, not a timing: the tick itself waits for nothing
    if ticked.is_alive():  # blocked opening the FIFO for writing: a reader lets it go
        os.close(os.open(spare, os.O_RDONLY | os.O_NONBLOCK))
        ticked.join(60)
        raise AssertionError("the disk probe blocked on a FIFO planted as its spare file")
    assert os.path.isfile(hold) and not os.path.islink(hold)
    with open(hold) as f:
        assert json.load(f)["since"] > 0
    [(kind, reason)] = events
    assert kind == "health" and "held back" in reason
    assert f"{spare} was a FIFO: replaced" in reason


def test_a_symlink_or_hard_link_planted_as_a_probe_file_never_writes_elsewhere(
    tmp_path: Any,
) -> None:
    probe, watcher, events, hold = _hold_now(tmp_path)
    spare = hold + ".spare"
    victim, other = tmp_path / "victim.txt", tmp_path / "state.json"
    victim.write_text("precious\n")
    other.write_text('{"state": "RUNNING"}\n')
    os.unlink(spare)
    os.symlink(victim, spare)
    watcher.tick()
    assert victim.read_text() == "precious\n"
    assert os.path.isfile(hold) and not os.path.islink(hold)
    assert f"{spare} was a symlink: replaced" in events[0][1]
    # Released (the disk has room again), then held again through a hard link to another file
    # (the agent's own state): that file keeps its bytes.
    holding = probe.cfg
    probe.cfg = DiskConfig(prune_at=1.0, warn_at=1.0, hold_at=1.0, scratch=1)
    watcher.tick()
    assert not os.path.lexists(hold) and os.path.isfile(spare)
    os.unlink(spare)
    os.link(other, spare)
    probe.cfg = holding
    watcher.tick()
    assert other.read_text() == '{"state": "RUNNING"}\n'
    assert os.stat(hold).st_nlink == 1 and not os.path.samefile(hold, other)
    assert f"{spare} was a hard link (2 names of one file): replaced" in events[-1][1]
    # And with no spare, the hold file itself planted as a symlink to where a file would be made.
    probe.cfg = DiskConfig(prune_at=1.0, warn_at=1.0, hold_at=1.0, scratch=1)
    watcher.tick()
    os.unlink(spare)
    elsewhere = tmp_path / "elsewhere"
    os.symlink(elsewhere, hold)
    probe.cfg = holding
    watcher.tick()
    assert not os.path.lexists(elsewhere) and not os.path.islink(hold)
    with open(hold) as f:
        assert json.load(f)["since"] > 0  # the probe's own JSON: why, since when
    assert f"{hold} was a symlink: replaced" in events[-1][1]


# ---- memory
# Holds MIB MiB; once GO exists, starts a child holding CHILD MiB with the tag scrubbed from its
# environment (found only as a child of a tagged process), writes its pid to GO.child; bounded.
HOLDER = """
import os, subprocess, sys, time
mib, go, child_mib = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
block = b"x" * (mib << 20)
print("ready", flush=True)
deadline = time.time() + 60
while time.time() < deadline and not os.path.exists(go):
    time.sleep(0.05)
if os.path.exists(go):
    code = "import time; b = b'y' * (%d << 20); print('up', flush=True); time.sleep(60)"
    env = {"PATH": os.environ.get("PATH", "")}
    child = subprocess.Popen([sys.executable, "-c", code % child_mib], env=env,
                             stdout=subprocess.PIPE, text=True)
    child.stdout.readline()
    with open(go + ".tmp", "w") as f:
        f.write(str(child.pid))
    os.rename(go + ".tmp", go + ".child")
while time.time() < deadline:
    time.sleep(0.1)
"""


class Holders:
    """Real processes holding memory, and their children; killed by PID at the end."""

    def __init__(self) -> None:
        self.procs: List[subprocess.Popen[str]] = []

    def start(self, mib: int, tag: Optional[str], go: str, child_mib: int = 0) -> int:
        env = dict(os.environ)
        env.pop("RGT_ATTEMPT_TAG", None)
        if tag:
            env["RGT_ATTEMPT_TAG"] = tag
        p = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(mib), go, str(child_mib)],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.procs.append(p)
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        return p.pid

    def stop(self) -> None:
        for p in self.procs:
            try:
                kids = [c.pid for c in psutil.Process(p.pid).children(recursive=True)]
            except psutil.Error:
                kids = []
            for pid in [p.pid, *kids]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait(10)
            if p.stdout is not None:
                p.stdout.close()


@pytest.fixture
def holders() -> Iterator[Holders]:
    h = Holders()
    try:
        yield h
    finally:
        h.stop()


def _owner(tag: Optional[str], current: Optional[str]) -> Optional[str]:
    if not tag or not tag.startswith(RUN + ":"):
        return None
    return "current" if tag == current else "earlier"


def _child(go: str) -> int:
    path = go + ".child"
    wait(lambda: os.path.exists(path), 30, "the holder's child")
    with open(path) as f:
        return int(f.read())


def test_memory_names_the_attempts_biggest_processes_only(tmp_path: Any, holders: Holders) -> None:
    tag = f"{RUN}:2:n1"
    go = str(tmp_path / "go")
    big = holders.start(96, tag, go, child_mib=48)
    small = holders.start(24, tag, str(tmp_path / "never"))
    holders.start(160, f"{RUN}:1:n0", str(tmp_path / "never"))  # an earlier attempt's
    holders.start(160, None, str(tmp_path / "never"))  # nobody's
    probe = MemoryProbe(MemoryConfig(warn_at=0.0001), _owner)
    r = probe.check(_ctx(tag=tag, job_pid=big))
    v = r.verdict
    assert (v.level, v.code) == ("warn", "memory_high"), v
    assert [p["pid"] for p in v.data["top"]] == [big, small]
    assert v.data["top"][0]["rss"] > 90 << 20 and "python" in v.data["top"][0]["name"]
    assert f"pid {big}" in v.reason and "2 processes hold" in v.reason
    assert r.sample["top_rss"] == v.data["top"][0]["rss"]
    assert "host" in v.data["where"]  # this test's cgroup has no limit: the host's is used
    assert r.sample["limit"] == psutil.virtual_memory().total
    # A worker started after the scan, without the tag in its environment: found as a child,
    # on the next tick and after a full rescan alike.
    open(go, "w").close()
    worker = _child(go)
    for _ in range(8):
        top = [p["pid"] for p in probe.check(_ctx(tag=tag, job_pid=big)).verdict.data["top"]]
        assert top == [big, worker, small], top
    # Under the mark: ok, with the numbers.
    calm = MemoryProbe(MemoryConfig(), _owner).check(_ctx(tag=tag, job_pid=big)).verdict
    assert calm.level == "ok" and " of " in calm.reason


def test_memory_reads_a_real_cgroup_v1_limit(tmp_path: Any, holders: Holders) -> None:
    base = "/sys/fs/cgroup/memory"
    require(os.geteuid() == 0 and os.path.isdir(base), "root and a cgroup v1 memory controller")
    cg = os.path.join(base, f"rgt-unit-{os.getpid()}")
    os.makedirs(cg, exist_ok=True)
    try:
        with open(os.path.join(cg, "memory.limit_in_bytes"), "w") as f:
            f.write(str(256 << 20))
        tag = f"{RUN}:1:n1"
        go = str(tmp_path / "go")
        pid = holders.start(8, tag, go, child_mib=128)
        with open(os.path.join(cg, "cgroup.procs"), "w") as f:
            f.write(str(pid))
        probe = MemoryProbe(MemoryConfig(warn_at=0.3), _owner)
        r = probe.check(_ctx(tag=tag, job_pid=pid))
        assert r.sample["limit"] == 256 << 20
        assert r.verdict.data["where"] == f"cgroup {cg}"
        assert r.sample["oom_kills"] == 0 and r.verdict.level == "ok", r.verdict
        open(go, "w").close()  # the child is born inside the cgroup: its memory counts there
        worker = _child(go)
        v = probe.check(_ctx(tag=tag, job_pid=pid)).verdict
        assert (v.level, v.code) == ("warn", "memory_high"), v
        assert v.data["top"][0]["pid"] == worker and f"pid {worker}" in v.reason
        assert "of 256.0 MiB" in v.reason
    finally:
        holders.stop()
        wait(lambda: not _procs(cg), 10, "the cgroup empty")
        os.rmdir(cg)


def _procs(cg: str) -> List[str]:
    with open(os.path.join(cg, "cgroup.procs")) as f:
        return f.read().split()


# ---- the exit of a job that ran out of inodes on a watched path besides its workdir
FILLER = """
import os, sys
for n in range(100000):  # bounded: the tmpfs has 2000 inodes
    open(os.path.join(sys.argv[1], f"shard{n}"), "w").close()
"""


def test_a_job_out_of_inodes_on_a_watched_dataset_dir_ends_as_inodes_exhausted(
    tmpfs: str, tmp_path: Any
) -> None:
    # The dataset dir ([health.disk] paths) is on its own filesystem, out of inodes with bytes to
    # spare; the workdir and the checkpoints are elsewhere, with room. The disk probe says
    # inodes; the job's exit must say the same, not "free disk space".
    from onbox.agent.classify import ExitStatus, Kind, classify
    from onbox.agent.runner import ShimRunner
    from onbox.agent.spec import JobSpec
    from onbox.common.rundir import RunDir

    work = tmp_path / "work"
    work.mkdir()
    health = HealthConfig(disk=DiskConfig(paths=(tmpfs,)))
    spec = JobSpec("ino", ("true",), str(work), str(work / "ckpt"), health=health)
    rd = RunDir("ino", home=str(tmp_path / "home"))
    runner = ShimRunner(rd, spec, agent_cmd=["false"], base_environ=os.environ)
    p = subprocess.run(
        [sys.executable, "-c", FILLER, tmpfs], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 1 and "No space left on device" in p.stderr, p.stderr
    v = classify(ExitStatus(code=p.returncode), p.stderr, inodes_exhausted=runner.inodes_exhausted)
    assert v.kind == Kind.INODES_EXHAUSTED, v
