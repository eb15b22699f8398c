"""The on-done action: a profile's reversible meter-stop (``shutdown -h now`` on AutoDL), run by
the agent itself once the run's result is safe.

It runs only when the run SUCCEEDED and its DONE.json reads back from the durable store naming
this run, or when a meter cap stopped the run and its final seal was verified; never after a
failure. It runs once: ``on_done.json`` in the run dir is written before the command starts (a
power-off leaves no time to write it after), so a restarted agent never runs it again. The
command is exec'd with a timeout; a shebang-less shell script (exec fails with ENOEXEC, as some
AutoDL images ship /usr/bin/shutdown) is run with /bin/sh.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import time
from typing import Any, Callable, List, Optional, Tuple

from onbox.agent.states import State
from onbox.common import jsondoc
from onbox.common.durable import read_json, write_json
from onbox.common.errors import IntegrityError, StoreError
from onbox.common.rundir import RunDir
from onbox.sealing import manifest as mf

TIMEOUT = 120.0
JOURNAL = "on_done.json"


def journal_path(rd: RunDir) -> str:
    """Where the run dir records that the on-done action was started."""
    return os.path.join(rd.path, JOURNAL)


def done_verified(store: Any, name: str) -> bool:
    """Whether the store holds a DONE.json of run ``name`` that parses."""
    try:
        data = store.get_bytes(mf.done_key(name))
        doc = jsondoc.loads(data) if data is not None else None
    except (StoreError, IntegrityError, ValueError):
        return False
    return isinstance(doc, dict) and doc.get("run") == name


def after_finish(
    spec: Any, rd: RunDir, state: State, seal: Any, event: Callable[..., None]
) -> None:
    """Run the spec's on-done action if the run's result is verified safe; else nothing (one
    event saying why, when an action was chosen)."""
    if not spec.on_done or not spec.on_done_command:
        return
    if state == State.SUCCEEDED and seal is not None and done_verified(seal.store, spec.name):
        why = "DONE.json is verified in the store"
    elif state == State.STOPPED and seal is not None and seal.capped and seal.final_verified:
        why = "the meter cap's final seal is verified"
    else:
        event(
            "on_done_skipped",
            f"on-done {spec.on_done!r} not run: the run is {state.value} without a verified "
            + ("DONE.json" if state == State.SUCCEEDED else "result"),
            klass="usage",
            remedy="stop the meter yourself once you have the results",
        )
        return
    run_once(spec.on_done, list(spec.on_done_command), rd, why, event)


def run_once(
    action: str, argv: List[str], rd: RunDir, why: str, event: Callable[..., None]
) -> Optional[int]:
    """Run ``argv`` unless the run dir says it was started before; its exit status."""
    path = journal_path(rd)
    if read_json(path) is not None:
        # Its own kind: not on_done_skipped (the result is not safe, the meter runs on).
        event(
            "on_done_started_before",
            f"on-done {action!r} was started before; not again",
            action=action,
        )
        return None
    write_json(path, {"action": action, "command": argv, "started_at": time.time()})
    event("on_done_started", f"{why}: running on-done {action!r}: {' '.join(argv)}", action=action)
    code, failure = _exec(argv, rd.agent_log)
    if failure is not None or code != 0:
        event(
            "on_done_failed",
            f"on-done {action!r} failed: {failure or f'exit status {code}'}",
            klass="permanent",
            remedy="stop the meter yourself (the console), the run's results are sealed",
            action=action,
            code=code,
        )
    else:
        event("on_done_finished", f"on-done {action!r} exited 0", action=action, code=code)
    return code


def _exec(argv: List[str], log_path: str) -> Tuple[Optional[int], Optional[str]]:
    """Exit status, or None and why it could not run."""
    with open(log_path, "ab") as logf:
        try:
            return _run(argv, logf), None
        except OSError as e:
            if e.errno != errno.ENOEXEC:
                return None, f"{argv[0]}: {e.strerror}"
        # A script with no #! line: what a shell does with it.
        exe = argv[0] if "/" in argv[0] else (shutil.which(argv[0]) or argv[0])
        try:
            return _run(["/bin/sh", exe, *argv[1:]], logf), None
        except OSError as e:
            return None, f"/bin/sh {exe}: {e.strerror}"


def _run(argv: List[str], logf: Any) -> int:
    """The exit status of ``argv``, its output to the agent's log; -1 when it was killed after
    ``TIMEOUT``."""
    try:
        p = subprocess.run(
            argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT, timeout=TIMEOUT
        )
    except subprocess.TimeoutExpired:
        return -1
    return p.returncode
