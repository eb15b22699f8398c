"""`rgt deploy` and `rgt pull` over ssh on loopback, next to plain ``rsync -e ssh`` of the same
files, in the same run.

    .venv/bin/python bench/bench_controller.py [--project-mib 50] [--pull-mib 1024] [--repeats 3]
                                               [--no-drop-caches] [--no-readme]

Set-up (untimed): a test sshd on 127.0.0.1 (tests/sshd.py; stopped by pid at the end) is "the
box": its RGT_HOME (``RGT_BOX_HOME``), the laptop's state (``RGT_CONTROLLER_HOME``: registry,
known_hosts, ssh control sockets) and everything else live in one temporary directory; ssh runs
with ``RGT_SSH_CONFIG=/dev/null`` and the target is the pasted line ``ssh -p PORT -i KEY
USER@127.0.0.1``. The reference commands use the same key, port and ``-F /dev/null``, as a
user's plain ``ssh -e`` would (a new connection per command, no multiplexing). `rgt` runs with
its bytecode cached (``PYTHONPYCACHEPREFIX`` in the temporary directory, written by the untimed
first deploy; ``PYTHONDONTWRITEBYTECODE`` cleared), as it does installed by pip, which compiles
it: without, each command compiles some 60 modules of rgt's again.

1. Deploy of unchanged code. A project of ``--project-mib`` MiB in a git repository (a few
   hundred source, config and text files plus four data files, committed) is deployed once
   with ``rgt deploy TARGET --name N --python PY -- sh -c 'echo started; exec sleep 3600'`` run
   from the project directory (this first deploy installs the agent: untimed), and copied once
   with ``rsync -a --exclude=.git -e 'ssh ...' project/ USER@127.0.0.1:DEST/`` (untimed). Then
   the same two commands take turns ``--repeats`` times: the second and later deploys of
   unchanged code while the run is live (what `rgt deploy` does again: the audit, whose one
   script also finds the release complete on the box and the agent's install in place, so the
   push sends nothing and installs nothing; its script also runs the found agent's
   ``status NAME --json --with-version``, which finds the run live on this very release:
   "nothing to do"), against the rsync no-op (the destination
   is up to date: rsync compares the file list and sends no file). Each rgt deploy's output is
   checked to say that nothing was sent and nothing was to do, and the rsync no-op is checked,
   untimed, to have nothing to send (``--dry-run --itemize-changes`` prints nothing). Judged:
   the medians' ratio, at most 2x.
   For scale, a deploy again of a run that has ended (``sh -c 'echo done'``, no store): nothing
   is sent either, but the agent starts the job again and deploy waits for its first line;
   this is reported next to the same rsync no-op, not judged (the no-op starts nothing).
   The page cache stays warm (the user's project was just read by git and rsync).
2. Where the deploy time goes: the same deploy of the live run, in this process
   (``controller.deploy.flow.deploy``), each step timed by a wrapper that does not change it (what
   it does here first, the steps with a round trip to the box, and their parts), and every ssh
   command it runs counted, timed and filed under the innermost step that ran it
   (``Remote.run``); next to the costs no deploy
   avoids, measured in the same run: Python's start with the `rgt` CLI's imports, a new ssh
   connection (handshake and ``true``), and one command over an open connection (ssh's
   ControlMaster, which rgt uses for every command of a deploy).
3. Pull throughput. A checkpoint of ``--pull-mib`` MiB (four safetensors shards of random
   data, with a valid header, plus a config.json) is sealed by the real
   ``onbox.sealing.sealer.Sealer``
   into a ``file://`` store on the box side, and the run is recorded in the laptop's registry.
   Then, taking turns, each ``--repeats`` times, into a fresh directory: ``rgt pull N --from box
   --to DIR`` (rsync over ssh into temporary names; each file's sha256 against the manifest;
   each safetensors header parsed; fsync; rename; the receipt), plain ``rsync -a -e 'ssh ...'
   USER@127.0.0.1:STORE/N/checkpoints/STEP/ DIR/`` of the same files (no check, no fsync), and,
   for reference, ``rgt pull N --from store`` (the store read directly: it is a path on this
   machine), ``rsync ... && sync`` (plain rsync made durable) and rsync with ssh told to use
   AES-GCM (``-c aes128-gcm@openssh.com``), the cipher rgt's ssh puts first where no
   configuration chooses one (controller/remote.py): so the report shows how much of rgt's
   pull speed is the cipher, next to plain rsync with ssh's default. Before every timed run the
   destination is removed and ``sync`` runs, and as root the page cache is dropped (as
   bench_seal.py does), so each command reads the files from the disk; then the programs
   themselves are read back in (Python with the modules `rgt pull` imports, rsync, ssh: about
   0.1 s for rgt's, which a user's warm laptop does not pay either). Judged: rgt's
   throughput from the box at least 0.8x rsync's (medians).
4. Where the pull time goes: the same pull in this process (``controller.results.pull.pull``), timed
   per phase, with when each file's hash ran (during the transfer, or after it).

Every timed run also records how busy the machine's CPUs were (/proc/stat), since on a 2-core
machine rsync, ssh and sshd over loopback keep both cores busy. A markdown report goes to stdout
and, between the ``bench_controller`` markers, into bench/README.md. Targets are marked
pass/FAIL; the exit code does not depend on them (a benchmark on a shared machine is a report,
not a test). Every process the benchmark starts (sshd, the runs' agents and jobs, ssh control
masters) is stopped by pid at the end, also when it fails.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib
import inspect
import json
import os
import platform
import random
import re
import shlex
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:  # tests/ is not installed: the sshd helper is imported from here
    sys.path.insert(0, ROOT)

from benchlib import (  # noqa: E402
    can_drop_caches,
    commit_of,
    fs_type,
    machine,
    replace_section,
    tool_version,
    verdict,
)

from controller.registry import Registry, RunRecord  # noqa: E402
from controller.remote import SshRemote  # noqa: E402
from controller.results import destination as destinationmod  # noqa: E402
from controller.results import hashing as hashingmod  # noqa: E402
from controller.results import pull as pullmod  # noqa: E402
from controller.results import transport as transportmod  # noqa: E402
from controller.target import Target, ssh_destination_args  # noqa: E402
from onbox.agent import procfs  # noqa: E402
from onbox.sealing.epochs import take_epoch  # noqa: E402
from onbox.sealing.sealer import Sealer  # noqa: E402
from onbox.sealing.stores import open_store  # noqa: E402
from tests.sshd import SshServer, start_sshd  # noqa: E402

README = os.path.join(HERE, "README.md")
BEGIN = "<!-- bench_controller:begin -->"
END = "<!-- bench_controller:end -->"
HEADING = "## bench_controller.py: `rgt deploy` and `rgt pull` next to rsync over ssh"
MiB = 1 << 20

# Targets (from the issue).
DEPLOY_RATIO_MAX = 2.0  # second deploy's time / a bare rsync no-op's
PULL_RATIO_MIN = 0.8  # rgt pull's throughput / rsync's

LIVE = "bench-live"  # the deploy measured: its job runs on
AGAIN = "bench-again"  # a run that ends at once: deployed again after it ended
PULLED = "bench-pull"
LIVE_JOB = ["sh", "-c", "echo started; exec sleep 3600"]
AGAIN_JOB = ["sh", "-c", "echo done"]
SHARDS = 4
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED", "PREEMPTED"}


def say(msg: str) -> None:
    """Progress goes to stderr, so stdout carries only the report."""
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def med(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# ---------------------------------------------------------------- the machine


def cpu_ticks() -> Tuple[int, int]:
    """(busy, total) jiffies of all CPUs, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # guest time is already counted in user
    return total - idle, total


