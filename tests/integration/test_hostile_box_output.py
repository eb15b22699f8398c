"""What the box's commands print is untrusted on the laptop: `rgt status`, `rgt watch`,
`rgt logs`, `rgt stop`, `rgt doctor` and the audit and look of `rgt deploy`, against a box whose
agent, spec.json and tools print escape sequences, rich markup and numbers no reader of them
expects, end without a traceback and with none of those escape sequences on the terminal.

The box is ``local`` (this machine: the same scripts and readers an ssh box gets), its
``rgt-agent`` a script printing what the test planted, and its ``df``, ``nvidia-smi`` and
``python3`` the first found on a PATH the test puts in front (the rgt under test inherits it,
as the commands it runs on ``local`` do).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest

from controller.deploy import look
from controller.deploy.audit import audit
from controller.registry import Registry, RunRecord
from controller.remote import LocalRemote
from controller.target import Target

RUN = "r1"
# An OSC that sets the window title (click strips only CSI sequences off a pipe, not this) and
# rich markup that is no tag pair.
OSC = "\x1b]0;owned\x07"
MARKUP = "[/bold][link=https://example.invalid]x"

FAKE_AGENT = """#!/bin/sh
# rgt-agent as a hostile box has it: what the test planted next to it.
d=$(dirname "$0")
case $1 in
  status) exec cat "$d/status.json" ;;
  logs) printf 'the job said this\\n'; printf '\\033]0;owned\\007boom\\n' >&2; exit 3 ;;
  stop) printf 'stopped \\033]0;owned\\007\\n'; printf 'note \\033]0;owned\\007\\n' >&2 ;;
esac
"""


def _tool(bin_dir: Path, name: str, body: str) -> None:
    (bin_dir / name).write_text("#!/bin/sh\n" + body)
    (bin_dir / name).chmod(0o755)


@pytest.fixture
def box(tmp_path: Path, controller_env: Dict[str, str]) -> Path:
    """A local box whose agent prints a hostile status, and the run's record on the laptop;
    tools go in the returned PATH directory."""
    agent_dir = tmp_path / "agent"
    agent_dir.mkdir()
    _tool(agent_dir, "rgt-agent", FAKE_AGENT.split("\n", 1)[1])
    status = {
        "name": RUN,
        "state": f"RUNNING{MARKUP}{OSC}",
        "attempt": 2,
        "job_alive": True,
        "progress": {"step": f"7{OSC}", "time": 1.0, "metrics": {f"loss{MARKUP}": f"{OSC}"}},
        "last_exit": {"kind": f"crash{OSC}", "reason": f"{MARKUP}{OSC}"},
    }
    (agent_dir / "status.json").write_text(json.dumps(status) + "\n")
    home = tmp_path / "boxhome"
    (home / "runs" / RUN).mkdir(parents=True)
    sealed = {"kind": "sealed", "step": f"5{OSC}", "time": "2024-01-01T00:00:00Z"}
    event = {"kind": f"x{OSC}", "reason": f"{MARKUP}{OSC}", "time": "2024-01-01T00:00:00Z"}
    (home / "runs" / RUN / "events.jsonl").write_text(
        json.dumps(sealed) + "\n" + json.dumps(event) + "\n"
    )
    rec = RunRecord(
        RUN,
        Target("local"),
        profile="local",
        box_home=str(home),
        workdir=str(tmp_path),
        agent=[str(agent_dir / "rgt-agent")],
    )
    Registry().put(rec)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    return bin_dir


def _rgt(bin_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "rgt")
    argv = [exe] if os.path.exists(exe) else [sys.executable, "-m", "controller.cli"]
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")
    return subprocess.run(
        [*argv, *args], capture_output=True, text=True, timeout=120, env=env, cwd=bin_dir
    )


def _clean(p: subprocess.CompletedProcess[str]) -> str:
    out = p.stdout + p.stderr
    assert "Traceback" not in out, out
    assert "\x1b" not in out and "\x07" not in out, out
    return out


@pytest.mark.parametrize("args", [["status", RUN], ["watch", RUN, "--once"]])
def test_status_and_watch_show_the_box_words_without_escapes_or_markup(
    box: Path, args: List[str]
) -> None:
    """The agent's state, step, metrics and last exit, and the sealed step and events of the
    box's events.jsonl, reached the terminal raw; `rgt watch` read them as rich markup and
    ended in a MarkupError."""
    p = _rgt(box, *args)
    out = _clean(p)
    assert p.returncode == 0, out
    assert f"RUNNING{MARKUP}?]0;owned?" in out, out


@pytest.mark.parametrize(
    "tool,body",
    [
        ("df", "echo 'fs 100 \u00b2 50 50% /'\n"),  # a digit str.isdigit takes and int() not
        ("df", "echo 'fs 100 50 " + "9" * 5000 + " 1% /'\n"),  # past int()'s 4300 digits
        ("nvidia-smi", "echo '1.2.3, 5, 6'\n"),
        ("date", "echo '\u00b9\u00b2'\n"),
    ],
    ids=["df-superscript", "df-5000-digits", "gpu-two-dots", "date-superscript"],
)
def test_status_and_watch_of_numbers_the_box_garbles_are_no_traceback(
    box: Path, tool: str, body: str
) -> None:
    _tool(box, tool, body)
    for args in (["status", RUN], ["watch", RUN, "--once"]):
        p = _rgt(box, *args)
        _clean(p)
        assert p.returncode == 0, (args, p.stderr)


def test_logs_error_and_stop_carry_no_escape_sequence(box: Path) -> None:
    """`rgt logs` put the agent's stderr inside its one-line error raw; `rgt stop` wrote the
    agent's stdout and stderr through as they came."""
    p = _rgt(box, "logs", RUN)
    out = _clean(p)
    assert p.returncode == 1, out
    assert "rgt: rgt-agent logs failed on the box: ?]0;owned?boom" in p.stderr, out
    p = _rgt(box, "stop", RUN)
    out = _clean(p)
    assert "stopped ?]0;owned?" in p.stdout and "note ?]0;owned?" in p.stderr, out


