"""A throwaway single-node Slurm (slurmctld + slurmd, munge for auth) for tests that need a real
scheduler.

``start_slurm(dir)`` starts munged (as the munge user, when none answers), writes a slurm.conf
whose state, spool and logs live in ``dir``, starts slurmctld and slurmd in the foreground as our
children, and returns once ``sinfo`` shows the node idle (about a second). ``SlurmCluster.stop``
cancels every job, then stops slurmd before slurmctld (the other order leaves slurmstepd retrying
RPCs for 10 s and more), each by PID; munged is left running only when it was already running
before, else the last cluster to stop stops it (several test sessions may share it).

Everything runs as root with ``proctrack/linuxproc`` (no cgroup plugin, no systemd here).
``AuthInfo=cred_expire=5`` (the least Slurm takes) lets a requeued job start again after about
6 s rather than the default 120 s, and ``KillWait`` is short so that a stop signal's grace is
seconds, not 30 s.
Clients find the cluster through ``SLURM_CONF``: ``env()`` is the environment for them (also what
a test's sshd "login node" passes to its sessions, ``ssh_setenv()``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import time
from typing import Dict, Iterator, List, Optional

from onbox.agent import procfs

DAEMONS = ("slurmctld", "slurmd", "munged")
CLIENTS = ("sbatch", "squeue", "scontrol", "scancel", "sinfo", "munge")
MUNGE_RUN = "/run/munge"
MUNGE_KEY = "/etc/munge/munge.key"
MUNGE_USERS = os.path.join(MUNGE_RUN, ".rgt-tests.lock")  # shared-locked by each cluster
MUNGE_OURS = os.path.join(MUNGE_RUN, ".rgt-tests-munged.pid")  # the munged a test started
MUNGE_START = os.path.join(MUNGE_RUN, ".rgt-tests-start.lock")  # joining and leaving, one at once


def _sbin(name: str) -> Optional[str]:
    for d in ("/usr/sbin", "/usr/bin"):
        p = os.path.join(d, name)
        if os.access(p, os.X_OK):
            return p
    return shutil.which(name)


def missing() -> Optional[str]:
    """What this machine lacks to run a test Slurm, or None."""
    if os.geteuid() != 0:
        return "root (slurmd and munged are started as root and munge here)"
    for name in DAEMONS + CLIENTS:
        if _sbin(name) is None:
            return f"{name} (apt-get install slurm-wlm munge)"
    return None


def _free_port_pair() -> int:
    """A port P with P and P+1 free on loopback (slurmctld's and slurmd's)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port > 65000:
            continue
        try:
            with socket.socket() as s2:
                s2.bind(("127.0.0.1", port + 1))
        except OSError:
            continue
        return int(port)
    raise RuntimeError("no two adjacent free ports on loopback")


def _munge_ok(env: Dict[str, str]) -> bool:
    r = subprocess.run([_sbin("munge") or "munge", "-n"], env=env, capture_output=True, timeout=10)
    return r.returncode == 0


def _alive(pid: int) -> bool:
    st = procfs.read_stat(pid)  # a zombie (state Z) has exited; PID 1 reaps it late here
    return st is not None and st.state != "Z"


