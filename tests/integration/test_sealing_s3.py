"""Sealing to a real S3 server (SeaweedFS) with real agents: the faults of a real network.

A user relies on: a killed agent never leaves a torn object under a final name, and the next
one finishes the job; an S3 outage only delays sealing (the backlog drains oldest first and
LATEST only moves forward); a fresh box resumes from what was sealed; a bad bucket or bad
credentials stop `start` before anything runs.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

from onbox.sealing import manifest as mf
from tests.conftest import ROOT, Cli, fixture, require
from tests.polling import wait
from tests.seaweed import SeaweedServer

WRITER = fixture("ckpt_writer.py")


def _s3(cli: Cli, s3_server: SeaweedServer) -> str:
    """Point the CLI's environment at the server (as a user would, with AWS_* variables) and
    return a fresh store URL."""
    cli.env.update(s3_server.env(cli.env))
    return f"s3://{s3_server.bucket()}/rgt"


def _get(s3_server: SeaweedServer, url: str, key: str) -> Any:
    bucket, _, prefix = url[len("s3://") :].partition("/")
    try:
        body = s3_server.client().get_object(Bucket=bucket, Key=f"{prefix}/{key}")["Body"]
        return json.loads(body.read())
    except Exception as e:  # NoSuchKey and friends
        if "NoSuchKey" in repr(e) or "404" in repr(e):
            return None
        raise


def _keys(s3_server: SeaweedServer, url: str) -> List[str]:
    bucket, _, prefix = url[len("s3://") :].partition("/")
    out: List[str] = []
    for page in (
        s3_server.client()
        .get_paginator("list_objects_v2")
        .paginate(Bucket=bucket, Prefix=prefix + "/")
    ):
        out += [o["Key"][len(prefix) + 1 :] for o in page.get("Contents", [])]
    return out


def _latest_step(s3_server: SeaweedServer, url: str, run: str) -> Optional[int]:
    """The step of ``run``'s LATEST.json, for polling: None while there is none, and while the
    server, just started again after the outage, still answers with an error (SeaweedFS gives
    InternalError for a while on a loaded machine)."""
    try:
        doc = _get(s3_server, url, f"{run}/LATEST.json")
    except Exception as e:  # botocore's ClientError / EndpointConnectionError
        if any(t in repr(e) for t in ("InternalError", "ServiceUnavailable", "Connect")):
            return None
        raise
    return None if doc is None else int(doc["step"])


def _ready(cli: Cli, name: str) -> Dict[str, Any]:
    """The run's status once its job is ready for USR2 (the handler installed)."""
    st = cli.wait_state(name, "STARTING", "RUNNING")
    cli.wait_output(name, "ready")
    return st


def _uploads(s3_server: SeaweedServer, url: str) -> List[Dict[str, Any]]:
    bucket = url[len("s3://") :].partition("/")[0]
    uploads: List[Dict[str, Any]] = (
        s3_server.client().list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    )
    return uploads


def _text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return ""


def _job(cli: Cli, name: str, url: str, mib: float) -> None:
    job = os.path.join(cli.home, f"{name}.toml")
    with open(job, "w") as f:
        f.write(
            f'command = {json.dumps([*WRITER, "on_signal", str(mib)])}\nstore = "{url}"\n'
            '[checkpoint]\ntrigger = "signal:USR2"\n'
        )
    cli("start", job, "--name", name, check=True)


def test_kill9_of_the_agent_mid_upload_leaves_nothing_torn_and_the_next_agent_seals(
    cli: Cli, s3_server: SeaweedServer
) -> None:
    url = _s3(cli, s3_server)
    cli.env["RGT_AGENT_RESPAWN_DELAY"] = "1000"  # this test restarts the agent by hand
    _job(cli, "k9", url, 160)
    st = _ready(cli, "k9")
    os.kill(st["pid"], signal.SIGUSR2)
    wait(lambda: bool(_uploads(s3_server, url)), 60, "a multipart upload in flight")
    os.kill(st["agent"]["pid"], signal.SIGKILL)
    time.sleep(0.5)
    # Nothing under a final name: no object for the checkpoint, no MANIFEST, no LATEST.
    assert not [k for k in _keys(s3_server, url) if k.startswith("k9/checkpoints/")]
    assert _get(s3_server, url, "k9/LATEST.json") is None
    assert _uploads(s3_server, url)  # the dead agent's half-done upload is still there
    cli("start", "--name", "k9", check=True)
    wait(
        lambda: (_get(s3_server, url, "k9/LATEST.json") or {}).get("step") == 1,
        60,
        "the next agent to seal step 1",
    )
    assert not _uploads(s3_server, url)  # the stale upload was aborted
    kinds = [e["kind"] for e in cli.events("k9")]
    assert "uploads_aborted" in kinds and "sealed" in kinds
    doc = _get(s3_server, url, mf.manifest_key("k9", 1))
    wrote = re.search(r"wrote step_1.pt version 1 sha256 ([0-9a-f]{64})", _text(st["log"]))
    assert wrote and doc["files"][0]["sha256"] == wrote.group(1)
    assert _get(s3_server, url, "k9/epochs/00000002") is not None
    cli("stop", "k9", "--grace", "1", check=True)


