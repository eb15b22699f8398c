"""`rgt sweep` and `rgt reconcile`, end to end: the real `rgt` CLI as a process, a sweep of six
cells over two real SSH boxes (the loopback sshd and the sshd inside a network namespace), each
cell a real PyTorch CPU training (examples/train_plain.py, bounded steps) behind a small job
that writes its result to the cell's own output path. Both boxes share this machine's file
system, so the store (file://) and what happened on a box are checked by reading them here.

One sequence, because each step builds on the last:

1. ``--dry-run`` shows six cells, three per box; nothing is deployed;
2. ``--no-wait`` deploys each box's first cell; the netns box's cell is killed mid-cell once it
   has a sealed checkpoint (its agent, shim and job SIGKILLed by PID: the box died);
3. ``rgt sweep`` again: that cell is deployed again and resumes from the store (its first step
   after the restart > 1), and every queue runs to its end; every cell has its own output in
   its own store prefix, the two cells whose tags differ only in case and punctuation too;
4. ``rgt reconcile`` passes (exit 0); one cell's output deleted from the store, and a stray run
   under the sweep's prefix: reconcile reports exactly that cell and that run (exit 18), and
   ``rgt down`` of any run on that cell's box is refused naming ``rgt reconcile``;
5. ``rgt sweep`` re-launches that cell as a fresh run of the identical config; reconcile passes;
   ``down`` now passes the sweep's gate (a pull's receipt is still required, then it goes down).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest

from onbox.agent import procfs
from tests.conftest import ROOT, _kill_run_processes
from tests.laptop import laptop_env, run_rgt, ssh_target
from tests.netns import Netns
from tests.polling import latest_step, wait
from tests.sshd import SshServer

# 6 s of steps a cell: the cell killed once step 5 is sealed (about a second in) still has
# ~5 s of steps left, so it is always killed mid-cell; every cell of a box's queue pays them.
STEPS = 30
# The job: its parameters and cell to its own output path, then the real training.
JOB = """\
import argparse, json, os, runpy, sys
ap = argparse.ArgumentParser()
ap.add_argument("--tag"); ap.add_argument("--seed", type=int); ap.add_argument("--out")
a = ap.parse_args()
print("cell", os.environ.get("RGT_CELL"), "out", a.out, flush=True)
# --sync: what is tested here does not depend on how the job saves, and the async writer
# would be a second process importing torch for every deploy.
sys.argv = ["train_plain.py", "--steps", "@STEPS@", "--sleep", "0.2", "--ckpt-every", "5",
            "--sync"]
runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_plain.py"),
               run_name="__main__")
os.makedirs(a.out, exist_ok=True)
with open(os.path.join(a.out, "result.json"), "w") as f:
    json.dump({"tag": a.tag, "seed": a.seed, "cell": os.environ.get("RGT_CELL"),
               "sweep": os.environ.get("RGT_SWEEP")}, f)
