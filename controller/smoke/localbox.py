"""The private box of ``rgt smoke``: a temporary directory holding a copy of the project (what a
release holds), RGT_HOME, a ``file://`` store and the job's TMPDIR, and the real ``rgt-agent
run`` started there as a child process, with the job on the CPU (``CUDA_VISIBLE_DEVICES=""``
unless a GPU is asked for) and ``RGT_SMOKE=1`` in its environment.

The run is read the way ``rgt-agent status`` reads it (onbox.agent.observe, in this process).
Each agent is a ``controller.children.Child`` (a session of its own, out of reach of the
terminal's Ctrl-C, as every child of rgt), entered in ``agents`` before an ask can raise
(``controller.hangup.held``: an ask while it starts would otherwise leave it running, unknown).
The shims and jobs it starts detach into sessions of their own, out of reach of its group, and
name themselves (onbox/agent/title.py: their environment in /proc is then the title's, not
theirs), and a shim outlives its agent; so while the box lives this process is their child
subreaper (Linux: PR_SET_CHILD_SUBREAPER), and each stays below it, in /proc's parent links,
whatever session it is in and whichever parent died. ``close`` stops every process this box
started, by PID: the agents it spawned with their process groups, then every live process
below this one that is the box's (``_below``), every shim and job the runs recorded (by pid and
start time, so a reused pid is never hit) and any process whose environment names this box
(its RGT_HOME, a run under it, its TMPDIR), until none is left.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

from controller import children, hangup
from controller.children import Child
from onbox.agent import observe, procfs
from onbox.agent.lock import read_holder
from onbox.agent.spec import JobSpec
from onbox.common import jsondoc
from onbox.common.rundir import RunDir

# A process SIGKILLed is gone once it leaves the kernel: at once, but one blocked in a system
# call that cannot be cut (an fsync on a busy disk) stays, killed, until it returns: a bound
# in time, not a count of polls, so that a loaded machine has its time.
STOP_WITHIN = 60.0
PR_SET_CHILD_SUBREAPER = 36
# The job's variables of an outer run (rgt smoke inside a job) never leak into the private one.
_KEEP_RGT = ("RGT_PROFILES_DIR", "RGT_MTBF")


def _subreaper(on: bool) -> None:
    """This process the child subreaper (``on``) of its descendants, or no longer; best effort
    (Linux >= 3.4), as onbox/agent/shim.py's."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def agent_command() -> List[str]:
    """``rgt-agent`` of this very installation: the script next to this Python, else the module."""
    script = os.path.join(os.path.dirname(sys.executable), "rgt-agent")
    return [script] if os.path.exists(script) else [sys.executable, "-m", "onbox.cli"]


