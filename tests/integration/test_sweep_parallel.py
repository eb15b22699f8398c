"""`rgt sweep` deploys to its boxes side by side: a box whose deploy is slow holds no other box's
deploy, and a box whose deploy fails leaves the others' cells deployed and the record whole.

Real parts: the real `rgt sweep` CLI as a process (bounded, killed by PID past it), real boxes
(the suite's loopback sshd, and sshds of the test's own), a real ``file://`` store, each cell a
real run of a small job. The slow box is a real hold on that box: its sshd gives every session
a PATH whose first ``sh`` is a script that, in the command that starts a run's agent (the
deploy's last step), waits while the test's HOLD file exists, saying so on its stderr (which
the deploy relays as it comes, so its wait never reads as silence); it creates REACHED as it
begins. That box is listed first in the plan: before the fix the sweep deployed one box after
the other, in the plan's order, so no other box's cell started while the first box's deploy
was held.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import psutil
import pytest

from tests.conftest import _kill_run_processes
from tests.laptop import laptop_env, rgt_exe, ssh_target
from tests.polling import wait
from tests.sshd import SshServer, start_sshd

BAD_BOX = "rgt-sweep-parallel-box.invalid"  # does not resolve: each deploy to it fails in ssh
WAIT = 300.0  # the most a step of the test waits for the sweep (deploys under load)

# The held box's ``sh`` (first on the PATH its sshd gives each session): the start's command
# (boxstart.py START_SH, the only one that says held=none) waits while HOLD exists, at most 600 s;
# then, as every other command, it is the real /bin/sh.
HOLD_SH = """\
#!/bin/sh
case "$*" in
*held=none*)
  : > '@REACHED@'
  i=0
  while [ -e '@HOLD@' ] && [ "$i" -lt 1200 ]; do
    [ $((i % 10)) -eq 0 ] && echo "test-hold: this box's start is held" >&2
    sleep 0.5
    i=$((i + 1))
  done ;;
