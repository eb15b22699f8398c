"""Taking up a run in the store, as its agent starts (``SealService.start``,
onbox/agent/sealservice.py), before the background thread: the epoch (none when another box
took the run over: onbox/agent/ownership.py), the uploads a dead agent left half-done, the
sealer with what the store holds, the run's history for ``checkpoint.interval = "auto"``, and
for a new incarnation the restore of the newest verified checkpoint. ``seal.doing`` says which
of them is under way, for the beginning that fails (onbox/agent/beginning.py).
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING

from onbox.agent.interval import AutoInterval, load_history
from onbox.agent.journal import read_events
from onbox.agent.ownership import Superseded, take_epoch_here
from onbox.sealing import manifest as mf
from onbox.sealing.restore import restore_latest
from onbox.sealing.sealer import Sealer

if TYPE_CHECKING:
    from onbox.agent.sealservice import SealService


def take_up(seal: SealService, begin: bool, adopting: bool) -> bool:
    """``SealService.start`` up to its thread: the epoch, the stale uploads, the sealer, the
    history and (``begin``) the restore; False when another box took the run over."""
    run, url, event = seal.spec.name, seal.store.url, seal.event
    seal.doing = f"taking the run's epoch in {url}"
    try:
        epoch = take_epoch_here(seal.store, seal.rd, going_on=adopting)
    except Superseded as e:
        seal.superseded = True
        e.tell(event)
        return False  # no sealer, no thread: nothing of this agent reaches the store
    seal.doing = f"aborting the uploads a dead agent left in {url}"
    aborted = seal.store.abort_stale_uploads(f"{run}/")
    if aborted:
        event(
            "uploads_aborted",
            f"aborted {aborted} upload(s) a dead agent left half-done",
            klass="transient",
        )
    seal.doing = f"reading the run's checkpoints in {url}"
    seal.sealer = Sealer.for_run(
        seal.rd,
        seal.store,
        seal.spec.ckpt_dir,
        epoch=epoch,
        keep=seal.spec.keep,
        event=event,
    )
    # A link in a checkpoint is followed only where the job's files are this filesystem
    # (a pod's job container may have its own: onbox/sealing/discovery.py).
    seal.sealer.follow_links = lambda: seal.workdir_root() == ""
    seal.sealer.load()
    key = mf.state_key(run, "events.jsonl")  # the history, read before our first mirror
    get = functools.partial(seal.store.get_bytes, key)
    read = functools.partial(load_history, read_events(seal.rd.events), get, begin)
    seal.doing = f"reading the run's history in {url}"
    hist = read() if seal.spec.ckpt_auto else None
    event(
        "epoch",
        f"epoch {epoch} in {seal.store.url}; LATEST is "
        f"{seal.sealer.latest if seal.sealer.latest is not None else 'empty'}",
        epoch=epoch,
    )
    if seal.spec.ckpt_auto:
        floor = seal.spec.health.stall.floor  # never ask faster than a hang is told apart
        seal.auto = AutoInterval(hist, floor, time.time(), seal.rd.events, event, read)
        seal.auto.start(time.time())
    if begin:
        seal.doing = f"restoring the newest checkpoint from {url}"
        seal.restored = restore_latest(
            seal.store, run, seal.spec.ckpt_dir, event, stall=seal.spec.restore_stall
        )
        if seal.restored is not None:
            seal.sealer.remember_restored(seal.restored)
    return True
