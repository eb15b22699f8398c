"""The agent in its own container (`rgt-agent run --pod`) with the job started by the job
container's launcher (`python -m onbox.agent.podlaunch RUN_DIR`), as in rgt emit k8s's pod.

No cluster runs here: a "pod" is two real process trees (the agent's, the launcher's) that share
an RGT_HOME and the host's PID namespace, which is what ``shareProcessNamespace`` and the
emptyDir give the two containers. The tests do the kubelet's parts by hand: start the launcher
once the sidecar published the job lib (its startup probe), SIGTERM the launcher (the job
container's PID 1) to stop the pod, SIGTERM the agent after the launcher exits, restart a
SIGKILLed agent, and kill the whole job container at once (cgroup v2's group OOM kill).
For the job container's own filesystem, the launcher starts in a mount namespace of its own
(``unshare --mount``) with a tmpfs on the job's workdir, which the agent's view never has: the
outputs it seals can only come through the launcher's /proc/PID/root.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence

import pytest

from onbox.agent import procfs
from onbox.common.rundir import RunDir
from tests import mounts
from tests.conftest import agent_exe, fixture, require
from tests.polling import latest_step, wait

JOB = fixture("pod_job.py")
MEM_LIMIT = 96 << 20  # the job container's memory limit in the OOM test


class Pod:
    """One pod: an RGT_HOME (the emptyDir), the agent sidecar and the job container."""

    def __init__(self, home: str, store: str, name: str, job: List[str], grace: int = 5) -> None:
        self.home, self.store, self.name, self.job, self.grace = home, store, name, job, grace
        self.toml = ""  # more top-level job file lines (workdir, outputs)
        os.makedirs(home, exist_ok=True)
        self.run_dir = os.path.join(home, "runs", name)
        self.procs: List[subprocess.Popen[bytes]] = []
        self.agent: Optional[subprocess.Popen[bytes]] = None
        self.launcher: Optional[subprocess.Popen[bytes]] = None

    def env(self, **more: str) -> Dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RGT_")}
        env.update(RGT_HOME=self.home, **more)
        return env

    def start_agent(self, **more: str) -> subprocess.Popen[bytes]:
        """The agent sidecar (``more``: its own environment, e.g. a test's store hold)."""
        job = os.path.join(self.home, "job.toml")
        with open(job, "w") as f:  # the agent asks the job for a checkpoint with SIGUSR2
            f.write(f"command = {json.dumps(self.job)}\n{self.toml}")
            f.write('[checkpoint]\ntrigger = "signal:USR2"\n')
        argv = [*agent_exe(), "run", "--pod", job, "--name", self.name, "--store", self.store]
        argv += ["--grace", str(self.grace)]
        with open(os.path.join(self.home, "agent.out"), "ab") as out:
            self.agent = subprocess.Popen(
                argv, env=self.env(**more), stdout=out, stderr=out, start_new_session=True
            )
        self.procs.append(self.agent)
        return self.agent

    def start_launcher(self, cgroup: str = "", wrap: Sequence[str] = ()) -> subprocess.Popen[bytes]:
        lib = os.path.join(self.home, "lib", "pod")
        # The kubelet starts the job container once the sidecar's startup probe sees the lib.
        wait(lambda: os.path.exists(os.path.join(lib, "onbox", "agent", "podlaunch.py")), 60)

        def enter() -> None:  # the job container's cgroup, for everything the launcher starts
            if cgroup:
                with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
                    f.write(str(os.getpid()))

        with open(os.path.join(self.home, "launcher.out"), "ab") as out:
            self.launcher = subprocess.Popen(
                [*wrap, sys.executable, "-S", "-m", "onbox.agent.podlaunch", self.run_dir],
                env=self.env(PYTHONPATH=lib),
                stdout=out,
                stderr=out,
                start_new_session=True,
                preexec_fn=enter,
                cwd=self.home,
            )
        self.procs.append(self.launcher)
        return self.launcher

    def state(self) -> Dict[str, Any]:
        try:
            with open(os.path.join(self.run_dir, "state.json")) as f:
                out: Dict[str, Any] = json.load(f)
            return out
        except (OSError, ValueError):
            return {}

    def wait_state(self, *states: str, timeout: float = 60) -> Dict[str, Any]:
        st: Dict[str, Any] = wait(
            lambda: self.state() if self.state().get("state") in states else None,
            timeout,
            f"state {states} (now {self.state().get('state')})",
        )
        return st

    def events(self, kind: str) -> List[Dict[str, Any]]:
        with open(os.path.join(self.run_dir, "events.jsonl")) as f:
            evs = [json.loads(line) for line in f if line.strip()]
        return [e for e in evs if e["kind"] == kind]

    def output(self, attempt: int = 1) -> str:
        with open(RunDir(self.name, self.home).output_log(attempt)) as f:
            return f.read()

    def record(self, attempt: int) -> Dict[str, Any]:
        with open(RunDir(self.name, self.home).job_record(attempt)) as f:
            out: Dict[str, Any] = json.load(f)
        return out

    def exit_of(self, proc: subprocess.Popen[bytes], timeout: float = 60) -> int:
        return proc.wait(timeout=timeout)

    def end(self) -> int:
        """The kubelet's end of a pod whose main container exited: SIGTERM to the sidecar."""
        assert self.agent is not None
        self.agent.send_signal(signal.SIGTERM)
        return self.agent.wait(timeout=30)

    def close(self) -> None:
        pids = [p.pid for p in self.procs]
        attempts = os.path.join(self.run_dir, "attempts")
        for a in os.listdir(attempts) if os.path.isdir(attempts) else []:
            try:
                rec = self.record(int(a))
                pids += [rec["pid"], rec["shim"]["pid"]]
            except (OSError, ValueError, KeyError):
                pass
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in self.procs:
            p.wait(timeout=10)


@pytest.fixture
def pods(tmp_path: Any) -> Iterator[List[Pod]]:
    made: List[Pod] = []
    yield made
    for pod in made:
        pod.close()


def _pod(pods: List[Pod], tmp_path: Any, which: str, name: str, steps: int, *extra: str) -> Pod:
    store = tmp_path / "durable"
    store.mkdir(exist_ok=True)
    pod = Pod(str(tmp_path / which), f"file://{store}", name, [*JOB, str(steps), *extra])
    pods.append(pod)
    return pod


def _store(tmp_path: Any) -> str:
    return str(tmp_path / "durable")


def test_pod_runs_a_job_to_succeeded_and_the_launcher_exits_0(
    pods: List[Pod], tmp_path: Any
) -> None:
    pod = _pod(pods, tmp_path, "pod1", "ok", 12)
    pod.start_agent()
    launcher = pod.start_launcher()
    assert pod.exit_of(launcher) == 0  # the main container's code is the run's
    assert pod.state()["state"] == "SUCCEEDED"
    assert "finished at step 12" in pod.output()
    assert os.path.exists(os.path.join(_store(tmp_path), "ok", "DONE.json"))
    # The job ran in the launcher's tree, under its shim: not the agent's child.
    rec = pod.record(1)
    assert pod.agent is not None and procfs.read_stat(rec["shim"]["pid"]) is None
    assert pod.agent.poll() is None  # a native sidecar waits for its SIGTERM, not exits
    assert pod.end() == 0


def test_sigterm_to_the_launcher_preempts_seals_and_exits_13(
    pods: List[Pod], tmp_path: Any
) -> None:
    pod = _pod(pods, tmp_path, "pod1", "pre", 100000)
    pod.start_agent()
    launcher = pod.start_launcher()
    wait(lambda: (latest_step(_store(tmp_path), "pre") or 0) >= 5, 60, "step 5 sealed")
    launcher.send_signal(signal.SIGTERM)  # the kubelet stops the main container first
    assert pod.exit_of(launcher) == 13
    assert pod.state()["state"] == "PREEMPTED"
    [last] = [ln for ln in pod.output().splitlines() if ln.startswith("wrote ")][-1:]
    assert last.endswith("(asked)")  # the checkpoint asked for at the stop was written...
    step = int(last.split("step_")[1].split(".")[0])
    assert latest_step(_store(tmp_path), "pre") == step  # ...and sealed before the end
    assert pod.end() == 13


def test_oom_kill_of_the_job_container_leaves_the_agent_to_seal_and_the_next_pod_resumes(
    pods: List[Pod], tmp_path: Any
) -> None:
    cgroup = mounts.memory_cgroup(MEM_LIMIT, "rgt-pod")
    require(bool(cgroup), "root and a writable cgroup v1 memory controller")
    hog = str(tmp_path / "hog")
    pod = _pod(pods, tmp_path, "pod1", "oom", 200, hog)
    try:
        pod.start_agent()
        launcher = pod.start_launcher(cgroup)
        wait(lambda: (latest_step(_store(tmp_path), "oom") or 0) >= 5, 60, "step 5 sealed")
        rec = pod.record(1)
        # cgroup v1 OOM-kills one process; v2 takes the whole container. Do v2's part: the
        # launcher and the shim are frozen while the kernel OOM-kills the job, then killed.
        for pid in (launcher.pid, rec["shim"]["pid"]):
            os.kill(pid, signal.SIGSTOP)
        open(hog, "w").close()
        job = procfs.Identity(rec["pid"], rec["start_ticks"])
        wait(lambda: not procfs.is_alive(job), 60, "the kernel to OOM-kill the job")
        for pid in (launcher.pid, rec["shim"]["pid"]):
            os.kill(pid, signal.SIGKILL)
        launcher.wait(timeout=10)
        st = pod.wait_state("PREEMPTED")
        assert pod.agent is not None and pod.agent.poll() is None  # its own container lives
        [died] = pod.events("job_container_died")
        assert died["oom"] is True and "OOM-killed" in died["reason"], died
        written = [w for w in pod.output().split() if w.startswith("step_")]
        last = max(int(w.split("_")[1].split(".")[0]) for w in written)
        assert latest_step(_store(tmp_path), "oom") == last  # the last complete one, sealed
        assert st["attempt"] == 1
        final = os.path.join(pod.run_dir, "pod", "final.json")
        wait(lambda: os.path.exists(final), 30, "the agent to finish the run")
        with open(final) as f:
            assert json.load(f)["code"] == 13
        assert pod.end() == 13
    finally:
        if os.path.exists(hog):
            os.unlink(hog)
        pod.close()
        mounts.remove_cgroup(cgroup)
    # The Job's next pod: fresh directories, the same store; it restores and finishes.
    again = _pod(pods, tmp_path, "pod2", "oom", 200, hog)
    again.start_agent()
    assert again.exit_of(again.start_launcher()) == 0
    out = again.output()
    assert f"resumed from {last}" in out and "finished at step 200" in out
    assert again.end() == 0


def test_a_killed_agent_sidecar_restarted_adopts_the_running_attempt(
    pods: List[Pod], tmp_path: Any
) -> None:
    pod = _pod(pods, tmp_path, "pod1", "adopt", 120)
    first = pod.start_agent()
    launcher = pod.start_launcher()
    wait(lambda: (latest_step(_store(tmp_path), "adopt") or 0) >= 5, 60, "step 5 sealed")
    job = pod.record(1)
    first.kill()  # SIGKILL: the sidecar container dies
    first.wait(timeout=10)
    time.sleep(0.2)  # the kubelet's restart comes a moment later; the job runs on meanwhile
    assert procfs.is_alive(procfs.Identity(job["pid"], job["start_ticks"]))
    pod.start_agent()
    assert pod.exit_of(launcher) == 0
    assert pod.state()["state"] == "SUCCEEDED" and pod.state()["attempt"] == 1
    assert len(pod.events("adopt")) == 1
    assert "finished at step 120" in pod.output() and "resumed from 0" in pod.output()
    assert os.path.exists(os.path.join(_store(tmp_path), "adopt", "DONE.json"))
    assert pod.end() == 0


def test_a_sidecar_that_leaves_an_unsealed_success_is_restarted_and_completes_it(
    pods: List[Pod], tmp_path: Any
) -> None:
    """The job succeeds while the store takes no upload (a file:// store held at its uploads,
    onbox/common/faults.py): the completion seal is cut, and the agent sidecar exits 14
    leaving the run RUNNING (onbox/agent/letgo.py left_unended). It writes no final.json: the
    launcher, and with it the pod and the results only its emptyDir holds, stays, and the
    kubelet's restart of the sidecar is the next agent that the remedy names: once the store
    answers it adopts the run, seals the rest and writes DONE.json, and the launcher exits 0.
    (A final.json of 14 would end the pod with the results unsealed: the next pod trains
    again from the last sealed step.)"""
    pod = _pod(pods, tmp_path, "pod1", "unsealed", 10)
    pod.toml = '[store]\nstall = "2s"\n'
    release, reached = tmp_path / "store-answers", tmp_path / "upload-held"
    hold = {"RGT_HOLD_AT": "store.put_file", "RGT_HOLD_UNTIL": str(release)}
    first = pod.start_agent(RGT_HOLD_REACHED=str(reached), **hold)
    launcher = pod.start_launcher()
    try:
        assert pod.exit_of(first, timeout=90) == 14  # StoreError: left RUNNING
    finally:
        release.write_text("")  # the store answers again (the hold lets its threads go)
    assert reached.exists()  # the store did hold an upload
    # STARTING or RUNNING: the state the run was in as its job ended (its start grace)
    assert pod.state()["state"] in ("STARTING", "RUNNING")
    assert len(pod.events("agent_left")) == 1
    assert not os.path.exists(os.path.join(pod.run_dir, "pod", "final.json"))
    assert launcher.poll() is None  # the job container waits for the run's final code
    assert not os.path.exists(os.path.join(_store(tmp_path), "unsealed", "DONE.json"))
    pod.start_agent()  # the kubelet restarts the sidecar
    assert pod.exit_of(launcher) == 0
    assert pod.state()["state"] == "SUCCEEDED" and len(pod.events("adopt")) == 1
    assert os.path.exists(os.path.join(_store(tmp_path), "unsealed", "DONE.json"))
    assert latest_step(_store(tmp_path), "unsealed") == 10
    assert pod.end() == 0


# The job of the own-filesystem tests: writes its outputs in its cwd (the workdir, a tmpfs in
# its own mount namespace), says so, then waits (bounded) for GO when given one. "leak" also
# plants links out of the workdir where outputs are declared.
OUT_JOB = """
import os, sys, time
seed, mode, go = sys.argv[1], sys.argv[2], sys.argv[3]
with open("result.bin", "wb") as f:
    f.write(bytes.fromhex(seed) * 4096)
if mode == "leak":
    os.symlink("/etc/hostname", "leak")
    os.makedirs("d")
    os.symlink("/etc", "d/etc")
    with open("d/ok.txt", "w") as f:
        f.write("ok")
print("outputs written in", os.getcwd(), flush=True)
deadline = time.monotonic() + 60
while go and not os.path.exists(go) and time.monotonic() < deadline:
    time.sleep(0.05)
"""


def _own_fs_pod(pods: List[Pod], tmp_path: Any, name: str, mode: str, go: str) -> Any:
    """A pod whose job container has its own view of the workdir; returns (pod, workdir, seed,
    the launcher's wrapper)."""
    require(os.geteuid() == 0 and bool(shutil.which("unshare")), "root and util-linux unshare")
    script, workdir = tmp_path / "out_job.py", tmp_path / "app"
    script.write_text(OUT_JOB)
    workdir.mkdir()
    seed = os.urandom(16).hex()
    pod = _pod(pods, tmp_path, "pod1", name, 0)
    pod.job = [sys.executable, str(script), seed, mode, go]
    outputs = ["result.bin", "leak", "d/"] if mode == "leak" else ["result.bin"]
    pod.toml = f"workdir = {json.dumps(str(workdir))}\noutputs = {json.dumps(outputs)}\n"
    # The job container's mounts: a copy of ours, private, plus a tmpfs on the workdir; the
    # namespace ends with its last process (the launcher, once final.json is there).
    mount = 'mount -t tmpfs -o size=4m rgt-job "$1" && shift && exec "$@"'
    wrap = ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount, "sh"]
    return pod, str(workdir), seed, [*wrap, str(workdir)]


