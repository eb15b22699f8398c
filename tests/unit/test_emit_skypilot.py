"""`rgt emit skypilot`: the task YAML's structure without SkyPilot installed (its own parser
checks it in tests/optin/test_skypilot_parser.py): the run step is the agent in the foreground,
setup installs rgt, the bucket is the store, secrets are names only, the preemption hook asks
rgt for the final seal within a budget derived from the seal time."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from typing import Any, Dict, Optional

import pytest

from controller.emit import skypilot
from onbox.common.errors import FINAL_EXIT_CODES, PERMANENT_EXIT_CODES
from onbox.common.sealtime import SealTime

yaml = pytest.importorskip("yaml")

RGT = os.path.join(os.path.dirname(sys.executable), "rgt")
PLANTED_FILE = "hf_" + "Skyplantedjobfilesecret012345678"
PLANTED_ENV = "planted-sky-laptop-secret-4321"


def emit(tmp: str, body: str, *args: str, env: Optional[Dict[str, str]] = None) -> Any:
    path = os.path.join(tmp, "job.toml")
    with open(path, "w") as f:
        f.write(body)
    e = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "RGT_"))}
    e.update(RGT_CONTROLLER_HOME=os.path.join(tmp, "ctl"), **(env or {}))
    return subprocess.run(
        [RGT, "emit", "skypilot", "job.toml", *args],
        cwd=tmp,
        env=e,
        capture_output=True,
        text=True,
        timeout=60,
    )


JOB = (
    'name = "skyrun"\ncommand = ["torchrun", "train.py"]\n'
    f'[env]\nHF_TOKEN = "{PLANTED_FILE}"\nWANDB_MODE = "offline"\n'
)


def test_task_structure_and_no_secret_values(tmp_path: Any) -> None:
    r = emit(
        str(tmp_path),
        JOB,
        "--store", "s3://bucket/rgt", "--gpus", "A100:8", "--spot", "--seal-time", "40",
        "--secret-env", "WANDB_API_KEY",
        env={"AWS_SECRET_ACCESS_KEY": PLANTED_ENV, "WANDB_API_KEY": PLANTED_ENV + "w"},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    for planted in (PLANTED_FILE, PLANTED_ENV):
        assert planted not in r.stdout and planted not in r.stderr
    doc = yaml.safe_load(r.stdout)
    assert doc["secrets"] == {
        "AWS_ACCESS_KEY_ID": None,
        "AWS_SECRET_ACCESS_KEY": None,
        "WANDB_API_KEY": None,
    }
    assert "envs" not in doc or all(v is None for v in doc["envs"].values())
    budget = SealTime(40.0, 1, "given").lead(
        assumed=skypilot.ASSUMED_SEAL_S, slack=skypilot.HOOK_SLACK_S, floor=30
    )
    run = shlex.split(doc["run"])
    assert run[:4] == ["exec", "rgt-agent", "run", "job.toml"]
    assert run[run.index("--name") + 1] == "skyrun"
    assert run[run.index("--store") + 1] == "s3://bucket/rgt"
    assert int(run[run.index("--grace") + 1]) == budget
    assert "remote-gpu-trainer[s3]" in doc["setup"]
    res = doc["resources"]
    assert (res["accelerators"], res["use_spot"]) == ("A100:8", True)
    rec = res["job_recovery"]
    assert FINAL_EXIT_CODES["PREEMPTED"] in rec["recover_on_exit_codes"]
    assert not set(rec["recover_on_exit_codes"]) & set(PERMANENT_EXIT_CODES)
    (hook,) = doc["config"]["hooks"]
    assert set(hook["events"]) == {"preemption", "stop"}
    sync = shlex.split(hook["run"].split("||")[0])
    assert sync == ["rgt-agent", "sync", "skyrun", "--timeout", f"{budget}s"]
    assert hook["timeout"] > budget  # rgt's own deadline fires first
    # A sync that did not seal (exit 22, or 7 for a run frozen by a NaN loss) is said after the
    # agent's own line, and does not fail the hook: SkyPilot goes on with the event.
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "rgt-agent").write_text(
        "#!/bin/sh\necho 'rgt-agent: error: step 9 is not sealed' >&2\nexit 22\n"
    )
    (bindir / "rgt-agent").chmod(0o755)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"}
    ran = subprocess.run(
        ["sh", "-c", hook["run"]], env=env, capture_output=True, text=True, timeout=30
    )
    assert ran.returncode == 0, ran
    assert ran.stderr.splitlines() == [
        "rgt-agent: error: step 9 is not sealed",
        skypilot.HOOK_FAILED,
    ]
    assert "measured" in r.stdout.splitlines()[1] or "given" in r.stdout.splitlines()[1]
    assert "HF_TOKEN" in r.stderr  # told to move the job file's credential out


def test_not_measured_says_so_and_file_stores_are_refused(tmp_path: Any) -> None:
    tmp = str(tmp_path)
    # Offline: the seal time is looked for in the store and not found, without the network.
    r = emit(tmp, JOB, "--store", "hf://user/repo", env={"HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr
    assert "NOT MEASURED, assumed" in r.stdout.splitlines()[1]
    doc = yaml.safe_load(r.stdout)
    assert doc["secrets"] == {"HF_TOKEN": None} and "[hf]" in doc["setup"]
    r = emit(tmp, JOB, "--store", "file:///mnt/x")
    assert r.returncode == 2 and "--store" in r.stderr and r.stdout == ""
    r = emit(tmp, JOB)
    assert r.returncode == 2 and "bucket" in r.stderr
    r = emit(tmp, JOB, "--store", "s3://bkt/p", "--gpus", "A100;rm -rf /")
    assert r.returncode == 2 and "--gpus" in r.stderr


def test_out_replaces_a_file_atomically(tmp_path: Any) -> None:
    tmp = str(tmp_path)
    out = os.path.join(tmp, "task.yaml")
    with open(out, "w") as f:
        f.write("old: true\n")
    r = emit(tmp, JOB, "--store", "s3://bkt/p", "--out", "task.yaml")
    assert r.returncode == 0, r.stderr and r.stdout == ""
    with open(out) as f:
        assert yaml.safe_load(f)["name"] == "skyrun"
    assert set(os.listdir(tmp)) - {"ctl"} == {"job.toml", "task.yaml"}
