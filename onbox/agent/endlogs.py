"""The job's logs of a run whose agent lets go of it FAILED, STOPPED or PREEMPTED, sealed to the
store as it ends.

The completion seal (onbox/agent/completion.py) puts the logs in the store only for a run that
succeeded, with DONE.json. The log a user needs most is a failed job's, and without this it
lived on the box alone: ``rgt down`` (or a box that dies) took it away, and ``rgt pull`` of the
store brought the checkpoints and no log. So when its agent lets go of a run, each attempt's
log that no agent sealed into this store yet (onbox/agent/sealedlogs.py: a run started again on
this box keeps its older attempts' logs, sealed by their own agents) goes to the store as the
completion seal puts it (``logs/e<epoch>/attempt-NNNN.log``,
verified by the store as it is uploaded; a log that holds a secret as a redacted copy, with its
``secret_in_log`` warning), then ``logs/e<epoch>.json`` lists them (this agent's log document:
the run, its epoch, the state it ended in, the logs as DONE.json lists them, ``left_out``).
A run that ended FAILED or STOPPED then gets ``ENDED.json`` too, the same document under the
run's name (its newest end): it never means success (no on-done action, no sweep cell, reads
it). ``rgt pull`` brings the logs of every epoch's document, and ENDED.json's while the store
has no DONE.json (controller/results/documents.py).

A run that ended PREEMPTED goes on (a restart, another box, which takes a new epoch and numbers
its attempts from 1 again): its box and its logs may be gone by then, so they are sealed within
the preemption's grace, after the final checkpoint, with what is left of it
(onbox/agent/sealservice.py ``before_terminal``); they never keep the agent past it. The
epoch in every key is what keeps the newer box's logs from replacing the older's.

An agent that no longer owns the run (a newer epoch) writes nothing, as the completion seal does
not. Each document is written last, after every log it lists: cut off before it, the store
holds logs no document names, and the pull brings none of them.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

from onbox.agent import sealedlogs
from onbox.agent.completion import Completion
from onbox.agent.spec import JobSpec
from onbox.common.errors import StoreError, event_class
from onbox.common.faults import crash_point
from onbox.common.rundir import RunDir
from onbox.sealing import manifest as mf
from onbox.sealing.sealer import Sealer
from onbox.sealing.stall import STALL_SETTING, took
from onbox.sealing.stores.base import Store, with_retries

if TYPE_CHECKING:
    from onbox.agent.sealservice import SealService

# The states whose logs are sealed here; SUCCEEDED has the completion seal. Of these, a
# run that ended FAILED or STOPPED also gets ENDED.json.
LOG_STATES = ("FAILED", "STOPPED", "PREEMPTED")
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
    """Seal each attempt's log of a run that ended ``state`` (LOG_STATES) that no agent sealed
    into ``store`` yet (onbox/agent/sealedlogs.py), then this epoch's log document, then
    (FAILED or STOPPED) ENDED.json; True when the log document was written. Store errors are
    the caller's to say."""
    run = spec.name
    if state not in LOG_STATES or not sealer.is_writer():
        return False
    before = [w for w in warnings if w.get("kind") == "secret_in_log"]
    done = Completion(
        spec, rd, store, sealer, event=event, warnings=warnings, mirror=lambda: None, root=root
    )
    # Only the logs no agent sealed into this store yet: a run started again on this box
    # keeps the older attempts' logs, sealed already (onbox/agent/sealedlogs.py).
    logs, sealed = sealedlogs.put_unsealed(rd, store, run, done.put_log)
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
    keys = [mf.logs_doc_key(run, sealer.epoch)]
    if state in ENDED_STATES:
        keys.append(mf.ended_key(run))
    # Recorded as pending first: killed before the second record, the next agent finds them
    # in the log document (onbox/agent/sealedlogs.py) rather than sealing them again.
    sealedlogs.record(rd, store.url, sealer.epoch, sealed, doc=keys[0])
    for key in keys:
        with_retries(functools.partial(store.put_bytes, key, mf.dump(doc)))
    crash_point("logs.before_record")
    sealedlogs.record(rd, store.url, sealer.epoch, sealed)
    event(
        "logs_sealed",
        f"the run ended {state}: {len(logs)} job log(s) sealed to the store with "
        f"{' and '.join(keys)}, for `rgt pull` once the box is gone",
        logs=[f["path"] for f in logs],
        state=state,
    )
    return True


def logs_not_sealed(event: Callable[..., None], why: str) -> None:
    """Say that a preemption left the job's logs unsealed, and ``why``."""
    event(
        "logs_not_sealed",
        f"preemption: the job's logs are not sealed to the store ({why}); they stay on this "
        "box's disk, and go with it",
        klass="transient",
        remedy="give the run a longer grace (--grace) where the platform allows it",
    )


def checkpoint_not_asked(seal: SealService) -> None:
    """A preemption with no budget to seal anything (a grace of 0): a checkpoint asked for now
    could only be half-sealed when SIGKILL comes, and the job's last moments go to its own
    exit, so none is asked for, and that is said."""
    latest = seal.sealer.latest if seal.sealer is not None else "none"
    event = seal.event
    event(
        "checkpoint_not_asked",
        f"preemption with no grace left to seal a final checkpoint; LATEST stays at step {latest}",
        klass="transient",
        remedy="give the run a longer grace (--grace) where the platform allows it",
    )


