"""A stalled job, seen by a real agent: it stops stepping while a thread keeps printing, and the
stall probe dumps every thread's stack, says why in an event, and restarts it from the newest
sealed checkpoint (a file:// store in the test's directory). A job stuck in C calls (a sleep, a
blocked read) still gets its stacks: through py-spy, and with py-spy hidden (``RGT_PYSPY=off``)
through the faulthandler hook rgt's sitecustomize installs in the job's Python. Every job is
bounded (its own deadline) and the ``cli`` fixture kills what is left by PID.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from typing import Any, Dict, List

import pytest

from onbox.common.rundir import RunDir
from onbox.health.stacks import pyspy_path
from tests.conftest import Cli, fixture, require
from tests.polling import latest_step, wait

STEPS = fixture("stall_steps.py")
CCALL = fixture("stall_ccall.py")
SLOWSTART = fixture("stall_slowstart.py")


def _job(
    cli: Cli,
    name: str,
    command: List[str],
    extra: str,
    stall: str = 'startup = "60s"',
    warmup: int = 3,
) -> str:
    path = os.path.join(cli.home, f"{name}.toml")
    with open(path, "w") as f:
        f.write(
            f"command = {json.dumps(command)}\n{extra}"
            "[health]\ninterval = 1\n"
            f'[health.stall]\nfloor = "3s"\nwarmup = {warmup}\n{stall}\n'
        )
    return path


def _events(cli: Cli, name: str, kind: str) -> List[Dict[str, Any]]:
    return [e for e in cli.events(name) if e["kind"] == kind]


def _stacks(cli: Cli, name: str, attempt: int) -> str:
    try:
        with open(RunDir(name, home=cli.home).stacks(attempt)) as f:
            return f.read()
    except OSError:
        return ""


def _stall_reason(cli: Cli, name: str) -> str:
    """The stall probe's last verdict, as `rgt-agent status --json` shows it ('' before one)."""
    probes = (cli.peek(name).get("health") or {}).get("probes") or {}
    return str((probes.get("stall") or {}).get("reason") or "")


def test_a_job_that_stops_stepping_while_printing_is_restarted_from_the_sealed_checkpoint(
    cli: Cli, tmp_path: Any
) -> None:
    root = str(tmp_path / "durable")
    os.makedirs(root, exist_ok=True)
    go = str(tmp_path / "stall-now")
    job = _job(
        cli,
        "st1",
        [*STEPS, go],
        f'store = "file://{root}"\n[checkpoint]\nscan = "1s"\n',
    )
    cli("start", job, "--name", "st1", check=True)
    wait(lambda: latest_step(root, "st1") == 5, timeout=60, what="step 5 sealed")
    # A job that trained a while, then hung: the probe has seen the warm-up's steps and learned
    # the step interval (its budget is the floor's few seconds, not the 60 s start-up budget a
    # hang in the warm-up would wait out).
    wait(lambda: "longest interval" in _stall_reason(cli, "st1"), 60, "a learned stall budget")
    open(go, "w").close()  # the training loop hangs now; the heartbeat thread goes on
    st = cli.wait_state("st1", "SUCCEEDED", "FAILED", timeout=90)
    assert st["state"] == "SUCCEEDED" and st["attempt"] == 2, st

    health = [e for e in _events(cli, "st1", "health") if e.get("code") == "stalled"]
    assert len(health) == 1 and health[0]["level"] == "alert"
    assert "no step for" in health[0]["reason"] and "last step" in health[0]["reason"]
    (stall,) = _events(cli, "st1", "stall")
    assert stall["stacks"] == RunDir("st1", home=cli.home).stacks(1)
    text = _stacks(cli, "st1", 1)
    assert "wait_for_peers" in text and "heartbeat" in text  # both threads
    assert any("wait_for_peers" in f for f in stall["frames"]), stall["frames"]

    first = [e for e in _events(cli, "st1", "exit") if e["reason"].startswith("attempt 1:")]
    assert first and "stalled" in first[0]["reason"] and first[0]["exit_kind"] == "stalled"
    out = cli("logs", "st1").stdout
    # Attempt 2 resumed from the sealed step (within an incarnation the sealing service sends
    # no RGT_RESUME_FROM while the box's newest checkpoint is that one: the job takes it).
    assert latest_step(root, "st1") == 5
    assert "attempt 2 resumed at step 5" in out, out[-2000:]
    assert "heartbeat" in out  # the thread did keep printing: freshness was no liveness


@pytest.mark.parametrize("path", ["py-spy", "faulthandler"])
def test_a_job_stuck_in_c_calls_still_gets_every_threads_stack(cli: Cli, path: str) -> None:
    if path == "py-spy":
        require(pyspy_path(os.environ) is not None, "py-spy (the stacks extra)")
    else:
        cli.env["RGT_PYSPY"] = "off"
    # A shell in the attempt's tree: no Python, no handler; the signal must not reach it
    # (a real-time signal kills a process without one, and this shell is the job).
    py = " ".join(shlex.quote(a) for a in CCALL)
    job = _job(cli, "st2", ["sh", "-c", f"{py} & wait"], "", 'startup = "3s"\naction = "alert"')
    cli("start", job, "--name", "st2", check=True)
    wait(lambda: _events(cli, "st2", "stall"), timeout=60, what="the stall")
    (stall,) = _events(cli, "st2", "stall")
    text = _stacks(cli, "st2", 1)
    assert "sleep_in_c" in text and "blocked_read" in text, text
    assert list(stall["how"].values()) == [path], stall["how"]
    if path == "faulthandler":
        assert "most recent call first" in text  # faulthandler's own format
    st = cli.status("st2")
    # the shell survived (alert only); the stall may come before the start grace ended
    assert st["state"] in ("STARTING", "RUNNING") and st["attempt"] == 1, st
    assert not _events(cli, "st2", "exit")
    cli("stop", "st2", "--grace", "1", check=True)


def test_slow_first_steps_past_the_warm_up_do_not_set_the_budget_of_a_later_hang(
    cli: Cli,
) -> None:
    """The job's first steps are slow for a one-off reason (6 s each, for more steps than the
    warm-up counts: a compile, graph capture, workers spinning up), then it steps every 0.1 s,
    then hangs. The budget the hang is judged by comes from the fast steps (floor 3 s, 2 x the
    ~1 s the probe sees between ticks), not from 2 x the 6 s slow ones."""
    slow, slow_steps, fast_steps = 6.0, 4, 40
    job = _job(
        cli,
        "st3",
        [*SLOWSTART, str(slow), str(slow_steps), str(fast_steps)],
        "",
        'startup = "60s"\nfactor = 2\naction = "alert"',
        warmup=2,
    )
    cli("start", job, "--name", "st3", check=True)
    wait(lambda: _events(cli, "st3", "stall"), timeout=90, what="the stall")
    (stall,) = _events(cli, "st3", "stall")
    # Not during the slow steps: after the last fast one.
    assert stall["step"] == slow_steps + fast_steps, stall
    reason = stall["reason"]
    since = float(re.search(r"no step for ([0-9.]+) s", reason).group(1))  # type: ignore[union-attr]
    budget = float(re.search(r"budget ([0-9.]+) s", reason).group(1))  # type: ignore[union-attr]
    # The slow steps, seen at 1 s ticks, are at least 5 s apart: learned, they would make the
    # budget at least 2 x 5 s. The fast ones are a tick apart.
    assert budget < 2 * (slow - 1), reason
    assert since < 2 * (slow - 1), reason
    cli("stop", "st3", "--grace", "1", check=True)
