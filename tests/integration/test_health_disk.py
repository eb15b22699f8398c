"""The disk probe in a real agent: a job fills its checkpoint filesystem's inodes (a real tmpfs
with bytes to spare), the agent says so in its status and events, and the training API's saves
inside the job are held back until the files are gone.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from typing import Any, Dict, Iterator

import pytest

from tests import mounts
from tests.conftest import Cli, fixture, require
from tests.polling import wait

NAME = "diskfull"


@pytest.fixture
def tmpfs(tmp_path: Any) -> Iterator[str]:
    """A 64 MiB tmpfs with 2000 inodes, mounted for real; unmounted at the end (after the
    test's processes are killed: ``cli`` is set up after it, so torn down before it)."""
    with mounts.tmpfs(str(tmp_path / "fs"), "size=64m,nr_inodes=2000", "rgt-health-disk") as path:
        yield path


def _log(cli: Cli) -> str:
    try:
        with open(os.path.join(cli.home, "runs", NAME, "attempts", "0001", "output.log")) as f:
            return f.read()
    except FileNotFoundError:
        return ""


def _disk(st: Dict[str, Any]) -> Dict[str, Any]:
    probes: Dict[str, Any] = (st.get("health") or {}).get("probes") or {}
    return probes.get("disk") or {}


def test_inodes_full_alerts_in_status_and_events_and_holds_the_jobs_saves(
    tmpfs: str, cli: Cli
) -> None:
    require(
        subprocess.run([sys.executable, "-c", "import torch"], capture_output=True).returncode == 0,
        "torch",
    )
    ckpt = os.path.join(tmpfs, "ckpt")
    job = os.path.join(cli.home, "job.toml")
    with open(job, "w") as f:
        f.write(
            f"command = {json.dumps([*fixture('inode_filler.py'), '90'])}\n"
            f"[checkpoint]\ndir = {json.dumps(ckpt)}\n"
            "[health]\ninterval = 1\n"
            '[health.disk]\nscratch = "1M"\n'
        )
    cli("start", job, "--name", NAME, check=True)
    job_pid = None
    try:
        st = cli.wait_for(
            NAME, lambda s: _disk(s).get("level") == "alert", 60, "the disk probe's alert"
        )
        job_pid = st.get("pid")
        disk = _disk(st)
        assert disk["code"] == "inodes_full", disk
        assert tmpfs in disk["reason"] and "ckpt" in disk["reason"]
        assert "bytes to spare" in disk["reason"] and "held back" in disk["reason"]
        assert disk["remedy"]
        hold = os.path.join(cli.home, "runs", NAME, "checkpoint.hold")
        assert os.path.exists(hold)
        events = [e for e in cli.events(NAME) if e.get("kind") == "health"]
        assert any(e.get("probe") == "disk" and e.get("level") == "alert" for e in events), events
        # The job's saves return None while held, and write nothing.
        wait(lambda: re.search(r"save \d+ -> None", _log(cli)), 30, "a save held back")
        log = _log(cli)
        assert log.startswith("save 1 -> " + ckpt), log
        assert log.count("checkpoint skipped") == 1, log  # said once per hold, not per call
        # Room again: the hold goes, and the next save writes a checkpoint.
        filler = os.path.join(ckpt, "filler")
        for name in os.listdir(filler):
            os.unlink(os.path.join(filler, name))
        wait(lambda: not os.path.exists(hold), 30, "the hold released")
        wait(
            lambda: re.search(r"save \d+ -> /", _log(cli).split("-> None")[-1]),
            30,
            "a save written after the hold",
        )
        st = cli.wait_for(NAME, lambda s: _disk(s).get("level") == "ok", 30, "disk ok")
        assert os.listdir(ckpt)  # the probe deleted nothing of the job's
    finally:
        p = cli("stop", NAME, timeout=60)
        if job_pid and p.returncode != 0:
            try:
                os.kill(int(job_pid), 9)
            except ProcessLookupError:
                pass


def test_checkpointer_save_is_skipped_while_held_and_said_once(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    import torch

    from onbox.train import Checkpointer

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    monkeypatch.setenv("RGT_RUN_DIR", str(run_dir))
    (run_dir / "checkpoint.hold").write_text('{"reason": "test"}')
    model = torch.nn.Linear(2, 2)
    ckpt = Checkpointer(str(tmp_path / "ckpt"), model=model, handle_signals=False)
    assert ckpt.save(1) is None and ckpt.save(2) is None
    assert not os.path.exists(tmp_path / "ckpt") or os.listdir(tmp_path / "ckpt") == []
    err = capfd.readouterr().err
    assert err.count("checkpoint skipped") == 1, err
    (run_dir / "checkpoint.hold").unlink()
    path = ckpt.save(3)
    assert path is not None and os.path.isdir(path)
    ckpt.close()
