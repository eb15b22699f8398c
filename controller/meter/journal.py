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

Atomic writes (onbox/common/durable.py). No API key is ever written here. rgt writes it, but it
lives on a disk the user may edit: a field of another type (never coerced), another run's
journal, or an id that is no provider's id, is malformed (IntegrityError, exit 6).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Dict, List, Optional, Tuple

from controller.meter.api import check_instance
from controller.remote import controller_home
from onbox.common.durable import make_dirs, read_json, write_json
from onbox.common.errors import IntegrityError, UsageError
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


# Each field's type, and its value when an older journal lacks it (None: every journal has it).
_FIELDS: Dict[str, Tuple[type, Any]] = {
    "run": (str, None),
    "api": (str, None),
    "instance": (str, None),
    "verb": (str, None),
    "state": (str, None),
    "unknown": (bool, False),
    "events": (list, ()),
    "accepted": (bool, False),
    "answer": (str, ""),
}
_REMEDY = "look at it; if the provider's console shows the box gone, move it aside"


def load(name: str, home: Optional[str] = None) -> Optional[Journal]:
    """The run's journal, or None when there is none. A file that does not parse, or whose
    document is not one rgt writes (_problem), is corrupt (exit 6): read as "none", it would let
    down send a call again; read loosely, it could say what it does not."""
    path = journal_path(name, home)
    try:
        doc = read_json(path)
    except (OSError, ValueError) as e:
        raise IntegrityError(f"the meter journal {path} cannot be read ({e})", _REMEDY) from None
    if doc is None:
        return None
    problem = _problem(doc, name)
    if problem:
        raise IntegrityError(f"the meter journal {path} is malformed: {problem}", _REMEDY)
    fields = {k: doc.get(k, default) for k, (_, default) in _FIELDS.items()}
    fields["events"] = list(fields["events"])
    return Journal(path, **fields)


def _problem(doc: Any, name: str) -> str:
    """What makes ``doc`` no journal of the run ``name``, or "". rgt writes it, but it lives on
    a disk the user may edit: a value of another type is never coerced (bool("false") is
    true), and another run's journal, or an id that is none, is not taken for this one's."""
    if not isinstance(doc, dict):
        return f"a JSON {type(doc).__name__}, not an object"
    for key, (kind, default) in _FIELDS.items():
        if key not in doc:
            if default is None:
                return f"it has no {key!r}"
        elif not isinstance(doc[key], kind):
            return f"{key!r} is {repr(doc[key])[:40]}, not a {kind.__name__}"
    if not all(isinstance(e, dict) for e in doc.get("events", ())):
        return "an event is not an object"
    if doc["run"] != name:
        return f"it is the journal of the run {doc['run'][:40]!r}, not of {name}"
    if doc["state"] not in STATES:
        return f"unknown state {doc['state'][:40]!r}"
    try:
        check_instance(doc["instance"])
    except UsageError:
        return f"{doc['instance'][:40]!r} is not a provider's id"
    return ""


def start(name: str, api: str, instance: str, verb: str, home: Optional[str] = None) -> Journal:
    """A new journal for the run (not yet written: the first ``note`` writes it)."""
    return Journal(journal_path(name, home), name, api, instance, verb)
