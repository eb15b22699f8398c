"""The four ways to run the goodput job on a box that gets preempted, and the boxes themselves.

A ``Box`` is one rented machine's life: its own empty directories (``work`` for the job's
cwd and local checkpoints, ``home`` for RGT_HOME) and a tag in the environment of every process
started on it (``GOODPUT_BOX``), by which all of them are found in /proc and killed by PID when
the box goes, whatever their process group or session. What outlives a box is only the setup's
durable directory (``durable/``: the rsync target, or rgt's ``file://`` store).

- ``nohup``: the job under nohup with its own checkpoint every P seconds to local disk,
  started again by hand on the new box (which has no checkpoint: it starts from step 0);
- ``cron``: the same plus an rsync loop every C seconds (what a cron line does) of the
  checkpoint dir to the durable directory, and on the new box an rsync back before the start;
- ``rgt-fixed`` / ``rgt-auto``: ``rgt-agent start`` of a job file with ``checkpoint.interval``
  fixed or ``"auto"``, the store ``file://durable``; a new box's agent restores from it.

A preemption is SIGTERM to the box's front process (the agent; the job and the rsync loop for
the hand-made setups, as a platform's stop signal reaches a container's processes), ``grace``
seconds, then SIGKILL of every process with the box's tag.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
JOB = os.path.join(HERE, "gp_job.py")
TAG = "GOODPUT_BOX"


def tagged(tag: str) -> List[int]:
    """PIDs of the processes whose environment carries ``GOODPUT_BOX=tag``."""
    want = f"{TAG}={tag}".encode()
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if want in f.read().split(b"\0"):
                    out.append(int(name))
        except OSError:
            continue
    return out


def leftovers(root: str, prefix: str) -> List[int]:
    """PIDs of what a harness run left: a tag starting with ``prefix`` in the environment, or
    (an agent, whose title rewrites its environment) a working directory or open file under
    ``root``."""
    want, under, out = f"{TAG}={prefix}".encode(), root.rstrip("/") + "/", []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if any(v.startswith(want) for v in f.read().split(b"\0")):
                    out.append(int(name))
                    continue
            links = [os.readlink(f"/proc/{name}/cwd")]
            for fd in os.listdir(f"/proc/{name}/fd"):
                links.append(os.readlink(f"/proc/{name}/fd/{fd}"))
        except OSError:
            continue
        if any(link.startswith(under) for link in links):
            out.append(int(name))
    return out


def sweep(root: str, prefix: str) -> None:
    """SIGKILL, by PID, everything ``leftovers`` finds, until nothing is left (at most 30 s)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        pids = leftovers(root, prefix)
        if not pids:
            return
        signal_all(pids, signal.SIGKILL)
        time.sleep(0.1)


