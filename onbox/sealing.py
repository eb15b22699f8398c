"""Sealing inside the agent: when it runs, at what priority, and what happens at the edges.

``SealService`` is the agent's ``Hooks``. At agent start it takes a new epoch in the store,
aborts uploads a dead agent left half-done, and (for a new incarnation) restores the newest
verified checkpoint onto a box that lacks it. Then a background thread, at lower CPU and IO
priority than the job, seals new complete checkpoints as they appear (a periodic scan), asks
the job to checkpoint on its declared trigger every ``checkpoint.interval``, and mirrors the
run's state and events to the store. On preemption it asks the job for a final checkpoint and
seals it only if the measured throughput says it fits in the budget; on success it seals the
last checkpoints, the outputs and the logs, verifies them, and writes DONE.json.

Nothing leaves the box with a secret in it unnoticed: the mirror of state and events goes
through the redactor (onbox/redact.py), and a job's log that holds a secret value or a token
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

from onbox import manifest as mf
from onbox import redact
from onbox.durable import sha256_file
from onbox.journal import FileJournal
from onbox.restore import restore_latest
from onbox.resumecheck import newest_local_step
from onbox.rundir import RunDir
from onbox.safepath import UnsafePath, safe_rel
from onbox.sealer import Sealer, take_epoch
from onbox.spec import JobSpec
from onbox.stores import open_store
from onbox.stores.base import Store, StoreError, with_retries
from onbox.supervisor import Hooks

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
            self.store.put_bytes(f"{self.spec.name}/state/{name}", data)
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
        if reason == "preempt":
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
        """On success: last checkpoints, outputs, logs, all verified; then DONE.json."""
        assert self.sealer is not None
        run = self.spec.name
        self.sealer.seal_pending()
        sealed: List[Dict[str, Any]] = []
        for rel in self.spec.outputs:
            sealed += self._put_tree(os.path.join(self.spec.workdir, rel), f"{run}/outputs/", rel)
        for a in self.rd.attempt_numbers():
            sealed += self._put_log(a)
        self.mirror()
        done = {
            "schema": mf.SCHEMA,
            "run": run,
            "latest": self.sealer.latest,
            "epoch": self.sealer.epoch,
            "files": sealed,
            "finished_at": time.time(),
        }
        with_retries(lambda: self.store.put_bytes(mf.done_key(run), mf.dump(done)))
        self.event(
            "done",
            f"DONE.json written: {len(sealed)} output and log files, LATEST "
            f"step {self.sealer.latest}",
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
                "output_missing",
                f"output {rel} does not exist",
                klass="usage",
                remedy="check `outputs` in the job file",
            )
        for full, r in paths:
            r = r.replace(os.sep, "/").strip("/")
            try:
                safe_rel(r, "the name")
            except UnsafePath as e:
                # DONE.json listing it would make every pull of the run refuse the whole
                # result (onbox/safepath.py): leave this one file out, say so, seal the rest.
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
