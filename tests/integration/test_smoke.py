"""`rgt smoke` as a user runs it: the real `rgt` CLI, the real `rgt-agent` it drives, real CPU
PyTorch jobs from examples/ and misbehaving fixtures (tests/fixtures/smoke_*), each walk bounded
by its own steps and --timeout, and by the test's timeout.

What must hold: train_plain passes all seven checks with --exact; the Transformers, Lightning and
Accelerate examples pass; a job that saves but never loads fails at 5 with the resume remedy,
one that never checkpoints at 3, one with an import error at 1 naming the module, one whose
checkpoint lacks the optimizer at 6 (--exact); each failure exits 19 with one line. Every walk,
passed, failed or interrupted, leaves no process and no temporary directory behind;
`rgt deploy --smoke` creates nothing on the box when the smoke fails.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from typing import Any, Dict, Iterator, List

import pytest

from onbox.agent import procfs
from tests.conftest import FIXTURES, ROOT, _kill_run_processes, require
from tests.laptop import laptop_env, rgt_exe, run_rgt

PY = sys.executable


@pytest.fixture
def env(tmp_path: Any) -> Iterator[Dict[str, str]]:
    """rgt's environment with a TMPDIR of the test's own (where the smoke makes its box); any
    process of a smoke box still alive at the end (a walk killed by the test's timeout) is
    killed by PID."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    e = {k: v for k, v in os.environ.items() if not k.startswith("RGT_")}
    e.update(TMPDIR=str(tmp), RGT_CONTROLLER_HOME=str(tmp_path / "ctl"))
    yield e
    for home in glob.glob(os.path.join(str(tmp), "*", "home")) + glob.glob(
        os.path.join(str(tmp_path), "*", "home")
    ):
        _kill_run_processes(home)


def _left(e: Dict[str, str]) -> List[str]:
    """What a smoke left: files in its TMPDIR, and live processes whose environment names it."""
    tmp = e["TMPDIR"]
    left = os.listdir(tmp)
    for pid in procfs.pids():
        env = procfs.environ(pid) or {}
        if (env.get(b"RGT_HOME") or b"").startswith(tmp.encode()):
            left.append(f"pid {pid}")
    return left


def smoke(e: Dict[str, str], *args: str, cwd: str = ROOT, timeout: float = 240) -> Any:
    p = run_rgt(["smoke", *args], e, cwd, timeout=timeout)
    print(p.stdout, p.stderr)
    return p


def _checks(out: str) -> Dict[int, str]:
    """check number -> ok | FAIL | --, from the walk's lines."""
    return {int(n): v for v, n in re.findall(r"^(ok|FAIL|--) +(\d) ", out, re.M)}


def _need(*modules: str) -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    require(not missing, f"{', '.join(missing)} (pip install -e '.[train,frameworks]')")


@pytest.mark.timeout(300)
def test_plain_example_passes_every_check_and_resumes_exactly(env: Dict[str, str]) -> None:
    _need("torch", "numpy")
    # Paced (--sleep changes nothing but the wall time): unpaced, 60 steps ended before the
    # preemption of check 5 on a loaded machine.
    job = ["--", PY, "examples/train_plain.py", "--steps", "300", "--ckpt-every", "10"]
    job += ["--sleep", "0.05"]
    p = smoke(env, "--exact", "--steps", "5", *job)
    assert p.returncode == 0, p.stderr
    assert _checks(p.stdout) == dict.fromkeys(range(1, 8), "ok")
    assert re.search(r"steps/s|s/step", p.stdout)
    assert re.search(r"pass --seal-time \d+", p.stdout)
    assert re.search(r"restored step (\d+) on a fresh directory", p.stdout)
    assert _left(env) == []


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "example,module",
    [("train_hf.py", "transformers"), ("train_lightning.py", "lightning"),
     ("train_accelerate.py", "accelerate")],
)  # fmt: skip
def test_framework_examples_pass(env: Dict[str, str], example: str, module: str) -> None:
    _need("torch", module)
    args = ["--steps", "40", "--save-steps", "10", "--sleep", "0.05"]
    p = smoke(env, "--steps", "5", "--", PY, f"examples/{example}", *args)
    assert p.returncode == 0, p.stderr
    assert _checks(p.stdout) == {**dict.fromkeys(range(1, 8), "ok"), 6: "--"}
    assert _left(env) == []


