"""The job's progress report: ``$RGT_RUN_DIR/progress.json``, written by the training-side API
(``onbox.train``) and read by the agent.

One JSON object, replaced atomically (temporary name, rename; no fsync: it is advisory and
rewritten often)::

    {"step": 1200, "attempt": 3, "pid": 4242, "time": 1764500000.0, "metrics": {"loss": 0.12}}

and, while the job writes a checkpoint or evaluates, ``"phase": "checkpoint"`` (or ``"eval"``);
once the job has saved, ``"save": {"step": 1000, "blocked_s": 0.042}``: the step of its last
checkpoint and how long that save held the training loop, which is what a checkpoint costs the
job (the agent's ``interval = "auto"`` takes it as Daly's d; the seal runs beside training).

``step`` is the number of optimizer steps the job has completed (the step a checkpoint taken now
would carry); ``attempt`` is the job's ``RGT_ATTEMPT``, so the agent can tell a report of this
attempt from one the previous attempt left behind. Scripts that do not use the API can report
through their log instead (``progress.pattern`` in the job file). Standard library only: this
module runs in the box's own Python.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from typing import Any, Dict, Optional, Tuple

from onbox.common.errors import UsageError

FILE = "progress.json"


def path_in(run_dir: str) -> str:
    """Where the progress report of the run in ``run_dir`` lives."""
    return os.path.join(run_dir, FILE)


def write(
    run_dir: str,
    step: int,
    attempt: int,
    metrics: Optional[Dict[str, Any]] = None,
    phase: Optional[str] = None,
    save: Optional[Tuple[int, float]] = None,
) -> None:
    """Replace the report atomically; a reader sees the old one or the new one, never a mix.

    ``phase`` ("checkpoint", "eval") says the job is in a stretch with no steps: the stall probe
    gives it that phase's budget instead of the step budget (onbox/health/stall.py)."""
    doc: Dict[str, Any] = {
        "step": int(step),
        "attempt": int(attempt),
        "pid": os.getpid(),
        "time": time.time(),
    }
    if phase:
        doc["phase"] = str(phase)
    if save is not None:
        doc["save"] = {"step": int(save[0]), "blocked_s": round(float(save[1]), 6)}
    if metrics:
        doc["metrics"] = {k: _plain(v) for k, v in metrics.items()}
    final = path_in(run_dir)
    tmp = f"{final}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, final)


def read(run_dir: str) -> Optional[Dict[str, Any]]:
    """The last report, or None when there is none or it cannot be read."""
    try:
        with open(path_in(run_dir)) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("step"), int):
        return None
    return doc


def last_save(doc: Optional[Dict[str, Any]]) -> Optional[Tuple[int, float]]:
    """(step, seconds the loop was blocked) of the job's last save in a report, or None
    (also for a cost that is no finite number of seconds >= 0)."""
    save = doc.get("save") if isinstance(doc, dict) else None
    if not isinstance(save, dict):
        return None
    step, blocked = save.get("step"), save.get("blocked_s")
    if not isinstance(step, int) or isinstance(step, bool):
        return None
    if not isinstance(blocked, (int, float)) or isinstance(blocked, bool):
        return None
    try:
        cost = float(blocked)
    except OverflowError:  # an int of hundreds of digits
        return None
    # A NaN, infinite or negative cost is no measurement (the agent's interval would be one).
    return (step, cost) if math.isfinite(cost) and cost >= 0 else None


def _plain(v: Any) -> Any:
    """A metric as JSON can hold it (a 0-d tensor or numpy scalar becomes a float)."""
    if isinstance(v, (int, float, str, bool)) or v is None:
        return v
    item = getattr(v, "item", None)
    if callable(item):
        try:
            return item()
        except (TypeError, ValueError, RuntimeError):
            pass
    return str(v)


def compile_progress_pattern(value: Any, field: str = "progress.pattern") -> re.Pattern[str]:
    """The job's step pattern, compiled: a regex with exactly one group, or a group named
    ``step``, matched against each line of the job's output (``'step (\\d+)'``)."""
    example = "e.g. pattern = 'step (\\d+)' or 'it=(?P<step>\\d+)'"
    if not isinstance(value, str) or not value:
        raise UsageError(field, f"{value!r} is not a regular expression", example)
    try:
        rx = re.compile(value)
    except re.error as e:
        raise UsageError(
            field, f"{value!r} is not a valid regular expression: {e}", example
        ) from None
    if "step" not in rx.groupindex and rx.groups != 1:
        what = "no group" if rx.groups == 0 else f"{rx.groups} groups, none named step,"
        raise UsageError(field, f"{value!r} has {what} to capture the step", example)
    return rx