""".replace("@STEPS@", str(STEPS))


class Sweep:
    """The laptop (its controller home), the boxes' RGT_HOME, the store, the plan."""

    def __init__(self, tmp: Path, targets: List[str]) -> None:
        self.ctl = tmp / "ctl"
        self.box_home = tmp / "box"
        self.store = tmp / "store"
        self.project = tmp / "project"
        for d in (self.ctl, self.store, self.project):
            d.mkdir()
        shutil.copy(os.path.join(ROOT, "examples", "train_plain.py"), self.project)
        (self.project / "job.py").write_text(JOB)
        self.targets = targets
        self.plan = self.project / "PLAN.toml"
        self.plan.write_text(
            f'name = "sw"\nstore = "file://{self.store}"\npython = "{sys.executable}"\n'
            "offline = true\n"
            f"targets = {json.dumps(targets)}\n"
            f'command = ["{sys.executable}", "job.py", "--tag", "{{tag}}", "--seed", "{{seed}}", '
            '"--out", "{out}"]\n'
            'outputs = ["out"]\n'
            '[grid]\ntag = ["a.b", "A-B"]\nseed = [0, 1, 2]\n'
        )

    def env(self) -> Dict[str, str]:
        return laptop_env(str(self.ctl), str(self.box_home))

    def rgt(self, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
        return run_rgt(args, self.env(), str(self.ctl), timeout)

    def record(self) -> Dict[str, Any]:
        with open(self.ctl / "sweeps" / "sw.json") as f:
            doc: Dict[str, Any] = json.load(f)
        return doc

    def reconcile(self) -> Tuple[int, Dict[str, Any]]:
        p = self.rgt("reconcile", str(self.plan), "--json")
        assert p.stdout.strip(), f"reconcile printed nothing ({p.returncode}): {p.stderr}"
        return p.returncode, json.loads(p.stdout)

    def run_dir(self, run: str) -> Path:
        return self.box_home / "runs" / run

    def kill_run(self, run: str) -> List[int]:
        """SIGKILL, by PID, the run's agent (its lock's holder), its shims and every process
        whose environment names its run directory: the box died under it."""
        rd = self.run_dir(run)
        killed: List[int] = []
        for _ in range(20):
            victims: List[
                Optional[procfs.Identity]
            ] = []  # each with its start time, so that a reused PID is never hit
            with contextlib.suppress(OSError, ValueError, KeyError):
                lock = json.loads((rd / "lock").read_text() or "{}")
                victims.append(procfs.Identity(int(lock["pid"]), int(lock["start_ticks"])))
            for rec in rd.glob("attempts/*/job.json"):
                with contextlib.suppress(OSError, ValueError, KeyError):
                    shim = json.loads(rec.read_text())["shim"]
                    victims.append(procfs.Identity(int(shim["pid"]), int(shim["start_ticks"])))
            for pid in procfs.pids():
                env = procfs.environ(pid) if pid != os.getpid() else None
                if env and env.get(b"RGT_RUN_DIR") == str(rd).encode():
                    victims.append(procfs.identity(pid))
            alive = [i.pid for i in victims if i is not None and procfs.is_alive(i)]
            if not alive:
                return killed
            for pid in alive:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
            time.sleep(0.1)
        raise AssertionError(f"processes of {run} survived SIGKILL")

    def cleanup(self) -> None:
        _kill_run_processes(str(self.box_home))


def _steps(log: str) -> List[int]:
    return [int(line.split()[1]) for line in log.splitlines() if line.startswith("step ")]


@pytest.fixture
def sweep(sshd: SshServer, netns_sshd: Tuple[Netns, SshServer], tmp_path: Path) -> Iterator[Sweep]:
    ns, server = netns_sshd
    s = Sweep(tmp_path, [ssh_target(sshd), ssh_target(server)])
    try:
        yield s
    finally:
        with contextlib.suppress(RuntimeError):
            ns.link_up()
        s.cleanup()


@pytest.mark.timeout(900)  # minutes of real training and deploys, more under load
def test_a_sweep_over_two_boxes_resumes_reconciles_and_gates_down(sweep: Sweep) -> None:
    s = sweep
    loop, netns = s.targets
    plan = str(s.plan)

    # 1. The dry run: six cells, split three and three; nothing deployed.
    p = s.rgt("sweep", plan, "--dry-run")
    assert p.returncode == 0, p.stderr
    assert "6 cells over 2 box(es)" in p.stderr and p.stderr.count("3 cells, cost 3") == 2
    assert not (s.ctl / "runs.json").exists() and not (s.box_home / "runs").exists()

    # 2. Each box's first cell deployed; the netns box's killed once it has sealed a step.
    p = s.rgt("sweep", plan, "--no-wait")
    assert p.returncode == 0, p.stderr
    doc = s.record()
    running = {c["box"]: n for n, c in doc["cells"].items() if c["state"] == "running"}
    assert set(running) == {loop, netns}, doc
    victim = running[netns]
    wait(lambda: (latest_step(str(s.store), victim) or 0) >= 5, 120, f"a sealed step of {victim}")
    assert not (s.store / victim / "DONE.json").exists()
    assert s.kill_run(victim)

    # 3. Run again: the dead cell is deployed again and resumes; every queue runs to its end.
    p = s.rgt("sweep", plan, "--interval", "1", timeout=420)
    assert p.returncode == 0, p.stderr
    assert f"{victim}'s agent on {netns} is gone mid-cell" in p.stderr
    doc = s.record()
    assert all(c["state"] == "succeeded" for c in doc["cells"].values()), doc
    logs = sorted((s.run_dir(victim) / "attempts").glob("*/output.log"))
    assert len(logs) >= 2, logs
    resumed = _steps(logs[-1].read_text())
    assert resumed and resumed[0] > 1 and resumed[-1] == STEPS, resumed[:3]
    assert "resumed at step" in logs[-1].read_text()
    seen_out = set()
    for name, c in doc["cells"].items():
        assert c["runs"] == [name] and c["box"] in (loop, netns)
        out = s.store / name / "outputs" / "out" / name / "result.json"
        got = json.loads(out.read_text())
        assert got["cell"] == name and got["sweep"] == "sw"
        assert {"tag": got["tag"], "seed": got["seed"]} == c["params"]
        seen_out.add(f"out/{name}".casefold())
    assert len(seen_out) == 6  # "a.b" and "A-B": distinct paths, case-insensitively too
    assert sorted(c["box"] for c in doc["cells"].values()) == sorted([loop] * 3 + [netns] * 3)

    # 4. Reconciled; then one cell's output deleted and a stray run under the sweep's prefix.
    rc, rep = s.reconcile()
    assert rc == 0 and rep["reconciled"] and rep["ok"] == 6, rep
    broken = next(n for n, c in doc["cells"].items() if c["box"] == loop)
    (s.store / broken / "outputs" / "out" / broken / "result.json").unlink()
    stray = s.store / "sw-tag-z-seed-9-0123abcd"
    stray.mkdir()
    (stray / "DONE.json").write_text("{}")
    rc, rep = s.reconcile()
    assert rc == 18, rep
    assert rep["unverified"] == [broken] and rep["missing"] == [] and rep["failed"] == []
    assert [d["run"] for d in rep["duplicates"]] == [stray.name]
    shutil.rmtree(stray)  # the test's own stray (rgt never deletes from a store)
    same_box = [n for n, c in doc["cells"].items() if c["box"] == loop]
    for run in (broken, next(n for n in same_box if n != broken)):
        p = s.rgt("down", run, "--yes")
        assert p.returncode == 7, p.stderr
        assert "rgt reconcile" in p.stderr and broken in p.stderr, p.stderr
    assert s.run_dir(broken).is_dir()  # nothing was taken down

    # 5. A fresh run of the identical config; reconciled; down passes the gate.
    p = s.rgt("sweep", plan, "--interval", "1", timeout=300)
    assert p.returncode == 0, p.stderr
    fresh = f"{broken}-r2"
    c = s.record()["cells"][broken]
    assert c["runs"] == [broken, fresh] and c["run"] == fresh and c["state"] == "succeeded"
    assert s.run_dir(fresh).is_dir() and (s.store / fresh / "DONE.json").is_file()
    rc, rep = s.reconcile()
    assert rc == 0 and rep["ok"] == 6, rep
    p = s.rgt("down", fresh, "--yes")
    assert p.returncode == 7 and "rgt pull" in p.stderr and "reconcile" not in p.stderr, p.stderr
    p = s.rgt("pull", fresh, timeout=120)
    assert p.returncode == 0, p.stderr
    p = s.rgt("down", fresh, "--yes", timeout=180)
    assert p.returncode == 0, p.stderr
    assert not s.run_dir(fresh).exists()
