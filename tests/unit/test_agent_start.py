"""What ``rgt-agent`` imports before it does anything: `rgt deploy` and `rgt status` run
`rgt-agent status NAME --json --with-version` on the box (often more than once), and each start
pays for every module then, so what only some commands use is imported inside them
(onbox/cli.py). Each case runs in a fresh Python and lists what it imported; no time is
asserted (tests/unit/test_cli_start.py does the same for the laptop's `rgt`).

Installed from rgt's wheel, ``status NAME --json --with-version`` says the version that
``--version`` says without importing importlib.metadata (the email package, zipfile): it reads
its own install's METADATA."""

from __future__ import annotations

import importlib.metadata
import io
import json
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import pytest

from controller.deploy import wheel
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


def _imported(argv: Sequence[str], env: Dict[str, str], cwd: Optional[str] = None) -> List[str]:
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
        cwd=cwd,
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


def test_status_with_version_of_an_installed_agent_reads_its_own_metadata(
    cli: Cli, tmp_path: Path
) -> None:
    """The look of `rgt deploy` runs ``status NAME --json --with-version`` through the agent's
    install: the version comes from that install's METADATA, as --version's does, and the start
    goes without importlib.metadata (where no dist-info is beside onbox, it asks that)."""
    cli("run", "--name", "r1", "--", sys.executable, "-c", "pass", timeout=60, check=True)
    site = tmp_path / "site"  # the wheel's files, as an install lays them out
    with zipfile.ZipFile(io.BytesIO(wheel.wheel_bytes("9.8.7rc1"))) as zf:
        zf.extractall(site)
    env = {**cli.env, "PYTHONPATH": str(site)}
    here = str(tmp_path)  # no onbox of the checkout on sys.path ("" comes first with -c)
    mods = _imported(["status", "r1", "--json", "--with-version"], env, cwd=here)
    assert "onbox.agent.observe" in mods  # the probe ran what it says
    assert "importlib.metadata" not in mods

    def agent(*args: str, e: Dict[str, str]) -> str:
        argv = [sys.executable, "-m", "onbox.cli", *args]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=e, cwd=here)
        assert r.returncode == 0, r.stderr
        return r.stdout

    assert agent("--version", e=env).split() == ["rgt-agent,", "version", "9.8.7rc1"]
    st = json.loads(agent("status", "r1", "--json", "--with-version", e=env))
    assert st["agent_version"] == "9.8.7rc1" and st["state"] == "SUCCEEDED"
    # The checkout (no dist-info beside it): importlib.metadata's answer, as before.
    st = json.loads(agent("status", "r1", "--json", "--with-version", e=cli.env))
    assert st["agent_version"] == importlib.metadata.version(wheel.DIST_NAME)
