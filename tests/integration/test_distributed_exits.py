"""How a distributed job's end is told: a real torchrun of two CPU ranks (gloo) under the real
agent (`rgt-agent run`), one rank failing for real (onbox/agent/launchers.py).

torchrun exits 1 with its own ChildFailedError whatever a rank did, and PyTorch prefixes a
rank's traceback with ``[rankN]:``: an import error in a rank was retried on the error budget
as torchrun's "ChildFailedError", and a rank killed from outside spent the error budget too.
Now the first failed rank's own end decides.

The same for a job that starts its processes with ``torch.multiprocessing.spawn``: the parent
ends on ProcessRaisedException (the child's traceback in its message) or ProcessExitedException
(a child ended by a signal), and the child's own end decides.
"""

from __future__ import annotations

import json
import socket
import sys
from typing import Any, Dict, List

from tests.conftest import Cli

JOB = """
import datetime, os, signal, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
how, marker = sys.argv[1], sys.argv[2]
if rank == 1 and how == "import":
    import no_such_module_rgt  # noqa: F401
t = torch.ones(4)
for step in range(20):
    try:
        dist.all_reduce(t)
    except RuntimeError:
        if how == "import":  # what a job's own report at its end may print: 40 KiB of it
            for i in range(400):
                print(f"rank {rank} diagnostics {i}: " + "x" * 80, flush=True)
        raise
    if rank == 0:
        print(f"step {step}", flush=True)
    if rank == 1 and how == "kill" and step == 5 and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)  # once: the next attempt runs to its end
    time.sleep(0.05)
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(cli: Cli, tmp_path: Any, name: str, how: str) -> Any:
    job = tmp_path / "ddp.py"
    job.write_text(JOB)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    port = ["--master-addr", "127.0.0.1", "--master-port", str(_free_port())]
    marker = str(tmp_path / "killed-once")
    return cli("run", "--name", name, "--", *torchrun, *port, str(job), how, marker, timeout=300)


def _exits(cli: Cli, name: str) -> List[Dict[str, Any]]:
    return [e for e in cli.events(name) if e["kind"] == "exit"]


def test_an_import_error_in_one_rank_fails_the_run_at_once_and_names_the_rank(
    cli: Cli, tmp_path: Any
) -> None:
    """Rank 0, whose peer went, prints 40 KiB before torchrun's summary: more than the tail
    the agent reads of a job's output, so rank 1's traceback is read from further back."""
    p = _run(cli, tmp_path, "ddpimport", "import")
    assert p.returncode == 11, (p.stdout, p.stderr)  # FAILED, not retried
    (ex,) = _exits(cli, "ddpimport")
    assert ex["exit_kind"] == "import_error", ex
    assert "rank 1: ModuleNotFoundError: No module named 'no_such_module_rgt'" in ex["reason"], ex


def test_a_rank_killed_from_outside_is_restarted_as_a_preemption_and_named(
    cli: Cli, tmp_path: Any
) -> None:
    p = _run(cli, tmp_path, "ddpkill", "kill")
    assert p.returncode == 0, (p.stdout, p.stderr)  # the second attempt ran to its end
    first = _exits(cli, "ddpkill")[0]
    assert first["exit_kind"] == "signal", first
    assert "rank 1: killed by signal 9 (SIGKILL)" in first["reason"], first
    st = cli.peek("ddpkill")
    assert st["budgets"]["error_used"] == 0 and st["budgets"]["preempt_used"] == 1, st


SPAWN_JOB = """
import os, signal, sys, time
import torch.multiprocessing as mp

def work(i, how, marker):
    if i == 1 and how == "import":
        import no_such_module_rgt  # noqa: F401
    for step in range(10):
        if i == 0:
            print(f"step {step}", flush=True)
        if i == 1 and how == "kill" and step == 3 and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)  # once: the next attempt runs to its end
        time.sleep(0.05)

if __name__ == "__main__":
    mp.spawn(work, args=(sys.argv[1], sys.argv[2]), nprocs=2)
"""


def _spawn(cli: Cli, tmp_path: Any, name: str, how: str) -> Any:
    job = tmp_path / "spawned.py"
    job.write_text(SPAWN_JOB)
    marker = str(tmp_path / "killed-once")
    return cli("run", "--name", name, "--", sys.executable, str(job), how, marker, timeout=300)


def test_an_import_error_in_a_spawned_child_fails_the_run_at_once_and_names_it(
    cli: Cli, tmp_path: Any
) -> None:
    p = _spawn(cli, tmp_path, "spawnimport", "import")
    assert p.returncode == 11, (p.stdout, p.stderr)  # FAILED, not retried
    (ex,) = _exits(cli, "spawnimport")
    assert ex["exit_kind"] == "import_error", ex
    want = "process 1: ModuleNotFoundError: No module named 'no_such_module_rgt'"
    assert want in ex["reason"], ex


def test_a_spawned_child_killed_from_outside_is_restarted_as_a_preemption_and_named(
    cli: Cli, tmp_path: Any
) -> None:
    """The parent ends on ProcessExitedException ("process 1 terminated with signal
    SIGKILL"), exit code 1: read as its own Python exception, on the error budget."""
    p = _spawn(cli, tmp_path, "spawnkill", "kill")
    assert p.returncode == 0, (p.stdout, p.stderr)  # the second attempt ran to its end
    first = _exits(cli, "spawnkill")[0]
    assert first["exit_kind"] == "signal", first
    assert "process 1: killed by signal 9 (SIGKILL)" in first["reason"], first
    st = cli.peek("spawnkill")
    assert st["budgets"]["error_used"] == 0 and st["budgets"]["preempt_used"] == 1, st


CAUGHT_JOB = """
import os, signal, sys, traceback
import torch.multiprocessing as mp

def work(i):
    if i == 1:
        os.kill(os.getpid(), signal.SIGKILL)

if __name__ == "__main__":
    for attempt in range(2):
        try:
            mp.spawn(work, nprocs=2)
        except mp.ProcessExitedException:
            traceback.print_exc()  # logged, and the job goes on
            print(f"spawn {attempt} failed; retrying", flush=True)
    print("giving up", flush=True)
    sys.exit(1)
"""


def test_a_spawn_failure_the_job_logged_and_went_on_from_is_not_how_it_ended(
    cli: Cli, tmp_path: Any
) -> None:
    """The job catches mp.spawn's ProcessExitedException ("process 1 terminated with signal
    SIGKILL"), prints its traceback, goes on, and later exits 1 of its own with no traceback.
    The logged exception was read as the job's end: a child killed from outside, restarted on
    the preemption budget (100 tries), where the job crash-loops on the error budget's."""
    job = tmp_path / "caught.py"
    job.write_text(CAUGHT_JOB)
    toml = tmp_path / "caught.toml"
    toml.write_text(
        f"command = {json.dumps([sys.executable, str(job)])}\n[restart]\n"
        'max_error_restarts = 1\nmax_preempt_restarts = 3\nbackoff_initial = "0.1s"\n'
        'backoff_max = "0.2s"\n'
    )
    p = cli("run", str(toml), "--name", "spawncaught", timeout=300)
    assert p.returncode == 11, (p.stdout, p.stderr)  # FAILED once the error budget is spent
    exits = _exits(cli, "spawncaught")
    assert [e["exit_kind"] for e in exits] == ["python_exception"] * 2, exits
    st = cli.peek("spawncaught")
    assert st["budgets"]["error_used"] == 1 and st["budgets"]["preempt_used"] == 0, st
