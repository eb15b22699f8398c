"""`rgt deploy`, status, watch, logs, stop and runs, end to end: the real `rgt` CLI as a process,
over real ssh, deploying a real PyTorch CPU training (examples/train_plain.py).

Two boxes, both this machine's file system and processes (so what happened on the box is
checked by reading it directly): a test sshd on loopback, and one inside a network namespace with
an address of its own, whose link the tests cut (tests/netns.py). Each box gets its own
controller home (registry, known_hosts, ssh control sockets) and its own RGT_HOME; each deploys
one run, shared by the tests of this module. Covered:

- deploy returns while the job runs; the ssh client and the controller are SIGKILLed, and the job
  goes on (same process, progress advancing); status, watch (rendered to a file) and logs show it;
- netns: the link cut in the middle of the push, then just after the agent started: deploy fails
  with RemoteUnreachable (exit 3) in bounded time; once the link is back, deploy again: one agent,
  one complete release, the run RUNNING; a deploy of unchanged code sends no file and runs one
  command on the box (the sshd's log counts them): the audit, which also asks the agent this
  laptop recorded for the run its --version and the run's status;
- a deploy whose found agent no longer answers --version installs it again, next to the live
  run's agent (whose files it leaves), and finds the run live: nothing to do;
- netns, link down: status reads the store's mirror and says "unknown since T";
- a canary secret (--secret-env) reaches the job, also after the agent is SIGKILLed and respawned
  and the job restarted, and is found only in the box's 0600 secrets file: in no process's argv
  (sampled all along), no file of the release or run directories, no log, no store object;
- hostile run names are refused naming --name; hostile job arguments arrive byte for byte;
  ``-oProxyCommand=...`` targets are refused and nothing runs;
- stop stops the run; runs lists it;
- every directory rgt made on the box is 0700.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import pytest

from controller.registry import Registry
from onbox.agent import procfs
from onbox.agent.observe import public_state
from tests.conftest import ROOT, _kill_run_processes, require
from tests.laptop import laptop_env, rgt_exe, ssh_target
from tests.netns import Netns
from tests.polling import wait_value
from tests.sshd import SshServer

TIMEOUT = 60.0
SECRET_VAR = "RGT_TEST_CANARY"
CANARY = "rgt-canary-" + os.urandom(12).hex()
CANARY_SHA = hashlib.sha256(CANARY.encode()).hexdigest()
# Job arguments a shell, ssh or an option parser could get wrong; each must arrive as it was.
HOSTILE_ARGS = [
    "with space",
    "quote'single",
    'quote"double',
    "semi;colon",
    "new\nline",
    "$(touch pwned-dollar)",
    "`touch pwned-backtick`",
    "-leading-dash",
    "--",
    "-oProxyCommand=touch pwned-proxy",
    "back\\slash",
    "tab\there",
    "star*glob?[x]",
    "",
    "ünïcödé",
    os.fsdecode(b"latin1-\xff"),  # not UTF-8
]
PWNED = ("pwned-dollar", "pwned-backtick", "pwned-proxy")

# The job: what it was given first (its argv, whether the secret reached it), then the real
# training. It runs in the release directory, with onbox on its PYTHONPATH from the agent.
JOB = f"""\
import hashlib, json, os, runpy, sys
print("argv " + json.dumps(sys.argv[1:]), flush=True)
v = os.environ.get({SECRET_VAR!r})
print("attempt", os.environ.get("RGT_ATTEMPT"), "secret",
      hashlib.sha256(v.encode()).hexdigest() if v else "missing", flush=True)
# --sync: what is tested here does not depend on how the job saves, and the async writer
# would be a second process importing torch for every deploy. A checkpoint every 100 steps:
# nothing here reads one, and each is a seal for the agent while the module's runs live.
sys.argv = ["train_plain.py", "--steps", "100000", "--sleep", "0.2", "--ckpt-every", "100",
            "--sync"]
runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_plain.py"),
               run_name="__main__")
