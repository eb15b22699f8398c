"""Shared test fixtures: an isolated RGT_HOME, the CLI as a real subprocess, and cleanup.

Every process a test starts is stopped by PID at the end (``procs`` and the run sweep below).
Under CI=true a test that would skip because a real service is missing fails instead.

A controller home in a test's directory is too long a path for ssh's control sockets, so rgt
keeps them in a private directory under /tmp that it records in the home (``cm-dir``,
controller/controldir.py): a user's home reuses its one, but each test's home is new, and the
suite left one behind for each (``no_control_dir_left``).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from typing import Any, Callable, Dict, Iterator, List, Optional

import pytest

from onbox.agent import observe, procfs
from onbox.common.rundir import RunDir
from tests.sshd import ssh_naming

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
# The opt-in tier (a real Hub token, a GPU, a cloud account) is not even collected unless asked
# for: RGT_HF_TESTS=1 (with HF_TOKEN) or RGT_SKYPILOT_TESTS=1 (SkyPilot's parser) runs tests/optin.
_OPTIN = ("RGT_HF_TESTS", "RGT_SKYPILOT_TESTS")
collect_ignore = [] if any(os.environ.get(v) for v in _OPTIN) else ["optin"]
# RGT_TEST_CPU=FILE: each test's CPU, its daemons' included, to FILE (tests/cpuacct.py).
pytest_plugins = ["tests.cpuacct"] if os.environ.get("RGT_TEST_CPU") else []
# One intra-op thread for every training job the tests start (they inherit the environment):
# the suite runs several jobs at once on two cores, where a second OpenMP thread per job only
# spins. Results do not depend on it: each test compares runs made under the same setting.
os.environ.setdefault("OMP_NUM_THREADS", "1")


# The longest test files, longest first (from a run of the suite on this machine: its junit times
# summed per file). With pytest-xdist's --dist loadfile each file runs whole on one worker,
# handed out in collection order: started first, the long files run beside the many short ones
# instead of after them.
LONGEST_FIRST = (
    # One unit (ONE_WORKER below): the Slurm files, about 7 minutes together.
    "integration/test_slurm_requeue.py",
    "integration/test_slurm_deploy.py",
    "integration/test_exact_frameworks.py",
    "chaos/test_two_writers.py",
    "integration/test_smoke.py",
    "integration/test_left_release.py",
    "integration/test_deploy.py",
    "integration/test_meter_stop.py",
    "integration/test_deploy_again.py",
    "integration/test_sweep.py",
    "integration/test_install.py",
    "integration/test_distributed_exits.py",
    "integration/test_refused_secrets.py",
    "integration/test_goodput_short.py",
    "integration/test_agent_lifecycle.py",
    "integration/test_restore_fallback.py",
    "integration/test_rank_verify.py",
    "integration/test_pull.py",
    "integration/test_preempted_logs.py",
    "integration/test_hostile_box.py",
    "integration/test_down.py",
    "integration/test_walk.py",
    "integration/test_sealing.py",
    "integration/test_train_faults.py",
    "integration/test_sweep_parallel.py",
    "integration/test_sweep_unread.py",
    "integration/test_pulled_results.py",
    "integration/test_upload_stall.py",
    "integration/test_ckpt_dir_links.py",
    "integration/test_sealing_s3.py",
    "integration/test_release_holds.py",
    "integration/test_letgo_hung_store.py",
)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    rank = {os.path.join(ROOT, "tests", f): i for i, f in enumerate(LONGEST_FIRST)}
    # sorted() is stable: every other file keeps its place, after the long ones.
    items[:] = sorted(items, key=lambda it: rank.get(str(it.path), len(rank)))


# Files that share a real service which must start once per test session, not once per worker
# (xdist's session fixtures are per worker): one work unit, run by one worker.
ONE_WORKER = {
    "tests/integration/test_slurm_deploy.py": "tests/integration/test_slurm_*.py",
    "tests/integration/test_slurm_requeue.py": "tests/integration/test_slurm_*.py",
}

try:
    from xdist.scheduler import LoadFileScheduling  # type: ignore[import-untyped]
except ImportError:  # the 3.9 stage has no xdist; it runs in one process anyway
    pass
else:

    class _LoadFileSharing(LoadFileScheduling):  # type: ignore[misc]
        """--dist loadfile, with the ONE_WORKER files in one unit."""

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return ONE_WORKER.get(path, path)

    def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
        if config.getvalue("dist") == "loadfile":
            return _LoadFileSharing(config, log)
        return None


def require(ok: bool, what: str) -> None:
    """Skip when a real service is missing, except in CI where that is a failure."""
    if ok:
        return
    if IN_CI:
        pytest.fail(f"CI needs {what}, and it is missing")
    pytest.skip(f"needs {what}")


def agent_exe() -> List[str]:
    """The rgt-agent command: the installed script next to this Python."""
    script = os.path.join(os.path.dirname(sys.executable), "rgt-agent")
    if os.path.exists(script):
        return [script]
    return [sys.executable, "-m", "onbox.cli"]


def fixture(name: str) -> List[str]:
    """argv of a misbehaving fixture program in tests/fixtures."""
    return [sys.executable, os.path.join(FIXTURES, name)]


class Cli:
    """Runs ``rgt-agent`` as a real process with an isolated RGT_HOME."""

    def __init__(self, home: str, env: Dict[str, str]) -> None:
        self.home = home
        self.env = env

    def __call__(
        self, *args: str, timeout: float = 60, check: bool = False, cwd: Optional[str] = None
    ) -> subprocess.CompletedProcess[str]:
        p = subprocess.run(
            [*agent_exe(), *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=cwd or self.home,
        )
        if check and p.returncode != 0:
            raise AssertionError(f"rgt-agent {args} -> {p.returncode}\n{p.stdout}\n{p.stderr}")
        return p

    def status(self, name: str) -> Dict[str, Any]:
        p = self("status", name, "--json", check=True)
        out: Dict[str, Any] = json.loads(p.stdout)
        return out

    def events(self, name: str) -> List[Dict[str, Any]]:
        path = os.path.join(self.home, "runs", name, "events.jsonl")
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]

    def wait_for(
        self,
        name: str,
        pred: Callable[[Dict[str, Any]], bool],
        timeout: float = 30,
        what: str = "condition",
    ) -> Dict[str, Any]:
        """The first status of ``name`` for which ``pred`` holds.

        Polled in this process with the code `rgt-agent status --json` runs (the same files,
        the same document), not by starting the CLI each time: a CLI start costs half a
        second of CPU, and polling it back to back took a core from the agent and job waited
        on. Tests of the CLI's own output call ``status`` or the CLI itself."""
        deadline = time.monotonic() + timeout
        st: Dict[str, Any] = {}
        while time.monotonic() < deadline:
            st = self.peek(name)
            if st and pred(st):
                return st
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}; last status: {st}")

    def peek(self, name: str) -> Dict[str, Any]:
        """What `rgt-agent status NAME --json` prints, read in this process; {} before the run
        directory exists."""
        rd = RunDir(name, self.home)
        if not os.path.isdir(rd.path):
            return {}
        try:
            doc: Dict[str, Any] = json.loads(json.dumps(observe.run_status(rd), sort_keys=True))
        except (OSError, ValueError):  # where the CLI would have failed: poll again
            return {}
        agent = doc.get("agent") or {}
        if agent.get("alive") and agent.get("pid") is None:
            return {}  # the lock is taken but its holder's record not yet written: read again
        return doc

    def log_text(self, name: str) -> str:
        """What `rgt-agent logs NAME` prints (every attempt's output, oldest first), read in
        this process for the same reason as ``peek``: for loops that poll the job's output."""
        buf = io.BytesIO()
        rd = RunDir(name, self.home)
        if os.path.isdir(rd.path):
            observe.copy_logs(rd, buf)
        return buf.getvalue().decode("utf-8", "replace")

    def wait_output(self, name: str, text: str, timeout: float = 60) -> str:
        """The job's output once it holds ``text``: e.g. a fixture's "ready", printed once its
        signal handlers are in place (a signal before that kills it, by default action)."""
        deadline = time.monotonic() + timeout
        while True:
            out = self.log_text(name)
            if text in out:
                return out
            if time.monotonic() > deadline:
                raise AssertionError(f"{text!r} not in {name}'s output: {out[-2000:]!r}")
            time.sleep(0.1)

    def wait_state(self, name: str, *states: str, timeout: float = 30) -> Dict[str, Any]:
        return self.wait_for(name, lambda s: s["state"] in states, timeout, f"state {states}")

    def wait_over(self, name: str, *states: str, timeout: float = 60) -> Dict[str, Any]:
        """One of ``states`` and its agent gone: the agent writes the final state before it
        has finished (its last seal and mirror), and a start meanwhile is refused (exit 5)."""
        return self.wait_for(
            name,
            lambda s: s["state"] in states and not s["agent"]["alive"],
            timeout,
            f"state {states} with the agent gone",
        )


