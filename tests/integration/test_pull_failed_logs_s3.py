"""The job's log of a run that FAILED with an S3 store outlives its box (a real SeaweedFS).

tests/integration/test_pull_failed_logs.py shows it for a file:// store. Here the store is
``s3://``: the agent seals the log and ENDED.json into the bucket as it lets go of the failed
run, `rgt pull --from store` brings the checkpoint and the log, each checked against the
store's sha256, and `--from box` takes the log from the store as well (ENDED.json's logs are
never the box's copy, which may be another attempt's: controller/results/sealed.py), the
checkpoint from the box. `rgt down` (its plan reads ENDED.json from the bucket) lists no job log
as lost, and says the bucket holds the log sealed after a pull of nothing. A real agent, a real
S3 server.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Any, Dict, List

import pytest

from controller.registry import Registry
from controller.remote import open_remote
from controller.results.down import down, plan_down
from controller.results.pull import covers_newest, pull
from tests.conftest import Cli
from tests.integration.test_down import Box
from tests.integration.test_pull import RUN, _read, _rec
from tests.integration.test_sealing_s3 import _get, _keys
from tests.seaweed import SeaweedServer

# A job that writes one checkpoint (atomically, as real scripts do), then fails: its log holds
# what the user needs (the error). The agent seals the checkpoint as the run ends FAILED.
_FAIL = (
    "import os, sys\n"
    "d = os.environ['RGT_CKPT_DIR']\n"
    "os.makedirs(d, exist_ok=True)\n"
    "with open(os.path.join(d, 'step_1.pt.tmp'), 'wb') as f:\n"
    "    f.write(b'weights of step 1' * 100)\n"
    "os.replace(os.path.join(d, 'step_1.pt.tmp'), os.path.join(d, 'step_1.pt'))\n"
    "print('step 1 loss 2.5', flush=True)\n"
    "print('RuntimeError: CUDA error: an illegal memory access', file=sys.stderr, flush=True)\n"
    "sys.exit(3)\n"
)


def _failed_s3_run(
    cli: Cli, tmp_path: Any, s3_server: SeaweedServer, monkeypatch: pytest.MonkeyPatch
) -> str:
    """A run with an S3 store whose job failed (no restart), its agent gone; the store URL.
    The agent and this process (the laptop) both get the server's credentials."""
    cli.env.update(s3_server.env(cli.env))
    for var, value in s3_server.env({}).items():
        monkeypatch.setenv(var, value)
    url = f"s3://{s3_server.bucket()}/rgt"
    (tmp_path / "fail.py").write_text(_FAIL)
    job = tmp_path / "job.toml"
    job.write_text(
        f"command = {json.dumps([sys.executable, str(tmp_path / 'fail.py')])}\n"
        f'store = "{url}"\n[restart]\nmax_error_restarts = 0\n'
    )
    cli("start", str(job), "--name", RUN, check=True)
    cli.wait_for(
        RUN,
        lambda s: s["state"] == "FAILED" and not s["agent"]["alive"],
        timeout=120,
        what="FAILED and the agent gone",
    )
    return url


