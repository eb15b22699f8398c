"""rgt-agent with real processes: what a user relies on when nobody is watching the box.

Each test starts real agents, shims and fixture jobs, kills them for real, and checks what a
user would see: the job outlives its agent, is never run twice, is restarted with the right
budget, and is stopped with every process it made.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Dict, List

import pytest

from onbox.agent import procfs
from onbox.agent.daemon import TAG_VAR
from onbox.common.errors import StopFailed
from onbox.common.faults import STOP_AFTER_EVENT
from tests import mounts
from tests.conftest import ROOT, Cli, agent_exe, fixture, require
from tests.polling import wait


def _toml(path: str, command: List[str], **restart: Any) -> str:
    lines = ["command = " + json.dumps(command)]
    grace = restart.pop("grace", None)
    if grace is not None:
        lines.append(f"grace = {json.dumps(grace)}")
    if restart:
        lines.append("[restart]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in restart.items()]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def _job_file(cli: Cli, name: str, command: List[str], **restart: Any) -> str:
    return _toml(os.path.join(cli.home, f"{name}.toml"), command, **restart)


def _alive(pid: int) -> bool:
    return procfs.identity(pid) is not None


def _wait_gone(pids: List[int], timeout: float = 15) -> None:
    wait(
        lambda: not any(_alive(p) for p in pids),
        timeout,
        f"{pids} to go",
        info=lambda: [p for p in pids if _alive(p)],
    )


def _tagged(cli: Cli, name: str, attempt: int) -> List[int]:
    with open(os.path.join(cli.home, "runs", name, "attempts", f"{attempt:04d}", "job.json")) as f:
        tag = json.load(f)["tag"]
    return [i.pid for i in procfs.find_tagged(TAG_VAR, tag)]


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        # Any process's arguments may be bytes that are not UTF-8 (the hostile-box tests run
        # such a job): this scan over every pid must not fail on one of them.
        return f.read().replace(b"\0", b" ").decode(errors="replace")


def _shim_pid(cli: Cli, name: str, attempt: int) -> int:
    with open(os.path.join(cli.home, "runs", name, "attempts", f"{attempt:04d}", "job.json")) as f:
        pid: int = json.load(f)["shim"]["pid"]
    return pid


def test_agent_kill9_leaves_the_job_running_and_start_reattaches_and_learns_the_exit(
    cli: Cli,
) -> None:
    cli.env["RGT_AGENT_RESPAWN_DELAY"] = "1000"  # no shim rescue: this test re-attaches by hand
    marker = os.path.join(cli.home, "go")
    job = fixture("crash_after.py")
    # The job waits for the marker, then exits with code 7, while no agent is alive.
    cmd = ["bash", "-c", f"while [ ! -e {marker} ]; do sleep 0.05; done; exec {' '.join(job)} 0 7"]
    cli("start", "--name", "r1", "--", *cmd, check=True)
    st = cli.wait_state("r1", "STARTING", "RUNNING")
    job_pid, agent_pid = st["pid"], st["agent"]["pid"]
    os.kill(agent_pid, signal.SIGKILL)
    _wait_gone([agent_pid])
    assert _alive(job_pid)
    assert not cli.status("r1")["agent"]["alive"]
    open(marker, "w").close()  # the job ends while nobody supervises it
    _wait_gone([job_pid])
    p = cli("start", "--name", "r1", check=True)
    assert "re-attached" in p.stdout
    cli.wait_state("r1", "BACKOFF", "STARTING", "RUNNING", "FAILED")
    # The exit of attempt 1, learned on re-attach (the state may already show a later attempt:
    # the marker is there, so each restart exits 7 at once too).
    exits = [e for e in cli.events("r1") if e["kind"] == "exit"]
    assert exits and exits[0]["reason"].startswith("attempt 1:"), exits
    assert exits[0]["code"] == 7 and "exited with code 7" in exits[0]["reason"], exits
    cli("stop", "r1", "--grace", "1", check=True)


def test_reattach_never_starts_a_second_copy(cli: Cli) -> None:
    cli.env["RGT_AGENT_RESPAWN_DELAY"] = "1000"
    cli("start", "--name", "r2", "--", *fixture("hang.py"), check=True)
    st = cli.wait_state("r2", "RUNNING", timeout=30)
    os.kill(st["agent"]["pid"], signal.SIGKILL)
    _wait_gone([st["agent"]["pid"]])
    cli("start", "--name", "r2", check=True)
    again = cli.wait_for("r2", lambda s: s["agent"]["alive"], what="a new agent")
    assert again["agent"]["pid"] != st["agent"]["pid"]
    assert (again["pid"], again["attempt"], again["state"]) == (st["pid"], 1, "RUNNING")
    assert _tagged(cli, "r2", 1) == [st["pid"]]
    assert not os.path.exists(os.path.join(cli.home, "runs", "r2", "attempts", "0002"))
    assert "adopt" in [e["kind"] for e in cli.events("r2")]
    cli("stop", "r2", "--grace", "1", check=True)


def test_a_killed_agent_is_started_again_by_the_shim(cli: Cli) -> None:
    cli("start", "--name", "r3", "--", *fixture("hang.py"), check=True)
    st = cli.wait_state("r3", "STARTING", "RUNNING")
    os.kill(st["agent"]["pid"], signal.SIGKILL)
    new = cli.wait_for(
        "r3",
        lambda s: s["agent"]["alive"] and s["agent"]["pid"] != st["agent"]["pid"],
        timeout=30,
        what="the shim to restart the agent",
    )
    assert new["pid"] == st["pid"] and _alive(st["pid"])
    assert "agent_respawn" in [e["kind"] for e in cli.events("r3")]
    assert "rgt-agent agent r3" in _cmdline(new["agent"]["pid"])
    cli("stop", "r3", "--grace", "1", check=True)


def test_ten_concurrent_starts_one_agent(cli: Cli) -> None:
    results: List[subprocess.CompletedProcess[str]] = []
    gate = threading.Barrier(10)

    def one() -> None:
        gate.wait()
        results.append(cli("start", "--name", "r4", "--", *fixture("hang.py")))

    threads = [threading.Thread(target=one) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = sorted(r.returncode for r in results)
    assert codes.count(0) == 1, [(r.returncode, r.stderr) for r in results]
    for r in results:
        if r.returncode:
            assert r.returncode == 5, r.stderr
            assert "held by rgt-agent pid" in r.stderr and len(r.stderr.splitlines()) == 1
    st = cli.wait_state("r4", "RUNNING", timeout=30)
    assert _tagged(cli, "r4", 1) == [st["pid"]]
    agents = [p for p in procfs.pids() if "rgt-agent agent r4" in _safe_cmdline(p)]
    assert agents == [st["agent"]["pid"]]
    cli("stop", "r4", "--grace", "1", check=True)


def _safe_cmdline(pid: int) -> str:
    try:
        return _cmdline(pid)
    except OSError:
        return ""


def test_crash_loop_ends_failed_with_the_reason_and_the_log_tail(cli: Cli) -> None:
    job = _job_file(
        cli,
        "r5",
        fixture("crash_now.py") + ["4"],
        start_grace="2s",
        max_error_restarts=2,
        backoff_initial="0.1s",
        backoff_max="0.2s",
    )
    cli("start", job, "--name", "r5", check=True)
    st = cli.wait_state("r5", "FAILED", timeout=30)
    assert st["attempt"] == 3 and st["restarts"] == 2
    reason = st["last_exit"]["reason"]
    assert "exited with code 4" in reason and "error restart budget spent (2/2)" in reason
    assert "crashing at once" in reason  # the tail of the job's own log
    kinds = [e["state"] for e in cli.events("r5") if e["kind"] == "state"]
    assert kinds == ["STARTING", "BACKOFF", "STARTING", "BACKOFF", "STARTING", "FAILED"]
    assert any("crash loop" in e["reason"] for e in cli.events("r5"))


def test_a_job_past_its_own_file_size_limit_spends_the_error_budget(cli: Cli) -> None:
    """The job sets RLIMIT_FSIZE (ulimit -f) and writes past it: the kernel's SIGXFSZ ends it,
    and it would again at every restart. It was taken for an outside kill and restarted on the
    preemption budget (100 tries); it is a crash of the job's own, on the error budget."""
    big = os.path.join(cli.home, "big.bin")
    job = _job_file(
        cli,
        "rx",
        ["sh", "-c", f"ulimit -f 64; exec head -c 1048576 /dev/zero > {big}"],
        start_grace="2s",
        max_error_restarts=1,
        backoff_initial="0.1s",
        backoff_max="0.2s",
    )
    cli("start", job, "--name", "rx", check=True)
    st = cli.wait_state("rx", "FAILED", timeout=30)
    assert st["attempt"] == 2 and st["budgets"]["preempt_used"] == 0, st
    assert "error restart budget spent (1/1)" in st["last_exit"]["reason"], st["last_exit"]
    exits = [e for e in cli.events("rx") if e["kind"] == "exit"]
    assert [e["exit_kind"] for e in exits] == ["crashed", "crashed"], exits
    assert all(e["signal"] == signal.SIGXFSZ and "RLIMIT_FSIZE" in e["reason"] for e in exits)
    assert os.path.getsize(big) < 1048576  # cut at the limit the job set (not one of rgt's)


