"""rgt-agent with real processes, when the job's pid is handed to somebody else.

The job's main process ends at a stop's SIGTERM while a child it made (out of the job's session)
holds the run in STOPPING. An unrelated process that then gets the main process's pid, and leads
a session and group of that id, must survive the stop's SIGKILL escalation.
"""

from __future__ import annotations

import os
import subprocess

from onbox.agent import procfs
from tests.conftest import Cli, agent_exe, fixture
from tests.pidreuse import squatter
from tests.polling import wait


def test_stop_spares_an_unrelated_process_that_reused_the_dead_jobs_pid(cli: Cli) -> None:
    cli("start", "--name", "pr", "--grace", "4", "--", *fixture("term_leaves_child.py"), check=True)
    path = os.path.join(cli.home, "runs", "pr", "child.pid")
    wait(lambda: os.path.exists(path), 30, "the job's child is up")
    with open(path) as f:
        child = procfs.identity(int(f.read()))
    job = cli.status("pr")["pid"]
    assert child is not None and procfs.identity(job) is not None
    stopper = subprocess.Popen(
        [*agent_exe(), "stop", "pr"],
        env=cli.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        # The main process ends at SIGTERM and the shim reaps it: its pid is free for anyone.
        wait(lambda: procfs.read_stat(job) is None, 30, "the job's main process is reaped")
        with squatter(job) as stranger:
            assert procfs.is_alive(child)  # the run is still STOPPING, SIGKILL yet to come
            out, _ = stopper.communicate(timeout=60)
            assert stopper.returncode == 0 and "STOPPED" in out, out
            assert not procfs.is_alive(child)  # the escalation reached the job's own child
            assert procfs.is_alive(stranger), "the stop killed a process that was not the job's"
    finally:
        if stopper.poll() is None:
            stopper.kill()
        stopper.communicate()
