"""The embedded default (examples/train_tiny.py, real PyTorch on the CPU) under rgt-agent: a
job killed mid-run is restarted by the agent and ends with the same weights as a run that was
never interrupted. (The exhaustive resume-exactness tests arrive with the training API.)"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time

from tests.conftest import ROOT, Cli, require

EXAMPLE = os.path.join(ROOT, "examples", "train_tiny.py")
ARGS = ["--steps", "60", "--ckpt-every", "10", "--sleep", "0.05"]


def _sha(output: str) -> str:
    m = re.search(r"weights sha256 ([0-9a-f]{64})", output)
    assert m, output[-2000:]
    return m.group(1)


def test_killed_example_job_resumes_to_the_same_weights(cli: Cli, tmp_path: object) -> None:
    require(importlib.util.find_spec("torch") is not None, "torch (pip install torch==2.13.0)")
    plain = subprocess.run(
        [sys.executable, EXAMPLE, *ARGS],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(tmp_path),
        check=True,
    )
    expected = _sha(plain.stdout)

    cli("start", "--name", "ex", "--", sys.executable, EXAMPLE, *ARGS, check=True)
    ckpt = os.path.join(cli.home, "runs", "ex", "ckpt")
    deadline = time.monotonic() + 120
    while not any(n.startswith("step_") for n in os.listdir(ckpt)):
        assert time.monotonic() < deadline, "no checkpoint written"
        time.sleep(0.05)
    st = cli.status("ex")
    assert st["attempt"] == 1
    os.kill(st["pid"], signal.SIGKILL)
    st = cli.wait_state("ex", "SUCCEEDED", timeout=240)
    assert st["attempt"] == 2 and st["last_exit"]["kind"] == "success"
    logs = cli("logs", "ex", check=True).stdout
    assert re.search(r"resumed from step_\d+\.pt at step [1-9]\d*", logs), logs[-2000:]
    assert _sha(logs) == expected
