"""Where the suite's CPU goes: each test's CPU, its children's and daemons' included.

An opt-in pytest plugin for measuring the suite, not a test: ``RGT_TEST_CPU=FILE pytest -p
tests.cpuacct ...`` moves the pytest process (each xdist worker) into a cgroup v1 ``cpuacct``
group of its own for each test, so that every process the test starts, daemonized agents and
their jobs included, is counted in it for its whole life, and appends one JSON line per test to
FILE: the node id, the worker, the group's CPU seconds and the wall seconds. A process that
outlives its test (a session service started lazily by it) keeps counting in that test's group,
which is read again at the end of the session (``"final"`` lines). Needs root and a cgroup v1
cpuacct hierarchy (this machine has one); without them it says so once and measures nothing.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, Iterator, Optional

import pytest

ROOT = "/sys/fs/cgroup/cpuacct"
OUT = os.environ.get("RGT_TEST_CPU", "")
_groups: Dict[str, str] = {}  # node id -> its group's directory


def _usage(group: str) -> float:
    with open(os.path.join(group, "cpuacct.usage")) as f:
        return int(f.read()) / 1e9


def _move(group: str) -> None:
    with open(os.path.join(group, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))


def _write(line: Dict[str, Any]) -> None:
    with open(OUT, "a") as f:  # one write per line: several workers append to one file
        f.write(json.dumps(line) + "\n")


def _usable() -> Optional[str]:
    if not OUT:
        return "RGT_TEST_CPU is not set"
    if not os.access(os.path.join(ROOT, "cgroup.procs"), os.W_OK):
        return f"{ROOT} is not writable (needs root and cgroup v1 cpuacct)"
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    if _usable() is not None:
        yield
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    group = os.path.join(ROOT, f"rgt-test-{os.getpid()}-{len(_groups)}")
    os.mkdir(group)
    _groups[item.nodeid] = group
    _move(group)
    t0 = time.monotonic()
    try:
        yield
    finally:
        _move(ROOT)  # the process leaves; its test's children stay and keep counting
        wall = time.monotonic() - t0
        _write({"test": item.nodeid, "worker": worker, "cpu": _usage(group), "wall": wall})


def pytest_sessionfinish(session: pytest.Session) -> None:
    for nodeid, group in _groups.items():
        try:
            _write({"test": nodeid, "final": _usage(group)})
            os.rmdir(group)  # refused while a process of it lives: left for the next boot
        except OSError:
            pass


def pytest_report_header(config: pytest.Config) -> Optional[str]:
    why = _usable()
    return f"cpuacct: not measuring ({why})" if why else f"cpuacct: per-test CPU to {OUT}"
