"""Durations as users write them (``30``, ``"30s"``, ``"5m"``, ``"1h"``, ``"250ms"``, ``"1d"``), for
job files, flags and platform profiles alike."""

from __future__ import annotations

import math
import re
from typing import Any

from onbox.common.errors import UsageError

_DURATION_RE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(ms|s|m|h|d)?\s*\Z")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}
MAX_DURATION = 366 * 86400.0


def parse_duration(value: Any, field: str, *, allow_zero: bool = False) -> float:
    """Seconds from ``30``, ``2.5``, ``"30s"``, ``"5m"``, ``"1h"``, ``"250ms"``, ``"1d"``."""
    if isinstance(value, bool):
        raise UsageError(field, f"{value!r} is not a duration", "give seconds, e.g. 30 or '5m'")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        m = _DURATION_RE.match(str(value))
        if not m:
            raise UsageError(
                field, f"{value!r} is not a duration", "give seconds or a number with ms/s/m/h/d"
            )
        seconds = float(m.group(1)) * _UNITS[m.group(2)]
    if math.isnan(seconds) or math.isinf(seconds) or seconds < 0:
        raise UsageError(field, f"{value!r} is not a finite duration >= 0", "e.g. 30 or '5m'")
    if seconds == 0 and not allow_zero:
        raise UsageError(field, "must be greater than 0", "e.g. 30 or '5m'")
    if seconds > MAX_DURATION:
        raise UsageError(field, f"{value!r} is longer than a year", "use a realistic duration")
    return seconds