def test_logs_follow_relays_the_box_stderr_without_escapes_and_fails_with_it(box: Path) -> None:
    """`rgt logs -f` let the box's stderr through to the terminal raw, and ended 0 when the
    agent's command failed (exit 3 here): now each line goes through printable, and the agent's
    failure is rgt's error (exit 1) naming what it said."""
    p = _rgt(box, "logs", RUN, "-f")
    out = _clean(p)
    assert "the job said this" in p.stdout, out
    assert "?]0;owned?boom" in p.stderr, out
    assert p.returncode == 1 and "rgt-agent logs -f failed on the box (exit 3)" in p.stderr, out


@pytest.mark.parametrize(
    "tool,body,shown",
    [
        ("python3", "echo '3.\u00b9\u00b2'\n", "is Python 3.\u00b9\u00b2; rgt's agent needs"),
        ("nvidia-smi", "printf '\\033]0;owned\\007H100, 550.1\\n'\n", "GPU(s): ?]0;owned?H100"),
    ],
    ids=["python-superscript", "gpu-name-escape"],
)
def test_doctor_of_a_box_whose_tools_print_garbage(
    box: Path, tool: str, body: str, shown: str
) -> None:
    """doctor's Python version read with str.isdigit (a traceback on "3.¹²"), and its findings
    (the GPU's name as nvidia-smi says it) printed raw."""
    _tool(box, tool, body)
    p = _rgt(box, "doctor", "local")
    out = _clean(p)
    assert shown in out, out


