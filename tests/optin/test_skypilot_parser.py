"""Opt-in: the task YAML of `rgt emit skypilot` through SkyPilot's own parser (sky.Task.from_yaml).

Collected only with RGT_SKYPILOT_TESTS=1. SkyPilot is large and not a dependency of rgt: the test
uses the Python of $RGT_SKYPILOT_PYTHON when set, else pip-installs skypilot (RGT_SKYPILOT_SPEC,
default "skypilot") into a venv under /tmp once (reused by later runs), and skips with the reason
when that cannot be done (no network, no venv module); nothing here is a service CI has.

    RGT_SKYPILOT_TESTS=1 .venv/bin/pytest -q tests/optin/test_skypilot_parser.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from onbox.common.errors import FINAL_EXIT_CODES

RGT = os.path.join(os.path.dirname(sys.executable), "rgt")
VENV = "/tmp/rgt-sky-venv"
PLANTED = "hf_" + "Optinplantedsecret0123456789ab"

if not os.environ.get("RGT_SKYPILOT_TESTS"):  # collected for another opt-in (RGT_HF_TESTS)
    pytest.skip("set RGT_SKYPILOT_TESTS=1 to check the task with SkyPilot", allow_module_level=True)

# What SkyPilot's parser made of the file, as JSON (run in SkyPilot's Python).
_READ = """
import json, sys
import sky
t = sky.Task.from_yaml(sys.argv[1])
r = next(iter(t.resources))
print(json.dumps({
    "name": t.name,
    "run": t.run,
    "setup": t.setup,
    "secret_values": [str(v) for v in t.secrets.values()],
    "envs": dict(t.envs),
    "accelerators": r.accelerators,
    "use_spot": r.use_spot,
    "job_recovery": r.job_recovery,
    "yaml": t.to_yaml_config(),
}, default=str))
"""


def sky_python() -> str:
    given = os.environ.get("RGT_SKYPILOT_PYTHON")
    if given:
        return given
    py = os.path.join(VENV, "bin", "python")
    ok = (
        os.path.exists(py)
        and subprocess.run([py, "-c", "import sky"], capture_output=True).returncode == 0
    )
    if not ok:
        made = subprocess.run([sys.executable, "-m", "venv", VENV], capture_output=True, text=True)
        if made.returncode != 0:
            pytest.skip(f"cannot make a venv for SkyPilot: {made.stderr.strip()[-300:]}")
        spec = os.environ.get("RGT_SKYPILOT_SPEC", "skypilot")
        pip = subprocess.run(
            [py, "-m", "pip", "install", "-q", spec], capture_output=True, text=True, timeout=900
        )
        if pip.returncode != 0:
            pytest.skip(f"cannot install {spec}: {pip.stderr.strip()[-300:]}")
    return py


def test_skypilots_parser_reads_the_task(tmp_path: Any) -> None:
    py = sky_python()
    tmp = str(tmp_path)
    with open(os.path.join(tmp, "job.toml"), "w") as f:
        f.write(
            f'name = "skyopt"\ncommand = ["python", "train.py"]\n[env]\nHF_TOKEN = "{PLANTED}"\n'
        )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "RGT_"))}
    env["RGT_CONTROLLER_HOME"] = os.path.join(tmp, "ctl")
    r = subprocess.run(
        [RGT, "emit", "skypilot", "job.toml", "--store", "s3://bucket-x/rgt", "--gpus", "A100:1",
         "--spot", "--seal-time", "30", "--out", "task.yaml"],
        cwd=tmp, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    sky_env = dict(os.environ, HOME=tmp, SKYPILOT_DISABLE_USAGE_COLLECTION="1")
    got = subprocess.run(
        [py, "-c", _READ, os.path.join(tmp, "task.yaml")],
        cwd=tmp, env=sky_env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert got.returncode == 0, got.stderr[-3000:]
    t = json.loads(got.stdout.strip().splitlines()[-1])
    assert t["name"] == "skyopt"
    assert t["run"].startswith("exec rgt-agent run job.toml --name skyopt")
    assert "remote-gpu-trainer[s3]" in t["setup"]
    # A secret with a null value is a required name, given at launch (`--secret NAME`).
    names = sorted(n.split(":", 1)[-1] for n in t["yaml"]["secrets"])
    assert names == ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"]
    assert t["secret_values"] == []
    assert t["accelerators"] == {"A100": 1} and t["use_spot"] is True
    assert FINAL_EXIT_CODES["PREEMPTED"] in t["job_recovery"]["recover_on_exit_codes"]
    hooks = t["yaml"].get("config", {}).get("hooks")
    assert hooks and "rgt-agent sync skyopt" in hooks[0]["run"]
    assert PLANTED not in got.stdout

    # The parser does check the hooks: the same task with an event it does not know is refused.
    with open(os.path.join(tmp, "task.yaml")) as f:
        bad = f.read().replace('- "preemption"', '- "meltdown"')
    with open(os.path.join(tmp, "bad.yaml"), "w") as f:
        f.write(bad)
    refused = subprocess.run(
        [py, "-c", _READ, os.path.join(tmp, "bad.yaml")],
        cwd=tmp, env=sky_env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert refused.returncode != 0 and "meltdown" in refused.stderr
