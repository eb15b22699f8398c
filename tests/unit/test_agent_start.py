"""What ``rgt-agent`` imports before it does anything: `rgt deploy` and `rgt status` run
`rgt-agent status NAME --json --with-version` on the box (often more than once), and each start
pays for every module then, so what only some commands use is imported inside them
(onbox/cli.py). Each case runs in a fresh Python and lists what it imported; no time is
asserted (tests/unit/test_cli_start.py does the same for the laptop's `rgt`)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Dict, List, Sequence

import pytest

from tests.conftest import Cli

# Never in the status start: the supervisor and what it spawns (subprocess), the job file's
# checks with the health configuration, the stores (and their thread pools), asking an agent to
# stop or seal, the Slurm helpers, and OpenSSL's hashes.
STATUS_NEVER = (
    "onbox.agent.claim",
    "onbox.agent.loop",
    "onbox.agent.daemon",
    "onbox.agent.detach",
    "onbox.agent.spec",
    "onbox.agent.mailbox",
    "onbox.agent.slurm",
    "onbox.agent.slurmlogin",
    "onbox.agent.catalog",
    "onbox.health",
    "onbox.sealing",
    "subprocess",
    "concurrent",
    "hashlib",
)

# What --version and --help need is click and the commands' declarations: not even the status.
VERSION_NEVER = STATUS_NEVER + ("onbox.agent.observe",)


def _imported(argv: Sequence[str], env: Dict[str, str]) -> List[str]:
    """The modules a fresh Python has loaded after ``rgt-agent ARGV`` exited 0 (its stdout's
    last line)."""
    probe = (
        "import json, sys\n"
        "from onbox.cli import main\n"
        f"code = main({list(argv)!r})\n"
        "print(json.dumps([code, sorted(sys.modules)]))"
    )
    r = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    code, mods = json.loads(r.stdout.splitlines()[-1])
    assert code == 0, r.stdout
    return list(mods)


def _offending(mods: Sequence[str], never: Sequence[str]) -> List[str]:
    return [m for m in mods if any(m == n or m.startswith(n + ".") for n in never)]


def test_status_json_imports_only_the_status(cli: Cli) -> None:
    """`rgt-agent status NAME --json` of a real run (one `rgt-agent run` that ended) reads it
    through onbox.agent.observe and imports nothing of the supervisor."""
    cli("run", "--name", "r1", "--", sys.executable, "-c", "pass", timeout=60, check=True)
    mods = _imported(["status", "r1", "--json"], cli.env)
    assert "onbox.agent.observe" in mods  # the probe ran what it says
    assert _offending(mods, STATUS_NEVER) == []


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["status", "--help"]])
def test_version_and_help_import_no_command_body(argv: List[str], cli: Cli) -> None:
    mods = _imported(argv, cli.env)
    assert "onbox.cli" in mods  # the probe ran what it says
    assert _offending(mods, VERSION_NEVER) == []
