"""The laptop is safe from what the box prints: a box whose commands print without end (a
runaway agent, a huge state document) or far more than a reader needs cannot make the laptop
hold it all. Each reader keeps a bound: a command past its cap is stopped (its process gone) and
the laptop says which command, the cap and what to do (HostError, exit 9); a reader of a
message keeps its tail (or a first line its head) and goes on; `rgt logs` streams the job's
bytes through as they come.

The box is ``local`` (the same readers an ssh box gets) and the test session's real sshd. The
rgt under test runs under an address-space limit (RLIMIT_AS) far below what keeping such output
would take, so a reader that keeps everything dies of MemoryError at once instead of filling
this machine; in-process readers are measured with tracemalloc (the bytes Python held at
peak).
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import IO, Any, Callable, Dict, Iterator, List, Tuple, Union

import pytest

from controller.capture import ERR_HEAD, ERR_TAIL
from controller.deploy import boxstart
from controller.observe import STOP_OUTPUT
from controller.registry import Registry, RunRecord
from controller.remote import MAX_OUTPUT, LocalRemote, SshRemote
from controller.report.data import MAX_BOX_BYTES
from controller.target import Target
from onbox.common.errors import HostError
from tests.sshd import SshServer

RUN = "r1"
Completed = subprocess.CompletedProcess[str]
AS_LIMIT = 1 << 30  # the rgt under test's address space: far below what endless output takes
BIG = 48 << 20  # a finite output far past a reader's need (safe to keep, for the "before" run)

# rgt-agent as a runaway box has it: each subcommand records its PID, then does what the test
# planted for it in a file named after it (sh code), next to the agent.
FAKE_AGENT = """#!/bin/sh
d=$(dirname "$0")
echo $$ > "$d/pid.$1"
. "$d/do.$1"
"""


@pytest.fixture
def agent(tmp_path: Path, controller_env: Dict[str, str]) -> Path:
    """The agent's directory; its run's record (on ``local``) is in the registry."""
    d = tmp_path / "agent"
    d.mkdir()
    (d / "rgt-agent").write_text(FAKE_AGENT)
    (d / "rgt-agent").chmod(0o755)
    home = tmp_path / "boxhome"
    (home / "runs" / RUN).mkdir(parents=True)
    _record(Target("local"), d, home)
    return d


def _record(target: Target, agent_dir: Path, home: Path) -> RunRecord:
    rec = RunRecord(
        RUN,
        target,
        profile="local",
        box_home=str(home),
        workdir=str(home),
        agent=[str(agent_dir / "rgt-agent")],
    )
    Registry().put(rec)
    return rec


def _does(agent_dir: Path, cmd: str, body: str) -> None:
    (agent_dir / f"do.{cmd}").write_text(body)


def _as_limit() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))


def _rgt(*args: str, stdout: Union[int, IO[str]] = subprocess.PIPE) -> Completed:
    """rgt as a real process under AS_LIMIT, bounded well below the readers' own timeouts."""
    exe = os.path.join(os.path.dirname(sys.executable), "rgt")
    argv = [exe] if os.path.exists(exe) else [sys.executable, "-m", "controller.cli"]
    return subprocess.run(
        [*argv, *args],
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        timeout=50,
        preexec_fn=_as_limit,
    )


def _one_line(p: Completed) -> str:
    assert "Traceback" not in p.stderr and "MemoryError" not in p.stderr, p.stderr[-2000:]
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rgt: "), p.stderr[-2000:]
    return lines[0]


def _gone(pid_file: Path) -> bool:
    """Whether the process whose PID the fake agent recorded has ended (gone, or a zombie
    waiting for its reaper), waiting for up to 30 s: a killed ssh session's command ends once
    its sshd notices."""
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(params=["local", "ssh"])
def transport(request: pytest.FixtureRequest, agent: Path, tmp_path: Path) -> Iterator[str]:
    """The run's box: ``local``, or the session's sshd (the same machine, over ssh)."""
    if request.param == "ssh":
        server: SshServer = request.getfixturevalue("sshd")
        target = Target(
            "ssh", host="127.0.0.1", user=server.user, port=server.port, identity=server.client_key
        )
        _record(target, agent, tmp_path / "boxhome")
        yield "ssh"
        SshRemote(target).close()
    else:
        yield "local"


def test_status_of_an_agent_printing_forever_is_stopped_at_its_cap(
    agent: Path, transport: str
) -> None:
    """`rgt status` kept all the agent printed until its 60 s timeout: gigabytes, then the
    laptop's OOM killer. Now the reader stops at MAX_OUTPUT, kills the command (over ssh: its
    ssh, and the box's command goes with the session) and says so."""
    _does(agent, "status", 'exec yes \'{"name": "r1", "state": "RUNNING"}\'\n')
    p = _rgt("status", RUN)
    line = _one_line(p)
    assert p.returncode == HostError.exit_code, line
    assert f"printed more than {MAX_OUTPUT >> 20}.0 MiB on its standard output" in line, line
    assert f"the look at {RUN} (rgt-agent status, events.jsonl" in line, line  # the command
    assert "it was stopped" in line, line
    assert "look at what that command prints on the box" in line, line
    assert _gone(agent / "pid.status"), "the box's runaway command still runs"


def test_report_of_a_box_sending_endless_data_is_stopped_at_its_cap(agent: Path) -> None:
    """`rgt report` reads the health series and events in one document, with a larger cap."""
    _does(agent, "report-data", 'exec yes \'{"status": {}, "samples": [], "events": []}\'\n')
    p = _rgt("report", RUN, "--out", str(agent / "r.html"))
    line = _one_line(p)
    assert p.returncode == HostError.exit_code, line
    assert f"`rgt-agent report-data {RUN}` printed more than" in line, line
    assert f"{MAX_BOX_BYTES >> 20}.0 MiB" in line, line
    assert _gone(agent / "pid.report-data")
    assert not (agent / "r.html").exists()


