"""The completion seal: what a run that succeeded leaves in the store, and DONE.json last.

On success the sealer seals the last checkpoints; then every other file the job left under
RGT_CKPT_DIR (``results/``, any format), the declared outputs and the logs, each verified by the
store as it is uploaded; only then DONE.json, which lists them, names the declared outputs
that were missing (each also an event and a status warning) and, in ``left_out``, each file the
job left that could not be sealed and why (each also an event), which `rgt pull` says. In a
pod the outputs are read in the job container's filesystem, through its launcher's
``/proc/PID/root``, never following a link out of the job's workdir (onbox/agent/jobroot.py).
A job's log that holds a secret value or a token shape is sealed as a redacted copy (the box's
own log stays unaltered), with a ``secret_in_log`` event and a status warning naming the log,
never the value.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from onbox.agent import sealedlogs
from onbox.agent.jobroot import JobFiles
from onbox.agent.spec import JobSpec
from onbox.common import links, redact
from onbox.common.errors import StoreError
from onbox.common.faults import crash_point
from onbox.common.rundir import RunDir
from onbox.common.safepath import NotRegularFile, UnsafePath, file_kind, safe_rel, sha256_regular
from onbox.common.wholefile import looks_whole
from onbox.sealing import manifest as mf
from onbox.sealing.discovery import (
    dir_candidate,
    is_ckpt_file,
    open_for_writing,
    skip,
    step_named,
)
from onbox.sealing.sealer import Sealer
from onbox.sealing.stores.base import Store, with_retries
from onbox.sealing.stores.hangbound import watched


class Completion:
    """The completion seal of one run, by its sealer (which must still own the run)."""

    def __init__(
        self,
        spec: JobSpec,
        rd: RunDir,
        store: Store,
        sealer: Sealer,
        *,
        event: Callable[..., None],
        warnings: List[Dict[str, Any]],
        mirror: Callable[[], None],
        root: Optional[str] = "",
    ) -> None:
        self.spec = spec
        self.rd = rd
        self.store = store
        self.sealer = sealer
        self.event = event
        self.warnings = warnings  # the agent's own list, in state.json: appended to in place
        self.mirror = mirror
        # Where the job's workdir is seen (runner.workdir_root): "" this filesystem, a pod's
        # /proc/PID/root, None when the job container's files cannot be read.
        self.root = root
        # What the job left that was not sealed, and why, by the name a pull would give it
        # (checkpoints/, outputs/, logs/): DONE.json's ``left_out``, which `rgt pull` says.
        self.left_out: List[Dict[str, str]] = []

    def run(self) -> None:
        """On success: the last checkpoints; then every other file the job left under
        RGT_CKPT_DIR (``_results``), the declared outputs and the logs, each verified by
        the store as it is uploaded; only then DONE.json, which lists them all and the
        declared outputs that were missing. Cut off before DONE.json (a crash, a store
        outage), nothing claims completion, and the next agent of the run does it all again
        (every upload is idempotent)."""
        run = self.spec.name
        # A stale agent (a newer epoch owns the run) writes none of the run's documents: its
        # DONE.json would end a run another box is still training.
        if not self.sealer.is_writer():
            return
        self.sealer.seal_pending()
        results = self._results()
        outputs, missing = self._outputs()
        self._report_missing(missing)
        # The logs an earlier end of this run on this box sealed are in the store already.
        logs, sealed = sealedlogs.put_unsealed(self.rd, self.store, run, self.put_log)
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
            "left_out": self.left_out,
            "finished_at": time.time(),
        }
        # Pending until DONE.json is written (onbox/agent/sealedlogs.py), then recorded.
        sealedlogs.record(self.rd, self.store.url, self.sealer.epoch, sealed, mf.done_key(run))
        with_retries(lambda: self.store.put_bytes(mf.done_key(run), mf.dump(done)))
        sealedlogs.record(self.rd, self.store.url, self.sealer.epoch, sealed)
        self.event(
            "done",
            f"DONE.json written: {len(results)} file(s) from the checkpoint dir, "
            f"{len(outputs)} output file(s), {len(logs)} log(s)"
            + (f", declared outputs missing: {', '.join(missing)}" if missing else "")
            + f"; LATEST step {self.sealer.latest}",
            missing_outputs=missing,
        )

    def run_said(self, said: Callable[[StoreError, str], None]) -> None:
        """``run``; a store error (one that failed each retry, an upload that moved nothing for
        ``[store] stall``) said first (``said``: a seal_error), then raised: the run is not
        SUCCEEDED, and its next agent completes it, as after a crash before DONE.json."""
        try:
            self.run()
        except StoreError as e:
            said(
                e,
                f"no DONE.json was written: `rgt-agent start --name {self.spec.name}` once the "
                "store answers seals the rest and writes it",
            )
            raise

    def _outputs(self) -> Tuple[List[Dict[str, Any]], List[str]]:
        """The declared outputs sealed, and those missing. Read where the job wrote them: here,
        or (``root``, a pod) in the job container's filesystem through its launcher's root,
        where every path is resolved inside that root and must stay in the workdir
        (onbox/agent/jobroot.py)."""
        prefix = mf.outputs_prefix(self.spec.name)
        outputs: List[Dict[str, Any]] = []
        missing: List[str] = []
        if self.root is None and self.spec.outputs:
            self.event(
                "outputs_unreadable",
                "the job container's filesystem cannot be read (its launcher is gone, or "
                "/proc/PID/root is denied): no declared output can be sealed",
                klass="usage",
                remedy="run the agent's container as the job container's user (or give it "
                "CAP_SYS_PTRACE), so that it may read /proc/PID/root",
            )
            return outputs, list(self.spec.outputs)
        job = JobFiles(self.root, self.spec.workdir, self._refused) if self.root else None
        for rel in self.spec.outputs:
            if job is not None:
                files = job.output(rel)
                if files is None:
                    missing.append(rel)
                    continue
                outputs += self._put_files(files, prefix)
                continue
            path = os.path.join(self.spec.workdir, rel)
            if not os.path.exists(path):
                missing.append(rel)
                continue
            # The declared path itself is followed (a results/ linked to a scratch disk is a
            # user's choice); what is under it is listed without following anything.
            outputs += self._put_tree(os.path.realpath(path), prefix, rel)
        return outputs, missing

    def _refused(self, rel: str, why: str) -> None:
        where = " in the job container" if self.root else ""
        self._not_sealed(f"outputs/{rel}", why)
        self.event(
            "output_refused",
            f"output {rel}{where} is not sealed: {why}",
            klass="usage",
            remedy="write outputs as plain files under the job's workdir; a symlink is never "
            "followed out of it",
            path=rel,
        )

    def _results(self) -> List[Dict[str, Any]]:
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
            if skip(name):
                continue
            if os.path.islink(path) and links.within(path) is not None:
                # A link to a path in the dir loses nothing: its target is sealed (here or as
                # a checkpoint) under its own name. Said once, at info level, not a pull warning.
                self.sealer.refusals.report_links(base, [name])
            elif os.path.islink(path):
                self._left_out(name, "it is a symlink out of the checkpoint dir")
            elif os.path.isdir(path):
                if dir_candidate(base, name, path) is None:
                    todo += self._walk_results(path, name)
            elif os.path.isfile(path):
                if not step_named(name):
                    todo.append(name)
            elif os.path.lexists(path):  # a FIFO would block the read forever: never opened
                self._left_out(name, f"it is {_kind(path)}, not a regular file")
        busy = open_for_writing([os.path.join(base, *r.split("/")) for r in todo])
        out: List[Dict[str, Any]] = []
        for rel in todo:
            full = os.path.join(base, *rel.split("/"))
            if os.path.realpath(full) in busy:
                self._left_out(rel, "a process still holds it open for writing")
                continue
            if is_ckpt_file(rel) and not looks_whole(full):
                self._left_out(rel, "it is torn (its writer stopped mid-write)")
                continue
            sealed = in_latest.get(rel)
            if sealed is not None:
                try:
                    same = sha256_regular(full) == (sealed["sha256"], sealed["size"])
                except (FileNotFoundError, NotRegularFile):
                    same = False  # replaced since it was listed: _put_files says what it is
                if same:
                    continue  # pulled as LATEST's own file
                self._left_out(
                    rel,
                    f"LATEST's checkpoint (step {sealer.latest}) holds other bytes under this "
                    "name, and these could not be sealed as a checkpoint",
                )
                continue
            out += [
                dict(e, root="ckpt")
                for e in self._put_tree(full, mf.results_prefix(self.spec.name), rel)
            ]
        return out

    def _walk_results(self, path: str, rel: str) -> List[str]:
        """The files under the directory ``path`` (``rel`` under the checkpoint dir), hidden
        and temporary names (and what is under them) skipped; symlinks left out, said so."""
        out: List[str] = []
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames[:] = sorted(d for d in dirnames if not skip(d))
            for d in list(dirnames):
                if os.path.islink(os.path.join(dirpath, d)):
                    dirnames.remove(d)
                    self._left_out(_rel_under(path, rel, os.path.join(dirpath, d)), "a symlink")
            for fn in sorted(filenames):
                full = os.path.join(dirpath, fn)
                r = _rel_under(path, rel, full)
                if skip(fn):
                    continue
                if os.path.islink(full) or not os.path.isfile(full):
                    self._left_out(r, "it is a symlink or not a regular file")
                    continue
                out.append(r)
        return out

    def _not_sealed(self, path: str, why: str) -> None:
        """``path`` (its name in a pull) is left out of DONE.json's files, for ``why``."""
        self.left_out.append({"path": path, "why": why})

    def _left_out(self, rel: str, why: str) -> None:
        self._not_sealed(f"checkpoints/{rel}", why)
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

    def put_log(self, attempt: int) -> List[Dict[str, Any]]:
        """The job's log of ``attempt`` to ``logs/``: as it is, or, when it holds a secret, a
        redacted copy. The box's log is the job's and stays unaltered; the store's copy (what
        `rgt pull` brings to the laptop, and maybe to others) never carries the value. A
        redacted copy rather than none: the log is what a person needs after a failure, and
        a warning says which one was changed."""
        path = self.rd.output_log(attempt)
        # Named by this agent's epoch: another box's log of the same attempt number keeps its
        # own key (onbox/sealing/manifest.py log_name).
        prefix, rel = mf.logs_prefix(self.spec.name), mf.log_name(self.sealer.epoch, attempt)
        if not os.path.isfile(path):
            # The shim opens the log before it starts the job: an attempt without one never
            # started its job (its start failure has its own events), or a person removed
            # the log. No mistake of the user's, nothing to fix: not a failure (class null).
            self.event(
                "seal_missing",
                f"the job's log of attempt {attempt} does not exist ({path}): the attempt "
                "never started its job, or the log was removed; nothing sealed for it",
                remedy="",
            )
            return []
        red = redact.for_home(self.rd.home)
        try:
            found = red.scan_file(path)
        except FileNotFoundError:
            found = []
        if not found:
            return self._put_tree(path, prefix, rel)
        tmp_dir = self.rd.staged_logs
        os.makedirs(tmp_dir, exist_ok=True)
        tmp = os.path.join(tmp_dir, rel.replace("/", "-"))
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
        paths: List[Tuple[str, str]] = []
        if os.path.isdir(path):
            paths = self._walk_output(path, rel)
        elif os.path.isfile(path):
            paths.append((path, rel))
        else:
            self._not_sealed(_pulled_as(prefix, rel), "it is no regular file nor directory")
            self.event(
                "seal_missing",
                f"{rel} does not exist or is no regular file nor directory ({path}): "
                "nothing sealed for it",
                klass="usage",
                remedy="",
            )
        return self._put_files(paths, prefix)

    def _walk_output(self, path: str, rel: str) -> List[Tuple[str, str]]:
        """(file, its name under the output ``rel``) of each regular file under the directory
        ``path``. Nothing is followed or opened here: a symlink (to a file or a directory), a
        FIFO, a socket or a device is left out with ``output_refused``, as in a pod. Opening a
        FIFO with no writer waits forever, and the run would never end."""
        out: List[Tuple[str, str]] = []

        def name(dirpath: str, entry: str) -> str:
            return os.path.join(rel, os.path.relpath(os.path.join(dirpath, entry), path))

        for dirpath, dirnames, files in os.walk(path):
            dirnames.sort()
            for d in [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
                dirnames.remove(d)
                self._refused(name(dirpath, d), "it is a symlink to a directory (never followed)")
            for fn in sorted(files):
                full = os.path.join(dirpath, fn)
                try:
                    kind = _kind(full)
                except FileNotFoundError:
                    continue  # deleted since the directory was read: not there to seal
                if kind is None:
                    out.append((full, name(dirpath, fn)))
                else:
                    self._refused(name(dirpath, fn), f"it is {kind}, not a regular file")
        return out

    def _put_files(self, paths: Iterable[Tuple[str, str]], prefix: str) -> List[Dict[str, Any]]:
        """Each (file to read, its name under ``prefix``) uploaded and verified."""
        out = []
        for full, r in paths:
            r = r.replace(os.sep, "/").strip("/")
            try:
                safe_rel(r, "the name")
            except UnsafePath as e:
                # DONE.json listing it would make every pull of the run refuse the whole
                # result (onbox/common/safepath.py): leave this one file out, say so, seal the rest.
                self._not_sealed(_pulled_as(prefix, r), e.what)
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
            key = prefix + r
            try:
                sha, size = sha256_regular(full)  # never blocks on a FIFO swapped in since
                put = functools.partial(self.store.put_file, key, full, sha256=sha, size=size)
                # Cut once the store took nothing of it for [store] stall (a hung mount).
                with_retries(functools.partial(watched, self.store, f"uploading {key}", put))
            except (FileNotFoundError, NotRegularFile) as e:
                why = e.what if isinstance(e, NotRegularFile) else "it was removed"
                self._not_sealed(_pulled_as(prefix, r), f"it changed since it was listed ({why})")
                self.event(
                    "seal_missing",
                    f"{r} is not sealed: it changed since it was listed ({why})",
                    klass="usage",
                    remedy="",
                )
                continue
            out.append({"path": r, "key": key, "size": size, "sha256": sha})
        return out


def _kind(path: str) -> Optional[str]:
    """What ``path`` is, by its lstat, when not a regular file ("a FIFO", "a symlink"); None for
    a regular file."""
    return file_kind(os.lstat(path).st_mode)


def _rel_under(top: str, rel: str, full: str) -> str:
    """``full`` (under the directory ``top``, which is ``rel`` under the checkpoint dir) as a
    '/'-separated path relative to the checkpoint dir."""
    return "/".join([rel, *os.path.relpath(full, top).split(os.sep)])


def _pulled_as(prefix: str, rel: str) -> str:
    """The name `rgt pull` gives a file sealed under the store ``prefix`` (RUN/results/,
    RUN/outputs/ or RUN/logs/) as ``rel``."""
    kind = prefix.rstrip("/").rsplit("/", 1)[-1]
    return f"{'checkpoints' if kind == 'results' else kind}/{rel}"
