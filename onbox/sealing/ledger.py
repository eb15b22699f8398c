"""The store-side ledger of a run: who owns it (epochs), what is sealed (MANIFESTs), where it
stands (LATEST), and what goes (pins, pruning, quarantine).

One writer per run, fenced at every write. Each agent start takes a new epoch (``epochs/<n>``,
created if absent: ``take_epoch``; one that goes on from an epoch it took before takes the next
only while none newer exists: ``take_epoch_after``; both in onbox/sealing/epochs.py); the newest
epoch owns the run. An agent
that lost it (a preempted box come back, an agent frozen mid-upload while a new box took over)
is kept from doing harm this way:

- objects: the files of checkpoint S sealed by epoch E go under ``checkpoints/S/eE/``, a prefix
  no other epoch writes, and dedupe only against objects of E (onbox/sealing/sealer.py); so no
  writer ever overwrites another's object, and an old agent's late upload lands beside the
  newer agent's, never on it;
- MANIFEST and LATEST: written only by compare-and-swap (``Store.get_versioned``, then
  ``put_bytes(if_absent=True)`` or ``put_bytes(if_match=VERSION)``: S3 If-None-Match/If-Match,
  a Hub commit on the head that was checked, a ``file://`` check and rename under the run's
  lock), and only after ``epochs/`` shows no newer epoch. A MANIFEST or LATEST that a newer
  epoch wrote is never replaced (LATEST carries its writer's epoch, ``writer``); each write is
  read back, and ``epochs/`` listed again, afterwards;
- a new agent claims LATEST when it loads (rewrites it with its own epoch as ``writer``), so
  from then on an older agent's conditional LATEST write fails even where the newer one has not
  sealed anything yet; a MANIFEST above LATEST whose epoch is older than LATEST's writer (an old
  agent's, written late) is never promoted; one that is newer (with no LATEST yet, any) is
  promoted only when every file it lists is in the store with its size (and sha256, where the
  store keeps one);
- the first time an agent finds a newer epoch it says so once (``stale_epoch``, class
  permanent, naming both epochs) and never writes an object, a MANIFEST or LATEST again, nor
  prunes.

LATEST moves down in one case only: from a checkpoint restore quarantined (corrupt in the store)
to a newer verified one of this epoch, after restore fell back below it
(``latest_after_quarantine``). A quarantined step may be sealed again by a newer epoch: its
record moves to ``quarantine/<step>.e<epoch>.json`` with the MANIFEST it judged (kept, no longer
in the way), then the new MANIFEST replaces the old. Pruning keeps what LATEST names, the newest
checkpoint before it, the newest ``keep``, every pinned one, and every object a kept (or
quarantined, or not promoted) MANIFEST references.

The quarantine records themselves (``quarantine/<step>.json``, written by restore) are
onbox/sealing/quarantine.py's.
"""

from __future__ import annotations

import functools
import json
import time
from typing import Any, Callable, Dict, List, Optional, Set, Union

from onbox.common.errors import (
    IntegrityError,
    PermanentStoreError,
    PreconditionFailed,
    TransientStoreError,
)
from onbox.common.faults import crash_point
from onbox.sealing import manifest as mf
from onbox.sealing.quarantine import quarantined
from onbox.sealing.stores.base import Store, with_retries

CAS_ATTEMPTS = 8  # conditional writes of one document before giving up (another writer races)


def _numbered(store: Store, prefix: str) -> Set[int]:
    """The numbers naming the documents under ``prefix`` (``epochs/<n>``, ``pinned/<step>``)."""
    out = set()
    for info in store.list(prefix):
        tail = info.key.rsplit("/", 1)[-1]
        if tail.isdigit():
            out.add(int(tail))
    return out


def newest_epoch(store: Store, run: str) -> int:
    """The newest epoch ``epochs/`` holds (0: none)."""
    return max(_numbered(store, mf.epochs_prefix(run)), default=0)


def pinned_steps(store: Store, run: str) -> Set[int]:
    """The steps ``pinned/`` keeps from pruning."""
    return _numbered(store, mf.pins_prefix(run))


