"""The goodput harness's short form (bench/goodput/goodput.py): one trace, rgt with
``checkpoint.interval = "auto"``, real preemptions (SIGTERM, no grace or a 10 s one, SIGKILL of
every process of the box, a fresh box with empty directories and a new agent that restores from
the store).

What a user relies on: across boxes, no step that counted is ever trained twice (each process
continues exactly from the step it was restored to, never past what was trained), and the run
ends bitwise where the preemption-free run beside it ends (weights, optimizer, RNG states); and
the interval counts as unplanned only the preemptions that lost work.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import re
import subprocess
import sys
from typing import Any, Dict, List

import pytest

from tests.conftest import ROOT, require

HARNESS = os.path.join(ROOT, "bench", "goodput", "goodput.py")
# Longer than the two 12 s boxes can train at 0.03 s a step (30 s at the least), so both are
# preempted mid-run whatever the machine's speed, and the third box finishes it.
STEPS = 1000
HASHES = ("weights", "optimizer", "rng")


def _hashes(out: str) -> Dict[str, str]:
    found = dict(re.findall(r"^(\w+) sha256 ([0-9a-f]{64})$", out, re.M))
    assert set(HASHES) <= set(found), out[-2000:]
    return {k: found[k] for k in HASHES}


def _kept(text: str) -> List[int]:
    """Replay the job's output in order: each resume throws away the steps past its restore
    point; a process that does not continue from it fails."""
    kept: List[int] = []
    resumed, fresh = 0, True
    for line in text.splitlines():
        m = re.match(r"resumed at step (\d+)$", line)
        if m:
            resumed, fresh = int(m.group(1)), True
            continue
        m = re.match(r"step (\d+) attempt \S+ at ", line)
        if not m:
            continue
        step = int(m.group(1))
        if fresh:
            assert resumed <= len(kept), f"resumed at {resumed}, only {len(kept)} trained"
            assert step == resumed + 1, f"restored to {resumed}, trained {step} first"
            kept, fresh = kept[:resumed], False
        assert step == len(kept) + 1, f"step {step} after {len(kept)}"
        kept.append(step)
    return kept


def _box_outputs(setup_dir: str) -> str:
    """Every attempt's output of every box, in order."""
    text = ""
    boxes = sorted(
        glob.glob(os.path.join(setup_dir, "box*")), key=lambda p: int(p.rsplit("box", 1)[1])
    )
    for box in boxes:
        logs = sorted(glob.glob(os.path.join(box, "home", "runs", "gp", "attempts", "*", "*.log")))
        for log in (p for p in logs if p.endswith("/output.log")):
            with open(log) as f:
                text += f.read()
    return text


# The grace: none, or one the final checkpoint and its seal fit in on a loaded machine (the
# job's save, the agent's seal of it, on two cores the rest of the suite shares: 3 s was once
# too short there). The preemption ends when the agent does, and the next box comes up then
# (--next-when-gone), so a long grace costs nothing.
@pytest.mark.timeout(240)
@pytest.mark.parametrize("grace", [0, 10])
def test_preempted_rgt_auto_never_redoes_a_counted_step_and_ends_exact(
    tmp_path: object, grace: int
) -> None:
    require(importlib.util.find_spec("torch") is not None, "torch (pip install torch==2.13.0)")
    require(importlib.util.find_spec("numpy") is not None, "numpy")
    tmp = str(tmp_path)
    trace = os.path.join(tmp, "trace.json")
    with open(trace, "w") as f:  # two boxes preempted 12 s after they are up, then one to the end
        json.dump(
            {
                "mtbp_min": 0.2,
                "seed": 0,
                "budget_min": 2.0,  # a bound: the run ends once the third box's job is done
                "delay_min": 0.01,
                "uptimes_min": [0.2, 0.2, 60.0],
            },
            f,
        )
    keep = os.path.join(tmp, "boxes")
    out = os.path.join(tmp, "result.json")
    argv = [sys.executable, HARNESS, "--trace", trace, "--grace", str(grace), "--k", "1"]
    argv += ["--setups", "auto", "--steps", str(STEPS), "--step-time", "0.03", "--floor", "1"]
    argv += ["--until-done", "--no-readme", "--next-when-gone", "--keep", keep, "--json", out]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=220)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    with open(out) as f:
        (point,) = json.load(f)
    assert point["preemptions"] == 2
    (row,) = point["rows"]
    assert "error" not in row, row
    point_dir = glob.glob(os.path.join(keep, "mtbp*"))[0]
    text = _box_outputs(os.path.join(point_dir, "rgt-auto"))
    assert _kept(text) == list(range(1, STEPS + 1))
    assert row["counted"] == STEPS and row["boxes"] == 3
    with open(os.path.join(point_dir, "preemption-free", "box0", "out.log")) as f:
        reference = f.read()
    assert _kept(reference) == list(range(1, STEPS + 1))
    assert _hashes(text) == _hashes(reference)
    # the agents chose the interval from the run's own history and said so
    events, per_box = [], []
    for path in sorted(
        glob.glob(os.path.join(point_dir, "rgt-auto", "box*", "home", "runs", "gp", "events.jsonl"))
    ):
        with open(path) as f:
            per_box.append([json.loads(line) for line in f if line.strip()])
        events += per_box[-1]
    chosen = [e for e in events if e["kind"] == "checkpoint_interval"]
    starts = [e for e in chosen if e["at_start"]]
    assert len(starts) == 3, chosen
    # With a grace the final checkpoint was sealed: nothing was lost, and the interval is not
    # shortened for it. With none, a preemption lost the work since the last seal (an unplanned
    # stop for the next box's M), unless the timer's checkpoint asked just before it was sealed
    # in the instant before the SIGKILL (a machine's timing: then it is covered).
    cov = [int(grace > 0 or _sealed_after_preempt(box)) for box in per_box[:2]]
    lost = [0, 1 - cov[0], 2 - cov[0] - cov[1]]
    covered = [0, cov[0], cov[0] + cov[1]]
    assert [e["base_unplanned"] for e in starts] == lost, starts
    assert [e["base_covered"] for e in starts] == covered, starts
    # d is what a checkpoint costs the job (the time its save held the loop, which the
    # training API reports and the sealer carries), not the seal that runs beside training:
    # every interval chosen from a measured d, the later boxes' first ones included, says so
    # and lies among the saves reported (which of the two is longer depends on the machine:
    # this job's checkpoint is small enough to seal in a few milliseconds)
    blocked = [
        max(float(e["blocked_s"]), 1e-3)
        for e in events
        if e["kind"] == "sealed" and isinstance(e.get("blocked_s"), float)
    ]
    assert blocked, events
    measured = [e for e in chosen if e["d"] is not None]
    assert len(measured) >= 2, chosen  # at least the second and third boxes' first choice
    for e in measured:
        assert "the job's blocked save" in e["reason"], e
        assert min(blocked) - 5e-4 <= e["d"] <= max(blocked) + 5e-4, (e, blocked)


def _sealed_after_preempt(events: List[Dict[str, Any]]) -> bool:
    """Whether a box sealed a step newer than its newest when the preemption's SIGTERM first
    showed: the agent's (``preempt``), or the job's exit by it, whichever it wrote first."""
    newest, after = -1, False
    for ev in events:
        by_term = ev["kind"] == "exit" and (ev.get("signal") == 15 or ev.get("code") == 143)
        if ev["kind"] == "preempt" or by_term:
            after = True
        elif ev["kind"] == "sealed":
            if after and ev["step"] > newest:
                return True
            newest = max(newest, ev["step"])
    return False
