"""The look at a run through an agent (controller/deploy/look.py): whether the agent says it runs
as this controller's version, and whether the run is live, from rgt_look's sections
(controller/shell/look.sh).

- A status run with ``--with-version`` that answered says the version in its JSON
  (``agent_version``, what ``--version`` would print): sound when it is this version, the run
  live on its release; another version, or none, is not sound (its status is not trusted).
- A status that did not answer is followed by ``--version``, judged as before: sound only when
  it exits 0 naming this version.
- No version asked: sound, whatever the agent said.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Sequence

from controller.deploy.look import look
from controller.registry import RunRecord
from controller.remote import LocalRemote
from controller.target import Target

VERSION = "1.2.3"
REC = RunRecord(
    "r1",
    Target("local"),
    profile="local",
    store=None,
    box_home="/nowhere",
    agent=["/nowhere/python", "-m", "onbox.cli"],
    release="abc",
    workdir="/nowhere/releases/abc",
)


def _status(**more: Any) -> str:
    doc = {"state": "RUNNING", "agent": {"alive": True}, "workdir": "/b/releases/abc", **more}
    return json.dumps(doc)


def _seen(status: str, rc: int, version: Sequence[str] = ()) -> Dict[str, List[str]]:
    """rgt_look's sections: the status and its exit code; ``version``: --version's output lines
    and exit code, where it ran."""
    seen = {"status": [status], "status-rc": [str(rc)], "spec": []}
    if version:
        seen["version"], seen["version-rc"] = list(version[:-1]), [version[-1]]
    return seen


def test_a_status_that_says_this_version_is_sound_and_its_run_live() -> None:
    seen = _seen(_status(agent_version=VERSION), 0)
    assert look(LocalRemote(), REC, VERSION, seen) == (True, ("RUNNING", "abc"))


def test_a_status_that_says_another_version_or_none_is_not_trusted() -> None:
    for status in (_status(agent_version="0.0.0+broken"), _status(), "not json", "[1]"):
        assert look(LocalRemote(), REC, VERSION, _seen(status, 0)) == (False, None), status


def test_a_status_that_did_not_answer_is_judged_by_version() -> None:
    ok = _seen("", 8, [f"rgt-agent, version {VERSION}", "0"])
    assert look(LocalRemote(), REC, VERSION, ok) == (True, None)
    other = _seen("", 8, ["rgt-agent, version 0.0.1", "0"])
    assert look(LocalRemote(), REC, VERSION, other) == (False, None)
    failed = _seen("", 2, ["Traceback ...", "1"])
    assert look(LocalRemote(), REC, VERSION, failed) == (False, None)
    # A status that failed without a --version after it tells nothing.
    assert look(LocalRemote(), REC, VERSION, _seen("", 8)) == (False, None)


def test_no_version_asked_takes_the_status_as_it_is() -> None:
    assert look(LocalRemote(), REC, None, _seen(_status(), 0)) == (True, ("RUNNING", "abc"))
    assert look(LocalRemote(), REC, None, _seen("", 8)) == (True, None)
