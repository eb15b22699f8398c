"""What the user sees of a failed `rgt-agent start` over a real ssh (controller/deploy/boxstart.py
``start_on_box``): the box's stderr is relayed as it comes, and the box's last words are on the
terminal exactly once, whoever fails.

- the start fails with no ``rgt:`` line (the agent's program gone: ``env: ...: No such file``):
  the relayed line is the only copy, and rgt's error says it is above and what to do;
- the release directory is gone (the start's ``cd``): one line, exit 8, what to do;
- a start that exits with one of rgt's codes (2 usage, 5 held, 13 preempted) but without rgt's
  own error line (Python's "can't open file" exits 2) is the box's failure, exit 9 naming the
  code, never rgt's meaning of that number; one with rgt's error line keeps its code;
- ssh itself fails (the box's sshd killed mid-command) after the box said an ``rgt:`` line that
  the relay holds back for the start's own error: that line is shown, above "cannot reach".

Each test has its own sshd (tests/sshd.py) on loopback; the box is this machine.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from typing import Iterator, List, Tuple

import pytest

from controller import capture
from controller.deploy.boxstart import start_on_box
from controller.registry import Registry, RunRecord
from controller.remote import SshRemote
from controller.target import Target
from onbox.common.errors import HostError, RemoteUnreachable, RgtError
from tests.sshd import SshServer, start_sshd


@pytest.fixture
def box(
    tmp_path: Path, controller_env: object
) -> Iterator[Tuple[SshServer, SshRemote, Registry, RunRecord]]:
    """(the sshd, a remote on it, the laptop's registry, a run record on the box)."""
    server = start_sshd(str(tmp_path / "sshd"))
    target = Target(
        "ssh", host=server.host, user=server.user, port=server.port, identity=server.client_key
    )
    remote = SshRemote(target)
    rec = RunRecord("said", target, box_home=str(tmp_path / "box"))
    try:
        yield server, remote, Registry(), rec
    finally:
        remote.close()
        server.stop()


def _start(
    box: Tuple[SshServer, SshRemote, Registry, RunRecord], argv: List[str], path: str
) -> RgtError:
    _, remote, registry, rec = box
    with pytest.raises(RgtError) as info:
        start_on_box(remote, registry, rec, remote.target.label, argv, path)
    return info.value


def test_a_start_that_fails_without_an_rgt_line_is_said_once_with_what_to_do(
    box: Tuple[SshServer, SshRemote, Registry, RunRecord],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Before: the box's line was relayed, then said again as rgt's error."""
    capsys.readouterr()
    e = _start(box, ["env", "RGT_X=1", "/nonexistent/bin/rgt-agent", "start"], str(tmp_path))
    relayed = capsys.readouterr().err
    seen = relayed + e.line()
    assert seen.count("/nonexistent/bin/rgt-agent") == 1, seen
    assert "  | env: '/nonexistent/bin/rgt-agent': No such file or directory" in relayed, seen
    assert e.what.startswith(f"rgt-agent start failed on {box[1].target.label} (exit 127)"), seen
    assert "above" in e.what, seen
    assert "rgt deploy" in (e.remedy or ""), seen


def test_a_start_whose_release_is_gone_says_so_once_with_what_to_do(
    box: Tuple[SshServer, SshRemote, Registry, RunRecord],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Before: "rgt-agent start failed ... (exit 9): 1: cd: can't cd to ..." (sh's own words,
    the sh's $0 taken for rgt's prefix), with no remedy."""
    gone = str(tmp_path / "releases" / "gone")
    capsys.readouterr()
    e = _start(box, ["true"], gone)
    seen = capsys.readouterr().err + e.line()
    assert seen.count(gone) == 1, seen
    assert e.exit_code == 8, seen
    assert "rgt deploy" in seen, seen


@pytest.mark.parametrize(
    "argv, rc",
    [
        ([sys.executable, "/nonexistent/rgt-agent.py", "start"], 2),  # "can't open file", on stderr
        (["sh", "-c", "echo 'usage: not rgt'; exit 2"], 2),  # said on stdout alone
        (["sh", "-c", "echo 'held?' >&2; exit 5"], 5),
        (["sh", "-c", "echo 'killed?' >&2; exit 13"], 13),
    ],
)
def test_an_exit_without_rgts_error_line_is_the_boxs_whatever_its_number(
    box: Tuple[SshServer, SshRemote, Registry, RunRecord],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    argv: List[str],
    rc: int,
) -> None:
    """Before: its code was passed on as rgt's: exit 2 a usage error of the user's, 5 "another
    agent is supervising the run", 13 "the box was preempted ... the run is PREEMPTED"."""
    capsys.readouterr()
    e = _start(box, argv, str(tmp_path))
    seen = capsys.readouterr().err + e.line()
    assert isinstance(e, HostError) and e.exit_code == 9, seen
    assert e.what.startswith(f"rgt-agent start failed on {box[1].target.label} (exit {rc})"), seen
    assert "without an error of rgt's" in e.what, seen
    assert "PREEMPTED" not in seen and "another agent" not in seen, seen
    assert "rgt deploy" in (e.remedy or ""), seen
    assert box[3].name not in [r.name for r in box[2].all()], "a run never started was recorded"


def test_an_exit_with_rgts_error_line_keeps_its_code(
    box: Tuple[SshServer, SshRemote, Registry, RunRecord],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    script = "echo 'restoring' >&2; echo 'rgt: JOB.toml: command: not found' >&2; exit 2"
    capsys.readouterr()
    e = _start(box, ["sh", "-c", script], str(tmp_path))
    seen = capsys.readouterr().err + e.line()
    assert e.exit_code == 2, seen
    assert e.what.endswith("(exit 2): JOB.toml: command: not found"), seen
    assert seen.count("command: not found") == 1, seen


def test_a_held_box_line_is_shown_when_ssh_fails_after_it(
    box: Tuple[SshServer, SshRemote, Registry, RunRecord],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The box says an rgt error line (held back by the relay: a failed start's error says it)
    and then its connection is lost: ssh exits 255 and the error is "cannot reach", which does
    not say the box's line. Before: the line was dropped, and the user never saw it."""
    server = box[0]
    pidfile = tmp_path / "sleeper.pid"
    said = threading.Event()
    add = capture.LineRelay.add

    def add_and_tell(self: capture.LineRelay, data: bytes) -> None:
        add(self, data)
        if b"rgt: store: the box said this" in data:
            said.set()  # the line is on the laptop, held by the relay

    monkeypatch.setattr(capture.LineRelay, "add", add_and_tell)

    def cut() -> None:
        if said.wait(60):
            for pid in server.session_pids():  # this connection's sshd, by PID
                os.kill(pid, signal.SIGKILL)

    killer = threading.Thread(target=cut, daemon=True)
    killer.start()
    script = "printf 'rgt: store: the box said this\\n' >&2; echo $$ > \"$1\"; exec sleep 120"
    capsys.readouterr()
    try:
        e = _start(box, ["sh", "-c", script, "sh", str(pidfile)], str(tmp_path))
    finally:
        killer.join(60)
        if pidfile.exists():  # the box's sleep outlives its connection: end it by its PID
            try:
                os.kill(int(pidfile.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert said.is_set()
    err = capsys.readouterr().err
    assert isinstance(e, RemoteUnreachable), e.line()
    assert err.count("  | rgt: store: the box said this\n") == 1, err