def signal_all(pids: List[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


class Box:
    """One machine's life: fresh directories, tagged processes."""

    def __init__(self, root: str, tag: str) -> None:
        self.root = root
        self.tag = tag
        self.work = os.path.join(root, "work")
        self.home = os.path.join(root, "home")
        os.makedirs(self.work)
        os.makedirs(self.home)
        self.front: List[int] = []  # the processes the platform's stop signal reaches first
        self.up_at = 0.0  # wall clock when the box came up
        self.restore_s = 0.0  # seconds a hand-made restore (rsync back) took

    def env(self, **extra: str) -> Dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RGT_")}
        env.update({TAG: self.tag, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}, **extra)
        return env

    def spawn(self, argv: List[str], log: str) -> int:
        with open(os.path.join(self.root, log), "ab") as out:
            p = subprocess.Popen(
                argv,
                cwd=self.work,
                env=self.env(),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.front.append(p.pid)
        return p.pid

    def preempt(self, grace: float) -> None:
        """SIGTERM to the front processes, up to ``grace`` seconds for everything tagged to
        go, then SIGKILL of what is left; returns once none is left."""
        signal_all(self.front, signal.SIGTERM)
        end = time.monotonic() + grace
        while time.monotonic() < end and tagged(self.tag):
            time.sleep(0.05)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            pids = tagged(self.tag)
            if not pids:
                break
            signal_all(pids, signal.SIGKILL)
            time.sleep(0.05)
        for pid in self.front:  # reap our own children
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass


class Setup:
    """How one setup starts a box and where its job's output is."""

    name = ""

    def __init__(self, durable: str, steps: int, step_time: float, period: float) -> None:
        self.durable = durable
        self.steps = steps
        self.step_time = step_time
        self.period = period  # the setup's checkpoint period (s): own, cron, or rgt's fixed
        os.makedirs(durable, exist_ok=True)

    def job(self, own_every: float) -> List[str]:
        return [
            sys.executable,
            JOB,
            "--steps",
            str(self.steps),
            "--step-time",
            str(self.step_time),
            "--ckpt-every-s",
            str(own_every),
        ]

    def start(self, box: Box) -> None:
        raise NotImplementedError

    def outputs(self, box: Box) -> List[str]:
        """The job's output files on ``box``, oldest first."""
        return [os.path.join(box.root, "out.log")]


class Reference(Setup):
    """The same job with no preemption and no checkpoint: what the budget can train."""

    name = "preemption-free"

    def start(self, box: Box) -> None:
        box.spawn(self.job(0.0), "out.log")


class Nohup(Setup):
    name = "nohup"

    def __init__(self, durable: str, steps: int, step_time: float, period: float) -> None:
        super().__init__(durable, steps, step_time, period)
        self.own_every = period

    def start(self, box: Box) -> None:
        box.spawn(["nohup", *self.job(self.own_every)], "out.log")


class Cron(Nohup):
    name = "cron+rsync"

    def __init__(self, durable: str, steps: int, step_time: float, period: float, cron: float):
        super().__init__(durable, steps, step_time, period)
        self.cron = cron

    def start(self, box: Box) -> None:
        ckpts = os.path.join(box.work, "checkpoints")
        os.makedirs(ckpts)
        t0 = time.monotonic()
        subprocess.run(["rsync", "-a", f"{self.durable}/", f"{ckpts}/"], check=True)
        box.restore_s = time.monotonic() - t0
        box.spawn(["nohup", *self.job(self.own_every)], "out.log")
        loop = f'while sleep {self.cron}; do rsync -a --delete --delay-updates "$1/" "$2/"; done'
        box.spawn(["nohup", "sh", "-c", loop, "cron", ckpts, self.durable], "cron.log")


class Rgt(Setup):
    """rgt-agent with checkpoint.interval fixed (``period`` > 0) or "auto" (``period`` 0)."""

    def __init__(
        self, durable: str, steps: int, step_time: float, period: float, grace: float, floor: float
    ) -> None:
        super().__init__(durable, steps, step_time, period)
        self.name = "rgt auto" if period <= 0 else f"rgt fixed {period:g}s"
        self.grace = grace
        self.floor = floor

    def job_file(self, box: Box) -> str:
        interval = '"auto"' if self.period <= 0 else f'"{self.period:g}s"'
        path = os.path.join(box.root, "job.toml")
        argv = ", ".join(f'"{a}"' for a in self.job(0.0))
        with open(path, "w") as f:
            f.write(
                f'name = "gp"\ncommand = [{argv}]\nstore = "file://{self.durable}"\n'
                f'grace = {self.grace:g}\n\n[checkpoint]\ntrigger = "file"\n'
                f'interval = {interval}\nkeep = 2\nscan = "1s"\n\n'
                f'[health.stall]\nfloor = "{self.floor:g}s"\n'
            )
        return path

    def start(self, box: Box) -> None:
        exe = os.path.join(os.path.dirname(sys.executable), "rgt-agent")
        env = box.env(RGT_HOME=box.home)
        p = subprocess.run(
            [exe, "start", self.job_file(box)],
            cwd=box.work,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if p.returncode != 0:
            raise RuntimeError(f"rgt-agent start: {p.returncode} {p.stdout} {p.stderr}")
        pid = agent_pid(box.home)
        if pid is not None:
            box.front.append(pid)

    def outputs(self, box: Box) -> List[str]:
        attempts = os.path.join(box.home, "runs", "gp", "attempts")
        names = sorted(os.listdir(attempts)) if os.path.isdir(attempts) else []
        return [os.path.join(attempts, n, "output.log") for n in names]

    def events(self, box: Box) -> str:
        return os.path.join(box.home, "runs", "gp", "events.jsonl")


def agent_pid(home: str) -> Optional[int]:
    """The agent's PID from its lock record (onbox/agent/lock.py writes it)."""
    from onbox.agent.lock import read_holder
    from onbox.common.rundir import RunDir

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        owner = read_holder(RunDir("gp", home).lock)
        if owner and owner.get("pid"):
            return int(owner["pid"])
        time.sleep(0.05)
    return None
