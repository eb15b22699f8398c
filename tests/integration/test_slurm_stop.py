"""`rgt-agent stop` on the login node against a run whose agent is in a real Slurm job
(tests/slurm.py), racing the job's time-limit warning. A stop the user asked for wins over the
requeue, whichever comes first: the job is not requeued, the run ends STOPPED and the allocation
ends; a stop that comes once the job was requeued already cancels the requeued job and says so.

The "login node" is this host under another hostname (a UTS namespace): the agent's lock names
another node, so the stop's wake-up goes through slurmctld (``scancel --batch --signal=USR2``)
as on a real cluster. Slurm's warning is what slurmctld sends for ``--signal=B:USR2@T``: USR2 to
the batch shell (the agent) with no request in its mailbox. The agent is held in its seal after
the first piece of a checkpoint's copy (``RGT_HOLD_AT=copy.after_piece``) until the test has
done what it must do there.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from typing import Any, Dict, List

import pytest

from onbox.common.rundir import RunDir
from tests.conftest import Cli, agent_exe
from tests.integration.test_slurm_requeue import _events, _sealed, _start_writer
from tests.polling import wait
from tests.slurm import SlurmCluster

NAME = "slurm-cancel"  # the writer's job file's name
MIB = 8  # a checkpoint past filecopy.SMALL_FILE: copied in pieces, so held after one
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "PENDING", "REQUEUED", "REQUEUE_HOLD")


def _login_node(cli: Cli, cluster: SlurmCluster, *args: str) -> subprocess.Popen[str]:
    """``rgt-agent ARGS`` as on the login node: another hostname, the cluster's clients."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) to give the login node its own hostname")
    return subprocess.Popen(
        ["unshare", "--uts", "sh", "-c", 'hostname rgt-login && exec "$@"', "sh", *agent_exe()]
        + list(args),
        env=cluster.env(cli.env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cli.home,
    )


def _finish(p: subprocess.Popen[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()  # by its PID
        out, err = p.communicate()
        raise AssertionError(
            f"rgt-agent stop did not end in {timeout:.0f} s: {out}\n{err}"
        ) from None
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def _copying(root: str) -> bool:
    """A copy into the store is under way (held): its temporary file is there."""
    return any(f.startswith(".rgt-tmp.") for _, _, files in os.walk(root) for f in files)


def _kinds(cli: Cli) -> List[str]:
    return [e["kind"] for e in _events(cli, NAME)]


def _held(tmp: Any) -> Dict[str, str]:
    return {"RGT_HOLD_AT": "copy.after_piece", "RGT_HOLD_UNTIL": str(tmp / "release")}


def _not_requeued_and_over(cluster: SlurmCluster, cli: Cli, job: str) -> None:
    """The allocation ended and the job is not back in the queue; the run STOPPED, said why."""
    wait(lambda: cluster.job_field(job, "JobState") in ENDED, 90, "the job's end", poll=0.25)
    assert cluster.job_field(job, "JobState") in ("COMPLETED", "FAILED"), _kinds(cli)
    assert cluster.job_field(job, "Restarts") == "0"
    kinds = _kinds(cli)
    assert cli.status(NAME)["state"] == "STOPPED", kinds
    assert "slurm_requeued" not in kinds, kinds
    (why,) = [e for e in _events(cli, NAME) if e["kind"] == "slurm_not_requeued"]
    assert "stopped by the user" in why["reason"], why


@pytest.mark.timeout(300)
def test_a_stop_during_the_warnings_seal_wins_over_the_requeue(
    slurm_cluster: SlurmCluster, cli: Cli, tmp_path: Any
) -> None:
    """Warned first: the agent asks the job for a checkpoint and seals it (held there); a stop
    asked from the login node during that seal must not leave the job requeued."""
    job, root = _start_writer(slurm_cluster, cli, tmp_path, MIB, _held(tmp_path))
    stop = None
    try:
        warn = slurm_cluster.run("scancel", "--batch", "--signal=USR2", job)
        assert warn.returncode == 0, warn.stderr
        # The job wrote its checkpoint and is gone; the agent is in the seal, held.
        wait(
            lambda: "exit" in _kinds(cli) and _copying(root),
            60,
            "the warning's seal",
            poll=0.25,
            info=lambda: _kinds(cli),
        )
        assert "slurm_warning" in _kinds(cli)
        stop = _login_node(cli, slurm_cluster, "stop", NAME)
        rd = RunDir(NAME, home=cli.home)
        wait(
            lambda: os.path.exists(rd.stop_request) or stop.poll() is not None,
            30,
            "a stop",
            poll=0.25,
        )
        (tmp_path / "release").touch()
        done = _finish(stop)
        assert done.returncode == 0, done.stderr
        assert f"run {NAME} is STOPPED" in done.stdout, (done.stdout, done.stderr)
        _not_requeued_and_over(slurm_cluster, cli, job)
        assert _sealed(cli, NAME) == [1]  # the stop did not cut the warning's seal short
    finally:
        if stop is not None and stop.poll() is None:
            stop.kill()
        slurm_cluster.run("scancel", job)


@pytest.mark.timeout(300)
def test_a_warning_during_a_stops_seal_does_not_requeue_the_job(
    slurm_cluster: SlurmCluster, cli: Cli, tmp_path: Any
) -> None:
    """Stopped first (a checkpoint's seal under way, held): Slurm's warning during the stop's
    seal must not turn the stop into a requeue."""
    job, root = _start_writer(slurm_cluster, cli, tmp_path, MIB, _held(tmp_path))
    stop = None
    try:
        pid = cli.status(NAME)["pid"]
        os.kill(pid, signal.SIGUSR2)  # the job writes a checkpoint; its seal holds
        wait(lambda: _copying(root), 60, "a seal", poll=0.25, info=lambda: _kinds(cli))
        stop = _login_node(cli, slurm_cluster, "stop", NAME)
        wait(
            lambda: "exit" in _kinds(cli) or stop.poll() is not None,
            60,
            "the stop",
            poll=0.25,
            info=lambda: _kinds(cli),
        )
        warn = slurm_cluster.run("scancel", "--batch", "--signal=USR2", job)
        assert warn.returncode == 0, warn.stderr
        (tmp_path / "release").touch()
        done = _finish(stop)
        assert done.returncode == 0, done.stderr
        assert f"run {NAME} is STOPPED" in done.stdout, (done.stdout, done.stderr)
        _not_requeued_and_over(slurm_cluster, cli, job)
    finally:
        if stop is not None and stop.poll() is None:
            stop.kill()
        slurm_cluster.run("scancel", job)


@pytest.mark.timeout(300)
def test_a_stop_after_the_requeue_cancels_the_requeued_job_and_says_so(
    slurm_cluster: SlurmCluster, cli: Cli, tmp_path: Any
) -> None:
    """Warned, sealed and requeued before anyone asked to stop: `rgt-agent stop` on the login
    node finds the run PREEMPTED and its job back in the queue. It must not say "already
    PREEMPTED" and leave the job to run again: it cancels the requeued job and says so."""
    job, _ = _start_writer(slurm_cluster, cli, tmp_path, 1)
    try:
        assert slurm_cluster.run("scancel", "--batch", "--signal=USR2", job).returncode == 0
        wait(
            lambda: "slurm_requeued" in _kinds(cli),
            90,
            "the requeue",
            poll=0.25,
            info=lambda: _kinds(cli),
        )
        # Kept in the queue (a requeued job starts again after ~15 s here): the stop must find
        # it waiting there, as it does on a busy cluster.
        assert slurm_cluster.run("scontrol", "hold", job).returncode == 0
        wait(lambda: cli.peek(NAME).get("state") == "PREEMPTED", 30, "the agent's exit", poll=0.25)
        done = _finish(_login_node(cli, slurm_cluster, "stop", NAME))
        assert done.returncode == 0, (done.stdout, done.stderr)
        said = done.stdout + done.stderr
        assert f"Slurm job {job} had been requeued" in said and f"scancel {job}" in said, said
        slurm_cluster.wait_job(job, "CANCELLED", timeout=60)
    finally:
        slurm_cluster.run("scancel", job)
