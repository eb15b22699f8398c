"""Sizes as users write them (``"20G"``, ``"512M"``, ``"1.5T"``, ``4096``), for flags, job files and
the doctor alike. Powers of 1024."""

from __future__ import annotations

import re
from typing import Any

from onbox.common.errors import UsageError

_SIZE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?)(i?B?)?\Z", re.IGNORECASE)


def parse_size(value: Any, field: str) -> int:
    """Bytes of ``"20G"``, ``"512M"``, ``"1.5T"``, ``"4096"`` or ``4096``; UsageError otherwise."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    m = _SIZE.match(str(value).strip()) if isinstance(value, str) else None
    if not m:
        raise UsageError(field, f"{value!r} is not a size", 'e.g. "20G", "512M" or 4096')
    scale = 1024 ** "KMGT".find(m.group(2).upper()) * 1024 if m.group(2) else 1
    return int(float(m.group(1)) * scale)


def human(n: float) -> str:
    """``n`` bytes for a person: "1.50 GiB", "12.0 MiB", "512 B"."""
    if n >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    if n >= 1 << 10:
        return f"{n / (1 << 10):.1f} KiB"
    return f"{int(n)} B"
