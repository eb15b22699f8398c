"""Sealing inside the agent: when it runs, at what priority, and what happens at the edges.

``SealService`` is the agent's ``Hooks``. At agent start it takes a new epoch in the store,
aborts uploads a dead agent left half-done, and (for a new incarnation) restores the newest
verified checkpoint onto a box that lacks it. Then a background thread, at lower CPU and IO
priority than the job, seals new complete checkpoints as they appear (a periodic scan), asks
the job to checkpoint on its declared trigger every ``checkpoint.interval``, and mirrors the
run's state and events to the store. On preemption it asks the job for a final checkpoint and
seals it only if the measured throughput says it fits in the budget; on success it seals the
last checkpoints, every other file the job left under RGT_CKPT_DIR (``results/``, any format),
the declared outputs and the logs, each verified, and only then writes DONE.json, which lists
them and names the declared outputs that were missing (each also an event and a status warning).

Nothing leaves the box with a secret in it unnoticed: the mirror of state and events goes
through the redactor (onbox/common/redact.py), and a job's log that holds a secret value or a token
shape is sealed as a redacted copy (the box's own log stays unaltered), with a
``secret_in_log`` event and an entry in state.json's ``warnings`` naming the log, never the
value. A run without a store gets the same for ``rgt pull --from box`` when its agent lets go of
it (``redact_box_logs``): a redacted copy next to each log that holds a secret, which the pull
takes in the log's place.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import threading
import time
from typing import Any, Callable, Dict, List, Optional

from onbox.agent.journal import FileJournal
from onbox.agent.resumecheck import newest_local_step
from onbox.agent.spec import JobSpec
from onbox.agent.supervisor import Hooks
from onbox.common import redact
from onbox.common.durable import sha256_file
from onbox.common.faults import crash_point
from onbox.common.rundir import RunDir
from onbox.common.safepath import UnsafePath, safe_rel
from onbox.sealing import manifest as mf
from onbox.sealing.restore import restore_latest
from onbox.sealing.sealer import (
    CKPT_SUFFIXES,
    Sealer,
    _skip,
    looks_whole,
    open_for_writing,
    step_from_name,
    take_epoch,
)
from onbox.sealing.stores import open_store
from onbox.sealing.stores.base import Store, StoreError, with_retries

# Seconds kept in hand at the end of a preemption budget for the final records and the exit.
MARGIN = 1.0
_IOPRIO_SET = {"x86_64": 251, "aarch64": 30}


def _lower_priority() -> None:
    """This thread yields CPU and disk to the job (nice 10, IO best-effort level 7)."""
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, 10)
    except OSError:
        pass
    nr = _IOPRIO_SET.get(os.uname().machine)
    if nr is None:
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).syscall(nr, 1, tid, (2 << 13) | 7)
    except (OSError, AttributeError):
        pass


class SealService(Hooks):
    """The agent's sealing: one per agent process, for a run with a store."""

    def __init__(
        self, spec: JobSpec, rd: RunDir, journal: FileJournal, signal_job: Callable[[int], None]
    ) -> None:
        assert spec.store is not None
        self.spec = spec
        self.rd = rd
        self.journal = journal
        self.signal_job = signal_job
        self.store: Store = open_store(spec.store)
        self.sealer: Optional[Sealer] = None
        self.restored: Optional[Dict[str, Any]] = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._asked_at = time.monotonic()
        self._mirrored: Dict[str, float] = {}
        self._observer: Any = None
        self._sync_request: Optional[str] = None
        # Warnings for status (state.json's ``warnings``): the agent puts this very list into
        # the supervisor's state document, so what is appended here is in the next save.
        self.warnings: List[Dict[str, Any]] = []

    def event(
        self, kind: str, reason: str, *, klass: Optional[str] = None, remedy: str = "", **data: Any
    ) -> None:
        self.journal.event(kind, reason, klass=klass, remedy=remedy, **data)

    # ---- start
    def start(self, begin: bool) -> None:
        """Epoch, stale uploads, restore (``begin``: a new incarnation), then the thread."""
        run = self.spec.name
        epoch = take_epoch(self.store, run)
        aborted = self.store.abort_stale_uploads(f"{run}/")
        if aborted:
            self.event(
                "uploads_aborted",
                f"aborted {aborted} upload(s) a dead agent left half-done",
                klass="transient",
            )
        staging = os.path.join(self.rd.path, "staging")
        self.sealer = Sealer(
            run,
            self.spec.ckpt_dir,
            self.store,
            staging,
            epoch=epoch,
            keep=self.spec.keep,
            event=self.event,
            state_path=os.path.join(self.rd.path, "sealer.json"),
        )
        self.sealer.load()
        self.event(
            "epoch",
            f"epoch {epoch} in {self.store.url}; LATEST is "
            f"{self.sealer.latest if self.sealer.latest is not None else 'empty'}",
            epoch=epoch,
        )
        if begin:
            self.restored = restore_latest(self.store, run, self.spec.ckpt_dir, self.event)
            if self.restored is not None:
                self.sealer.remember_restored(self.restored)
        self._thread = threading.Thread(target=self._loop, name="rgt-sealer", daemon=True)
        self._thread.start()
        self._watch()

    def _watch(self) -> None:
        """inotify (through watchdog) wakes the sealer when a file in the checkpoint dir is
        closed after writing or renamed into place; the periodic scan stays the fallback."""
        try:
            from watchdog.events import FileSystemEvent, FileSystemEventHandler
            from watchdog.observers import Observer
        except ImportError:
            self.event(
                "inotify_unavailable",
                "watchdog is not installed: checkpoints are found "
                f"by a scan every {self.spec.scan_interval:.0f}s",
                klass="usage",
                remedy="pip install watchdog into the agent's venv",
            )
            return
        wake = self._wake

        class Handler(FileSystemEventHandler):
            def on_any_event(self, event: FileSystemEvent) -> None:
                if event.event_type in ("closed", "moved", "created"):
                    wake.set()

        try:
            observer = Observer()
            observer.daemon = True
            observer.schedule(Handler(), self.spec.ckpt_dir, recursive=True)
            observer.start()
            self._observer = observer
        except OSError as e:  # inotify limits reached: the scan still finds everything
            self.event(
                "inotify_unavailable",
                f"cannot watch {self.spec.ckpt_dir}: {e}",
                klass="transient",
                remedy="raise fs.inotify.max_user_watches",
            )

    def resume_from(self) -> str:
        """RGT_RESUME_FROM for the next attempt: the restored checkpoint, or ''.

        Only while it is still the newest complete checkpoint on the box: after the job wrote
        a newer one, a restart must not send it back to the step this incarnation began at
        (with '' the job resumes from its own newest, as after any restart)."""
        if self.restored is None or not os.path.exists(self.restored["local"]):
            return ""
        newest = newest_local_step(self.spec.ckpt_dir)
        if newest is not None and newest > self.restored["step"]:
            return ""
        return str(self.restored["local"])

    def done(self) -> Optional[Dict[str, Any]]:
        data = self.store.get_bytes(mf.done_key(self.spec.name))
        return json.loads(data) if data else None

    # ---- the background thread
    def wake(self) -> None:
        self._wake.set()

    def sync_soon(self, request: str) -> None:
        """`rgt-agent sync`: seal now; ``request`` is removed once all is sealed."""
        self._sync_request = request
        self._wake.set()

    def _loop(self) -> None:
        _lower_priority()
        backoff = 0.0
        while not self._stop.is_set():
            self._wake.wait(max(self.spec.scan_interval, backoff))
            self._wake.clear()
            if self._stop.is_set():
                break
            # A sync asked before this pass began is answered once the pass is done.
            request = self._sync_request
            try:
                self._ask_on_timer()
                assert self.sealer is not None
                self.sealer.seal_pending()
                self.mirror()
                backoff = 0.0
                if request is not None:
                    if self._sync_request == request:
                        self._sync_request = None
                    try:
                        os.unlink(request)
                    except FileNotFoundError:
                        pass
            except StoreError as e:
                backoff = min(300.0, max(2.0, backoff * 2))
                klass = "transient" if type(e).__name__.startswith("Transient") else "permanent"
                self.event(
                    "seal_error",
                    f"{e.what}; retrying in {backoff:.0f}s",
                    klass=klass,
                    remedy=e.remedy or "the checkpoints stay on the box meanwhile",
                )
            except Exception as e:  # a bug must not kill sealing for the rest of the run
                backoff = min(300.0, max(5.0, backoff * 2))
                self.event(
                    "seal_bug",
                    f"{type(e).__name__}: {e}",
                    klass="permanent",
                    remedy="report this; sealing retries",
                )

    def _ask_on_timer(self) -> None:
        if self.spec.ckpt_interval is None:
            return
        if time.monotonic() - self._asked_at >= self.spec.ckpt_interval:
            self._asked_at = time.monotonic()
            self.ask_job("timer")

    def ask_job(self, why: str) -> None:
        """Ask the job for a checkpoint the way it declared."""
        trigger = self.spec.trigger
        if trigger == "file":
            with open(os.path.join(self.rd.path, "checkpoint.request"), "w") as f:
                f.write(json.dumps({"why": why, "at": time.time()}))
        elif trigger.startswith("signal:"):
            self.signal_job(int(getattr(signal, "SIG" + trigger.split(":", 1)[1])))
        else:
            return
        self.event("checkpoint_asked", f"asked the job for a checkpoint ({why}, {trigger})")

    def mirror(self) -> None:
        """The run's state and events in the store, so status is readable without the box."""
        if self.sealer is not None and self.sealer.stale:
            return  # a newer epoch's agent mirrors the run now; ours would overwrite its state
        for name, path in (("state.json", self.rd.state), ("events.jsonl", self.rd.events)):
            try:
                mtime = os.stat(path).st_mtime
                if self._mirrored.get(name) == mtime:
                    continue
                with open(path, "rb") as f:
                    data = f.read()
            except OSError:
                continue
            # Written redacted by the journal; again here for lines written before a secret
            # was added (`rgt-agent secrets` on a live run) or by an older agent.
            data = redact.for_home(self.rd.home).redact_bytes(data)
            self.store.put_bytes(mf.state_key(self.spec.name, name), data)
            self._mirrored[name] = mtime

    def _stop_thread(self, deadline: Optional[float]) -> bool:
        """Stop the thread; True when it finished its current seal before ``deadline``."""
        if self._observer is not None:
            self._observer.stop()
        self._stop.set()
        self._wake.set()
        if self._thread is None:
            return True
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        self._thread.join(left)
        return not self._thread.is_alive()

    # ---- hooks
    def on_stop_requested(self, reason: str, deadline: float) -> None:
        if reason != "preempt":
            return
        if deadline - MARGIN <= time.monotonic():
            # No budget to seal anything (grace 0): a checkpoint asked for now could only be
            # half-sealed when SIGKILL comes, and the job's last moments go to its own exit.
            self.event(
                "checkpoint_not_asked",
                "preemption with no grace left to seal a final checkpoint; LATEST stays at "
                f"step {self.sealer.latest if self.sealer is not None else 'none'}",
                klass="transient",
                remedy="give the run a longer grace (--grace) where the platform allows it",
            )
            return
        self.ask_job("preemption")

    def before_terminal(self, reason: str, deadline: float) -> None:
        sealer = self.sealer
        if sealer is None:
            return
        if reason == "success":
            self._stop_thread(None)
            self._finish()
            return
        budget_end = deadline - MARGIN
        if not self._stop_thread(budget_end):
            self.event(
                "seal_cut",
                f"an upload was still running when the {reason} budget ended; "
                f"LATEST stays at step {sealer.latest}",
                klass="transient",
                remedy="a longer grace, or smaller/more frequent checkpoints",
            )
            return
        pending = sealer.scan()
        if not pending:
            self.mirror_quietly()
            return
        need = sum(_size(self.spec.ckpt_dir, c.files) for c in pending)
        estimate = need / max(sealer.bytes_per_s, 1.0) + 0.5
        left = budget_end - time.monotonic()
        if estimate > left:
            self.event(
                "final_not_sealed",
                f"{reason}: sealing {need} bytes needs ~{estimate:.1f}s"
                f" at {sealer.bytes_per_s / 1e6:.0f} MB/s, {max(left, 0):.1f}s are left; "
                f"LATEST stays at step {sealer.latest}",
                klass="transient",
                remedy="the checkpoint stays on this box's disk",
            )
            return
        sealer.seal_pending(budget_end)
        self.mirror_quietly()

    def close(self) -> None:
        """The agent is leaving: the thread stops between two seals, never in the middle of
        writing a document. A run that FAILED still gets its checkpoints sealed first."""
        if self._thread is None:
            return
        stopped = self._stop.is_set()
        self._stop_thread(None)
        if not stopped and self.sealer is not None:
            try:
                self.sealer.seal_pending()
            except StoreError as e:
                self.event(
                    "seal_error",
                    e.what,
                    klass="transient",
                    remedy="the checkpoints stay on the box; the next start seals them",
                )
        self.mirror_quietly()

    def mirror_quietly(self) -> None:
        try:
            self.mirror()
        except StoreError:
            pass

    def _finish(self) -> None:
        """On success: the last checkpoints; then every other file the job left under
        RGT_CKPT_DIR (``_put_results``), the declared outputs and the logs, each verified by
        the store as it is uploaded; only then DONE.json, which lists them all and the
        declared outputs that were missing. Cut off before DONE.json (a crash, a store
        outage), nothing claims completion, and the next agent of the run does it all again
        (every upload is idempotent)."""
        assert self.sealer is not None
        run = self.spec.name
        # A stale agent (a newer epoch owns the run) writes none of the run's documents: its
        # DONE.json would end a run another box is still training.
        if not self.sealer.is_writer():
            return
        self.sealer.seal_pending()
        results = self._put_results()
        outputs: List[Dict[str, Any]] = []
        missing: List[str] = []
        for rel in self.spec.outputs:
            path = os.path.join(self.spec.workdir, rel)
            if not os.path.exists(path):
                missing.append(rel)
                continue
            outputs += self._put_tree(path, f"{run}/outputs/", rel)
        self._report_missing(missing)
        logs: List[Dict[str, Any]] = []
        for a in self.rd.attempt_numbers():
            logs += self._put_log(a)
        self.mirror()
        crash_point("finish.before_done")
        if not self.sealer.is_writer():  # checked again last: the uploads above take time
            return
        done = {
            "schema": mf.SCHEMA,
            "run": run,
            "latest": self.sealer.latest,
            "epoch": self.sealer.epoch,
            "files": results + outputs + logs,
            "missing_outputs": missing,
            "finished_at": time.time(),
        }
        with_retries(lambda: self.store.put_bytes(mf.done_key(run), mf.dump(done)))
        self.event(
            "done",
            f"DONE.json written: {len(results)} file(s) from the checkpoint dir, "
            f"{len(outputs)} output file(s), {len(logs)} log(s)"
            + (f", declared outputs missing: {', '.join(missing)}" if missing else "")
            + f"; LATEST step {self.sealer.latest}",
            missing_outputs=missing,
        )

    def _put_results(self) -> List[Dict[str, Any]]:
        """Every file under RGT_CKPT_DIR that no checkpoint rule covers, to ``results/``, for
        DONE.json with ``"root": "ckpt"`` (``rgt pull`` puts each at ``checkpoints/<path>``,
        beside LATEST's files, as a pull without a store does).

        Covered, so not sealed here: a step-named checkpoint (a file in a checkpoint format
        with a step in its name, a directory with a completeness marker and a step), which
        ``checkpoint.keep`` governs; a file LATEST's MANIFEST holds with these very bytes;
        hidden and temporary names (torn writes live there; pull skips them too). Everything
        else is sealed, in any format: results (``result.txt``, ``metrics.json``), files in
        a directory with no marker, an in-place checkpoint other than LATEST's own
        (``best.pt`` beside ``last.pt``). A file that cannot be taken as it is (torn, still
        open for writing, a symlink, a name pull refuses, LATEST's path with other bytes) is
        left out with one event naming it."""
        sealer = self.sealer
        assert sealer is not None
        base = self.spec.ckpt_dir
        latest_doc = sealer.manifests.get(sealer.latest) if sealer.latest is not None else None
        in_latest = {f["path"]: f for f in latest_doc["files"]} if latest_doc else {}
        todo: List[str] = []
        try:
            names = sorted(os.listdir(base))
        except FileNotFoundError:
            return []
        for name in names:
            path = os.path.join(base, name)
            if _skip(name):
                continue
            if os.path.islink(path):
                self._left_out(name, "it is a symlink")
            elif os.path.isdir(path):
                if sealer._dir_candidate(name, path) is None:
                    todo += self._walk_results(path, name)
            elif os.path.isfile(path) and not _step_named(name):
                todo.append(name)
        busy = open_for_writing([os.path.join(base, *r.split("/")) for r in todo])
        out: List[Dict[str, Any]] = []
        for rel in todo:
            full = os.path.join(base, *rel.split("/"))
            if os.path.realpath(full) in busy:
                self._left_out(rel, "a process still holds it open for writing")
                continue
            if rel.lower().endswith(CKPT_SUFFIXES) and not looks_whole(full):
                self._left_out(rel, "it is torn (its writer stopped mid-write)")
                continue
            sealed = in_latest.get(rel)
            if sealed is not None:
                if sha256_file(full) == (sealed["sha256"], sealed["size"]):
                    continue  # pulled as LATEST's own file
                self._left_out(
                    rel,
                    f"LATEST's checkpoint (step {sealer.latest}) holds other bytes under this "
                    "name, and these could not be sealed as a checkpoint",
                )
                continue
            out += [
                dict(e, root="ckpt")
                for e in self._put_tree(full, f"{self.spec.name}/results/", rel)
            ]
        return out

    def _walk_results(self, path: str, rel: str) -> List[str]:
        """The files under the directory ``path`` (``rel`` under the checkpoint dir), hidden
        and temporary names (and what is under them) skipped; symlinks left out, said so."""
        out: List[str] = []
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames[:] = sorted(d for d in dirnames if not _skip(d))
            for d in list(dirnames):
                if os.path.islink(os.path.join(dirpath, d)):
                    dirnames.remove(d)
                    self._left_out(_rel_under(path, rel, os.path.join(dirpath, d)), "a symlink")
            for fn in sorted(filenames):
                full = os.path.join(dirpath, fn)
                r = _rel_under(path, rel, full)
                if _skip(fn):
                    continue
                if os.path.islink(full) or not os.path.isfile(full):
                    self._left_out(r, "it is a symlink or not a regular file")
                    continue
                out.append(r)
        return out

    def _left_out(self, rel: str, why: str) -> None:
        self.event(
            "result_left_out",
            f"{rel} in the checkpoint dir is not sealed at completion: {why}",
            klass="usage",
            remedy="write results as plain files under RGT_CKPT_DIR, closed before the job "
            "exits; the file stays on the box",
            path=rel,
        )

    def _report_missing(self, missing: List[str]) -> None:
        """One ``output_missing`` event and status warning per declared output that did not
        exist at completion. The warning list is the agent's own (in state.json); those of an
        earlier completion of this run (cut off before DONE.json) are replaced, not doubled."""
        self.warnings[:] = [w for w in self.warnings if w.get("kind") != "output_missing"]
        for rel in missing:
            path = os.path.join(self.spec.workdir, rel)
            self.warnings.append(
                {
                    "kind": "output_missing",
                    "path": rel,
                    "reason": f"declared output {rel} did not exist when the job succeeded "
                    f"({path}): it is not sealed and `rgt pull` cannot bring it",
                }
            )
            self.event(
                "output_missing",
                f"declared output {rel} does not exist ({path}) now that the job succeeded: "
                "nothing sealed for it",
                klass="usage",
                remedy=f"make the job write it under its workdir {self.spec.workdir}, or fix "
                "the path in `outputs` (job file) or --output",
                path=rel,
            )

    def _put_log(self, attempt: int) -> List[Dict[str, Any]]:
        """The job's log of ``attempt`` to ``logs/``: as it is, or, when it holds a secret, a
        redacted copy. The box's log is the job's and stays unaltered; the store's copy (what
        `rgt pull` brings to the laptop, and maybe to others) never carries the value. A
        redacted copy rather than none: the log is what a person needs after a failure, and
        a warning says which one was changed."""
        path = self.rd.output_log(attempt)
        prefix, rel = f"{self.spec.name}/logs/", f"attempt-{attempt:04d}.log"
        red = redact.for_home(self.rd.home)
        try:
            found = red.scan_file(path)
        except FileNotFoundError:
            found = []
        if not found:
            return self._put_tree(path, prefix, rel)
        tmp_dir = os.path.join(self.rd.path, "staging", "logs")
        os.makedirs(tmp_dir, exist_ok=True)
        tmp = os.path.join(tmp_dir, rel)
        try:
            red.redact_file(path, tmp)
            sealed = [dict(e, redacted=True) for e in self._put_tree(tmp, prefix, rel)]
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        what = ", ".join(found)
        key = prefix + rel
        self.warnings.append(
            {
                "kind": "secret_in_log",
                "attempt": attempt,
                "log": path,
                "key": key,
                "found": found,
                "reason": f"the job's log of attempt {attempt} holds {what}: the store has a "
                "redacted copy; the log on the box is unaltered",
            }
        )
        self.event(
            "secret_in_log",
            f"the job's log of attempt {attempt} ({path}) holds {what}; sealed {key} as a "
            f"redacted copy (each match replaced by {redact.MARK}), the box's log is unaltered",
            klass="usage",
            remedy="do not print secrets; rotate the secret if the box's log was shared",
            attempt=attempt,
            log=path,
            key=key,
            found=found,
        )
        return sealed

    def _put_tree(self, path: str, prefix: str, rel: str) -> List[Dict[str, Any]]:
        out = []
        paths = []
        if os.path.isdir(path):
            for dirpath, _, files in os.walk(path):
                for fn in sorted(files):
                    full = os.path.join(dirpath, fn)
                    paths.append((full, os.path.join(rel, os.path.relpath(full, path))))
        elif os.path.isfile(path):
            paths.append((path, rel))
        else:
            self.event(
                "seal_missing",
                f"{rel} does not exist ({path}): nothing sealed for it",
                klass="usage",
                remedy="",
            )
        for full, r in paths:
            r = r.replace(os.sep, "/").strip("/")
            try:
                safe_rel(r, "the name")
            except UnsafePath as e:
                # DONE.json listing it would make every pull of the run refuse the whole
                # result (onbox/common/safepath.py): leave this one file out, say so, seal the rest.
                self.event(
                    "unsafe_name",
                    f"output {r!r} is not sealed: {e.what}; restore and `rgt pull` would "
                    "refuse it, so it could never come back",
                    klass="usage",
                    remedy="rename it (letters, digits, '.', '_', '-'); the other outputs "
                    "are sealed as usual",
                    path=r,
                )
                continue
            sha, size = sha256_file(full)
            key = prefix + r
            with_retries(functools.partial(self.store.put_file, key, full, sha256=sha, size=size))
            out.append({"path": r, "key": key, "size": size, "sha256": sha})
        return out


def _step_named(name: str) -> bool:
    """A loose file the sealer seals as a step of its own (``step_120.pt``), not in place."""
    return name.lower().endswith(CKPT_SUFFIXES) and step_from_name(name) is not None


def _rel_under(top: str, rel: str, full: str) -> str:
    """``full`` (under the directory ``top``, which is ``rel`` under the checkpoint dir) as a
    '/'-separated path relative to the checkpoint dir."""
    return "/".join([rel, *os.path.relpath(full, top).split(os.sep)])


def _size(base: str, files: List[str]) -> int:
    n = 0
    for rel in files:
        try:
            n += os.path.getsize(os.path.join(base, *rel.split("/")))
        except OSError:
            pass
    return n


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
        tmp = os.path.join(rd.attempt_dir(attempt), ".output.redacted.log.tmp")
        written: Optional[str] = copy
        why = ""
        try:
            red.redact_file(path, tmp)
            os.replace(tmp, copy)
        except OSError as e:
            # A copy made with fewer secrets would carry the new one: none is better.
            written, why = None, f"{e.strerror or e}"
            for p in (tmp, copy):
                try:
                    os.unlink(p)
                except OSError:  # gone already, or not a file: nothing of ours to remove
                    pass
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


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