"""


# Each poll is a real `rgt status`/`logs` over ssh: about a second of CPU on the laptop and
# the box together. Back to back, they took a core from the job and agent being waited on.
POLL = 1.0


def _project(root: Path, blob_bytes: int = 0) -> str:
    root.mkdir(parents=True)
    shutil.copy(os.path.join(ROOT, "examples", "train_plain.py"), root / "train_plain.py")
    (root / "job.py").write_text(JOB)
    if blob_bytes:  # a larger project, so that a push takes long enough to be cut
        for i in range(4):
            (root / f"data{i}.bin").write_bytes(os.urandom(blob_bytes // 4))
    return str(root)


def _grep_tree(root: str, needle: bytes) -> List[str]:
    hits = []
    for here, _, files in os.walk(root):
        for name in files:
            path = os.path.join(here, name)
            if os.path.islink(path):
                continue
            try:
                with open(path, "rb") as f:
                    if needle in f.read():
                        hits.append(path)
            except OSError:
                pass
    return sorted(hits)


class ArgvSampler:
    """Reads every process's /proc/PID/cmdline over and over, from a thread, and remembers those
    that hold the needle: a secret passed in an argv would be visible to every user of the box."""

    def __init__(self, needle: bytes) -> None:
        self.needle = needle
        self.hits: List[Tuple[int, bytes]] = []
        self.rounds = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for pid in procfs.pids():
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        line = f.read()
                except OSError:
                    continue
                if self.needle in line:
                    self.hits.append((pid, line))
            self.rounds += 1
            self._stop.wait(0.02)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


@dataclasses.dataclass
class Box:
    """One box, the run deployed to it, and the laptop state that reaches it."""

    label: str
    sshd: SshServer
    ctl_home: str
    box_home: str
    store: str  # a directory, used as file://store
    project: str
    name: str
    ns: Optional[Netns] = None
    # (exit status, stderr, seconds: from the cut when a cut ended it, else in all) per deploy
    deploys: List[Tuple[int, str, float]] = dataclasses.field(default_factory=list)
    after_cut: Dict[str, Any] = dataclasses.field(default_factory=dict)  # the box, then
    last_deploy_commands: int = -1  # commands the sshd started for the last deploy of the fixture

    @property
    def target(self) -> str:
        return ssh_target(self.sshd)

    def env(self) -> Dict[str, str]:
        return laptop_env(self.ctl_home, self.box_home, **{SECRET_VAR: CANARY})

    def rgt(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*rgt_exe(), *args],
            env=self.env(),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=self.ctl_home,
        )

    def deploy_argv(self, *extra: str, job_args: Tuple[str, ...] = ()) -> List[str]:
        return [
            *rgt_exe(), "deploy", self.target, "--name", self.name, "--python", sys.executable,
            "--project", self.project, "--store", "file://" + self.store, *extra,
            "--", sys.executable, "job.py", *job_args,
        ]  # fmt: skip

    def deploy(self, *extra: str, job_args: Tuple[str, ...] = ()) -> subprocess.Popen[str]:
        return subprocess.Popen(
            self.deploy_argv(*extra, job_args=job_args),
            env=self.env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=self.ctl_home,
        )

    def finish(
        self, p: subprocess.Popen[str], since: float, timeout: float = 300
    ) -> Tuple[int, str, float]:
        """Wait for a deploy; its status, stderr and the seconds it took from ``since``."""
        _, err = p.communicate(timeout=timeout)
        done = (p.returncode, err, time.monotonic() - since)
        self.deploys.append(done)
        return done

    def status(self) -> Dict[str, Any]:
        p = self.rgt("status", self.name, "--json", timeout=120)
        assert p.returncode == 0, f"rgt status -> {p.returncode}: {p.stderr}"
        doc: Dict[str, Any] = json.loads(p.stdout)
        return doc

    def wait_status(
        self, pred: Callable[[Dict[str, Any]], bool], what: str, timeout: float = TIMEOUT
    ) -> Dict[str, Any]:
        return wait_value(
            self.status,
            pred,
            timeout,
            f"{self.label}: {what}",
            POLL,
            lambda st: f"last status {st}",
        )

    def logs(self) -> str:
        p = self.rgt("logs", self.name, timeout=120)
        assert p.returncode == 0, f"rgt logs -> {p.returncode}: {p.stderr}"
        return p.stdout

    def wait_log(self, text: str, timeout: float = TIMEOUT) -> str:
        return wait_value(
            self.logs, lambda out: text in out, timeout, f"{self.label}: {text!r} in the log",
            POLL, lambda out: repr(out[-2000:]),
        )  # fmt: skip

    def commands(self) -> int:
        """Commands the box's sshd has started so far: one per ssh command, multiplexed or not."""
        return self.sshd.log().count("Starting session: ")

    def run_dir(self, *parts: str) -> str:
        return os.path.join(self.box_home, "runs", self.name, *parts)

    def complete_releases(self) -> List[str]:
        return sorted(
            os.path.basename(os.path.dirname(m))
            for m in glob.glob(os.path.join(self.box_home, "releases", "*", ".rgt-release"))
        )

    def agents(self) -> List[int]:
        """Processes of this box that are an agent of the run and hold its lock."""
        lock = os.path.realpath(self.run_dir("lock"))
        title = f"rgt-agent agent {self.name}".encode()
        found = []
        for pid in procfs.pids():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if not f.read().startswith(title):
                        continue
                fds = os.listdir(f"/proc/{pid}/fd")
            except OSError:
                continue
            for fd in fds:
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}") == lock:
                        found.append(pid)
                        break
        return found

    def ssh_clients(self) -> List[int]:
        """This controller's ssh processes (control master and clients): they name its
        control socket directory in their command line."""
        dirs = [os.path.join(self.ctl_home, "cm").encode()]
        # Where HOME/cm is too long for a socket, rgt uses a private /tmp directory whose name
        # it records in HOME/cm-dir (controller/controldir.py control_dir).
        with contextlib.suppress(OSError), open(os.path.join(self.ctl_home, "cm-dir"), "rb") as f:
            dirs.append(f.read().strip())
        out = []
        for pid in procfs.pids():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    line = f.read()
            except OSError:
                continue
            if line.startswith(b"ssh") and any(d and d in line for d in dirs):
                out.append(pid)
        return out

    def cleanup(self) -> None:
        """Stop the run through the box's own agent, then kill by PID whatever is left of it and
        of this controller's ssh connections."""
        if self.ns is not None:  # the session's namespace, as the next test expects it
            self.ns.unlimit_rate()
            with contextlib.suppress(RuntimeError):
                self.ns.link_up()
        with contextlib.suppress(Exception):
            rec = Registry(self.ctl_home).get(self.name)
            subprocess.run(
                rec.agent_argv("stop", self.name, "--grace", "2"),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=60,
            )
        _kill_run_processes(self.box_home)
        for pid in self.ssh_clients():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(OSError), open(os.path.join(self.ctl_home, "cm-dir")) as f:
            shutil.rmtree(f.read().strip(), ignore_errors=True)  # the private /tmp one, if any


