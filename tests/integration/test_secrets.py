"""Secrets reach the job, and only the job, through `rgt-agent secrets` (stdin) and the 0600
file it writes: also after the agent is killed and started again by the shim, and after the
job restarts; never in an argv, a file of the run, a log, or the store."""

from __future__ import annotations

import hashlib
import os
import signal
import stat
import subprocess
import sys
from typing import Any

from tests.conftest import Cli, agent_exe
from tests.polling import wait_value

CANARY = "canary-" + os.urandom(8).hex()
JOB = """
import hashlib, os, sys, time
v = os.environ.get("RGT_TEST_SECRET")
print("attempt", os.environ["RGT_ATTEMPT"], "secret",
      hashlib.sha256(v.encode()).hexdigest() if v else "missing", flush=True)
if os.environ["RGT_ATTEMPT"] == "1":
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.05)
    sys.exit(3)
"""


def _grep_tree(root: str, needle: bytes) -> list[str]:
    hits = []
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            try:
                with open(path, "rb") as f:
                    if needle in f.read():
                        hits.append(path)
            except OSError:
                pass
    return hits


def _argv_hits(needle: bytes) -> list[int]:
    hits = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if needle in f.read():
                    hits.append(int(pid))
        except OSError:
            pass
    return hits


def test_a_secret_reaches_the_job_across_restarts_and_nowhere_else(cli: Cli, tmp_path: Any) -> None:
    p = subprocess.run(
        [*agent_exe(), "secrets", "sec"],
        input=f'{{"RGT_TEST_SECRET": "{CANARY}"}}',
        env=cli.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    assert CANARY not in p.stdout + p.stderr and "RGT_TEST_SECRET" in p.stdout
    secrets_file = os.path.join(cli.home, "secrets", "sec")
    assert stat.S_IMODE(os.stat(secrets_file).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(secrets_file)).st_mode) == 0o700

    store = str(tmp_path / "durable")
    os.makedirs(store)
    flag = str(tmp_path / "go")
    script = str(tmp_path / "job.py")
    with open(script, "w") as f:
        f.write(JOB)
    cli("start", "--name", "sec", "--store", "file://" + store, "--", sys.executable, script, flag,
        check=True)  # fmt: skip
    want = hashlib.sha256(CANARY.encode()).hexdigest()
    st = cli.wait_for("sec", lambda s: s["job_alive"], 30, "the job running")
    assert f"attempt 1 secret {want}" in _wait_log(cli, "attempt 1 secret")

    os.kill(st["agent"]["pid"], signal.SIGKILL)  # the shim starts a new agent
    cli.wait_for(
        "sec", lambda s: s["agent"]["alive"] and s["agent"]["pid"] != st["agent"]["pid"], 60,
        "a new agent",
    )  # fmt: skip
    open(flag, "w").close()  # attempt 1 fails; the new agent starts attempt 2
    cli.wait_state("sec", "SUCCEEDED", timeout=120)
    assert f"attempt 2 secret {want}" in cli("logs", "sec", check=True).stdout

    needle = CANARY.encode()
    assert _grep_tree(os.path.join(cli.home, "runs"), needle) == []
    assert _grep_tree(store, needle) == []
    assert _argv_hits(needle) == []
    assert _grep_tree(cli.home, needle) == [secrets_file]


def _wait_log(cli: Cli, text: str, timeout: float = 30) -> str:
    return wait_value(
        lambda: cli("logs", "sec", check=True).stdout,
        lambda out: text in out,
        timeout,
        f"{text!r} in the log",
        0.1,
        lambda out: repr(out[-2000:]),
    )


def test_secrets_on_stdin_must_be_a_json_object_of_strings(cli: Cli) -> None:
    for bad in ("not json", '["A"]', '{"A": 1}', '{"not a name": "x"}'):
        p = subprocess.run(
            [*agent_exe(), "secrets", "x"], input=bad, env=cli.env, capture_output=True,
            text=True, timeout=60,
        )  # fmt: skip
        assert p.returncode == 2 and "stdin" in p.stderr, (bad, p.stderr)
    assert not os.path.exists(os.path.join(cli.home, "secrets", "x"))
