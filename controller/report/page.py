"""The report's one HTML page: inline CSS and SVG, no script, nothing fetched when opened.

From a ``ReportData`` (controller/report/data.py): the run's header and health verdicts, the
plots (step rate, loss, GPU utilisation and memory, disk bytes and inodes, memory) over one time
axis, the timeline of attempts and events, and the events as a table. Every string is escaped
(html.escape) where it is placed; the data is already capped in size.
"""

from __future__ import annotations

import datetime
import re
from typing import Any, Dict, List, Optional, Tuple

from controller.report.data import ReportData
from controller.report.plots import (
    MARKERS,
    Plot,
    Point,
    Series,
    attempt_bands,
    axis_for,
    esc,
    render_plot,
    render_timeline,
)

STEP_KEYS = ("progress.step", "stall.step")
LOSS_KEYS = ("training.loss", "progress.loss")
MAX_TABLE = 1000  # events in the table (the newest); the timeline has them all
_DISK = re.compile(r"disk\.([A-Za-z0-9_.-]{1,40})\.(bytes_used|inodes_used)")

_CSS = """
body { font-family: sans-serif; margin: 12px; color: #222; background: #fff; }
h1 { font-size: 20px; margin: 0 0 4px 0; } h2 { font-size: 16px; margin: 18px 0 6px 0; }
.meta { color: #555; font-size: 13px; margin-bottom: 10px; }
svg { display: block; margin: 4px 0; }
table { border-collapse: collapse; font-size: 12px; }
td, th { border: 1px solid #ccc; padding: 2px 6px; text-align: left; vertical-align: top; }
.lv-alert { color: #b00; font-weight: bold; } .lv-warn { color: #a60; }
.key span { display: inline-block; width: 12px; height: 12px; margin: 0 4px 0 12px; }
"""


def _first_key(rows: List[Dict[str, Any]], keys: Tuple[str, ...]) -> Optional[str]:
    return next((k for k in keys if any(isinstance(r.get(k), float) for r in rows)), None)


def _values(rows: List[Dict[str, Any]], key: str) -> List[Point]:
    return [(r["t"], r[key] if isinstance(r.get(key), float) else None) for r in rows]


def step_rate(rows: List[Dict[str, Any]], key: str) -> List[Point]:
    """Steps per second between successive samples of one attempt (a gap elsewhere)."""
    out: List[Point] = []
    prev: Optional[Tuple[float, float, int]] = None
    for r in rows:
        s = r.get(key)
        if not isinstance(s, float):
            out.append((r["t"], None))
            prev = None
            continue
        rate = None
        if prev is not None and prev[2] == r["attempt"] and r["t"] > prev[0] and s >= prev[1]:
            rate = (s - prev[1]) / (r["t"] - prev[0])
        out.append((r["t"], rate))
        prev = (r["t"], s, r["attempt"])
    return out


def plots(rows: List[Dict[str, Any]]) -> List[Plot]:
    """Every plot of the report, in page order (empty ones say so)."""
    step = _first_key(rows, STEP_KEYS)
    loss = _first_key(rows, LOSS_KEYS)
    out = [
        Plot("step_rate", "step rate (steps/s)", [Series("steps/s", step_rate(rows, step))])
        if step
        else Plot("step_rate", "step rate (steps/s)", [], empty="no step samples"),
        Plot("loss", "loss", [Series("loss", _values(rows, loss))] if loss else []),
        Plot(
            "gpu_util",
            "GPU utilisation (%)",
            [Series("util", _values(rows, "gpu.util"))],
            y_range=(0.0, 100.0),
            empty="no GPU samples",
        ),
        Plot(
            "gpu_mem",
            "GPU memory",
            [Series("used", _values(rows, "gpu.mem_used"))]
            + [Series("total", _values(rows, "gpu.mem_total"), dashed=True)],
            empty="no GPU samples",
        ),
    ]
    out.append(Plot("disk", "disk used (fraction)", _disk(rows), y_range=(0.0, 1.0)))
    out.append(
        Plot(
            "memory",
            "memory (bytes)",
            [Series("used", _values(rows, "memory.used"))]
            + [Series("limit", _values(rows, "memory.limit"), dashed=True)],
        )
    )
    return out


def _disk(rows: List[Dict[str, Any]]) -> List[Series]:
    """Bytes and inodes used per watched path; paths on one filesystem (the same numbers at
    every sample) are one line, named after all of them."""
    labels = sorted({m.group(1) for r in rows for k in r if (m := _DISK.fullmatch(k))})
    same: Dict[Tuple[Any, ...], List[str]] = {}
    for label in labels:
        b, i = _values(rows, f"disk.{label}.bytes_used"), _values(rows, f"disk.{label}.inodes_used")
        same.setdefault((tuple(b), tuple(i)), []).append(label)
    out = []
    for (b, i), names in list(same.items())[:4]:
        name = ", ".join(names)
        out.append(Series(f"{name}: bytes", list(b)))
        out.append(Series(f"{name}: inodes", list(i), dashed=True))
    return out