def _mounted(workdir: str, pid: Optional[int] = None) -> str:
    task = ["--task", str(pid)] if pid else []
    got = subprocess.run(
        ["findmnt", "-n", "-o", "SOURCE,FSTYPE", *task, "--mountpoint", workdir],
        capture_output=True,
        text=True,
        timeout=10,
    )
    return got.stdout.strip()


def _done(tmp_path: Any, run: str) -> Dict[str, Any]:
    with open(os.path.join(_store(tmp_path), run, "DONE.json")) as f:
        out: Dict[str, Any] = json.load(f)
    return out


def test_a_pod_seals_outputs_from_the_job_containers_own_filesystem(
    pods: List[Pod], tmp_path: Any
) -> None:
    go = str(tmp_path / "go")
    pod, workdir, seed, wrap = _own_fs_pod(pods, tmp_path, "outs", "plain", go)
    pod.start_agent()
    launcher = pod.start_launcher(wrap=wrap)
    log = RunDir(pod.name, pod.home).output_log(1)
    wait(lambda: os.path.exists(log) and "outputs written" in pod.output(), 60, "the outputs")
    # The job's view has the tmpfs with its output; the agent's has neither.
    assert _mounted(workdir, launcher.pid) == "rgt-job tmpfs"
    ns = os.stat(f"/proc/{launcher.pid}/ns/mnt").st_ino
    assert _mounted(workdir) == "" and os.listdir(workdir) == []
    open(go, "w").close()
    assert pod.exit_of(launcher) == 0
    assert pod.state()["state"] == "SUCCEEDED"
    done = _done(tmp_path, "outs")
    [entry] = [e for e in done["files"] if e["path"] == "result.bin"]
    assert done["missing_outputs"] == []
    with open(os.path.join(_store(tmp_path), entry["key"]), "rb") as f:
        assert f.read() == bytes.fromhex(seed) * 4096
    assert os.listdir(workdir) == []  # so the bytes came through the launcher's root
    assert pod.end() == 0
    # Nothing left mounted: the job container's namespace ended with its last process.
    assert _mounted(workdir) == ""
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}/ns/mnt").st_ino == ns:
                left.append(pid)
        except OSError:
            pass
    assert left == []