class LocalBox:
    """The temporary box under ``root`` (made empty by the caller)."""

    def __init__(self, root: str, gpu: bool = False) -> None:
        self.root = root
        self.home = os.path.join(root, "home")
        self.store_root = os.path.join(root, "store")
        os.makedirs(self.home, mode=0o700)
        os.makedirs(self.store_root, mode=0o700)
        env = {k: v for k, v in os.environ.items() if not k.startswith("RGT_") or k in _KEEP_RGT}
        # The job's own temporary files (torch's compile cache) go with the box too.
        self.tmp = os.path.join(root, "tmp")
        os.makedirs(self.tmp, mode=0o700)
        env.update(RGT_HOME=self.home, RGT_SMOKE="1", TMPDIR=self.tmp)
        if not gpu:
            env["CUDA_VISIBLE_DEVICES"] = ""
        self.env = env
        self.agents: Dict[str, Child] = {}
        self.started: List[Child] = []  # every agent, also one a later start replaced
        _subreaper(True)  # (until close)

    @property
    def store_url(self) -> str:
        return "file://" + self.store_root

    def copy_project(self, project: str, files: Sequence[str], dest: str) -> str:
        """The project's release files copied under ``dest`` (links stay links)."""
        for rel in files:
            src, dst = os.path.join(project, rel), os.path.join(dest, rel)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            if os.path.islink(src):
                os.symlink(os.readlink(src), dst)
            else:
                shutil.copy2(src, dst)
        os.makedirs(dest, exist_ok=True)
        return dest

    # ---- the agent
    def start(
        self,
        name: str,
        cwd: str,
        job_file: Optional[str],
        command: Sequence[str],
        ckpt_dir: str,
        grace: str,
        store: bool = True,
    ) -> None:
        """``rgt-agent run`` for ``name`` in ``cwd``, in the background; its own output goes to
        ``agent-NAME.out`` beside the run (the run's agent.log has the details)."""
        argv = [*agent_command(), "run"] + ([job_file] if job_file else [])
        argv += ["--name", name, "--ckpt-dir", ckpt_dir, "--grace", grace]
        if store:
            argv += ["--store", self.store_url]
        if command:
            argv += ["--", *command]
        # Held: a Popen cut by an ask after its fork leaves a process that nothing knows.
        with hangup.held(), open(os.path.join(self.root, f"agent-{name}.out"), "ab") as out:
            p = Child(argv, cwd=cwd, env=self.env, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
            self.started.append(p)
            self.agents[name] = p

    def agent_output(self, name: str) -> str:
        try:
            with open(os.path.join(self.root, f"agent-{name}.out"), "rb") as f:
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def agent_exit(self, name: str) -> Optional[int]:
        """The exit code of ``name``'s agent, None while it runs."""
        p = self.agents.get(name)
        return None if p is None else p.poll()

    def preempt(self, name: str, grace: float) -> Optional[int]:
        """SIGTERM to the agent (a preemption: it asks the job, seals what fits, ends the run
        PREEMPTED), SIGKILL when it is not gone ``grace`` seconds later; its exit code."""
        p = self.agents[name]
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(grace)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        self._kill_recorded(name)
        return p.returncode

    def wipe(self, name: str, *dirs: str) -> None:
        """The box is gone: the run's directory and ``dirs`` (its checkpoints) deleted."""
        for d in (RunDir(name, self.home).path, *dirs):
            shutil.rmtree(d, ignore_errors=True)

    # ---- reading the run
    def rd(self, name: str) -> RunDir:
        return RunDir(name, self.home)

    def status(self, name: str) -> Dict[str, Any]:
        """What ``rgt-agent status NAME --json`` shows; {} before the run exists."""
        rd = self.rd(name)
        if not os.path.isfile(rd.state):
            return {}
        try:
            return observe.run_status(rd)
        except (OSError, ValueError):
            return {}

    def spec(self, name: str) -> Optional[JobSpec]:
        try:
            with open(self.rd(name).spec) as f:
                return JobSpec.from_json(json.load(f))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def events(self, name: str) -> List[Dict[str, Any]]:
        out = []
        try:
            with open(self.rd(name).events) as f:
                for line in f:
                    try:
                        out.append(jsondoc.loads(line))
                    except ValueError:
                        continue  # a line being written
        except OSError:
            pass
        return out

    def log(self, name: str, attempt: Optional[int] = None) -> str:
        """The job's output: of ``attempt``, else of every attempt, oldest first."""
        rd = self.rd(name)
        attempts = [attempt] if attempt else rd.attempt_numbers()
        parts = []
        for a in attempts:
            try:
                with open(rd.output_log(a), "rb") as f:
                    parts.append(f.read().decode("utf-8", "replace"))
            except OSError:
                continue
        return "".join(parts)

    # ---- stopping everything
    def _recorded(self, name: str) -> List[procfs.Identity]:
        """The agent (lock holder), shims and jobs the run ``name`` recorded."""
        rd = self.rd(name)
        found = []
        holder = read_holder(rd.lock) or {}
        if holder.get("pid"):
            found.append(procfs.Identity(int(holder["pid"]), holder.get("start_ticks") or -1))
        for a in rd.attempt_numbers() if os.path.isdir(rd.path) else []:
            try:
                with open(rd.job_record(a)) as f:
                    rec = json.load(f)
                found.append(procfs.Identity(rec["shim"]["pid"], rec["shim"]["start_ticks"]))
                found.append(procfs.Identity(rec["pid"], rec["start_ticks"]))
            except (OSError, ValueError, KeyError, TypeError):
                continue
        return found

    def _ours(self) -> List[int]:
        """Processes whose environment names this box's RGT_HOME, a run under it or its
        TMPDIR."""
        key, tmp = self.home.encode(), self.tmp.encode()
        out = []
        for pid in procfs.pids():
            env = procfs.environ(pid) if pid != os.getpid() else None
            if env and (
                env.get(b"RGT_HOME") == key
                or env.get(b"TMPDIR") == tmp
                or (env.get(b"RGT_RUN_DIR") or b"").startswith(key + b"/")
            ):
                out.append(pid)
        return out

    def _below(self) -> List[int]:
        """Live processes below this one that are the box's: every descendant but those of the
        children that rgt started for something else (controller/children.py; `rgt smoke`
        and `deploy --smoke` start none while the box lives)."""
        others = children.started() - {p.pid for p in self.started}
        kids: Dict[int, List[int]] = {}
        for pid in procfs.pids():
            st = procfs.read_stat(pid)
            if st is not None and st.state not in ("Z", "X"):
                kids.setdefault(st.ppid, []).append(pid)
        found, todo = [], [c for c in kids.get(os.getpid(), []) if c not in others]
        while todo:
            pid = todo.pop()
            found.append(pid)
            todo += kids.get(pid, [])
        return found

    def _reap(self) -> None:
        """Collect the box's processes that ended as this process's children (those it adopted
        as their subreaper), so none stays a zombie; not the ``Child`` ones (their Popen
        does)."""
        for pid in procfs.pids():
            st = procfs.read_stat(pid)
            if st is None or st.ppid != os.getpid() or st.state != "Z":
                continue
            if pid not in children.started():
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass

    def _kill_recorded(self, name: Optional[str] = None) -> None:
        """SIGKILL the processes of run ``name`` (of every run, and every process ``_ours``
        finds, when None) until none is left, at most ``STOP_WITHIN`` seconds."""
        names = [name] if name else list(self.agents)
        deadline = time.monotonic() + STOP_WITHIN
        while time.monotonic() < deadline:
            victims = [i.pid for n in names for i in self._recorded(n) if procfs.is_alive(i)]
            if name is None:
                victims += self._ours() + self._below()
            if not victims:
                return
            for pid in victims:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)

    def close(self) -> None:
        """Stop every process this box started, by PID; wait for the agents it spawned. Held
        (``controller.hangup.held``): a second Ctrl-C or SIGTERM does not cut it."""
        with hangup.held():
            try:
                for p in self.started:
                    p.kill()  # (its process group: SIGKILL)
                for p in self.started:
                    try:
                        subprocess.Popen.wait(p, 10)  # (Child's raises once stop_all killed it)
                    except subprocess.TimeoutExpired:
                        pass
                self._kill_recorded()
                self._reap()
            finally:
                _subreaper(False)
