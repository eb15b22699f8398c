"""A run's store opened on its box with the store's variables among the run's secrets
(onbox.sealing.stores.open_box_store): only those reach the client, they win over the box's own
configuration, half an AWS key pair is refused, and a secrets file others may read is not used.
The end-to-end proof over real S3 and a (fake) Hub is tests/integration/test_store_secrets.py."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict

import pytest

from onbox.common.errors import HostError, UsageError
from onbox.common.rundir import RunDir
from onbox.sealing.stores import Store, open_box_store, open_store

# The S3 extra (boto3) is not in every environment the unit tests run in (the Python 3.9 stage).
pytest.importorskip("boto3")

from onbox.sealing.stores.s3 import S3Store  # noqa: E402


def s3(store: Store) -> S3Store:
    assert isinstance(store, S3Store)
    return store


@pytest.fixture
def box(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """RGT_HOME, and a box whose own AWS configuration is another identity's."""
    home = str(tmp_path / "home")
    monkeypatch.setenv("RGT_HOME", home)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "boxownkey")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "boxownsecret")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    return home


def _write_secrets(run: str, doc: Dict[str, str], mode: int = 0o600) -> None:
    path = RunDir(run).secrets_file
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f)
    os.chmod(path, mode)


def test_the_runs_store_variables_win_over_the_boxs(box: str) -> None:
    _write_secrets(
        "r1",
        {
            "AWS_ACCESS_KEY_ID": "runkeyid",
            "AWS_SECRET_ACCESS_KEY": "runsecret",
            "AWS_REGION": "eu-west-3",
            "AWS_ENDPOINT_URL": "http://127.0.0.1:2",
            "WANDB_API_KEY": "the job's",
        },
    )
    store = s3(open_box_store("s3://bucket/p", "r1"))
    client = store.client
    creds = store.credentials()
    assert (creds.access_key, creds.secret_key) == ("runkeyid", "runsecret")
    assert client.meta.region_name == "eu-west-3"
    assert store.endpoint == "http://127.0.0.1:2"
    # The job file's endpoint_url, the run's own setting, still wins over the secret's.
    store = s3(open_store("s3://bucket/p", endpoint_url="http://127.0.0.1:3", secrets={}))
    assert store.endpoint == "http://127.0.0.1:3"


def test_a_run_without_secrets_uses_the_boxs_own_configuration(box: str) -> None:
    store = s3(open_box_store("s3://bucket/p", "r2"))
    assert store.endpoint == "http://127.0.0.1:1"  # the client (and its session) made here
    assert store.credentials().access_key == "boxownkey"


def test_half_an_aws_key_pair_is_refused(box: str) -> None:
    _write_secrets("r3", {"AWS_ACCESS_KEY_ID": "runkeyid"})
    with pytest.raises(UsageError, match="not AWS_SECRET_ACCESS_KEY") as e:
        open_box_store("s3://bucket/p", "r3")
    assert "together" in (e.value.remedy or "")


def test_a_secrets_file_others_may_read_is_not_used(box: str) -> None:
    _write_secrets("r4", {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}, mode=0o644)
    with pytest.raises(HostError, match="readable by others"):
        open_box_store("s3://bucket/p", "r4")