def test_a_pod_refuses_output_links_out_of_the_job_workdir(pods: List[Pod], tmp_path: Any) -> None:
    pod, workdir, seed, wrap = _own_fs_pod(pods, tmp_path, "leaky", "leak", "")
    pod.start_agent()
    assert pod.exit_of(pod.start_launcher(wrap=wrap)) == 0
    assert pod.state()["state"] == "SUCCEEDED"
    refused = {e["path"]: e["reason"] for e in pod.events("output_refused")}
    assert set(refused) == {"leak", "d/etc"}, refused
    assert "/etc/hostname" in refused["leak"] and "outside its workdir" in refused["leak"]
    assert "symlink" in refused["d/etc"]
    done = _done(tmp_path, "leaky")
    sealed = {e["path"] for e in done["files"] if e["key"].startswith("leaky/outputs/")}
    assert sealed == {"result.bin", "d/ok.txt"}
    with open("/etc/hostname", "rb") as f:
        hostname = f.read()
    for dirpath, _, files in os.walk(_store(tmp_path)):  # nothing of /etc in the store
        for fn in files:
            with open(os.path.join(dirpath, fn), "rb") as f:
                assert f.read() != hostname, os.path.join(dirpath, fn)
    assert pod.end() == 0
    assert _mounted(workdir) == "" and os.listdir(workdir) == []