def test_logs_streams_the_job_bytes_as_they_come(agent: Path) -> None:
    """`rgt logs` (not following) held the whole log until the agent ended, then wrote it: a
    log larger than the laptop's memory could not be read. The agent here prints its second
    line only once the first has reached the file `rgt logs` writes to."""
    out = agent / "out.log"
    _does(
        agent,
        "logs",
        f"printf 'first\\n'\ni=0\nuntil grep -q first '{out}'; do\n"
        "  i=$((i + 1)); [ $i -gt 400 ] && { echo 'never saw it' >&2; exit 7; }; sleep 0.05\n"
        "done\nprintf 'second \\033]0;raw\\007\\n'\n",
    )
    with open(out, "w") as f:
        p = _rgt("logs", RUN, stdout=f)
    assert p.returncode == 0, p.stderr[-2000:]
    assert out.read_bytes() == b"first\nsecond \x1b]0;raw\x07\n"  # the job's bytes, raw


def test_stop_keeps_the_tail_of_what_the_agent_prints(agent: Path) -> None:
    """`rgt stop` showed all the agent's stop printed; now its last STOP_OUTPUT bytes, and the
    stop runs to its end (its last line is there)."""
    _does(agent, "stop", f"head -c {BIG} /dev/zero | tr '\\0' x\nprintf '\\nstopped cleanly\\n'\n")
    p = _rgt("stop", RUN)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.endswith("x\nstopped cleanly\n")
    assert len(p.stdout) <= STOP_OUTPUT


def _peak(fn: Callable[[], object]) -> Tuple[Any, int]:
    """What ``fn`` returned (or raised) and the most bytes Python held meanwhile."""
    tracemalloc.start()
    try:
        try:
            got = fn()
        except Exception as e:  # noqa: BLE001 - the test looks at it
            got = e
        return got, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_reader_past_its_cap_holds_no_more_than_the_cap() -> None:
    """Remote.run kept everything a command printed before looking at it."""
    got, peak = _peak(lambda: LocalRemote().run(["head", "-c", str(BIG), "/dev/zero"]))
    assert isinstance(got, HostError), got
    assert "`head -c" in got.what and "printed more than 4.0 MiB" in got.what, got.what
    assert peak < MAX_OUTPUT + (4 << 20), peak


def test_stderr_keeps_its_head_and_tail_only() -> None:
    """A command's stderr was kept whole (a box's login shell or command talking without end
    on it); now its first and last bytes, which carry the why of a failure."""
    script = f"echo starts >&2; head -c {BIG} /dev/zero >&2; echo boom >&2; exit 3"
    got, peak = _peak(lambda: LocalRemote().run(["sh", "-c", script]))
    assert not isinstance(got, Exception), got
    assert got.rc == 3
    err: bytes = got.stderr
    assert err.startswith(b"starts\n") and err.endswith(b"\0boom\n")
    assert b"rgt dropped" in err and len(err) < ERR_HEAD + ERR_TAIL + 100
    assert peak < 4 << 20, peak


def test_deploy_reads_only_the_beginning_of_the_job_log_for_its_first_line(agent: Path) -> None:
    """`rgt deploy` waits for the job's first line: it read the whole log, again every half
    second, to show that line. (It reads the log of the attempt the status names.)"""
    _does(agent, "status", 'echo \'{"name": "r1", "state": "RUNNING", "attempt": 1}\'\n')
    said: List[str] = []
    rec = Registry().get(RUN)
    log = Path(rec.box_home, "runs", RUN, "attempts", "0001", "output.log")
    log.parent.mkdir(parents=True)
    with open(log, "wb") as f:
        f.write(b"step 1 loss 2.5\n")
        f.truncate(BIG)  # and then more, past what a first line needs
    got, peak = _peak(lambda: boxstart.wait_first_line(LocalRemote(), rec, "box", said.append))
    assert not isinstance(got, Exception), got
    assert said[0] == f"rgt: {RUN} is RUNNING; its first line: step 1 loss 2.5", said
    assert peak < 4 << 20, peak


def _tool(bin_dir: Path, name: str, body: str) -> None:
    (bin_dir / name).write_text("#!/bin/sh\n" + body)
    (bin_dir / name).chmod(0o755)


# The box's side of a transfer talking without end on stderr (its rsync's messages, its login
# shell), then failing: what the laptop kept of it was everything.
NOISY = f"head -c {BIG} /dev/zero >&2; echo 'rsync error: boom (code 12)' >&2; exit 12\n"


@pytest.mark.parametrize("step", ["pull-rsync", "push-rsync", "push-tar"])
def test_a_transfer_keeps_only_a_bounded_tail_of_the_box_stderr(
    step: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from controller.deploy import release
    from controller.results import transport

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # tar reads its archive to the end (as the box's does) while it talks.
    _tool(bin_dir, "rsync", NOISY)
    _tool(bin_dir, "tar", "cat >/dev/null &\n" + NOISY.replace("exit 12", "wait; exit 2"))
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("a\n")
    calls = {
        "pull-rsync": lambda: transport.fetch_rsync(
            LocalRemote(), str(src), [], str(src), None, lambda e, sha256=None: None
        ),
        "push-rsync": lambda: release._rsync(LocalRemote(), str(src), ["a.txt"], "/x", None, []),
        "push-tar": lambda: release._tar(LocalRemote(), str(src), ["a.txt"], "/x"),
    }
    got, peak = _peak(calls[step])
    assert isinstance(got, Exception) and "boom" in str(got), got
    assert peak < 4 << 20, peak
