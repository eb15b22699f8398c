"""`rgt deploy` of a run that is already on the box: started again by name alone, and what the
laptop says when the box's start fails.

- `rgt deploy TARGET --name N` with no command starts a STOPPED run again from the box's own
  record of it (its spec.json), also from a laptop that has no record of the run; it is refused
  with its own exit code and what to do when the box has no such run (8) or the run is live (5);
  over a real ssh too, where a --store given this time is the store the laptop records;
- a failed start's error is said once (not relayed from the box, then again as rgt's error),
  with the box's exit code and remedy;
- a start refused because another agent holds the run (exit 5) names the laptop's commands
  only, not the box's `rgt-agent status` / `rgt-agent stop`;
- a store named by the job file (not --store) is the store the laptop records (locally, and over
  ssh, where `rgt status` reads it while the box does not answer);
- a run `rgt down` took off its box, whose record the laptop keeps for its store, is deployed
  again under its name: the new record replaces the kept one and the run resumes from the store.

The `local` target runs the same commands as an ssh box (controller/remote.py), with the real
`rgt` CLI in this process and the real agent installed once, in a box home shared by the module.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator, List, Tuple

import pytest

from controller.cli import main as rgt_main
from controller.registry import Registry
from tests.conftest import Cli, _kill_run_processes, fixture
from tests.laptop import laptop_env, run_rgt, ssh_target
from tests.seaweed import SeaweedServer
from tests.sshd import SshServer, start_sshd

JOB = "import os, time\nprint('job started', flush=True)\ntime.sleep(600)\n"


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The box's RGT_HOME, shared by the module's tests (one agent install for them all)."""
    home = str(tmp_path_factory.mktemp("box"))
    yield home
    _kill_run_processes(home)


@pytest.fixture
def on_box(
    box: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, controller_env: Any
) -> Tuple[Cli, str]:
    """(a Cli reading the box's runs, the project to deploy)."""
    monkeypatch.setenv("RGT_BOX_HOME", box)
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "job.py").write_text(JOB)
    return Cli(box, dict(os.environ, RGT_HOME=box)), str(proj)


def _rgt(capsys: pytest.CaptureFixture[str], *argv: str) -> Tuple[int, str]:
    """`rgt ARGV` in this process: its exit code and what it printed on stderr."""
    capsys.readouterr()
    code = rgt_main(list(argv))
    return code, capsys.readouterr().err


def _deploy(proj: str, name: str, *cmd: str) -> List[str]:
    tail = ["--", *cmd] if cmd else []
    return ["deploy", "local", "--name", name, "--python", sys.executable, "--project", proj, *tail]


