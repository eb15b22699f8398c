"""`rgt report RUN`: one self-contained HTML file of a run over time.

The samples the agent's health watcher recorded (onbox/health/series.py) and the run's events,
from the box or, when the box does not answer, from the store's mirror (data.py), drawn as
inline SVG on one time axis (plots.py) in a page that needs no network to open (page.py).
"""

from __future__ import annotations

import os
from typing import Optional

from controller.registry import RunRecord
from controller.report.data import ReportData, gather
from controller.report.page import render
from onbox.common.errors import HostError

__all__ = ["ReportData", "gather", "render", "write"]


def write(rec: RunRecord, out: Optional[str] = None) -> str:
    """Gather the run's data, write the page to ``out`` (default ./NAME-report.html)
    atomically, and return its path."""
    data = gather(rec)
    path = os.path.abspath(out or f"{rec.name}-report.html")
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(render(data))
        os.replace(tmp, path)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise HostError(f"cannot write the report to {path}: {e.strerror}") from None
    return path