def _running(attempt: int) -> Callable[[Dict[str, Any]], bool]:
    return lambda s: bool(s["attempt"] == attempt and s["state"] == "RUNNING")


def test_outside_kills_spend_the_preemption_budget_not_the_error_budget(cli: Cli) -> None:
    job = _job_file(
        cli,
        "r6",
        fixture("hang.py"),
        start_grace="0.5s",
        max_error_restarts=0,
        max_preempt_restarts=2,
    )
    cli("start", job, "--name", "r6", check=True)
    for attempt in (1, 2):
        st = cli.wait_for("r6", _running(attempt), what=f"attempt {attempt} running")
        os.kill(st["pid"], signal.SIGKILL)
    st = cli.wait_for("r6", lambda s: s["attempt"] == 3 and s["state"] == "RUNNING")
    assert st["budgets"]["preempt_used"] == 2 and st["budgets"]["error_used"] == 0
    os.kill(st["pid"], signal.SIGKILL)
    st = cli.wait_state("r6", "FAILED")
    assert "preemption restart budget spent (2/2)" in st["last_exit"]["reason"]


def test_stop_escalates_to_sigkill_of_the_whole_group_and_setsid_children(cli: Cli) -> None:
    cli("start", "--name", "r7", "--grace", "1", "--", *fixture("forker.py"), check=True)
    pids_file = os.path.join(cli.home, "runs", "r7", "forker.pids")
    wait(lambda: os.path.exists(pids_file), 30, pids_file)
    with open(pids_file) as f:
        pids = [int(x) for x in f.read().split()]
    assert len(pids) == 4 and all(_alive(p) for p in pids)
    escapee = pids[2]
    assert procfs.read_stat(escapee).sid == escapee  # type: ignore[union-attr]
    p = cli("stop", "r7", check=True)
    assert "STOPPED" in p.stdout and "no process of attempt 1 remains" in p.stdout
    assert not any(_alive(pid) for pid in pids)  # stop returned only once all were gone
    st = cli.status("r7")
    assert st["state"] == "STOPPED" and st["last_exit"]["signal"] == signal.SIGKILL


