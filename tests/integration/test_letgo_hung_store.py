"""An agent letting go of a run whose store stopped answering still lets go: in time.

The store is a ``file://`` directory whose listings hang from a chosen moment on (hold point
``store.list``, onbox/common/faults.py: as on an NFS or FUSE mount whose server stopped
answering; the hold ends after HOLD_FOR, 120 s, a real hung mount's never). The run's step 1 is
sealed first; then the store hangs and the run ends: its job fails, `rgt-agent stop` stops it,
or a real SIGTERM preempts it with a grace. Before the fix the agent's last mirror of the run's
state to the store (``SealService.mirror_quietly``: a listing of the run's epochs, then the
puts) had no bound: the agent waited on the store, holding the run's lock, past the grace of a
preemption (its PREEMPTED not written in time), and after a stop or a failure as long as the
store hung. Now every store call of the letting go is bounded by ``[store] stall`` (a
preemption's by what is left of its grace): the agent says it with ``seal_error``, writes the
run's final state, lets go of the lock and exits, and a new `rgt-agent start` takes the run.

Real agents and jobs, a real SIGTERM; the test waits for the agent's PID with a bound (WAIT,
well under the hold's 120 s) and kills what is left by PID (the cli fixture).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Dict, List

import pytest

from tests.conftest import Cli
from tests.heldstore import end_while_held, held_store, running_with_step_one
from tests.polling import wait

RUN = "letgo"
GRACE = "5"
WAIT = 45.0  # the test's bound on the agent's exit: before the fix, the hold's 120 s
# Step 1, then "ready"; then the job waits for the file ``go`` and exits 3, or is stopped.
JOB = """\
import os, sys, time
d, go = os.environ["RGT_CKPT_DIR"], sys.argv[1]
os.makedirs(d, exist_ok=True)
if not os.path.exists(os.path.join(d, "step_1.pt")):
    with open(os.path.join(d, "step_1.pt.tmp"), "wb") as f:
        f.write(b"weights of step 1" * 100)
    os.replace(os.path.join(d, "step_1.pt.tmp"), os.path.join(d, "step_1.pt"))
print("ready", flush=True)
while not os.path.exists(go):
    time.sleep(0.05)
print("RuntimeError: CUDA error", file=sys.stderr, flush=True)
sys.exit(3)
"""


def _events(cli: Cli, kind: str) -> List[Dict[str, Any]]:
    return [e for e in cli.events(RUN) if e["kind"] == kind]


def _start(cli: Cli, tmp_path: Any, root: str, stall: str = "2s", grace: str = GRACE) -> None:
    job_py = tmp_path / "job.py"
    job_py.write_text(JOB)
    job = tmp_path / "job.toml"
    job.write_text(
        f"command = {json.dumps([sys.executable, str(job_py), str(tmp_path / 'go')])}\n"
        # start_grace: RUNNING (what running_with_step_one waits for) 1 s after the start,
        # not 5; the job never exits before the test tells it to.
        '[restart]\nmax_error_restarts = 0\nstart_grace = "1s"\n'
        '[store]\nurl = "file://' + root + '"\n'
        f'stall = "{stall}"\n'
    )
    cli("start", str(job), "--name", RUN, "--grace", grace, check=True, cwd=cli.home)


@pytest.mark.parametrize(
    "how, hold",
    [
        ("fail", "store.list"),
        ("stop", "store.list"),
        ("preempt", "store.list"),
        ("fail", "store.put_file"),
        ("stop", "store.put_file"),
    ],
)
def test_an_agent_letting_go_on_a_hung_store_exits_in_time_and_frees_the_run(
    cli: Cli, tmp_path: Any, how: str, hold: str
) -> None:
    """Step 1 sealed, then the store's listings (or its uploads of files: the job's logs)
    hang; the run ends (``how``). The agent ends the run FAILED, STOPPED or PREEMPTED on the
    box, says the store's silence with seal_error (a remedy that names the store's stall),
    exits within WAIT, and a new `rgt-agent start` of the run is not refused. Before the fix
    it waited on the hold (120 s): a failed run's agent, and a stopped one's (`rgt-agent stop`
    failed, exit 10: the lock still held); a preempted one with the run still STOPPING."""
    root = str(tmp_path / "store")
    os.makedirs(root)
    release = tmp_path / "store-answers"
    release.write_text("")
    cli.env.update(RGT_HOLD_AT=hold, RGT_HOLD_UNTIL=str(release))
    _start(cli, tmp_path, root)
    pid, agent = running_with_step_one(cli, RUN, root)
    release.unlink()  # from here on the store hangs there
    final = {"fail": "FAILED", "stop": "STOPPED", "preempt": "PREEMPTED"}[how]
    end_while_held(cli, RUN, tmp_path, how, pid, agent, release, WAIT)
    assert cli.peek(RUN)["state"] == final
    errors = _events(cli, "seal_error")
    said = ("did not answer", "not asked", "took nothing")  # a call, or an upload that hung
    hung = [e for e in errors if any(s in e["reason"] for s in said)]
    assert hung and all("[store] stall" in e["remedy"] for e in hung), errors
    assert len(hung) == len({e["reason"] for e in hung}), errors  # none said twice
    del cli.env["RGT_HOLD_AT"]
    (tmp_path / "go").write_text("")  # the new attempt fails at once
    _start(cli, tmp_path, root)
    cli.wait_over(RUN, "FAILED", timeout=60)


def test_a_preemption_while_the_sealing_thread_hangs_in_a_listing_says_what_it_was_doing(
    cli: Cli, tmp_path: Any
) -> None:
    """The sealing thread is held in a listing of the store (its pass's, not an upload: no
    checkpoint is new) when a SIGTERM with a grace of 3 s comes, its stall bound (60 s) far
    past the grace: the final seal cannot begin, and seal_cut says where the thread was. Before
    the fix it said "an upload was still running", whatever the thread was doing."""
    root, release, reached = held_store(cli.env, tmp_path, "store.list", "list-held")
    _start(cli, tmp_path, root, stall="60s", grace="3")
    pid, agent = running_with_step_one(cli, RUN, root)
    release.unlink()  # from here on the store's listings hang
    wait(reached.exists, 60, "the sealing thread held in a listing")
    end_while_held(cli, RUN, tmp_path, "preempt", pid, agent, release, WAIT)
    assert cli.peek(RUN)["state"] == "PREEMPTED"
    [cut] = _events(cli, "seal_cut")
    assert "the sealing thread was still " in cut["reason"], cut
    assert "upload" not in cut["reason"] and "LATEST stays at step 1" in cut["reason"], cut