def seal_cut(seal: SealService, reason: str) -> None:
    """The final seal of a stop or a preemption not begun: the sealing thread was still where
    its ``phase`` says (an upload, a listing, the mirror) when the budget ended."""
    latest = seal.sealer.latest if seal.sealer is not None else None
    event = seal.event
    event(
        "seal_cut",
        f"the sealing thread was {seal.phase} when the {reason} budget ended; "
        f"LATEST stays at step {latest}",
        klass="transient",
        remedy="a longer grace, or smaller/more frequent checkpoints",
    )
    if reason == "preempt":
        logs_not_sealed(event, "the grace ended before the checkpoints' seal did")


def in_grace(seal: Callable[[], None], left: float, event: Callable[..., None]) -> None:
    """Run ``seal`` (the logs of a run being preempted) within the ``left`` seconds of its
    grace. A seal not done by then is left to run in a daemon thread (the agent exits soon
    after; the log document, written last, is then never written, or written whole after every
    log it lists) and said with ``seal_error``, as a failure is: the agent lets go in time."""
    if left <= 0:
        logs_not_sealed(event, "no grace was left after the final checkpoint")
        return
    keep = "the job's logs stay on this box's disk, and go with it"
    worker = threading.Thread(
        target=functools.partial(said, seal, event, keep), name="rgt-seal-logs", daemon=True
    )
    worker.start()
    worker.join(left)
    if worker.is_alive():
        event(
            "seal_error",
            f"preemption: the job's logs were still being sealed when the grace ended "
            f"({left:.1f}s were left after the final checkpoint); the agent lets go of the run "
            "without them",
            klass="transient",
            remedy=f"a longer grace (--grace) where the platform allows it; {keep}",
        )


def said(seal: Callable[[], None], event: Callable[..., None], keep: str) -> None:
    """Run ``seal``; a failure is a ``seal_error`` event (its remedy ends with ``keep``, where
    the logs are meanwhile), never raised: the agent must still let go of the run."""
    try:
        seal()
    except StoreError as e:
        remedy = (e.remedy + "; " if e.remedy else "") + keep
        event("seal_error", e.what, klass=event_class(e), remedy=remedy)
    except Exception as e:  # a bug must not keep the agent from letting go of the run
        what = f"sealing the job's logs failed: {type(e).__name__}: {e}"
        event("seal_error", what, klass="permanent", remedy=keep)


def seal_logs(seal: SealService, state: str, bound: float) -> None:
    """``seal_end_logs`` for the agent's sealing ``seal`` (its sealer must be set), each store
    call bounded by ``bound``; its ``logs_sealed`` set when the log document was written.
    Raises what the store raises."""
    assert seal.sealer is not None
    with seal.store.calls_bounded(bound):
        seal.logs_sealed |= seal_end_logs(
            seal.spec,
            seal.rd,
            seal.store,
            seal.sealer,
            state,
            event=seal.event,
            warnings=seal.warnings,
            root=seal.workdir_root(),
        )


def logs_in_grace(seal: SealService, budget_end: float) -> None:
    """The logs of a run being preempted, in what is left of the grace once the final
    checkpoint is sealed, never past ``budget_end`` (monotonic; ``in_grace``)."""
    if seal.elsewhere:
        return
    left = budget_end - time.monotonic()
    bound = min(seal.spec.restore_stall, max(left, 0.0))
    in_grace(functools.partial(seal_logs, seal, "PREEMPTED", bound), left, seal.event)


def logs_at_end(seal: SealService, ended: str) -> bool:
    """The logs of a run that ended FAILED or STOPPED, to the store, each call bounded by
    ``[store] stall`` (a hung mount must not keep the agent, and the run's lock, for ever);
    an error said, never raised (the agent must still let go of the run). The uploads of the
    logs are copies, which that bound does not watch (hangbound.py: they are cut when they
    move nothing for it, on every store, the Hub's too): the seal as a whole gets
    the sum of its calls' bounds (a log's upload, and four calls for the documents: two
    listings, two puts), and one not done by then is left to a daemon thread and said, as
    ``in_grace`` leaves a preemption's."""
    if ended not in ENDED_STATES or seal.elsewhere:
        return False
    stall = seal.spec.restore_stall
    keep = "the job's logs stay on the box: pull them before the box goes"
    run = functools.partial(
        said, functools.partial(seal_logs, seal, ended, stall), seal.event, keep
    )
    worker = threading.Thread(target=run, name="rgt-seal-logs", daemon=True)
    worker.start()
    bound = stall * (len(seal.rd.attempt_numbers()) + 4)
    worker.join(bound)
    if worker.is_alive():
        event = seal.event
        event(
            "seal_error",
            f"the job's logs were not sealed: {seal.store.url} did not answer for {took(bound)} "
            "(their upload); the agent lets go of the run without them",
            klass="transient",
            remedy="check the store (a hung mount, a store that stopped answering) and its "
            f"server, then try again; a store that slow can be given longer: {STALL_SETTING}; "
            + keep,
        )
    return True
