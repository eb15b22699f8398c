"""`rgt deploy --profile slurm` end to end: the real `rgt` CLI as a process, over a real sshd
"login node" (the session fixture ``slurm_login``, whose sessions get SLURM_CONF), against the
session's real single-node Slurm (``slurm_cluster``), deploying the real PyTorch CPU training
examples/train_plain.py. The login node and the "compute node" are this machine, so they share
the filesystem as a cluster's do: the agent installed at deploy is the one the batch job runs.

Covered:

- a job held in the queue (``--sbatch --begin=now+1hour``): status says Slurm's state and that no
  agent started, logs says so too, stop cancels it (squeue has no job of it then);
- a deploy with no `--secret-env` submits its job with no secrets a cut-off deploy left staged
  (the submit's command removes them; one that cannot is refused, exit 9, nothing queued, and
  the release that deploy pushed for the job is removed again);
- a running job: status joins Slurm's side (state, restarts, time left) with the agent's; logs
  show the training; a second deploy of the same run submits no second job; stop asks the agent
  (STOPPED) and the job is gone from the queue;
- a sweep of 4 cells as one job array (`rgt sweep PLAN.toml` with ``slurm =``): each cell's
  DONE.json and output are in the store, and `rgt reconcile PLAN.toml` verifies them (exit 0);
- a job array removes the secrets a cut-off deploy left staged under a cell's name in its
  submit's command (the cell's job never sees them; one that cannot be is exit 9, nothing queued);
- the acceptance: a training that needs longer than the time its allocation leaves before the
  warning (``--time 2``, a lead of 62 s from ``--seal-time 1``) is warned, seals, requeues
  itself, restores in the requeued job and SUCCEEDS, and its final weights, optimizer and RNG
  hashes equal an uninterrupted run's.

Every job is cancelled by name at the end and every process of the runs killed by PID.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Tuple

import pytest

from controller.registry import Registry
from controller.sweep.plan import load_plan
from onbox.sealing import manifest as mf
from onbox.sealing.stores import open_store
from tests.beside import Beside
from tests.conftest import ROOT, _kill_run_processes
from tests.laptop import laptop_env, run_rgt, ssh_target
from tests.polling import wait_value
from tests.slurm import SlurmCluster
from tests.sshd import SshServer


def _hashes(out: str) -> Dict[str, str]:
    return dict(re.findall(r"^(\w+) sha256 ([0-9a-f]{64})$", out, re.M))


@dataclasses.dataclass
class Login:
    """The login node, the laptop state that reaches it, and the code pushed to it."""

    sshd: SshServer
    cluster: SlurmCluster
    ctl_home: str
    box_home: str
    store: str  # a directory, used as file://store
    project: str

    @property
    def target(self) -> str:
        return ssh_target(self.sshd)

    def env(self) -> Dict[str, str]:
        return laptop_env(self.ctl_home, self.box_home)

    def rgt(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return run_rgt(args, self.env(), self.ctl_home, timeout)

    def deploy(self, name: str, *flags: str, job: List[str]) -> subprocess.CompletedProcess[str]:
        return self.rgt(
            "deploy", self.target, "--profile", "slurm", "--name", name,
            "--python", sys.executable, "--project", self.project,
            "--store", "file://" + self.store, *flags, "--", sys.executable, *job,
        )  # fmt: skip

    def status(self, name: str) -> Dict[str, Any]:
        p = self.rgt("status", name, "--json", timeout=120)
        assert p.returncode == 0, f"rgt status -> {p.returncode}: {p.stderr}"
        doc: Dict[str, Any] = json.loads(p.stdout)
        return doc

    def wait_status(
        self, name: str, pred: Callable[[Dict[str, Any]], bool], what: str, timeout: float
    ) -> Dict[str, Any]:
        return wait_value(
            lambda: self.status(name), pred, timeout, what, 1.0, lambda st: f"last status {st}"
        )

    def job(self, name: str) -> str:
        return str(Registry(self.ctl_home).get(name).scheduler["job"])

    def queued(self, name: str) -> List[str]:
        """The ids of the jobs named ``name`` that Slurm still has in its queue."""
        r = self.cluster.run("squeue", "-h", "-n", name, "-o", "%i")
        assert r.returncode == 0, r.stderr
        return r.stdout.split()

    def cancel(self, *names: str) -> None:
        for name in names:
            self.cluster.run("scancel", "-n", name)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(self.queued(n) for n in names):
            time.sleep(0.5)


@pytest.fixture(scope="module")
def login(slurm_login: SshServer, slurm_cluster: SlurmCluster) -> Iterator[Login]:
    # Short paths without blanks: the batch script's #SBATCH --output must hold them.
    root = tempfile.mkdtemp(prefix="rgt-slurm-", dir="/tmp")
    project = Path(root, "project")
    project.mkdir()
    shutil.copy(os.path.join(ROOT, "examples", "train_plain.py"), project / "train_plain.py")
    lg = Login(
        slurm_login,
        slurm_cluster,
        ctl_home=os.path.join(root, "ctl"),
        box_home=os.path.join(root, "box"),
        store=os.path.join(root, "store"),
        project=str(project),
    )
    os.makedirs(lg.ctl_home)
    for store in (lg.store, lg.store + "-job"):  # store roots are the user's to make
        os.makedirs(store)
    try:
        yield lg
    finally:
        with contextlib.suppress(Exception):
            names = [r.name for r in Registry(lg.ctl_home).all()] + ["sw4"]
            lg.cancel(*names)
        _kill_run_processes(lg.box_home)
        shutil.rmtree(root, ignore_errors=True)


def _deploy_held(login: Login, name: str) -> subprocess.CompletedProcess[str]:
    """Deploy a short job held in the queue for an hour (``--begin=now+3600``): it never runs
    while the test looks at it; the caller cancels it."""
    return login.deploy(
        name, "--time", "10", "--seal-time", "2", "--sbatch", "--begin=now+3600",
        job=["train_plain.py", "--steps", "10"],
    )  # fmt: skip


def test_a_queued_job_status_logs_and_stop(login: Login) -> None:
    name = "slurm-held"
    p = _deploy_held(login, name)
    try:
        assert p.returncode == 0, p.stderr
        # The lead and where it came from: the flag's 2 s seal, doubled, plus Slurm's slack.
        assert "USR2 64 s before the limit: 2 x the given 2 s seal + 60 s slack" in p.stderr
        assert "rgt requeues this job" in p.stderr
        job = login.job(name)
        assert login.queued(name) == [job]
        st = login.status(name)
        assert st["scheduler"]["job"]["state"] == "PENDING"
        assert st.get("agent_started") is False
        text = login.rgt("status", name)
        assert text.returncode == 0, text.stderr
        assert f"Slurm job {job} is PENDING" in text.stdout and "agent has not" in text.stdout
        logs = login.rgt("logs", name)
        assert logs.returncode == 0, logs.stderr
        assert "no agent of slurm-held has started yet" in logs.stderr
        stop = login.rgt("stop", name, timeout=120)
        assert stop.returncode == 0, stop.stderr
        assert "cancelled Slurm job" in stop.stdout
        assert login.queued(name) == []
    finally:
        login.cancel(name)


def test_a_queued_job_whose_job_file_names_the_store_is_recorded_with_it(login: Login) -> None:
    """A job file's store is the agent's to read, and on Slurm the agent runs only once the job
    does: the laptop recorded a queued run with no store, so `rgt status` could not read the
    store while the login node did not answer. It now records the job file's store at once."""
    name = "slurm-jobstore"
    job = Path(login.project, "jobstore.toml")
    job.write_text(
        f'command = ["{sys.executable}", "train_plain.py", "--steps", "10"]\n'
        f'store = "file://{login.store}-job"\n'
    )
    p = login.rgt(
        "deploy", login.target, "--profile", "slurm", "--name", name,
        "--python", sys.executable, "--project", login.project,
        "--time", "10", "--seal-time", "2", "--sbatch", "--begin=now+3600", str(job),
    )  # fmt: skip
    try:
        assert p.returncode == 0, p.stderr
        assert Registry(login.ctl_home).get(name).store == f"file://{login.store}-job"
    finally:
        login.cancel(name)