def test_the_deploy_audit_of_a_df_printing_a_superscript_is_no_traceback(
    box: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The audit of `rgt deploy` read df's free blocks with str.isdigit, then int()."""
    _tool(box, "df", "echo 'fs 100 50 \u00b2 1% /'\n")
    monkeypatch.setenv("PATH", f"{box}:{os.environ['PATH']}")
    found = audit(LocalRemote(), python=sys.executable, box_home=str(tmp_path / "home")).findings
    assert not any("free at" in f.what for f in found), found


# A line a reader of the box's sections takes for a number: more digits than int() reads.
DIGITS = "9" * 5000


def test_a_spec_forging_the_version_section_is_no_traceback(box: Path) -> None:
    """Deploy's look at the run's agent ends with the box's spec.json, whose lines can start
    sections of their own: "@@version-rc" and 5000 digits ended `rgt deploy` in a traceback.
    Now that agent does not answer the version (and is installed anew)."""
    rec = Registry().get(RUN)
    Path(rec.box_home, "runs", RUN, "spec.json").write_text(f"@@version-rc\n{DIGITS}\n")
    assert look.look(LocalRemote(), rec, version="1.0") == (False, None)


def test_slurm_stop_and_logs_carry_no_escape_sequence(box: Path, tmp_path: Path) -> None:
    """`rgt stop` of a Slurm run wrote the login node's agent's stdout and stderr through as
    they came. The login node is ``local`` with an ``scontrol`` of the test's: the job runs at
    the first look, and Slurm no longer knows it after (the stop then cancels nothing)."""
    reg = Registry()
    rec = reg.get(RUN)
    rec.scheduler = {"kind": "slurm", "job": "123"}
    reg.put(rec)
    batch = tmp_path / "slurm-123.out"
    batch.write_bytes(b"batch says \x1b]0;owned\x07hi\n")
    count = tmp_path / "scontrol.count"
    _tool(
        box,
        "scontrol",
        f'[ -f {count} ] && {{ echo "slurm_load_jobs error: Invalid job id specified"; exit 1; }}\n'
        f"touch {count}\n"
        f"echo 'JobId=123 JobName=rgt-{RUN} JobState=RUNNING Reason=None StdOut={batch}'\n",
    )
    p = _rgt(box, "stop", RUN)
    out = _clean(p)
    assert p.returncode == 0, out
    assert "stopped ?]0;owned?" in p.stdout and "note ?]0;owned?" in p.stderr, out
    count.unlink()
    p = _rgt(box, "logs", RUN)  # no agent made the run yet: the batch job's own output, raw
    assert p.returncode == 0, p.stderr
    assert "no agent of r1 has started yet (Slurm job 123 RUNNING)" in p.stderr, p.stderr
    assert p.stdout == "batch says \x1b]0;owned\x07hi\n"


def test_an_error_carrying_the_box_stderr_forges_no_line_of_rgt(box: Path) -> None:
    """`rgt logs` put the agent's stderr, line breaks and all, inside its error: a box printing
    "\\nrgt: all checkpoints verified" made a line the user takes for rgt's own. Now each line of
    the box's text after the first is under "  | ", and the box's words are all still there."""
    agent = Path(Registry().get(RUN).agent[0])
    agent.write_text(
        "#!/bin/sh\n"
        "printf 'ERROR: Could not install\\nrgt: all checkpoints verified\\nsee above\\n' >&2\n"
        "exit 3\n"
    )
    p = _rgt(box, "logs", RUN)
    _clean(p)
    assert p.returncode == 1, p.stderr
    lines = p.stderr.splitlines()
    assert [ln for ln in lines if ln.startswith("rgt:")] == [
        "rgt: rgt-agent logs failed on the box: ERROR: Could not install"
    ], p.stderr
    assert lines[1:] == ["  | rgt: all checkpoints verified", "  | see above"], p.stderr


def test_logs_follow_quotes_the_box_stderr_so_it_forges_no_line_of_rgt(box: Path) -> None:
    """`rgt logs -f` relayed the box's stderr at the margin: a box printing "rgt: all
    checkpoints verified" there made a line the user takes for rgt's own. Each relayed line is
    now under "  | ", as the box's text in an error is."""
    agent = Path(Registry().get(RUN).agent[0])
    agent.write_text(
        "#!/bin/sh\n"
        "printf 'the job said this\\n'\n"
        "printf 'rgt: all checkpoints verified\\nConnection closed\\n' >&2\n"
    )
    p = _rgt(box, "logs", RUN, "-f")
    _clean(p)
    assert p.returncode == 0, p.stderr
    assert "the job said this" in p.stdout
    assert p.stderr.splitlines() == [
        "  | rgt: all checkpoints verified",
        "  | Connection closed",
    ], p.stderr


NO_RUN = "#!/bin/sh\necho \"rgt: no run named 'r1' on this box\" >&2\nexit 8\n"


@pytest.mark.parametrize("follow", [[], ["-f"]], ids=["logs", "logs-f"])
@pytest.mark.parametrize("slurm", [False, True], ids=["ssh", "slurm"])
def test_logs_of_a_run_the_agent_does_not_know_exit_8_on_every_platform(
    box: Path, tmp_path: Path, slurm: bool, follow: List[str]
) -> None:
    """The agent's `logs` failing with NotFound (exit 8: its run directory gone) made `rgt logs`
    exit 1; for a Slurm run after a look at scontrol and one at the spec. Now it exits 8 with
    the agent's words, and a Slurm run whose agent made the run asks the login node once: the
    agent's logs (scontrol is not asked)."""
    reg = Registry()
    rec = reg.get(RUN)
    Path(rec.agent[0]).write_text(NO_RUN)
    Path(rec.box_home, "runs", RUN, "spec.json").write_text("{}\n")
    asked = tmp_path / "scontrol.asked"
    if slurm:
        rec.scheduler = {"kind": "slurm", "job": "123"}
        reg.put(rec)
        _tool(box, "scontrol", f"echo asked >> {asked}\necho 'JobId=123 JobState=RUNNING'\n")
    p = _rgt(box, "logs", RUN, *follow)
    _clean(p)
    assert p.returncode == 8, p.stderr
    assert "no run named 'r1' on this box" in p.stderr, p.stderr
    assert not asked.exists()
