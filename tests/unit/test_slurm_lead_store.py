"""A Slurm deploy plans its warning lead from the seal time measured in the store the run will
use (controller/deploy/request.py): ``--store``, else the job file's ``store`` (a URL, or a
table whose ``endpoint_url`` is where the box reads and writes it). A run that sealed before
(a requeued or re-deployed one) so gets its own, longer lead, never the assumed default that
would let the limit's kill cut its final seal short.

Real stores: a ``file://`` directory holding the run's mirrored events, and a local HTTP server
answering S3's GetObject at the job file's endpoint, boto3's own endpoint a closed port."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from controller.deploy.request import DeployRequest, check_request
from controller.slurm.submit import SLACK
from onbox.agent.journal import iso

T0 = 1_790_000_000.0
SEAL = 300  # the run's measured seal: longer than the lead assumed without a measurement
EVENTS = "".join(
    json.dumps({"time": iso(T0 + at), "kind": kind}) + "\n"
    for kind, at in (("checkpoint_asked", 0), ("sealed", SEAL))
).encode()


@pytest.fixture(autouse=True)
def _no_user_profiles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RGT_CONTROLLER_HOME", str(tmp_path / "ctl"))
    monkeypatch.delenv("RGT_PROFILES_DIR", raising=False)


def _lead(tmp_path: Path, store_setting: str, **more: Any) -> Any:
    job = tmp_path / "job.toml"
    job.write_text('name = "r1"\ncommand = ["python", "train.py"]\n' + store_setting)
    req = DeployRequest(
        target="me@login.example.com",
        command=[],
        job_file=str(job),
        profile="slurm",
        project=str(tmp_path),
        slurm_time="4:00:00",
        **more,
    )
    ask = check_request(req, {}).slurm
    assert ask is not None
    return ask


def _file_store(tmp_path: Path) -> str:
    state = tmp_path / "store" / "r1" / "state"
    state.mkdir(parents=True)
    (state / "events.jsonl").write_bytes(EVENTS)
    return f"file://{tmp_path / 'store'}"


@pytest.mark.parametrize("form", ["url", "table"])
def test_the_lead_is_measured_in_the_job_files_store(tmp_path: Path, form: str) -> None:
    url = _file_store(tmp_path)
    setting = f'store = "{url}"\n' if form == "url" else f'[store]\nurl = "{url}"\n'
    ask = _lead(tmp_path, setting)
    assert ask.lead == 2 * SEAL + SLACK, ask.lead_line
    assert "measured" in ask.lead_line and "NOT MEASURED" not in ask.lead_line


def test_a_store_flag_still_wins_over_the_job_files(tmp_path: Path) -> None:
    url = _file_store(tmp_path)
    (tmp_path / "empty").mkdir()
    ask = _lead(tmp_path, f'store = "file://{tmp_path / "empty"}"\n', store=url)
    assert ask.lead == 2 * SEAL + SLACK, ask.lead_line
    ask = _lead(tmp_path, f'store = "{url}"\n', store=f"file://{tmp_path / 'empty'}")
    assert "NOT MEASURED" in ask.lead_line


def test_a_slurm_arrays_lead_covers_the_slowest_cell_measured(tmp_path: Path) -> None:
    """A job array's one ``--signal`` lead is every task's: measured over the cells' own runs
    in the sweep's store, the longest seal of them, not the first cell's alone."""
    from controller.slurm.array import plan_ask
    from controller.sweep.plan import load_plan

    store = tmp_path / "store"
    plan_file = tmp_path / "PLAN.toml"
    plan_file.write_text(
        f'name = "lr"\nstore = "file://{store}"\nslurm = "login1"\n'
        'command = ["python", "train.py", "--lr", "{lr}"]\n'
        '[grid]\nlr = [0.1, 0.01, 0.001]\n[sbatch]\ntime = "4:00:00"\n'
    )
    cells = load_plan(str(plan_file)).cells
    for cell, seconds in ((cells[0], 100), (cells[2], SEAL)):
        state = store / cell.name / "state"
        state.mkdir(parents=True)
        (state / "events.jsonl").write_bytes(
            EVENTS.replace(iso(T0 + SEAL).encode(), iso(T0 + seconds).encode())
        )
    ask = plan_ask(load_plan(str(plan_file)))
    assert ask.lead == 2 * SEAL + SLACK, ask.lead_line
    assert f"run {cells[2].name}" in ask.lead_line and "2 of them measured" in ask.lead_line
