"""The report's plots as inline SVG, every one on the same time axis so that events line up.

Each plot is one ``<svg>`` of ``WIDTH`` x its height; its plot area runs from ``X0`` to ``X1``
(``Axis`` maps a time to an x there), framed in ``FRAME``. A series is a line in its colour
(``PALETTE``, the first one ``LINE``), broken where a value is missing. The timeline has a lane
per kind of event, each marker a short vertical line in its kind's colour (``MARKERS``), over
bands for the attempts. Lines are drawn ``crispEdges`` so their colours stay exact (the
screenshot test reads them). Every string that reaches the SVG is escaped here.
"""

from __future__ import annotations

import dataclasses
import datetime
import html
from typing import Any, Dict, List, Optional, Sequence, Tuple

WIDTH = 1000
X0, X1 = 110, 960
FRAME = "#555555"
GRID = "#e6e6e6"
LINE = "#1f77b4"
PALETTE = (LINE, "#17becf", "#393b79", "#637939", "#7b4173", "#843c39")
# Kinds of event, in lane order, with their marker colours (distinct from the series').
MARKERS = {
    "preemption": "#d62728",
    "restart": "#ff7f0e",
    "exit": "#8c564b",
    "stall": "#9467bd",
    "health": "#e377c2",
    "seal": "#2ca02c",
    "other": "#a0a0a0",
}
BANDS = ("#dbe9f6", "#e5f2dc")  # the attempts, alternating
_TICKS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200)

Point = Tuple[float, Optional[float]]


def esc(v: Any) -> str:
    return html.escape(str(v), quote=True)


