"""The mean time between failures M that the training API's ``interval="auto"`` assumes
(onbox/train/checkpointer.py): ``RGT_MTBF`` seconds from the job's environment, else observed
from the restarts of this incarnation (the agent's state.json: its ``restarts`` since
``started_ts``, both begun again by each `rgt-agent start`; RGT_ATTEMPT is not, and counted
a stopped and started run's attempts against its new start's time), else DEFAULT.

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


def mtbf(run_dir: Optional[str]) -> Tuple[float, str]:
    """M in seconds, and where it came from (for the line the API prints)."""
    env = _from_env()
    if env is not None:
        return env, jobenv.MTBF
    seen = _restarts(run_dir) if run_dir else None
    if seen is not None:
        n, lived = seen
        return max(lived / n, MIN_OBSERVED), f"observed: {n} restarts in {lived / 3600:.1f} h"
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


def _restarts(run_dir: str) -> Optional[Tuple[int, float]]:
    """(restarts, seconds) of this incarnation so far, from state.json; None before the first
    restart or where the document is unusable."""
    try:
        with open(os.path.join(run_dir, "state.json")) as f:
            doc = json.load(f)
        started, n = float(doc["started_ts"]), doc["restarts"]
    except (OSError, ValueError, KeyError, TypeError, OverflowError):
        return None
    lived = time.time() - started
    if isinstance(n, bool) or not (isinstance(n, int) and n > 0 and 0 < lived <= MAX_LIVED):
        return None
    return n, lived
