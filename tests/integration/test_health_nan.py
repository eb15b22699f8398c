"""A NaN in the loss, with a real agent, a real PyTorch CPU job and a file:// store.

What a user relies on: when the loss goes NaN the run ends FAILED saying so and at which step;
the store's LATEST stays the last good checkpoint (sealed before the NaN, still restorable, its
weights finite) although the job went on writing checkpoints after it; the events say what the
health probe saw; a loss spike before it is a warning while the run goes on. Started again
(the job fixed), the run resumes from that last good checkpoint; the checkpoints written after
the NaN are moved aside, never sealed, and an event says where. So too for a run without a
store: the last good checkpoint is then the newest on the box at or before the last finite loss
the probe saw.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
from typing import Any, Dict, List, Tuple

from onbox.agent import procfs
from onbox.common.faults import STOP_AFTER_EVENT
from onbox.common.rundir import RunDir
from tests.conftest import FIXTURES, Cli, agent_exe, require
from tests.polling import latest_step, wait

SPIKE_FROM, SPIKE_TO, NAN_AT, TOTAL, EVERY = 150, 180, 205, 400, 50
FIRST_BAD_CKPT = 250  # the first checkpoint on the job's schedule after NAN_AT


def _health(events: List[Dict[str, Any]], code: str) -> List[Dict[str, Any]]:
    return [e for e in events if e["kind"] == "health" and e.get("code") == code]


def _local_steps(ckpt_dir: str) -> List[int]:
    return sorted(
        int(m.group(1)) for n in os.listdir(ckpt_dir) if (m := re.fullmatch(r"step_(\d+)", n))
    )


def _start(
    cli: Cli,
    tmp_path: Any,
    name: str,
    nan_at: int = NAN_AT,
    total: int = TOTAL,
    store: bool = True,
) -> str:
    """Start the NaN job (its loss NaN from step ``nan_at``, ending at ``total``) as run
    ``name`` with a file:// store under ``tmp_path``: its root (none with ``store=False``).
    Again for a run that ended: a new incarnation with that job."""
    require(importlib.util.find_spec("torch") is not None, "torch (pip install torch)")
    root = str(tmp_path / "durable")
    os.makedirs(root, exist_ok=True)
    command = [
        sys.executable,
        os.path.join(FIXTURES, "nan_job.py"),
        *(str(n) for n in (SPIKE_FROM, SPIKE_TO, nan_at, total, EVERY)),
    ]
    job = os.path.join(cli.home, f"{name}.toml")
    with open(job, "w") as f:
        f.write(f"command = {json.dumps(command)}\n")
        if store:
            f.write(f'store = "file://{root}"\n')
        f.write("grace = 20\n[health]\ninterval = 1\n")
    cli("start", job, "--name", name, check=True)
    return root


def test_a_nan_loss_fails_the_run_and_keeps_the_last_good_checkpoint(
    cli: Cli, tmp_path: Any
) -> None:
    root = _start(cli, tmp_path, "nan1")
    st = cli.wait_state("nan1", "FAILED", "SUCCEEDED", timeout=120)
    print(json.dumps(cli.events("nan1"), indent=None))  # shown when the test fails

    # the run ended FAILED, saying the loss went NaN, and at which step
    assert st["state"] == "FAILED", st
    reason = st["last_exit"]["reason"]
    m = re.search(r"loss is nan at step (\d+)", reason)
    assert m, reason
    bad_step = int(m.group(1))
    assert NAN_AT <= bad_step < FIRST_BAD_CKPT, reason

    # the health event says what was kept; it is the store's LATEST, a step before the NaN
    events = cli.events("nan1")
    [nan] = [e for e in _health(events, "nan_loss") if e["level"] == "alert"]
    keep = nan["data"]["keep_step"]
    assert nan["probe"] == "training" and nan["class"] == "permanent"
    assert f"step {keep} in the store" in nan["remedy"]
    latest = latest_step(root, "nan1")
    assert latest == keep and latest is not None and latest < NAN_AT, (latest, keep)

    # the job went on checkpointing after the NaN; none of those was sealed
    ckpt_dir = os.path.join(cli.home, "runs", "nan1", "ckpt")
    after = [s for s in _local_steps(ckpt_dir) if s >= NAN_AT]
    assert after, _local_steps(ckpt_dir)
    sealed = os.listdir(os.path.join(root, "nan1", "checkpoints"))
    assert all(int(s) < NAN_AT for s in sealed), sealed

    # nor does a sync, with the agent gone: it fails, saying that was on purpose and why (it
    # sealed them and moved LATEST onto a NaN checkpoint, exit 0)
    cli.wait_over("nan1", "FAILED")
    p = cli("sync", "nan1")
    print(p.stderr)  # shown when the test fails
    assert p.returncode == 7, (p.returncode, p.stdout, p.stderr)
    assert "is not sealed" in p.stderr and "on purpose" in p.stderr, p.stderr
    assert f"frozen at step {keep}" in p.stderr and "loss is nan" in p.stderr, p.stderr
    assert latest_step(root, "nan1") == latest
    assert os.listdir(os.path.join(root, "nan1", "checkpoints")) == sealed

    # the kept checkpoint restores, and its weights are finite
    dest = str(tmp_path / "restored")
    p = cli("restore", "--store", f"file://{root}", "--name", "nan1", "--to", dest, check=True)
    restored = p.stdout.strip().splitlines()[-1]
    import torch

    from onbox.train import Checkpointer

    model = torch.nn.Linear(4, 1)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    step = Checkpointer(
        str(tmp_path / "unused"), model=model, optimizer=opt, handle_signals=False
    ).load(restored)
    assert step == latest
    assert all(math.isfinite(v) for t in model.state_dict().values() for v in t.flatten().tolist())

    # the spike before it was a warning, and the run went on after it
    [spike] = [e for e in _health(events, "loss_spike") if e["level"] == "warn"]
    assert spike["class"] == "transient" and "x the median" in spike["reason"]
    step_at_spike = int(re.search(r"at step (\d+)", spike["reason"]).group(1))  # type: ignore[union-attr]
    assert SPIKE_FROM <= step_at_spike <= SPIKE_TO
    assert events.index(spike) < events.index(nan)


def test_a_nan_run_started_again_resumes_from_the_last_good_checkpoint(
    cli: Cli, tmp_path: Any
) -> None:
    """The user fixed the job (here: its loss no longer goes NaN; it ends before the first
    checkpoint the NaN run wrote after the NaN) and starts the run again. The new incarnation
    sealed the checkpoints written after the NaN, and the job resumed from the newest of them,
    its weights NaN: LATEST was one of them."""
    root = _start(cli, tmp_path, "nan4")
    cli.wait_over("nan4", "FAILED", "SUCCEEDED", timeout=120)
    [nan] = [e for e in _health(cli.events("nan4"), "nan_loss") if e["level"] == "alert"]
    keep = nan["data"]["keep_step"]
    assert keep is not None and keep < NAN_AT and latest_step(root, "nan4") == keep, nan
    ckpt_dir = os.path.join(cli.home, "runs", "nan4", "ckpt")
    after = [s for s in _local_steps(ckpt_dir) if s > keep]
    assert after and after[0] >= NAN_AT, _local_steps(ckpt_dir)  # its stop's save, at least

    again = NAN_AT - 1  # the fixed job's last step: before any checkpoint written after the NaN
    _start(cli, tmp_path, "nan4", nan_at=10 * TOTAL, total=again)
    st = cli.wait_over("nan4", "SUCCEEDED", "FAILED", timeout=120)
    events = cli.events("nan4")
    print(json.dumps(events, indent=None))  # shown when the test fails
    assert st["state"] == "SUCCEEDED", st

    # the job resumed from the last good checkpoint
    with open(RunDir("nan4", cli.home).output_log(st["attempt"])) as f:
        resumed = re.findall(r"^resumed from step (\d+)$", f.read(), re.M)
    assert resumed == [str(keep)], resumed

    # nothing written after the NaN was sealed: LATEST is the fixed job's last checkpoint
    assert latest_step(root, "nan4") == again
    sealed = sorted(int(s) for s in os.listdir(os.path.join(root, "nan4", "checkpoints")))
    assert all(s <= again for s in sealed), sealed

    # those checkpoints are not gone without a trace: set aside, an event says where
    [aside] = [e for e in events if e["kind"] == "set_aside"]
    assert aside["steps"] == after and aside["above"] == keep, aside
    where = aside["path"]
    assert where in aside["reason"] and "loss is nan" in aside["reason"], aside
    assert _local_steps(where) == after
    assert all(s <= again for s in _local_steps(ckpt_dir)), _local_steps(ckpt_dir)
    assert not os.path.exists(RunDir("nan4", cli.home).sealing_frozen)


def test_a_nan_run_without_a_store_started_again_resumes_from_the_last_good_checkpoint(
    cli: Cli, tmp_path: Any
) -> None:
    """As above with no store: nothing was frozen (there was no sealer to freeze), so the new
    incarnation left the checkpoints written after the NaN in place and the job resumed from
    the newest of them, its weights NaN."""
    _start(cli, tmp_path, "nan5", store=False)
    st = cli.wait_over("nan5", "FAILED", "SUCCEEDED", timeout=120)
    assert st["state"] == "FAILED", st
    ckpt_dir = os.path.join(cli.home, "runs", "nan5", "ckpt")
    steps = _local_steps(ckpt_dir)
    assert any(s >= NAN_AT for s in steps), steps  # its stop's save, at least

    again = NAN_AT - 1  # the fixed job's last step: before any checkpoint written after the NaN
    _start(cli, tmp_path, "nan5", nan_at=10 * TOTAL, total=again, store=False)
    st = cli.wait_over("nan5", "SUCCEEDED", "FAILED", timeout=120)
    events = cli.events("nan5")
    print(json.dumps(events, indent=None))  # shown when the test fails
    assert st["state"] == "SUCCEEDED", st

    # the job resumed from a checkpoint before the NaN: the one the probe kept, the newest on
    # the box at or before the last finite loss it saw
    with open(RunDir("nan5", cli.home).output_log(st["attempt"])) as f:
        resumed = re.findall(r"^resumed from step (\d+)$", f.read(), re.M)
    assert len(resumed) == 1 and int(resumed[0]) < NAN_AT, resumed
    [nan] = [e for e in _health(events, "nan_loss") if e["level"] == "alert"]
    keep, good = nan["data"]["keep_step"], nan["data"]["good_step"]
    assert resumed == [str(keep)], (resumed, nan)
    assert good < NAN_AT and keep == max(s for s in steps if s <= good), (nan, steps)
    assert f"step {keep} in the checkpoint dir" in nan["remedy"], nan

    # the checkpoints written after it were set aside, an event says where
    after = [s for s in steps if s > keep]
    [aside] = [e for e in events if e["kind"] == "set_aside"]
    assert aside["steps"] == after and aside["above"] == keep, aside
    assert aside["path"] in aside["reason"] and "loss is nan" in aside["reason"], aside
    assert _local_steps(aside["path"]) == after
    assert all(s <= again for s in _local_steps(ckpt_dir)), _local_steps(ckpt_dir)
    assert not os.path.exists(RunDir("nan5", cli.home).sealing_frozen)


def test_a_sync_asked_of_an_agent_frozen_by_a_nan_loss_fails_saying_so(
    cli: Cli, tmp_path: Any
) -> None:
    """The agent stops itself (a stop point) just after the NaN loss froze its sealing, before
    it signals the job, which goes on writing checkpoints; a sync asks it, then it goes on. The
    frozen agent's pass sealed nothing and answered the sync all the same: exit 0."""
    root, agent = _frozen_and_stopped(cli, tmp_path, "nan2")
    env = {k: v for k, v in cli.env.items() if k != STOP_AFTER_EVENT}
    sync = subprocess.Popen(
        [*agent_exe(), "sync", "nan2", "--timeout", "60s"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        request = os.path.join(cli.home, "runs", "nan2", "sync.request")
        wait(lambda: os.path.exists(request), 30, "the sync to ask the agent")
        os.kill(agent, signal.SIGCONT)
        out, err = sync.communicate(timeout=90)
    finally:
        if sync.poll() is None:
            sync.kill()
            sync.wait()
    print(err)  # shown when the test fails
    [nan] = [e for e in _health(cli.events("nan2"), "nan_loss") if e["level"] == "alert"]
    keep = nan["data"]["keep_step"]
    assert sync.returncode == 7, (sync.returncode, out, err)
    assert "is not sealed" in err and "on purpose" in err, err
    assert f"frozen at step {keep}" in err and "loss is nan" in err, err
    assert latest_step(root, "nan2") == keep and keep < NAN_AT, keep


def test_a_preemption_while_a_nan_loss_ends_the_attempt_seals_nothing_newer(
    cli: Cli, tmp_path: Any
) -> None:
    """SIGTERM (a preemption) reaches the agent as it ends the attempt for a NaN loss: its
    final seal sealed the job's newest checkpoint, written after the NaN, and made it LATEST."""
    root, agent = _frozen_and_stopped(cli, tmp_path, "nan3")
    os.kill(agent, signal.SIGTERM)
    os.kill(agent, signal.SIGCONT)
    st = cli.wait_over("nan3", "FAILED", "PREEMPTED", timeout=120)
    print(json.dumps(cli.events("nan3"), indent=None))  # shown when the test fails
    [nan] = [e for e in _health(cli.events("nan3"), "nan_loss") if e["level"] == "alert"]
    keep = nan["data"]["keep_step"]
    assert keep is not None and keep < NAN_AT, nan
    assert latest_step(root, "nan3") == keep, st
    sealed = os.listdir(os.path.join(root, "nan3", "checkpoints"))
    assert all(int(s) < NAN_AT for s in sealed), sealed


def _frozen_and_stopped(cli: Cli, tmp_path: Any, name: str) -> Tuple[str, int]:
    """The NaN job as run ``name``, its agent stopped (SIGSTOP, a stop point) just after the
    NaN loss froze its sealing, before it signals the job, which goes on writing checkpoints
    until one after the NaN is on the box: (the store's root, the agent's pid)."""
    cli.env[STOP_AFTER_EVENT] = "kill_attempt"
    root = _start(cli, tmp_path, name)
    agent = cli.wait_state(name, "RUNNING")["agent"]["pid"]
    wait(lambda: _stopped(agent), 90, "the agent to stop as it ends the attempt")
    ckpt_dir = os.path.join(cli.home, "runs", name, "ckpt")
    wait(lambda: _local_steps(ckpt_dir)[-1] >= FIRST_BAD_CKPT, 60, "a checkpoint after the NaN")
    return root, agent


def _stopped(pid: int) -> bool:
    st = procfs.read_stat(pid)
    return st is not None and st.state in ("T", "t")
