"""An attempt whose job ends before the agent has looked at its shim is still seen to end.

The shim reports the job started, then waits for it, records its exit and exits. A job that
fails at once (a bad argument, an import error) can end, and its shim with it, between the
shim's report and the agent's next line: under load the agent is descheduled right there (CI
caught a run left RUNNING with its job long dead). The shim is then a zombie, the agent's own
unreaped child. Real shim, real job; the test holds the agent's side back until the shim has
exited, as the scheduler did.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, List, Optional

from onbox.agent import procfs, runner
from onbox.agent.classify import ExitStatus
from onbox.agent.runner import ShimRunner
from onbox.agent.spec import JobSpec
from onbox.common.rundir import RunDir

WAIT = 30.0  # seconds: the most the shim may take to exit, and the agent to see the end


def _own_children() -> List[int]:
    pids: List[int] = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                pids += [int(p) for p in f.read().split()]
        except OSError:
            continue
    return pids


def test_an_attempt_that_ends_before_the_agent_looks_at_its_shim_is_seen_to_end(
    tmp_path: Any, monkeypatch: Any
) -> None:
    rd = RunDir("quick", home=str(tmp_path / "home"))
    os.makedirs(rd.path)
    job = (sys.executable, "-c", "raise SystemExit(3)")
    spec = JobSpec("quick", job, str(tmp_path), str(tmp_path / "ckpt"))
    # respawn_delay: the shim must not start an agent of its own (no lock is held here)
    agent = ShimRunner(rd, spec, agent_cmd=["false"], base_environ=os.environ, respawn_delay=3600)
    read_line = runner._read_line
    before = set(_own_children())  # the shim is the one child spawn adds (the job is its own)
    seen: List[int] = []

    def shims() -> List[int]:
        return [p for p in _own_children() if p not in before]

    def descheduled(fd: int, timeout: float) -> str:
        line = read_line(fd, timeout)  # the shim's report: the job started
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:  # ... and the agent runs again only once it is over
            pids = shims()
            states = [procfs.read_stat(p) for p in pids]
            if pids and all(st is not None and st.state == "Z" for st in states):
                seen.extend(pids)
                break
            time.sleep(0.01)
        return line

    monkeypatch.setattr(runner, "_read_line", descheduled)
    try:
        agent.spawn(1)
        assert seen, "the shim did not exit in time"
        status: Optional[ExitStatus] = None
        deadline = time.monotonic() + WAIT
        while status is None:
            fds, every = agent.watch_fds(), agent.poll_interval()
            # What the agent's loop waits on: without either, it would never look again.
            assert fds or every is not None, "nothing will wake the agent for this attempt"
            assert time.monotonic() < deadline, "the attempt's end was never seen"
            procfs.wait_readable(fds, every if every is not None else 1.0)
            status = agent.poll_exit()
        assert (status.code, status.signal) == (3, None)
        assert not shims()  # the zombie was reaped
    finally:
        agent.close()
