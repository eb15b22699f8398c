"""Whether a run is live on the box, seen through an agent (rgt_look, controller/shell/look.sh):
its state and the release it runs, and a deploy of other code under its name refused.

The audit's one round trip holds a look through the agent this laptop recorded for the run
(controller/deploy/audit.py); where it answers as this version, a run it sees live on another
release is refused before the push (``refuse_live_elsewhere``). A look that cannot tell is taken
after the install (controller/deploy/flow.py ``agent_and_run``).
"""

from __future__ import annotations

import posixpath
from typing import Dict, List, Optional, Tuple

from controller import boxrun
from controller.capture import box_int
from controller.deploy import audit as auditmod
from controller.deploy.install import answers_version
from controller.deploy.request import Plan
from controller.registry import RunRecord
from controller.remote import Remote
from onbox.agent.states import LIVE_NAMES
from onbox.common import jsondoc
from onbox.common.errors import LockedError

Live = Tuple[str, Optional[str]]  # a live run's state and the release it runs


def look_args(rec: RunRecord, version: Optional[str]) -> List[str]:
    """audit.rgt_look's arguments for a look at ``rec``'s run (the agent's version too, with
    ``version``)."""
    return ["1" if version else "0", boxrun.look_dir(rec).spec, rec.name, *rec.agent_argv()]


def look(
    remote: Remote,
    rec: RunRecord,
    version: Optional[str] = None,
    seen: Optional[Dict[str, List[str]]] = None,
) -> Tuple[bool, Optional[Live]]:
    """Whether the run's agent says it runs as ``version`` (not asked, True, when ``version`` is
    None: ``_answers``), and the run's (state, release) when it is live on the box: from
    ``seen`` (the audit's look through the same agent) or one command now."""
    if seen is None:
        r = remote.sh(auditmod.LOOK_SH + 'rgt_look "$@"', *look_args(rec, version), timeout=180)
        seen = auditmod.sections(r.text)
    status_rc = "".join(seen.get("status-rc") or []).strip()
    if version is not None and not _answers(seen, status_rc, version):
        return False, None  # its status is not to be trusted either
    if status_rc != "0":
        return True, None
    return True, live_of(seen.get("status") or [], seen.get("spec") or [])


def _answers(seen: Dict[str, List[str]], status_rc: str, version: str) -> bool:
    """Whether the agent said it runs as ``version``: in its status (``--with-version``, where
    that answered), else in its ``--version`` (rgt_look runs it where the status did not)."""
    if "version-rc" in seen:
        rc = box_int("".join(seen["version-rc"]))
        said = "\n".join(seen.get("version") or [])
        return answers_version(-1 if rc is None else rc, said, version)
    if status_rc != "0":
        return False
    try:
        doc = jsondoc.loads("\n".join(seen.get("status") or []))
    except ValueError:
        return False
    return isinstance(doc, dict) and doc.get("agent_version") == version


def live_of(status: List[str], spec: List[str]) -> Optional[Live]:
    """(state, release) from ``rgt-agent status --json`` and spec.json when the run is live."""
    try:
        doc = jsondoc.loads("\n".join(status))
    except ValueError:
        return None
    if not isinstance(doc, dict) or doc.get("state") not in LIVE_NAMES:
        return None
    if not (doc.get("agent") or {}).get("alive"):
        return None
    rel = posixpath.basename(str(doc.get("workdir") or "")) or None
    if rel is None:
        try:
            rel = posixpath.basename(str(jsondoc.loads("\n".join(spec)).get("workdir", ""))) or None
        except (ValueError, AttributeError):
            rel = None
    return str(doc["state"]), rel


def live_refusal(plan: Plan, live: Live) -> LockedError:
    """The refusal of a deploy of other code under the name of a run live on the box."""
    state, release = live
    return LockedError(
        f"run {plan.name} is {state} on {plan.target.label} with release {release}",
        f"`rgt stop {plan.name}` first, or deploy under another --name",
    )


def refuse_live_elsewhere(
    remote: Remote,
    plan: Plan,
    prev: Optional[RunRecord],
    seen: Optional[Dict[str, List[str]]],
    version: str,
    rid: Optional[str],
) -> None:
    """Refused before the push: the run this laptop deployed, which the audit's look ``seen``
    (through its recorded agent, answering as this version) saw live on another release. The
    push would only leave a release on the box that no run uses. (A look that cannot tell is
    decided after the push, by flow.py's ``_already_live``.)"""
    if prev is None or not seen or rid is None:
        return
    sound, live = look(remote, prev, version, seen)  # no round trip: the audit's look
    if sound and live is not None and live[1] is not None and live[1] != rid:
        raise live_refusal(plan, live)
