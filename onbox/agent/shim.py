"""The tiny parent of one attempt (the containerd-shim / conmon design).

``python -m onbox.agent.shim RUN_DIR ATTEMPT READY_FD``, started by the agent in a session of its
own.
It starts the job in a new session (so the job's process group is its own), records the job's
identity in job.json, reports on READY_FD, waits, and records the exit status in exit.json,
durably, whether or not any agent is alive to hear it. While it waits it checks that some agent
holds the run's lock; when none has for ``respawn_delay`` seconds it starts one again, because a
job whose checkpoints nobody seals must not go on silently.

Imports only the standard library and onbox's ground floor, to start fast and stay small.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time

from onbox.agent import procfs
from onbox.agent.journal import FileJournal, iso
from onbox.agent.lock import is_held
from onbox.agent.title import set_title
from onbox.common import redact
from onbox.common.durable import read_json, write_json
from onbox.common.rundir import RunDir, read_secrets

TYPE_CHECKING = False
if TYPE_CHECKING:  # the shim imports this module: typing would cost it ~2 MiB
    from typing import Any, Dict, List, Optional

# At most this many agent restarts per window; then the shim only records (a crashing agent
# restarted forever would hide the problem).
MAX_RESPAWNS = 5
RESPAWN_WINDOW = 600.0
LOCK_CHECK_EVERY = 1.0


class Shim:
    """One attempt's parent."""

    def __init__(self, rd: RunDir, attempt: int, launch: Dict[str, Any]) -> None:
        self.rd = rd
        self.attempt = attempt
        self.launch = launch
        self.journal = FileJournal(rd.state, rd.events, rd.agent_log)
        self.agent_proc: Optional[subprocess.Popen[bytes]] = None
        self.respawns: List[float] = []
        self.lock_free_since: Optional[float] = None

    def job_env(self) -> Dict[str, str]:
        """The job's environment: the launch's, plus the run's secrets, read here from their
        0600 file on every start so that a restarted attempt gets them too and no file of the
        run ever holds them."""
        env = dict(self.launch["env"])
        if self.launch.get("inherit_env"):
            # In a pod (onbox/agent/podrunner.py) the job's base environment is its own
            # container's (its image's PATH and settings), which the launcher passed to us.
            env = {**os.environ, **env}
        path = self.launch.get("secrets")
        if not path:
            return env
        env.update(read_secrets(path))
        return env

    def start_job(self) -> subprocess.Popen[bytes]:
        adj = str(self.launch["oom_score_adj"]).encode()

        def before_exec() -> None:  # runs in the child, between fork and exec
            # Ignored signals stay ignored across exec: give the job the defaults back.
            for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_DFL)
            try:
                with open("/proc/self/oom_score_adj", "wb") as f:
                    f.write(adj)
            except OSError:
                pass

        out = os.open(
            self.rd.output_log(self.attempt),
            os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC,
            0o600,
        )
        try:
            return subprocess.Popen(
                self.launch["command"],
                cwd=self.launch["cwd"],
                env=self.job_env(),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,
                close_fds=True,
                umask=0o077,
                preexec_fn=before_exec,
            )
        finally:
            os.close(out)

    def record_exit(self, code: Optional[int], sig: Optional[int], note: str = "") -> None:
        write_json(
            self.rd.exit_record(self.attempt),
            {"code": code, "signal": sig, "note": note, "ended_at": iso(time.time())},
        )

    def run(self, ready_fd: int) -> int:
        try:
            job = self.start_job()
        except OSError as e:
            note = f"could not start {self.launch['command'][0]!r}: {e.strerror or e}"
            self.record_exit(127, None, note)
            _say(ready_fd, {"ok": False, "error": note})
            return 0
        ident = procfs.child_identity(job.pid)  # ended already or not: ours until reaped
        me = procfs.identity(os.getpid())
        write_json(
            self.rd.job_record(self.attempt),
            {
                "pid": job.pid,
                "start_ticks": ident.start_ticks if ident else -1,
                "pgid": job.pid,
                "tag": self.launch["tag"],
                "shim": {"pid": os.getpid(), "start_ticks": me.start_ticks if me else -1},
                "boot_id": procfs.boot_id(),
                "started_at": iso(time.time()),
            },
        )
        _say(ready_fd, {"ok": True, "pid": job.pid})
        pidfd = procfs.open_pidfd(ident) if ident else None
        while True:
            if pidfd is not None:
                procfs.wait_readable([pidfd], LOCK_CHECK_EVERY)
            else:
                time.sleep(0.1)
            status = self.reap(job.pid)
            if status is not None:
                break
            self.watch_agent()
        job.returncode = status  # reaped here, not by Popen
        if os.WIFSIGNALED(status):
            self.record_exit(None, os.WTERMSIG(status))
        else:
            self.record_exit(os.WEXITSTATUS(status), None)
        return 0

    def reap(self, job_pid: int) -> Optional[int]:
        """Reap every child that ended (the job, orphans we adopted, an agent we started);
        the job's wait status once it has ended."""
        found = None
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return found
            if pid == 0:
                return found
            if pid == job_pid:
                found = status
            elif self.agent_proc is not None and pid == self.agent_proc.pid:
                self.agent_proc.returncode = status

    def watch_agent(self) -> None:
        """Start the agent again when nobody has held the run's lock for a while."""
        if self.launch.get("respawn_agent") is False:
            return  # in a pod the agent has its own container, which the kubelet restarts
        if is_held(self.rd.lock):
            self.lock_free_since = None
            return
        now = time.monotonic()
        if self.lock_free_since is None:
            self.lock_free_since = now
            return
        if now - self.lock_free_since < float(self.launch["respawn_delay"]):
            return
        self.respawns = [t for t in self.respawns if now - t < RESPAWN_WINDOW]
        if len(self.respawns) >= MAX_RESPAWNS:
            if len(self.respawns) == MAX_RESPAWNS:
                self.journal.event(
                    "agent_respawn_gave_up",
                    f"the agent died {MAX_RESPAWNS} times in {RESPAWN_WINDOW:.0f}s; the job "
                    "runs unsupervised",
                    klass="permanent",
                    remedy="read agent.log, then `rgt-agent start --name " + self.rd.name + "`",
                )
                self.respawns.append(now)
            return
        self.respawns.append(now)
        self.lock_free_since = None
        self.spawn_agent()

    def spawn_agent(self) -> None:
        fd = os.open(self.rd.lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return  # someone started an agent meanwhile
            self.journal.event(
                "agent_respawn",
                f"no agent held the run; the shim of attempt {self.attempt} is starting one",
                klass="transient",
                remedy="read agent.log for why the agent died",
            )
            from onbox.agent.daemon import (
                spawn_agent,  # only now: the shim stays small until needed
            )

            self.agent_proc = spawn_agent(
                self.rd, fd, adopt_only=True, argv=self.launch["agent_cmd"]
            )
        finally:
            os.close(fd)  # the agent holds the lock now


def _say(fd: int, msg: Dict[str, Any]) -> None:
    try:
        os.write(fd, (json.dumps(msg) + "\n").encode())
        os.close(fd)
    except OSError:  # the agent that started us is gone; the records on disk still tell
        pass


def _become_subreaper() -> None:
    """Orphans of the job are reparented to the shim instead of init, so they stay findable as
    descendants of the attempt (containerd-shim does the same). Best effort: Linux >= 3.4."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def main(argv: List[str]) -> int:
    run_path, attempt_s, ready_s = argv
    # The shim's stdout and stderr are agent.log (onbox/agent/runner.py): a traceback or a warning
    # printed there is redacted line by line, as the agent's own are (onbox/agent/loop.py). The
    # redactor is built only when a line is written, so a quiet shim never pays for it.
    home = os.path.dirname(os.path.dirname(os.path.abspath(run_path)))
    sys.stdout = redact.RedactingStream(sys.stdout, lambda: redact.for_home(home))
    sys.stderr = redact.RedactingStream(sys.stderr, lambda: redact.for_home(home))
    os.umask(0o077)
    _become_subreaper()
    for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM, signal.SIGPIPE):
        # The shim must outlive everything but its job: only SIGKILL ends it early.
        signal.signal(sig, signal.SIG_IGN)
    rd = RunDir(os.path.basename(run_path), os.path.dirname(os.path.dirname(run_path)))
    attempt = int(attempt_s)
    set_title(f"rgt-agent shim {rd.name} attempt {attempt}")
    launch_path = os.path.join(rd.attempt_dir(attempt), "launch.json")
    launch = read_json(launch_path)
    os.unlink(launch_path)
    if launch is None:
        raise SystemExit(f"rgt shim: {launch_path} is missing")
    return Shim(rd, attempt, launch).run(int(ready_s))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
