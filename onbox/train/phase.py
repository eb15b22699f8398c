"""``with onbox.train.phase("eval"):`` tells the agent that the job is in a stretch with no
training steps (an evaluation, a long checkpoint write of its own), so that the stall probe gives
it that phase's budget (``[health.stall] eval`` / ``checkpoint``) instead of the step budget.

It rewrites progress.json (onbox/common/progress.py) at once, with the step the job last
reported and the phase; on the way out, without the phase. Outside the agent (no RGT_RUN_DIR)
it does nothing. Standard library only: it runs in the job's own Python.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

from onbox.common import jobenv, progress

PHASES = ("checkpoint", "eval")


def _write(phase_name: str = "") -> None:
    run_dir = os.environ.get(jobenv.RUN_DIR)
    if not run_dir:
        return
    attempt = int(os.environ.get(jobenv.ATTEMPT, "0") or 0)
    last = progress.read(run_dir)
    mine = last is not None and last.get("attempt") == attempt
    step = int(last["step"]) if last is not None and mine else 0
    metrics = last.get("metrics") if last is not None and mine else None
    save = progress.last_save(last) if mine else None
    try:
        progress.write(run_dir, step, attempt, metrics, phase=phase_name or None, save=save)
    except OSError:
        pass  # advisory: never fail training over it


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """The block is a ``name`` phase ("checkpoint" or "eval") for the stall probe."""
    if name not in PHASES:
        raise ValueError(f"phase {name!r} is not one of {', '.join(PHASES)}")
    _write(name)
    try:
        yield
    finally:
        _write()