def test_a_submit_without_secrets_removes_those_a_cut_off_deploy_left_staged(
    login: Login,
) -> None:
    """A deploy cut off between its secrets and its submit leaves them staged
    (secrets/.N.staged); the batch job's agent claims what is staged when it starts. A deploy
    with no `--secret-env` submitted the job with them still there: the run would start with
    the cut-off deploy's values. The submit's own command removes them first."""
    name = "slurm-stale"
    staged = Path(login.box_home, "secrets", f".{name}.staged")
    staged.parent.mkdir(parents=True, mode=0o700, exist_ok=True)
    staged.write_text('{"RGT_TEST_TOKEN": "left-by-a-cut-off-deploy"}')
    staged.chmod(0o600)
    p = _deploy_held(login, name)
    try:
        assert p.returncode == 0, p.stderr
        assert login.queued(name) == [login.job(name)]
        assert not staged.exists(), "the cut-off deploy's secrets stayed for the batch job"
    finally:
        login.cancel(name)


def test_a_submit_that_cannot_remove_staged_secrets_submits_nothing(login: Login) -> None:
    """Here the staged path is a directory, which `rm -f` refuses: the deploy stops with the
    path and what to do (exit 9), and no job is queued."""
    name = "slurm-odd"
    staged = Path(login.box_home, "secrets", f".{name}.staged")
    (staged / "inside").mkdir(parents=True)
    p = _deploy_held(login, name)
    try:
        assert p.returncode == 9, p.stderr
        assert f"cannot remove {staged} on " in p.stderr, p.stderr
        assert "nothing was submitted" in p.stderr, p.stderr
        assert login.queued(name) == []
    finally:
        login.cancel(name)


