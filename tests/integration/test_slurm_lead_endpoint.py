"""The Slurm warning lead and `rgt emit`'s hook budget, measured at a job file's store endpoint.

A job file may name an S3-compatible store with its own ``endpoint_url`` (MinIO, R2): the
laptop must read the run's measured seal there, not at boto3's default endpoint, or the lead is
the assumed one and a final seal longer than it is cut by the time limit. A real SeaweedFS holds
the run's mirrored events; the laptop's ``AWS_ENDPOINT_URL`` points at a closed port, so a read
that ignored the job file's endpoint fails to measure. (tests/unit/test_slurm_lead_store.py has
the file:// and --store cases.)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from controller.deploy.request import DeployRequest, check_request
from controller.slurm.submit import SLACK
from onbox.agent.journal import iso
from onbox.sealing import manifest as mf
from tests.httpsink import closed_port
from tests.seaweed import SeaweedServer

SEAL = 300  # the run's measured seal: longer than the lead assumed without a measurement
EVENTS = "".join(
    json.dumps({"time": iso(1_790_000_000.0 + at), "kind": kind}) + "\n"
    for kind, at in (("checkpoint_asked", 0), ("sealed", SEAL))
).encode()


@pytest.fixture
def store_url(s3_server: SeaweedServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """An s3:// URL whose prefix holds run r1's mirrored events (a seal of SEAL seconds); the
    laptop's own endpoint is a closed port, its credentials the server's."""
    bucket = s3_server.bucket()
    s3_server.store(bucket, "rgt").put_bytes(mf.state_key("r1", "events.jsonl"), EVENTS)
    monkeypatch.setenv("RGT_CONTROLLER_HOME", str(tmp_path / "ctl"))
    monkeypatch.delenv("RGT_PROFILES_DIR", raising=False)
    for var in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    monkeypatch.setenv("AWS_DEFAULT_REGION", s3_server.region)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed_port()}")  # not here
    return f"s3://{bucket}/rgt"


def _job(tmp_path: Path, url: str, endpoint: str) -> Path:
    job = tmp_path / "job.toml"
    job.write_text(
        'name = "r1"\ncommand = ["python", "train.py"]\n'
        f'[store]\nurl = "{url}"\nendpoint_url = "{endpoint}"\n'
    )
    return job


def test_the_lead_is_measured_at_the_job_files_endpoint(
    tmp_path: Path, store_url: str, s3_server: SeaweedServer
) -> None:
    job = _job(tmp_path, store_url, s3_server.endpoint)
    req = DeployRequest(
        target="me@login.example.com",
        command=[],
        job_file=str(job),
        profile="slurm",
        project=str(tmp_path),
        slurm_time="4:00:00",
    )
    ask = check_request(req, {}).slurm
    assert ask is not None
    assert ask.lead == 2 * SEAL + SLACK, ask.lead_line


def test_emit_measures_at_the_job_files_endpoint_too(
    tmp_path: Path, store_url: str, s3_server: SeaweedServer, monkeypatch: Any
) -> None:
    """`rgt emit skypilot`'s preemption hook budget comes from the same store, by the same rule
    (the job file's, at its endpoint, when no --store)."""
    from click.testing import CliRunner

    from controller.emit import skypilot
    from controller.emit.cli import emit

    monkeypatch.chdir(tmp_path)
    _job(tmp_path, store_url, s3_server.endpoint)
    r = CliRunner().invoke(emit, ["skypilot", "job.toml"])
    assert r.exit_code == 0, r.output
    assert f"--timeout {2 * SEAL + skypilot.HOOK_SLACK_S}s" in r.output, r.output
