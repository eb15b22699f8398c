"""What `rgt report` draws, read from the box or, when it does not answer, from the store.

From the box: ``rgt-agent report-data NAME`` (onbox/agent/observe.py ``report_data``) in one
round trip, as status reads it. From the store: the mirror the agent keeps next to state.json
(RUN/state/samples.jsonl, coarse.jsonl, events.jsonl; onbox/agent/sealservice.py ``mirror``).
Everything read is untrusted: rows and events are capped in number, only plain numbers are kept
as samples, every string is cut to ``MAX_TEXT`` (the page escapes them), no path in them is ever
opened.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import time
from typing import Any, Dict, List, Optional

from controller import observe
from controller.registry import RunRecord
from controller.remote import open_remote
from controller.runstore import open_run_store
from onbox.common import jsondoc
from onbox.common.errors import HostError, NotFound, RemoteUnreachable
from onbox.health import series
from onbox.sealing import manifest as mf

MAX_ROWS = 5000
MAX_EVENTS = 2000
MAX_TEXT = 400
MAX_KEYS = 200  # sample names per row
MAX_MIRROR_BYTES = 64 << 20  # of one mirrored file: its tail beyond this is what is read
MAX_BOX_BYTES = 64 << 20  # of `rgt-agent report-data`'s answer: a box sending more is refused


@dataclasses.dataclass
class ReportData:
    """A run's samples and events, checked: ``rows`` hold numbers (``t`` epoch seconds),
    ``events`` hold ``t`` and short strings."""

    name: str
    source: str  # "box" or "store"
    read_at: float
    status: Dict[str, Any]
    rows: List[Dict[str, Any]]
    events: List[Dict[str, Any]]
    why_not_box: Optional[str] = None  # why it was read from the store, as the page says it


def text(v: Any, limit: int = MAX_TEXT) -> str:
    """A value from the box as a bounded string (the page escapes it)."""
    s = v if isinstance(v, str) else json.dumps(v, sort_keys=True, default=str)
    return s if len(s) <= limit else s[: limit - 1] + "\u2026"


def number(v: Any) -> Optional[float]:
    """A finite number, or None (strings such as "nan", booleans, anything else)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def clean_row(row: Any) -> Optional[Dict[str, Any]]:
    """A sample row with its time, attempt, state and up to ``MAX_KEYS`` numbers."""
    if not isinstance(row, dict) or number(row.get("t")) is None:
        return None
    out: Dict[str, Any] = {"t": float(row["t"])}
    attempt = row.get("attempt")
    out["attempt"] = attempt if isinstance(attempt, int) and not isinstance(attempt, bool) else 0
    out["state"] = text(row.get("state") or "", 40)
    for k, v in list(row.items())[:MAX_KEYS]:
        if isinstance(k, str) and len(k) <= 120 and k not in out:
            n = number(v)
            if n is not None:
                out[k] = n
            elif isinstance(v, str) and v.lower() in ("nan", "inf", "-inf"):
                out[k] = v.lower()  # a NaN loss is worth showing as such
    return out


def event_time(ev: Dict[str, Any]) -> Optional[float]:
    """An event's ``time`` (ISO 8601, as the journal writes it) as epoch seconds."""
    when = ev.get("time")
    if not isinstance(when, str) or len(when) > 40:
        return None
    try:
        t = datetime.datetime.fromisoformat(when.replace("Z", "+00:00"))
    except ValueError:
        return None
    if t.tzinfo is None:
        t = t.replace(tzinfo=datetime.timezone.utc)
    return t.timestamp()


_EVENT_FIELDS = ("kind", "class", "reason", "remedy", "state", "probe", "level", "code")


def clean_event(ev: Any) -> Optional[Dict[str, Any]]:
    if not isinstance(ev, dict):
        return None
    t = event_time(ev)
    if t is None:
        return None
    out: Dict[str, Any] = {"t": t, "time": text(ev.get("time"), 40)}
    for k in _EVENT_FIELDS:
        v = ev.get(k)
        out[k] = "" if v is None else text(v)
    for k in ("exit_kind", "step", "attempt"):
        if ev.get(k) is not None:
            out[k] = text(ev.get(k), 60)
    return out


def checked(name: str, source: str, doc: Dict[str, Any], rows: Any, events: Any) -> ReportData:
    rows = rows if isinstance(rows, list) else []
    events = events if isinstance(events, list) else []
    good_rows = [r for r in (clean_row(x) for x in rows[-MAX_ROWS:]) if r is not None]
    good_rows.sort(key=lambda r: r["t"])
    good_events = [e for e in (clean_event(x) for x in events[-MAX_EVENTS:]) if e is not None]
    good_events.sort(key=lambda e: e["t"])
    return ReportData(name, source, time.time(), doc, good_rows, good_events)


def from_box(rec: RunRecord) -> ReportData:
    """``rgt-agent report-data NAME`` on the box (RemoteUnreachable when it does not answer)."""
    remote = open_remote(rec.target)
    # The agent sends at most MAX_ROWS samples and MAX_EVENTS events: well under this.
    r = remote.run(rec.agent_argv("report-data", rec.name), timeout=120, limit=MAX_BOX_BYTES)
    if r.rc == NotFound.exit_code:
        raise NotFound(
            f"the agent on {rec.target.label} knows no run {rec.name!r}",
            "was it taken down? the store's copy is read when the box does not answer",
        )
    if r.rc != 0:
        raise HostError(
            f"rgt-agent report-data {rec.name} failed on {remote.target.label} (exit {r.rc}): "
            f"{r.err.strip()[-300:]}",
            "deploy again to update the box's agent" if r.rc == 2 else None,
        )
    try:
        doc = jsondoc.loads(r.stdout)
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        raise HostError(f"rgt-agent report-data {rec.name} printed no JSON object")
    status: Dict[str, Any] = doc["status"] if isinstance(doc.get("status"), dict) else {}
    return checked(rec.name, "box", status, doc.get("samples"), doc.get("events"))


def _lines(raw: Optional[bytes]) -> List[bytes]:
    if raw is None:
        return []
    if len(raw) > MAX_MIRROR_BYTES:
        raw = raw[-MAX_MIRROR_BYTES:]
        raw = raw[raw.find(b"\n") + 1 :]  # the first line is torn
    return raw.splitlines()[-(MAX_ROWS + MAX_EVENTS) :]


def from_store(rec: RunRecord, why_not_box: Optional[str]) -> ReportData:
    """The mirror in the store (NotFound when there is none, as status says)."""
    status = observe.from_store(rec)
    store = open_run_store(rec)  # from_store refused a run without one

    def get(name: str) -> List[bytes]:
        return _lines(store.get_bytes(mf.state_key(rec.name, name)))

    fine = series.read_lines(get("samples.jsonl"))
    start = fine[0]["t"] if fine else float("inf")
    coarse = [r for r in series.read_lines(get("coarse.jsonl")) if r["t"] < start]
    events = []
    for raw in get("events.jsonl"):
        try:
            events.append(jsondoc.loads(raw))
        except ValueError:
            continue
    data = checked(rec.name, "store", status, coarse + fine, events)
    data.why_not_box = why_not_box
    return data


def gather(rec: RunRecord) -> ReportData:
    """From the box; from the store when the box does not answer, or when the run was taken
    down (nothing of it is left on a box)."""
    if rec.down_at is not None:
        return from_store(rec, f"{rec.taken_down()} by rgt down: nothing of it is left on its box")
    try:
        return from_box(rec)
    except RemoteUnreachable as e:
        return from_store(rec, f"the box did not answer: {e.what}")