def _new_box(
    label: str, sshd: SshServer, tmp: Path, blob_bytes: int = 0, ns: Optional[Netns] = None
) -> Box:
    box = Box(
        label=label,
        sshd=sshd,
        ctl_home=str(tmp / "ctl"),
        box_home=str(tmp / "box"),
        store=str(tmp / "store"),
        project=_project(tmp / "project", blob_bytes),
        name=f"{label}-{os.getpid()}",
        ns=ns,
    )
    os.makedirs(box.ctl_home)
    os.makedirs(box.store)
    return box


@pytest.fixture(scope="module")
def sampler() -> Iterator[ArgvSampler]:
    s = ArgvSampler(CANARY.encode())
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def loop(
    sshd: SshServer, tmp_path_factory: pytest.TempPathFactory, sampler: ArgvSampler
) -> Iterator[Box]:
    """The loopback box, its run deployed (with the canary secret and the hostile arguments)."""
    box = _new_box("loop", sshd, tmp_path_factory.mktemp("loop"))
    try:
        t0 = time.monotonic()
        box.finish(box.deploy("--secret-env", SECRET_VAR, job_args=tuple(HOSTILE_ARGS)), t0)
        yield box
    finally:
        box.cleanup()


@pytest.fixture(scope="module")
def netns(
    netns_sshd: Tuple[Netns, SshServer], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Box]:
    """The namespace's box, after this sequence (each deploy's (rc, stderr, seconds after the
    cut or in all) in ``box.deploys``):

    0. link rate-capped; deploy; the link cut once the push has sent its first file;
    1. link back, uncapped; deploy; the link cut as soon as the agent holds the run's lock;
    2. link back; deploy;
    3. deploy again, the code unchanged.

    The box has no package index (no network but the link): the agent comes --offline.
    """
    require(shutil.which("tc") is not None, "iproute2's tc, to slow the link down")
    ns, server = netns_sshd
    box = _new_box("netns", server, tmp_path_factory.mktemp("netns"), blob_bytes=6 << 20, ns=ns)
    releases = os.path.join(box.box_home, "releases")
    try:
        ns.limit_rate("16mbit")  # 6 MiB: about three seconds of pushing
        p = box.deploy("--offline")
        # rsync writes each file under a dot name, then renames it: the first name that shows is
        # a whole file sent, with more to come.
        _wait_for(lambda: bool(glob.glob(os.path.join(releases, ".tmp-*", "*"))), p, "a push")
        ns.link_down()
        box.finish(p, time.monotonic())
        box.after_cut = _box_state(box)
        ns.link_up()
        ns.unlimit_rate()

        p = box.deploy("--offline")
        _wait_for(lambda: os.path.exists(box.run_dir("lock")), p, "the agent's start")
        ns.link_down()
        box.finish(p, time.monotonic())
        ns.link_up()
        t0 = time.monotonic()
        box.finish(box.deploy("--offline"), t0)
        t0 = time.monotonic()
        n = box.commands()
        box.finish(box.deploy("--offline"), t0)
        box.last_deploy_commands = box.commands() - n
        yield box
    finally:
        box.cleanup()


