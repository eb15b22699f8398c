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
