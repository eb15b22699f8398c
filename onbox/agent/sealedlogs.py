"""Which of the job's logs in a run directory are in the store already: ``logs-sealed.json``.

A run stopped (or failed) and started again on the same box keeps its run directory: a new
agent, a new epoch, and attempts/ still holding the older attempts' logs (attempts are numbered
on from the last). Each agent seals the logs as it lets go of the run (onbox/agent/endlogs.py,
or DONE.json's, onbox/agent/completion.py), and sealing every attempt's log put the older ones
in the store twice, under each epoch, and `rgt pull` brought them twice. So once a document
that lists some logs is in the store (``logs/e<epoch>.json``, DONE.json), the agent records
here which attempts' logs it sealed, into which store, under which epoch and at what size; the
next agent seals only the others.

"Its own attempts" is what no agent sealed yet, not the epoch an attempt began under: an
attempt the agent adopted (its agent killed, the shim's respawned one going on with it) is the
adopter's to seal, and an older attempt whose own agent never got its log document into the
store (killed with SIGKILL mid-seal, a store call that failed, a preemption's grace that ran
out) is sealed by the next agent that lets go of the run, once, under that agent's epoch
(``e<epoch>/attempt-NNNN.log``, the attempt's own number). Not under the older epoch's name:
that agent's log document is the one that names ``e<old>/``, a pull refuses a document naming
another epoch's logs, and writing the older agent's document for it would be a check-then-put
that no store makes atomic.

A log is sealed again when it is not recorded for this store (a run started again with
another store), or its size on the box changed since (a preempted job that wrote on after its
logs were sealed in the grace): the newer copy, under the newer epoch, beside the older one;
nothing is lost. A record that cannot be read counts as none: every log is sealed again.
Killed between the document and this record, the next agent seals those logs once more.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional, Tuple

from onbox.common.durable import read_json, write_json
from onbox.common.rundir import RunDir
from onbox.sealing import manifest as mf

Put = Callable[[int], List[Dict[str, Any]]]


def _records(rd: RunDir) -> Dict[str, Any]:
    try:
        doc = read_json(rd.sealed_logs)
    except (OSError, ValueError):
        return {}
    attempts = doc.get("attempts") if isinstance(doc, dict) else None
    return attempts if isinstance(attempts, dict) else {}


def _size(rd: RunDir, attempt: int) -> Optional[int]:
    try:
        return os.stat(rd.output_log(attempt)).st_size
    except OSError:
        return None


def put_unsealed(
    rd: RunDir, store_url: str, put: Put
) -> Tuple[List[Dict[str, Any]], Dict[int, int]]:
    """``put`` (the completion seal's ``put_log``) each attempt's log that is not recorded as
    sealed into ``store_url`` at its present size, oldest first: (the entries for the document,
    {attempt: its log's size before it was sealed} of each one sealed, for ``record``). The size
    is taken before the upload: a log that grows meanwhile is sealed again next time, not lost."""
    done = _records(rd)
    logs: List[Dict[str, Any]] = []
    sealed: Dict[int, int] = {}
    for attempt in rd.attempt_numbers():
        size = _size(rd, attempt)
        was = done.get(str(attempt))
        if (
            isinstance(was, dict)
            and size is not None
            and was.get("store") == store_url
            and was.get("size") == size
        ):
            continue
        got = put(attempt)
        logs += got
        if got and size is not None:
            sealed[attempt] = size
    return logs, sealed


def record(rd: RunDir, store_url: str, epoch: int, sealed: Dict[int, int]) -> None:
    """Record that the logs ``sealed`` ({attempt: size}) are in ``store_url`` under ``epoch``:
    called once the document that lists them is in the store."""
    if not sealed:
        return
    done = _records(rd)
    for attempt, size in sealed.items():
        done[str(attempt)] = {
            "epoch": epoch,
            "store": store_url,
            "size": size,
            "path": mf.log_name(epoch, attempt),
        }
    write_json(rd.sealed_logs, {"attempts": done})
