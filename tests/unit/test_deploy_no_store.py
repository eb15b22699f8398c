"""`rgt deploy` warns, in one line, when a run gets no store at all (controller/deploy/flow.py):
no --store, none in the job file, and no durable mount of the profile's that rgt defaults to; or
one that is durable only on some of the storage that may be at its path (RunPod's /workspace)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import pytest

from controller.deploy import flow
from controller.deploy.request import DeployRequest, check_request


def _said(
    tmp_path: Path, profile: str, store: Optional[str] = None, job: Optional[str] = None
) -> List[str]:
    job_file = None
    if job is not None:
        (tmp_path / "job.toml").write_text(job)
        job_file = str(tmp_path / "job.toml")
    req = DeployRequest(
        target="local" if profile == "local" else "me@gpu.example.com",
        command=[] if job_file else ["python", "train.py"],
        job_file=job_file,
        profile=profile,
        store=store,
        project=str(tmp_path),
        slurm_time="1:00:00" if profile == "slurm" else None,
    )
    said: List[str] = []
    flow._warn_no_store(check_request(req, {}), said.append)
    return said


@pytest.fixture(autouse=True)
def _no_user_profiles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RGT_CONTROLLER_HOME", str(tmp_path / "ctl"))
    monkeypatch.delenv("RGT_PROFILES_DIR", raising=False)


@pytest.mark.parametrize("profile", ["generic-ssh", "lambda", "vastai"])
def test_no_store_and_no_durable_mount_is_one_warning_line(tmp_path: Path, profile: str) -> None:
    said = _said(tmp_path, profile)
    assert len(said) == 1, said
    assert said[0].startswith("rgt: warning: no --store"), said
    assert f"profile {profile}" in said[0] and "gone if it is destroyed" in said[0], said
    assert "--store s3://" in said[0] and "--store file:///" in said[0], said


@pytest.mark.parametrize("profile", ["autodl", "slurm", "kubernetes", "local"])
def test_a_profile_with_a_durable_default_is_not_warned(tmp_path: Path, profile: str) -> None:
    assert _said(tmp_path, profile) == []


def test_a_store_given_or_in_the_job_file_is_not_warned(tmp_path: Path) -> None:
    assert _said(tmp_path, "generic-ssh", store="s3://bucket/rgt") == []
    job = 'command = ["python", "train.py"]\nstore = "file:///mnt/durable/rgt"\n'
    assert _said(tmp_path, "generic-ssh", job=job) == []


def test_a_default_durable_only_on_some_storage_is_warned_with_the_truth(tmp_path: Path) -> None:
    """RunPod's /workspace outlives the pod only when a Network Volume is mounted there; else it
    is the pod's volume disk, deleted on terminate. Before, /workspace counted as durable and a
    deploy with no store said nothing."""
    said = _said(tmp_path, "runpod")
    assert len(said) == 1, said
    line = said[0]
    assert line.startswith("rgt: warning: no --store, so checkpoints go to profile runpod's"), line
    assert "/workspace, which outlives the box only on network-volume, not on volume" in line, line
    assert "durable only when a Network Volume is mounted there" in line, line
    assert "check with the provider" in line and "--store s3://BUCKET/PREFIX" in line, line
    assert _said(tmp_path, "runpod", store="s3://bucket/rgt") == []
