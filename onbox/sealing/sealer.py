"""The sealer: makes the job's complete checkpoints durable in the store.

For each new complete checkpoint (onbox/sealing/discovery.py says what one is), oldest first:
stage what may change under us, hash while reading, upload every file (or point at an identical
file an earlier checkpoint of this epoch already holds), let the store verify it (many files in
flight at once: onbox/sealing/upload.py), write its MANIFEST once every one is verified, then
advance LATEST (by step, never backwards, only while this agent's epoch is the
newest) and prune: the ledger (onbox/sealing/ledger.py) writes those documents, fenced.

A checkpoint with a name that could not come back, an entry that is no regular file and a
symlink in the checkpoint dir are never sealed, each said once (onbox/sealing/refusals.py).

A checkpoint that fails for a reason retrying cannot fix (an IntegrityError, a
PermanentStoreError: the store refuses that object) does not end the pass: oldest first, it
would otherwise block every newer checkpoint for the rest of the run. Once a newer one is
sealed after it, the failure is known to be that checkpoint's own: one ``seal_failed`` event,
and it is not tried again until it changes. While none is, the failure is raised as before and
the pass retried with backoff: a full or read-only mount refuses every checkpoint alike, and
the newest must be sealed once it is fixed. A store that refuses the credentials refuses every
checkpoint alike: that is raised at once, as before.

A file with no step in its name that the job rewrites in place (``ckpt.pt``) is a sequence: each
completed rewrite is the next step (remembered on the box in RunDir.sealer_state). Such a file
is staged (copied while hashed, and checked not to have changed meanwhile) before upload, so the
upload never reads a half-rewritten file.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from onbox.common import progress
from onbox.common.durable import write_json
from onbox.common.errors import (
    IntegrityError,
    PermanentStoreError,
    RgtError,
    StoreAuthError,
    StoreError,
)
from onbox.common.faults import crash_point
from onbox.common.rundir import RunDir
from onbox.common.wholefile import looks_whole
from onbox.sealing import manifest as mf
from onbox.sealing.dirlinks import Seen, links_state
from onbox.sealing.discovery import (
    Candidate,
    in_place,
    listing,
    open_for_writing,
    signature,
    step_from_name,
)
from onbox.sealing.epochs import take_epoch
from onbox.sealing.ledger import Ledger
from onbox.sealing.refusals import Refusals
from onbox.sealing.room import Room
from onbox.sealing.stores.base import Store
from onbox.sealing.upload import CheckpointUpload, OutOfTime, Vanished

MAX_BACKLOG = 8  # pending checkpoints sealed per pass at most (the newest ones)
# A seal that puts fewer bytes than this measures its fixed costs (the epoch's listing, the
# MANIFEST's put, the fsyncs), not how fast bytes go: it leaves ``bytes_per_s`` alone, which a
# preemption's final seal is judged by (onbox/agent/budgetseal.py). Moved by small seals, the
# rate fell under 1 MB/s after a few, and a final seal that fitted was refused.
RATE_MIN_BYTES = 8 << 20


class Sealer:
    """Seals one run's checkpoints into a store. Thread-safe: one seal at a time."""

    def __init__(
        self,
        run: str,
        ckpt_dir: str,
        store: Store,
        staging: str,
        *,
        epoch: int,
        keep: int = 3,
        event: Callable[..., None],
        state_path: str,
        links_path: Optional[str] = None,
    ) -> None:
        self.run = run
        self.ckpt_dir = ckpt_dir
        self.store = store
        self.staging = staging
        self.event = event
        self.ledger = Ledger(run, store, epoch=epoch, keep=keep, event=event)
        self.state_path = state_path  # local memory of in-place sequences
        self.lock = threading.Lock()
        self.torn: Dict[str, Tuple[int, int, int]] = {}
        self.refusals = Refusals(event)  # what is never sealed, each said once
        self.failed: Dict[str, Tuple[int, int, int]] = {}  # failed for good, until they change
        self.bytes_per_s = 50e6  # until measured: a cautious guess for the preemption estimate
        self.backlog: Optional[int] = None  # complete checkpoints the last pass left unsealed
        self.seq: Dict[str, Dict[str, Any]] = self._load_seq()
        # The dir's links as observed: recorded with their target; kept next to the sequences
        # (RunDir.sealer_links), so an agent restarted before a MANIFEST still records them.
        self.seen = Seen(ckpt_dir, links_path or links_state(state_path))
        # The seconds the job's save of a step held its loop, where the job reports it
        # (onbox/common/progress.py): carried on the ``sealed`` event for the auto interval.
        self.job_blocked: Callable[[int], Optional[float]] = lambda step: None
        # Whether a symlink to a regular file inside a checkpoint is sealed as that file
        # (onbox/sealing/discovery.py): only where the job's files are in this filesystem,
        # which the agent knows (a pod's job container may not be); not assumed.
        self.follow_links: Callable[[], bool] = lambda: False

    @classmethod
    def for_run(
        cls,
        rd: RunDir,
        store: Store,
        ckpt_dir: str,
        *,
        keep: int,
        event: Callable[..., None],
        epoch: Optional[int] = None,
    ) -> Sealer:
        """The sealer of the run ``rd`` (its staging and sequence memory in the run dir), as
        the writer of a new epoch unless ``epoch`` is given. Call ``load`` before sealing."""
        sealer = cls(
            rd.name,
            ckpt_dir,
            store,
            rd.staging,
            epoch=take_epoch(store, rd.name) if epoch is None else epoch,
            keep=keep,
            event=event,
            state_path=rd.sealer_state,
            links_path=rd.sealer_links,
        )

        def blocked(step: int) -> Optional[float]:
            # The report is read when the seal is done, by which time the job has long
            # written it; a report of a newer save is the same job's cost all the same.
            save = progress.last_save(progress.read(rd.path))
            return save[1] if save is not None and save[0] >= step else None

        sealer.job_blocked = blocked
        return sealer

    # ---- the ledger's view, for the agent and the tests
    @property
    def epoch(self) -> int:
        return self.ledger.epoch

    @property
    def latest(self) -> Optional[int]:
        return self.ledger.latest

    @property
    def manifests(self) -> Dict[int, Dict[str, Any]]:
        return self.ledger.manifests

    @property
    def stale(self) -> bool:
        return self.ledger.stale

    def is_writer(self) -> bool:
        """Whether this agent still owns the run's store prefix (``Ledger.is_writer``)."""
        return self.ledger.is_writer()

    def load(self) -> None:
        """The ledger from the store (``Ledger.load``); in-place sequences continue from the
        steps sealed."""
        self.ledger.load()
        for step, doc in self.manifests.items():  # sequences continue after a restore
            if in_place(doc["root"], doc.get("kind", "")):
                entry = self.seq.setdefault(doc["root"], {"step": -1, "sig": None})
                entry["step"] = max(entry["step"], step)

    def _load_seq(self) -> Dict[str, Dict[str, Any]]:
        try:
            with open(self.state_path) as f:
                data = json.load(f)
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def _save_seq(self) -> None:
        write_json(self.state_path, self.seq)

    # ---- finding checkpoints
    def scan(self) -> List[Candidate]:
        """Complete checkpoints not sealed yet, oldest step first."""
        dirs, files, links = listing(self.ckpt_dir, self.follow_links())
        self.refusals.report_links(self.ckpt_dir, [n for n, _ in links])
        dirs = [c for c in dirs if self.refusals.safe_names(c.root, c.files, c.signature)]
        files = [(n, st) for n, st in files if self.refusals.safe_names(n, [n], signature(st))]
        # Only what may still need sealing is checked for writers: the walk of /proc reads every
        # open file of every process (a box's data loaders hold many), and most passes find
        # nothing new. A sealed checkpoint is never sealed again, whoever has it open.
        dirs = [c for c in dirs if self._unsealed(c.step)]
        for c in dirs:
            self.refusals.report_left_out(c)
        files = [(n, st) for n, st in files if self._may_be_new(n, st)]
        in_dirs = [os.path.join(self.ckpt_dir, f) for c in dirs for f in c.files]
        busy = open_for_writing([os.path.join(self.ckpt_dir, n) for n, _ in files] + in_dirs)
        # A directory whose marker appeared while a file of it (the marker itself: Transformers
        # writes trainer_state.json in place) is still open for writing is not complete yet.
        out = [c for c in dirs if not any(os.path.join(self.ckpt_dir, f) in busy for f in c.files)]
        for name, st in files:
            path = os.path.join(self.ckpt_dir, name)
            if path in busy:
                continue
            if not looks_whole(path):
                if self.torn.get(name) != signature(st):
                    self.torn[name] = signature(st)
                    self.event(
                        "torn_checkpoint",
                        f"{name} is incomplete (its writer stopped mid-write): not sealed",
                        klass="integrity",
                        remedy="write checkpoints to a temporary name, then rename",
                    )
                continue
            step = step_from_name(name)
            if step is None:
                entry = self.seq.get(name)
                if entry is not None and entry.get("sig") == list(signature(st)):
                    continue  # this rewrite is sealed already
                step = self._next_seq_step(entry["step"] if entry else -1)
            out.append(Candidate(name, "file", step, [name], signature(st)))
        out = [c for c in out if self._unsealed(c.step) and self.failed.get(c.root) != c.signature]
        # The links now, after the checkpoints were picked (a job links one once it is written):
        # each one picked is recorded with the links that lead to it here, even if the job has
        # moved them on by its MANIFEST (onbox/sealing/dirlinks.py ``Seen``).
        self.seen.look()
        return sorted(out, key=lambda c: c.step or 0)

    def _unsealed(self, step: Optional[int]) -> bool:
        """Whether a checkpoint of ``step`` is still to be sealed (scan's final filter)."""
        return (
            step is not None
            and step not in self.manifests
            and step not in self.ledger.pruned
            and (self.latest is None or step > self.latest)
        )

    def _may_be_new(self, name: str, st: os.stat_result) -> bool:
        """A checkpoint file scan must look at: a step-named one not sealed yet, or a rewrite
        of an in-place file other than the one sealed last."""
        step = step_from_name(name)
        if step is not None:
            return self._unsealed(step)
        entry = self.seq.get(name)
        return entry is None or entry.get("sig") != list(signature(st))

    def _next_seq_step(self, last: int) -> int:
        """The next step of an in-place sequence: after everything sealed, so LATEST moves."""
        known = [last, -1, *self.manifests, *self.ledger.pruned]
        if self.latest is not None:
            known.append(self.latest)
        return max(known) + 1

    # ---- sealing
    def seal(self, cand: Candidate, deadline: Optional[float] = None) -> Optional[Dict[str, Any]]:
        """Upload, verify, MANIFEST, LATEST. None when the job took the checkpoint away, when
        a newer agent owns the run (this one then writes nothing more), or when ``deadline``
        (time.monotonic) came before every file was put (no MANIFEST: seal_cut)."""
        assert cand.step is not None
        step = cand.step
        with self.lock:
            if step in self.manifests:  # sealed already, or another checkpoint of its step is
                same = self.manifests[step].get("root") == cand.root
                return self.manifests[step] if same else None
            if self.ledger.is_stale(f"checkpoint {cand.root} (step {step})"):
                return None  # one writer per run: a newer agent owns it now
            t0 = time.monotonic()
            try:
                entries, uploaded = self._upload(cand, deadline)
            except OutOfTime:
                self.event(
                    "seal_cut",
                    f"checkpoint {cand.root} (step {step}) was not sealed in the time left "
                    f"(no MANIFEST written); LATEST stays at step {self.latest}",
                    klass="transient",
                    remedy="a longer grace, or smaller/more frequent checkpoints; it stays on "
                    "the box's disk",
                )
                return None
            except Vanished as e:
                self.event(
                    "seal_skipped",
                    f"checkpoint {cand.root} changed or was deleted while "
                    f"it was sealed ({e}); a newer one will be sealed",
                    klass="transient",
                    remedy="",
                )
                return None
            crash_point("seal.before_manifest")
            doc = mf.new_manifest(self.run, step, self.epoch, cand.root, cand.kind, entries)
            # The dir's links to it (Lightning's last.ckpt): those seen leading to it since it
            # was picked, and now (onbox/sealing/dirlinks.py ``Seen``).
            found = self.seen.leading_to(doc)
            if found:  # none: the MANIFEST as before links were recorded
                doc["links"] = found
            if not self.ledger.put_manifest(step, doc):
                return None  # stale: the objects stay where no MANIFEST names them
            crash_point("seal.after_manifest")
            self.seen.sealed(cand.root)
            self.manifests[step] = doc
            took = time.monotonic() - t0
            if uploaded >= RATE_MIN_BYTES and took > 0:
                self.bytes_per_s = 0.5 * self.bytes_per_s + 0.5 * (uploaded / took)
            if in_place(cand.root, cand.kind):
                self.seq[cand.root] = {"step": cand.step, "sig": list(cand.signature)}
                self._save_seq()
            blocked = self.job_blocked(step)
            self.event(
                "sealed",
                f"checkpoint {cand.root} sealed as step {cand.step}: "
                f"{len(entries)} files, {uploaded} bytes uploaded in {took:.1f}s",
                step=cand.step,
                files=len(entries),
                uploaded=uploaded,
                seconds=took,
                **({} if blocked is None else {"blocked_s": blocked}),
            )
            if self.ledger.advance_latest(step):
                crash_point("seal.after_latest")
            self.ledger.prune()
            return doc

    def _upload(
        self, cand: Candidate, deadline: Optional[float]
    ) -> Tuple[List[Dict[str, Any]], int]:
        """Every file of ``cand`` in the store and verified (onbox/sealing/upload.py: many in
        flight), or OutOfTime once ``deadline`` would pass: the MANIFEST's entries and the
        bytes put."""
        # Dedupe only against this epoch's own objects: an older agent that lost the run may
        # still prune its checkpoints (it was frozen past its last check), never ours.
        known: Dict[Tuple[str, int], str] = {}
        for doc in self.manifests.values():
            if mf.manifest_epoch(doc) == self.epoch:
                for f in doc["files"]:
                    known[(f["sha256"], f["size"])] = f["key"]
        # Only a file with no step in its name is rewritten in place: stage it. A step-named
        # file or a directory is new each time; hash it while reading, no copy.
        return CheckpointUpload(
            self.store,
            self.ckpt_dir,
            list(cand.files),
            mf.epoch_prefix(self.run, cand.step or 0, self.epoch),
            known,
            stage_dir=os.path.join(self.staging, f"step-{cand.step}"),
            rewritten=in_place(cand.root, cand.kind),
            found=cand.signature if in_place(cand.root, cand.kind) else None,
            deadline=deadline,
            linked=cand.linked,
            look=self.seen.look,
        ).run()

    def remember_restored(self, doc: Dict[str, Any]) -> None:
        """A checkpoint restore put back is sealed already, and it is where this agent goes on
        from: the newest sealed step is the restored one (lower than LATEST's when restore fell
        back from a quarantined checkpoint, so the job's next checkpoints are sealed and LATEST
        re-pointed to them). An in-place file restored at step S continues its sequence from S
        instead of being sealed again as new."""
        with self.lock:
            self.ledger.forget_quarantined()  # restore may have added some
            self.ledger.latest = doc["step"]
        root = doc["root"]
        if in_place(root, doc.get("kind", "")):
            try:
                st = os.stat(os.path.join(self.ckpt_dir, *root.split("/")))
            except OSError:
                return
            self.seq[root] = {"step": doc["step"], "sig": list(signature(st))}
            self._save_seq()

    _room: Optional[Room] = None

    def free_room(self) -> int:
        """When the checkpoint disk runs low, delete local copies whose exact bytes are sealed
        and reached in the store, oldest first (onbox/sealing/room.py says what may go); bytes
        freed."""
        if self._room is None:
            self._room = Room(
                self.run,
                self.ckpt_dir,
                self.store,
                event=self.event,
                busy=open_for_writing,
                follow=lambda: self.follow_links(),
            )
        return self._room.free(self.manifests, self.latest)

    def _failed_for_good(self, cand: Candidate, e: RgtError) -> None:
        """Remember ``cand`` (by signature) as failing for good, said once: scan skips it."""
        self.failed[cand.root] = cand.signature
        self.event(
            "seal_failed",
            f"checkpoint {cand.root} (step {cand.step}) cannot be sealed: {e.what}; it is not "
            "tried again until it changes, and the newer checkpoints are sealed",
            klass="permanent",
            remedy=e.remedy or "the checkpoint stays on the box's disk",
            step=cand.step,
        )

    def seal_pending(self, deadline: Optional[float] = None) -> int:
        """Seal every pending checkpoint, oldest first; stop at ``deadline`` (monotonic).
        Returns how many were sealed. A failure for good does not end the pass (the module
        docstring says how it is told from the store's state, which is raised). The backlog is
        bounded: when the store was away long enough for more than MAX_BACKLOG to pile up, the
        oldest are left out."""
        n = 0
        pending = self.scan()
        if len(pending) > MAX_BACKLOG:
            skipped = [c.step for c in pending[:-MAX_BACKLOG]]
            pending = pending[-MAX_BACKLOG:]
            self.event(
                "backlog_bounded",
                f"{len(skipped)} older pending checkpoints left out "
                f"(steps {skipped[0]}..{skipped[-1]}); sealing the newest {MAX_BACKLOG}",
                klass="transient",
                remedy="the store was slow or away",
            )
        failures: List[Tuple[Candidate, RgtError]] = []
        for cand in pending:
            if deadline is not None and time.monotonic() >= deadline:
                break
            try:
                done = self.seal(cand, deadline)
            except (IntegrityError, PermanentStoreError) as e:
                if isinstance(e, StoreAuthError):
                    raise  # the store refuses everything alike: not this checkpoint's fault
                failures.append((cand, e))
                continue
            if done is not None:
                n += 1
                for old, why in failures:  # a newer one sealed: theirs is their own failure
                    self._failed_for_good(old, why)
                failures = []
        self.backlog = len(pending) - n
        if n:
            self.free_room()
        if failures:  # nothing newer sealed: the store's state (full, read-only) as likely
            raise failures[0][1]  # the pass is retried with backoff until it passes
        return n


__all__ = ["Sealer", "StoreError", "Vanished", "open_for_writing", "step_from_name"]
