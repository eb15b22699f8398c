"""Whose run it is in the store: the epoch this box's writer of a run took, and the check that
keeps a writer which only goes on with a run here from taking it back from another box.

Each agent start takes a new epoch in the store, and the newest owns the run
(onbox/sealing/ledger.py). A new incarnation (``rgt-agent start`` of a new or ended run) takes one
whatever the store holds: that is how a fresh box takes a run over. A writer that only goes on
with the run on this box does not: an agent that adopts it (one the shim respawned, ``rgt-agent
start`` or ``boot`` of a run that had not ended, ``rgt-agent stop`` with no agent alive) and
``rgt-agent sync`` with no agent alive. They take the next epoch only while the one this box's
last writer took (``epoch.json`` in the run directory, written as soon as an epoch is taken;
for a run begun before that file, the last ``epoch`` event) is still the newest in the store,
and only if no other writer takes that number first (``take_epoch_after``). When another box
has taken the run over meanwhile, they take none and write nothing to the store: no checkpoint,
MANIFEST, LATEST, state mirror or DONE.json. ``Superseded`` says so: one ``superseded`` event,
and for ``rgt-agent sync`` its one-line error (exit 7). A run this box never wrote (no epoch
recorded) takes one as before.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from onbox.agent.journal import read_events
from onbox.common import jsondoc
from onbox.common.durable import read_json, write_json
from onbox.common.errors import StoreError, UnsafeRefused
from onbox.common.rundir import RunDir
from onbox.sealing import manifest as mf
from onbox.sealing.ledger import newest_epoch, take_epoch, take_epoch_after
from onbox.sealing.stores.base import Store


class Superseded(UnsafeRefused):
    """Another box's agent took the run over in the store after this box's last writer."""

    def __init__(self, run: str, url: str, own: int, newer: int, holder: str) -> None:
        super().__init__(
            f"run {run} was taken over in {url} by a newer agent (epoch {newer}{holder}) after "
            f"this box's (epoch {own}): nothing is written to the store from this box, no "
            "checkpoint, LATEST, state or DONE.json",
            "the run goes on where that agent runs (`rgt-agent sync` there); this box's "
            "checkpoints stay on its disk, and `rgt-agent stop` here stops only this box's copy",
        )
        self.own = own
        self.newer = newer

    def tell(self, event: Callable[..., None]) -> None:
        """The run's ``superseded`` event."""
        event(
            "superseded",
            self.what,
            klass="permanent",
            remedy=self.remedy or "",
            epoch=self.own,
            newer_epoch=self.newer,
        )


def recorded_epoch(rd: RunDir) -> Optional[int]:
    """The epoch this box's newest writer of the run took, or None when none did."""
    try:
        doc = read_json(rd.epoch_record)
    except (OSError, ValueError):
        doc = None
    if isinstance(doc, dict) and _is_epoch(doc.get("epoch")):
        return int(doc["epoch"])
    # A run whose agent predates epoch.json: its last ``epoch`` event says the same.
    for ev in reversed(read_events(rd.events)):
        if isinstance(ev, dict) and ev.get("kind") == "epoch" and _is_epoch(ev.get("epoch")):
            return int(ev["epoch"])
    return None


def _is_epoch(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def take_epoch_here(store: Store, rd: RunDir, *, going_on: bool) -> int:
    """A new epoch in ``store`` for a writer of run ``rd`` on this box, recorded in the run
    directory at once. ``going_on``: the writer goes on with the run here (an adopting agent,
    a sync with no agent): Superseded, with no epoch taken, when another box took it over."""
    own = recorded_epoch(rd) if going_on else None
    if own is None:
        epoch = take_epoch(store, rd.name)
    else:
        got = take_epoch_after(store, rd.name, own)
        if got is None:
            newer = newest_epoch(store, rd.name)
            raise Superseded(rd.name, store.url, own, newer, _holder(store, rd.name, newer))
        epoch = got
    write_json(rd.epoch_record, {"epoch": epoch, "store": store.url})
    return epoch


def _holder(store: Store, run: str, epoch: int) -> str:
    """Who took ``epoch``, as ", host H, pid P" (its document in the store); "" if unknown."""
    try:
        doc = jsondoc.loads(store.get_bytes(mf.epoch_key(run, epoch)) or b"")
        return f", host {doc['host']}, pid {doc['pid']}"
    except (StoreError, ValueError, KeyError, TypeError):  # only words for the message
        return ""
