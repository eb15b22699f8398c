"""A Slurm deploy plans its warning lead from the seal time measured in the store the run will
use (controller/deploy/request.py): ``--store``, else the job file's ``store`` (a URL, or a
table whose ``endpoint_url`` is where the box reads and writes it). A run that sealed before
(a requeued or re-deployed one) so gets its own, longer lead, never the assumed default that
would let the limit's kill cut its final seal short.

Real stores: a ``file://`` directory holding the run's mirrored events, and a local HTTP server
answering S3's GetObject at the job file's endpoint, boto3's own endpoint a closed port."""

from __future__ import annotations

import http.server
import json
import threading
from pathlib import Path
from typing import Any, Iterator, List

import pytest

from controller.deploy.request import DeployRequest, check_request
from controller.slurm.submit import SLACK
from onbox.agent.journal import iso
from tests.httpsink import closed_port

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


class _S3:
    """GetObject of the one key ``/BUCKET/PREFIX/r1/state/events.jsonl``, else NoSuchKey."""

    def __init__(self, key: str) -> None:
        self.paths: List[str] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                outer.paths.append(self.path)
                found = self.path.split("?")[0] == key
                body = EVENTS if found else b"<Error><Code>NoSuchKey</Code></Error>"
                self.send_response(200 if found else 404)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[_S3]:
    pytest.importorskip("boto3")
    for var, value in (("AWS_ACCESS_KEY_ID", "k"), ("AWS_SECRET_ACCESS_KEY", "s")):
        monkeypatch.setenv(var, value)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed_port()}")  # not here
    server = _S3("/jobs/rgt/r1/state/events.jsonl")
    yield server
    server.close()


def test_the_lead_is_measured_at_the_job_files_endpoint(tmp_path: Path, s3: _S3) -> None:
    ask = _lead(tmp_path, f'[store]\nurl = "s3://jobs/rgt"\nendpoint_url = "{s3.url}"\n')
    assert ask.lead == 2 * SEAL + SLACK, ask.lead_line
    assert s3.paths, "the job file's endpoint was never asked"


def test_emit_measures_at_the_job_files_endpoint_too(
    tmp_path: Path, s3: _S3, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`rgt emit skypilot`'s preemption hook budget comes from the same store, by the same rule
    (the job file's, at its endpoint, when no --store)."""
    from click.testing import CliRunner

    from controller.emit import skypilot
    from controller.emit.cli import emit

    monkeypatch.chdir(tmp_path)
    (tmp_path / "job.toml").write_text(
        f'name = "r1"\ncommand = ["python", "train.py"]\n'
        f'[store]\nurl = "s3://jobs/rgt"\nendpoint_url = "{s3.url}"\n'
    )
    r = CliRunner().invoke(emit, ["skypilot", "job.toml"])
    assert r.exit_code == 0, r.output
    assert f"--timeout {2 * SEAL + skypilot.HOOK_SLACK_S}s" in r.output, r.output


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
