"""The agent in its own container of a Kubernetes pod: ``rgt-agent run --pod --name N``.

Why: on cgroup v2 (Kubernetes >= 1.28) one OOM kill takes every process of a container, so an
agent in the job's container dies with the job and cannot seal. In a pod the agent is a native
sidecar (an initContainer with ``restartPolicy: Always``: the kubelet restarts it when it dies,
and the new agent adopts the running attempt) and the job runs in the main container, in its own
image, under ``onbox.agent.podlaunch``. Both share the run directory (an emptyDir at RGT_HOME)
and one PID namespace (``shareProcessNamespace``), so pids, pidfds, /proc and signals work
across the two containers as they do on one box (signals need both containers to run as the
same user, or the agent's to hold CAP_KILL).

``PodRunner`` is the ``ShimRunner`` with one change: the agent does not fork the shim, it asks
the launcher to (``pod/spawn-N.json``) and waits, bounded, for the shim's job.json (or its
exit.json), then watches and signals the attempt exactly as ``ShimRunner.adopt`` does. The
launch file tells that shim not to respawn the agent (the kubelet does) and to give the job its
own container's environment underneath the run's.

Outputs: the job's workdir is in the job container's filesystem, not this one. With a shared
process namespace the kernel shows it at ``/proc/<launcher pid>/root``, and the launcher lives
until final.json, so at success ``workdir_root`` gives the completion seal that root (when the
launcher's mount namespace or root differs from ours), and onbox/agent/jobroot.py reads the
declared outputs there, resolving every link inside it and refusing what leaves the workdir.
Reading it needs the two containers to run as one user (or the agent to hold CAP_SYS_PTRACE);
when it cannot be read the outputs are reported missing with ``outputs_unreadable``.

When the job container dies whole (an OOM kill, or the node's runtime killing it), the shim
leaves no exit record and the launcher is gone with it: nothing in this pod can start the job
again. The agent, alive in its own container, records ``job_container_died`` (OOM-killed when
the container's cgroup counter or the kernel log says so), ends the run PREEMPTED through the
preemption path (what is complete is sealed, the state mirrored to the store) and waits; the
Job's next pod restores. After any terminal state the agent writes ``pod/final.json`` with the
exit code (the launcher exits with it, for ``podFailurePolicy``) and then waits for its own
SIGTERM instead of exiting, because a native sidecar that exits is started again.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any, Callable, List, Optional, Tuple, cast

from onbox.agent import cgroup, procfs
from onbox.agent.classify import ExitStatus
from onbox.agent.journal import iso
from onbox.agent.lock import RunLock
from onbox.agent.loop import Agent
from onbox.agent.podlaunch import (
    AGENT,
    FINAL,
    LAUNCHER,
    POD,
    POD_LIB,
    identity_doc,
    pod_file,
    recorded,
    spawn_file,
)
from onbox.agent.runner import ShimRunner, ensure_job_lib
from onbox.agent.spec import JobSpec
from onbox.agent.title import set_title
from onbox.common.durable import read_json, write_json
from onbox.common.errors import FINAL_EXIT_CODES, RgtError, UsageError
from onbox.common.rundir import RunDir
from onbox.health.memory import Cgroup, cgroup_chain

# How long a spawn waits for the launcher to start the shim: the job container may still be
# pulling its image when the agent asks for the first attempt.
SPAWN_WAIT = 300.0
RECORD_POLL = 0.05


def publish_lib(home: str) -> str:
    """The job lib (runner.ensure_job_lib) under the stable name ``$RGT_HOME/lib/pod``, which
    the job container's PYTHONPATH names and the sidecar's startup probe waits for. A relative
    link, replaced atomically: the same in both containers, whatever their mount path."""
    lib = ensure_job_lib(home)
    link = os.path.join(home, POD_LIB)
    if os.path.realpath(link) != os.path.realpath(lib):
        tmp = f"{link}.tmp.{os.getpid()}"
        os.symlink(os.path.basename(lib), tmp)
        os.replace(tmp, link)
    return link


class PodRunner(ShimRunner):
    """Attempts started by the job container's launcher, supervised from the agent's."""

    def __init__(self, rd: RunDir, spec: JobSpec, **kw: Any) -> None:
        super().__init__(rd, spec, **kw)
        # The job's base environment is its own container's (the shim's inherit_env), not this
        # container's: only the run's variables travel in the launch file.
        self.base_environ = {}
        # Called once when the job container is found dead (the agent stops the run then).
        self.container_gone: Callable[[str], None] = lambda why: None
        self.launcher: Optional[procfs.Identity] = None
        self._box: Optional[Tuple[Cgroup, Optional[int]]] = None  # its cgroup, OOM count then
        self._kmsg_mark: Optional[int] = None  # the kernel log's end when the launcher was seen
        self._ended: Optional[ExitStatus] = None  # an end found at spawn, for poll_exit
        os.makedirs(os.path.join(rd.path, POD), exist_ok=True)
        write_json(pod_file(rd.path, AGENT), identity_doc())  # the launcher passes stops here

    # ---- the launcher
    def _note_launcher(self) -> Optional[procfs.Identity]:
        """The live launcher; the first time it is seen, its container's memory cgroup and
        OOM-kill count (where this container can read them) and the kernel log's mark, the
        evidence of an OOM later."""
        ident = recorded(pod_file(self.rd.path, LAUNCHER))
        if ident is not None and ident != self.launcher:
            self.launcher = ident
            self._kmsg_mark = cgroup.kernel_log_mark()
            theirs, ours = cgroup_chain(ident.pid), cgroup_chain(None)
            if theirs and (not ours or theirs[0].path != ours[0].path):
                self._box = (theirs[0], theirs[0].oom_kills())
        return ident

    def _await_records(self, attempt: int) -> bool:
        """Wait (bounded) until the shim of ``attempt`` wrote job.json or exit.json; False when
        the launcher died or never came."""
        deadline = time.monotonic() + SPAWN_WAIT
        seen = os.path.exists(pod_file(self.rd.path, LAUNCHER))
        while not any(
            map(os.path.exists, (self.rd.job_record(attempt), self.rd.exit_record(attempt)))
        ):
            alive = self._note_launcher() is not None
            seen = seen or alive
            if (seen and not alive) or time.monotonic() >= deadline:
                return False
            time.sleep(RECORD_POLL)
        self._note_launcher()
        return True

    def workdir_root(self) -> Optional[str]:
        """The job container's filesystem as this container sees it: ``/proc/PID/root`` of the
        live launcher (the job container's PID 1, alive until final.json) when it is another
        mount namespace or root than ours; "" when it is ours (one filesystem, as in the tests'
        plain pods); None when it cannot be read (the launcher is gone, /proc denied)."""
        ident = recorded(pod_file(self.rd.path, LAUNCHER))
        if ident is None:
            return None
        root = f"/proc/{ident.pid}/root"
        try:
            theirs = [os.stat(f"/proc/{ident.pid}/{p}") for p in ("ns/mnt", "root")]
            ours = [os.stat(f"/proc/self/{p}") for p in ("ns/mnt", "root")]
        except OSError:
            return None
        if not procfs.is_alive(ident):  # its pid reused meanwhile: not the job's root
            return None
        if [(s.st_dev, s.st_ino) for s in theirs] == [(s.st_dev, s.st_ino) for s in ours]:
            return ""
        return root

    # ---- starting and re-attaching
    def spawn(self, attempt: int) -> int:
        tag = self.write_launch(attempt, respawn_agent=False, inherit_env=True)
        write_json(spawn_file(self.rd.path, attempt), {"attempt": attempt, "at": iso(time.time())})
        self.attempt, self.tag, self.job, self.shim = attempt, tag, None, None
        if not self._await_records(attempt):
            self._ended = self._died(ExitStatus(), started=False)
            return -1
        status = self.adopt(attempt)
        if status is not None:  # it could not start (the shim's exit.json says why)
            self._ended = status
            return -1
        return self.job.pid if self.job is not None else -1

    def adopt(self, attempt: int) -> Optional[ExitStatus]:
        # A restarted sidecar: the launcher may not have started the attempt the last agent
        # asked for yet; wait for it rather than take a missing record for a lost attempt.
        if os.path.exists(spawn_file(self.rd.path, attempt)) and not self._await_records(attempt):
            self.attempt = attempt
            return self._died(ExitStatus(), started=False)
        return super().adopt(attempt)

    # ---- watching
    def poll_exit(self) -> Optional[ExitStatus]:
        if self._ended is not None:
            ended, self._ended = self._ended, None
            return ended
        status = super().poll_exit()
        if status is None or status.known or self._recorded_exit() is not None:
            return status
        if self._note_launcher() is not None:
            return status  # only the shim was killed: the container lives, as on a box
        return self._died(status, started=True)

    def _died(self, status: ExitStatus, *, started: bool) -> ExitStatus:
        """The job container is gone: say so and why, once, and have the agent end the run."""
        pids = [i.pid for i in (self.job, self.shim, self.launcher) if i is not None]
        evidence: List[str] = []
        if self._box is not None:
            box, before = self._box
            after = box.oom_kills()
            if after is not None and before is not None and after > before:
                evidence.append(f"its cgroup {box.path} counted {after - before} OOM kill(s)")
        if pids and cgroup.kernel_says_oom_killed(pids, self._kmsg_mark):
            evidence.append("the kernel log names one of its processes")
        how = f"OOM-killed ({'; '.join(evidence)})" if evidence else "killed"
        what = (
            f"its launcher, the shim and the job of attempt {self.attempt} ended together "
            "with no exit record"
            if started
            else f"attempt {self.attempt} was never started (no launcher alive)"
        )
        why = f"the job container died, {how}: {what}"
        self.event(
            "job_container_died",
            f"{why}; nothing in this pod can start the job again, so the agent seals what is "
            "complete and ends the run PREEMPTED; the Job's next pod restores",
            klass="transient",
            remedy="give the job container more memory (resources.limits.memory)"
            if evidence
            else "see the pod's events (kubectl describe pod)",
            attempt=self.attempt,
            oom=bool(evidence),
        )
        self.container_gone(why)
        sig = signal.SIGKILL if evidence else status.signal
        return ExitStatus(code=status.code, signal=sig, note=why)


class PodAgent(Agent):
    """The agent with a PodRunner; a dead job container ends the run as a preemption does."""

    runner_class = PodRunner

    def __init__(self, rd: RunDir, lock: RunLock) -> None:
        super().__init__(rd, lock)
        cast(PodRunner, self.runner).container_gone = lambda why: self.sup.request_stop("preempt")


def final_of(rd: RunDir) -> Optional[int]:
    """The exit code an earlier agent of this pod wrote, else None."""
    try:
        doc = read_json(pod_file(rd.path, FINAL))
    except ValueError:
        return None
    return None if doc is None else int(doc["code"])


def _write_final(rd: RunDir, state: str, code: int) -> None:
    os.makedirs(os.path.join(rd.path, POD), exist_ok=True)
    write_json(pod_file(rd.path, FINAL), {"state": state, "code": code, "at": iso(time.time())})


class _TermWaiter:
    """Installed before final.json is written (the kubelet's SIGTERM to the sidecar follows the
    launcher's exit, which follows final.json), so that SIGTERM is never missed."""

    def __init__(self) -> None:
        self.r, w = os.pipe()
        os.set_blocking(w, False)
        os.set_blocking(self.r, False)
        self.got: List[int] = []
        signal.set_wakeup_fd(w)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: self.got.append(signum))

    def wait(self) -> None:
        while not self.got:
            procfs.wait_readable([self.r], None)
            try:
                while os.read(self.r, 512):
                    pass
            except BlockingIOError:
                pass


def run_pod(
    name: Optional[str],
    claim: Callable[[], Optional[Tuple[JobSpec, RunDir, RunLock]]],
    emit: Callable[[str], None],
) -> int:
    """``rgt-agent run --pod``: supervise the run through the job container's launcher, write
    the final code for it, then wait for SIGTERM; returns the final state's exit code."""
    if not name:
        raise UsageError(
            "--name",
            "--pod needs the run's name: the job container's launcher is given its run dir",
            "give --name N (rgt emit k8s does)",
        )
    rd = RunDir(name)
    publish_lib(rd.home)
    code = final_of(rd)
    if code is not None:  # this pod's run ended under an earlier agent: do not begin again
        emit(f"run {rd.name} ended already in this pod (exit {code}); waiting for SIGTERM")
        _TermWaiter().wait()
        return code
    claimed = claim()
    if claimed is None:  # the store says it is finished
        waiter = _TermWaiter()
        _write_final(rd, "SUCCEEDED", FINAL_EXIT_CODES["SUCCEEDED"])
        waiter.wait()
        return FINAL_EXIT_CODES["SUCCEEDED"]
    spec, rd, lock = claimed
    if os.path.commonpath([os.path.abspath(spec.ckpt_dir), rd.home]) != rd.home:
        lock.release()
        raise UsageError(
            "checkpoint.dir",
            f"{spec.ckpt_dir} is not under {rd.home}, the directory both containers share",
            "leave [checkpoint] dir unset (the run dir's ckpt) or put it under RGT_HOME",
        )
    set_title(f"rgt-agent run --pod {rd.name}")
    agent = PodAgent(rd, lock)
    try:
        agent.prepare(may_begin=True)
    except RgtError as e:  # the run is FAILED already, with why
        waiter = _TermWaiter()
        _write_final(rd, "FAILED", e.exit_code)
        waiter.wait()
        raise
    # A store error (letgo.py left_unended: a success whose results the store did not take,
    # left RUNNING) goes out as it is, with no final.json: the launcher, the pod and the
    # results only its emptyDir holds stay, and the kubelet's restart of this sidecar is the
    # next agent, which adopts the run and seals the rest once the store answers.
    final = agent.run()
    emit(f"run {rd.name} ended {final.value}; waiting for SIGTERM (a native sidecar)")
    waiter = _TermWaiter()
    code = FINAL_EXIT_CODES.get(final.value, 1)
    _write_final(rd, final.value, code)
    waiter.wait()
    return code
