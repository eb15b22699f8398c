"""Boxes, stores and faults for the chaos suite: real agents, real stores, real signals.

A ``Box`` is one rented machine as rgt sees it: an RGT_HOME and a checkpoint dir of its own,
``rgt-agent`` run as real processes, and the bounded job ``tests/chaos/job.py``. Two boxes on
one run and one store are a preempted box and its replacement. The shim never starts an agent
again by itself here (RGT_AGENT_RESPAWN_DELAY is large): a test restarts an agent it killed by
hand, with the environment it chooses (without the crash point that killed the last one).

``Backend`` is a store under test: its URL, the environment that reaches it, and a raw
``StoreView`` of it (tests/chaos/invariants.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, Callable, Dict, Iterator, List, Optional

from tests.chaos.invariants import Checker, StoreView
from tests.conftest import Cli, _kill_run_processes, require

JOB = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "job.py")]
# Keys the agent rewrites on its own while it lives (mirrors, epochs): not a checkpoint's upload.
_HOUSEKEEPING = ("state/", "epochs/", "logs/", ".rgt-preflight")


def wait(pred: Callable[[], Any], timeout: float = 30, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.05)


@contextlib.contextmanager
def tmpfs(path: str, opts: str) -> Iterator[str]:
    """A small tmpfs mounted at ``path`` (as root) for the block; unmounted in ``finally``.
    Without root it skips (fails under CI=true)."""
    os.makedirs(path, exist_ok=True)
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", path], capture_output=True)
    require(p.returncode == 0, f"root, to mount a small tmpfs ({p.stderr.decode().strip()})")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], capture_output=True)


def remount(path: str, opts: str) -> None:
    """Grow a tmpfs in place (the operator freed space)."""
    subprocess.run(["mount", "-o", f"remount,{opts}", path], check=True, capture_output=True)


class Backend:
    """A store under test."""

    def __init__(self, kind: str, url: str, env: Dict[str, str], view: StoreView) -> None:
        self.kind = kind
        self.url = url
        self.env = env
        self.view = view

    def checker(self, run: str) -> Checker:
        return Checker(self.view, run)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (FileNotFoundError, IndexError):
        return False


def freeze(pid: int) -> None:
    """SIGSTOP, and wait until the kernel says it is stopped."""
    os.kill(pid, signal.SIGSTOP)

    def stopped() -> bool:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")

    wait(stopped, 5, f"pid {pid} to stop")


def thaw(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


class Box:
    """One box: its own RGT_HOME and checkpoint dir, real agents."""

    def __init__(self, base: str, label: str, env: Dict[str, str]) -> None:
        self.label = label
        self.dir = os.path.join(base, label)
        self.home = os.path.join(self.dir, "home")
        self.ckpt = os.path.join(self.dir, "ckpt")
        self.gate = os.path.join(self.dir, "gate")
        for d in (self.home, self.gate):
            os.makedirs(d, exist_ok=True)
        env = dict(env)
        env.pop("RGT_ATTEMPT_TAG", None)
        env.pop("RGT_CRASH_AT", None)
        env["RGT_HOME"] = self.home
        env["RGT_AGENT_RESPAWN_DELAY"] = "1000"  # agents are restarted by the test, by hand
        self.env = env
        self.cli = Cli(self.home, env)

    def _cli(self, extra: Optional[Dict[str, str]]) -> Cli:
        return Cli(self.home, {**self.env, **(extra or {})})

    def start(
        self,
        run: str,
        store: str,
        job: List[str],
        *,
        keep: int = 3,
        ckpt_dir: Optional[str] = None,
        env: Optional[Dict[str, str]] = None,
        outputs: Optional[List[str]] = None,
        check: bool = True,
        start_grace: Optional[str] = None,
    ) -> subprocess.CompletedProcess[str]:
        """``rgt-agent start`` of ``job.py JOB...`` on this box (``env``: the agent's extra;
        ``start_grace``: the job file's, for a test that waits for RUNNING)."""
        path = os.path.join(self.dir, f"{run}.toml")
        with open(path, "w") as f:
            f.write(
                f"command = {json.dumps([*JOB, *job])}\n"
                f"store = {json.dumps(store)}\n"
                + (f"outputs = {json.dumps(outputs)}\n" if outputs else "")
                + "[checkpoint]\n"
                f'dir = {json.dumps(ckpt_dir or self.ckpt)}\nkeep = {keep}\nscan = "1s"\n'
                "[restart]\nmax_error_restarts = 0\n"
                + (f"start_grace = {json.dumps(start_grace)}\n" if start_grace else "")
            )
        return self._cli(env)("start", path, "--name", run, check=check, cwd=self.dir)

    def restart(
        self, run: str, env: Optional[Dict[str, str]] = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """``rgt-agent start --name RUN``: a new agent adopts or begins the run."""
        return self._cli(env)("start", "--name", run, check=check, cwd=self.dir)

    def secrets(self, run: str, values: Dict[str, str]) -> None:
        """``rgt-agent secrets RUN`` with a JSON object on stdin, as `rgt deploy` passes them."""
        from tests.conftest import agent_exe

        p = subprocess.run(
            [*agent_exe(), "secrets", run],
            input=json.dumps(values),
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert p.returncode == 0, f"rgt-agent secrets -> {p.returncode}: {p.stderr}"

    def open_gate(self, step: int) -> None:
        with open(os.path.join(self.gate, str(step)), "w"):
            pass

    def _run(self, run: str, name: str) -> str:
        return os.path.join(self.home, "runs", run, name)

    def agent_pid(self, run: str) -> Optional[int]:
        """The pid of the run's lock holder, when it is alive."""
        try:
            with open(self._run(run, "lock")) as f:
                rec = json.loads(f.read() or "{}")
        except (OSError, ValueError):
            return None
        pid = rec.get("pid")
        return pid if isinstance(pid, int) and alive(pid) else None

    def wait_agent(self, run: str, timeout: float = 30) -> int:
        pid: int = wait(lambda: self.agent_pid(run), timeout, f"{self.label}'s agent of {run}")
        return pid

    def state(self, run: str) -> Optional[str]:
        try:
            with open(self._run(run, "state.json")) as f:
                st: Optional[str] = json.load(f).get("state")
                return st
        except (OSError, ValueError):
            return None

    def events(self, run: str) -> List[Dict[str, Any]]:
        try:
            with open(self._run(run, "events.jsonl")) as f:
                return [json.loads(line) for line in f if line.strip()]
        except FileNotFoundError:
            return []

    def kinds(self, run: str) -> List[str]:
        return [e["kind"] for e in self.events(run)]

    def epoch(self, run: str) -> int:
        """The epoch this box's newest agent took (its ``epoch`` event)."""
        got = [e["epoch"] for e in self.events(run) if e["kind"] == "epoch"]
        assert got, f"{self.label} took no epoch for {run}: {self.kinds(run)}"
        return int(got[-1])

    def epochs(self, run: str) -> List[int]:
        """Every epoch this box's agents of ``run`` took."""
        return [int(e["epoch"]) for e in self.events(run) if e["kind"] == "epoch"]

    def wait_epoch(self, run: str, n: int = 1, timeout: float = 30) -> int:
        wait(
            lambda: len([k for k in self.kinds(run) if k == "epoch"]) >= n,
            timeout,
            f"{self.label}'s agent #{n} of {run} to take an epoch",
        )
        return self.epoch(run)

    def log(self, run: str) -> str:
        out = []
        attempts = self._run(run, "attempts")
        for a in sorted(os.listdir(attempts)) if os.path.isdir(attempts) else []:
            try:
                with open(os.path.join(attempts, a, "output.log"), errors="replace") as f:
                    out.append(f.read())
            except FileNotFoundError:
                continue
        return "".join(out)

    def agent_log(self, run: str) -> str:
        try:
            with open(self._run(run, "agent.log"), errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def wrote(self, run: str) -> Dict[str, str]:
        """The sha256 the job printed for each file it wrote, the last one per name."""
        out = {}
        for line in self.log(run).splitlines():
            parts = line.split()
            if len(parts) == 4 and parts[0] == "wrote" and parts[2] == "sha256":
                out[parts[1]] = parts[3]
        return out

    def kill_agent(self, run: str) -> None:
        """SIGKILL the run's agent (the job and its shim live on, as after a crash)."""
        pid = self.agent_pid(run)
        if pid is not None:
            os.kill(pid, signal.SIGKILL)

    def stop(self, run: str) -> None:
        self.cli("stop", run, "--grace", "0", timeout=60)

    def kill_all(self) -> None:
        """SIGKILL every process of this box, by PID (frozen ones too)."""
        _kill_run_processes(self.home)

    def diagnose(self, run: str) -> str:
        return (
            f"--- {self.label} events: {[(e['kind'], e.get('reason')) for e in self.events(run)]}"
            f"\n--- {self.label} agent.log tail:\n{self.agent_log(run)[-2000:]}"
        )


def upload_started(view: StoreView, run: str, before: Dict[str, int]) -> bool:
    """Whether an upload of a checkpoint has begun since ``before`` (view.objects of the run):
    a new object or a temporary upload outside the agent's housekeeping."""

    def mine(key: str) -> bool:
        rest = key[len(run) + 1 :]
        return not rest.startswith(_HOUSEKEEPING) and rest != "LATEST.json"

    if any(mine(k) for k in view.temps(f"{run}/")):
        return True
    now = view.objects(f"{run}/")
    return any(mine(k) and before.get(k) != size for k, size in now.items())


def freeze_mid_upload(box: Box, run: str, view: StoreView, step: int, timeout: float = 60) -> int:
    """Open the gate of ``step`` on ``box`` and SIGSTOP its agent as soon as the checkpoint's
    upload has begun and before its MANIFEST is written. Returns the frozen agent's pid."""
    pid = box.wait_agent(run)
    before = view.objects(f"{run}/")
    box.open_gate(step)
    deadline = time.monotonic() + timeout
    while not upload_started(view, run, before):
        assert time.monotonic() < deadline, (
            f"timed out waiting for {box.label}'s upload of step {step}\n{box.diagnose(run)}"
        )
        time.sleep(0.002)
    freeze(pid)
    manifest = f"{run}/checkpoints/{step}/MANIFEST.json"
    assert view.read(manifest) is None, (
        f"scenario precondition: {box.label}'s agent was to be frozen mid-upload of step {step}, "
        f"but its MANIFEST is written already"
    )
    return pid