def _recorded_processes(home: str) -> List[procfs.Identity]:
    """Agents (lock holders) and shims (job.json) of every run under ``home``: found by their
    records, since setproctitle blanks their /proc/PID/environ."""
    found = []
    runs = os.path.join(home, "runs")
    for name in os.listdir(runs) if os.path.isdir(runs) else []:
        run = os.path.join(runs, name)
        try:
            with open(os.path.join(run, "lock")) as f:
                holder = json.loads(f.read() or "{}")
            if holder.get("pid"):
                found.append(procfs.Identity(holder["pid"], holder.get("start_ticks") or -1))
        except (OSError, ValueError):
            pass
        attempts = os.path.join(run, "attempts")
        for a in os.listdir(attempts) if os.path.isdir(attempts) else []:
            try:
                with open(os.path.join(attempts, a, "job.json")) as f:
                    rec = json.load(f)
                found.append(procfs.Identity(rec["shim"]["pid"], rec["shim"]["start_ticks"]))
            except (OSError, ValueError, KeyError):
                pass
    return found


def _kill_run_processes(home: str) -> None:
    """SIGKILL, by PID, every agent and shim of the runs under ``home`` (first, so that nothing
    restarts a job), then every process whose environment names ``home``; until none is left."""
    key = home.encode()
    for _ in range(5):
        victims = [i.pid for i in _recorded_processes(home) if procfs.is_alive(i)]
        for pid in procfs.pids():
            env = procfs.environ(pid) if pid != os.getpid() else None
            if env and (
                env.get(b"RGT_HOME") == key or (env.get(b"RGT_RUN_DIR") or b"").startswith(key)
            ):
                victims.append(pid)
        if not victims:
            return
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


