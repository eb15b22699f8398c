"""A DataLoader worker taken by the OOM killer, in a real agent inside a real cgroup v1 memory
limit: the job's main process does not die of the kill, it raises PyTorch's "DataLoader worker
(pid N) is killed by signal: Killed" and exits 1. The verdict read that as a Python exception
("fix the error shown in the log"); the cgroup's OOM-kill count rose, and the exit now says the
OOM killer took a worker, with what to lower.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from tests import mounts
from tests.conftest import Cli, agent_exe, require

LIMIT = 700 << 20  # room for the job's torch; the worker grows past it
JOB = """
import torch
from torch.utils.data import DataLoader, Dataset

class Grows(Dataset):
    def __len__(self):
        return 100

    def __getitem__(self, i):
        hog = []
        while i == 3:  # the fourth sample's worker holds ever more memory, until it is killed
            hog.append(bytearray(32 << 20))
        return torch.zeros(4)

for step, batch in enumerate(DataLoader(Grows(), batch_size=1, num_workers=1)):
    print("step", step, flush=True)
"""


def test_a_dataloader_worker_the_oom_killer_took_is_an_oom_kill(cli: Cli, tmp_path: Any) -> None:
    cg = mounts.memory_cgroup(LIMIT, "rgt-dl")
    require(bool(cg), "root and a writable cgroup v1 memory controller")
    script = tmp_path / "loader.py"
    script.write_text(JOB)
    job = os.path.join(cli.home, "dl.toml")
    with open(job, "w") as f:
        f.write(f"command = {json.dumps([sys.executable, str(script)])}\n")
        f.write("[restart]\nmax_error_restarts = 0\n")
    wrapper = f"echo $$ > {cg}/cgroup.procs && exec {' '.join(agent_exe())} run {job} --name dl"
    try:
        p = subprocess.run(
            ["bash", "-c", wrapper], env=cli.env, capture_output=True, text=True, timeout=180
        )
    finally:
        mounts.remove_cgroup(cg, timeout=10)
    assert p.returncode == 11, (p.stdout, p.stderr)  # FAILED: no error restart allowed
    last = cli.status("dl")["last_exit"]
    assert last["kind"] == "oom_killed", last
    assert "DataLoader worker" in last["reason"] and "OOM killer" in last["reason"], last
    assert "num_workers" in last["remedy"], last
