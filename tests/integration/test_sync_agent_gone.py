"""`rgt-agent sync` while the run's agent dies: the seal is made anyway.

`sync` asks a live agent to seal and waits; with no agent it seals from itself. An agent that
dies while `sync` waits on it (the OOM killer, a person's kill, a preemption of the agent alone)
used to leave `sync` waiting out its whole timeout, or, when the lock came free between two
looks, failing at once with "does not answer" (exit 10): the user's explicit "seal now" lost.
Now `sync` seals from itself as soon as no agent holds the run. Real agent, real job, a real
SIGSTOP and SIGKILL, a file:// store.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Any

from tests.conftest import Cli, agent_exe
from tests.polling import wait

JOB = """\
import os, signal, sys, time
ckpt = sys.argv[1]
os.makedirs(ckpt, exist_ok=True)
path = os.path.join(ckpt, "step_1.pt")
with open(path + ".tmp", "wb") as f:
    f.write(b"step one" * 1000)
os.replace(path + ".tmp", path)
print("wrote step_1.pt", flush=True)
time.sleep(120)  # bounded: the test kills it by PID long before
"""


def test_sync_seals_from_itself_when_the_agent_it_asked_dies(cli: Cli, tmp_path: Any) -> None:
    root = str(tmp_path / "durable")
    os.makedirs(root)
    work = str(tmp_path / "box")
    os.makedirs(work)
    with open(os.path.join(work, "job.py"), "w") as f:
        f.write(JOB)
    ckpt = os.path.join(work, "ckpt")
    with open(os.path.join(work, "job.toml"), "w") as f:
        f.write(
            'name = "gone"\n'
            f"command = {json.dumps([sys.executable, 'job.py', ckpt])}\n"
            f'store = "file://{root}"\n'
            # An hour's scan: the agent seals only when asked (or woken by a close), so what
            # is sealed below is the sync's doing.
            f'[checkpoint]\ndir = {json.dumps(ckpt)}\nscan = "1h"\n'
        )
    cli.env["RGT_AGENT_RESPAWN_DELAY"] = "1000"  # the shim does not bring the agent back
    cli("start", os.path.join(work, "job.toml"), check=True, cwd=work)
    st = cli.wait_state("gone", "RUNNING", "STARTING")
    cli.wait_output("gone", "wrote step_1.pt")
    agent = st["agent"]["pid"]
    os.kill(agent, signal.SIGSTOP)  # holds the run's lock and answers nothing
    sync = subprocess.Popen(
        [*agent_exe(), "sync", "gone", "--timeout", "30s"],
        env=cli.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        request = os.path.join(cli.home, "runs", "gone", "sync.request")
        wait(lambda: os.path.exists(request), 30, "sync to ask the agent")
        os.kill(agent, signal.SIGKILL)  # dies without answering: the lock comes free
        out, err = sync.communicate(timeout=50)
    finally:
        if sync.poll() is None:
            sync.kill()
            sync.wait()
        os.kill(st["pid"], signal.SIGKILL)
    assert sync.returncode == 0, (sync.returncode, out, err)
    assert "LATEST is step 1" in out, (out, err)
    with open(os.path.join(root, "gone", "LATEST.json")) as f:
        assert json.load(f)["step"] == 1