@dataclasses.dataclass(frozen=True)
class Axis:
    """The shared time axis: ``t0``..``t1`` (epoch seconds) onto ``X0``..``X1``."""

    t0: float
    t1: float

    def x(self, t: float) -> float:
        return X0 + (t - self.t0) / (self.t1 - self.t0) * (X1 - X0)

    def ticks(self) -> List[float]:
        span = self.t1 - self.t0
        step = next((s for s in _TICKS if span / s <= 8), 86400 * max(1, int(span / 86400 / 8)))
        first = (int(self.t0) // step + 1) * step
        return [float(t) for t in range(first, int(self.t1) + 1, step)]


def axis_for(times: Sequence[float]) -> Axis:
    lo, hi = (min(times), max(times)) if times else (0.0, 1.0)
    if hi - lo < 1.0:
        hi = lo + 1.0
    return Axis(lo, hi)


def _clock(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%H:%M:%S")


def _fmt(v: float) -> str:
    return f"{v:.4g}"


@dataclasses.dataclass
class Series:
    label: str
    points: List[Point]
    dashed: bool = False


@dataclasses.dataclass
class Plot:
    key: str  # data-plot, for readers of the page (and its test)
    title: str
    series: List[Series]
    y_range: Optional[Tuple[float, float]] = None  # fixed (fractions, percent), else the data's
    empty: str = "no samples"
    height: int = 150

    def count(self) -> int:
        return sum(1 for s in self.series for _, v in s.points if v is not None)


def _frame(axis: Axis, y0: int, y1: int, height: int) -> List[str]:
    out = []
    for t in axis.ticks():
        x = round(axis.x(t))
        out.append(f'<line x1="{x}" y1="{y0}" x2="{x}" y2="{y1}" stroke="{GRID}"/>')
        out.append(
            f'<text x="{x}" y="{height - 6}" font-size="11" text-anchor="middle" '
            f'fill="#333">{esc(_clock(t))}</text>'
        )
    out.append(
        f'<rect x="{X0}" y="{y0}" width="{X1 - X0}" height="{y1 - y0}" fill="none" '
        f'stroke="{FRAME}" stroke-width="1"/>'
    )
    return out


def _open(key: str, axis: Axis, height: int, count: int) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" shape-rendering="crispEdges" data-plot="{esc(key)}" '
        f'data-points="{count}" data-t0="{axis.t0!r}" data-t1="{axis.t1!r}" '
        f'data-x0="{X0}" data-x1="{X1}">'
    )


def _y_range(plot: Plot) -> Tuple[float, float]:
    if plot.y_range is not None:
        return plot.y_range
    vals = [v for s in plot.series for _, v in s.points if v is not None]
    lo, hi = min(vals), max(vals)
    if hi - lo < 1e-12:
        pad = abs(hi) * 0.1 or 1.0
        lo, hi = lo - pad, hi + pad
    return lo, hi


def _segments(points: List[Point]) -> List[List[Tuple[float, float]]]:
    segs: List[List[Tuple[float, float]]] = [[]]
    for t, v in points:
        if v is None:
            if segs[-1]:
                segs.append([])
        else:
            segs[-1].append((t, v))
    return [s for s in segs if s]


def render_plot(plot: Plot, axis: Axis) -> str:
    """One plot's SVG: title, frame, time ticks, y bounds, its series and their legend."""
    h = plot.height
    y0, y1 = 22, h - 24
    out = [_open(plot.key, axis, h, plot.count())]
    out.append(f'<text x="4" y="15" font-size="13" font-weight="bold">{esc(plot.title)}</text>')
    out += _frame(axis, y0, y1, h)
    if not plot.count():
        out.append(
            f'<text x="{(X0 + X1) // 2}" y="{(y0 + y1) // 2}" font-size="12" fill="#777" '
            f'text-anchor="middle">{esc(plot.empty)}</text></svg>'
        )
        return "".join(out)
    lo, hi = _y_range(plot)
    for v, y in ((hi, y0 + 10), (lo, y1)):
        out.append(
            f'<text x="{X0 - 6}" y="{y}" font-size="11" text-anchor="end">{esc(_fmt(v))}</text>'
        )

    def ymap(v: float) -> float:
        v = min(max(v, lo), hi)  # inset from the frame, so that a line never hides it
        return y1 - 4 - (v - lo) / (hi - lo) * (y1 - y0 - 8)

    legend_x = 220
    legend = []
    # The first series last, on top: where lines coincide the primary one stays visible.
    for i, s in reversed(list(enumerate(plot.series))):
        colour = PALETTE[i % len(PALETTE)]
        dash = ' stroke-dasharray="6 3"' if s.dashed else ""
        for seg in _segments(s.points):
            pts = " ".join(f"{axis.x(t):.1f},{ymap(v):.1f}" for t, v in seg)
            if len(seg) == 1:
                cx, cy = pts.split(",")
                out.append(f'<circle cx="{cx}" cy="{cy}" r="2.5" fill="{colour}"/>')
            else:
                out.append(
                    f'<polyline points="{pts}" fill="none" stroke="{colour}" '
                    f'stroke-width="2"{dash}/>'
                )
        legend.append((s, colour, dash))
    for s, colour, dash in reversed(legend):
        out.append(
            f'<line x1="{legend_x}" y1="11" x2="{legend_x + 18}" y2="11" stroke="{colour}" '
            f'stroke-width="2"{dash}/><text x="{legend_x + 22}" y="15" font-size="11">'
            f"{esc(s.label[:60])}</text>"
        )
        legend_x += 30 + 7 * len(s.label[:60])
    out.append("</svg>")
    return "".join(out)


def attempt_bands(rows: List[Dict[str, Any]]) -> List[Tuple[int, float, float]]:
    """(attempt, first t, last t) of each run of rows of one attempt (attempt 0: none yet)."""
    bands: List[Tuple[int, float, float]] = []
    for r in rows:
        a = r["attempt"]
        if bands and bands[-1][0] == a:
            bands[-1] = (a, bands[-1][1], r["t"])
        elif a:
            bands.append((a, r["t"], r["t"]))
    return [b for b in bands if b[0]]


def render_timeline(
    axis: Axis, bands: List[Tuple[int, float, float]], marks: List[Tuple[str, Dict[str, Any]]]
) -> str:
    """The attempts as bands, then a lane per kind of event with a marker per event."""
    lane_h = 16
    y0 = 22
    y1 = y0 + 20 + lane_h * len(MARKERS)
    h = y1 + 24
    out = [_open("timeline", axis, h, len(marks))]
    out.append('<text x="4" y="15" font-size="13" font-weight="bold">attempts and events</text>')
    for a, t0, t1 in bands:
        xa, xb = axis.x(t0), max(axis.x(t1), axis.x(t0) + 2)
        out.append(
            f'<rect x="{xa:.1f}" y="{y0}" width="{xb - xa:.1f}" height="{y1 - y0}" '
            f'fill="{BANDS[a % 2]}"><title>attempt {a}</title></rect>'
            f'<text x="{xa + 3:.1f}" y="{y0 + 14}" font-size="11" fill="#345">attempt {a}</text>'
        )
    lanes = {kind: y0 + 20 + i * lane_h for i, kind in enumerate(MARKERS)}
    for kind, y in lanes.items():
        out.append(
            f'<text x="{X0 - 6}" y="{y + 12}" font-size="11" text-anchor="end" '
            f'fill="{MARKERS[kind]}">{esc(kind)}</text>'
        )
    out += _frame(axis, y0, y1, h)
    for kind, ev in marks:
        x = round(axis.x(ev["t"]))
        y = lanes[kind]
        tip = f"{ev.get('time')} {ev.get('kind')}: {ev.get('reason')}"
        out.append(
            f'<line x1="{x}" y1="{y + 2}" x2="{x}" y2="{y + lane_h - 2}" '
            f'stroke="{MARKERS[kind]}" stroke-width="3"><title>{esc(tip)}</title></line>'
        )
    out.append("</svg>")
    return "".join(out)