def _failed_at(p: Any, n: int) -> str:
    """The walk stopped at check ``n`` with exit 19 and one line: that line."""
    assert p.returncode == 19, p.stdout + p.stderr
    checks = _checks(p.stdout)
    assert checks[n] == "FAIL" and max(checks) == n, p.stdout
    assert all(v == "ok" for k, v in checks.items() if k < n)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and f"smoke check {n} " in lines[0], p.stderr
    return str(lines[0])


def test_an_import_error_fails_at_1_naming_the_module(env: Dict[str, str]) -> None:
    p = smoke(env, "--project", FIXTURES, "--", PY, "smoke_import_error.py", timeout=120)
    assert "rgt_smoke_no_such_module" in _failed_at(p, 1)
    assert _left(env) == []


def test_no_checkpoint_fails_at_3_and_keep_holds_the_run(
    env: Dict[str, str], tmp_path: Any
) -> None:
    keep = str(tmp_path / "kept")
    job = os.path.join(FIXTURES, "smoke_no_ckpt.toml")
    p = smoke(env, "--project", FIXTURES, "--timeout", "6", "--keep", keep, job, timeout=120)
    assert "no complete checkpoint" in _failed_at(p, 3)
    assert "checkpoint.trigger" in p.stdout  # the remedy
    assert os.path.isfile(os.path.join(keep, "home", "runs", "smoke", "events.jsonl"))
    assert _left(env) == []


def test_saving_without_loading_fails_at_5_with_the_resume_remedy(env: Dict[str, str]) -> None:
    job = os.path.join(FIXTURES, "smoke_no_load.toml")
    line = _failed_at(smoke(env, "--project", FIXTURES, job, timeout=120), 5)
    assert "reports step 1" in line and "RGT_RESUME_FROM" in line
    assert _left(env) == []


@pytest.mark.timeout(300)
def test_a_checkpoint_without_the_optimizer_fails_at_6(env: Dict[str, str]) -> None:
    _need("torch")
    cmd = ["--", PY, "smoke_no_optimizer.py"]
    p = smoke(env, "--exact", "--steps", "3", "--project", FIXTURES, *cmd)
    assert "weights" in _failed_at(p, 6)
    assert _left(env) == []


def test_ctrl_c_stops_every_process_and_removes_the_box(env: Dict[str, str]) -> None:
    job = os.path.join(FIXTURES, "smoke_no_load.toml")
    argv = [*rgt_exe(), "smoke", "--project", FIXTURES, job]
    p = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        pattern = os.path.join(env["TMPDIR"], "*", "home", "runs", "smoke", "attempts", "*")
        while not glob.glob(pattern):
            assert time.monotonic() < deadline and p.poll() is None, "the job never started"
            time.sleep(0.1)
        p.send_signal(signal.SIGINT)
        assert p.wait(60) == 130
    finally:
        if p.poll() is None:
            p.kill()
        p.communicate(timeout=30)
    assert _left(env) == []


def _box_processes(tmp: str) -> List[int]:
    """Live processes of smokes made under ``tmp``: their environment names it as TMPDIR or
    RGT_HOME, which the box's agents, shims and jobs have, and rgt's own children too before
    their exec (a fork of rgt: its TMPDIR)."""
    key = tmp.encode()
    found = []
    for pid in procfs.pids():
        env = procfs.environ(pid) if pid != os.getpid() else None
        if env and any((env.get(k) or b"").startswith(key) for k in (b"TMPDIR", b"RGT_HOME")):
            found.append(pid)
    return found


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "(gone)"


