"""A Slurm deploy refused because a job named for the run is live, whose look at that job
(``queue.live_jobs``: is it this laptop's own, queued from the same release?) fails: nothing was
submitted, so the release the deploy pushed for the job goes again (``unsubmitted``), as after
any refused submit; the deploy's error stays the refusal (exit 5), saying that whether the
live job is this laptop's own could not be checked, and why.

Real parts: the session's single-node Slurm, the real `rgt` CLI over a real sshd "login node"
of this test's own. The one fake: ``squeue`` on the login node's PATH is a wrapper of the real
one that, once the test arms it, fails (or hangs, for a Ctrl-C during the look) when called
outside the submit's lock (its own ``squeue`` inside that lock answers as Slurm does, so the
submit is refused for the live job); nothing else on the cluster fails that way on demand.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest

from controller.registry import Registry
from tests.conftest import ROOT, _kill_run_processes, require
from tests.integration.test_slurm_deploy import Login
from tests.laptop import rgt_exe
from tests.slurm import SlurmCluster, missing
from tests.sshd import start_sshd

NAME = "slurm-sq"
FAKE = """#!/bin/sh
# The real squeue, but a failure (exit 1) once {arm} exists and the caller does not hold the
# run's submit lock (flock -n gets it: no caller holds it); with {arm}-hang too, a squeue that
# does not answer: it writes its PID to {arm}.pid (for the test to end it) and sleeps.
if [ -e "{arm}" ] && flock -n "{lock}" true; then
  if [ -e "{arm}-hang" ]; then
    echo $$ >"{arm}.pid.tmp" && mv "{arm}.pid.tmp" "{arm}.pid" && exec sleep 300
  fi
  echo "squeue: error: Unable to contact slurm controller (fake)" >&2; exit 1
