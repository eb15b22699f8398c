"""A real agent (`rgt-agent start`, probes every second) reading its GPU through a FAKE NVML at
the seam (tests/fakes/pynvml.py, put first on the GPU worker's path by $RGT_GPU_WORKER_PATH):
what the user sees in `status --json`, and a stale GPU memory holder of an earlier attempt of
the same run (a real sleeping process carrying that attempt's tag) reaped by the agent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Dict

from onbox.agent.journal import read_events
from onbox.common import jobenv
from onbox.health.gpu import PATH_VAR
from tests.conftest import ROOT, Cli
from tests.polling import wait

FAKES = os.path.join(ROOT, "tests", "fakes")


def _gpu(st: Dict[str, Any]) -> Dict[str, Any]:
    probes = (st.get("health") or {}).get("probes") or {}
    gpu: Dict[str, Any] = probes.get("gpu") or {}
    return gpu


def test_fake_nvml_agent_status_shows_the_gpu_verdict_and_reaps_an_earlier_attempts_holder(
    cli: Cli, tmp_path: Any
) -> None:
    nvml = str(tmp_path / "nvml.json")
    stale = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)"],
        env={**os.environ, jobenv.ATTEMPT_TAG: "g1:0:earlier"},
    )
    try:
        doc = {
            "devices": [
                {
                    "name": "Fake H100",
                    "util": 88,
                    "mem_used": 5000,
                    "mem_total": 81559,
                    "temp": 55,
                    "power": 250.0,
                    "processes": [{"pid": stale.pid, "used": 3000}],
                }
            ]
        }
        with open(nvml, "w") as f:
            json.dump(doc, f)
        cli.env["RGT_FAKE_NVML"] = nvml
        cli.env[PATH_VAR] = FAKES
        job = os.path.join(cli.home, "g1.toml")
        with open(job, "w") as f:
            cmd = [sys.executable, "-c", "import time; time.sleep(120)"]
            f.write(f"command = {json.dumps(cmd)}\n[health]\ninterval = 1\n")
        cli("start", job, "--name", "g1", check=True)
        st = cli.wait_for(
            "g1", lambda s: "Fake H100" in _gpu(s).get("reason", ""), 60, "the gpu verdict"
        )
        gpu = _gpu(st)
        assert gpu["level"] == "ok", gpu
        assert "util 88%" in gpu["reason"] and "5000/81559 MiB" in gpu["reason"], gpu
        assert stale.wait(timeout=30) == -9  # the agent killed it: the run's earlier attempt
        events = os.path.join(cli.home, "runs", "g1", "events.jsonl")
        reaped = wait(
            lambda: [e for e in read_events(events) if e["kind"] == "gpu_reaped"],
            30,
            "the gpu_reaped event",
        )
        assert reaped[0]["pid"] == stale.pid and "3000 MiB" in reaped[0]["reason"]
        samples = os.path.join(cli.home, "runs", "g1", "health", "samples.jsonl")
        wait(lambda: os.path.exists(samples), 30, "the samples file")
        with open(samples) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        assert any(r.get("gpu.util") == 88 and r.get("gpu.idle") is False for r in rows), rows
        cli("stop", "g1", "--grace", "1", check=True)
        cli.wait_state("g1", "STOPPED")
    finally:
        if stale.poll() is None:
            stale.kill()
        stale.wait()
