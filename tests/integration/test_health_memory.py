"""The memory probe in a real agent inside a real cgroup v1 memory limit: a job's child process
grows toward the limit, the probe's warning names that child as the biggest process of the
attempt, and once the OOM killer takes it the verdict is an ``oom_kill`` alert naming it.
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any, Dict, Iterator

import pytest

from tests import mounts
from tests.conftest import Cli, agent_exe, fixture, require
from tests.polling import wait

NAME = "memhog"
LIMIT = 300 << 20


@pytest.fixture
def cgroup() -> Iterator[str]:
    """A cgroup v1 memory group of our own with LIMIT bytes and no swap; at the end every
    process left in it is killed by PID and the group removed."""
    path = mounts.memory_cgroup(LIMIT, "rgt-health")
    require(bool(path), "root and a writable cgroup v1 memory controller")
    try:
        yield path
    finally:
        mounts.remove_cgroup(path)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return ""


def _memory(st: Dict[str, Any]) -> Dict[str, Any]:
    probes: Dict[str, Any] = (st.get("health") or {}).get("probes") or {}
    return probes.get("memory") or {}


def test_memory_warning_names_the_child_and_its_oom_kill_is_an_alert(
    cgroup: str, cli: Cli, tmp_path: Any
) -> None:
    go = str(tmp_path / "go")
    job = os.path.join(cli.home, "job.toml")
    with open(job, "w") as f:
        f.write(
            f"command = {json.dumps([*fixture('mem_child.py'), '128', go])}\n"
            "[restart]\nmax_error_restarts = 0\n"
            "[health]\ninterval = 1\n"
            "[health.memory]\nwarn_at = 0.4\n"
        )
    # The agent starts inside the cgroup, so that it and everything it starts count there.
    wrapper = f"echo $$ > {cgroup}/cgroup.procs && exec {' '.join(agent_exe())} start {job} "
    wrapper += f"--name {NAME}"
    p = subprocess.run(
        ["bash", "-c", wrapper],
        env=cli.env,
        cwd=cli.home,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, (p.stdout, p.stderr)
    child = int(wait(lambda: _read(go + ".pid"), 60, "the job's child holding its memory"))
    st = cli.wait_for(NAME, lambda s: _memory(s).get("level") == "warn", 60, "memory warning")
    mem = _memory(st)
    assert mem["code"] == "memory_high", mem
    assert mem["data"]["limit"] == LIMIT and cgroup in mem["data"]["where"]
    assert mem["data"]["top"][0]["pid"] == child, mem["data"]["top"]
    assert mem["data"]["top"][0]["rss"] >= 128 << 20
    assert f"pid {child}" in mem["reason"] and "of 300.0 MiB" in mem["reason"]
    open(go, "w").close()  # the child grows past the limit
    st = cli.wait_for(NAME, lambda s: _memory(s).get("code") == "oom_kill", 60, "the OOM alert")
    mem = _memory(st)
    assert mem["level"] == "alert"
    assert "OOM killer killed 1 process" in mem["reason"] and f"pid {child}" in mem["reason"]
    assert mem["data"]["cause"]["pid"] == child
    assert mem["remedy"]
    events = [e for e in cli.events(NAME) if e.get("kind") == "health"]
    assert any(e.get("probe") == "memory" and e.get("code") == "oom_kill" for e in events), events
    assert os.path.exists(f"/proc/{st['pid']}")  # the job itself lives on: only its child died