def test_a_failed_runs_log_lands_in_the_bucket_and_is_pulled_from_the_store_or_the_box(
    cli: Cli,
    tmp_path: Any,
    laptop: str,
    s3_server: SeaweedServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = _failed_s3_run(cli, tmp_path, s3_server, monkeypatch)
    keys = _keys(s3_server, url)
    assert f"{RUN}/ENDED.json" in keys and f"{RUN}/logs/e1/attempt-0001.log" in keys, keys
    assert f"{RUN}/DONE.json" not in keys, keys
    ended = _get(s3_server, url, f"{RUN}/ENDED.json")
    assert ended["state"] == "FAILED", ended
    assert [f["path"] for f in ended["files"]] == ["e1/attempt-0001.log"], ended
    sha = ended["files"][0]["sha256"]

    rec = _rec(url, cli.home)
    receipt = pull(rec, str(tmp_path / "dest"), "store")
    assert receipt.sealed.ended_sha256 is not None and receipt.sealed.step == 1, receipt.sealed
    files: Dict[str, Any] = {f.path: f for f in receipt.files}
    assert "logs/e1/attempt-0001.log" in files and "checkpoints/step_1.pt" in files, files
    log = files["logs/e1/attempt-0001.log"]
    assert log.sha256 == sha and log.source == f"{RUN}/logs/e1/attempt-0001.log", log
    assert log.verified == "sha256" and not log.redacted, log
    text = _read(str(tmp_path / "dest" / "logs" / "e1" / "attempt-0001.log"))
    assert hashlib.sha256(text).hexdigest() == sha
    assert b"CUDA error: an illegal memory access" in text, text
    assert covers_newest(rec, receipt)

    # --from box: the checkpoint is the box's copy, the log the store's. The box's log changed
    # after the seal (here: appended to) would fail its sha256 check if it were taken.
    box_log = os.path.join(cli.home, "runs", RUN, "attempts", "0001", "output.log")
    with open(box_log, "ab") as f:
        f.write(b"written after the seal\n")
    again = pull(rec, str(tmp_path / "from-box"), "box")
    by_path = {f.path: f for f in again.files}
    assert by_path["logs/e1/attempt-0001.log"].source == f"{RUN}/logs/e1/attempt-0001.log", by_path
    assert by_path["checkpoints/step_1.pt"].source.startswith(cli.home), by_path
    assert _read(str(tmp_path / "from-box" / "logs" / "e1" / "attempt-0001.log")) == text
    assert again.sealed == receipt.sealed


def _never(prompt: str) -> str:
    raise AssertionError(f"down asked {prompt!r} before it should have")


def _lost(shown: List[str]) -> str:
    """What down's plan lists as lost (between "will be lost" and "kept:")."""
    text = "\n".join(shown)
    return text.split("will be lost")[1].split("\nkept:")[0] if "will be lost" in text else ""


def test_down_of_a_failed_run_keeps_its_log_in_the_bucket_and_does_not_call_it_lost(
    cli: Cli,
    tmp_path: Any,
    laptop: str,
    s3_server: SeaweedServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """tests/integration/test_pull_failed_logs.py shows it for a file:// store: after a pull
    from the bucket (the checkpoint and the log its agent sealed with ENDED.json), down's plan
    lists no job log as lost; down removes the run from the box and leaves the bucket as it
    was."""
    url = _failed_s3_run(cli, tmp_path, s3_server, monkeypatch)
    before = _keys(s3_server, url)
    rec = _rec(url, cli.home)
    Registry().put(rec)
    pull(rec, str(tmp_path / "dest"), "store")
    shown: List[str] = []
    down(rec, yes=True, interactive=False, ask=_never, show=shown.append)
    text = "\n".join(shown)
    assert "job log" not in _lost(shown), text  # the receipt has it
    assert f"the pulled files in {tmp_path / 'dest'}" in text, text
    assert not os.path.exists(os.path.join(cli.home, "runs", RUN))
    assert _keys(s3_server, url) == before


def test_down_of_a_run_pulled_with_nothing_sealed_reads_the_log_sealed_in_the_bucket_after(
    cli: Cli,
    tmp_path: Any,
    laptop: str,
    s3_server: SeaweedServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As test_down_unsealed.py's file:// case: pulled from the bucket while nothing was
    sealed; then the run stopped before any checkpoint and its agent sealed the job's log there
    with ENDED.json. Down goes on that receipt; its plan says the bucket holds the log (kept),
    not that nothing is sealed, and lists no job log as lost."""
    cli.env.update(s3_server.env(cli.env))
    for var, value in s3_server.env({}).items():
        monkeypatch.setenv(var, value)
    url = f"s3://{s3_server.bucket()}/rgt"
    box = Box(cli, tmp_path, store=url)
    rec = box.record()
    receipt = pull(rec, str(tmp_path / "dest"), "store")
    assert receipt.sealed.nothing, receipt.sealed
    cli("stop", RUN, check=True, timeout=120)
    cli.wait_for(
        RUN,
        lambda s: s["state"] == "STOPPED" and not s["agent"]["alive"],
        what="STOPPED and the agent gone",
    )
    keys = _keys(s3_server, url)
    assert f"{RUN}/ENDED.json" in keys and f"{RUN}/LATEST.json" not in keys, keys
    head = plan_down(rec, open_remote(rec.target)).lines()[1]
    held = "the store holds the job's log of 1 attempt (sealed as its agent let go of the run)"
    assert held in head, head
    shown: List[str] = []
    down(rec, yes=True, interactive=False, ask=_never, show=shown.append)
    text = "\n".join(shown)
    assert "job log" not in _lost(shown), text
    assert f"job log of attempt 1: sealed in the store {url}" in text, text
    assert not os.path.exists(box.run_dir)
    assert _keys(s3_server, url) == keys
