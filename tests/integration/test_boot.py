"""Boot survival with real processes: the hook the agent installs, a power loss by SIGKILL, the
hook run as the box would at power-on, and the run back by itself, resuming from its seal.

The one thing that cannot be done here is a reboot: the hook's "new boot" test compares the
kernel's boot_id with the one `rgt-agent boot` recorded under $RGT_HOME, so the test marks the
boot as new by changing the recorded one.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Any, Dict, List

import pytest

from onbox.agent import procfs
from onbox.agent.boot import boot_command
from onbox.common.errors import FINAL_EXIT_CODES
from onbox.common.rundir import RunDir
from tests.conftest import Cli, agent_exe
from tests.integration.test_restore_interrupted import _preempt_at_epoch
from tests.polling import latest_step, wait

JOB = r"""
import io, json, os, re, sys, time, zipfile
ck, run = os.environ["RGT_CKPT_DIR"], os.environ["RGT_RUN_DIR"]
frm = os.environ.get("RGT_RESUME_FROM", "")
with open(os.path.join(run, "seen.jsonl"), "a") as f:
    f.write(json.dumps({"attempt": os.environ["RGT_ATTEMPT"], "resume_from": frm}) + "\n")
m = re.search(r"step_(\d+)", os.path.basename(frm))
step = int(m.group(1)) + 1 if m else 1
buf = io.BytesIO()
with zipfile.ZipFile(buf, "w") as z:
    z.writestr("version", str(step))
tmp = os.path.join(ck, ".tmp-step")
with open(tmp, "wb") as f:
    f.write(buf.getvalue())
