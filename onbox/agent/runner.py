"""The real Runner: starts each attempt under its own shim, finds its processes, signals them.

The job's processes are named three ways, each covering a gap in the others: the shim (its
parent, which records the exit status), the job's process group (the job is a session leader,
so the group id is its pid), and a tag in the environment of every process of the attempt
(which a child keeps even after it calls setsid and leaves the group).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import onbox
from onbox.agent import cgroup, procfs, proxyhook
from onbox.agent.classify import ExitStatus
from onbox.agent.daemon import TAG_VAR, agent_environ, python_argv, user_environ
from onbox.agent.journal import log
from onbox.agent.spec import JobSpec
from onbox.agent.watchedpaths import disk_paths
from onbox.common import jobenv
from onbox.common.durable import read_json, write_json
from onbox.common.errors import HostError
from onbox.common.rundir import RunDir
from onbox.common.terminal import printable

TAIL_BYTES = 16384
# Without pidfds (Linux < 5.3) the agent looks for the shim's exit this often.
POLL_FALLBACK = 0.2
# The job's oom_score_adj is this much above the agent's, so the OOM killer takes the job.
OOM_ADJ_STEP = 500


def ensure_job_lib(home: str) -> str:
    """A directory holding only the pure-Python ``onbox`` package and rgt's ``sitecustomize``
    (the stack hook), for the job's PYTHONPATH.

    The job runs in the box's own Python; it must be able to ``import onbox`` (the training
    API) without seeing the agent's site-packages. Named by content hash, made atomically.
    Every module's compiled bytecode for this Python goes with it (pip compiled it at
    install): a job on a fresh box would otherwise compile the training API at every start
    (15-20 ms of CPU on this project's test machine, when the job's own imports want it; a
    box whose Python differs uses its own cache tag and compiles, as it would anyway).
    """
    root = onbox.import_root()
    files = []  # every module of the package, its wings included, relative to root
    for here, dirs, names in os.walk(os.path.join(root, "onbox")):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
        files += [os.path.relpath(os.path.join(here, n), root) for n in names if n.endswith(".py")]
    files.sort()
    h = hashlib.sha256()
    for name in files:
        with open(os.path.join(root, name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read())
    dest = os.path.join(home, "lib", "onbox-" + h.hexdigest()[:16])
    if not os.path.isdir(dest):
        tmp = f"{dest}.tmp.{os.getpid()}"
        # The job's Python runs it at start (and then the next sitecustomize on its path): the
        # faulthandler hook that dumps every thread's stack at a stall (onbox/health/stacks.py).
        hook = os.path.join("onbox", "health", "stackhook.py")
        for src, dst in [(n, n) for n in files] + [(hook, "sitecustomize.py")]:
            os.makedirs(os.path.dirname(os.path.join(tmp, dst)), exist_ok=True)
            _place(os.path.join(root, src), os.path.join(tmp, dst))
            for pyc_src, pyc_dst in _bytecode(root, src, tmp, dst):
                os.makedirs(os.path.dirname(pyc_dst), exist_ok=True)
                _place(pyc_src, pyc_dst)
        try:
            os.rename(tmp, dest)
        except OSError:  # another agent made it first
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _bytecode(root: str, src: str, tmp: str, dst: str) -> List[Tuple[str, str]]:
    """(cached, its place in the lib) for each compiled form of module ``src`` this Python
    wrote (plain, -O, -OO). Valid beside the copy because the copy keeps the source's size
    and mtime, which is what the cache checks; the code's file name is set at load."""
    tag = sys.implementation.cache_tag
    if tag is None:  # this Python writes no bytecode cache
        return []
    out = []
    stem = os.path.splitext(os.path.basename(dst))[0]
    here = os.path.join(root, os.path.dirname(src), "__pycache__")
    there = os.path.join(tmp, os.path.dirname(dst), "__pycache__")
    base = os.path.splitext(os.path.basename(src))[0]
    for opt in ("", ".opt-1", ".opt-2"):
        cached = os.path.join(here, f"{base}.{tag}{opt}.pyc")
        if os.path.isfile(cached):
            out.append((cached, os.path.join(there, f"{stem}.{tag}{opt}.pyc")))
    return out