def _kill_box_processes(tmp: str) -> List[str]:
    """SIGKILL, by PID, every process ``_box_processes`` finds, until none is left; those found
    first, each as its PID and command line."""
    first = [f"{pid} {_cmdline(pid)}" for pid in _box_processes(tmp)]
    for _ in range(50):
        left = _box_processes(tmp)
        if not left:
            break
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    return first


# Where the asks land: (the walk's line after which they are sent, the delays in seconds).
# "smoke:" is printed just before the first agent starts; "attempt" is once the agent made
# the run's first attempt (it starts the shim, which starts the job); "ok 1" once the job
# trains; "ok 4" just before the preemption, the wipe and the second agent of check 5.
_PHASES = {
    "agent_starting": ("smoke:", [0.0, 0.02, 0.1, 0.3]),
    "job_starting": ("attempt", [0.0, 0.02, 0.05]),
    "training": (r"ok +1 ", [0.0, 0.1]),
    "resuming": (r"ok +4 ", [0.0, 0.05, 0.1, 0.2, 0.4, 0.8]),
}


def _interrupted(
    base: Dict[str, str], tmp: str, after: str, delay: float, asks: List[int], gap: float = 0.05
) -> Any:
    """`rgt smoke` of the no-load fixture (it fails at 5 if nothing stops it), sent ``asks``
    (signals, ``gap`` seconds apart) ``delay`` seconds after the walk printed a line that
    ``after`` (a regular expression) matches, or its run's first attempt was made ("attempt");
    its exit code, its output, and what of its box was left once it ended: live processes
    (killed then by PID), and its temporary directory."""
    os.makedirs(tmp)
    e = dict(base, TMPDIR=tmp)
    job = os.path.join(FIXTURES, "smoke_no_load.toml")
    argv = [*rgt_exe(), "smoke", "--project", FIXTURES, "--timeout", "30", job]
    p = subprocess.Popen(argv, env=e, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    out: List[str] = []
    try:
        assert p.stdout is not None
        for line in p.stdout:  # bounded: the walk's own --timeout, and the test's timeout
            out.append(line)
            if re.match("smoke:" if after == "attempt" else after, line):
                break
        else:
            raise AssertionError(f"the walk ended before {after!r}: {''.join(out)}")
        attempts = os.path.join(tmp, "*", "home", "runs", "smoke", "attempts", "*")
        while after == "attempt" and not glob.glob(attempts):
            assert p.poll() is None, "the walk ended before its first attempt"
            time.sleep(0.002)
        time.sleep(delay)
        for signum in asks:
            if p.poll() is None:
                p.send_signal(signum)
            time.sleep(gap)
        rc = p.wait(90)
    finally:
        if p.poll() is None:
            p.kill()
        out.append(p.communicate(timeout=30)[0])
        left = _kill_box_processes(tmp)
    return rc, "".join(out), left + os.listdir(tmp)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("phase", sorted(_PHASES))
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_an_ask_at_any_point_of_the_walk_leaves_no_process(
    env: Dict[str, str], phase: str, signum: int
) -> None:
    """A SIGTERM or a Ctrl-C while the first agent starts, while it starts the shim and the
    job, while the job trains, or during the preemption, wipe and restart of check 5, at
    several delays: `rgt smoke` exits 128 + the
    signal (130 for a Ctrl-C, 143 for a SIGTERM: controller/hangup.py, as every command), or
    19 where the walk failed at 5 before it, and no process of its local box is left."""
    after, delays = _PHASES[phase]
    want = 128 + signum
    bad = []
    for i, delay in enumerate(delays):
        tmp = os.path.join(env["TMPDIR"], f"{phase}-{i}")
        rc, out, left = _interrupted(env, tmp, after, delay, [signum])
        if left or rc not in (want, 19) or (rc == 19 and phase != "resuming"):
            bad.append(f"{delay} s after {after!r}: exit {rc}, left {left}\n{out}")
    assert not bad, "\n".join(bad)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("after", [r"ok +1 ", r"ok +4 "])
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_asks_repeated_during_the_cleanup_leave_no_process(
    env: Dict[str, str], after: str, signum: int
) -> None:
    """The signal 40 times, 5 ms apart (an impatient person's Ctrl-C, a service manager's
    SIGTERM): the later ones land while the first one's cleanup stops the local box, and cut
    none of it. The exit: 128 + the signal, or killed by it where one came once rgt had put
    the default handlers back, on its way out."""
    tmp = os.path.join(env["TMPDIR"], "repeated")
    rc, out, left = _interrupted(env, tmp, after, 0.0, [signum] * 40, 0.005)
    assert left == [], out
    assert rc in (128 + signum, -signum), out


def _shim_below(pid: int) -> Any:
    """The identity of the shim of attempt 1 below ``pid`` (its agent's child, or its own once
    the agent is gone), by its title (onbox/agent/title.py); None while there is none."""
    for cand in procfs.pids():
        st = procfs.read_stat(cand)
        if st is None or _cmdline(cand) != "rgt-agent shim smoke attempt 1":
            continue
        parent = procfs.read_stat(st.ppid)
        if st.ppid == pid or (parent is not None and parent.ppid == pid):
            return procfs.Identity(cand, st.start_ticks)
    return None


@pytest.mark.timeout(300)
def test_a_sigterm_while_the_shim_starts_the_job_leaves_no_shim(env: Dict[str, str]) -> None:
    """A loaded machine, made certain: the shim of the first attempt stopped (SIGSTOP) once it
    has named itself (its environment in /proc is then its title's) and before it recorded
    its job in job.json, then SIGTERM to `rgt smoke`. Neither the records nor the environment
    find that shim; left running, it starts the job and, no agent holding the run, an agent
    again. Tried until the stop lands in that window (it is ms wide)."""
    job = os.path.join(FIXTURES, "smoke_no_load.toml")
    for i in range(10):
        tmp = os.path.join(env["TMPDIR"], f"try-{i}")
        os.makedirs(tmp)
        e = dict(env, TMPDIR=tmp)
        argv = [*rgt_exe(), "smoke", "--project", FIXTURES, "--timeout", "30", job]
        p = subprocess.Popen(argv, env=e, cwd=ROOT, stdout=subprocess.DEVNULL)
        shim = None
        try:
            records = os.path.join(
                tmp, "*", "home", "runs", "smoke", "attempts", "0001", "job.json"
            )
            deadline = time.monotonic() + 60
            while shim is None and not glob.glob(records):
                assert time.monotonic() < deadline and p.poll() is None, "no shim started"
                shim = _shim_below(p.pid)
            if shim is not None:
                os.kill(shim.pid, signal.SIGSTOP)
                time.sleep(0.1)  # (what it was writing is written, or not begun)
            if shim is None or glob.glob(records):
                continue  # the window was missed: try again
            p.send_signal(signal.SIGTERM)
            assert p.wait(90) == 143
            left = procfs.is_alive(shim)
            assert not left, f"the shim {shim.pid} was left running"
            assert _box_processes(tmp) == []
            return
        finally:
            if p.poll() is None:
                p.kill()
            p.wait(30)
            if shim is not None and procfs.is_alive(shim):
                os.kill(shim.pid, signal.SIGKILL)
            _kill_box_processes(tmp)
    raise AssertionError("the shim was never stopped before it recorded its job: 10 tries")


def test_deploy_smoke_creates_nothing_on_the_box_when_the_smoke_fails(
    env: Dict[str, str], tmp_path: Any
) -> None:
    box = tmp_path / "box"
    e = laptop_env(str(tmp_path / "ctl"), str(box), TMPDIR=env["TMPDIR"])
    argv = ["deploy", "local", "--smoke", "--project", FIXTURES, "--", PY, "smoke_import_error.py"]
    p = run_rgt(argv, e, ROOT, timeout=120)
    assert p.returncode == 19, p.stdout + p.stderr
    assert "smoke check 1 " in p.stderr
    assert not box.exists()
    assert not (tmp_path / "ctl" / "runs.json").exists()