os.replace(tmp, os.path.join(ck, "step_%d.pt" % step))
print("wrote step %d" % step, flush=True)
time.sleep(float(sys.argv[1]))  # bounded: then it ends by itself
"""


BIG_PAD = 'z.writestr("version", str(step)); z.writestr("pad", os.urandom(5 << 20))'
LIVE = ("STARTING", "RUNNING")


def _seen(cli: Cli, name: str) -> List[Dict[str, str]]:
    try:
        with open(os.path.join(cli.home, "runs", name, "seen.jsonl")) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def _kinds(cli: Cli, name: str, kind: str) -> List[Dict[str, Any]]:
    return [e for e in cli.events(name) if e["kind"] == kind]


def _override(tmp_path: Any, cli: Cli, profile: str, boot_path: str) -> None:
    d = tmp_path / "profiles"
    d.mkdir(exist_ok=True)
    (d / f"{profile}.toml").write_text(f"[boot]\npath = {json.dumps(boot_path)}\n")
    cli.env["RGT_PROFILES_DIR"] = str(d)


def _start(
    cli: Cli, tmp_path: Any, name: str, profile: str, life: float = 120, script: str = ""
) -> str:
    root = str(tmp_path / "durable")
    os.makedirs(root, exist_ok=True)
    if not script:
        script = str(tmp_path / "job.py")
        with open(script, "w") as f:
            f.write(JOB)
    job = os.path.join(cli.home, f"{name}.toml")
    with open(job, "w") as f:
        f.write(
            f'profile = "{profile}"\n'
            f"command = {json.dumps([sys.executable, str(script), str(life)])}\n"
            f'store = "file://{root}"\n'
        )
    cli("start", job, "--name", name, check=True)
    return root


def _power_loss(cli: Cli, name: str) -> None:
    """SIGKILL the agent, its shim and the job by PID, as a power-off ends them all at once."""
    st = cli.status(name)
    with open(RunDir(name, cli.home).job_record(st["attempt"])) as f:
        rec = json.load(f)
    idents = [
        # the shim first: it would start a dead agent again
        procfs.Identity(rec["shim"]["pid"], rec["shim"]["start_ticks"]),
        procfs.Identity(st["agent"]["pid"], -1),
        procfs.Identity(rec["pid"], rec["start_ticks"]),
    ]
    for i in idents:
        try:
            os.kill(i.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    wait(lambda: not any(procfs.is_alive(i) for i in idents[::2]), what="the processes to die")
    wait(lambda: not cli.peek(name)["agent"]["alive"], what="the agent's lock to go")


def _new_boot(cli: Cli) -> None:
    with open(os.path.join(cli.home, "boot_id"), "w") as f:
        f.write("a-boot-before-the-power-loss\n")


def _run_hook(cli: Cli, hook: str) -> None:
    env = dict(cli.env)
    env.pop("RGT_HOME", None)  # the hook names it itself
    subprocess.run(["sh", hook], env=env, check=True, timeout=30, cwd="/")


def test_profile_d_hook_brings_the_run_back_after_a_power_loss(cli: Cli, tmp_path: Any) -> None:
    hook = str(tmp_path / "profile.d" / "rgt-agent.sh")
    os.makedirs(os.path.dirname(hook))
    _override(tmp_path, cli, "autodl", hook)
    root = _start(cli, tmp_path, "b1", "autodl")
    wait(lambda: latest_step(root, "b1") == 1, what="step 1 sealed")

    # The hook: installed where the profile says, valid POSIX sh, and said so in an event.
    wait(lambda: os.path.exists(hook), what="the hook")
    subprocess.run(["sh", "-n", hook], check=True, timeout=10)
    if shutil.which("shellcheck"):
        subprocess.run(["shellcheck", "-s", "sh", hook], check=True, timeout=30)
    assert [e for e in cli.events("b1") if e["kind"] == "boot_hook" and e["path"] == hook]
    first = cli.status("b1")
    # Installing it counts this boot as seen: the hook acts from the next power-on only.
    with open(os.path.join(cli.home, "boot_id")) as f:
        assert f.read().strip() == procfs.boot_id()

    _power_loss(cli, "b1")
    _new_boot(cli)
    _run_hook(cli, hook)

    # The agent comes back by itself; the next attempt resumes from the sealed checkpoint.
    st = cli.wait_for(
        "b1",
        lambda s: s["agent"]["alive"] and s["attempt"] >= 2 and s["state"] in LIVE,
        timeout=60,
        what="the run to come back",
    )
    assert st["agent"]["pid"] != first["agent"]["pid"]
    assert _kinds(cli, "b1", "boot"), "the agent says it came from rgt-agent boot"
    assert len(_kinds(cli, "b1", "boot_hook")) == 1  # installed once; the second agent found it
    seen = wait(lambda: len(_seen(cli, "b1")) >= 2 and _seen(cli, "b1"), what="attempt 2")
    assert seen[0]["resume_from"] == ""
    assert os.path.basename(seen[1]["resume_from"]) == "step_1.pt", seen
    wait(lambda: latest_step(root, "b1") == 2, what="the resumed attempt's step 2 sealed")
    with open(os.path.join(cli.home, "boot_id")) as f:
        assert f.read().strip() == procfs.boot_id()  # this boot is recorded

    # Running the hook again, or `rgt-agent boot` itself, starts nothing twice.
    _run_hook(cli, hook)
    cli("boot", check=True)
    time.sleep(1.0)  # give a wrongly started second agent time to show (not a timed assertion)
    again = cli.status("b1")
    assert again["agent"]["pid"] == st["agent"]["pid"] and again["attempt"] == st["attempt"]
    assert len(_seen(cli, "b1")) == 2
    cli("stop", "b1", "--grace", "5", check=True)


def test_a_stopped_run_is_not_resumed_at_boot(cli: Cli, tmp_path: Any) -> None:
    hook = str(tmp_path / "rgt-agent.sh")
    _override(tmp_path, cli, "autodl", hook)
    root = _start(cli, tmp_path, "b2", "autodl")
    wait(lambda: latest_step(root, "b2") == 1, what="step 1 sealed")
    cli("stop", "b2", "--grace", "5", check=True)
    cli.wait_state("b2", "STOPPED")
    wait(lambda: not cli.peek("b2")["agent"]["alive"], what="the agent to exit")
    _new_boot(cli)
    p = cli("boot", check=True)
    assert "b2" not in p.stdout
    st = cli.status("b2")
    assert st["state"] == "STOPPED" and not st["agent"]["alive"]
    assert len(_seen(cli, "b2")) == 1


def test_a_power_on_that_cannot_resume_fails_the_run_and_says_why(cli: Cli, tmp_path: Any) -> None:
    """The power took the box's disk with the checkpoint dir, and the only sealed checkpoint
    is damaged in the store: the agent `rgt-agent boot` started quarantined it and left, and
    the run stayed STARTING on disk with no agent, no event and nothing sent. Now it is
    FAILED from where it was, with one restore_failed event saying what was tried."""
    hook = str(tmp_path / "rgt-agent.sh")
    _override(tmp_path, cli, "autodl", hook)
    root = _start(cli, tmp_path, "b1", "autodl")
    wait(lambda: latest_step(root, "b1") == 1, what="step 1 sealed")
    _power_loss(cli, "b1")
    shutil.rmtree(os.path.join(cli.home, "runs", "b1", "ckpt"))  # gone with the disk
    (obj,) = glob.glob(os.path.join(root, "b1", "checkpoints", "1", "e*", "step_1.pt"))
    with open(obj, "r+b") as f:
        f.seek(10)
        f.write(b"XXXX")
    _new_boot(cli)
    p = cli("boot")
    assert "no verified checkpoint left" in p.stdout + p.stderr, p.stdout + p.stderr
    st = wait(lambda: (s := cli.peek("b1"))["state"] == "FAILED" and s, what="FAILED")
    assert not st["agent"]["alive"] and st["last_exit"]["kind"] == "begin", st
    assert "nothing to resume from" in st["last_exit"]["reason"], st["last_exit"]
    (failed,) = _kinds(cli, "b1", "restore_failed")
    assert failed["class"] == "integrity" and [t["step"] for t in failed["tried"]] == [1]
    assert not os.listdir(os.path.join(cli.home, "runs", "b1", "ckpt"))  # nothing trained
    assert len(_seen(cli, "b1")) == 1  # no attempt started after the power-on


def test_onstart_hook_is_one_guarded_line(cli: Cli, tmp_path: Any) -> None:
    onstart = tmp_path / "onstart.sh"
    onstart.write_text("#!/bin/sh\necho user-setup\n")
    _override(tmp_path, cli, "vastai", str(onstart))
    _start(cli, tmp_path, "v1", "vastai")
    _start(cli, tmp_path, "v2", "vastai")
    for name in ("v1", "v2"):  # a stop is read in the agent's loop, after the hook's install
        cli("stop", name, "--grace", "5", check=True)
        cli.wait_state(name, "STOPPED")
    text = onstart.read_text()
    assert text.startswith("#!/bin/sh\necho user-setup\n")  # the user's lines are kept
    assert text.count("rgt-agent boot hook") == 1, text
    assert len(_kinds(cli, "v1", "boot_hook")) == 1 and not _kinds(cli, "v2", "boot_hook")
    subprocess.run(["sh", "-n", str(onstart)], check=True, timeout=10)


def test_an_unwritable_hook_path_is_one_warning_and_the_run_goes_on(
    cli: Cli, tmp_path: Any
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    _override(tmp_path, cli, "autodl", str(blocker / "rgt-agent.sh"))
    root = _start(cli, tmp_path, "b3", "autodl")
    wait(lambda: latest_step(root, "b3") == 1, what="step 1 sealed")
    failed = [e for e in cli.events("b3") if e["kind"] == "boot_hook_failed"]
    assert len(failed) == 1 and failed[0]["remedy"], failed
    assert cli.status("b3")["state"] in ("STARTING", "RUNNING")
    cli("stop", "b3", "--grace", "5", check=True)


def test_cron_hook_needs_the_opt_in(cli: Cli, tmp_path: Any) -> None:
    cron = tmp_path / "cron.d-rgt-agent"
    _override(tmp_path, cli, "generic-ssh", str(cron))
    _start(cli, tmp_path, "c1", "generic-ssh")
    cli.wait_state("c1", "STARTING", "RUNNING")
    assert not cron.exists()  # OS persistence only when asked
    assert not [e for e in cli.events("c1") if e["kind"].startswith("boot_hook")]
    cli("stop", "c1", "--grace", "5", check=True)
    cli.wait_state("c1", "STOPPED")
    wait(lambda: not cli.peek("c1")["agent"]["alive"], what="the agent to exit")
    cli("start", "--name", "c1", "--boot-hook", check=True)
    # The entry is written, then its event: wait for the event (the file alone raced it).
    wait(
        lambda: [e for e in cli.events("c1") if e["kind"] == "boot_hook"],
        what="the boot_hook event",
    )
    line = cron.read_text()
    assert line.startswith("@reboot ") and "rgt-agent boot hook" in line, line
    ev = [e for e in cli.events("c1") if e["kind"] == "boot_hook"]
    assert ev and "OS persistence" in ev[-1]["reason"]
    cli("stop", "c1", "--grace", "5", check=True)


@pytest.mark.parametrize("how", ["boot", "start"])
def test_a_run_preempted_in_its_restore_after_a_power_loss_is_said_not_to_have_started(
    cli: Cli, tmp_path: Any, how: str
) -> None:
    """The run was RUNNING when the power went, so the agent that `rgt-agent boot` (or a
    person's `rgt-agent start --name`) starts after the power-on takes it over (``adopt``) and
    restores; a SIGTERM in that restore ends it PREEMPTED before the job runs again. `start`
    printed "re-attached to run ...: STOPPING" and exited 0, and `boot` passed that on: now
    both say the run did not start and why, and `start` exits 13 as for a run that had not
    run before (onbox/agent/detach.py ``NotStarted``)."""
    hook = str(tmp_path / "rgt-agent.sh")
    _override(tmp_path, cli, "autodl", hook)
    root = _start(cli, tmp_path, "b4", "autodl")
    wait(lambda: latest_step(root, "b4") == 1, what="step 1 sealed")
    _power_loss(cli, "b4")
    _new_boot(cli)
    argv = [*boot_command()] if how == "boot" else [*agent_exe(), "start", "--name", "b4"]
    p = _preempt_at_epoch(argv, cli)  # the agent's SIGTERM right after its epoch
    said = p.stdout if how == "boot" else p.stderr
    assert "re-attached" not in p.stdout + p.stderr, p
    want = "run b4 did not start: a SIGTERM (a preemption) came"
    if how == "boot":
        assert p.stdout.startswith(f"rgt-agent boot: b4: not started: {want}"), p
    else:
        assert p.returncode == FINAL_EXIT_CODES["PREEMPTED"], p
        assert f"\nrgt: {want}" in "\n" + said, p
    assert "the run is PREEMPTED" in said and "rgt-agent boot" in said, p
    st = cli.wait_over("b4", "PREEMPTED", timeout=60)
    assert st["attempt"] == 1 and len(_seen(cli, "b4")) == 1, st  # the job did not run again
    assert _kinds(cli, "b4", "adopt") and _kinds(cli, "b4", "restore_interrupted")


def _step_is(root: str, name: str, step: int) -> bool:
    return latest_step(root, name) == step


def _back(cli: Cli, name: str) -> bool:
    """Whether the run's job ran a second time (after the power-on)."""
    return len(_seen(cli, name)) == 2


def test_boot_starts_every_run_at_once_and_waits_out_a_long_restore(
    cli: Cli, tmp_path: Any
) -> None:
    """`rgt-agent boot` ran each run's `start` in turn with 120 s in all: a run whose restore
    was long held back every run after it, and one longer than 120 s was said not started while
    its agent went on. Every run's start now begins at once, and each is waited out (its agent's
    silence bounds it, never its length): here the first run's restore is held until the test
    lets it go, and the second run is back meanwhile."""
    hook = str(tmp_path / "rgt-agent.sh")
    _override(tmp_path, cli, "autodl", hook)
    big = tmp_path / "big.py"  # step 1 with 5 MiB beside it: copied in pieces, so it holds
    big.write_text(JOB.replace('z.writestr("version", str(step))', BIG_PAD))
    root = _start(cli, tmp_path, "b1long", "autodl", script=str(big))
    _start(cli, tmp_path, "b2short", "autodl")
    for name in ("b1long", "b2short"):
        wait(functools.partial(_step_is, root, name, 1), what=f"{name}'s step 1 sealed")
        _power_loss(cli, name)
    # b1long's checkpoint dir came back empty (a disk the power-off lost): it restores.
    ckpt = os.path.join(cli.home, "runs", "b1long", "ckpt")
    shutil.rmtree(ckpt)
    os.makedirs(ckpt)
    _new_boot(cli)
    release = tmp_path / "release"
    p = subprocess.Popen(
        boot_command(),
        env=dict(cli.env, RGT_HOLD_AT="copy.after_piece", RGT_HOLD_UNTIL=str(release)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd="/",
    )
    try:
        # b1long's restore holds (it sorts first); b2short is back all the same.
        wait(functools.partial(_back, cli, "b2short"), timeout=60, what="b2short back")
        assert len(_seen(cli, "b1long")) == 1 and p.poll() is None
        release.write_text("")
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, (out, err)
    for name in ("b1long", "b2short"):
        assert f"rgt-agent boot: {name}: re-attached to run {name}" in out, (out, err)
        wait(functools.partial(_back, cli, name), what=f"{name}'s job back")
        assert _seen(cli, name)[-1]["resume_from"].endswith("step_1.pt"), _seen(cli, name)