class Ledger:
    """One agent's view of its run's documents in the store, and its only way to write them.
    Not thread-safe: the sealer holds its lock around every call that writes."""

    def __init__(
        self, run: str, store: Store, *, epoch: int, keep: int, event: Callable[..., None]
    ) -> None:
        self.run = run
        self.store = store
        self.epoch = epoch
        self.keep = max(1, keep)
        self.event = event
        self.manifests: Dict[int, Dict[str, Any]] = {}  # sealed, verified, not quarantined
        # MANIFESTs in the store that are not sealed checkpoints of this run's line: quarantined
        # ones, an old agent's late ones, unverified ones. Their objects are never pruned.
        self.others: Dict[int, Dict[str, Any]] = {}
        self.quarantined: Set[int] = set()
        self.latest: Optional[int] = None
        self.stale = False
        self.pruned: Set[int] = set()

    # ---- what the store holds
    def load(self) -> None:
        """Read the sealed manifests and LATEST from the store; promote a verified MANIFEST
        newer than LATEST, or the newest verified one where there is no LATEST yet (an agent
        that died between the two), and claim LATEST for this epoch (see the module docstring)."""
        self.manifests, self.others = {}, {}
        self.quarantined = self.quarantined_steps()
        latest = self.read_latest()
        found = self._read_manifests()
        at = latest["step"] if latest else None
        writer = mf.latest_writer(latest) if latest else 0
        newer: List[int] = []
        for step, doc in found.items():
            if step in self.quarantined:
                self.others[step] = doc  # not sealed: the step may be sealed again
            # With no LATEST yet, every MANIFEST is above it: the first seal's writer may have
            # died between the two. Taken as sealed unpromoted, its step was never sealed
            # again nor LATEST written (a sync said "LATEST is step none" and exited 0).
            elif at is not None and step <= at:
                self.manifests[step] = doc
            else:
                newer.append(step)
        promote = None
        for step in sorted(newer, reverse=True):
            doc = found[step]
            epoch = mf.manifest_epoch(doc)
            if epoch < writer:
                problem: Optional[str] = (
                    f"it was written by epoch {epoch} after epoch {writer} had taken the run "
                    f"over (LATEST is step {at}): an old agent's, written late"
                )
            else:
                problem = self.unverified(doc)
            if problem is not None:
                self.others[step] = doc
                self.event(
                    "manifest_not_promoted",
                    f"the MANIFEST of step {step} is newer than LATEST but is not promoted: "
                    f"{problem}",
                    klass="integrity",
                    remedy="nothing to do: it is left in the store, and LATEST stays",
                    step=step,
                )
                continue
            self.manifests[step] = doc
            promote = step if promote is None else promote
        self.latest = at
        if promote is not None:
            # A MANIFEST is written only after its files verified: an agent that died before
            # moving LATEST left a good checkpoint behind. Finish its job.
            self.advance_latest(promote)
        elif latest is not None:  # the claim: LATEST as it is, with this epoch as its writer
            self.advance_latest(latest["step"], epoch=mf.manifest_epoch(latest))

    def _read_manifests(self) -> Dict[int, Dict[str, Any]]:
        """Every readable MANIFEST of the run, by step; an unreadable one is said and left."""
        found: Dict[int, Dict[str, Any]] = {}
        for info in self.store.list(mf.checkpoints_prefix(self.run)):
            step = mf.manifest_step(self.run, info.key)
            if step is None:
                continue  # an object, or a file of a checkpoint named MANIFEST.json
            data = with_retries(functools.partial(self.store.get_bytes, info.key))
            if data is None:
                continue
            try:
                doc = mf.parse_manifest(data, info.key)
                if doc["step"] != step:
                    raise IntegrityError(f"{info.key} is for step {doc['step']}")
            except IntegrityError as e:
                self.event(
                    "manifest_unreadable",
                    e.what,
                    klass="integrity",
                    remedy="it is ignored; the previous checkpoint is used",
                )
                continue
            found[step] = doc
        return found

    def read_latest(self) -> Optional[Dict[str, Any]]:
        data = with_retries(functools.partial(self.store.get_bytes, mf.latest_key(self.run)))
        return mf.parse_latest(data)

    def quarantined_steps(self) -> Set[int]:
        return set(quarantined(self.store, self.run))

    def forget_quarantined(self) -> None:
        """Restore may have quarantined sealed steps: they are no longer sealed ones."""
        self.quarantined = self.quarantined_steps()
        for step in self.quarantined:
            if step in self.manifests:
                self.others[step] = self.manifests.pop(step)

    def unverified(self, doc: Dict[str, Any]) -> Optional[str]:
        """Why the store does not hold every file of ``doc`` as listed (present, its size, its
        sha256 where the store keeps one), or None when it does. From the store's own stat:
        nothing is downloaded."""
        for f in doc["files"]:
            key = mf.object_key(self.run, doc["step"], f)
            info = with_retries(functools.partial(self.store.stat, key))
            if info is None:
                return f"{key} is missing"
            if info.size != f["size"]:
                return f"{key} is {info.size} bytes, the MANIFEST says {f['size']}"
            if info.sha256 is not None and info.sha256 != f["sha256"]:
                return f"{key} has sha256 {info.sha256[:12]}, the MANIFEST says {f['sha256'][:12]}"
        return None

    # ---- fencing: one writer per run
    def _go_stale(self, newest: int, what: str) -> None:
        """From now on this agent writes nothing to the store; said once."""
        if self.stale:
            return
        self.stale = True
        self.event(
            "stale_epoch",
            f"a newer agent (epoch {newest}) has taken run {self.run} over in {self.store.url}; "
            f"this one (epoch {self.epoch}) stops writing to the store: {what} is not sealed, "
            "and it writes no checkpoint, MANIFEST or LATEST of this run again",
            klass="permanent",
            remedy="stop this old agent (`rgt-agent stop` on this box): the run goes on with "
            "the newer one; this box's checkpoints stay on its disk",
            epoch=self.epoch,
            newer_epoch=newest,
        )

    def is_stale(self, what: str = "the next checkpoint") -> bool:
        """Whether a newer epoch owns the run (listed afresh until it does: then for good)."""
        if not self.stale:
            newest = with_retries(lambda: newest_epoch(self.store, self.run))
            if newest < self.epoch:
                raise self._epoch_gone(newest, what)
            if newest > self.epoch:
                self._go_stale(newest, what)
        return self.stale

    def _epoch_gone(self, newest: int, what: str) -> PermanentStoreError:
        """The store no longer holds the epoch this agent took: it is not the store the run
        was taken in (a durable mount dropped or swapped under its path, a bucket emptied,
        another endpoint), and what is written there would not be the run's."""
        return PermanentStoreError(
            f"{self.store.url} no longer holds run {self.run}'s epoch {self.epoch} (its newest "
            f"is {newest or 'none'}): it is not the store this agent took the run in (was the "
            f"durable mount unmounted? the bucket emptied?); {what} is not sealed",
            "check the store; nothing is written to it until the run's epoch is back there "
            "or the run is started again; the checkpoints stay on the box",
        )

    def is_writer(self) -> bool:
        """Whether this agent still owns the run's store prefix (no newer epoch): callers
        that write other documents of the run (DONE.json, outputs) ask first."""
        return not self.is_stale("the run's documents")

    def _cas(
        self, key: str, decide: Callable[[Optional[bytes]], Union[bytes, bool]], what: str
    ) -> bool:
        """Compare-and-swap ``key``: ``decide`` sees the current bytes (None: absent) and
        answers the bytes to write, True (it is as wanted already) or False (write nothing);
        the write happens only if ``key`` is still what was read, else it is read again. After
        the write ``epochs/`` is listed and the document read back: a newer epoch means this
        agent is stale (False), another writer's bytes there mean read and decide again."""
        for _ in range(CAS_ATTEMPTS):
            if self.is_stale(what):
                return False
            cur = with_retries(functools.partial(self.store.get_versioned, key))
            data = decide(None if cur is None else cur[0])
            if data is True or data is False:
                return data and not self.stale
            try:
                if cur is None:
                    put = functools.partial(self.store.put_bytes, key, data, if_absent=True)
                else:
                    put = functools.partial(self.store.put_bytes, key, data, if_match=cur[1])
                with_retries(put)
            except PreconditionFailed:
                continue  # another writer got there first: look again
            if self.is_stale(what):
                return False
            if with_retries(functools.partial(self.store.get_bytes, key)) == data:
                return True
        raise TransientStoreError(
            f"{what}: {key} in {self.store.url} changed under each of {CAS_ATTEMPTS} "
            "conditional writes",
            "another writer races this agent; it is tried again at the next seal",
        )

    # ---- writing MANIFESTs and LATEST
    def put_manifest(self, step: int, doc: Dict[str, Any]) -> bool:
        """Write checkpoint ``step``'s MANIFEST: created, or replacing one of an older epoch
        (an old agent's, or a quarantined one), never one a newer epoch wrote."""
        key = mf.manifest_key(self.run, step)
        data = mf.dump(doc)
        what = f"the MANIFEST of step {step}"
        if step in self.quarantined and not self._unquarantine(step, what):
            return False

        def decide(cur: Optional[bytes]) -> Union[bytes, bool]:
            if cur is None:
                return data
            if cur == data:
                return True
            try:
                epoch = mf.manifest_epoch(mf.parse_manifest(cur, key))
            except IntegrityError:
                epoch = -1  # a malformed MANIFEST is no checkpoint: replaced
            if epoch > self.epoch:
                self._go_stale(epoch, what)
                return False
            return data

        return self._cas(key, decide, what)

    def _unquarantine(self, step: int, what: str) -> bool:
        """Before a newer epoch seals ``step`` again: its quarantine record moves to
        ``quarantine/<step>.e<epoch>.json`` together with the MANIFEST it judged, so both are
        kept and the new checkpoint is not hidden by them. A crash in between leaves the old
        MANIFEST unflagged; a restore finds it corrupt again and flags it again."""
        if self.is_stale(what):
            return False
        old = self.others.get(step)
        qkey = mf.quarantine_key(self.run, step)
        record = with_retries(functools.partial(self.store.get_bytes, qkey))
        epoch = mf.manifest_epoch(old) if old is not None else 0
        archive = json.dumps(
            {
                "step": step,
                "record": (record or b"").decode("utf-8", "replace"),
                "manifest": old,
                "sealed_again_by": self.epoch,
                "at": time.time(),
            },
            indent=1,
        ).encode()
        akey = mf.quarantine_attempt_key(self.run, step, epoch)
        with_retries(functools.partial(self.store.put_bytes, akey, archive))
        with_retries(functools.partial(self.store.delete, qkey))
        self.quarantined.discard(step)
        self.event(
            "quarantine_superseded",
            f"step {step} was quarantined (its record and MANIFEST are kept as {akey}); "
            f"epoch {self.epoch} seals a new checkpoint of that step",
            step=step,
        )
        return True

    def advance_latest(self, step: int, epoch: Optional[int] = None) -> bool:
        """Point LATEST at ``step`` (whose MANIFEST ``epoch`` sealed: by default this agent's,
        or the one in ``self.manifests``), written by this epoch. Never backwards, except away
        from a quarantined checkpoint; never over a LATEST a newer epoch wrote. True when
        LATEST names it now."""
        if epoch is None:
            doc = self.manifests.get(step)
            epoch = mf.manifest_epoch(doc) if doc is not None else self.epoch
        key = mf.latest_key(self.run)
        what = f"LATEST -> step {step}"
        down_from: List[int] = []

        def decide(cur: Optional[bytes]) -> Union[bytes, bool]:
            down_from.clear()
            try:
                doc = mf.parse_latest(cur)
            except IntegrityError:
                doc = None  # an unreadable LATEST names nothing: replaced
            if doc is not None:
                writer = mf.latest_writer(doc)
                if writer > self.epoch:
                    self._go_stale(writer, what)
                    return False
                at = doc["step"]
                if at == step and writer == self.epoch and mf.manifest_epoch(doc) == epoch:
                    return True
                if step < at:
                    if at not in self.quarantined_steps():
                        return False  # never backwards
                    down_from.append(at)
            return mf.dump(mf.new_latest(self.run, step, epoch, writer=self.epoch))

        if not self._cas(key, decide, what):
            return False
        moved = self.latest != step
        self.latest = step
        if down_from:
            self.event(
                "latest_after_quarantine",
                f"LATEST -> step {step}, down from step {down_from[0]}, which is quarantined "
                "(unusable in the store): the run went on from an earlier checkpoint",
                klass="integrity",
                remedy=f"see {mf.quarantine_key(self.run, down_from[0])} in the store",
                step=step,
                quarantined=down_from[0],
            )
        elif moved:
            self.event("latest", f"LATEST -> step {step}", step=step)
        return True

    # ---- rotation
    def _kept(self) -> Set[int]:
        """The sealed steps pruning keeps (see the module docstring)."""
        assert self.latest is not None
        steps = sorted(self.manifests)
        before = [s for s in steps if s < self.latest]
        return (
            set(steps[-self.keep :])
            | {self.latest}
            | set(before[-1:])  # the newest verified one before LATEST: the fallback
            | {s for s in steps if s > self.latest}  # sealed, LATEST not there yet
            | (pinned_steps(self.store, self.run) & set(steps))
        )

    def prune(self) -> None:
        if self.stale or self.latest is None:
            return
        keep = self._kept()
        drop = [s for s in sorted(self.manifests) if s not in keep]
        if not drop:
            return
        referenced = {
            f["key"]
            for docs in (self.others, {s: self.manifests[s] for s in keep})
            for doc in docs.values()
            for f in doc["files"]
        }
        for s in drop:
            # Listed afresh before each checkpoint goes: an agent that lost the run between
            # two deletes stops there.
            if self.is_stale(f"pruning step {s}"):
                return
            doc = self.manifests.pop(s)
            self.pruned.add(s)
            # The MANIFEST goes first: a checkpoint without one does not exist.
            with_retries(functools.partial(self.store.delete, mf.manifest_key(self.run, s)))
            for f in doc["files"]:
                if f["key"] not in referenced:
                    with_retries(functools.partial(self.store.delete, f["key"]))
                    crash_point("prune.after_delete")
            self.event("pruned", f"step {s} pruned (keeping {sorted(keep)})", step=s)