def _place(src: str, dst: str) -> None:
    """``dst`` as a hard link to ``src`` (a system call, where a copy is several), a copy
    keeping the mtime where the link is refused (another filesystem, a file of another
    user under protected_hardlinks). Installers replace a module by a new file, so a link
    keeps the content the lib was named for."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _own_oom_adj() -> int:
    try:
        with open("/proc/self/oom_score_adj") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 0


class ShimRunner:
    """Attempts of one run, each under ``python -m onbox.agent.shim``."""

    def __init__(
        self,
        rd: RunDir,
        spec: JobSpec,
        *,
        agent_cmd: List[str],
        base_environ: Mapping[str, str],
        respawn_delay: float = 3.0,
    ) -> None:
        self.rd = rd
        self.spec = spec
        self.agent_cmd = agent_cmd
        self.base_environ = user_environ(dict(base_environ))
        self.respawn_delay = respawn_delay
        self.attempt = 0
        self.tag: Optional[str] = None
        self.job: Optional[procfs.Identity] = None
        self.shim: Optional[procfs.Identity] = None
        self._shim_proc: Optional[subprocess.Popen[bytes]] = None
        self._watch: Optional[procfs.Identity] = None  # what the pidfd watches
        self._pidfd: Optional[int] = None
        # The restored checkpoint, set by the sealing service; '' when starting fresh.
        self.resume_from: Callable[[], str] = lambda: ""
        # The run's journal (set by the agent); the proxy hook's events go there, once each.
        self.event: Callable[..., None] = lambda kind, reason, **kw: log(rd.agent_log, reason)
        self._hook_said = False

    # ---- starting
    def job_environ(self, attempt: int, tag: str) -> Dict[str, str]:
        env = dict(self.base_environ)
        # The platform's proxy hook first: the profile's vars and the user's [env] win over it.
        env.update(self._hook_vars(env))
        env.update(self.spec.env)
        env.update(
            {
                jobenv.RUN: self.spec.name,
                jobenv.RUN_DIR: self.rd.path,
                jobenv.CKPT_DIR: self.spec.ckpt_dir,
                jobenv.RESUME_FROM: self.resume_from(),
                jobenv.ATTEMPT: str(attempt),
                # How the agent asks for a checkpoint ("signal:USR2", "file", "none"), so the
                # training API listens the same way (onbox/train/checkpointer.py).
                jobenv.CKPT_TRIGGER: self.spec.trigger,
                jobenv.STACKS_FILE: self.rd.stacks(attempt),
                TAG_VAR: tag,
            }
        )
        env.setdefault("PYTHONUNBUFFERED", "1")
        lib = ensure_job_lib(self.rd.home)
        old = env.get("PYTHONPATH")
        env["PYTHONPATH"] = lib + (os.pathsep + old if old else "")
        return env

    def _hook_vars(self, base: Mapping[str, str]) -> Dict[str, str]:
        """What the profile's proxy hook exports (onbox/agent/proxyhook.py); {} without one."""
        hook = self.spec.proxy_hook
        if not hook:
            return {}
        got, why = proxyhook.source(hook, base)
        if not self._hook_said:  # once per agent, not once per attempt
            self._hook_said = True
            if why is not None:
                self.event(
                    "proxy_hook_failed",
                    f"{why}: the job starts without the platform's proxy settings",
                    klass="usage",
                    remedy=f"fix {hook} or set env.proxy_hook in the {self.spec.profile} "
                    "profile ($RGT_HOME/profiles); meanwhile downloads go without the proxy",
                )
            else:  # names only: a proxy URL may hold a password
                self.event(
                    "proxy_hook",
                    f"sourced {hook}: the job gets {', '.join(proxyhook.names(got)) or 'nothing'}",
                    variables=proxyhook.names(got),
                )
        return got

    def write_launch(self, attempt: int, **more: Any) -> str:
        """Write attempt ``attempt``'s launch.json (``more``: extra fields for the shim, e.g.
        the pod runner's); return the attempt's tag."""
        os.makedirs(self.rd.attempt_dir(attempt), exist_ok=True)
        os.makedirs(self.spec.ckpt_dir, exist_ok=True)
        tag = f"{self.spec.name}:{attempt}:{os.urandom(6).hex()}"
        launch = {
            "name": self.spec.name,
            "attempt": attempt,
            "command": list(self.spec.command),
            "cwd": self.spec.workdir,
            "env": self.job_environ(attempt, tag),
            "tag": tag,
            "oom_score_adj": min(1000, _own_oom_adj() + OOM_ADJ_STEP),
            "agent_cmd": self.agent_cmd,
            "respawn_delay": self.respawn_delay,
            # Secrets never pass through this file: the shim reads them itself
            # (onbox/agent/shim.py).
            "secrets": self.rd.secrets_file,
            **more,
        }
        # The launch file holds the job's environment (maybe secrets): 0600, and the shim
        # deletes it as soon as it has read it.
        write_json(os.path.join(self.rd.attempt_dir(attempt), "launch.json"), launch)
        return tag

    def spawn(self, attempt: int) -> int:
        tag = self.write_launch(attempt)
        r, w = os.pipe()
        try:
            with open(self.rd.agent_log, "ab") as logf:
                proc = subprocess.Popen(
                    [*python_argv("onbox.agent.shim"), self.rd.path, str(attempt), str(w)],
                    stdin=subprocess.DEVNULL,
                    stdout=logf,
                    stderr=subprocess.STDOUT,
                    pass_fds=(w,),
                    start_new_session=True,
                    close_fds=True,
                    env=agent_environ(self.rd),
                    cwd="/",
                )
        finally:
            os.close(w)
        try:
            line = _read_line(r, timeout=30.0)
        finally:
            os.close(r)
        self._shim_proc = proc
        self.attempt, self.tag = attempt, tag
        # The shim may have ended already (a job that fails at once): a zombie, still ours.
        self.shim = procfs.child_identity(proc.pid)
        msg: Dict[str, Any] = (
            json.loads(line) if line else {"ok": False, "error": "the shim said nothing"}
        )
        rec = read_json(self.rd.job_record(attempt))
        if rec is not None:
            self.job = procfs.Identity(rec["pid"], rec["start_ticks"])
        self._set_watch(self.shim)
        if not msg.get("ok"):
            # The shim recorded the failure in exit.json; poll_exit() will report it.
            return -1
        return int(msg["pid"])

    # ---- re-attaching
    def adopt(self, attempt: int) -> Optional[ExitStatus]:
        """Attach to attempt ``attempt`` started by an earlier agent.

        Returns its exit status when it has already ended, else None (then watch it).
        """
        self.attempt = attempt
        rec = read_json(self.rd.job_record(attempt))
        if rec is None:
            return self._recorded_exit() or ExitStatus()
        self.tag = rec.get("tag")
        if rec.get("boot_id") and rec["boot_id"] != procfs.boot_id():
            # The box rebooted: pids and start times from before name nothing now.
            self.job = self.shim = None
            return self._recorded_exit() or ExitStatus()
        self.job = procfs.Identity(rec["pid"], rec["start_ticks"])
        shim = rec.get("shim")
        self.shim = procfs.Identity(shim["pid"], shim["start_ticks"]) if shim else None
        if procfs.is_alive(self.shim):
            self._set_watch(self.shim)
            return None
        status = self._recorded_exit()
        if status is not None:
            return status
        if procfs.is_alive(self.job):  # the shim was killed; the job lives on
            self._set_watch(self.job)
            return None
        return ExitStatus()

    # ---- watching
    def _set_watch(self, ident: Optional[procfs.Identity]) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
        self._watch = ident
        self._pidfd = procfs.open_pidfd(ident) if ident else None

    def watch_fds(self) -> List[int]:
        return [self._pidfd] if self._pidfd is not None else []

    def poll_interval(self) -> Optional[float]:
        """How often to call ``poll_exit`` when no fd will wake us."""
        if self._watch is not None and self._pidfd is None:
            return POLL_FALLBACK
        return None

    def _recorded_exit(self) -> Optional[ExitStatus]:
        rec = read_json(self.rd.exit_record(self.attempt))
        if rec is None:
            return None
        return ExitStatus(code=rec.get("code"), signal=rec.get("signal"), note=rec.get("note", ""))

    def poll_exit(self) -> Optional[ExitStatus]:
        """The attempt's exit status once its main process is gone, else None."""
        if self._watch is None:
            return None
        if procfs.is_alive(self._watch):
            return None
        if self._shim_proc is not None:
            self._shim_proc.poll()  # reap our child shim
        status = self._recorded_exit()
        if status is not None:
            self._set_watch(None)
            return status
        if self._watch == self.shim and procfs.is_alive(self.job):
            # The shim was killed but the job lives on: watch the job itself now.
            log(
                self.rd.agent_log,
                f"shim of attempt {self.attempt} is gone; watching the job "
                "directly (its exit status will not be known)",
            )
            self._set_watch(self.job)
            return None
        if self._watch == self.shim:
            # The shim may be between reaping the job and writing exit.json.
            time.sleep(0.05)
            status = self._recorded_exit()
        self._set_watch(None)
        return status or ExitStatus()

    # ---- acting on the attempt's processes
    def _tagged(self) -> List[procfs.Identity]:
        if not self.tag:
            return []
        return procfs.find_attempt(TAG_VAR, self.tag, self.job, [self.shim])

    def alive(self) -> bool:
        return procfs.is_alive(self.job) or bool(self._tagged())

    def signal(self, sig: int) -> None:
        group = None
        if self.job is not None and procfs.is_alive(self.job):
            try:
                os.killpg(self.job.pid, sig)  # the job is a session leader: pgid == pid
                group = self.job.pid
            except ProcessLookupError:
                pass
        for ident in self._tagged():
            st = procfs.read_stat(ident.pid)
            if st is None or st.pgid == group:
                continue  # the group signal reached it: a job's handler must not see two
            if procfs.is_alive(ident):
                try:
                    os.kill(ident.pid, sig)
                except ProcessLookupError:
                    pass

    def signal_job(self, sig: int) -> None:
        """Send ``sig`` to the job's main process only (a checkpoint request)."""
        if self.job is not None and procfs.is_alive(self.job):
            try:
                os.kill(self.job.pid, sig)
            except ProcessLookupError:
                pass

    def tail(self, limit: int = TAIL_BYTES) -> str:
        path = self.rd.output_log(self.attempt)
        try:
            with open(path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - limit))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def oom_kills(self) -> Optional[int]:
        return cgroup.oom_kill_count()

    def kernel_log_mark(self) -> Optional[int]:
        return cgroup.kernel_log_mark()

    def kernel_oom_killed(self, pid: int, after: Optional[int]) -> bool:
        return cgroup.kernel_says_oom_killed([pid], after)

    def workdir_root(self) -> Optional[str]:
        """Where the job's workdir is seen from here, as a prefix: "" (on a box, this very
        filesystem). PodRunner's is the job container's /proc/PID/root."""
        return ""

    def inodes_exhausted(self) -> bool:
        # Every path the disk probe watches (a dataset dir, the cache), not only the workdir and
        # the checkpoints: the exit says what its verdict said.
        for path in disk_paths(self.spec, self.rd.path).values():
            try:
                st = os.statvfs(path)
            except OSError:
                continue
            if st.f_files <= 0 or st.f_blocks <= 0:
                continue
            # ENOSPC reads the same for bytes and inodes; the scarcer one ran out. (Not "zero
            # inodes left": the sealer may have freed a few sealed copies since.)
            inodes, space = st.f_favail / st.f_files, st.f_bavail / st.f_blocks
            if inodes < 0.1 and inodes < space:
                return True
        return False

    def close(self) -> None:
        self._set_watch(None)


