"""The walk of ``rgt smoke``: the job under a private agent (controller/smoke/localbox.py),
through the checks of a real run in order; the first that fails ends it (``SmokeFailed``).

1. starts: the job's first reported step, or how it ended before one, classified by the agent
   (onbox/agent/classify.py: an import error names the module);
2. progress: steps reported (progress.json from the training API, or ``[progress] pattern`` in
   its output) until ``--steps N`` or ``--seconds S``; the step rate;
3. checkpoint: asked through the job's trigger (the request file or the signal, as the agent
   asks), or by its own interval; complete by the sealer's rule (onbox/sealing/discovery.py);
4. sealed: LATEST in the store reaches it, and the real restore (onbox/sealing/restore.py)
   downloads it and checks every sha256; the seal time from the run's events
   (onbox/common/sealtime.py), printed as the ``--seal-time`` to pass;
5. resume: SIGTERM to the agent (the job's grace, then SIGKILL), every local directory of the
   run deleted, the agent started again on a fresh copy of the project and a fresh checkpoint
   dir: it restores from the store, and the agent's own resume check
   (onbox/agent/resumecheck.py) says whether the first step reported continues from there;
6. exact (``--exact``): the resumed run's final state hashes equal an uninterrupted run's,
   started beside it at the beginning (controller/smoke/finish.py);
7. outputs: what ``rgt pull`` would bring back, files the job left outside it, and CRLF shell
   scripts among the project's files (finish.py).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from controller import hangup
from controller.deploy.project import project_files
from controller.smoke import finish
from controller.smoke.checks import Report, rate_text, seal_text, short_list, step_rate, tree
from controller.smoke.localbox import LocalBox
from onbox.agent.journal import iso
from onbox.agent.spec import JobSpec
from onbox.common.errors import RgtError, UsageError
from onbox.common.logscan import LogScanner
from onbox.common.progress import compile_progress_pattern
from onbox.common.sealtime import measure
from onbox.sealing import manifest as mf
from onbox.sealing.discovery import newest_local_step
from onbox.sealing.restore import restore_latest
from onbox.sealing.stores import open_store

RUN = "smoke"
POLL = 0.2


@dataclasses.dataclass
class SmokeRequest:
    """What the user asked for (``rgt smoke``'s arguments)."""

    job_file: Optional[str] = None
    command: List[str] = dataclasses.field(default_factory=list)
    steps: Optional[int] = None
    seconds: Optional[float] = None
    exact: bool = False
    keep: Optional[str] = None
    gpu: bool = False
    project: str = "."
    timeout: float = 120.0  # each wait of the walk
    grace: float = 15.0  # the preemption's grace


def wait_for(pred: Callable[[], Any], timeout: float) -> Any:
    """The first truthy value of ``pred`` within ``timeout`` seconds; None at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() >= deadline:
            return None
        time.sleep(POLL)


class Walk:
    """One walk on ``box``; ``run`` prints each check's line and raises at the first FAIL."""

    def __init__(self, req: SmokeRequest, box: LocalBox, report: Report) -> None:
        self.req, self.box, self.report = req, box, report
        self.project = os.path.abspath(req.project)
        self.files = project_files(self.project)
        self.job_rel: Optional[str] = None
        if req.job_file:
            rel = os.path.relpath(os.path.abspath(req.job_file), self.project)
            if rel.startswith(".." + os.sep) or rel == "..":
                raise UsageError("JOB.toml", f"{req.job_file} is not inside the project")
            self.job_rel = rel
        self.spec: Optional[JobSpec] = None
        self.samples: List[Tuple[float, int]] = []
        self._scanner: Optional[LogScanner] = None
        self._scanned_attempt = 0
        self._logged: Optional[int] = None  # the last step the pattern found in the output
        self.asked_at: Optional[float] = None  # wall time of the smoke's own ask
        self.grace = f"{req.grace:g}"

    # ---- the private box
    def workdir(self, tag: str) -> str:
        """A fresh copy of the project, as a release on a fresh box holds it."""
        return self.box.copy_project(self.project, self.files, os.path.join(self.box.root, tag))

    def start(self, name: str, work: str, ckpt: str, store: bool = True) -> None:
        job = os.path.join(work, self.job_rel) if self.job_rel else None
        self.box.start(name, work, job, self.req.command, ckpt, self.grace, store)

    def ckpt_dir(self, n: int) -> str:
        return os.path.join(self.box.root, f"ckpt-{n}")

    # ---- reading the run
    def step_now(self, st: Dict[str, Any]) -> Optional[int]:
        """The newest step the current attempt reported: progress.json, or the job file's
        progress pattern in its output."""
        attempt = st.get("attempt") or 0
        found: Optional[int] = None
        prog = st.get("progress")
        if isinstance(prog, dict) and prog.get("attempt") == attempt:
            found = int(prog["step"])
        pattern = self.spec.progress_pattern if self.spec else None
        if pattern and attempt:
            if self._scanner is None or self._scanned_attempt != attempt:
                self._scanner = LogScanner(compile_progress_pattern(pattern))
                self._scanned_attempt, self._logged = attempt, None
            step = self._scanner.last(self.box.rd(RUN).output_log(attempt), 4 << 20)
            if step is not None:
                self._logged = step
            if self._logged is not None and (found is None or self._logged > found):
                found = self._logged
        return found

    def sample(self) -> Tuple[Dict[str, Any], Optional[int]]:
        st = self.box.status(RUN)
        step = self.step_now(st) if st else None
        if step is not None and (not self.samples or step > self.samples[-1][1]):
            self.samples.append((time.monotonic(), step))
        return st, step

    def crash(self, n: int, st: Dict[str, Any]) -> None:
        """FAIL check ``n`` when an attempt of the run ended badly (the agent's verdict)."""
        ex = st.get("last_exit")
        if isinstance(ex, dict) and ex.get("kind") not in (None, "success"):
            at = f" at step {ex['step']}" if ex.get("step") else ""
            why = str(ex.get("reason") or ex.get("kind")).split(" | last output:")[0]
            raise self.report.fail(
                n,
                f"the job ended{at}: {why}",
                str(ex.get("remedy") or "see the job's output"),
            )

    def refused(self, n: int) -> None:
        """FAIL check ``n`` when the agent itself exited before the run began (a bad job file,
        a command not on PATH): its own one line says why."""
        code = self.box.agent_exit(RUN)
        if code is not None and not self.box.status(RUN).get("attempt"):
            lines = [ln for ln in self.box.agent_output(RUN).splitlines() if ln.strip()]
            why = lines[-1].removeprefix("rgt: ") if lines else f"rgt-agent run exited {code}"
            raise self.report.fail(n, why, "fix what the line says, then run rgt smoke again")

    # ---- the checks
    def run(self) -> None:
        if self.req.exact:  # the uninterrupted reference runs beside the walk from the start
            self.start(finish.REFERENCE, self.workdir("work-ref"), self.ckpt_dir(0), False)
        self.work = self.workdir("work-1")
        self.start(RUN, self.work, self.ckpt_dir(1))
        self.starts()
        self.progress()
        step = self.checkpoint()
        self.sealed(step)
        self.work = self.resume()
        done = finish.exact(self) if self.req.exact else None
        if not self.req.exact:
            self.report.skip(6, "not asked (--exact compares with an uninterrupted run)")
        finish.outputs(self, done)

    def starts(self) -> None:
        t0 = time.monotonic()

        def look() -> Optional[str]:
            self.refused(1)
            st, step = self.sample()
            if st and self.spec is None:
                self.spec = self.box.spec(RUN)
            if step is not None:
                return "step"
            if st.get("last_exit") or st.get("state") in ("SUCCEEDED", "FAILED"):
                return "ended"
            return None

        what = wait_for(look, self.req.timeout)
        st = self.box.status(RUN)
        if what == "step":
            first = self.samples[0][1]
            self.report.ok(1, f"the job started and reported step {first} after "
                           f"{time.monotonic() - t0:.1f} s")  # fmt: skip
            return
        self.crash(1, st)
        printed = bool(self.box.log(RUN).strip())
        if what == "ended" or printed:  # it started and printed: progress is what is missing
            self.report.ok(1, "the job started and printed")
            return
        raise self.report.fail(
            1,
            f"the job printed nothing in {self.req.timeout:.0f} s",
            "see its output with --keep DIR; raise --timeout for a slow start",
        )

    def progress(self) -> None:
        req = self.req
        t0 = time.monotonic()

        def reached() -> bool:
            st, step = self.sample()
            if st.get("last_exit") or st.get("state") in ("SUCCEEDED", "FAILED"):
                return True
            if step is None:
                return False
            if req.seconds is not None:
                return time.monotonic() - self.samples[0][0] >= req.seconds
            return step >= (req.steps or 10)

        wait_for(reached, req.timeout + (req.seconds or 0))
        st = self.box.status(RUN)
        self.crash(2, st)
        if not self.samples:
            raise self.report.fail(
                2,
                f"the job reported no step in {time.monotonic() - t0:.0f} s",
                "report steps: onbox.train's should_checkpoint(step), or a [progress] pattern "
                "in the job file (pattern = 'step (\\d+)')",
            )
        last = self.samples[-1][1]
        rate = rate_text(step_rate(self.samples))
        self.report.ok(2, f"reached step {last}; {rate}")

    def ask(self) -> str:
        """Ask the job for a checkpoint the way the agent would (onbox/agent/sealservice.py)."""
        assert self.spec is not None
        trigger = self.spec.trigger
        rd = self.box.rd(RUN)
        self.asked_at = time.time()
        if trigger == "file":
            with open(rd.checkpoint_request, "w") as f:
                f.write('{"why": "smoke"}')
            return "asked through its request file"
        if trigger.startswith("signal:"):
            pid = self.box.status(RUN).get("pid")
            if pid:
                os.kill(int(pid), int(getattr(signal, "SIG" + trigger.split(":", 1)[1])))
            return f"asked with {trigger.split(':', 1)[1]}"
        self.asked_at = None
        return "by its own interval: checkpoint.trigger is none, so rgt cannot ask"

    def checkpoint(self) -> int:
        assert self.spec is not None
        ckpt = self.spec.ckpt_dir
        before = newest_local_step(ckpt) or 0
        how = self.ask()
        t0 = time.monotonic()

        def written() -> Optional[int]:
            st, _ = self.sample()
            newest = newest_local_step(ckpt)
            if newest is not None and (newest > before or self.asked_at is None):
                return newest
            if st.get("last_exit") or st.get("state") in ("SUCCEEDED", "FAILED"):
                return -1
            return None

        step = wait_for(written, self.req.timeout)
        st = self.box.status(RUN)
        if step is None or step < 0:
            self.crash(3, st)
            raise self.report.fail(3, self._no_checkpoint(ckpt, time.monotonic() - t0, how),
                                   finish.CKPT_REMEDY)  # fmt: skip
        self.report.ok(3, f"step {step} complete in RGT_CKPT_DIR after "
                       f"{time.monotonic() - t0:.1f} s ({how})")  # fmt: skip
        return int(step)

    def _no_checkpoint(self, ckpt: str, waited: float, how: str) -> str:
        try:
            held = sorted(os.listdir(ckpt))
        except OSError:
            held = []
        why = f"no complete checkpoint in RGT_CKPT_DIR after {waited:.0f} s ({how})"
        if held:
            why += f"; it holds {short_list(held)}, none complete by rgt's rules"
        elsewhere = [r for r in sorted(tree(self.work) - set(self.files)) if finish.is_ckpt_name(r)]
        if elsewhere:
            why += f"; the job wrote {short_list(elsewhere)} in its workdir instead"
        return why

    def sealed(self, step: int) -> None:
        store = open_store(self.box.store_url)

        def latest() -> Optional[int]:
            self.sample()
            doc = mf.parse_latest(store.get_bytes(mf.latest_key(RUN)))
            return int(doc["step"]) if doc and int(doc["step"]) >= step else None

        if wait_for(latest, self.req.timeout) is None:
            errors = [e["reason"] for e in self.box.events(RUN) if e.get("class")]
            raise self.report.fail(
                4,
                f"step {step} was not sealed in {self.req.timeout:.0f} s"
                + (f": {errors[-1]}" if errors else ""),
                "see the run's events with --keep DIR (events.jsonl)",
            )
        try:
            doc = restore_latest(store, RUN, os.path.join(self.box.root, "verify"), _quiet)
        except RgtError as e:
            why = f"the sealed checkpoint does not verify: {e.what}"
            raise self.report.fail(4, why, e.remedy or "see the store") from None
        assert doc is not None
        events = self.box.events(RUN)
        if self.asked_at is not None:  # the smoke asked, not the agent: its ask counts
            asked = {"kind": "checkpoint_asked", "time": iso(self.asked_at)}
            events = [asked] + [e for e in events if str(e.get("time", "")) >= asked["time"]]
        self.seal = measure(events, "the smoke run")
        files = doc.get("files", [])
        self.report.ok(4, f"step {doc['step']} sealed, {len(files)} file(s) restored from the "
                       f"store and every sha256 verified; {seal_text(self.seal)}")  # fmt: skip

    def resume(self) -> str:
        """Check 5; the fresh workdir the resumed run uses."""
        st, step = self.sample()
        if st.get("state") in ("SUCCEEDED", "FAILED"):
            self.crash(5, st)
            raise self.report.fail(
                5,
                f"the job ended ({st.get('state')}, at step {step}) before it could be preempted",
                "under RGT_SMOKE=1, give it more steps than the smoke needs (--steps N)",
            )
        code = self.box.preempt(RUN, self.req.grace + 15)
        ended = self.box.status(RUN).get("state")
        self.box.wipe(RUN, self.ckpt_dir(1))
        work = self.workdir("work-2")
        self.start(RUN, work, self.ckpt_dir(2))
        verdict = wait_for(lambda: self._resume_verdict(), self.req.timeout)
        if verdict is None:
            st = self.box.status(RUN)
            self.crash(5, st)
            restored = any(e.get("kind") == "restored" for e in self.box.events(RUN))
            why = (
                "the job reported no step after the restore"
                if restored
                else "nothing was restored from the store"
            )
            raise self.report.fail(5, f"{why} in {self.req.timeout:.0f} s",
                                   "see the run's events with --keep DIR")  # fmt: skip
        if verdict["kind"] != "resumed":
            raise self.report.fail(5, verdict["reason"], verdict.get("remedy") or "")
        self.report.ok(5, f"preempted at step {step} (the run ended {ended}, agent exit {code}); "
                       f"restored step {verdict.get('resume_step')} on a fresh directory, and "
                       f"the job went on at step {verdict.get('reported_step')}")  # fmt: skip
        return work

    def _resume_verdict(self) -> Optional[Dict[str, Any]]:
        for e in self.box.events(RUN):
            if e.get("kind") in ("resumed", "resume_mismatch"):
                return e
        st = self.box.status(RUN)
        ex = st.get("last_exit")
        if st.get("state") == "FAILED" or (isinstance(ex, dict) and ex.get("kind") != "success"):
            return None if not st else _ended(st)
        return None


def _ended(st: Dict[str, Any]) -> Dict[str, Any]:
    ex = st.get("last_exit") or {}
    return {
        "kind": "ended",
        "reason": f"after the restore the job ended: {ex.get('reason') or st.get('state')}",
        "remedy": ex.get("remedy") or "see the job's output with --keep DIR",
    }


def _quiet(*args: Any, **kwargs: Any) -> None:
    """The restore's events: the verdict is its return value or its error."""


def check_request(req: SmokeRequest) -> None:
    """Refuse a request that cannot be walked, before anything is made."""
    if not req.command and not req.job_file:
        raise UsageError("CMD", "nothing to run", "rgt smoke [JOB.toml] -- CMD ...")
    if req.steps is not None and req.seconds is not None:
        raise UsageError("--steps", "give --steps or --seconds, not both")
    if req.steps is not None and req.steps < 2:
        raise UsageError("--steps", f"{req.steps} is too few to see a resume", "at least 2")
    if req.keep and os.path.exists(req.keep) and os.listdir(req.keep):
        raise UsageError("--keep", f"{req.keep} is not empty", "name a new directory")


def smoke(req: SmokeRequest, emit: Callable[[str], None]) -> None:
    """Walk the checks for ``req``, printing a line each; SmokeFailed at the first failure.
    Every process started is stopped by PID before it returns or raises, also on a Ctrl-C, a
    SIGTERM or a hang-up (controller/hangup.py, set up by `rgt`'s ``main``: KeyboardInterrupt,
    exit 130, 143 or 129), and the temporary directory is deleted unless ``--keep DIR`` named
    it. Only the walk itself is cut by an ask, once (``hangup.raised_once``): the local box's
    processes have no owner but this function, so making the box and stopping it are held
    (``hangup.held``), and a second ask cannot leave them running."""
    check_request(req)
    t0 = time.monotonic()
    with hangup.held():
        if req.keep:
            os.makedirs(req.keep, mode=0o700, exist_ok=True)
            root = os.path.abspath(req.keep)
        else:
            root = tempfile.mkdtemp(prefix="rgt-smoke-")
        box = LocalBox(root, gpu=req.gpu)
        try:
            with hangup.raised_once():
                emit(f"smoke: {' '.join(req.command) or req.job_file} under a private "
                     f"rgt-agent ({'GPU' if req.gpu else 'CPU'}, RGT_SMOKE=1, store "
                     f"{box.store_url})")  # fmt: skip
                Walk(req, box, Report(emit)).run()
                emit(f"smoke: every check passed in {time.monotonic() - t0:.0f} s")
        finally:
            box.close()
            if req.keep:
                emit(f"smoke: kept {root}")
            else:
                shutil.rmtree(root, ignore_errors=True)
