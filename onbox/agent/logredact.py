"""The redacted copies of the job's logs for a run without a store (``rgt pull --from box``).

The box's log is the job's and stays unaltered; a log that holds a secret value or a token
shape (onbox/common/redact.py) gets a redacted copy next to it, which the pull takes in the
log's place, and a ``secret_in_log`` warning in status. (A run with a store seals such a log as
a redacted copy instead: onbox/agent/completion.py.)
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional, Tuple

from onbox.common import redact
from onbox.common.rundir import RunDir


def redact_box_logs(rd: RunDir, event: Callable[..., None], warnings: List[Dict[str, Any]]) -> bool:
    """For a run without a store, as its agent lets go of it: each attempt's log that holds a
    secret value or a token shape gets a redacted copy next to it (``RunDir.redacted_log``,
    0600), which ``rgt pull --from box`` takes in the log's place, and a ``secret_in_log``
    warning in ``warnings`` (and an event, once per finding). The log itself stays unaltered.
    A copy whose log no longer holds any (a secret since removed) goes, with its warning.
    Returns whether ``warnings`` changed.

    A copy that cannot be written (a full disk) is a warning with ``copy`` null: the pull
    then refuses that log rather than take the raw one."""
    red = redact.for_home(rd.home)
    changed = False
    for attempt in rd.attempt_numbers():
        path, copy = rd.output_log(attempt), rd.redacted_log(attempt)
        old = next(
            (w for w in warnings if w.get("kind") == "secret_in_log" and w.get("log") == path),
            None,
        )
        try:
            found = red.scan_file(path)
        except FileNotFoundError:
            found = []
        if not found:
            _unlink(copy)
            if old is not None:
                warnings.remove(old)
                changed = True
            continue
        written, why = _write_copy(red, path, rd.redacted_log_tmp(attempt), copy)
        what = ", ".join(found)
        if written is not None:
            reason = (
                f"the job's log of attempt {attempt} holds {what}: `rgt pull` takes its "
                "redacted copy; the log on the box is unaltered"
            )
        else:
            reason = (
                f"the job's log of attempt {attempt} holds {what} and no redacted copy could "
                f"be written ({why}): `rgt pull` refuses this log; the log on the box is unaltered"
            )
        warning = {
            "kind": "secret_in_log",
            "attempt": attempt,
            "log": path,
            "copy": written,
            "found": found,
            "reason": reason,
        }
        if warning == old:
            continue  # reported by an earlier agent of the run, and nothing changed since
        if old is not None:
            warnings.remove(old)
        warnings.append(warning)
        changed = True
        event(
            "secret_in_log",
            f"the job's log of attempt {attempt} ({path}) holds {what}; "
            + (
                f"wrote {copy}, a redacted copy (each match replaced by {redact.MARK}) that "
                "`rgt pull` takes in its place"
                if written is not None
                else f"no redacted copy could be written ({why}), so `rgt pull` refuses it"
            )
            + "; the box's log is unaltered",
            klass="usage",
            remedy="do not print secrets; rotate the secret if the box's log was shared",
            attempt=attempt,
            log=path,
            copy=written,
            found=found,
        )
    return changed


def _write_copy(red: redact.Redactor, path: str, tmp: str, copy: str) -> Tuple[Optional[str], str]:
    """Write the redacted copy of ``path`` at ``copy`` (through ``tmp``): (``copy``, "") once
    written, (None, why) when it could not be, and then no copy is left at all."""
    try:
        red.redact_file(path, tmp)
        os.replace(tmp, copy)
    except OSError as e:
        # A copy made with fewer secrets would carry the new one: none is better.
        for p in (tmp, copy):
            try:
                os.unlink(p)
            except OSError:  # gone already, or not a file: nothing of ours to remove
                pass
        return None, f"{e.strerror or e}"
    return copy, ""


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
