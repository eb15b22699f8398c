"""The job's logs of a run that ended FAILED or STOPPED, sealed to the store as it ends.

The completion seal (onbox/agent/completion.py) puts the logs in the store only for a run that
succeeded, with DONE.json. The log a user needs most is a failed job's, and without this it
lived on the box alone: ``rgt down`` (or a box that dies) took it away, and ``rgt pull`` of the
store brought the checkpoints and no log. So when its agent lets go of a run that ended FAILED
or STOPPED, each attempt's log goes to the store as the completion seal puts it (``logs/``,
verified by the store as it is uploaded; a log that holds a secret as a redacted copy, with its
``secret_in_log`` warning), then ``ENDED.json`` lists them: the run, its epoch, the state it
ended in, the logs (as DONE.json lists them), ``left_out`` (DONE.json's form). ``ENDED.json``
never means success (no on-done action, no sweep cell, reads it); ``rgt pull`` brings its logs
(controller/results/documents.py) while the store has no DONE.json.

A run that ended PREEMPTED is left out: it goes on (a restart, another box), and its grace is
spent on the final checkpoint. An agent that no longer owns the run (a newer epoch) writes
nothing, as the completion seal does not. Written last, after every log it lists: cut off
before it, the store holds logs no document names, and the pull brings none of them.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional

from onbox.agent.completion import Completion
from onbox.agent.spec import JobSpec
from onbox.common.rundir import RunDir
from onbox.sealing import manifest as mf
from onbox.sealing.sealer import Sealer
from onbox.sealing.stores.base import Store, with_retries

# The states whose logs are sealed here; SUCCEEDED has the completion seal.
ENDED_STATES = ("FAILED", "STOPPED")


def seal_end_logs(
    spec: JobSpec,
    rd: RunDir,
    store: Store,
    sealer: Sealer,
    state: str,
    *,
    event: Callable[..., None],
    warnings: List[Dict[str, Any]],
    root: Optional[str] = "",
) -> bool:
    """Seal each attempt's log of a run that ended ``state`` (FAILED or STOPPED), then
    ENDED.json; True when ENDED.json was written. Store errors are the caller's to say."""
    run = spec.name
    if state not in ENDED_STATES or not sealer.is_writer():
        return False
    before = [w for w in warnings if w.get("kind") == "secret_in_log"]
    done = Completion(
        spec, rd, store, sealer, event=event, warnings=warnings, mirror=lambda: None, root=root
    )
    logs: List[Dict[str, Any]] = []
    for attempt in rd.attempt_numbers():
        logs += done.put_log(attempt)
    # The same log's warning from an earlier end of this run (stopped, started, failed) once.
    for w in before:
        if w in warnings[warnings.index(w) + 1 :]:
            warnings.remove(w)
    if not sealer.is_writer():  # checked again last: the uploads above take time
        return False
    doc = {
        "schema": mf.SCHEMA,
        "run": run,
        "state": state,
        "epoch": sealer.epoch,
        "latest": sealer.latest,
        "files": logs,
        "left_out": done.left_out,
        "ended_at": time.time(),
    }
    with_retries(lambda: store.put_bytes(mf.ended_key(run), mf.dump(doc)))
    event(
        "logs_sealed",
        f"the run ended {state}: {len(logs)} job log(s) sealed to the store with "
        f"{mf.ended_key(run)}, for `rgt pull` once the box is gone",
        logs=[f["path"] for f in logs],
        state=state,
    )
    return True
