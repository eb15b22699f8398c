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

import os
import secrets
from typing import Any, Callable, Dict, Optional

from onbox.agent.journal import read_events
from onbox.common.durable import read_json, write_json
from onbox.common.errors import StoreError, UnsafeRefused
from onbox.common.rundir import RunDir
from onbox.common.terminal import printable
from onbox.sealing.epochs import epoch_doc, take_epoch, take_epoch_after
from onbox.sealing.ledger import newest_epoch
from onbox.sealing.stores.base import Store


class Superseded(UnsafeRefused):
    """Another box's agent took the run over in the store after this box's last writer."""

    def __init__(self, run: str, url: str, own: int, newer: int, holder: str) -> None:
        super().__init__(
            f"run {run} was taken over in {url} by a newer agent (epoch {newer}{holder}) after "
            f"this box's (epoch {own}): nothing is written to the store from this box, no "
            "checkpoint, LATEST, state or DONE.json",
            "the run goes on where that agent runs (`rgt-agent sync` there); this box's "
            "checkpoints stay on its disk, and its agent stops this box's copy of the job",
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
    mark = writer_mark(rd)  # recorded before any epoch is taken: see _go_on
    own = recorded_epoch(rd) if going_on else None
    epoch = take_epoch(store, rd.name, mark) if own is None else _go_on(store, rd, own, mark)
    write_json(rd.epoch_record, {"epoch": epoch, "store": store.url, "writer": mark})
    return epoch


def _go_on(store: Store, rd: RunDir, own: int, mark: str) -> int:
    """The epoch after ``own``, or Superseded. A newer epoch that this run directory's own mark
    took (a writer here killed between taking it and recording it in epoch.json) is this box's,
    not another's: without that, a kill -9 or a power cut at that moment would stop the box
    sealing its run for good."""
    while True:
        got = take_epoch_after(store, rd.name, own, mark)
        if got is not None:
            return got
        newest = newest_epoch(store, rd.name)
        doc = _epoch_doc(store, rd.name, newest)
        if newest > own and doc.get("writer") == mark and doc.get("host") == _host():
            own = newest  # and go on after it: ``own`` only grows, so this ends
            continue
        raise Superseded(rd.name, store.url, own, newest, _holder(doc))


def writer_mark(rd: RunDir) -> str:
    """This run directory's mark, put into every epoch document its writers take; made once and
    kept in epoch.json, written before the first epoch is taken. Together with the host name
    it tells this box's epochs from another box's (a disk cloned into a new box carries the
    mark, not the host name)."""
    try:
        doc = read_json(rd.epoch_record)
    except (OSError, ValueError):
        doc = None
    doc = doc if isinstance(doc, dict) else {}
    mark = doc.get("writer")
    if isinstance(mark, str) and len(mark) == 32 and mark.isalnum():
        return mark
    doc["writer"] = secrets.token_hex(16)
    write_json(rd.epoch_record, doc)
    return str(doc["writer"])


def _host() -> str:
    return os.uname().nodename


def _epoch_doc(store: Store, run: str, epoch: int) -> Dict[str, Any]:
    try:
        return epoch_doc(store, run, epoch)
    except StoreError:  # read for the mark and the message only: as if it said nothing
        return {}


def _holder(doc: Dict[str, Any]) -> str:
    """Who took an epoch, as ", host H, pid P" (its document in the store); "" if unknown."""
    if "host" not in doc or "pid" not in doc:
        return ""
    return f", host {printable(str(doc['host']))}, pid {printable(str(doc['pid']))}"
