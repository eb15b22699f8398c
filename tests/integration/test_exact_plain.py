"""Resume exactness of the plain training API (examples/train_plain.py) under a real agent.

What a user relies on: a run interrupted any number of times, in any of the ways boxes die,
ends bitwise where the uninterrupted run ends (weights, optimizer state, RNG states), and once
the steps trained past each restore point are discarded (they were lost with the box), every
step was trained exactly once. The interruptions, at random points (the seed is printed):
SIGKILL of the job, SIGTERM of the agent (a preemption: the job checkpoints and exits, the run
is started again), and the box gone (stop, delete every local directory, start again on an
empty one: restored from the durable store).
"""

from __future__ import annotations

import importlib.util
import os
import random
import re
import signal
import subprocess
import sys
import time
from typing import Callable, Dict, List, Tuple

import pytest

from tests.beside import Beside
from tests.conftest import ROOT, Cli, require

EXAMPLE = os.path.join(ROOT, "examples", "train_plain.py")
STEPS = 240
ARGS = ["--steps", str(STEPS), "--ckpt-every", "15", "--sleep", "0.03"]
HASHES = ("weights", "optimizer", "rng")


def _hashes(out: str) -> Dict[str, str]:
    found = dict(re.findall(r"^(\w+) sha256 ([0-9a-f]{64})$", out, re.M))
    assert set(HASHES) <= set(found), out[-2000:]
    return {k: found[k] for k in HASHES}


def _segments(log: str) -> List[Tuple[int, List[int]]]:
    """(resumed-from step, steps trained) of each job process, in order."""
    segs: List[Tuple[int, List[int]]] = []
    resumed = 0
    last_attempt = None
    for line in log.splitlines():
        m = re.match(r"resumed at step (\d+) ", line)
        if m:
            resumed = int(m.group(1))
            last_attempt = None  # the next step line starts a new process
            continue
        m = re.match(r"step (\d+) attempt (\S+) loss ", line)
        if m:
            if last_attempt != m.group(2):
                segs.append((resumed, []))
                resumed = 0
                last_attempt = m.group(2)
            segs[-1][1].append(int(m.group(1)))
    return segs


def _check_steps(log: str) -> int:
    """Every step trained exactly once after discarding what each restore rolled back; the
    number of processes seen."""
    kept: List[int] = []
    segs = _segments(log)
    for resumed, steps in segs:
        assert steps and steps[0] == resumed + 1, (resumed, steps[:3])
        assert resumed <= len(kept), f"resumed at {resumed} but only {len(kept)} steps ran"
        kept = kept[:resumed] + steps
    assert kept == list(range(1, STEPS + 1))
    return len(segs)


@pytest.mark.timeout(900)  # minutes of real training and deploys, more under load
def test_exact_plain_api_survives_kills_preemptions_and_a_fresh_box(
    cli: Cli, tmp_path: object
) -> None:
    require(importlib.util.find_spec("torch") is not None, "torch (pip install torch==2.13.0)")
    require(importlib.util.find_spec("numpy") is not None, "numpy")
    env = dict(os.environ, PYTHONPATH=ROOT)
    # The uninterrupted run, beside the run under test rather than before it (faults come at
    # steps, not at times: its share of the CPU changes no step).
    plain_dir = os.path.join(str(tmp_path), "plain")
    os.makedirs(plain_dir)
    plain = Beside([sys.executable, EXAMPLE, *ARGS], plain_dir, env)
    try:
        _interrupted(cli, str(tmp_path), plain)
    finally:
        plain.kill()


def _interrupted(cli: Cli, tmp: str, plain: Beside) -> None:
    """The run under test, interrupted by faults at random steps, and its end checked against
    the uninterrupted run ``plain``."""
    seed = random.randrange(1 << 30)
    print(f"interruption points from seed {seed}")
    rnd = random.Random(seed)
    root = os.path.join(tmp, "durable")
    os.makedirs(root)
    start = ["start", "--name", "ex", "--store", "file://" + root, "--grace", "20", "--"]
    start += [sys.executable, EXAMPLE, *ARGS]
    cli(*start, check=True)
    earlier = ""  # logs of the box that is gone

    def step_now() -> int:
        found = re.findall(r"^step (\d+) ", cli.log_text("ex"), re.M)
        return int(found[-1]) if found else 0

    def when_past(step: int) -> None:
        deadline = time.monotonic() + 180
        while step_now() < step:
            assert time.monotonic() < deadline, f"the job never reached step {step}"
            time.sleep(0.1)

    def sigkill_job() -> None:
        st = cli.status("ex")
        os.kill(st["pid"], signal.SIGKILL)
        # A new attempt began: STARTING or RUNNING, or already SUCCEEDED where few steps were
        # left (under load the agent may go from STARTING straight to SUCCEEDED, never RUNNING).
        began = ("STARTING", "RUNNING", "SUCCEEDED")
        cli.wait_for(
            "ex", lambda s: s["attempt"] > st["attempt"] and s["state"] in began, 60, "restart"
        )

    def preempt() -> None:
        os.kill(cli.status("ex")["agent"]["pid"], signal.SIGTERM)
        cli.wait_over("ex", "PREEMPTED", timeout=60)
        cli(*start, check=True)

    def box_gone() -> None:
        nonlocal earlier
        cli("stop", "ex", "--grace", "20", check=True)
        earlier += cli("logs", "ex", check=True).stdout
        subprocess.run(["rm", "-rf", os.path.join(cli.home, "runs")], check=True)
        cli(*start, check=True)

    faults: List[Callable[[], None]] = [sigkill_job, preempt, box_gone, sigkill_job]
    at = 0
    for fault in faults:
        at = step_now() + rnd.randrange(20, 45)
        when_past(at)
        fault()
    cli.wait_state("ex", "SUCCEEDED", timeout=300)
    log = earlier + cli("logs", "ex", check=True).stdout

    assert _hashes(log) == _hashes(plain.output(timeout=300))
    assert _check_steps(log) >= len(faults) + 1
    kinds = [e["kind"] for e in cli.events("ex")]
    assert "restored" in kinds  # the last box began empty and resumed from the store