def test_a_stopped_run_is_started_again_by_name_from_the_boxs_record(
    on_box: Tuple[Cli, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Before: `rgt deploy TARGET --name N` with no command was refused (exit 2, "nothing to
    run"), though the box keeps the run's job and `rgt-agent start --name N` starts it again."""
    cli, proj = on_box
    code, err = _rgt(capsys, *_deploy(proj, "redo", sys.executable, "job.py"))
    assert code == 0, err
    # Live: nothing to start again, said with its own code and what to do.
    code, err = _rgt(capsys, *_deploy(proj, "redo"))
    assert code == 5, err
    assert re.search(
        r"run redo is (STARTING|RUNNING) on local: there is nothing to start again", err
    ), err
    assert "`rgt stop redo` first" in err, err
    code, err = _rgt(capsys, "stop", "redo", "--grace", "1")
    assert code == 0, err
    cli.wait_over("redo", "STOPPED")
    # A laptop with no record of the run: the box's record is what starts.
    monkeypatch.setenv("RGT_CONTROLLER_HOME", str(tmp_path / "other-laptop"))
    code, err = _rgt(capsys, *_deploy(proj, "redo"))
    assert code == 0, err
    assert "starting run redo again from the box's record" in err and "job.py" in err, err
    assert re.search(r"redo is (STARTING|RUNNING); its first line: job started", err), err
    st = cli.wait_state("redo", "RUNNING")
    assert st["attempt"] == 2, st
    assert cli.log_text("redo").count("job started") == 2
    code, err = _rgt(capsys, "stop", "redo", "--grace", "1")  # the new laptop knows it now
    assert code == 0, err


def test_starting_again_a_run_the_box_does_not_have_is_not_found(
    on_box: Tuple[Cli, str], capsys: pytest.CaptureFixture[str]
) -> None:
    cli, proj = on_box
    code, err = _rgt(capsys, *_deploy(proj, "ghost"))
    assert code == 8, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("rgt: there is no run ghost on local to start again"), err
    assert "rgt deploy local --name ghost -- CMD" in last, last
    assert not os.path.exists(os.path.join(cli.home, "runs", "ghost"))


def test_starting_again_a_run_whose_release_is_gone_is_not_found_and_starts_nothing(
    on_box: Tuple[Cli, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """The run's release (its workdir) was removed from the box since it stopped: the start
    again was refused by the shell's `cd` (exit 9, no remedy); now exit 8, saying to give the
    command, which pushes the code again, and the run is not started."""
    cli, proj = on_box
    code, err = _rgt(capsys, *_deploy(proj, "gone", sys.executable, "job.py"))
    assert code == 0, err
    code, err = _rgt(capsys, "stop", "gone", "--grace", "1")
    assert code == 0, err
    cli.wait_over("gone", "STOPPED")
    spec = json.loads(Path(cli.home, "runs", "gone", "spec.json").read_text())
    shutil.rmtree(spec["workdir"])
    code, err = _rgt(capsys, *_deploy(proj, "gone"))
    assert code == 8, err
    last = err.strip().splitlines()[-1]
    assert "is no longer on local: there is nothing to start it in again" in last, err
    assert "rgt deploy local --name gone -- CMD" in last, last
    assert cli.status("gone")["state"] == "STOPPED"  # not started


def test_a_failed_start_says_its_error_once_with_the_boxs_code_and_remedy(
    on_box: Tuple[Cli, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: the box's error line was relayed as it came, then said again as rgt's error."""
    _, proj = on_box
    code, err = _rgt(capsys, *_deploy(proj, "nocmd", "rgt-no-such-program"))
    assert code == 2, err
    assert err.count("'rgt-no-such-program' is not found on PATH") == 1, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("rgt: rgt-agent start failed on local (exit 2): command:"), last
    assert last.endswith("(give its full path)"), last


def test_a_start_refused_for_a_held_run_names_only_the_laptops_commands(
    on_box: Tuple[Cli, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """The run is STOPPED but its lock still held (an agent finishing its last seal, a box's
    `rgt-agent stop`): the box's start exits 5. Before: the box's line, relayed above rgt's
    error, told the laptop's user to run `rgt-agent status` and `rgt-agent stop`."""
    cli, proj = on_box
    code, err = _rgt(capsys, *_deploy(proj, "held", sys.executable, "job.py"))
    assert code == 0, err
    code, err = _rgt(capsys, "stop", "held", "--grace", "1")
    assert code == 0, err
    cli.wait_over("held", "STOPPED")
    lock = os.path.join(cli.home, "runs", "held", "lock")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from onbox.agent.lock import RunLock; "
         "RunLock.acquire(sys.argv[1], 'held', 'sync'); print('held', flush=True); "
         "time.sleep(600)", lock],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        code, err = _rgt(capsys, *_deploy(proj, "held", sys.executable, "job.py"))
    finally:
        holder.kill()  # by its PID
        holder.wait()
        assert holder.stdout is not None
        holder.stdout.close()
    assert code == 5, err
    assert f"is held by rgt-agent pid {holder.pid}" in err, err
    assert "rgt-agent status" not in err and "rgt-agent stop" not in err, err
    assert "`rgt status held`" in err and "`rgt stop held`" in err, err


def test_started_again_over_ssh_with_a_new_store_the_laptop_records_that_store(
    sshd: SshServer, tmp_path: Path
) -> None:
    """Over a real ssh (the box's commands through its login shell): a stopped run started
    again by name alone, with --store given this time. The box's agent runs it with that store
    (``rgt-agent start --name N --store``); before, the laptop recorded the store of the box's
    old spec.json, so `rgt runs` named it and `rgt status` from the store read the wrong one."""
    ctl, box_home = str(tmp_path / "ctl"), str(tmp_path / "box")
    proj, old, new = tmp_path / "proj", tmp_path / "old", tmp_path / "new"
    os.mkdir(ctl)
    for d in (proj, old, new):
        d.mkdir()
    (proj / "job.py").write_text(JOB)
    env = laptop_env(ctl, box_home)
    cli = Cli(box_home, dict(os.environ, RGT_HOME=box_home))
    name, target = f"again-ssh-{os.getpid()}", ssh_target(sshd)
    base = ["deploy", target, "--name", name, "--python", sys.executable, "--project", str(proj)]
    try:
        p = run_rgt([*base, "--store", f"file://{old}", "--", sys.executable, "job.py"], env, ctl)
        assert p.returncode == 0, p.stderr
        p = run_rgt(["stop", name, "--grace", "1"], env, ctl)
        assert p.returncode == 0, p.stderr
        cli.wait_over(name, "STOPPED")
        p = run_rgt([*base, "--store", f"file://{new}"], env, ctl)
        assert p.returncode == 0, p.stderr
        assert f"starting run {name} again from the box's record" in p.stderr, p.stderr
        assert cli.wait_state(name, "RUNNING")["attempt"] == 2
        with open(os.path.join(box_home, "runs", name, "spec.json")) as f:
            assert json.load(f)["store"] == f"file://{new}"
        p = run_rgt(["runs"], env, ctl)
        assert f"store=file://{new}" in p.stdout, p.stdout + p.stderr
    finally:
        run_rgt(["stop", name, "--grace", "1"], env, ctl)
        _kill_run_processes(box_home)


def test_a_deploy_to_local_keeps_the_store_its_job_file_names(
    on_box: Tuple[Cli, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On the local target rgt defaults the store to the box home's store/, but only when the
    job names none: a job file's store was silently replaced by that default, so a user trying
    the run here sealed somewhere other than the store the job file names."""
    cli, proj = on_box
    mine = tmp_path / "job-store"
    mine.mkdir()
    (Path(proj) / "job.toml").write_text(
        f'command = ["{sys.executable}", "job.py"]\nstore = "file://{mine}"\n'
    )
    code, err = _rgt(capsys, *_deploy(proj, "jobstore"), str(Path(proj) / "job.toml"))
    assert code == 0, err
    spec = json.loads(Path(cli.home, "runs", "jobstore", "spec.json").read_text())
    assert spec["store"] == f"file://{mine}", spec["store"]
    code, err = _rgt(capsys, "stop", "jobstore", "--grace", "1")
    assert code == 0, err


def test_a_deploy_over_ssh_records_the_store_its_job_file_names(tmp_path: Path) -> None:
    """Over a real ssh, a job file naming the store (no --store): before, the laptop recorded the
    run with no store ("the agent reads it"), so `rgt runs` named none and `rgt status` with the
    box gone said the run has no store. The record now takes the store from the box's spec.json
    after the start. The box's sshd is this test's own, stopped to make the box not answer."""
    ctl, box_home = str(tmp_path / "ctl"), str(tmp_path / "box")
    proj, store = tmp_path / "proj", tmp_path / "job-store"
    os.mkdir(ctl)
    proj.mkdir()
    store.mkdir()
    (proj / "job.py").write_text(JOB)
    (proj / "job.toml").write_text(
        f'command = ["{sys.executable}", "job.py"]\nstore = "file://{store}"\n'
    )
    server = start_sshd(str(tmp_path / "sshd"))
    env = laptop_env(ctl, box_home)
    cli = Cli(box_home, dict(os.environ, RGT_HOME=box_home))
    name = f"jobstore-ssh-{os.getpid()}"
    argv = ["deploy", ssh_target(server), "--name", name, "--python", sys.executable]
    try:
        p = run_rgt([*argv, "--project", str(proj), str(proj / "job.toml")], env, ctl)
        assert p.returncode == 0, p.stderr
        spec = json.loads(Path(box_home, "runs", name, "spec.json").read_text())
        assert spec["store"] == f"file://{store}", spec
        p = run_rgt(["runs"], env, ctl)
        assert f"store=file://{store}" in p.stdout, p.stdout + p.stderr
        mirror = store / name / "state" / "state.json"

        def mirrored(_: Any) -> bool:
            try:
                return bool(json.loads(mirror.read_text()).get("state") == "RUNNING")
            except (OSError, ValueError):
                return False

        cli.wait_for(name, mirrored, what="RUNNING mirrored to the store")
        server.stop()
        p = run_rgt(["status", name, "--json"], env, ctl, timeout=120)
        assert p.returncode == 0, p.stdout + p.stderr
        doc = json.loads(p.stdout)
        assert doc["source"] == "store" and doc["box_unreachable"], doc
        assert doc["state"] == "RUNNING", doc
    finally:
        server.stop()
        _kill_run_processes(box_home)


def test_a_job_file_naming_an_s3_store_gets_an_agent_that_can_reach_it(
    on_box: Tuple[Cli, str],
    s3_server: SeaweedServer,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The agent is installed with the extras its store needs (boto3 for s3://). They were
    chosen from --store only, so a job file naming an S3 store got an agent without boto3,
    and the run failed at its start on the box."""
    cli, proj = on_box
    bucket = s3_server.bucket()
    (Path(proj) / "s3job.toml").write_text(
        f'command = ["{sys.executable}", "job.py"]\n'
        f'[store]\nurl = "s3://{bucket}/rgt"\nendpoint_url = "{s3_server.endpoint}"\n'
    )
    for var, value in s3_server.env({}).items():
        monkeypatch.setenv(var, value)
    secrets = ["--secret-env", "AWS_ACCESS_KEY_ID", "--secret-env", "AWS_SECRET_ACCESS_KEY"]
    code, err = _rgt(capsys, *_deploy(proj, "s3job"), *secrets, str(Path(proj) / "s3job.toml"))
    assert code == 0, err
    assert cli.status("s3job")["state"] in ("STARTING", "RUNNING")
    code, err = _rgt(capsys, "stop", "s3job", "--grace", "1")
    assert code == 0, err


def test_a_run_taken_down_with_its_store_kept_is_deployed_again_and_resumes_from_the_store(
    on_box: Tuple[Cli, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`rgt down` keeps the record of a run whose store outlives the box, marked taken down.
    A new `rgt deploy TARGET --name N` is not refused for it: its record replaces the kept one,
    and the agent restores the run's newest sealed checkpoint from the store, which `rgt status`
    names as the newest sealed at once."""
    cli, proj = on_box
    store = tmp_path / "store"
    store.mkdir()
    job = [*fixture("ckpt_writer.py"), "on_signal", "0.25"]
    deploy = [*_deploy(proj, "again"), "--store", f"file://{store}", "--", *job]
    code, err = _rgt(capsys, *deploy)
    assert code == 0, err
    cli.wait_for("again", lambda s: bool(s.get("pid")) and "ready" in cli.log_text("again"))
    os.kill(cli.status("again")["pid"], signal.SIGUSR2)
    latest = store / "again" / "LATEST.json"
    deadline = time.monotonic() + 60
    while not (latest.exists() and json.loads(latest.read_text())["step"] == 1):
        assert time.monotonic() < deadline, "step 1 was not sealed"
        time.sleep(0.05)
    code, err = _rgt(capsys, "pull", "again", "--to", str(tmp_path / "dest"))
    assert code == 0, err
    code, err = _rgt(capsys, "down", "again", "--yes")
    assert code == 0, err
    ckpt = Path(cli.home, "runs", "again", "ckpt", "step_1.pt")
    assert not ckpt.exists() and Registry().get("again").down_at is not None

    code, err = _rgt(capsys, *deploy)
    assert code == 0, err
    rec = Registry().get("again")
    assert rec.down_at is None and rec.store == f"file://{store}"
    assert ckpt.exists()  # restored from the store before the job started
    # The new box's status names the restored step as the newest sealed at once: it is in
    # the store (it said nothing of it until the run sealed again).
    capsys.readouterr()
    code = rgt_main(["status", "again"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert re.search(r"newest sealed checkpoint: step 1 \(restored from the store at ", out), out
    _box_as_documented(capsys)
    code, err = _rgt(capsys, "stop", "again", "--grace", "5")
    assert code == 0, err


def _box_as_documented(capsys: pytest.CaptureFixture[str]) -> None:
    """`rgt status again --json` of a box that restored step 1: its ``box.sealed`` is the
    ``restored`` event (the restored step is sealed in the store), and README's contract of
    `rgt status --json` names the ``box`` object, each key it holds, and that ``sealed`` may be
    a ``restored`` event. Before, README named neither."""
    code = rgt_main(["status", "again", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    doc = json.loads(out)
    sealed = doc["box"]["sealed"]
    assert sealed["kind"] == "restored" and sealed["step"] == 1, sealed
    readme = Path(__file__).parents[2] / "README.md"
    text = readme.read_text().split("- **status / watch / logs / stop**")[1].split("\n- **")[0]
    for key in ["source", "read_at", "box", *doc["box"], *sealed]:
        assert f"`{key}`" in text, (key, text)
    assert "`restored`" in text, text


def test_a_deploy_of_a_finished_run_says_nothing_was_started_and_keeps_its_release(
    on_box: Tuple[Cli, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run whose store holds DONE.json does not train again. A deploy of it with changed
    code said "fin is SUCCEEDED; its first line: ..." (the old attempt's line, as if the new
    code had started), moved the box's `current` link to a release the run never ran, and on
    a fresh box (no run dir) waited a minute for a first line that never came ("no output
    within 60 s yet", "follow it with `rgt watch fin`"). Now it says that nothing started."""
    cli, proj = on_box
    (tmp_path / "store").mkdir()
    store = f"file://{tmp_path / 'store'}"
    (Path(proj) / "done.py").write_text("print('trained', flush=True)\n")
    deploy = [*_deploy(proj, "fin"), "--store", store, "--", sys.executable, "done.py"]
    code, err = _rgt(capsys, *deploy)
    assert code == 0, err
    cli.wait_over("fin", "SUCCEEDED")
    current = Path(cli.home, "deploys", "fin", "current")
    ran_in = os.readlink(current)
    (Path(proj) / "done.py").write_text("print('trained again', flush=True)\n")
    for fresh_box in (False, True):
        if fresh_box:
            shutil.rmtree(Path(cli.home, "runs", "fin"))
        code, err = _rgt(capsys, *deploy)
        assert code == 0, err
        assert "its first line" not in err and "follow it with" not in err, err
        last = err.strip().splitlines()[-1]
        assert last.startswith("rgt: run fin is finished (its store holds DONE.json)"), err
        assert "nothing was started: this deploy's code did not run" in last, last
        assert "deploy under a new --name" in last and "`rgt pull fin`" in last, last
        assert os.readlink(current) == ran_in


def test_a_deploy_of_new_code_to_a_live_run_is_refused_before_the_code_is_pushed(
    on_box: Tuple[Cli, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """A deploy of changed code under the name of a run that is live on the box is refused
    (exit 5). It pushed the whole project first, then refused: minutes of upload for a large
    project, and a release on the box that no run uses and no `rgt down` removes."""
    cli, proj = on_box
    code, err = _rgt(capsys, *_deploy(proj, "busy", sys.executable, "job.py"))
    assert code == 0, err
    releases = Path(cli.home, "releases")
    before = sorted(os.listdir(releases))
    (Path(proj) / "job.py").write_text(JOB + "# changed\n")
    code, err = _rgt(capsys, *_deploy(proj, "busy", sys.executable, "job.py"))
    assert code == 5, err
    assert re.search(r"run busy is (STARTING|RUNNING) on local with release \w+", err), err
    assert "`rgt stop busy` first, or deploy under another --name" in err, err
    assert "sent" not in err, err  # no push line
    assert sorted(os.listdir(releases)) == before
    code, err = _rgt(capsys, "stop", "busy", "--grace", "1")
    assert code == 0, err
