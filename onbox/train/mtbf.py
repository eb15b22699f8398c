"""The mean time between failures M that the training API's ``interval="auto"`` assumes
(onbox/train/checkpointer.py): ``RGT_MTBF`` seconds from the job's environment, else observed
from this run's restarts (the agent's state.json), else DEFAULT.

Both sources are outside the API's hands: a value that is no finite number of seconds > 0 (an
``RGT_MTBF`` of 0, -5, nan or inf; a state.json whose start is -inf or in the future) is passed
over for the next source, never given to the formula, which would raise out of ``save()`` after
the checkpoint was written and end the training. An unusable ``RGT_MTBF`` is the user's to fix:
it is said once on stderr. Standard library only (the job's own Python).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Optional, Set, Tuple

from onbox.common import jobenv

DEFAULT = 4 * 3600.0  # spot boxes are commonly reclaimed within hours
MIN_OBSERVED = 60.0  # restarts closer together than this say more about the job than the box
MAX_LIVED = 10 * 365 * 86400.0  # a run older than ten years is a clock or a record gone wrong
_warned: Set[str] = set()  # the RGT_MTBF values already said to be unusable


def mtbf(run_dir: Optional[str], attempt: int) -> Tuple[float, str]:
    """M in seconds, and where it came from (for the line the API prints)."""
    env = _from_env()
    if env is not None:
        return env, jobenv.MTBF
    if run_dir and attempt > 1:
        lived = _lived(run_dir)
        if lived is not None:
            return max(lived / (attempt - 1), MIN_OBSERVED), (
                f"observed: {attempt - 1} restarts in {lived / 3600:.1f} h"
            )
    return DEFAULT, "default; set RGT_MTBF"


def _from_env() -> Optional[float]:
    raw = os.environ.get(jobenv.MTBF)
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if math.isfinite(value) and value > 0:
        return value
    if raw not in _warned:
        _warned.add(raw)
        print(
            f"rgt: {jobenv.MTBF}={raw!r} is not a number of seconds > 0: ignored (the mean "
            "time between failures is observed from the run's restarts, else 4 h)",
            file=sys.stderr,
            flush=True,
        )
    return None


def _lived(run_dir: str) -> Optional[float]:
    """Seconds since the run began (state.json's ``started_ts``), None where unusable."""
    try:
        with open(os.path.join(run_dir, "state.json")) as f:
            started = float(json.load(f)["started_ts"])
    except (OSError, ValueError, KeyError, TypeError, OverflowError):
        return None
    lived = time.time() - started
    return lived if 0 < lived <= MAX_LIVED else None  # NaN fails both
