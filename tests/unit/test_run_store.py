"""A run's store as the laptop records and opens it (controller/runstore.py): the job file's
``[store] endpoint_url`` and ``stall`` are recorded with the run, by the box's own rule for a
``--store`` that replaces the job file's store (the endpoint stays for an s3:// one), and a
record written before these fields still loads. The end-to-end proof over a real S3 server is
tests/integration/test_store_endpoint.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Optional

import pytest

from controller.deploy.request import DeployRequest, Plan, check_request
from controller.registry import Registry
from controller.runstore import open_run_store, run_store_stall, run_store_url, store_fields
from onbox.common.errors import UsageError
from onbox.common.storeurl import RESTORE_STALL

EP = "http://127.0.0.1:9000"
TABLE = f'[store]\nurl = "s3://jobs/rgt"\nendpoint_url = "{EP}"\nstall = "7m"\n'


@pytest.fixture(autouse=True)
def _no_user_profiles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RGT_CONTROLLER_HOME", str(tmp_path / "ctl"))
    monkeypatch.delenv("RGT_PROFILES_DIR", raising=False)


def _plan(tmp_path: Path, store_table: str, store: Optional[str] = None) -> Plan:
    (tmp_path / "job.toml").write_text('command = ["python", "train.py"]\n' + store_table)
    req = DeployRequest(
        target="me@gpu.example.com",
        command=[],
        job_file=str(tmp_path / "job.toml"),
        profile="generic-ssh",
        store=store,
        project=str(tmp_path),
    )
    return check_request(req, {})


def _recorded(plan: Plan) -> Dict[str, Any]:
    return store_fields(plan.req.store or plan.job_store, plan.store_endpoint, plan.store_stall)


def test_the_job_files_endpoint_and_stall_are_recorded(tmp_path: Path) -> None:
    fields = _recorded(_plan(tmp_path, TABLE))
    assert fields == {"store": "s3://jobs/rgt", "store_endpoint_url": EP, "store_stall": 420.0}


def test_an_s3_store_flag_keeps_the_job_files_endpoint_as_the_box_does(tmp_path: Path) -> None:
    fields = _recorded(_plan(tmp_path, TABLE, store="s3://other/p"))
    assert fields == {"store": "s3://other/p", "store_endpoint_url": EP, "store_stall": 420.0}


def test_a_file_store_flag_has_no_endpoint(tmp_path: Path) -> None:
    fields = _recorded(_plan(tmp_path, TABLE, store="file:///mnt/durable"))
    assert fields["store"] == "file:///mnt/durable" and fields["store_endpoint_url"] is None


def test_a_plain_store_url_records_no_endpoint_and_no_stall(tmp_path: Path) -> None:
    fields = _recorded(_plan(tmp_path, 'store = "s3://jobs/rgt"\n'))
    assert fields == {"store": "s3://jobs/rgt", "store_endpoint_url": None, "store_stall": None}


def test_a_bad_endpoint_kept_for_a_store_flag_is_refused_before_anything(tmp_path: Path) -> None:
    table = '[store]\nurl = "s3://jobs/rgt"\nendpoint_url = "ftp://x"\n'
    with pytest.raises(UsageError) as e:
        _plan(tmp_path, table, store="s3://other/p")
    assert "store.endpoint_url" in e.value.what


def test_a_record_from_before_the_fields_loads_and_opens_at_boto3s_endpoint(
    tmp_path: Path,
) -> None:
    ctl = tmp_path / "old-ctl"
    ctl.mkdir()
    old = {"name": "r", "target": {"kind": "local"}, "store": f"file://{tmp_path}"}
    (ctl / "runs.json").write_text(json.dumps({"runs": {"r": old}}))
    rec = Registry(str(ctl)).get("r")
    assert rec.store_endpoint_url is None and rec.store_stall is None
    assert run_store_url(rec).endpoint_url is None
    assert run_store_stall(rec) == RESTORE_STALL
    assert open_run_store(rec).url == f"file://{tmp_path}"


def test_a_recorded_endpoint_is_checked_again_when_opened(tmp_path: Path) -> None:
    ctl = tmp_path / "edited"
    ctl.mkdir()
    doc = {"name": "r", "target": {"kind": "local"}, "store": "s3://jobs/rgt"}
    doc["store_endpoint_url"] = "file:///etc"  # a hand-edited runs.json
    (ctl / "runs.json").write_text(json.dumps({"runs": {"r": doc}}))
    rec = Registry(str(ctl)).get("r")
    with pytest.raises(UsageError) as e:
        run_store_url(rec)
    assert "endpoint_url" in e.value.field