def category(ev: Dict[str, Any]) -> str:
    """The timeline lane of an event (plots.MARKERS)."""
    kind, state = ev.get("kind", ""), ev.get("state", "")
    if kind.startswith("preempt"):
        return "preemption"
    # A restart of the job: the agent writes no "restart" kind; every restart within an
    # incarnation is the state event into BACKOFF (onbox/agent/supervisor.py _decide), whose
    # reason says why and when. A `start` after PREEMPTED or STOPPED is an `incarnation`.
    if kind == "state" and state == "BACKOFF":
        return "restart"
    stalled = ev.get("exit_kind") == "stalled" or ev.get("code") == "stalled"
    if stalled or (kind == "health" and ev.get("probe") == "stall" and _concern(ev)):
        return "stall"
    if kind == "exit" and ev.get("exit_kind") != "success":
        return "exit"
    if kind == "health" and _concern(ev):
        return "health"
    if kind == "sealed":
        return "seal"
    return "other"


def _concern(ev: Dict[str, Any]) -> bool:
    return ev.get("level") in ("warn", "alert")


def _when(t: Optional[float]) -> str:
    if t is None:
        return "-"
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat(timespec="seconds")


def _health_table(status: Dict[str, Any]) -> str:
    health = status.get("health")
    probes = health.get("probes") if isinstance(health, dict) else None
    if not isinstance(probes, dict) or not probes:
        return "<p>no health verdicts recorded</p>"
    rows = []
    for name, v in sorted(probes.items())[:50]:
        v = v if isinstance(v, dict) else {}
        level = str(v.get("level", ""))[:20]
        rows.append(
            f'<tr><td>{esc(str(name)[:60])}</td><td class="lv-{esc(level)}">{esc(level)}</td>'
            f"<td>{esc(str(v.get('reason', ''))[:400])}</td>"
            f"<td>{esc(str(v.get('remedy', ''))[:400])}</td></tr>"
        )
    return (
        "<table><tr><th>probe</th><th>level</th><th>reason</th><th>remedy</th></tr>"
        + "".join(rows)
        + "</table>"
    )


def _events_table(events: List[Dict[str, Any]]) -> str:
    rows = []
    for ev in events[-MAX_TABLE:]:
        cat = category(ev)
        rows.append(
            f'<tr><td>{esc(ev["time"])}</td><td style="color:{MARKERS[cat]}">{esc(cat)}</td>'
            f"<td>{esc(ev['kind'])}</td><td>{esc(ev['class'])}</td><td>{esc(ev['reason'])}</td>"
            f"<td>{esc(ev['remedy'])}</td></tr>"
        )
    more = len(events) - MAX_TABLE
    note = f"<p>{more} older events are on the timeline only</p>" if more > 0 else ""
    return (
        note + "<table><tr><th>time (UTC)</th><th>lane</th><th>kind</th><th>class</th>"
        "<th>reason</th><th>remedy</th></tr>" + "".join(rows) + "</table>"
    )


def render(data: ReportData) -> str:
    """The whole page."""
    times = [r["t"] for r in data.rows] + [e["t"] for e in data.events]
    axis = axis_for(times)
    st = data.status
    head = (
        f"state {st.get('state')}, attempt {st.get('attempt')}, restarts {st.get('restarts')}; "
        f"read from the {data.source} at {_when(data.read_at)}"
        + (f" ({data.why_not_box})" if data.why_not_box else "")
    )
    span = f"{_when(axis.t0)} to {_when(axis.t1)} (UTC), {len(data.rows)} samples"
    marks = [(category(e), e) for e in data.events]
    key = "".join(
        f'<span style="background:{colour}"></span>{esc(kind)}' for kind, colour in MARKERS.items()
    )
    body = [
        f"<h1>rgt report: {esc(data.name)}</h1>",
        f'<div class="meta">{esc(head)}<br>{esc(span)}</div>',
        "<h2>health now</h2>",
        _health_table(st),
        "<h2>over time</h2>",
        *(render_plot(p, axis) for p in plots(data.rows)),
        render_timeline(axis, attempt_bands(data.rows), marks),
        f'<div class="key">{key}</div>',
        f"<h2>events ({len(data.events)})</h2>",
        _events_table(data.events),
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>rgt report {esc(data.name)}</title><style>{_CSS}</style></head>"
        "<body>" + "\n".join(body) + "</body></html>\n"
    )