esac
exec /bin/sh "$@"
"""
# The job: its cell marked as started (a file on this machine, which the boxes share), then a line.
JOB = """\
import os, sys
open(os.path.join(sys.argv[1], os.environ["RGT_CELL"] + ".started"), "w").close()
print("cell", os.environ["RGT_CELL"], "started", flush=True)
"""


class Held:
    """A box whose agent's start waits while ``hold`` exists (module docstring)."""

    def __init__(self, tmp: Path) -> None:
        tmp.mkdir()
        self.hold = tmp / "HOLD"
        self.reached = tmp / "REACHED"
        (tmp / "bin").mkdir()
        script = tmp / "bin" / "sh"
        script.write_text(
            HOLD_SH.replace("@HOLD@", str(self.hold)).replace("@REACHED@", str(self.reached))
        )
        script.chmod(0o755)
        self.hold.touch()
        (tmp / "sshd").mkdir()
        path = f"{tmp / 'bin'}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        self.server: SshServer = start_sshd(str(tmp / "sshd"), set_env={"PATH": path})

    def release(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.hold.unlink()


class Sweep:
    """The laptop's home, the boxes' home, the store, the plan over ``targets``, and the
    `rgt sweep` process once started."""

    def __init__(self, tmp: Path, targets: List[str]) -> None:
        self.tmp, self.targets = tmp, targets
        self.ctl, self.box_home, self.store = tmp / "ctl", tmp / "box", tmp / "store"
        self.marks, project = tmp / "marks", tmp / "project"
        for d in (self.ctl, self.store, self.marks, project):
            d.mkdir()
        (project / "job.py").write_text(JOB)
        self.plan = project / "PLAN.toml"
        self.plan.write_text(
            f'name = "par"\nstore = "file://{self.store}"\npython = "{sys.executable}"\n'
            f"offline = true\ntargets = {json.dumps(targets)}\n"
            f'command = ["{sys.executable}", "job.py", "{self.marks}", "{{seed}}"]\n'
            f"[grid]\nseed = {list(range(len(targets)))}\n"
        )
        self.err = tmp / "sweep.err"
        self.proc: Optional[subprocess.Popen[bytes]] = None

    def start(self, *args: str, group: bool = False) -> None:
        """The sweep, started; ``group``: in a process group of its own, as a terminal runs
        its foreground job (its Ctrl-C then goes to that group: ``ctrl_c``)."""
        env = laptop_env(str(self.ctl), str(self.box_home))
        with open(self.err, "wb") as err:
            self.proc = subprocess.Popen(
                [*rgt_exe(), "sweep", str(self.plan), *args], env=env, cwd=str(self.tmp),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                start_new_session=group,
            )  # fmt: skip

    def ctrl_c(self) -> None:
        """A terminal's Ctrl-C: SIGINT to every process of the sweep's process group (its
        own: ``start(group=True)``), the children it started in that group included."""
        assert self.proc is not None and self.proc.poll() is None
        os.killpg(self.proc.pid, signal.SIGINT)

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def ended(self) -> int:
        """The sweep's exit code, once it ends (WAIT at most)."""
        assert self.proc is not None
        proc = self.proc
        wait(lambda: proc.poll() is not None, WAIT, "the sweep's end", 0.2, self.stderr)
        return int(proc.returncode)

    def started(self) -> List[str]:
        """The cells whose job started, by their marks."""
        return sorted(p.name[: -len(".started")] for p in self.marks.glob("*.started"))

    def record(self) -> Dict[str, Any]:
        with open(self.ctl / "sweeps" / "par.json") as f:
            cells: Dict[str, Any] = json.load(f)["cells"]
        return cells

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # by its PID (Popen.kill)
            self.proc.wait(timeout=30)
        _kill_run_processes(str(self.box_home))


@pytest.fixture
def held(tmp_path: Path) -> Iterator[Held]:
    h = Held(tmp_path / "held")
    try:
        yield h
    finally:
        h.release()
        h.server.stop()


@contextlib.contextmanager
def _swept(tmp_path: Path, targets: List[str]) -> Iterator[Sweep]:
    s = Sweep(tmp_path, targets)
    try:
        yield s
    finally:
        s.stop()


def _lines_name_their_box(err: str, targets: List[str]) -> None:
    """Each line of a deploy, and each line of its box's stderr relayed as it comes, is whole
    and starts with its box's label (``  [TARGET] ``)."""
    lines = err.splitlines()
    for line in lines:
        if line.startswith("  ["):
            assert any(line.startswith(f"  [{t}] ") for t in targets), (line, err)
            assert line.count("  [") == 1, (line, err)
    deploys = [ln for ln in lines if "rgt: auditing " in ln]
    assert len(deploys) == 2 and all(ln.startswith("  [") for ln in deploys), err
    relayed = [ln for ln in lines if "test-hold: " in ln]
    assert relayed and all(ln == f"  [{targets[0]}]   | test-hold: this box's start is held"
                           for ln in relayed), err  # fmt: skip


def _cells(s: Sweep) -> Dict[str, Any]:
    """The sweep's record's cells ({} before the sweep made it)."""
    with contextlib.suppress(OSError, ValueError):
        return s.record()
    return {}


def _first_held_then(
    s: Sweep, held: Held, then: Any, what: str
) -> Tuple[List[str], Dict[str, Any]]:
    """Wait (WAIT at most) for ``then(cells)`` (the record's) while the first box's start is
    held; the cells started by then and the record as it was, before the hold is let go."""

    def seen() -> bool:  # (the first box's deploy at its start, held)
        return bool(then(_cells(s))) and held.reached.exists()

    wait(lambda: seen() or (s.proc is not None and s.proc.poll() is not None), WAIT, what,
         poll=0.2, info=s.stderr)  # fmt: skip
    cells = s.record()
    assert seen(), f"the sweep ended before {what}:\n{s.stderr()}"
    return s.started(), cells


@pytest.mark.timeout(900)
def test_a_held_deploy_to_one_box_does_not_hold_the_other_boxes_deploy(
    tmp_path: Path, sshd: SshServer, held: Held
) -> None:
    """Before the fix: no cell started (the sweep waited on the first box's held deploy)."""
    targets = [ssh_target(held.server), ssh_target(sshd)]
    with _swept(tmp_path, targets) as s:
        s.start("--no-wait")
        started, cells = _first_held_then(
            s, held, lambda cells: any(c["state"] == "running" for c in cells.values()),
            "a cell deployed while the first box's deploy is held",
        )  # fmt: skip
        free = next(n for n, c in cells.items() if c["state"] == "running")
        first = next(n for n in cells if n != free)
        assert started == [free], started
        # The held box's deploy had begun and not ended: its cell neither deployed nor failed.
        assert cells[first]["state"] == "pending" and cells[first]["error"] is None, cells
        held.release()
        assert s.ended() == 0, s.stderr()
        cells = s.record()
        assert cells[free]["box"] == targets[1] and cells[first]["box"] == targets[0], cells
        for name in (free, first):
            assert cells[name]["state"] == "running" and cells[name]["runs"] == [name], cells
        # The held box's deploy ended after the other box's: the two overlapped.
        assert cells[first]["deployed_at"] > cells[free]["deployed_at"], cells
        assert s.started() == sorted([free, first])
        _lines_name_their_box(s.stderr(), targets)


@pytest.mark.timeout(900)
def test_a_failing_deploy_leaves_the_other_boxes_cells_deployed_and_the_record_whole(
    tmp_path: Path, held: Held
) -> None:
    """One box cannot be reached (each deploy to it fails in ssh) while the first box's deploy
    is held: its failure is recorded on its cell while that deploy goes on, which then ends
    deployed; the sweep follows that cell to its end and exits 3 (a box was left with cells to
    do). Before the fix the failing box's deploy waited for the held one."""
    targets = [ssh_target(held.server), BAD_BOX]
    with _swept(tmp_path, targets) as s:
        s.start("--interval", "0.5")
        started, cells = _first_held_then(
            s, held, lambda cells: any(c["error"] for c in cells.values()),
            "the failed deploy recorded while the first box's is held",
        )  # fmt: skip
        assert started == [], started
        bad = next(n for n, c in cells.items() if c["box"] == BAD_BOX)
        first = next(n for n in cells if n != bad)
        assert cells[first]["state"] == "pending" and cells[first]["error"] is None, cells
        assert cells[bad]["state"] == "pending", cells
        assert cells[bad]["error"].startswith(f"rgt: cannot reach {BAD_BOX}: "), cells
        held.release()
        assert s.ended() == 3, s.stderr()
        cells = s.record()
        assert cells[first]["state"] == "succeeded" and cells[first]["error"] is None, cells
        assert (s.store / first / "DONE.json").is_file()
        assert cells[bad]["state"] == "pending" and cells[bad]["runs"] == [], cells
        assert s.started() == [first]
        err = s.stderr()
        assert f"rgt sweep: {bad}: its deploy to {BAD_BOX} failed" in err, err
        assert f"{BAD_BOX}: its queue is left: " in err, err
        assert f"rgt sweep: {first} succeeded on {targets[0]}" in err, err


@pytest.mark.timeout(900)
def test_a_ctrl_c_lets_the_deploys_in_flight_end_and_the_next_sweep_follows_them(
    tmp_path: Path, sshd: SshServer, held: Held
) -> None:
    """SIGINT to the sweep (a Ctrl-C; to its process alone, so the held deploy's ssh is not
    cut) while the first box's deploy is held: the sweep says it waits for the deploys in
    flight and does, records the held one's cell once it is deployed, then ends with 130; the
    next `rgt sweep` follows both cells to their end."""
    targets = [ssh_target(held.server), ssh_target(sshd)]
    with _swept(tmp_path, targets) as s:
        s.start("--interval", "0.5")
        _, cells = _first_held_then(
            s, held, lambda cells: any(c["state"] == "running" for c in cells.values()),
            "a cell deployed while the first box's deploy is held",
        )  # fmt: skip
        first = next(n for n, c in cells.items() if c["state"] == "pending")
        assert s.proc is not None
        s.proc.send_signal(signal.SIGINT)  # by its PID
        said = "rgt sweep: interrupted: waiting for the deploys in flight to end"
        wait(lambda: said in s.stderr(), WAIT, "the sweep to say it waits", 0.2, s.stderr)
        assert s.proc.poll() is None, s.stderr()  # it waits for the held deploy
        assert s.record()[first]["state"] == "pending", s.record()
        held.release()
        assert s.ended() == 130, s.stderr()
        cells = s.record()
        assert [c["state"] for c in cells.values()] == ["running", "running"], cells
        assert cells[first]["error"] is None and cells[first]["runs"] == [first], cells
        s.start("--interval", "0.5")
        assert s.ended() == 0, s.stderr()
        cells = s.record()
        assert [c["state"] for c in cells.values()] == ["succeeded", "succeeded"], cells
        assert all((s.store / n / "DONE.json").is_file() for n in cells)


SAID_WAITS = "rgt sweep: interrupted: waiting for the deploys in flight to end"


@pytest.mark.timeout(900)
def test_a_terminals_ctrl_c_to_the_whole_group_lets_the_held_deploy_end(
    tmp_path: Path, sshd: SshServer, held: Held
) -> None:
    """A terminal's Ctrl-C goes to the sweep's whole process group while the first box's
    deploy is held: the ssh carrying that deploy must not be cut by it, so the deploy ends
    once let go, its cell recorded deployed with no error, and the sweep exits 130. Before the
    fix the ssh children shared rgt's group and died of the SIGINT: the held deploy failed
    ("cannot reach" or a start cut off) and its cell kept the error."""
    targets = [ssh_target(held.server), ssh_target(sshd)]
    with _swept(tmp_path, targets) as s:
        s.start("--interval", "0.5", group=True)
        _, cells = _first_held_then(
            s, held, lambda cells: any(c["state"] == "running" for c in cells.values()),
            "a cell deployed while the first box's deploy is held",
        )  # fmt: skip
        first = next(n for n, c in cells.items() if c["state"] == "pending")
        s.ctrl_c()
        wait(lambda: SAID_WAITS in s.stderr(), WAIT, "the sweep to say it waits", 0.2, s.stderr)
        held.release()
        assert s.ended() == 130, s.stderr()
        cells = s.record()
        assert cells[first]["error"] is None, (cells, s.stderr())
        assert cells[first]["state"] == "running" and cells[first]["runs"] == [first], cells
        s.start("--interval", "0.5")
        assert s.ended() == 0, s.stderr()
        assert [c["state"] for c in s.record().values()] == ["succeeded", "succeeded"]


def _descendants(pid: int) -> List[psutil.Process]:
    """The processes below ``pid`` now (each kept with its start time: a PID reused later is
    not taken for it)."""
    return psutil.Process(pid).children(recursive=True)


def _gone(p: psutil.Process) -> bool:
    """Whether ``p`` ended (a zombie not yet reaped by whoever adopted it is dead)."""
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.timeout(900)
def test_a_second_ctrl_c_stops_the_deploys_children(
    tmp_path: Path, sshd: SshServer, held: Held
) -> None:
    """A second Ctrl-C (to the group, as a terminal sends it) while the sweep waits for the
    held deploy: the sweep exits 130 at once, and no process it started for that deploy (its
    ssh) is left running, though none of them takes the terminal's SIGINT (each checked by its
    PID). Without rgt stopping them itself, the held deploy's ssh ran on after the sweep."""
    targets = [ssh_target(held.server), ssh_target(sshd)]
    with _swept(tmp_path, targets) as s:
        s.start("--interval", "0.5", group=True)
        _first_held_then(
            s, held, lambda cells: any(c["state"] == "running" for c in cells.values()),
            "a cell deployed while the first box's deploy is held",
        )  # fmt: skip
        s.ctrl_c()
        wait(lambda: SAID_WAITS in s.stderr(), WAIT, "the sweep to say it waits", 0.2, s.stderr)
        assert s.proc is not None
        kids = _descendants(s.proc.pid)
        assert any(k.name() == "ssh" for k in kids), (kids, s.stderr())
        s.ctrl_c()
        assert s.ended() == 130, s.stderr()
        wait(lambda: all(_gone(k) for k in kids), 60, "the sweep's children to end", 0.2,
             lambda: [k for k in kids if not _gone(k)])  # fmt: skip


@pytest.mark.timeout(900)
def test_a_hangup_lets_the_deploys_in_flight_end_as_a_first_ctrl_c_does(
    tmp_path: Path, sshd: SshServer, held: Held
) -> None:
    """SIGHUP to the sweep (its terminal closed) while the first box's deploy is held: as on a
    first Ctrl-C, the deploy in flight is let end (a hang-up again, as a terminal may send,
    does not cut it off), its cell recorded deployed, and the sweep exits 129. Before the fix
    SIGHUP ended rgt at once: the held deploy's ssh ran on, its cell never recorded."""
    targets = [ssh_target(held.server), ssh_target(sshd)]
    with _swept(tmp_path, targets) as s:
        s.start("--interval", "0.5", group=True)
        _, cells = _first_held_then(
            s, held, lambda cells: any(c["state"] == "running" for c in cells.values()),
            "a cell deployed while the first box's deploy is held",
        )  # fmt: skip
        first = next(n for n, c in cells.items() if c["state"] == "pending")
        assert s.proc is not None
        s.proc.send_signal(signal.SIGHUP)  # by its PID
        wait(lambda: SAID_WAITS in s.stderr(), WAIT, "the sweep to say it waits", 0.2, s.stderr)
        s.proc.send_signal(signal.SIGHUP)
        kids = _descendants(s.proc.pid)
        assert s.proc.poll() is None and any(k.name() == "ssh" for k in kids), s.stderr()
        held.release()
        assert s.ended() == 129, s.stderr()
        cells = s.record()
        assert cells[first]["error"] is None, (cells, s.stderr())
        assert cells[first]["state"] == "running" and cells[first]["runs"] == [first], cells


@pytest.mark.timeout(900)
def test_a_sigterm_after_a_hangup_stops_the_deploys_children(
    tmp_path: Path, sshd: SshServer, held: Held
) -> None:
    """SIGHUP, then SIGTERM (a second ask, as a second Ctrl-C) while the sweep waits for the
    held deploy: the sweep exits 129 (its first signal) at once, and no process it started for
    that deploy is left running (each checked by its PID)."""
    targets = [ssh_target(held.server), ssh_target(sshd)]
    with _swept(tmp_path, targets) as s:
        s.start("--interval", "0.5", group=True)
        _first_held_then(
            s, held, lambda cells: any(c["state"] == "running" for c in cells.values()),
            "a cell deployed while the first box's deploy is held",
        )  # fmt: skip
        assert s.proc is not None
        s.proc.send_signal(signal.SIGHUP)
        wait(lambda: SAID_WAITS in s.stderr(), WAIT, "the sweep to say it waits", 0.2, s.stderr)
        kids = _descendants(s.proc.pid)
        assert any(k.name() == "ssh" for k in kids), (kids, s.stderr())
        s.proc.send_signal(signal.SIGTERM)
        assert s.ended() == 129, s.stderr()
        wait(lambda: all(_gone(k) for k in kids), 60, "the sweep's children to end", 0.2,
             lambda: [k for k in kids if not _gone(k)])  # fmt: skip