def test_stop_finds_an_orphaned_setsid_grandchild_that_blanked_its_environment(cli: Cli) -> None:
    cli("start", "--name", "rh", "--grace", "1", "--", *fixture("hider.py"), check=True)
    path = os.path.join(cli.home, "runs", "rh", "hider.pid")
    wait(lambda: os.path.exists(path), 30, path)
    with open(path) as f:
        hidden = int(f.read())
    env = procfs.environ(hidden) or {}
    assert TAG_VAR.encode() not in env  # the premise: the tag cannot be read any more
    st = procfs.read_stat(hidden)
    assert st is not None and st.sid == hidden
    assert st.ppid == _shim_pid(cli, "rh", 1)  # adopted by the shim, a child subreaper
    cli("stop", "rh", check=True)
    assert not _alive(hidden)


# Exits 0 once told to (RGT_RUN_DIR/go), leaving a child out of its session that ignores SIGTERM.
LEAVES_CHILD = """
import os, signal, time
run = os.environ["RGT_RUN_DIR"]
child = os.fork()
if child == 0:
    os.setsid()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(120)
    os._exit(0)
with open(os.path.join(run, "child.pid.tmp"), "w") as f:
    f.write(str(child))
os.rename(os.path.join(run, "child.pid.tmp"), os.path.join(run, "child.pid"))
while not os.path.exists(os.path.join(run, "go")):
    time.sleep(0.05)
"""