fi
exec {real} "$@"
"""


@pytest.fixture
def login(slurm_cluster: SlurmCluster) -> Iterator[Login]:
    why = missing()
    require(why is None, why or "")
    root = tempfile.mkdtemp(prefix="rgt-slurm-sq-", dir="/tmp")  # short: #SBATCH paths
    fake = Path(root, "fake-bin")
    fake.mkdir()
    real = shutil.which("squeue")
    assert real is not None
    box_home = os.path.join(root, "box")
    lock = os.path.join(box_home, "runs", NAME, ".submit.lock")
    (fake / "squeue").write_text(FAKE.format(arm=f"{root}/arm", lock=lock, real=real))
    (fake / "squeue").chmod(0o755)
    path = f"{fake}:{os.environ.get('PATH', '/usr/bin:/bin')}"
    server = start_sshd(
        os.path.join(root, "sshd"), set_env={"SLURM_CONF": slurm_cluster.conf, "PATH": path}
    )
    project = Path(root, "project")
    project.mkdir()
    shutil.copy(os.path.join(ROOT, "examples", "train_plain.py"), project / "train_plain.py")
    lg = Login(server, slurm_cluster, os.path.join(root, "ctl"), box_home,
               os.path.join(root, "store"), str(project))  # fmt: skip
    os.makedirs(lg.ctl_home)
    os.makedirs(lg.store)
    try:
        yield lg
    finally:
        lg.cancel(NAME)
        _kill_run_processes(lg.box_home)
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_a_refused_submit_whose_live_job_cannot_be_looked_at_fake_squeue_drops_its_release(
    login: Login,
) -> None:
    """The run's job is queued (held an hour) from release R; R is then gone from the login
    node (and the deploy's current link with it), so the same code deployed again pushes R
    anew; the submit is refused (the run's job is live), and the look at whether that job is
    this laptop's own fails (squeue fails). Before the fix that look's HostError ended the
    deploy (exit 9) and R, pushed for a job never submitted, stayed on the login node."""
    flags = ["--time", "10", "--seal-time", "2", "--sbatch", "--begin=now+3600"]
    job = ["train_plain.py", "--steps", "10"]
    p = login.deploy(NAME, *flags, job=job)
    assert p.returncode == 0, p.stderr
    queued = login.queued(NAME)
    assert len(queued) == 1, queued
    rel = Registry(login.ctl_home).get(NAME).release
    assert rel, "the deploy recorded no release"
    release = Path(login.box_home, "releases", rel)
    assert release.is_dir(), release
    shutil.rmtree(release)
    os.unlink(Path(login.box_home, "deploys", NAME, "current"))
    Path(os.path.dirname(login.project), "arm").write_text("")
    p = login.deploy(NAME, *flags, job=job)
    assert p.returncode == 5, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr, p.stderr
    assert f"run {NAME} has a live Slurm job" in p.stderr, p.stderr
    assert f"whether it is this laptop's own job {queued[0]}" in p.stderr, p.stderr
    assert "Unable to contact slurm controller (fake)" in p.stderr, p.stderr
    assert f"rgt: release {rel}, which this deploy pushed," in p.stderr, p.stderr
    assert not release.exists(), "the release pushed for a job never submitted stayed"
    assert login.queued(NAME) == queued  # nothing more submitted


def test_ctrl_c_while_the_live_job_is_looked_at_fake_squeue_drops_its_release(
    login: Login,
) -> None:
    """As above, but the look at the live job does not answer (squeue hangs) and the user
    presses Ctrl-C (a SIGINT to rgt's whole process group, as a terminal sends it). Before the
    fix the deploy ended (exit 130) and R, pushed for a job never submitted, stayed on the
    login node, with no line about it. Now the Ctrl-C ends the deploy as promptly, saying what
    became of R, which goes."""
    flags = ["--time", "10", "--seal-time", "2", "--sbatch", "--begin=now+3600"]
    job = ["train_plain.py", "--steps", "10"]
    p = login.deploy(NAME, *flags, job=job)
    assert p.returncode == 0, p.stderr
    queued = login.queued(NAME)
    assert len(queued) == 1, queued
    rel = Registry(login.ctl_home).get(NAME).release
    assert rel, "the deploy recorded no release"
    release = Path(login.box_home, "releases", rel)
    shutil.rmtree(release)
    os.unlink(Path(login.box_home, "deploys", NAME, "current"))
    arm = Path(os.path.dirname(login.project), "arm")
    Path(f"{arm}-hang").write_text("")
    arm.write_text("")
    pid_file = Path(f"{arm}.pid")
    out = Path(os.path.dirname(login.project), "deploy.out")
    argv = [
        *rgt_exe(), "deploy", login.target, "--profile", "slurm", "--name", NAME,
        "--python", sys.executable, "--project", login.project,
        "--store", "file://" + login.store, *flags, "--", sys.executable, *job,
    ]  # fmt: skip
    with open(out, "wb") as f:
        # Its own process group, as a shell's foreground job: the SIGINT goes to all of it.
        deploy = subprocess.Popen(
            argv,
            env=login.env(),
            cwd=login.ctl_home,
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 240
        while not pid_file.exists():
            assert deploy.poll() is None, out.read_bytes()[-3000:]
            assert time.monotonic() < deadline, "the deploy never looked at the live job"
            time.sleep(0.1)
        os.killpg(deploy.pid, signal.SIGINT)
        rc = deploy.wait(150)  # the drop is one command, bounded; the hung squeue is not waited
    finally:
        if deploy.poll() is None:
            os.killpg(deploy.pid, signal.SIGKILL)
            deploy.wait(10)
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
    said = out.read_bytes().decode(errors="replace")
    assert rc == 130, (rc, said)
    assert "Traceback" not in said, said
    assert f"rgt: release {rel}, which this deploy pushed, was removed" in said, said
    assert not release.exists(), "the release pushed for a job never submitted stayed"
    assert login.queued(NAME) == queued  # nothing more submitted