def rgt_exe() -> List[str]:
    """The `rgt` command a user runs: the console script next to this Python."""
    script = os.path.join(os.path.dirname(sys.executable), "rgt")
    return [script] if os.path.exists(script) else [sys.executable, "-m", "controller.cli"]


# ---------------------------------------------------------------- one timed command


@dataclasses.dataclass
class Sample:
    """One timed run of one arm."""

    seconds: float
    busy: float  # the machine's CPUs busy meanwhile, all processes (0..1)
    stderr: str = ""


def timed(argv: List[str], *, cwd: Optional[str] = None, timeout: float = 600) -> Sample:
    b0, t0 = cpu_ticks()
    start = time.monotonic()
    p = subprocess.run(
        argv, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout
    )
    took = time.monotonic() - start
    b1, t1 = cpu_ticks()
    if p.returncode != 0:
        raise RuntimeError(
            f"{' '.join(argv[:3])} ... exited {p.returncode}: {(p.stderr or p.stdout)[-2000:]}"
        )
    return Sample(took, (b1 - b0) / max(1, t1 - t0), p.stderr)


Arm = Tuple[Callable[[], None], Callable[[], Sample]]  # (untimed preparation, the timed run)


def alternate(arms: Dict[str, Arm], repeats: int, what: str) -> Dict[str, List[Sample]]:
    """Every arm once per repeat; the order rotates so that no arm always goes first."""
    names = list(arms)
    out: Dict[str, List[Sample]] = {n: [] for n in names}
    for rep in range(repeats):
        k = rep % len(names)
        for name in names[k:] + names[:k]:
            prepare, run = arms[name]
            prepare()
            s = run()
            out[name].append(s)
            say(f"{what} #{rep + 1} {name}: {s.seconds:.2f} s, CPUs {100 * s.busy:.0f}% busy")
    return out


# ---------------------------------------------------------------- the box