def test_an_s3_outage_delays_sealing_and_the_backlog_drains_oldest_first(
    cli: Cli, s3_server: SeaweedServer
) -> None:
    url = _s3(cli, s3_server)
    _job(cli, "out", url, 0.2)
    st = _ready(cli, "out")
    os.kill(st["pid"], signal.SIGUSR2)
    wait(lambda: _latest_step(s3_server, url, "out") == 1, 60, "step 1 sealed")
    s3_server.stop()
    try:
        for k in (2, 3, 4):
            os.kill(st["pid"], signal.SIGUSR2)
            wait(lambda k=k: f"wrote step_{k}.pt" in _text(st["log"]), 60, f"step {k}")
        wait(
            lambda: "seal_error" in [e["kind"] for e in cli.events("out")],
            60,
            "the sealer to notice the outage",
        )
        time.sleep(2)
    finally:
        s3_server.start()
    wait(lambda: _latest_step(s3_server, url, "out") == 4, 120, "the backlog to drain")
    events = cli.events("out")
    sealed = [e["step"] for e in events if e["kind"] == "sealed"]
    assert sealed == [1, 2, 3, 4]  # oldest first
    latest = [e["step"] for e in events if e["kind"] == "latest"]
    assert latest == sorted(latest)  # only forward
    assert cli.status("out")["state"] in ("STARTING", "RUNNING")  # training never stopped
    cli("stop", "out", "--grace", "1", check=True)


def test_fresh_box_resumes_a_real_pytorch_training_from_s3(
    cli: Cli, s3_server: SeaweedServer
) -> None:
    require(__import__("importlib").util.find_spec("torch") is not None, "torch")
    url = _s3(cli, s3_server)
    example = os.path.join(ROOT, "examples", "train_tiny.py")
    args = ["--steps", "80", "--ckpt-every", "10", "--sleep", "0.05"]
    cli("start", "--name", "fb3", "--store", url, "--", sys.executable, example, *args, check=True)
    wait(
        lambda: (_get(s3_server, url, "fb3/LATEST.json") or {}).get("step", 0) >= 20,
        120,
        "a sealed step >= 20",
    )
    cli("stop", "fb3", "--grace", "1", check=True)
    sealed = _get(s3_server, url, "fb3/LATEST.json")["step"]
    subprocess.run(["rm", "-rf", os.path.join(cli.home, "runs")], check=True)  # box gone
    cli("start", "--name", "fb3", "--store", url, "--", sys.executable, example, *args, check=True)
    cli.wait_state("fb3", "SUCCEEDED", timeout=240)
    out = cli("logs", "fb3", check=True).stdout
    assert f"resumed from step_{sealed}.pt at step {sealed}" in out
    first = re.search(r"^step (\d+) ", out, re.M)
    assert first is not None and int(first.group(1)) == sealed + 1
    done = _get(s3_server, url, "fb3/DONE.json")
    assert done is not None and done["latest"] == 80
    assert _get(s3_server, url, "fb3/state/state.json")["state"] == "SUCCEEDED"


def test_a_missing_bucket_or_wrong_credentials_start_nothing(
    cli: Cli, s3_server: SeaweedServer
) -> None:
    cli.env.update(s3_server.env(cli.env))
    p = cli("start", "--name", "nb", "--store", "s3://rgt-no-such-bucket/x", "--", "true")
    assert p.returncode == 14, (p.stdout, p.stderr)
    assert "store preflight failed at 'resolve'" in p.stderr and "does not exist" in p.stderr
    cli.env["AWS_SECRET_ACCESS_KEY"] = "wrong-secret"
    p = cli("start", "--name", "nb", "--store", f"s3://{s3_server.bucket()}/x", "--", "true")
    assert p.returncode in (4, 14), (p.stdout, p.stderr)
    assert "store preflight failed" in p.stderr and "credentials" in p.stderr.lower()
    assert not os.path.exists(os.path.join(cli.home, "runs", "nb", "state.json"))


def test_s3_hashes_while_uploading_so_the_sealer_reads_each_new_file_once(
    s3_server: SeaweedServer, tmp_path: Any
) -> None:
    import hashlib

    store = s3_server.store(s3_server.bucket(), "p", part_size=5 << 20)
    assert store.hashes_while_uploading
    for size in (1000, (12 << 20) + 7):  # one put, and multipart
        path = str(tmp_path / f"f{size}")
        data = os.urandom(size)
        with open(path, "wb") as f:
            f.write(data)
        info = store.put_file(f"k{size}", path, sha256=None, size=size)
        assert info.sha256 == hashlib.sha256(data).hexdigest()  # what the MANIFEST records
        got = str(tmp_path / f"g{size}")
        store.get_file(f"k{size}", got)
        with open(got, "rb") as f:
            assert f.read() == data
