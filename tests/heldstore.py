"""A real agent's ``file://`` store held at a hook point (onbox/common/faults.py), as a hung
mount holds it, and a run ended while it is held: the set-up the tests of an agent letting go of
its run on a hung store share (test_letgo_hung_store.py, test_upload_stall.py)."""

from __future__ import annotations

import os
import signal
from typing import Any, Dict, Tuple

from onbox.agent import procfs
from tests.polling import latest_step, wait

# A job for these tests: step 1 (small), then "ready"; once the file ``more`` exists in the
# directory it is given, step 2 (``step2``'s bytes), then "step 2"; then it waits for ``go`` and
# exits with the code it was given, or is stopped. Arguments: that directory, the exit code.
_STAGED_JOB = """\
import os, sys, time
d, tmp, code = os.environ["RGT_CKPT_DIR"], sys.argv[1], int(sys.argv[2])
os.makedirs(d, exist_ok=True)

def write(step, data):
    path = os.path.join(d, f"step_{step}.pt")
    if not os.path.exists(path):
        with open(path + ".tmp", "wb") as f:
            f.write(data)
        os.replace(path + ".tmp", path)

def wait(name):
    while not os.path.exists(os.path.join(tmp, name)):
        time.sleep(0.05)

write(1, b"weights of step 1" * 100)
print("ready", flush=True)
wait("more")
write(2, @STEP2@)
print("step 2", flush=True)
wait("go")
sys.exit(code)
"""


def staged_job(step2: str) -> str:
    """The staged job's text, its step 2 written from the Python expression ``step2``."""
    return _STAGED_JOB.replace("@STEP2@", step2)


def held_store(env: Dict[str, str], tmp: Any, at: str, reached: str) -> Tuple[str, Any, Any]:
    """A ``file://`` store's directory under ``tmp`` whose agent (run with ``env``) will hang
    at the hold point ``at`` (onbox/common/faults.py) once the returned ``release`` file is
    removed, and let go once it is written again; the agent writes ``tmp/reached`` when it
    starts waiting there: (the store's root, release, reached)."""
    root = os.path.join(str(tmp), "store")
    os.makedirs(root)
    release, held = tmp / "store-answers", tmp / reached
    release.write_text("")
    env.update(RGT_HOLD_AT=at, RGT_HOLD_UNTIL=str(release), RGT_HOLD_REACHED=str(held))
    return root, release, held


def running_with_step_one(cli: Any, run: str, root: str) -> Tuple[int, Any]:
    """Wait for ``run`` RUNNING, its job ready and step 1 sealed in ``root``: (the agent's
    pid, its identity for ``procfs.is_alive``)."""
    cli.wait_state(run, "RUNNING")
    cli.wait_output(run, "ready")
    wait(lambda: latest_step(root, run) == 1, 60, "step 1 sealed")
    pid = cli.status(run)["agent"]["pid"]
    return pid, procfs.identity(pid)


def end_while_held(
    cli: Any, run: str, tmp: Any, how: str, pid: int, agent: Any, release: Any, bound: float
) -> None:
    """End ``run`` ``how`` while its store is held (fail or success: the job's ``go`` file;
    stop: `rgt-agent stop`; preempt: SIGTERM to the agent), wait up to ``bound`` for the agent
    to exit, then let the store answer again (the hold lets its threads go)."""
    if how in ("fail", "success"):
        (tmp / "go").write_text("")
    elif how == "stop":
        p = cli("stop", run, "--grace", "1", timeout=bound + 30)
        assert p.returncode == 0, (p.stdout, p.stderr)
    else:
        os.kill(pid, signal.SIGTERM)
    try:
        wait(lambda: not procfs.is_alive(agent), bound, f"the agent (pid {pid}) to exit")
    finally:
        release.write_text("")
