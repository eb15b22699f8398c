"""The meter-stop's journal, ``$RGT_CONTROLLER_HOME/meter/NAME.json``: what rgt was asked to
stop, whether its one call was sent and what came of it, so that a second ``rgt down`` never
sends a call whose outcome is unknown and only polls.

States, in order:

    intent     about to send the call (written before it is sent; if rgt dies here the call
               may have gone out: a later down treats it as sent)
    not-sent   the request never reached the provider: nothing changed, it may be sent again
    sent       the provider accepted it (2xx: ``accepted`` true), or its outcome is unknown
               (``unknown`` true), or it answered 404
    refused    the provider said no (4xx): nothing changed
    gone       the resource was gone before any call (already gone)
    confirmed  polled until the provider no longer has it (or, for a reversible verb, it is off)
    unresolved still listed when the poll gave up, or no answer to tell

Atomic writes (onbox/common/durable.py). No API key is ever written here.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Dict, List, Optional

from controller.remote import controller_home
from onbox.common.durable import make_dirs, read_json, write_json
from onbox.common.errors import IntegrityError
from onbox.common.rundir import check_name

STATES = ("intent", "not-sent", "sent", "refused", "gone", "confirmed", "unresolved")
# A call may have reached the provider in these: it is never sent again, only polled.
SENT = ("intent", "sent", "unresolved")


def journal_dir(home: Optional[str] = None) -> str:
    return os.path.join(home or controller_home(), "meter")


def journal_path(name: str, home: Optional[str] = None) -> str:
    return os.path.join(journal_dir(home), check_name(name) + ".json")


@dataclasses.dataclass
class Journal:
    """One run's meter-stop record; ``note`` appends an event and saves."""

    path: str
    run: str
    api: str
    instance: str
    verb: str
    state: str = "intent"
    unknown: bool = False  # the call was sent and no answer came
    events: List[Dict[str, Any]] = dataclasses.field(default_factory=list)
    accepted: bool = False  # the provider answered the call 2xx (vast.ai's "exited": VAST15)
    # What the provider answered the call when it did not accept it (an HTTP error's status and
    # message, a page rgt cannot read); "" when it accepted, gave no answer, or rgt stopped
    # before it saw the answer (an older journal: not recorded).
    answer: str = ""

    def note(self, state: str, what: str) -> None:
        assert state in STATES, state
        self.state = state
        self.events.append({"t": round(time.time(), 3), "state": state, "what": what})
        make_dirs(os.path.dirname(self.path))
        doc = {k: v for k, v in dataclasses.asdict(self).items() if k != "path"}
        write_json(self.path, doc)

    @property
    def call_sent(self) -> bool:
        """The call may have reached the provider and has no known end: never send it again."""
        return self.state in SENT


def load(name: str, home: Optional[str] = None) -> Optional[Journal]:
    """The run's journal, or None when there is none. A file that does not parse is corrupt
    (exit 6): read as "none", it would let down send a call again."""
    path = journal_path(name, home)
    try:
        doc = read_json(path)
    except (OSError, ValueError) as e:
        raise IntegrityError(
            f"the meter journal {path} cannot be read ({e})",
            "look at it; if the provider's console shows the box gone, move it aside",
        ) from None
    if doc is None:
        return None
    try:
        j = Journal(
            path,
            str(doc["run"]),
            str(doc["api"]),
            str(doc["instance"]),
            str(doc["verb"]),
            str(doc["state"]),
            bool(doc.get("unknown")),
            list(doc.get("events") or []),
            bool(doc.get("accepted")),  # absent from an older journal: not accepted
            str(doc.get("answer") or ""),
        )
    except (KeyError, TypeError) as e:
        raise IntegrityError(f"the meter journal {path} is malformed ({e!r})") from None
    if j.state not in STATES:
        raise IntegrityError(f"the meter journal {path} has an unknown state {j.state!r}")
    return j


def start(name: str, api: str, instance: str, verb: str, home: Optional[str] = None) -> Journal:
    """A new journal for the run (not yet written: the first ``note`` writes it)."""
    return Journal(journal_path(name, home), name, api, instance, verb)