def _over_with_a_child_left(cli: Cli) -> procfs.Identity:
    """Run "lo" SUCCEEDED, its agent killed while it ended the attempt's leftovers (an OOM kill,
    a person's kill -9): the job's child that ignores SIGTERM lives on. Its identity."""
    run_dir = os.path.join(cli.home, "runs", "lo")
    # The agent holds after its SIGTERM to the leftovers (onbox/common/faults.py) instead of
    # waiting LEFTOVER_GRACE: the SIGKILL below lands before its own, on any machine.
    cli.env["RGT_HOLD_AT"] = "leftovers.after_term"
    cli("start", "--name", "lo", "--", sys.executable, "-c", LEAVES_CHILD, check=True)
    del cli.env["RGT_HOLD_AT"]  # for the agent only: not the `stop` below
    st = cli.wait_state("lo", "STARTING", "RUNNING")
    agent = st["agent"]["pid"]
    path = os.path.join(run_dir, "child.pid")
    wait(lambda: os.path.exists(path), 30, "the job's child is up")
    with open(path) as f:
        child = procfs.identity(int(f.read()))
    assert child is not None
    open(os.path.join(run_dir, "go"), "w").close()
    # The agent ends the child (SIGTERM, ignored; SIGKILL after LEFTOVER_GRACE): killed before.
    cli.wait_for("lo", lambda s: any(e["kind"] == "leftovers" for e in cli.events("lo")))
    os.kill(agent, signal.SIGKILL)
    _wait_gone([agent])
    st = cli.status("lo")
    assert st["state"] == "SUCCEEDED" and not st["agent"]["alive"] and procfs.is_alive(child)
    return child


def test_stop_of_a_run_already_over_ends_what_its_last_attempt_left(cli: Cli) -> None:
    """`rgt-agent stop` of a run over with a child of its job alive said "already SUCCEEDED"
    and left it, holding what it holds; it now ends it, as the agent would have."""
    child = _over_with_a_child_left(cli)
    p = cli("stop", "lo", check=True)
    assert not procfs.is_alive(child), p.stdout
    assert "SUCCEEDED" in p.stdout and "no process of attempt 1 remains" in p.stdout, p.stdout
    assert cli.status("lo")["state"] == "SUCCEEDED"  # the run's end is not rewritten
    assert [e["kind"] for e in cli.events("lo")].count("leftovers") == 2
    # With nothing left, a stop says so and does nothing.
    assert "already SUCCEEDED" in cli("stop", "lo", check=True).stdout


