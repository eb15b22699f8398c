"""Where the run's state and events go: state.json (atomic replace) and events.jsonl (append).

Each event has ``time``, ``kind``, ``class`` (transient | permanent | integrity | usage, or null
for an event that is not a failure), ``reason`` (for a person) and ``remedy``, plus data.

This is the chokepoint for what rgt writes into the run directory: every state document, event
and agent.log line passes through the box's redactor (onbox/common/redact.py) on its way to the
file,
so a secret in an exit reason (the job's exception message, its last output lines) is masked.

Each event written is a stop point for tests (onbox/common/faults.py ``stop_after_event``).
"""

from __future__ import annotations

import json
import time

from onbox.common import jsondoc, redact
from onbox.common.durable import append_line, write_json
from onbox.common.faults import stop_after_event

TYPE_CHECKING = False
if TYPE_CHECKING:  # the shim imports this module: typing would cost it ~2 MiB
    from typing import Any, Dict, List, Optional

CLASSES = ("transient", "permanent", "integrity", "usage")


def iso(t: float) -> str:
    """UTC ISO-8601 with milliseconds."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"


class FileJournal:
    """The real journal, in the run directory; also echoes events to the agent log."""

    def __init__(
        self,
        state_path: str,
        events_path: str,
        log_path: Optional[str] = None,
        wall: Any = time.time,
    ) -> None:
        self.state_path = state_path
        self.events_path = events_path
        self.log_path = log_path
        self.wall = wall
        # Called with each event as written (redacted), e.g. the notifier's queue
        # (onbox/health/notify.py). A listener must return at once and never raise.
        self.listeners: List[Any] = []

    def save(self, doc: Dict[str, Any]) -> None:
        write_json(self.state_path, redact.for_run_file(self.state_path).redact_obj(doc))

    def event(
        self, kind: str, reason: str, *, klass: Optional[str] = None, remedy: str = "", **data: Any
    ) -> None:
        assert klass is None or klass in CLASSES, klass
        now = self.wall()
        ev = {
            "time": iso(now),
            "kind": kind,
            "class": klass,
            "reason": reason,
            "remedy": remedy,
            **data,
        }
        ev = redact.for_run_file(self.events_path).redact_obj(ev)
        append_line(self.events_path, json.dumps(ev, sort_keys=True))
        for listen in self.listeners:
            try:
                listen(ev)
            except Exception:  # a listener's bug must not lose the next event
                pass
        if self.log_path:
            reason, remedy = ev["reason"], ev["remedy"]
            log(self.log_path, f"{kind}: {reason}" + (f" [{remedy}]" if remedy else ""))
        stop_after_event(kind)


class MemoryJournal:
    """A journal in memory, for policy tests."""

    def __init__(self) -> None:
        self.docs: List[Dict[str, Any]] = []
        self.events: List[Dict[str, Any]] = []

    def save(self, doc: Dict[str, Any]) -> None:
        self.docs.append(json.loads(json.dumps(doc)))

    def event(
        self, kind: str, reason: str, *, klass: Optional[str] = None, remedy: str = "", **data: Any
    ) -> None:
        assert klass is None or klass in CLASSES, klass
        self.events.append(
            {"kind": kind, "class": klass, "reason": reason, "remedy": remedy, **data}
        )


def log(path: str, message: str) -> None:
    """One line in the agent's log, redacted (not fsynced: the events file is the durable
    record)."""
    append_line(path, f"{iso(time.time())} {redact.for_run_file(path).redact(message)}", sync=False)


def read_events(path: str) -> List[Dict[str, Any]]:
    """Every event, oldest first; a torn last line (a crash mid-append) is skipped."""
    out = []
    try:
        with open(path, "rb") as f:
            for raw in f:
                try:
                    out.append(jsondoc.loads(raw))
                except ValueError:
                    continue
    except FileNotFoundError:
        pass
    return out
