"""First contact: the first time this laptop meets a target under a profile, the platform's
danger clocks (what destroys data or money, and by when) and its conveniences are shown once,
by `rgt deploy` and `rgt doctor` alike (``--verbose`` on doctor shows them again).

What was met is remembered in ``$RGT_CONTROLLER_HOME/contacts.json`` (``{"seen": {"LABEL
PROFILE": unix time}}``), replaced atomically under an flock. A file that does not parse is
set aside in memory (read as "nothing met yet"): it only decides whether a note is shown again.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from typing import Any, Dict, Iterator, List

from controller.remote import controller_home
from onbox.common import jsondoc
from onbox.common.durable import make_dirs, write_json
from onbox.profiles.schema import Profile

FILE = "contacts.json"


def _path() -> str:
    return os.path.join(controller_home(), FILE)


@contextlib.contextmanager
def _locked() -> Iterator[Dict[str, Any]]:
    home = controller_home()
    make_dirs(home)
    fd = os.open(_path() + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield _read()
    finally:
        os.close(fd)


def _read() -> Dict[str, Any]:
    try:
        with open(_path(), "rb") as f:
            doc = jsondoc.loads(f.read())
    except (OSError, ValueError):
        return {"seen": {}}
    if not isinstance(doc, dict) or not isinstance(doc.get("seen"), dict):
        return {"seen": {}}
    return doc


def _days(seconds: float) -> str:
    return f"{seconds / 86400:g} days" if seconds >= 86400 else f"{seconds / 3600:g} hours"


def notes(label: str, profile: Profile) -> List[str]:
    """The first-contact lines of target ``label`` under ``profile``: its danger clocks, then
    its conveniences."""
    out: List[str] = []
    for d in profile.danger:
        when = f" (after {_days(d.after)})" if d.after is not None else ""
        out.append(f"  danger: {d.name}{when}: {d.what}; {d.remedy}")
    out += [f"  tip: {c}" for c in profile.conveniences]
    if out:
        # The title describes the profile ("Any box reachable over SSH"), not a platform's
        # name: quoted after the profile's name, the line reads right for every title.
        head = f'rgt: first contact with {label} under profile {profile.name}, "{profile.title}":'
        out.insert(0, head)
    return out


def first_contact(label: str, profile: Profile, again: bool = False) -> List[str]:
    """The lines to show for target ``label`` under ``profile``: its notes the first time (or
    with ``again``), else none; the meeting is remembered either way."""
    key = f"{label} {profile.name}"
    # Labels before IPv6 hosts were shown in brackets (controller/target.py): met all the same.
    old = f"{label.replace('[', '').replace(']', '')} {profile.name}"
    with _locked() as doc:
        seen = key in doc["seen"] or old in doc["seen"]
        if not seen:
            doc["seen"][key] = time.time()
            write_json(_path(), doc)
    return notes(label, profile) if again or not seen else []