def _read_line(fd: int, timeout: float) -> str:
    """One line from a pipe within ``timeout`` seconds ('' on EOF or timeout)."""
    deadline = time.monotonic() + timeout
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0 or not procfs.wait_readable([fd], left):
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        buf += chunk
    return buf.split(b"\n", 1)[0].decode(errors="replace")


def read_ready(
    fd: int, silence: float, working: Callable[[Dict[str, Any]], None] = lambda msg: None
) -> Dict[str, Any]:
    """The JSON readiness message a child writes on ``fd``. Before it the child may write
    ``{"working": ...}`` lines, signs of life each handed to ``working``: ``silence`` bounds
    the wait for each line, not the whole wait. HostError when the child is silent that long
    or closes the pipe without a message."""
    buf = b""
    while True:
        while b"\n" not in buf:
            chunk = os.read(fd, 4096) if procfs.wait_readable([fd], silence) else b""
            if not chunk:
                raise HostError("the process did not report ready in time", "see the agent log")
            buf += chunk
        line, buf = buf.split(b"\n", 1)
        try:
            msg = json.loads(line.decode(errors="replace"))
        except ValueError:
            msg = None
        if not isinstance(msg, dict):  # never written so by an agent of this version
            said = printable(line[:200].decode(errors="replace"))
            raise HostError(f"the process's ready message was unreadable: {said}", "see its log")
        if "working" not in msg:
            return msg
        working(msg)