def test_a_refused_submit_of_new_code_removes_the_release_it_pushed(login: Login) -> None:
    """Nothing was submitted (the staged secrets cannot be removed: a directory), so no job
    uses the release this deploy pushed for it: it goes from the login node again, in one
    command after the refusal, which stays the deploy's error (exit 9)."""
    name = "slurm-left"
    project = Path(login.project).parent / "project-left"
    shutil.copytree(login.project, project)
    (project / "left.txt").write_text("code that no other test pushes\n")
    staged = Path(login.box_home, "secrets", f".{name}.staged")
    (staged / "inside").mkdir(parents=True)
    releases = Path(login.box_home, "releases")
    before = sorted(os.listdir(releases)) if releases.is_dir() else []
    p = login.rgt(
        "deploy", login.target, "--profile", "slurm", "--name", name,
        "--python", sys.executable, "--project", str(project),
        "--store", "file://" + login.store, "--time", "10", "--seal-time", "2",
        "--", sys.executable, "train_plain.py", "--steps", "10",
    )  # fmt: skip
    try:
        assert p.returncode == 9 and "nothing was submitted" in p.stderr, p.stderr
        assert "sent (" in p.stderr, p.stderr  # the push made the release
        assert sorted(n for n in os.listdir(releases) if not n.startswith(".")) == [
            n for n in before if not n.startswith(".")
        ], "the refused submit's release stayed on the login node"
        said = "was removed from the box again: the cluster refused the submit"
        assert said in p.stderr, p.stderr
        assert login.queued(name) == []
    finally:
        login.cancel(name)


def test_a_running_job_status_logs_one_job_and_stop(login: Login) -> None:
    name = "slurm-obs"
    job_args = ["train_plain.py", "--steps", "100000", "--sleep", "0.2", "--ckpt-every", "20"]
    p = login.deploy(name, "--time", "10", "--seal-time", "2", job=job_args)
    try:
        assert p.returncode == 0, p.stderr
        job = login.job(name)
        st = login.wait_status(
            name,
            lambda s: (
                (s.get("scheduler") or {}).get("job", {}).get("state") == "RUNNING"
                and s.get("state") == "RUNNING"
                and (s.get("progress") or {}).get("step", 0) > 0
            ),
            "the job RUNNING in Slurm and the agent's run RUNNING with progress",
            timeout=90,
        )
        side = st["scheduler"]["job"]
        assert side["restarts"] == 0 and side["time_limit"] == 600
        assert 0 < side["time_left"] <= 600 and side["node"] == login.cluster.node
        text = login.rgt("status", name)
        assert f"slurm: job {job} RUNNING on {login.cluster.node}, restarts 0" in text.stdout
        assert "time left" in text.stdout and "RUNNING, attempt" in text.stdout
        logs = login.rgt("logs", name)
        assert logs.returncode == 0 and re.search(r"^step \d+ attempt", logs.stdout, re.M)
        # Deploying the same run again while its job runs never makes a second job.
        again = login.deploy(name, "--time", "10", "--seal-time", "2", job=job_args)
        assert again.returncode in (0, 5), again.stderr
        assert login.queued(name) == [job]
        stop = login.rgt("stop", name, timeout=300)
        assert stop.returncode == 0, stop.stdout + stop.stderr
        deadline = time.monotonic() + 60  # the ended job leaves the queue (COMPLETING) soon after
        while login.queued(name) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert login.queued(name) == []
        assert login.status(name)["state"] == "STOPPED"
    finally:
        login.cancel(name)


