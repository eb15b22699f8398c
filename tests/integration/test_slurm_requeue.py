"""rgt-agent under a real Slurm (tests/slurm.py, once per session): the batch script of
controller/slurm/batch.py submitted with sbatch, no ssh.

1. A real CPU training (examples/train_plain.py) that cannot finish within its time limit is
   warned before the limit (Slurm's B:USR2, or the agent's own timer), seals, requeues itself,
   restores from the store in the requeued allocation (SLURM_RESTART_COUNT 1, Restarts=1) and
   finishes SUCCEEDED with DONE.json, bitwise where an uninterrupted run (no Slurm) ends.
2. `scancel` while a big checkpoint is being sealed: LATEST is left on a checkpoint whose
   MANIFEST is there and whose every file matches its sha256 (restore's own verification), and
   a cancelled job is not requeued.
3. A stop asked from another node (the login node): the wake-up goes through slurmctld to the
   agent, and the run ends STOPPED.

Time limits are Slurm's minutes, and slurmctld looks at them every 30 s or so (the warning comes
up to ~30 s earlier than asked, the kill up to ~30 s after the limit): the training is sized so
that the first allocation is always warned and the second always has time to finish.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

import pytest

from controller.slurm.batch import batch_script
from onbox.agent import slurmlogin
from onbox.common.durable import read_json, write_json
from onbox.common.rundir import RunDir
from onbox.common.sealtime import SealTime
from onbox.sealing import manifest as mf
from onbox.sealing.restore import restore_latest
from onbox.sealing.stores import open_store
from tests.beside import Beside
from tests.conftest import FIXTURES, ROOT, Cli, agent_exe, require
from tests.integration.test_exact_plain import HASHES, _hashes
from tests.polling import wait
from tests.slurm import SlurmCluster

EXAMPLE = os.path.join(ROOT, "examples", "train_plain.py")
# ~88 s of training, in steps of a second (the sleep, not the compute, so that a loaded machine
# changes the pace little). With a 34 s lead, Slurm warns a 2-minute job 34 to ~64 s before its
# end (the agent's own timer at 34 s at the latest): the first allocation trains at most ~86
# steps, so it is always warned; the second has at least ~56 s for the ~42 steps left at most
# (a lead as short as it can be while both hold even when each start takes 10 s: every second
# of lead cut would be a step less to train, but the second allocation would risk a warning).
STEPS = 88
ARGS = ["--steps", str(STEPS), "--ckpt-every", "10", "--sleep", "1.0"]


def _sbatch(cluster: SlurmCluster, script: str, path: str, env: Dict[str, str]) -> str:
    with open(path, "w") as f:
        f.write(script)
    r = subprocess.run(
        ["bash", "-n", path], capture_output=True, text=True, timeout=30
    )  # the shell reads what it is given
    assert r.returncode == 0, r.stderr
    p = subprocess.run(
        ["sbatch", "--parsable", path],
        env=cluster.env(env),
        capture_output=True,
        text=True,
        timeout=30,
        cwd=os.path.dirname(path),
    )
    assert p.returncode == 0, p.stderr
    return p.stdout.strip().split(";")[0]


def _events(cli: Cli, name: str) -> List[Dict[str, Any]]:
    try:
        return cli.events(name)
    except (OSError, ValueError):
        return []


def _when(ev: Dict[str, Any]) -> float:
    return datetime.datetime.fromisoformat(ev["time"].replace("Z", "+00:00")).timestamp()


def _job_log(out_dir: str) -> str:
    text = ""
    for f in sorted(os.listdir(out_dir)):
        with open(os.path.join(out_dir, f), errors="replace") as fh:
            text += fh.read()
    return text


@pytest.mark.timeout(900)  # two allocations and a requeue's hold: minutes, more under load
def test_warned_before_its_time_limit_it_seals_requeues_and_ends_exactly(
    slurm_cluster: SlurmCluster, cli: Cli, tmp_path: Any
) -> None:
    require(importlib.util.find_spec("torch") is not None, "torch (pip install torch==2.13.0)")
    require(importlib.util.find_spec("numpy") is not None, "numpy")
    root, out = str(tmp_path / "durable"), str(tmp_path / "out")
    os.makedirs(root)
    os.makedirs(out)
    # A seal measured at 12 s elsewhere: 2 x 12 + 10 s of slack = a 34 s warning.
    lead = SealTime(12.0, 1, "given: 12 s").lead(assumed=60, slack=10)
    assert lead == 34
    name = "slurm-requeue"
    script = batch_script(
        name=name,
        agent_argv=agent_exe(),
        release_dir=ROOT,
        output_dir=out,
        time_limit="2",
        lead=lead,
        command=[sys.executable, EXAMPLE, *ARGS],
        store="file://" + root,
        env={"RGT_HOME": cli.home},
    )
    # The uninterrupted run (the same steps, without the sleeps), beside the Slurm job rather
    # than before it: the job mostly sleeps.
    env = dict(os.environ, PYTHONPATH=ROOT)
    with Beside([sys.executable, EXAMPLE, *ARGS[:-2]], str(tmp_path), env) as plain:
        job = _sbatch(slurm_cluster, script, str(tmp_path / "job.sh"), cli.env)
        try:
            expected = _hashes(plain.output(timeout=300))
            store = open_store("file://" + root)
            wait(
                lambda: slurm_cluster.job_field(job, "JobState") == "COMPLETED",
                600,
                "the job's completion",
                poll=0.25,
                info=lambda: (slurm_cluster.job_field(job, "JobState"), _job_log(out)[-3000:]),
            )
        finally:
            slurm_cluster.run("scancel", job)
    kinds = [e["kind"] for e in _events(cli, name)]
    log = _job_log(out)
    assert cli.status(name)["state"] == "SUCCEEDED", log[-3000:]
    # Requeued at least once (on a loaded machine the second allocation may be warned too).
    restarts = int(slurm_cluster.job_field(job, "Restarts") or 0)
    assert restarts >= 1, kinds
    assert slurm_cluster.job_field(job, "ExitCode") == "0:0"
    allocations = [e for e in _events(cli, name) if e["kind"] == "slurm_job"]
    assert [e["restart_count"] for e in allocations] == list(range(restarts + 1))
    assert all(e["job_id"] == job for e in allocations)
    # Warned before the limit; requeued once every process of the attempt was gone and the
    # job's last checkpoint sealed; the new allocation restored exactly that one.
    events = _events(cli, name)
    warned, requeued = kinds.index("slurm_warning"), kinds.index("slurm_requeued")
    assert _when(events[warned]) < allocations[0]["end_time"]
    assert warned < kinds.index("state", warned) < requeued
    assert events[kinds.index("state", warned)]["state"] == "STOPPING"
    sealed = [e["step"] for e in events[:requeued] if e["kind"] == "sealed"]
    restored = [e for e in events[requeued:] if e["kind"] == "restored"]
    assert restored and restored[0]["step"] == max(sealed), (sealed, restored)
    assert kinds.count("slurm_requeued") == restarts and "slurm_requeue_failed" not in kinds
    assert store.get_bytes(mf.done_key(name)) is not None
    train = cli("logs", name, check=True).stdout
    assert re.search(r"^resumed at step \d+ ", train, re.M), train[-2000:]
    assert _hashes(train) == expected, {k: expected[k][:12] for k in HASHES}
    assert f"run {name} ended PREEMPTED" in log and f"run {name} ended SUCCEEDED" in log


def _job_file(tmp: Any, mib: int) -> str:
    path = str(tmp / "job.toml")
    cmd = [sys.executable, os.path.join(FIXTURES, "ckpt_writer.py"), "on_signal", str(mib)]
    with open(path, "w") as f:
        f.write(f"name = 'slurm-cancel'\ncommand = {cmd!r}\n")
        f.write("[checkpoint]\ntrigger = 'signal:USR2'\n")
    return path


def _sealed(cli: Cli, name: str) -> List[Any]:
    return [e.get("step") for e in _events(cli, name) if e["kind"] == "sealed"]


def _start_writer(
    cluster: SlurmCluster, cli: Cli, tmp: Any, mib: int, env: Optional[Dict[str, str]] = None
) -> Tuple[str, str]:
    """The checkpoint writer fixture (``mib`` MiB a checkpoint, written on USR2) submitted as
    run slurm-cancel with a file:// store; (job id, store dir) once the job said it is ready.
    ``env``: more variables for the agent (a hold point, onbox/common/faults.py)."""
    root, out = str(tmp / "durable"), str(tmp / "out")
    os.makedirs(root)
    os.makedirs(out)
    name = "slurm-cancel"
    script = batch_script(
        name=name,
        agent_argv=agent_exe(),
        release_dir=str(tmp),
        output_dir=out,
        time_limit="5",
        lead=SealTime(None, 0, "not measured").lead(assumed=30),
        job_file=_job_file(tmp, mib),
        store="file://" + root,
        env={"RGT_HOME": cli.home, **(env or {})},
    )
    job = _sbatch(cluster, script, str(tmp / "job.sh"), cli.env)
    try:
        wait(
            lambda: "ready" in (cli("logs", name).stdout if _events(cli, name) else ""),
            60,
            "the job's start",
            poll=0.25,
            info=lambda: _job_log(out)[-2000:],
        )
    except BaseException:
        cluster.run("scancel", job)
        raise
    return job, root


def test_scancel_during_a_seal_leaves_latest_on_a_verified_checkpoint(
    slurm_cluster: SlurmCluster, cli: Cli, tmp_path: Any
) -> None:
    name = "slurm-cancel"
    job, root = _start_writer(slurm_cluster, cli, tmp_path, 256)
    try:
        # A first checkpoint (the job writes one on its own USR2), sealed; then `rgt-agent
        # sync`, whose USR2 to the agent comes with a request: it is not Slurm's warning.
        pid = cli.status(name)["pid"]
        os.kill(pid, signal.SIGUSR2)
        wait(lambda: _sealed(cli, name) == [1], 60, "the first seal", poll=0.25)
        cli("sync", name, "--timeout", "60", check=True, timeout=90)
        assert "slurm_warning" not in [e["kind"] for e in _events(cli, name)]
        # The second: cancelled once the job wrote it (renamed into place), before its seal.
        os.kill(pid, signal.SIGUSR2)
        ckpt = os.path.join(cli.home, "runs", name, "ckpt", "step_2.pt")
        wait(lambda: os.path.exists(ckpt), 60, "the second checkpoint", poll=0.25)
        assert _sealed(cli, name) == [1]
        assert slurm_cluster.run("scancel", job).returncode == 0
        slurm_cluster.wait_job(job, "CANCELLED", timeout=60)
    finally:
        slurm_cluster.run("scancel", job)
    store = open_store("file://" + root)
    latest = mf.parse_latest(store.get_bytes(mf.latest_key(name)))
    assert latest is not None and latest["step"] >= 1
    assert store.get_bytes(mf.manifest_key(name, latest["step"])) is not None
    seen: List[str] = []
    doc = restore_latest(
        store, name, str(tmp_path / "check"), lambda kind, reason, **kw: seen.append(kind)
    )
    assert doc is not None and doc["step"] == latest["step"], seen  # every sha256 matched
    assert not any("quarantin" in k for k in seen), seen
    kinds = [e["kind"] for e in _events(cli, name)]
    assert "slurm_requeued" not in kinds
    assert slurm_cluster.job_field(job, "Restarts") == "0"


def test_a_stop_asked_from_another_node_reaches_the_agent_through_slurm(
    slurm_cluster: SlurmCluster, cli: Cli, tmp_path: Any, monkeypatch: Any
) -> None:
    """`rgt-agent stop` on the login node while the agent holds the run from a compute node:
    the request file is on the shared filesystem, and the wake-up (SIGUSR2) goes through
    slurmctld to the job's batch shell, the agent, wherever it runs (a plain kill could not
    reach another node). The run ends STOPPED, not requeued, and its job leaves the queue."""
    name = "slurm-cancel"  # the job file's name
    job, _ = _start_writer(slurm_cluster, cli, tmp_path, 1)
    try:
        rd = RunDir(name, home=cli.home)
        write_json(rd.stop_request, {"grace": None, "requested_at": time.time()})
        monkeypatch.setenv("SLURM_CONF", slurm_cluster.conf)
        assert slurmlogin.wake_agent(read_json(rd.state) or {})
        slurm_cluster.wait_job(job, "COMPLETED", "FAILED", timeout=90)
    finally:
        slurm_cluster.run("scancel", job)
    kinds = [e["kind"] for e in _events(cli, name)]
    assert cli.status(name)["state"] == "STOPPED", kinds
    assert "stop" in kinds and "slurm_warning" not in kinds and "slurm_requeued" not in kinds
    assert slurm_cluster.job_field(job, "Restarts") == "0"
    assert not slurmlogin.wake_agent({"slurm": {"job_id": "x; rm -rf /"}})  # never a shell word


def test_a_requeue_by_slurm_during_a_seal_is_said_as_one_and_resumes_the_newest_seal(
    slurm_cluster: SlurmCluster, cli: Cli, tmp_path: Any
) -> None:
    """`scontrol requeue` by someone else (an admin; Slurm does the same on a node failure or a
    preemption in REQUEUE mode) while a checkpoint is being sealed: the agent gets a bare
    SIGTERM, seals within the grace and must say the job was requeued (not "cancelled, not
    requeued, sbatch it again", which would make a second job of the same run), must not requeue
    it a second time, and the next allocation resumes from the newest sealed step."""
    name = "slurm-cancel"  # the job file's name
    job, _ = _start_writer(slurm_cluster, cli, tmp_path, 64)
    try:
        pid = cli.status(name)["pid"]
        os.kill(pid, signal.SIGUSR2)
        wait(lambda: _sealed(cli, name) == [1], 60, "the first seal", poll=0.25)
        os.kill(pid, signal.SIGUSR2)
        ckpt = os.path.join(cli.home, "runs", name, "ckpt", "step_2.pt")
        wait(lambda: os.path.exists(ckpt), 60, "the second checkpoint", poll=0.25)
        assert slurm_cluster.run("scontrol", "requeue", job).returncode == 0
        # The second allocation's slurm_job event comes after its restore.
        wait(
            lambda: [e["kind"] for e in _events(cli, name)].count("slurm_job") == 2,
            180,
            "the second allocation",
            poll=0.25,
            info=lambda: [e["kind"] for e in _events(cli, name)],
        )
        events = _events(cli, name)
        kinds = [e["kind"] for e in events]
        again = kinds.index("incarnation", kinds.index("slurm_job") + 1)
        first = events[:again]
        assert "slurm_not_requeued" not in kinds, [e.get("reason") for e in first[-3:]]
        assert [e["kind"] for e in first].count("slurm_requeued") == 1, kinds
        assert "slurm_requeue_failed" not in kinds
        assert [e["restart_count"] for e in events if e["kind"] == "slurm_job"] == [0, 1]
        sealed = [e["step"] for e in first if e["kind"] == "sealed"]
        restored = [e for e in events[again:] if e["kind"] == "restored"]
        assert restored and restored[-1]["step"] == max(sealed) >= 1, (sealed, restored)
        assert slurm_cluster.job_field(job, "Restarts") == "1"  # requeued once, by Slurm
    finally:
        slurm_cluster.run("scancel", job)
    slurm_cluster.wait_job(job, "CANCELLED", timeout=60)


def test_allocations_that_seal_nothing_newer_are_not_requeued_for_ever(
    slurm_cluster: SlurmCluster, cli: Cli, tmp_path: Any
) -> None:
    """A time limit that leaves no room after the warning's lead (here a 1-minute job warned
    58 s before its end, while its job is still starting): every allocation was warned before
    it could checkpoint, sealed nothing, and requeued the job again, for ever, each allocation
    spent for nothing. With a store, `max_stuck_restarts` allocations in a row that sealed
    nothing newer than they began with end the loop: not requeued, said why, the job gone."""
    root, out = str(tmp_path / "durable"), str(tmp_path / "out")
    os.makedirs(root)
    os.makedirs(out)
    name = "slurm-stuck"
    job_file = str(tmp_path / "job.toml")
    slow = "import time\ntime.sleep(50)  # a long start: an import, a dataset's index\n"
    with open(job_file, "w") as f:
        f.write(f"name = {name!r}\ncommand = {[sys.executable, '-c', slow]!r}\n")
        f.write("[restart]\nmax_stuck_restarts = 1\n")
    script = batch_script(
        name=name,
        agent_argv=agent_exe(),
        release_dir=str(tmp_path),
        output_dir=out,
        time_limit="1",
        lead=58,
        job_file=job_file,
        store="file://" + root,
        env={"RGT_HOME": cli.home},
    )
    job = _sbatch(slurm_cluster, script, str(tmp_path / "job.sh"), cli.env)
    try:
        wait(
            lambda: (
                {"slurm_requeued", "slurm_not_requeued"} & {e["kind"] for e in _events(cli, name)}
                if os.path.exists(RunDir(name, cli.home).events)
                else False
            ),
            240,
            "the first allocation's end",
            poll=0.25,
            info=lambda: _job_log(out)[-2000:],
        )
        kinds = [e["kind"] for e in _events(cli, name)]
        assert "slurm_requeued" not in kinds, kinds
        (why,) = [e for e in _events(cli, name) if e["kind"] == "slurm_not_requeued"]
        assert "sealed nothing newer" in why["reason"] and "--time" in why["remedy"], why
        assert slurm_cluster.job_field(job, "Restarts") in ("0", None, ""), job
    finally:
        slurm_cluster.run("scancel", job)
