"""``rgt watch``: a live view of a run, refreshed until interrupted or until it ends.

Each frame is one ``rgt status`` (controller/observe.py ``status``: the box, or the store's
copy when the box does not answer) drawn as a rich table, with the step rate measured across
frames (``Rates``). On a terminal it redraws in place; elsewhere one plain frame per refresh.
"""

from __future__ import annotations

import datetime
import time
from typing import IO, Any, Dict, Optional, Tuple

from controller.observe import box_now, describe, metrics_line, status
from controller.registry import RunRecord
from onbox.agent.observe import health_lines
from onbox.agent.states import TERMINAL_NAMES
from onbox.common.terminal import printable


class Rates:
    """Steps per second from successive progress reports."""

    def __init__(self) -> None:
        self.last: Optional[Tuple[int, float]] = None
        self.rate: Optional[float] = None

    def update(self, prog: Dict[str, Any]) -> Optional[float]:
        step, t = prog.get("step"), prog.get("time")
        if not isinstance(step, int) or not isinstance(t, (int, float)):
            return self.rate
        if self.last is not None and t > self.last[1] and step >= self.last[0]:
            self.rate = (step - self.last[0]) / (t - self.last[1])
        if self.last is None or t > self.last[1]:
            self.last = (step, float(t))
        return self.rate


def render(doc: Dict[str, Any], rate: Optional[float], why_not_box: Optional[str]) -> Any:
    """A rich renderable of one frame of `rgt watch`."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    head = Text(describe(doc, why_not_box).splitlines()[0], style="bold")
    t = _Rows(Table.grid(padding=(0, 2)))
    t.table.add_column(style="dim")
    t.table.add_column()
    prog = doc.get("progress") or {}
    t.add_row("state", f"{doc.get('state')} (attempt {doc.get('attempt')})")
    if (doc.get("scheduler") or {}).get("line"):
        t.add_row("slurm", str(doc["scheduler"]["line"]).removeprefix("slurm: "))
    if prog:
        t.add_row(
            "step",
            f"{prog.get('step')}"
            + (f"  ({rate:.2f} steps/s)" if rate else "")
            + metrics_line(prog),
        )
    box = doc.get("box") or {}
    gpus = box.get("gpus") or []
    t.add_row(
        "gpu",
        "; ".join(f"{g['util']:.0f}% {g['mem_used_mib']:.0f}/{g['mem_mib']:.0f} MiB" for g in gpus)
        or "none seen",
    )
    if box.get("disk"):
        d = box["disk"]
        inodes = box.get("inodes") or {}
        t.add_row(
            "disk",
            f"{d['avail_kb'] / 1048576:.1f} GiB free"
            + (f", {inodes.get('free')} inodes free" if inodes else ""),
        )
    mem = box.get("memory_kb") or {}
    if mem.get("MemTotal"):
        t.add_row(
            "memory",
            f"{mem.get('MemAvailable', 0) / 1048576:.1f} of {mem['MemTotal'] / 1048576:.1f} GiB "
            "available",
        )
    sealed = box.get("sealed")
    if sealed and box.get("box_time"):
        age = _age(sealed.get("time"), box["box_time"])
        how = "restored from the store " if sealed.get("kind") == "restored" else ""
        t.add_row("sealed", f"step {sealed.get('step')}, {how}{age} ago")
    elif doc.get("in_effect"):
        t.add_row("sealed", f"step {doc['in_effect'].get('step')} ({doc['in_effect'].get('note')})")
    elif doc.get("latest"):
        t.add_row("sealed", f"step {doc['latest'].get('step')}")
    else:
        t.add_row("sealed", "nothing sealed yet")
    health = health_lines(doc, box_now(doc))
    if health:  # each line printable already (health_lines)
        t.table.add_row("health", Text("\n".join([health[-1], *health[:-1]])))
    ev = _Rows(Table.grid())
    for e in (box.get("events") or [])[-6:]:
        ev.add_row(f"{str(e.get('time', ''))[11:19]} {e.get('kind')}: {e.get('reason', '')}")
    return Group(head, t.table, Text("recent events", style="dim"), ev.table)


class _Rows:
    """A rich table whose cells are the box's text as it is: never read as rich markup (a
    state of "[/bold]" ended `rgt watch` in a MarkupError), its control characters shown as
    '?' (rich passes ESC through to the terminal)."""

    def __init__(self, table: Any) -> None:
        self.table = table

    def add_row(self, *cells: str) -> None:
        from rich.text import Text

        self.table.add_row(*(Text(printable(c)) for c in cells))


def _age(when: Any, now: int) -> str:
    try:
        t = datetime.datetime.fromisoformat(str(when).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return "?"
    s = max(0, int(now - t))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def watch(rec: RunRecord, *, interval: float, once: bool, until_done: bool, out: IO[str]) -> str:
    """Refresh a live view until interrupted (``once``: one frame; ``until_done``: until the run
    ends). Returns the last state seen. On a terminal it redraws in place; elsewhere (a file,
    a pipe) it writes one plain frame per refresh."""
    from rich.console import Console
    from rich.live import Live

    console = Console(file=out, force_terminal=None, width=100 if not out.isatty() else None)
    rates = Rates()
    state = "?"
    ended = False

    def frame() -> Any:
        nonlocal state, ended
        doc, why = status(rec)
        state = str(doc.get("state"))
        # A Slurm run's PREEMPTED agent goes on once Slurm starts its requeued job.
        live = (doc.get("scheduler") or {}).get("live")
        # A run taken down has nothing left to change its state (only the store's copy is read).
        ended = (state in TERMINAL_NAMES and live is not True) or rec.down_at is not None
        return render(doc, rates.update(doc.get("progress") or {}), why)

    if once or not console.is_terminal:
        while True:
            console.print(frame())
            if once or (until_done and ended):
                return state
            console.print()
            time.sleep(interval)
    with Live(frame(), console=console, refresh_per_second=4) as live:
        try:
            while not (until_done and ended):
                time.sleep(interval)
                live.update(frame())
        except KeyboardInterrupt:
            pass
    return state
