"""The disk probe over two real filesystems at once (two tmpfs mounts of our own, unmounted at
the end): the checkpoints' and the run dir's on one, a cache (or the user's output dir) on the
other. Whatever is short, by bytes or by inodes, the user's status line and the ``health`` event
name every filesystem in danger, with its path, what is left on it and its own remedy; the
fullest by bytes does not hide another that is out of inodes.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from typing import Any, Dict, Iterator, List, Tuple

import pytest

from onbox.agent.observe import health_lines
from onbox.health.config import DiskConfig, HealthConfig
from onbox.health.disk import DiskProbe
from onbox.health.verdict import Context
from onbox.health.watcher import HealthWatcher
from tests import mounts

Events = List[Tuple[str, str, Dict[str, Any]]]


def _ctx() -> Context:
    return Context(
        now=time.monotonic(),
        wall=time.time(),
        state="RUNNING",
        attempt=1,
        attempt_started=None,
        job_pid=None,
        tag=None,
        sealing=None,
    )


@pytest.fixture
def two(tmp_path: Any) -> Iterator[Tuple[str, str]]:
    """(the checkpoints' filesystem, the cache's): 64 MiB tmpfs mounts, the cache's with 2000
    inodes, mounted for real and unmounted at the end."""
    with contextlib.ExitStack() as stack:  # (one statement: the py39 target has no `with (...)`)
        ck = stack.enter_context(mounts.tmpfs(str(tmp_path / "ck"), "size=64m", "rgt-many-ck"))
        ca = stack.enter_context(
            mounts.tmpfs(str(tmp_path / "ca"), "size=64m,nr_inodes=2000", "rgt-many-ca")
        )
        yield ck, ca


def _fill_bytes(path: str, fraction: float) -> str:
    st = os.statvfs(path)
    name = os.path.join(path, "big")
    with open(name, "wb") as f:
        f.write(b"x" * int(st.f_blocks * st.f_frsize * fraction))
    return name


def _fill_inodes(path: str) -> List[str]:
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


def _rig(ck: str, ca: str) -> Tuple[DiskProbe, HealthWatcher, Events]:
    run, ckpt = os.path.join(ck, "run"), os.path.join(ck, "ckpt")
    os.makedirs(run)
    paths = {"run": run, "ckpt": ckpt, "cache": ca}
    hold = os.path.join(run, "checkpoint.hold")
    probe = DiskProbe(DiskConfig(scratch=1 << 20), paths, hold, True)
    events: Events = []
    watcher = HealthWatcher(
        HealthConfig(), [probe], _ctx, lambda kind, reason, **kw: events.append((kind, reason, kw))
    )
    return probe, watcher, events


def _status(watcher: HealthWatcher) -> str:
    """The disk line of the user's status (``rgt-agent status``, ``rgt status``)."""
    [line] = [x for x in health_lines({"health": watcher.to_doc()}) if x.startswith("disk:")]
    return line


def test_both_filesystems_short_each_is_named_with_what_is_left_and_its_remedy(
    two: Tuple[str, str],
) -> None:
    ck, ca = two
    probe, watcher, events = _rig(ck, ca)
    watcher.tick()
    assert watcher.verdicts["disk"].level == "ok"
    _fill_bytes(ck, 0.97)  # the checkpoints' disk out of bytes
    _fill_inodes(ca)  # the cache's out of inodes: the fuller of the two by its measure
    watcher.tick()
    v = watcher.verdicts["disk"]
    assert v.level == "alert", v
    line = _status(watcher)
    # The checkpoints' filesystem: its path, its labels, the bytes left, the bytes remedy.
    assert f"{ck}/run (run, ckpt)" in v.reason and "of bytes used" in v.reason, v.reason
    assert f"free space on {ck}" in v.remedy, v.remedy
    # The cache's: out of inodes with bytes to spare, and the inodes remedy naming it.
    assert f"{ca} (cache)" in v.reason and "inodes 100% used" in v.reason, v.reason
    assert f"delete many small files on {ca}" in v.remedy, v.remedy
    for text in (v.reason, v.remedy):
        assert text in line
    [(kind, reason, kw)] = [e for e in events if e[0] == "health"]
    assert f"{ck}/run (run, ckpt)" in reason and f"{ca} (cache)" in reason
    assert f"free space on {ck}" in kw["remedy"] and f"small files on {ca}" in kw["remedy"]
    assert "held back" in reason  # the checkpoints' disk is past hold_at: saves held


def test_a_filesystem_out_of_inodes_is_named_although_another_is_fuller_by_bytes(
    two: Tuple[str, str],
) -> None:
    ck, ca = two
    probe, watcher, events = _rig(ck, ca)
    _fill_bytes(ck, 0.99)  # the fullest filesystem there is, by any measure
    watcher.tick()
    first = watcher.verdicts["disk"]
    assert (first.level, first.code) == ("alert", "bytes_full"), first
    assert ca not in first.reason  # the cache is fine: not named as short
    made = _fill_inodes(ca)
    for name in made[:60]:  # inodes 97% used: short, though less than the other's 99% bytes
        os.unlink(name)
    watcher.tick()
    v = watcher.verdicts["disk"]
    assert f"{ca} (cache)" in v.reason and "inodes 97% used" in v.reason, v.reason
    assert f"delete many small files on {ca}" in v.remedy, v.remedy
    assert f"{ca} (cache)" in _status(watcher)
    # The user is told, not only the state file: an event, though the code stayed bytes_full.
    said = [reason for kind, reason, _ in events if kind == "health"]
    assert len(said) == 2 and f"{ca} (cache)" in said[1], said
    # The cache cleaned up: said again, naming the checkpoints' disk alone.
    for name in made[60:]:
        os.unlink(name)
    watcher.tick()
    said = [reason for kind, reason, _ in events if kind == "health"]
    assert len(said) == 3 and ca not in said[2] and f"{ck}/run (run, ckpt)" in said[2], said


def test_only_the_filesystem_out_of_inodes_is_named_not_the_fullest_by_bytes(
    two: Tuple[str, str],
) -> None:
    ck, ca = two
    probe, watcher, events = _rig(ck, ca)
    _fill_bytes(ck, 0.85)  # past prune_at, under warn_at: not short
    _fill_inodes(ca)
    watcher.tick()
    v = watcher.verdicts["disk"]
    assert (v.level, v.code) == ("alert", "inodes_full"), v
    assert f"{ca} (cache)" in v.reason and ck not in v.reason, v.reason
    assert ck not in v.remedy and ca in v.remedy, v.remedy
    assert not os.path.exists(os.path.join(ck, "run", "checkpoint.hold"))  # the cache's disk


def test_a_filesystem_short_of_both_is_not_said_to_have_bytes_to_spare(
    two: Tuple[str, str],
) -> None:
    ck, ca = two
    probe, watcher, events = _rig(ck, ca)
    _fill_bytes(ca, 0.96)
    _fill_inodes(ca)
    watcher.tick()
    v = watcher.verdicts["disk"]
    assert (v.level, v.code) == ("alert", "inodes_full"), v
    assert "bytes to spare" not in v.reason and "df -h shows room" not in v.reason, v.reason
    assert "inodes 100% used" in v.reason and "96% of bytes used" in v.reason, v.reason
    # Both remedies, for the one filesystem.
    assert f"delete many small files on {ca}" in v.remedy and f"free space on {ca}" in v.remedy