def test_ctrl_c_ends_the_wait_of_a_stop_ending_leftovers_and_says_what_is_left(cli: Cli) -> None:
    """A Ctrl-C to `rgt-agent stop` while it ends what an ended run left was swallowed: the
    command went on to SIGKILL and returned ~15 s later. It now stops at once with what was
    sent, what is alive and how to finish; the run stays SUCCEEDED and a second stop ends
    the child. The SIGINT lands at an exact point: the command stops itself right after its
    `leftovers` event (the journal's test seam) and is signalled while stopped."""
    child = _over_with_a_child_left(cli)
    stop = subprocess.Popen(
        [*agent_exe(), "stop", "lo"],
        env=dict(cli.env, **{STOP_AFTER_EVENT: "leftovers"}),
        cwd=cli.home,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait(
            lambda: (st := procfs.read_stat(stop.pid)) is None or st.state in "TtZX",
            60,
            "the stop to reach its leftovers event",
            poll=0.01,
        )
        os.kill(stop.pid, signal.SIGINT)  # delivered at SIGCONT, before any SIGTERM is sent
        os.kill(stop.pid, signal.SIGCONT)
        out, err = stop.communicate(timeout=60)
    finally:
        if stop.poll() is None:
            stop.kill()
            stop.wait()
    assert procfs.is_alive(child), "the stop went on to SIGKILL the child after the Ctrl-C"
    assert stop.returncode == StopFailed.exit_code, (out, err)
    assert "interrupted (SIGINT)" in err and "no signal sent to them yet" in err, err
    assert f"still alive: pid {child.pid}" in err and "rgt-agent stop lo" in err, err
    assert cli.status("lo")["state"] == "SUCCEEDED" and not cli.peek("lo")["agent"]["alive"]
    p = cli("stop", "lo", check=True)
    assert not procfs.is_alive(child), p.stdout
    assert "no process of attempt 1 remains" in p.stdout, p.stdout


@pytest.mark.parametrize("agent", ["alive", "gone"])
def test_ctrl_c_ends_the_wait_of_a_stop_of_a_live_run_and_the_stop_goes_on(
    cli: Cli, agent: str
) -> None:
    """`rgt-agent stop` of a live run whose job ignores SIGTERM waits out the job's grace. A
    person's Ctrl-C then ended it silently (exit 130, no word) while the run's agent stopped
    it; and with no agent (killed with its shim), the command stopped the run in its own
    process and ignored the Ctrl-C until the grace was over. Now the wait ends at once, saying
    the stop goes on in the agent, which an agent does: the job keeps its grace (alive when the
    command returns), the run is STOPPING under a live agent, and it ends STOPPED."""
    cli("start", "--name", "cc", "--grace", "120", "--", *fixture("ignore_term.py"), check=True)
    st = cli.wait_state("cc", "STARTING", "RUNNING")
    cli.wait_output("cc", "unkillable")
    job = procfs.identity(st["pid"])
    assert job is not None
    if agent == "gone":  # killed with its shim (which would start it again), the job alive
        with open(os.path.join(cli.home, "runs", "cc", "attempts", "0001", "job.json")) as f:
            shim = json.load(f)["shim"]["pid"]
        for pid in (shim, st["agent"]["pid"]):
            os.kill(pid, signal.SIGKILL)
        _wait_gone([shim, st["agent"]["pid"]])
        cli.wait_for("cc", lambda s: not s["agent"]["alive"], what="the agent's lock to go")
    stop = subprocess.Popen(
        [*agent_exe(), "stop", "cc"], env=cli.env, cwd=cli.home,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        cli.wait_state("cc", "STOPPING")
        # The command asked and waits (asleep in the kernel) for the job's 120 s of grace.
        wait(
            lambda: (ps := procfs.read_stat(stop.pid)) is None or ps.state == "S",
            60,
            "the stop to wait",
            poll=0.01,
        )
        os.kill(stop.pid, signal.SIGINT)
        out, err = stop.communicate(timeout=60)
    finally:
        if stop.poll() is None:
            stop.kill()
            stop.wait()
    assert stop.returncode == 130, (out, err)
    assert "interrupted (SIGINT) while waiting for run 'cc' to stop" in err, err
    assert "goes on in its agent" in err and "the run will be STOPPED" in err, err
    assert "rgt-agent status cc" in err, err
    # Neither cancelled nor torn: the job has its grace, a live agent carries the stop.
    assert procfs.is_alive(job), "the Ctrl-C cut the job's grace short"
    now = cli.peek("cc")
    assert now["state"] == "STOPPING" and now["agent"]["alive"], now
    assert now["stop"]["reason"] == "stop", now
    # A second stop hastens it (the sooner SIGKILL wins) and finds the agent carrying it.
    cli("stop", "cc", "--grace", "1", check=True)
    cli.wait_over("cc", "STOPPED")
    assert not procfs.is_alive(job)


def test_stop_gives_the_job_its_grace_before_sigkill(cli: Cli) -> None:
    cli("start", "--name", "r8", "--", *fixture("ignore_term.py"), check=True)
    cli.wait_state("r8", "STARTING", "RUNNING")
    t0 = time.monotonic()
    cli("stop", "r8", "--grace", "2", check=True)
    assert time.monotonic() - t0 >= 2.0  # SIGTERM was ignored; SIGKILL came after the grace
    assert cli.status("r8")["last_exit"]["signal"] == signal.SIGKILL


@pytest.mark.parametrize("then", ["stop", "sigterm"])
def test_a_second_stop_while_one_runs_hastens_it_and_the_job_is_killed(cli: Cli, then: str) -> None:
    """A job that ignores SIGTERM, being stopped with a 6 s grace; meanwhile a second
    `rgt-agent stop --grace 1`, or a preemption's SIGTERM to the agent: the agent raised
    STOPPING -> STOPPING and died, every respawned agent with it, and the job was never
    killed. Now the sooner SIGKILL wins (the second stop's; the preemption's 6 s is no
    sooner) and the run ends STOPPED, as asked."""
    cli("start", "--name", "rd", "--grace", "6", "--", *fixture("ignore_term.py"), check=True)
    st = cli.wait_state("rd", "STARTING", "RUNNING")
    agent, job = st["agent"]["pid"], st["pid"]
    first = subprocess.Popen(
        [*agent_exe(), "stop", "rd"], env=cli.env, cwd=cli.home,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        cli.wait_state("rd", "STOPPING")
        if then == "stop":
            second = cli("stop", "rd", "--grace", "1", timeout=30)
            assert second.returncode == 0, second.stdout + second.stderr
        else:
            os.kill(agent, signal.SIGTERM)
        _wait_gone([job, agent], timeout=20)
        out, err = first.communicate(timeout=30)
        assert first.returncode == 0, out + err
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    st = cli.status("rd")
    assert st["state"] == "STOPPED" and not st["job_alive"], st
    assert not [e for e in cli.events("rd") if e["kind"] == "agent_respawn"]


HOLD_AS_SYNC = """
import sys, time
from onbox.agent.lock import RunLock
lock = RunLock.acquire(sys.argv[1], "rs", role="sync")
print("held", flush=True)
time.sleep(float(sys.argv[2]))  # bounded: a sync sealing with no agent alive
lock.release()
"""


def test_a_stop_waits_for_a_sync_holding_the_lock_instead_of_killing_it(cli: Cli) -> None:
    """With no agent alive, `rgt-agent sync` holds the run's lock while it seals. A stop took
    any holder for an agent and sent it SIGUSR2, whose default action killed the sync; the
    stop then waited for an agent that did not exist and failed (exit 10)."""
    cli.env["RGT_AGENT_RESPAWN_DELAY"] = "1000"  # no shim rescue of the agent killed below
    cli("start", "--name", "rs", "--", *fixture("hang.py"), check=True)
    st = cli.wait_state("rs", "STARTING", "RUNNING")
    with open(os.path.join(cli.home, "runs", "rs", "attempts", "0001", "job.json")) as f:
        shim = json.load(f)["shim"]["pid"]
    for pid in (shim, st["agent"]["pid"]):
        os.kill(pid, signal.SIGKILL)
    _wait_gone([shim, st["agent"]["pid"]])
    env = dict(cli.env, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, cli.env.get("PYTHONPATH")])))
    sync = subprocess.Popen(
        [sys.executable, "-c", HOLD_AS_SYNC, os.path.join(cli.home, "runs", "rs", "lock"), "3"],
        env=env, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert sync.stdout is not None and sync.stdout.readline().strip() == "held"
        stop = cli("stop", "rs", "--grace", "1", timeout=60)
        assert sync.wait(timeout=30) == 0  # not killed by SIGUSR2 (-12)
        assert stop.returncode == 0, stop.stdout + stop.stderr
    finally:
        if sync.poll() is None:
            sync.kill()
            sync.wait()
        if sync.stdout is not None:
            sync.stdout.close()
    st = cli.status("rs")
    assert st["state"] == "STOPPED" and not st["job_alive"], st


def test_sigterm_to_the_agent_is_a_preemption_that_ends_within_the_budget(cli: Cli) -> None:
    cli("start", "--name", "r9", "--grace", "4", "--", *fixture("ignore_term.py"), check=True)
    st = cli.wait_state("r9", "STARTING", "RUNNING")
    t0 = time.monotonic()
    os.kill(st["agent"]["pid"], signal.SIGTERM)
    _wait_gone([st["agent"]["pid"], st["pid"]], timeout=10)
    took = time.monotonic() - t0
    assert took < 4.0, f"the agent outlived its 4 s preemption budget ({took:.2f}s)"
    st = cli.status("r9")
    assert st["state"] == "PREEMPTED" and not st["job_alive"]
    # A later start begins a new incarnation that continues the run.
    cli("start", "--name", "r9", check=True)
    st = cli.wait_state("r9", "STARTING", "RUNNING")
    assert st["incarnation"] == 2 and st["attempt"] == 2
    cli("stop", "r9", "--grace", "0", check=True)


def test_stale_pid_record_is_not_adopted_and_its_process_is_not_touched(cli: Cli) -> None:
    cli.env["RGT_AGENT_RESPAWN_DELAY"] = "1000"
    cli("start", "--name", "ra", "--", *fixture("hang.py"), check=True)
    st = cli.wait_state("ra", "STARTING", "RUNNING")
    cli("stop", "ra", "--grace", "1", check=True)
    # Forge what a box reboot or pid reuse looks like: state says RUNNING, the recorded pid
    # now belongs to an unrelated process with another start time.
    stranger = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        run = os.path.join(cli.home, "runs", "ra")
        rec_path = os.path.join(run, "attempts", "0001", "job.json")
        with open(rec_path) as f:
            rec: Dict[str, Any] = json.load(f)
        real = procfs.identity(stranger.pid)
        assert real is not None
        rec.update(pid=stranger.pid, pgid=stranger.pid, start_ticks=real.start_ticks - 1)
        rec["shim"] = {"pid": stranger.pid, "start_ticks": real.start_ticks - 1}
        with open(rec_path, "w") as f:
            json.dump(rec, f)
        os.unlink(os.path.join(run, "attempts", "0001", "exit.json"))
        with open(os.path.join(run, "state.json")) as f:
            state = json.load(f)
        state.update(state="RUNNING", pid=stranger.pid, exit_seen=False, stop=None)
        with open(os.path.join(run, "state.json"), "w") as f:
            json.dump(state, f)
        cli("start", "--name", "ra", check=True)
        st = cli.wait_for("ra", lambda s: s["attempt"] == 2, what="a fresh attempt")
        assert st["last_exit"]["kind"] == "unknown"
        assert stranger.poll() is None  # never signalled
    finally:
        stranger.kill()
        stranger.wait()
    cli("stop", "ra", "--grace", "1", check=True)


@pytest.mark.parametrize(
    "kind,expect,retried",
    [
        ("exception", "ValueError: bad shape (3, 4) for the head", True),
        ("import", "ModuleNotFoundError: No module named 'rgt_no_such_module'", False),
        ("cuda_oom", "CUDA out of memory", True),
        ("nan", "the loss became NaN/inf", True),
        ("enospc", "no space left on device (ENOSPC)", True),
        ("signal_kill", "killed by signal 9 (SIGKILL)", True),
        ("code", "exited with code 3", True),
    ],
)
def test_exits_are_classified(cli: Cli, kind: str, expect: str, retried: bool) -> None:
    name = "c-" + kind.replace("_", "-")
    job = _job_file(
        cli,
        name,
        fixture("fail_with.py") + [kind],
        start_grace="0.2s",
        max_error_restarts=1,
        max_preempt_restarts=1,
        backoff_initial="0.1s",
    )
    cli("start", job, "--name", name, check=True)
    st = cli.wait_state(name, "FAILED", timeout=30)
    assert expect in st["last_exit"]["reason"]
    assert st["last_exit"]["step"] == 42
    assert st["attempt"] == (2 if retried else 1)


def test_syntax_error_is_not_retried(cli: Cli) -> None:
    script = os.path.join(cli.home, "broken.py")
    with open(script, "w") as f:
        f.write("def broken(:\n    pass\n")
    job = _job_file(cli, "rs", ["python3", script], max_error_restarts=5)
    cli("start", job, "--name", "rs", check=True)
    st = cli.wait_state("rs", "FAILED")
    assert st["attempt"] == 1 and "SyntaxError" in st["last_exit"]["reason"]
    assert "not retried" in st["last_exit"]["reason"]


def test_logs_print_every_attempt_oldest_first_unaltered(cli: Cli) -> None:
    script = os.path.join(cli.home, "echo_attempt.py")
    with open(script, "w") as f:
        f.write(
            "import os, sys\nsys.stdout.write('out %s\\n' % os.environ['RGT_ATTEMPT'])\n"
            "sys.stderr.write('err \\xe9 %s\\n' % os.environ['RGT_ATTEMPT'])\n"
            "sys.exit(0 if os.environ['RGT_ATTEMPT'] == '3' else 1)\n"
        )
    job = _job_file(cli, "rl", ["python3", script], start_grace="0.1s", backoff_initial="0.1s")
    cli("start", job, "--name", "rl", check=True)
    cli.wait_state("rl", "SUCCEEDED")
    out = cli("logs", "rl", check=True).stdout
    assert out == "".join(f"out {a}\nerr \u00e9 {a}\n" for a in (1, 2, 3))
    follow = cli("logs", "rl", "-f", timeout=20, check=True).stdout  # ends: the run is over
    assert follow == out
    assert "agent pid" in cli("logs", "rl", "--agent", check=True).stdout


def test_detached_job_environment(cli: Cli) -> None:
    script = os.path.join(cli.home, "env_probe.py")
    with open(script, "w") as f:
        f.write(
            "import json, os, sys\n"
            "p = os.path.join(os.environ['RGT_CKPT_DIR'], 'probe')\n"
            "open(p, 'w').close()\n"
            "print(json.dumps({'mode': oct(os.stat(p).st_mode & 0o777),\n"
            "  'stdin': sys.stdin.read(), 'sid': os.getsid(0) == os.getpid(),\n"
            "  'adj': open('/proc/self/oom_score_adj').read().strip(),\n"
            "  'cwd': os.getcwd(), 'unbuf': os.environ.get('PYTHONUNBUFFERED'),\n"
            "  'run': os.environ['RGT_RUN'], 'attempt': os.environ['RGT_ATTEMPT'],\n"
            "  'resume': os.environ['RGT_RESUME_FROM'],\n"
            "  'onbox': __import__('onbox').__file__,\n"
            "  'pythonpath': os.environ['PYTHONPATH']}))\n"
        )
    workdir = os.path.join(cli.home, "work")
    os.makedirs(workdir)
    cli.env["PYTHONPATH"] = "/opt/user-libs"  # the user's own, which the job must keep
    cli("start", "--name", "re", "--", "python3", script, check=True, cwd=workdir)
    st = cli.wait_state("re", "SUCCEEDED")
    got = json.loads(cli("logs", "re", check=True).stdout)
    assert got["mode"] == "0o600"  # umask 077
    assert got["stdin"] == "" and got["sid"] is True  # stdin is /dev/null; own session
    with open("/proc/self/oom_score_adj") as f:
        assert int(got["adj"]) > int(f.read())  # the OOM killer takes the job first
    assert got["cwd"] == workdir and got["unbuf"] == "1"
    assert (got["run"], got["attempt"], got["resume"]) == ("re", "1", "")
    # onbox comes from a directory of its own, never the agent's packages; the user's path stays
    assert got["onbox"].startswith(os.path.join(cli.home, "lib"))
    lib, user = got["pythonpath"].split(os.pathsep)
    assert lib.startswith(os.path.join(cli.home, "lib")) and user == "/opt/user-libs"
    assert st["last_exit"]["kind"] == "success"


def test_ps_names_the_agent_and_the_shim_with_the_run(cli: Cli) -> None:
    cli("start", "--name", "rp", "--", *fixture("hang.py"), check=True)
    st = cli.wait_state("rp", "STARTING", "RUNNING")
    ps = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    lines = {int(ln.split(None, 1)[0]): ln.split(None, 1)[1] for ln in ps.splitlines() if ln}
    assert lines[st["agent"]["pid"]].startswith("rgt-agent agent rp")
    assert lines[_shim_pid(cli, "rp", 1)].startswith("rgt-agent shim rp")
    cli("stop", "rp", "--grace", "1", check=True)


def test_run_in_the_foreground_returns_the_final_state_as_exit_code(cli: Cli) -> None:
    p = cli("run", "--name", "rf", "--", *fixture("crash_after.py"), "0.3", "0", timeout=60)
    assert p.returncode == 0 and "ended SUCCEEDED" in p.stdout
    proc = subprocess.Popen(
        [*agent_exe(), "run", "--name", "rg", "--grace", "3", "--", *fixture("hang.py")],
        env=cli.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        cli.wait_state("rg", "STARTING", "RUNNING")
        proc.send_signal(signal.SIGTERM)  # a Slurm or Kubernetes preemption
        out, _ = proc.communicate(timeout=10)
        assert proc.returncode == 13 and b"ended PREEMPTED" in out
        assert cli.status("rg")["state"] == "PREEMPTED"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_the_oom_killer_takes_the_job_not_the_agent_and_the_exit_says_so(cli: Cli) -> None:
    cg = mounts.memory_cgroup(300 << 20, "rgt-test")
    require(bool(cg), "root and a writable cgroup v1 memory controller")
    hog = (
        "import time\nchunks = []\nwhile True:\n    chunks.append(b'x' * (32 << 20))\n"
        "    print('step', len(chunks), flush=True)\n"
    )
    job = _job_file(cli, "oom", ["python3", "-c", hog], max_error_restarts=0)
    wrapper = f"echo $$ > {cg}/cgroup.procs && exec {' '.join(agent_exe())} run {job} --name oom"
    try:
        p = subprocess.run(
            ["bash", "-c", wrapper], env=cli.env, capture_output=True, text=True, timeout=120
        )
        assert p.returncode == 11, (p.stdout, p.stderr)  # FAILED, told by a living agent
        st = cli.status("oom")
        assert st["last_exit"]["kind"] == "oom_killed", st["last_exit"]
        assert st["last_exit"]["signal"] == signal.SIGKILL
        assert "OOM killer" in st["last_exit"]["reason"]
    finally:
        mounts.remove_cgroup(cg, timeout=10)