def _stop_pid(pid: int, timeout: float = 10.0) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@dataclasses.dataclass
class SlurmCluster:
    """A running single-node cluster: its directory, slurm.conf and daemons' PIDs."""

    dir: str
    conf: str
    node: str
    ctld: subprocess.Popen  # type: ignore[type-arg]
    slurmd: subprocess.Popen  # type: ignore[type-arg]
    munge_use: int  # a shared flock on MUNGE_USERS while this cluster uses munged
    partition: str = "debug"

    def env(self, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        """An environment for Slurm's client tools (sbatch, squeue, ...): ``SLURM_CONF`` set."""
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = self.conf
        return env

    def ssh_setenv(self) -> str:
        """The sshd_config line that gives a login node's sessions this cluster."""
        return f"SetEnv SLURM_CONF={self.conf}"

    def run(self, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        """A client command against this cluster (``squeue``, ``scontrol``, ...)."""
        return subprocess.run(
            list(argv), env=self.env(), capture_output=True, text=True, timeout=timeout
        )

    def job_ids(self) -> List[str]:
        r = self.run("squeue", "-h", "-o", "%A")
        return [x for x in r.stdout.split() if x.strip()]

    def job_field(self, job: str, field: str) -> Optional[str]:
        """One ``Key=value`` of ``scontrol show job -o JOB`` (None when not shown)."""
        r = self.run("scontrol", "show", "job", "-o", job)
        for word in r.stdout.split():
            key, _, value = word.partition("=")
            if key == field:
                return value
        return None

    def wait_job(self, job: str, *states: str, timeout: float = 120) -> str:
        """Wait until JOB's JobState is one of ``states``; the state seen."""
        deadline = time.monotonic() + timeout
        seen = None
        while time.monotonic() < deadline:
            seen = self.job_field(job, "JobState")
            if seen in states:
                return seen
            time.sleep(0.5)
        raise AssertionError(f"job {job} is {seen}, not {states}, after {timeout:.0f} s")

    def cancel_all(self) -> None:
        ids = self.job_ids()
        if ids:
            self.run("scancel", "--full", "--signal=KILL", *ids)
            self.run("scancel", *ids)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and self.job_ids():
            time.sleep(0.5)

    def stop(self) -> None:
        """Jobs, then slurmd, then slurmctld (then munged, if we started it), each by PID."""
        try:
            if self.ctld.poll() is None:
                self.cancel_all()
        finally:
            _stop_pid(self.slurmd.pid)
            _stop_pid(self.ctld.pid)
            for p in (self.slurmd, self.ctld):
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
            _leave_munge(self.munge_use)


def _start_munge(env: Dict[str, str]) -> Optional[int]:
    """munged as the munge user (as root it refuses its seed dir); its PID, None when one ran."""
    if os.path.exists(MUNGE_KEY) and _munge_ok(env):
        return None
    if not os.path.exists(MUNGE_KEY):
        subprocess.run([_sbin("mungekey") or "mungekey", "-c", "-f"], check=True, timeout=30)
    shutil.chown(MUNGE_KEY, "munge", "munge")
    os.chmod(MUNGE_KEY, 0o400)
    subprocess.run(
        ["runuser", "-u", "munge", "--", _sbin("munged") or "munged"], check=True, timeout=30
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not _munge_ok(env):
        time.sleep(0.1)
    try:
        with open(os.path.join(MUNGE_RUN, "munged.pid")) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _join_munge(env: Dict[str, str]) -> int:
    """Use munged, starting it when none answers; a shared flock on MUNGE_USERS is held while
    in use. Several test sessions (pytest-xdist workers) may run clusters at once: the munged
    one started is recorded in MUNGE_OURS, and the last cluster to stop stops it
    (``_leave_munge``). Joining and leaving are serialised by MUNGE_START, so that one session
    never stops the munged another is about to use."""
    os.makedirs(MUNGE_RUN, exist_ok=True)
    shutil.chown(MUNGE_RUN, "munge", "munge")
    os.chmod(MUNGE_RUN, 0o755)
    with _start_lock():
        pid = _start_munge(env)
        if pid is not None:
            with open(MUNGE_OURS, "w") as f:
                f.write(str(pid))
        fd = os.open(MUNGE_USERS, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


@contextlib.contextmanager
def _start_lock() -> Iterator[None]:
    fd = os.open(MUNGE_START, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _leave_munge(fd: int) -> None:
    """Stop using munged; the last user stops the munged a test started (by its PID)."""
    with _start_lock():
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)  # another cluster still uses it
            return
        try:
            with open(MUNGE_OURS) as f:
                pid: Optional[int] = int(f.read().strip())
            os.unlink(MUNGE_OURS)
        except (OSError, ValueError):
            pid = None  # munged was running before any test
        if pid is not None:
            _stop_pid(pid)
        os.close(fd)


_CONF = """\
ClusterName=rgt
SlurmctldHost={node}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# a requeued job waits cred_expire (default 120 s) before it may start again; 5 is the least
# slurmctld takes (a launch credential lives that long: a loopback launch takes milliseconds)
AuthInfo=cred_expire=5
MailProg=/bin/true
SlurmctldPort={port}
SlurmdPort={port1}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
# the stop signal's grace on scancel, a time limit or a requeue (default 30 s)
KillWait={kill_wait}
MinJobAge=300
SchedulerParameters=sched_interval=1
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} Sockets=1 CoresPerSocket={cpus} ThreadsPerCore=1 \
RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


def start_slurm(d: str, kill_wait: int = 5, timeout: float = 30.0) -> SlurmCluster:
    """Start a single-node cluster with its state in ``d``; returns once the node is idle."""
    d = os.path.abspath(d)
    for sub in ("state", "spool", "log"):
        os.makedirs(os.path.join(d, sub), exist_ok=True)
    node = socket.gethostname().split(".")[0]
    port = _free_port_pair()
    conf = os.path.join(d, "slurm.conf")
    with open(conf, "w") as f:
        f.write(
            _CONF.format(
                node=node,
                port=port,
                port1=port + 1,
                d=d,
                kill_wait=kill_wait,
                cpus=os.cpu_count() or 1,
            )
        )
    env = dict(os.environ, SLURM_CONF=conf)
    munge_use = _join_munge(env)
    out = open(os.path.join(d, "log", "daemons.out"), "ab")  # noqa: SIM115 (the daemons' stdout)
    ctld = subprocess.Popen(
        [_sbin("slurmctld") or "slurmctld", "-D", "-f", conf], env=env, stdout=out, stderr=out
    )
    slurmd = subprocess.Popen(
        [_sbin("slurmd") or "slurmd", "-D", "-f", conf], env=env, stdout=out, stderr=out
    )
    out.close()
    cluster = SlurmCluster(d, conf, node, ctld, slurmd, munge_use)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = cluster.run("sinfo", "-h", "-o", "%T", timeout=10)
        if r.returncode == 0 and "idle" in r.stdout.split():
            return cluster
        if ctld.poll() is not None or slurmd.poll() is not None:
            break
        time.sleep(0.2)
    cluster.stop()
    with open(os.path.join(d, "log", "slurmctld.log"), errors="replace") as f:
        tail = f.read()[-2000:]
    raise RuntimeError(f"Slurm did not come up within {timeout:.0f} s: {tail}")
