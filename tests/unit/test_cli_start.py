"""What `rgt` imports before it does anything: every command (status, logs, pull, a deploy that
finds its run live) pays for each module then, so what only some commands use is imported
inside them (controller/cli.py, controller/deploy/flow.py). Each case runs in a fresh Python
and lists what it imported; no time is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import List, Sequence

import pytest

# Never at the start of any command: the stores' SDKs, a framework, and what only one command
# (a sweep, a Slurm deploy, observing a run, a pull) or the wheel's version (importlib.metadata,
# which brings the email package) needs.
NEVER = (
    "boto3",
    "botocore",
    "huggingface_hub",
    "torch",
    "controller.sweep.plan",
    "controller.sweep.run",
    "controller.slurm",
    "controller.observe",
    "controller.watch",
    "controller.results",
    "controller.smoke.walk",
    "onbox.sealing.restore",
    "onbox.sealing.stores",
    "importlib.metadata",
    "email",
)

# `rgt --help` and `rgt deploy --help` need only click and the commands' own modules: not the
# registry with the ssh layer, nor the deploy itself, nor the job file's checks.
HELP_NEVER = NEVER + (
    "controller.registry",
    "controller.remote",
    "controller.deploy",
    "onbox.agent",
)


def _imported(code: str) -> List[str]:
    """The modules a fresh Python has loaded after ``code`` (its stdout's last line)."""
    probe = code + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    r = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False
    )
    assert r.returncode == 0, r.stderr
    return list(json.loads(r.stdout.splitlines()[-1]))


def _offending(mods: Sequence[str], never: Sequence[str]) -> List[str]:
    return [m for m in mods if any(m == n or m.startswith(n + ".") for n in never)]


@pytest.mark.parametrize("argv", [["--help"], ["deploy", "--help"]])
def test_help_imports_no_command_body(argv: List[str]) -> None:
    mods = _imported(f"from controller.cli import main\nmain({argv!r})")
    assert "controller.cli" in mods  # the probe ran what it says
    assert _offending(mods, HELP_NEVER) == []


def test_deploy_start_imports_only_what_a_live_deploy_runs() -> None:
    """`rgt deploy`'s imports (controller.cli, then controller.deploy.flow): none of a Slurm
    deploy's, the start's (a live run starts nothing), observing's or a sweep's."""
    mods = _imported("import controller.cli, controller.deploy.flow")
    assert "controller.deploy.flow" in mods
    assert _offending(mods, NEVER + ("controller.deploy.boxstart",)) == []


def test_status_start_imports_no_store() -> None:
    """`rgt status`, `watch`, `logs`, `stop` (controller.observe): the store's modules are read
    only when the box does not answer (observe.from_store)."""
    mods = _imported("import controller.cli, controller.observe")
    assert "controller.observe" in mods
    never = [n for n in NEVER if n != "controller.observe"]
    never += ["controller.runstore", "onbox.sealing"]
    assert _offending(mods, never) == []