@pytest.fixture
def rgt_home(tmp_path: Any) -> Iterator[str]:
    home = str(tmp_path / "rgt-home")
    os.makedirs(home)
    yield home
    _kill_run_processes(home)


@pytest.fixture
def cli(rgt_home: str) -> Cli:
    env = dict(os.environ)
    env["RGT_HOME"] = rgt_home
    env.pop("RGT_ATTEMPT_TAG", None)
    env["RGT_AGENT_RESPAWN_DELAY"] = "1"
    return Cli(rgt_home, env)


@pytest.fixture
def controller_env(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Dict[str, str]:
    """The laptop's state in the test's own directory, and ssh without the user's config."""
    env = {"RGT_CONTROLLER_HOME": str(tmp_path / "controller"), "RGT_SSH_CONFIG": "/dev/null"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


@pytest.fixture
def laptop(controller_env: Dict[str, str]) -> str:
    """The laptop's state dir (receipts, records), for tests that pass it as ``home``."""
    return controller_env["RGT_CONTROLLER_HOME"]


@pytest.fixture(autouse=True, scope="module")
def no_control_dir_left(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """At the end of each test module, the ssh control directory recorded in each controller
    home made in the directories its tests and fixtures made (``tmp_path``, ``mktemp``) is
    removed, its masters stopped first (``drop_control_dir``). Module-scoped and used first,
    it ends after every fixture of the module, theirs that close connections included."""
    base = str(tmp_path_factory.getbasetemp())
    before = set(os.listdir(base))
    yield
    for name in sorted(set(os.listdir(base)) - before):
        for home in _homes(os.path.join(base, name), 3):
            drop_control_dir(home)


def _homes(top: str, depth: int) -> Iterator[str]:
    """The directories at most ``depth`` below ``top`` (``top`` included) holding a ``cm-dir``
    record: controller homes. Symlinks are not followed."""
    try:
        entries = list(os.scandir(top))
    except OSError:
        return
    for e in entries:
        if e.name == "cm-dir" and e.is_file(follow_symlinks=False):
            yield top
        elif depth > 0 and e.is_dir(follow_symlinks=False):
            yield from _homes(e.path, depth - 1)


def drop_control_dir(home: str) -> None:
    """Stop the ssh masters in the control directory recorded for ``home`` (``-O exit`` on
    each socket, then SIGKILL by PID any ssh whose command line still names the directory) and
    remove it. Only a directory of the name rgt makes (``/tmp/rgt-cm-UID-*``), and not a
    symlink: a record a test wrote to point elsewhere is left to that test."""
    try:
        with open(os.path.join(home, "cm-dir")) as f:
            d = f.read().strip()
    except (OSError, UnicodeDecodeError):
        return
    prefix = f"/tmp/rgt-cm-{os.getuid()}-"
    if not d.startswith(prefix) or "/" in d[len(prefix) :]:
        return
    try:
        if not stat.S_ISDIR(os.lstat(d).st_mode):
            return
        names = os.listdir(d)
    except OSError:
        return
    for name in names:
        sock = os.path.join(d, name)
        try:
            if not stat.S_ISSOCK(os.lstat(sock).st_mode):
                continue
            subprocess.run(
                ["ssh", "-F", "/dev/null", "-o", f"ControlPath={sock}", "-O", "exit", "rgt"],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=30,
            )
        except (OSError, subprocess.TimeoutExpired):
            pass
    for pid in ssh_naming(d):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    shutil.rmtree(d, ignore_errors=True)