ARRAY_JOB = """\
import json, os, runpy, sys
steps, out = sys.argv[1], sys.argv[2]
sys.argv = ["train_plain.py", "--steps", steps, "--ckpt-every", "4", "--sync"]
runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_plain.py"),
               run_name="__main__")
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, "result.json"), "w") as f:
    json.dump({"steps": int(steps), "cell": os.environ.get("RGT_CELL")}, f)
"""


def test_a_sweep_of_four_cells_as_one_job_array(login: Login) -> None:
    """`rgt sweep PLAN.toml` with ``slurm =``: one job array, task i runs cell i, each cell its
    own run, store prefix and output path; `rgt reconcile PLAN.toml` then finds every cell's
    DONE.json and files verified (exit 0)."""
    Path(login.project, "cell.py").write_text(ARRAY_JOB)
    plan = Path(login.project, "PLAN.toml")
    plan.write_text(
        f'name = "sw4"\nstore = "file://{login.store}"\nslurm = {json.dumps(login.target)}\n'
        f'python = "{sys.executable}"\nprofile = "slurm"\n'
        f'command = ["{sys.executable}", "cell.py", "{{steps}}", "{{out}}"]\n'
        'outputs = ["out"]\n[sbatch]\ntime = "5"\nseal_time = "2"\n'
        "[grid]\nsteps = [12, 16, 20, 24]\n"
    )
    try:
        p = login.rgt("sweep", str(plan), timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        assert "job array" in p.stderr, p.stderr
        cells = [r for r in Registry(login.ctl_home).all() if r.name.startswith("sw4-")]
        assert len(cells) == 4 and len({r.scheduler["job"] for r in cells}) == 1, cells
        assert sorted(r.scheduler["array_task"] for r in cells) == [0, 1, 2, 3]
        store = open_store("file://" + login.store)
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            if all(store.get_bytes(mf.done_key(r.name)) is not None for r in cells):
                break
            time.sleep(1.0)
        rc = login.rgt("reconcile", str(plan), "--json", timeout=120)
        rep = json.loads(rc.stdout)
        assert rc.returncode == 0 and rep["reconciled"] and rep["ok"] == 4, (rep, rc.stderr)
        # Each cell trained its own steps and wrote its own output, in its own run.
        for r in cells:
            task = r.scheduler["array_task"]
            latest = json.loads(store.get_bytes(mf.latest_key(r.name)) or b"{}")
            assert latest.get("step") == 12 + 4 * task, latest
            got = store.get_bytes(f"{r.name}/outputs/out/{r.name}/result.json")
            assert got is not None and json.loads(got)["cell"] == r.name
        st = login.status(cells[2].name)
        assert st["state"] == "SUCCEEDED"
        assert (
            st["scheduler"]["ref"]
            == f"{cells[2].scheduler['job']}_{cells[2].scheduler['array_task']}"
        )
    finally:
        login.cancel("sw4")


# A cell that writes what it sees of the secret a cut-off deploy staged under its name.
SECRET_CELL = """\
import json, os, sys
os.makedirs(sys.argv[1], exist_ok=True)
with open(os.path.join(sys.argv[1], "seen.json"), "w") as f:
    json.dump({"token": os.environ.get("RGT_TEST_TOKEN")}, f)
"""


def _one_cell_plan(login: Login, sweep: str) -> Tuple[Path, str]:
    """A plan of one cell that runs SECRET_CELL; (its path, the cell's run name)."""
    Path(login.project, "seen.py").write_text(SECRET_CELL)
    plan = Path(login.project, f"{sweep}.toml")
    plan.write_text(
        f'name = "{sweep}"\nstore = "file://{login.store}"\nslurm = {json.dumps(login.target)}\n'
        f'python = "{sys.executable}"\nprofile = "slurm"\n'
        f'command = ["{sys.executable}", "seen.py", "{{out}}"]\n'
        'outputs = ["out"]\n[sbatch]\ntime = "5"\nseal_time = "2"\n'
        "[grid]\nsteps = [1]\n"
    )
    (cell,) = load_plan(str(plan)).cells
    return plan, cell.name


def test_a_job_array_removes_the_secrets_a_cut_off_deploy_left_staged_for_a_cell(
    login: Login,
) -> None:
    """A deploy cut off between its secrets and its submit leaves them staged under its run's
    name; a sweep's cell of that name ran with them (its agent claims what is staged when it
    starts): the array's submit did not remove them, as the single submit does. Now its own
    command removes each cell's before the sbatch: the cell never sees them."""
    plan, cell = _one_cell_plan(login, "swsec")
    staged = Path(login.box_home, "secrets", f".{cell}.staged")
    staged.parent.mkdir(parents=True, mode=0o700, exist_ok=True)
    staged.write_text('{"RGT_TEST_TOKEN": "left-by-a-cut-off-deploy"}')
    staged.chmod(0o600)
    try:
        p = login.rgt("sweep", str(plan), timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        assert not staged.exists(), "the cut-off deploy's secrets stayed for the cell's job"
        store = open_store("file://" + login.store)
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and store.get_bytes(mf.done_key(cell)) is None:
            time.sleep(1.0)
        seen = store.get_bytes(f"{cell}/outputs/out/{cell}/seen.json")
        assert seen is not None and json.loads(seen) == {"token": None}, seen
    finally:
        login.cancel("swsec")


def test_a_job_array_that_cannot_remove_a_cells_staged_secrets_submits_nothing(
    login: Login,
) -> None:
    """Here a cell's staged path is a directory, which `rm -f` refuses: the sweep stops with
    the path and what to do (exit 9), and no array is queued."""
    plan, cell = _one_cell_plan(login, "swodd")
    staged = Path(login.box_home, "secrets", f".{cell}.staged")
    (staged / "inside").mkdir(parents=True)
    try:
        p = login.rgt("sweep", str(plan), timeout=300)
        assert p.returncode == 9, p.stderr[-3000:]
        assert f"cannot remove {staged} on " in p.stderr, p.stderr
        assert "nothing was submitted" in p.stderr, p.stderr
        assert login.queued("swodd") == []
    finally:
        login.cancel("swodd")


# Two allocations of a 2-minute limit, a requeue's hold and the uninterrupted run: minutes, more
# on a loaded machine (the suite's workers), so a longer bound than the suite's default.
@pytest.mark.timeout(900)
def test_warned_before_the_limit_sealed_requeued_restored_and_exact(login: Login) -> None:
    name = "slurm-limit"
    steps = "270"
    train = ["--steps", steps, "--sleep", "0.2", "--ckpt-every", "10"]
    # The uninterrupted run (--sleep changes nothing but the wall time), beside the deploy and
    # its Slurm job rather than before them: the job mostly sleeps.
    tmp = tempfile.mkdtemp(prefix="rgt-plain-")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RGT_")}
    argv = [sys.executable, os.path.join(login.project, "train_plain.py"), "--steps", steps]
    try:
        with Beside(argv, tmp, env) as plain:
            _limit_run(login, name, train, plain)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _limit_run(login: Login, name: str, train: List[str], plain: Beside) -> None:
    """The deploy of ``train`` under a 2-minute limit, to its end; checked against ``plain``."""
    # A 2-minute limit and a 62 s lead (2 x 1 s + 60 s): an allocation trains for at most
    # 58 s before its warning (Slurm's own comes up to 30 s sooner), and this training needs
    # about 55 s more than its start-up: it cannot finish in its first allocation.
    p = login.deploy(
        name, "--time", "2", "--seal-time", "1", job=["train_plain.py", *train]
    )  # fmt: skip
    try:
        assert p.returncode == 0, p.stderr
        assert "USR2 62 s before the limit" in p.stderr
        job = login.job(name)
        w = login.rgt("watch", name, "--until-done", "--interval", "3", timeout=720)
        assert w.returncode == 0, w.stdout[-3000:] + w.stderr
        st = login.status(name)
        assert st["state"] == "SUCCEEDED" and st["scheduler"]["live"] is False
        restarts = login.cluster.job_field(job, "Restarts")
        assert restarts is not None and int(restarts) >= 1, restarts
        with open(os.path.join(login.box_home, "runs", name, "events.jsonl")) as f:
            kinds = [json.loads(line).get("kind") for line in f if line.strip()]
        for kind in ("slurm_warning", "sealed", "slurm_requeued"):
            assert kind in kinds, kinds
        log = login.rgt("logs", name).stdout
        assert re.search(r"^resumed at step \d+", log, re.M), log[-2000:]
        expected = _hashes(plain.output(timeout=120))
        assert len(expected) == 3
        assert _hashes(log) == expected
    finally:
        login.cancel(name)