def _wait_for(pred: Callable[[], bool], p: subprocess.Popen[str], what: str) -> None:
    deadline = time.monotonic() + 120
    while not pred():
        if p.poll() is not None:
            err = p.stderr.read() if p.stderr else ""
            raise AssertionError(f"deploy ended ({p.returncode}) before {what}: {err}")
        if time.monotonic() > deadline:
            p.kill()
            raise AssertionError(f"no sign of {what} within 120 s")
        time.sleep(0.01)


def _box_state(box: Box) -> Dict[str, Any]:
    releases = os.path.join(box.box_home, "releases")
    return {
        "complete": box.complete_releases(),
        "entries": sorted(os.listdir(releases)) if os.path.isdir(releases) else [],
        "current": os.path.lexists(os.path.join(box.box_home, "deploys", box.name, "current")),
        "run": os.path.exists(box.run_dir()),
    }


@pytest.fixture(params=["loop", "netns"])
def box(request: pytest.FixtureRequest) -> Box:
    b: Box = request.getfixturevalue(request.param)
    return b


def _step(st: Dict[str, Any]) -> int:
    prog = st.get("progress") or {}
    return int(prog.get("step") or 0)


# --- deploy returns; the job outlives the laptop ------------------------------------------------


def test_deploy_returns_while_the_job_runs(box: Box) -> None:
    # netns: the deploy after the cut ones (the job had started under a cut one: see below)
    rc, err, _ = box.deploys[0] if box.label == "loop" else box.deploys[2]
    assert rc == 0, err
    if box.label == "loop":
        assert "its first line: argv " in err and f"rgt watch {box.name}" in err, err
    else:
        assert re.search(rf"{box.name} is already (STARTING|RUNNING) on this release; nothing", err)
    st = box.status()
    # The job has printed its first line; RUNNING comes once it has lived its start grace.
    assert st["source"] == "box" and st["state"] in ("STARTING", "RUNNING"), st
    assert st["job_alive"], st
    st = box.wait_status(lambda s: s["state"] == "RUNNING", "RUNNING")
    assert st["agent"]["alive"] and box.agents() == [st["agent"]["pid"]], (st, box.agents())
    rec = Registry(box.ctl_home).get(box.name)
    assert rec.release is not None and box.complete_releases() == [rec.release]
    assert os.readlink(os.path.join(box.box_home, "deploys", box.name, "current")) == (
        f"../../releases/{rec.release}"
    )