class Box:
    """The loopback box, the laptop's state, and the commands that reach the box."""

    def __init__(self, tmp: str, srv: SshServer, drop_caches: bool) -> None:
        self.tmp = tmp
        self.srv = srv
        self.drop = drop_caches and can_drop_caches()
        self.ctl = self.dir("ctl")
        self.box_home = self.dir("box")
        self.target = f"ssh -p {srv.port} -i {srv.client_key} {srv.user}@{srv.host}"
        self.ssh = [
            "ssh", "-F", "/dev/null", "-p", str(srv.port), "-i", srv.client_key,
            "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
            "-o", f"UserKnownHostsFile={srv.known_hosts}",
            "-o", "StrictHostKeyChecking=accept-new",
        ]  # fmt: skip
        self.login = f"{srv.user}@{srv.host}"

    def dir(self, *parts: str) -> str:
        p = os.path.join(self.tmp, *parts)
        os.makedirs(p, exist_ok=True)
        return p

    def environ(self) -> Dict[str, str]:
        """What every rgt command of the benchmark runs with (this process too)."""
        return {
            "RGT_CONTROLLER_HOME": self.ctl,
            "RGT_BOX_HOME": self.box_home,
            "RGT_SSH_CONFIG": "/dev/null",
            # `rgt` with its bytecode cached, as pip's install leaves it (written by the
            # untimed first deploy), even where PYTHONDONTWRITEBYTECODE is set for this shell
            "PYTHONDONTWRITEBYTECODE": "",
            "PYTHONPYCACHEPREFIX": os.path.join(self.tmp, "pycache"),
        }

    def rsync_e(self) -> str:
        return " ".join(shlex.quote(a) for a in self.ssh)

    def remote(self, path: str) -> str:
        return f"{self.login}:{path}"

    def settle(self) -> None:
        """Flush what earlier runs left dirty, then drop the page cache (as root)."""
        os.sync()
        if self.drop:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")

    def record(self, name: str) -> RunRecord:
        return Registry(self.ctl).get(name)

    def agent(self, name: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """``rgt-agent ARGS`` of the run, on the box (this machine), as the run's record says."""
        return subprocess.run(
            self.record(name).agent_argv(*args),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def state(self, name: str) -> str:
        p = self.agent(name, "status", name, "--json")
        try:
            return str(json.loads(p.stdout).get("state"))
        except ValueError:
            return "?"

    def wait_ended(self, name: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while self.state(name) not in TERMINAL:
            if time.monotonic() > deadline:
                raise RuntimeError(f"run {name} did not end within {timeout:.0f} s")
            time.sleep(0.1)

    def cleanup(self) -> None:
        """Stop the runs through their agents, then kill by pid whatever is left of them and
        every ssh process that names this benchmark's directory (control masters)."""
        for name in (LIVE, AGAIN):
            with contextlib.suppress(Exception):
                self.agent(name, "stop", name, "--grace", "2", timeout=60)
        kill_run_processes(self.box_home)
        key = self.tmp.encode()
        for pid in list(procfs.pids()):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    line = f.read()
            except OSError:
                continue
            if line.startswith(b"ssh\0") and key in line:
                ident = procfs.identity(pid)
                if ident is not None and procfs.is_alive(ident):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)


def kill_run_processes(home: str) -> None:
    """SIGKILL, by pid, every agent (the run's lock holder) and shim (job.json) of the runs
    under ``home``, then every process whose environment names ``home`` (the jobs), until
    none is left (as tests/conftest.py does)."""
    key = home.encode()
    for _ in range(5):
        victims: List[procfs.Identity] = []
        runs = os.path.join(home, "runs")
        for name in os.listdir(runs) if os.path.isdir(runs) else []:
            with contextlib.suppress(OSError, ValueError, KeyError):
                with open(os.path.join(runs, name, "lock")) as f:
                    holder = json.loads(f.read() or "{}")
                if holder.get("pid"):
                    victims.append(procfs.Identity(holder["pid"], holder.get("start_ticks") or -1))
            attempts = os.path.join(runs, name, "attempts")
            for a in os.listdir(attempts) if os.path.isdir(attempts) else []:
                with contextlib.suppress(OSError, ValueError, KeyError):
                    with open(os.path.join(attempts, a, "job.json")) as f:
                        rec = json.load(f)
                    victims.append(procfs.Identity(rec["shim"]["pid"], rec["shim"]["start_ticks"]))
        pids = [v.pid for v in victims if procfs.is_alive(v)]
        for pid in procfs.pids():
            env = procfs.environ(pid) if pid != os.getpid() else None
            if env and (
                env.get(b"RGT_HOME") == key or (env.get(b"RGT_RUN_DIR") or b"").startswith(key)
            ):
                pids.append(pid)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


# ---------------------------------------------------------------- 1, 2: deploy

WORDS = (
    "import", "torch", "numpy", "model", "layer", "loss", "step", "batch", "train", "eval",
    "optimizer", "scheduler", "config", "data", "loader", "tokenizer", "dataset", "checkpoint",
    "gradient", "learning", "rate", "warmup", "epoch",
)  # fmt: skip
SOURCE_KINDS = (".py", ".py", ".py", ".py", ".yaml", ".json", ".md", ".txt", ".cfg", ".sh")
SOURCE_DIRS = (
    "src/model", "src/model/layers", "src/model/heads", "src/data", "src/train", "src/utils",
    "configs", "configs/experiments", "scripts", "tests", "docs",
)  # fmt: skip


def make_project(root: str, total: int, sources: int = 320) -> Tuple[int, int]:
    """A project of about ``total`` bytes, committed to a git repository: ``sources`` text
    files of 0.5-30 kB in a tree of packages, plus four data files (random bytes) that make up
    the rest. Returns (files, bytes)."""
    rng = random.Random(20261130)
    size = 0
    for i in range(sources):
        d = os.path.join(root, SOURCE_DIRS[i % len(SOURCE_DIRS)])
        os.makedirs(d, exist_ok=True)
        want = rng.randint(500, 30000)
        lines: List[str] = []
        n = 0
        while n < want:
            line = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) + "\n"
            lines.append(line)
            n += len(line)
        data = "".join(lines).encode()
        with open(os.path.join(d, f"m{i:03d}{SOURCE_KINDS[i % len(SOURCE_KINDS)]}"), "wb") as f:
            f.write(data)
        size += len(data)
    rest = max(0, total - size)
    os.makedirs(os.path.join(root, "data"), exist_ok=True)
    for i, share in enumerate((0.5, 0.25, 0.15, 0.10)):
        with open(os.path.join(root, "data", f"vocab_{i}.bin"), "wb") as f:
            f.write(os.urandom(int(rest * share)))
        size += int(rest * share)

    def git(*args: str) -> None:
        subprocess.run(
            ["git", "-c", "user.name=bench", "-c", "user.email=bench@localhost", *args],
            cwd=root,
            check=True,
            capture_output=True,
            timeout=120,
        )

    git("init", "-q")
    git("add", "-A")
    git("commit", "-q", "-m", "the project")
    return sources + 4, size


def deploy_argv(box: Box, name: str, job: List[str]) -> List[str]:
    return [
        *rgt_exe(),
        "deploy",
        box.target,
        "--name",
        name,
        "--python",
        sys.executable,
        "--",
        *job,
    ]


def check_deploy_output(s: Sample, again: bool) -> Sample:
    """The premise of the measurement: nothing was sent, and (live) nothing was to do."""
    if "already on the box, nothing sent" not in s.stderr:
        raise RuntimeError(f"this deploy pushed code, so the project changed: {s.stderr[-1500:]}")
    if not again and "nothing to do" not in s.stderr:
        raise RuntimeError(f"this deploy did more than find its run live: {s.stderr[-1500:]}")
    return s


@dataclasses.dataclass
class DeployResults:
    files: int
    size: int
    arms: Dict[str, List[Sample]]
    steps: Steps
    floors: Dict[str, List[float]]


def measure_deploy(box: Box, project_bytes: int, repeats: int) -> DeployResults:
    project = box.dir("project")
    files, size = make_project(project, project_bytes)
    say(f"project: {files} files, {size / MiB:.1f} MiB, committed to git")
    dest = box.dir("rsync-dest")
    say("first deploy (untimed: it installs the agent)")
    first = timed(deploy_argv(box, LIVE, LIVE_JOB), cwd=project, timeout=1800)
    say(f"first deploy took {first.seconds:.1f} s")
    rsync = ["rsync", "-a", "--exclude=.git", "-e", box.rsync_e(), "./", box.remote(dest) + "/"]
    timed(rsync, cwd=project)
    noop = subprocess.run(
        [*rsync[:1], "--dry-run", "--itemize-changes", *rsync[1:]],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if noop.returncode != 0 or noop.stdout.strip():
        raise RuntimeError(f"the rsync reference is not a no-op: {noop.stdout[-1000:]}")
    say("deploying the run that ends at once (untimed)")
    timed(deploy_argv(box, AGAIN, AGAIN_JOB), cwd=project)

    arms: Dict[str, Arm] = {
        "rgt": (
            lambda: None,
            lambda: check_deploy_output(
                timed(deploy_argv(box, LIVE, LIVE_JOB), cwd=project), again=False
            ),
        ),
        "rsync": (lambda: None, lambda: timed(rsync, cwd=project)),
        "rgt, run ended": (
            lambda: box.wait_ended(AGAIN),
            lambda: check_deploy_output(
                timed(deploy_argv(box, AGAIN, AGAIN_JOB), cwd=project), again=True
            ),
        ),
    }
    samples = alternate(arms, repeats, "deploy")
    steps = deploy_steps(box, project, repeats)
    floors = deploy_floors(box, repeats)
    box.agent(LIVE, "stop", LIVE, "--grace", "2")
    box.wait_ended(AGAIN)
    return DeployResults(files, size, samples, steps, floors)


class Steps:
    """Times every call of the wrapped functions (nested calls too) and every ssh command,
    which it files under the innermost step running it."""

    def __init__(self) -> None:
        self.stack: List[str] = []
        self.calls: List[Tuple[str, float]] = []  # (step, seconds), in order
        self.ssh: List[Tuple[str, float, str]] = []  # (step, seconds, command)
        self.runs: List[Dict[str, Any]] = []  # per deploy: totals by step, ssh counts

    def wrap(self, stack: contextlib.ExitStack, obj: Any, attr: str, label: str) -> None:
        orig = getattr(obj, attr, None)
        if orig is None:
            return  # the deploy code changed: that step is not shown
        stack.callback(setattr, obj, attr, inspect.getattr_static(obj, attr))
        steps = self

        def timed_call(*args: Any, **kwargs: Any) -> Any:
            steps.stack.append(label)
            t0 = time.monotonic()
            try:
                return orig(*args, **kwargs)
            finally:
                steps.calls.append((label, time.monotonic() - t0))
                steps.stack.pop()

        setattr(obj, attr, timed_call)

    def wrap_ssh(self, stack: contextlib.ExitStack, cls: Any) -> None:
        orig = cls.run
        steps = self

        def run(remote: Any, argv: Sequence[str], **kwargs: Any) -> Any:
            t0 = time.monotonic()
            try:
                return orig(remote, argv, **kwargs)
            finally:
                where = steps.stack[-1] if steps.stack else "(outside the steps)"
                what = " ".join(argv[:3]).replace("\n", " ")[:60]
                steps.ssh.append((where, time.monotonic() - t0, what))

        stack.callback(setattr, cls, "run", inspect.getattr_static(cls, "run"))
        cls.run = run


# (module, class or "", attribute, label): the deploy's steps as controller/deploy/flow.py calls
# them,
# and (indented) what they call inside. A name the code no longer has is left out of the report.
# The audit's one script also reads the box's Python for the agent, the marker of the agent's
# install and whether the release is complete, and the run's status (with the version) through
# the agent this laptop recorded; the push and the install run commands of their own only when
# the audit found no complete release or no install that answers.
STEP_LABELS = (
    ("controller.deploy.flow", "", "project_files", "list the project's files (git ls-files)"),
    ("controller.deploy.flow", "", "release_id", "hash them into the release id (sha256)"),
    (
        "controller.deploy.flow",
        "",
        "kept_agent_wheel",
        "rgt's wheel (its hash names the agent's install; built again only for other code)",
    ),
    ("controller.deploy.flow", "", "open_remote", "set up the ssh client"),
    (
        "controller.remote",
        "SshRemote",
        "connect_ahead",
        "start opening the connection in the background (ssh -N)",
    ),
    (
        "controller.deploy.audit",
        "",
        "audit",
        "audit (one script: Python, GPU, disk, cgroup, clock; the agent's install, the release)",
    ),
    (
        "controller.remote",
        "SshRemote",
        "ready",
        "  wait for the connection opened in the background (what the hashing left of it)",
    ),
    (
        "controller.deploy.flow",
        "",
        "push_release",
        "push the code (none to push when the audit found the release)",
    ),
    ("controller.deploy.flow", "", "_agent_and_run", "the agent and the run"),
    (
        "controller.deploy.flow",
        "",
        "_look",
        "  the agent's `status NAME --json --with-version`, spec.json (one script)",
    ),
    (
        "controller.deploy.flow",
        "",
        "install_agent",
        "  install the agent (when none found answers --version)",
    ),
    ("controller.deploy.flow", "", "switch_current", "switch the current link (if not there yet)"),
    ("controller.registry", "Registry", "put", "remember the run (the local registry)"),
    ("controller.remote", "SshRemote", "close", "close the ssh connection (ssh -O exit)"),
)


def _resolve(module: str, cls: str) -> Any:
    mod = importlib.import_module(module)
    return getattr(mod, cls) if cls else mod


def deploy_steps(box: Box, project: str, repeats: int) -> Steps:
    """The live run's deploy in this process, ``repeats`` times, every step timed."""
    from controller import remote as remotemod
    from controller.deploy import flow as deploymod
    from controller.deploy.request import DeployRequest

    steps = Steps()
    for rep in range(repeats):
        steps.calls, steps.ssh = [], []
        with contextlib.ExitStack() as stack:
            for module, cls, attr, label in STEP_LABELS:
                steps.wrap(stack, _resolve(module, cls), attr, label)
            steps.wrap_ssh(stack, remotemod.Remote)
            req = DeployRequest(
                target=box.target,
                command=list(LIVE_JOB),
                name=LIVE,
                python=sys.executable,
                project=project,
            )
            lines: List[str] = []
            t0 = time.monotonic()
            deploymod.deploy(req, say=lines.append)
            total = time.monotonic() - t0
        if not any("nothing to do" in x for x in lines):
            raise RuntimeError(f"the in-process deploy did more than find its run live: {lines}")
        by: Dict[str, float] = {}
        for label, sec in steps.calls:
            by[label] = by.get(label, 0.0) + sec
        ssh_n: Dict[str, int] = {}
        ssh_s: Dict[str, float] = {}
        for where, sec, _ in steps.ssh:
            ssh_n[where] = ssh_n.get(where, 0) + 1
            ssh_s[where] = ssh_s.get(where, 0.0) + sec
        steps.runs.append(
            {"total": total, "by": by, "ssh_n": ssh_n, "ssh_s": ssh_s, "ssh": list(steps.ssh)}
        )
        say(f"deploy in-process #{rep + 1}: {total:.2f} s, {len(steps.ssh)} ssh commands")
    return steps


def deploy_floors(box: Box, repeats: int) -> Dict[str, List[float]]:
    """Costs every deploy pays whatever it does: the CLI's start, a new ssh connection, one
    command over an open one."""
    out: Dict[str, List[float]] = {"python": [], "connect": [], "mux": []}
    imports = "import controller.cli, controller.deploy.flow"
    cm = os.path.join(box.dir("cm-floor"), "m")
    master = [*box.ssh, "-o", "ControlMaster=yes", "-o", f"ControlPath={cm}"]
    subprocess.run(
        [*master, "-o", "ControlPersist=120", "-fN", box.login],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=60,
        check=True,
    )
    try:
        for _ in range(repeats):
            out["python"].append(timed([sys.executable, "-c", imports]).seconds)
            out["connect"].append(timed([*box.ssh, box.login, "true"]).seconds)
            mux = [*box.ssh, "-o", f"ControlPath={cm}", box.login, "true"]
            out["mux"].append(timed(mux).seconds)
    finally:
        subprocess.run(
            [*box.ssh, "-o", f"ControlPath={cm}", "-O", "exit", box.login],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=60,
        )
    return out


# ---------------------------------------------------------------- 3, 4: pull


def write_safetensors(path: str, size: int) -> None:
    """A valid safetensors file of about ``size`` bytes: one F32 tensor of random data."""
    n = max(4, (size - 128) // 4 * 4)
    header = json.dumps(
        {
            "__metadata__": {"format": "pt"},
            "w": {"dtype": "F32", "shape": [n // 4], "data_offsets": [0, n]},
        }
    ).encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        left = n
        while left > 0:
            k = min(left, 16 * MiB)
            f.write(os.urandom(k))
            left -= k
        f.flush()
        os.fsync(f.fileno())


@dataclasses.dataclass
class PullResults:
    size: int  # bytes of the sealed checkpoint's files
    files: int
    arms: Dict[str, List[Sample]]
    phases: List[Dict[str, Any]]


def seal_checkpoint(box: Box, total: int) -> Tuple[str, int, int]:
    """Write and seal step 1 of the run; returns (the step's directory in the store, bytes,
    files)."""
    store_root = box.dir("store")
    store = open_store("file://" + store_root)
    ckpt = box.dir("ckpt")
    step = box.dir("ckpt", "step_1")
    for i in range(SHARDS):
        write_safetensors(
            os.path.join(step, f"model-{i + 1:05d}-of-{SHARDS:05d}.safetensors"), total // SHARDS
        )
    with open(os.path.join(step, "config.json"), "w") as f:
        json.dump({"hidden_size": 4096, "num_layers": 32}, f)
    with open(os.path.join(step, ".rgt-complete"), "w") as f:
        json.dump({"step": 1}, f)
    sealer = Sealer(
        PULLED,
        ckpt,
        store,
        box.dir("staging"),
        epoch=take_epoch(store, PULLED),
        event=lambda *a, **k: None,
        state_path=os.path.join(box.tmp, "sealer.json"),
    )
    sealer.load()
    if sealer.seal_pending() != 1:
        raise RuntimeError("the checkpoint was not sealed")
    shutil.rmtree(ckpt)
    srv = box.srv
    Registry(box.ctl).put(
        RunRecord(
            PULLED,
            Target("ssh", host=srv.host, user=srv.user, port=srv.port, identity=srv.client_key),
            store="file://" + store_root,
            box_home=box.box_home,
        )
    )
    where = os.path.join(store_root, PULLED, "checkpoints", "1")
    size = files = 0
    for here, _, names in os.walk(where):
        for n in names:
            size += os.path.getsize(os.path.join(here, n))
            files += 1
    return where, size, files


def warm_programs() -> None:
    """After a page-cache drop, read the programs back in (Python and the modules `rgt pull`
    imports, rsync, ssh), so that the timed runs read only their data from the disk."""
    for argv in (
        [sys.executable, "-c", "import controller.cli, controller.results.pull, rich.progress"],
        ["rsync", "--version"],
        ["ssh", "-V"],
    ):
        subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=60)


def tree_bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(here, n)) for here, _, ns in os.walk(root) for n in ns)


def measure_pull(box: Box, pull_bytes: int, repeats: int) -> PullResults:
    say(f"writing and sealing a {pull_bytes / MiB:.0f} MiB checkpoint")
    where, size, files = seal_checkpoint(box, pull_bytes)
    dest = os.path.join(box.tmp, "pulled")
    rsync = ["rsync", "-a", "-e", box.rsync_e(), box.remote(where) + "/", dest + "/"]
    gcm = f"{box.rsync_e()} -c aes128-gcm@openssh.com"
    rsync_gcm = ["rsync", "-a", "-e", gcm, box.remote(where) + "/", dest + "/"]

    def fresh() -> None:
        shutil.rmtree(dest, ignore_errors=True)
        box.settle()
        warm_programs()

    def rgt_pull(source: str) -> Sample:
        s = timed([*rgt_exe(), "pull", PULLED, "--from", source, "--to", dest])
        if not os.path.exists(os.path.join(dest, ".rgt-receipt.json")):
            raise RuntimeError(f"rgt pull --from {source} wrote no receipt: {s.stderr[-1000:]}")
        return s

    def plain(argv: List[str]) -> Sample:
        s = timed(argv)
        if tree_bytes(dest) != size:
            raise RuntimeError(f"rsync copied {tree_bytes(dest)} bytes, not {size}")
        return s

    arms: Dict[str, Arm] = {
        "rgt --from box": (fresh, lambda: rgt_pull("box")),
        "rsync": (fresh, lambda: plain(rsync)),
        "rgt --from store": (fresh, lambda: rgt_pull("store")),
        "rsync && sync": (
            fresh,
            lambda: plain(["sh", "-c", '"$@" && sync', "sh", *rsync]),
        ),
        "rsync, AES-GCM": (fresh, lambda: plain(rsync_gcm)),
    }
    samples = alternate(arms, repeats, "pull")
    phases = [pull_phases(box, dest, fresh) for _ in range(repeats)]
    shutil.rmtree(dest, ignore_errors=True)
    return PullResults(size, files, samples, phases)


def pull_phases(box: Box, dest: str, fresh: Callable[[], None]) -> Dict[str, Any]:
    """One ``rgt pull --from box`` in this process, its phases timed, and when each file's
    hash (during the transfer, by the pull's checker) ran."""
    fresh()
    marks: Dict[str, Tuple[float, float]] = {}
    hashes: List[Tuple[float, float]] = []
    t0 = time.monotonic()

    def wrap(stack: contextlib.ExitStack, obj: Any, attr: str, label: str) -> None:
        orig = getattr(obj, attr, None)
        if orig is None:
            return
        stack.callback(setattr, obj, attr, inspect.getattr_static(obj, attr))

        def timed_call(*args: Any, **kwargs: Any) -> Any:
            a = time.monotonic()
            try:
                return orig(*args, **kwargs)
            finally:
                if label == "hash":
                    hashes.append((a - t0, time.monotonic() - t0))
                else:
                    marks[label] = (a - t0, time.monotonic() - t0)

        setattr(obj, attr, staticmethod(timed_call) if label == "hash" else timed_call)

    with contextlib.ExitStack() as stack:
        wrap(stack, pullmod, "read_sealed", "read")
        wrap(stack, transportmod, "fetch_rsync", "fetch")  # called inside transport
        wrap(stack, pullmod, "_verify", "verify")
        wrap(stack, pullmod, "_open_all", "open")
        wrap(stack, destinationmod, "place", "place")  # pull.py calls destination.place
        wrap(stack, pullmod, "write_receipt", "receipt")
        checker = getattr(hashingmod, "Checker", None)
        if checker is not None:
            wrap(stack, checker, "_hash", "hash")
        t0 = time.monotonic()
        pullmod.pull(box.record(PULLED), dest, "box")
        total = time.monotonic() - t0
    rsync_end = marks.get("fetch", (0.0, 0.0))[1]  # it returns as soon as rsync has exited
    return {
        "total": total,
        "marks": marks,
        "hashes": len(hashes),
        "hash_s": sum(b - a for a, b in hashes),
        "hash_after_s": sum(max(0.0, b - max(a, rsync_end)) for a, b in hashes),
    }


# ---------------------------------------------------------------- the report


INTRO = """\
`rgt deploy` of unchanged code and `rgt pull` of a sealed checkpoint, each timed as the whole
command a user runs, over ssh to a test sshd on 127.0.0.1 (box and laptop are one machine),
next to plain `rsync -a -e ssh` of the same files in the same run: the arms take turns, the
medians are compared, and each command's output is checked (the deploys sent nothing, the pulls
wrote their receipt, rsync copied every byte). The second deploy is of a run that is still live
(rgt finds its release on the box and the run live on it: nothing to do), against an rsync
no-op (destination up to date); the pull is `--from box` (rsync into temporary names, sha256 of
each file against the manifest, safetensors headers parsed, fsync, rename, receipt) against
`rsync -a` into a fresh directory, the page cache dropped before each (then the programs are
read back in: only the data comes from the disk). In-process runs of the same deploy and pull,
timed step by step, show where the time goes. The module docstring of
bench/bench_controller.py says exactly what is measured. Run it from the repository root, as
root for the page-cache drops (about two minutes; `--no-readme` only prints the report):

    .venv/bin/python bench/bench_controller.py
    .venv/bin/python bench/bench_controller.py --project-mib 5 --pull-mib 64 --repeats 1 \\
        --no-readme
"""


def render(dep: DeployResults, pull: PullResults, meta: str) -> str:
    rows: List[Tuple[str, ...]] = []
    r_noop = med([s.seconds for s in dep.arms["rsync"]])
    d_live = med([s.seconds for s in dep.arms["rgt"]])
    d_again = med([s.seconds for s in dep.arms["rgt, run ended"]])
    proj = f"{dep.size / MiB:.0f} MiB, {dep.files}-file"
    rows.append(
        (
            f"second `rgt deploy` of an unchanged {proj} project, run live: nothing sent, "
            "nothing to do (s)",
            f"{d_live:.2f}",
            f"{r_noop:.2f} (rsync -a no-op)",
            f"{d_live / r_noop:.2f}x",
            f"≤ {DEPLOY_RATIO_MAX:.0f}x",
            verdict(d_live <= DEPLOY_RATIO_MAX * r_noop),
        )
    )
    rows.append(
        (
            "`rgt deploy` again after the run ended: nothing sent, the job started again, "
            "its first line awaited (s)",
            f"{d_again:.2f}",
            f"{r_noop:.2f} (rsync -a no-op)",
            f"{d_again / r_noop:.2f}x",
            "none set",
            "reported",
        )
    )
    gib = pull.size / MiB

    def mbps(arm: str) -> float:
        return pull.size / med([s.seconds for s in pull.arms[arm]]) / 1e6

    ref = mbps("rsync")
    for arm, target, label in (
        ("rgt --from box", PULL_RATIO_MIN, "`rgt pull --from box`: rsync over ssh, verified"),
        ("rgt --from store", None, "`rgt pull --from store` (file:// store read directly)"),
        ("rsync && sync", None, "`rsync -a -e ssh ... && sync` (plain rsync made durable)"),
        ("rsync, AES-GCM", None, "`rsync -a -e 'ssh -c aes128-gcm@openssh.com'` (a tuned ssh)"),
    ):
        ratio = mbps(arm) / ref
        rows.append(
            (
                f"{label}, {gib:.0f} MiB in {pull.files} files (MB/s)",
                f"{mbps(arm):.0f}",
                f"{ref:.0f} (rsync -a -e ssh)",
                f"{ratio:.2f}x",
                f"≥ {target:.1f}x" if target else "none set",
                verdict(ratio >= target) if target else "reported",
            )
        )
    table = (
        "| metric | rgt | reference | ratio rgt/reference | target | verdict |\n"
        "|---|---:|---:|---:|---|---|\n"
        + "".join(f"| {' | '.join(r)} |\n" for r in rows)
        + "\nRatios of time: lower is better for rgt; of throughput: higher is better.\n"
    )

    # Where the deploy time goes.
    runs = dep.steps.runs
    labels = [label for *_, label in STEP_LABELS if any(label in r["by"] for r in runs)]
    seg = [
        "| step of a second deploy (run live), in-process | median s | ssh commands (median s "
        "in them) |\n",
        "|---|---:|---:|\n",
    ]
    for label in labels:
        t = med([r["by"].get(label, 0.0) for r in runs])
        n = med([r["ssh_n"].get(label, 0) for r in runs])
        s = med([r["ssh_s"].get(label, 0.0) for r in runs])
        cell = f"{n:.0f} ({s:.2f})" if n else ""
        name = label.replace("  ", "&nbsp;&nbsp;", 1) if label.startswith("  ") else label
        seg.append(f"| {name} | {t:.3f} | {cell} |\n")
    top = [lab for lab in labels if not lab.startswith("  ")]
    other = med([r["total"] - sum(r["by"].get(lab, 0.0) for lab in top) for r in runs])
    seg.append(f"| everything else (parsing, checks) | {other:.3f} | |\n")
    n_all = med([sum(r["ssh_n"].values()) for r in runs])
    s_all = med([sum(r["ssh_s"].values()) for r in runs])
    seg.append(
        f"| **total, in-process** | **{med([r['total'] for r in runs]):.3f}** | "
        f"**{n_all:.0f} ({s_all:.2f})** |\n"
    )
    f = dep.floors
    floors = (
        f"- Python's start with the imports of `rgt deploy` (`python -c 'import controller.cli, "
        f"controller.deploy.flow'`): {med(f['python']):.2f} s; the whole `rgt deploy` command "
        f"(median {d_live:.2f} s) is this plus the in-process total above;\n"
        f"- a new ssh connection (handshake, authentication, `true`), what rsync pays once and "
        f"a deploy pays once, opening it in the background while it hashes the project: "
        f"{med(f['connect']):.2f} s;\n"
        f"- one more command over an open connection (ControlMaster, as rgt runs every command "
        f"after the first): {med(f['mux']):.3f} s; the second deploy runs {n_all:.0f} ssh "
        "commands, one after the other.\n"
    )
    first_ssh = runs[0]["ssh"] if runs else []
    ssh_list = "".join(
        f"{i + 1}. {where.strip()}: `{what}` {sec:.3f} s\n"
        for i, (where, sec, what) in enumerate(first_ssh)
    )

    # Where the pull time goes.
    ph = pull.phases

    def phase(label: str) -> float:
        return med([p["marks"][label][1] - p["marks"][label][0] for p in ph if label in p["marks"]])

    def after_fetch() -> float:
        return med([p["total"] - p["marks"]["fetch"][1] for p in ph if "fetch" in p["marks"]])

    pull_seg = (
        "| phase of `rgt pull --from box`, in-process | median s |\n|---|---:|\n"
        f"| read the sealed state (LATEST, MANIFEST: one ssh command, which opens the "
        f"connection) | {phase('read'):.2f} |\n"
        f"| rsync of every file into temporary names (the checker hashes and fsyncs each "
        f"finished file meanwhile) | {phase('fetch'):.2f} |\n"
        f"| after rsync: verify (wait for the last hashes, hash what was not) | "
        f"{phase('verify'):.2f} |\n"
        f"| open each file as its framework would (safetensors headers) | {phase('open'):.3f} |\n"
        f"| fsync what is not yet, rename into place, fsync directories | {phase('place'):.3f} |\n"
        f"| the receipt | {phase('receipt'):.3f} |\n"
        f"| **everything after rsync** | **{after_fetch():.2f}** |\n"
        f"| **total, in-process** | **{med([p['total'] for p in ph]):.2f}** |\n\n"
        "The pull's checker hashes (and fsyncs) each file once rsync has logged the next one, "
        "or has exited; of the time it spent on that, the part after rsync exited, per run: "
        + ", ".join(f"{p['hash_after_s']:.2f} of {p['hash_s']:.2f} s" for p in ph)
        + f" ({ph[0]['hashes'] if ph else 0} files).\n"
    )
    busy = "; ".join(
        f"{arm}: {100 * med([s.busy for s in ss]):.0f}%"
        for arms in (dep.arms, pull.arms)
        for arm, ss in arms.items()
    )
    samples = [
        f"- {what} {arm}: " + ", ".join(f"{s.seconds:.2f}" for s in ss)
        for what, arms in (("deploy", dep.arms), ("pull", pull.arms))
        for arm, ss in arms.items()
    ]
    return (
        INTRO
        + "\n"
        + meta
        + "\n"
        + table
        + "\nWhere a second deploy's time goes (the medians need not add up to the total):\n\n"
        + "".join(seg)
        + "\nFor scale, measured in the same run:\n\n"
        + floors
        + "\nThe ssh commands of the first in-process deploy, in order:\n\n"
        + ssh_list
        + "\nWhere the pull's time goes:\n\n"
        + pull_seg
        + "\nThe machine's CPUs busy during the timed runs (median, all processes): "
        + busy
        + ".\n\nEvery timed run (s), in order:\n\n"
        + "\n".join(samples)
        + "\n"
    )


def update_readme(path: str, body: str) -> None:
    """Replace what lies between the markers; append a heading and the section if missing."""
    block = f"{BEGIN}\n{body}{END}"
    with open(path) as f:
        text = f.read()
    new = replace_section(text, BEGIN, END, block)
    text = new if new is not None else text.rstrip("\n") + f"\n\n{HEADING}\n\n{block}\n"
    with open(path, "w") as f:
        f.write(text)


def ssh_cipher(box: Box, argv: Optional[List[str]] = None) -> str:
    """The cipher an ssh command (``argv``, ending in the box's address; plain ``ssh`` with the
    benchmark's options by default) negotiates with the box."""
    p = subprocess.run(
        [*(argv or [*box.ssh, "-v", box.login]), "true"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    m = re.search(r"server->client cipher: (\S+)", p.stderr)
    return m.group(1) if m else "unknown"


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def environ(env: Dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    os.environ.pop("RGT_HOME", None)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--project-mib", type=float, default=50, help="the project (default 50)")
    ap.add_argument("--pull-mib", type=int, default=1024, help="the checkpoint (default 1024)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per arm (default 3)")
    ap.add_argument("--no-drop-caches", action="store_true", help="keep the page cache warm")
    ap.add_argument("--workdir", default=None, help="where the temporary directory goes")
    ap.add_argument("--readme", default=README, help="README to update (default bench/README.md)")
    ap.add_argument("--no-readme", action="store_true", help="only print the report")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = ap.parse_args(argv)
    if args.project_mib < 1 or args.pull_mib < SHARDS or args.repeats < 1:
        ap.error(f"need --project-mib >= 1, --pull-mib >= {SHARDS}, --repeats >= 1")
    for tool in ("rsync", "git", "ssh"):
        if shutil.which(tool) is None:
            ap.error(f"needs {tool} on PATH")

    signal.signal(signal.SIGTERM, _terminate)
    started = datetime.datetime.now(datetime.timezone.utc)
    code = commit_of("controller")
    with contextlib.ExitStack() as stack:
        tmp = tempfile.mkdtemp(prefix="bench-ctl-", dir=args.workdir)
        if args.keep:
            say(f"keeping {tmp}")
        else:
            stack.callback(shutil.rmtree, tmp, ignore_errors=True)  # runs last: LIFO
        srv = start_sshd(os.path.join(tmp, "sshd"))
        stack.callback(srv.stop)  # by pid
        say(f"sshd pid {srv.pid} on {srv.host}:{srv.port}")
        box = Box(tmp, srv, not args.no_drop_caches)
        stack.callback(box.cleanup)
        stack.enter_context(environ(box.environ()))
        say(f"page cache {'dropped' if box.drop else 'warm (cannot drop it)'} before each pull")
        cipher = ssh_cipher(box)
        srv_t = Target("ssh", host=srv.host, user=srv.user, port=srv.port, identity=srv.client_key)
        ours = SshRemote(srv_t)
        # rgt's own options, on a connection of its own (ssh takes an option's first value).
        own = ["-v", "-o", "ControlMaster=no", "-o", "ControlPath=none"]
        rgt_cipher = ssh_cipher(
            box, ["ssh", *ours.config_args, *own, *ours.options, *ssh_destination_args(srv_t)]
        )
        dep = measure_deploy(box, int(args.project_mib * MiB), args.repeats)
        pull = measure_pull(box, args.pull_mib * MiB, args.repeats)
        versions = [
            f"Python {platform.python_version()}",
            tool_version(["rsync", "--version"]).replace("  ", " "),
            tool_version(["ssh", "-V"])
            + f" (cipher {cipher}, ssh's default here and plain rsync's; rgt's ssh: {rgt_cipher})",
            tool_version(["git", "--version"]),
        ]
        meta = (
            f"Measured {started.strftime('%Y-%m-%d %H:%M UTC')}; machine: {machine()}; "
            f"{', '.join(versions)}; box and laptop are this machine (sshd on 127.0.0.1), files "
            f"on {fs_type(tmp)}, one disk; page cache "
            f"{'dropped before every timed pull' if box.drop else 'warm (not root)'}, warm for "
            f"the deploys; rgt's bytecode cached (as pip installs it); medians of "
            f"{args.repeats} runs per arm; controller at {code}.\n"
        )
        body = render(dep, pull, meta)
    print(body)
    if not args.no_readme:
        update_readme(args.readme, body)
        say(f"wrote {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