def test_rgt_directories_on_the_box_are_0700(box: Box) -> None:
    # Made by rgt, they are the box user's alone: its code, the agent's install, the runs'
    # checkpoints, logs and secrets (mkdir -p under the usual umask 022 made them 0755).
    home = box.box_home
    rid = box.complete_releases()[-1]
    dirs = [".", "releases", f"releases/{rid}", "deploys", f"deploys/{box.name}", "agent"]
    dirs += ["runs", f"runs/{box.name}", f"runs/{box.name}/ckpt", "lib"]
    dirs += ["secrets"] if os.path.isdir(os.path.join(home, "secrets")) else []  # loop's only
    dirs += [
        os.path.join("agent", d)
        for d in os.listdir(os.path.join(home, "agent"))
        if os.path.isdir(os.path.join(home, "agent", d))
    ]
    modes = {d: oct(os.stat(os.path.join(home, d)).st_mode & 0o777) for d in dirs}
    assert {d: m for d, m in modes.items() if m != "0o700"} == {}


def test_the_job_outlives_the_ssh_client_and_the_controller(box: Box, tmp_path: Path) -> None:
    before = box.wait_status(lambda s: s["job_alive"] and _step(s) > 0, "progress")
    out = tmp_path / "follow.out"
    with open(out, "wb") as f:  # a controller that is connected right now: `rgt logs -f`
        follower = subprocess.Popen(
            [*rgt_exe(), "logs", box.name, "-f"],
            env=box.env(),
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + TIMEOUT
        while b"loss" not in out.read_bytes():
            assert follower.poll() is None, out.read_bytes()[-2000:]
            assert time.monotonic() < deadline, "rgt logs -f printed nothing"
            time.sleep(0.1)
        clients = box.ssh_clients()
        assert len(clients) >= 2, clients  # the control master and the follower's client
        follower.kill()  # SIGKILL: no chance to close anything
        for pid in clients:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    finally:
        follower.kill()
        follower.wait(10)
    deadline = time.monotonic() + 10
    while set(clients) & set(box.ssh_clients()):
        assert time.monotonic() < deadline, box.ssh_clients()
        time.sleep(0.05)

    # RUNNING comes once the job has lived past its start grace: run first in the module (alone,
    # with -k), the steps can advance before that.
    after = box.wait_status(
        lambda s: _step(s) >= _step(before) + 3 and s["state"] == "RUNNING",
        "the steps to advance, the job RUNNING",
    )
    assert after["job_alive"], after
    assert (after["pid"], after["attempt"]) == (before["pid"], before["attempt"]), after

    watch = tmp_path / "watch.txt"
    with open(watch, "w") as f:
        p = subprocess.run(
            [*rgt_exe(), "watch", box.name, "--once"],
            env=box.env(),
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    frame = watch.read_text()
    assert p.returncode == 0, p.stderr
    assert f"{box.name}: RUNNING" in frame and "read from the box" in frame, frame
    m = re.search(r"^step\s+(\d+)", frame, re.M)
    assert m and int(m.group(1)) >= _step(after), frame
    assert "state" in frame and "disk" in frame and "recent events" in frame, frame

    log = box.logs()
    steps = [
        int(s) for s in re.findall(rf"^step (\d+) attempt {after['attempt']} loss ", log, re.M)
    ]
    assert steps and steps[-1] >= _step(after), log[-2000:]


# --- the namespace's link cut mid-deploy --------------------------------------------------------


def test_a_deploy_cut_mid_push_fails_in_bounded_time_and_leaves_no_release(netns: Box) -> None:
    rc, err, seconds = netns.deploys[0]
    assert rc == 3, err
    assert "cannot reach" in err or "cut off" in err, err
    assert seconds < 30, f"deploy took {seconds:.1f}s to notice the cut"
    state = netns.after_cut
    assert state["complete"] == [] and not state["current"] and not state["run"], state
    # At most the cut push's temporary directory, never a release under its final name.
    assert all(e.startswith(".tmp-") for e in state["entries"]), state


def test_a_deploy_cut_after_the_start_then_again_gives_one_agent_one_release(netns: Box) -> None:
    rc, err, seconds = netns.deploys[1]
    assert rc == 3, err
    assert seconds < 30, f"deploy took {seconds:.1f}s to notice the cut"
    # The reason is the connection's, not whatever the box's command had printed meanwhile.
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"rgt: cannot reach {netns.sshd.user}@{netns.sshd.host}:"), err
    assert "WARNING" not in last, err
    rc, err, _ = netns.deploys[2]
    assert rc == 0, err
    # The cut deploy had started the agent: the next one finds the run live and leaves it.
    assert "nothing to do" in err, err
    rec = Registry(netns.ctl_home).get(netns.name)
    assert netns.complete_releases() == [rec.release]
    entries = os.listdir(os.path.join(netns.box_home, "releases"))
    assert [e for e in entries if not e.startswith(".tmp-")] == [rec.release], entries
    st = netns.status()
    assert st["state"] == "RUNNING" and st["attempt"] == 1, st
    assert netns.agents() == [st["agent"]["pid"]], netns.agents()
    with open(netns.run_dir("events.jsonl")) as f:
        incarnations = [e for e in map(json.loads, f) if e["kind"] == "incarnation"]
    assert len(incarnations) == 1, incarnations


def test_a_deploy_of_unchanged_code_moves_no_file(box: Box) -> None:
    if box.label == "loop":
        t0 = time.monotonic()
        n = box.commands()
        p = box.deploy("--secret-env", SECRET_VAR, job_args=tuple(HOSTILE_ARGS))
        rc, err, _ = box.finish(p, t0)
        commands = box.commands() - n
    else:
        rc, err, _ = box.deploys[3]
        commands = box.last_deploy_commands
    assert rc == 0, err
    assert "already on the box, nothing sent" in err, err
    assert "already installed" in err and "nothing to do" in err, err
    assert len(box.complete_releases()) == 1
    assert len(box.agents()) == 1
    # The audit (with the Python, the install's marker, the release, and the recorded agent's
    # --version with the run's status and spec in it): nothing else.
    assert commands == 1, box.sshd.log()[-3000:]


def test_status_reads_the_store_when_the_box_does_not_answer(netns: Box) -> None:
    mirror = os.path.join(netns.store, netns.name, "state", "state.json")
    deadline = time.monotonic() + TIMEOUT
    while not os.path.exists(mirror):
        assert time.monotonic() < deadline, "the agent mirrored no state to the store"
        time.sleep(0.2)
    assert netns.ns is not None
    netns.ns.link_down()
    try:
        t0 = time.monotonic()
        p = netns.rgt("status", netns.name, timeout=120)
        seconds = time.monotonic() - t0
        assert p.returncode == 0, p.stderr
        assert seconds < 30, seconds
        assert re.search(
            rf"^{re.escape(netns.name)}: unknown since \d{{4}}-\d\d-\d\dT\d\d:\d\d:\d\d", p.stdout
        ), p.stdout
        assert "RUNNING" in p.stdout and "does not answer" in p.stdout, p.stdout
        assert "dead" not in p.stdout.lower(), p.stdout
        p = netns.rgt("status", netns.name, "--json", timeout=120)
        assert p.returncode == 0, p.stderr
        doc = json.loads(p.stdout)
        assert doc["source"] == "store" and doc["state"] == "RUNNING", doc
        assert doc["box_unreachable"] and doc["read_at"] and doc["known_at"], doc
        # The agent's own bookkeeping stays out, as it does in the box's answer.
        assert public_state(doc) == doc
    finally:
        netns.ns.link_up()
    assert netns.wait_status(lambda s: s["source"] == "box", "the box again")["state"] == "RUNNING"


def test_a_found_agent_that_does_not_answer_is_installed_again_beside_the_live_run(
    sshd: SshServer, tmp_path_factory: pytest.TempPathFactory
) -> None:
    box = _new_box("again", sshd, tmp_path_factory.mktemp("again"))
    argv = [
        *rgt_exe(), "deploy", box.target, "--name", box.name, "--python", sys.executable,
        "--project", box.project, "--", "sh", "-c", "echo started; exec sleep 600",
    ]  # fmt: skip

    def deploy() -> str:
        p = subprocess.run(
            argv, env=box.env(), stdin=subprocess.DEVNULL, capture_output=True, text=True,
            timeout=300, cwd=box.ctl_home,
        )  # fmt: skip
        assert p.returncode == 0, p.stderr
        return p.stderr

    try:
        assert "its first line: started" in deploy()
        first = Registry(box.ctl_home).get(box.name).agent[0]  # .../agent/<key>/venv/bin/python
        install_dir = os.path.dirname(os.path.dirname(os.path.dirname(first)))
        # RUNNING too: the job can be up while the agent has still to say so (STARTING).
        before = box.wait_status(
            lambda s: s["state"] == "RUNNING" and s["agent"]["alive"] and s["job_alive"], "the run"
        )
        (meta,) = glob.glob(
            os.path.join(
                install_dir,
                "venv/lib/python*/site-packages/remote_gpu_trainer-*.dist-info/METADATA",
            )
        )
        with open(meta) as f:
            text = f.read()
        broken = re.sub(r"(?m)^Version: .*$", "Version: 0.0.0+broken", text)
        with open(meta, "w") as f:  # its --version now names another version; nothing else
            f.write(broken)

        err = deploy()
        assert "agent installed (venv" in err and "nothing to do" in err, err
        again = Registry(box.ctl_home).get(box.name).agent[0]
        assert again == first.replace(install_dir, install_dir + "-2")
        with open(meta) as f:
            assert f.read() == broken  # the live run's agent keeps its install whole
        after = box.status()
        assert after["state"] == "RUNNING" and after["agent"]["alive"], after
        assert (after["agent"]["pid"], after["pid"]) == (before["agent"]["pid"], before["pid"])

        n = box.commands()
        err = deploy()
        assert "agent already installed" in err and "nothing to do" in err, err
        assert box.commands() - n == 1  # the audit, through the agent recorded last time
    finally:
        box.cleanup()


# --- secrets ------------------------------------------------------------------------------------


def test_a_secret_reaches_the_job_across_restarts_and_nowhere_else(
    loop: Box, sampler: ArgvSampler
) -> None:
    assert f"attempt 1 secret {CANARY_SHA}" in loop.wait_log("attempt 1 secret")
    st = loop.wait_status(lambda s: s["job_alive"] and s["agent"]["alive"], "the run")
    os.kill(st["agent"]["pid"], signal.SIGKILL)  # the shim starts a new agent
    st = loop.wait_status(
        lambda s: s["agent"]["alive"] and s["agent"]["pid"] != st["agent"]["pid"], "a new agent"
    )
    job = procfs.identity(st["pid"])
    assert job is not None and st["job_alive"], st
    os.kill(job.pid, signal.SIGKILL)  # the new agent starts the job again
    log = loop.wait_log(f"attempt {st['attempt'] + 1} secret", timeout=120)
    assert f"attempt {st['attempt'] + 1} secret {CANARY_SHA}" in log, log[-2000:]
    assert "missing" not in log

    secrets_file = os.path.join(loop.box_home, "secrets", loop.name)
    assert stat.S_IMODE(os.stat(secrets_file).st_mode) == 0o600
    needle = CANARY.encode()
    # In the box's RGT_HOME (releases/, runs/ with every log, the agent's install): only there.
    assert _grep_tree(loop.box_home, needle) == [secrets_file]
    assert _grep_tree(loop.store, needle) == []
    assert _grep_tree(loop.ctl_home, needle) == []  # the laptop's registry, known_hosts
    assert needle not in Path(loop.sshd.log_path).read_bytes()
    assert CANARY not in "".join(err for _, err, _ in loop.deploys)
    assert sampler.rounds > 10 and sampler.hits == [], sampler.hits


# --- hostile inputs -----------------------------------------------------------------------------


def test_hostile_job_arguments_arrive_byte_for_byte(loop: Box) -> None:
    log = loop.logs()
    first = log.splitlines()[0]
    assert first.startswith("argv "), log[:500]
    assert json.loads(first[len("argv ") :]) == HOSTILE_ARGS
    rec = Registry(loop.ctl_home).get(loop.name)
    for d in (
        rec.workdir or "",
        loop.box_home,
        loop.project,
        loop.ctl_home,
        os.path.expanduser("~"),
        loop.sshd.home,
    ):
        for marker in PWNED:
            assert not os.path.exists(os.path.join(d, marker)), (d, marker)


HOSTILE_NAMES = [
    "with space",
    "quote'q",
    'dq"x',
    "semi;colon",
    "new\nline",
    "$(touch pwned-name)",
    "`touch pwned-name`",
    "-leading",
    "--leading",
    "UPPER",
    "..",
]


def test_hostile_run_names_are_refused_naming_the_field(
    sshd: SshServer, tmp_path_factory: pytest.TempPathFactory
) -> None:
    box = _new_box("names", sshd, tmp_path_factory.mktemp("names"))
    for name in HOSTILE_NAMES:
        p = box.rgt(
            "deploy", box.target, f"--name={name}", "--project", box.project, "--", "true",
            timeout=120,
        )  # fmt: skip
        assert p.returncode == 2, (name, p.returncode, p.stderr)
        assert "--name" in p.stderr, (name, p.stderr)
    assert not os.path.exists(box.box_home)
    assert not os.path.exists(os.path.join(box.ctl_home, "runs.json"))
    assert box.ssh_clients() == []
    assert not os.path.exists(os.path.join(box.ctl_home, "pwned-name"))


def test_ssh_options_as_target_are_refused_and_nothing_runs(
    sshd: SshServer, tmp_path_factory: pytest.TempPathFactory
) -> None:
    box = _new_box("targets", sshd, tmp_path_factory.mktemp("targets"))
    marker = os.path.join(box.ctl_home, "proxy-ran")
    dest = f"{sshd.user}@127.0.0.1"
    targets = [
        f"-oProxyCommand=touch {marker}",
        f"-oProxyCommand=touch${{IFS}}{marker}",
        "-oProxyCommand=sh",
        f"ssh -oProxyCommand='touch {marker}' {dest}",
        f"ssh -o 'ProxyCommand=touch {marker}' {dest}",
        f"ssh -p {sshd.port} {dest} -oProxyCommand='touch {marker}'",
        f"ssh -J '-oProxyCommand=touch {marker}' {dest}",
        f"ssh -- -oProxyCommand=touch {dest}",
        f"{sshd.user}@-oProxyCommand=sh",
        f"ssh -p {sshd.port} -i {sshd.client_key} {dest} touch {marker}",
    ]
    for target in targets:
        p = box.rgt("deploy", target, "--name", "x", "--project", box.project, "--", "true")
        assert p.returncode == 2, (target, p.returncode, p.stderr)
        # Refused by rgt's TARGET check or, for a word starting with '-', as an unknown option
        # by the command line parser itself.
        named = "TARGET" in p.stderr or (target[0] == "-" and "No such option" in p.stderr)
        assert named, (target, p.stderr)
    assert not os.path.exists(marker)
    assert box.ssh_clients() == []
    assert not os.path.exists(os.path.join(box.ctl_home, "runs.json"))


# --- stop, runs ---------------------------------------------------------------------------------


def test_stop_stops_the_run_and_runs_lists_it(box: Box) -> None:
    p = box.rgt("runs")
    assert p.returncode == 0, p.stderr
    assert f"{box.name}  {box.sshd.user}@{box.sshd.host}:{box.sshd.port}  generic-ssh" in p.stdout
    assert f"store=file://{box.store}" in p.stdout, p.stdout
    p = box.rgt("runs", "--json")
    assert [r["name"] for r in json.loads(p.stdout)] == [box.name]
    job = procfs.identity(box.status()["pid"])
    assert job is not None
    p = box.rgt("stop", box.name, "--grace", "5", timeout=120)
    assert p.returncode == 0, (p.stdout, p.stderr)
    st = box.status()
    assert st["state"] == "STOPPED" and not st["job_alive"], st
    assert not procfs.is_alive(job)
