"""Invariant I8, the canary: a job that prints its secret (as is, base64, URL-encoded, in JSON),
raises with it and exits non-zero leaves it in nothing rgt writes or uploads.

Real processes: `rgt-agent secrets` sets the canary, `rgt-agent start --store file://...` runs
the job under a real agent, and the laptop's real `rgt pull` brings the result home. Then every
byte of the run directory (but the job's own output.log, which is the job's and stays
unaltered), the store, `status --json`, `list --json`, `logs --agent`, an error line and the
pulled files are searched for the secrets in each encoding.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import urllib.parse
import uuid
from typing import Any, Dict, List, Tuple

from controller.pull import pull
from controller.registry import RunRecord
from controller.target import Target
from tests.conftest import ROOT, Cli, agent_exe

CANARY = f"rgt-canary-{uuid.uuid4()}"
# A second secret with characters that URL, base64 and JSON encodings all change.
CANARY_PW = f"pw {uuid.uuid4().hex[:12]}/+&=é\"'"

JOB = r"""
import base64, json, os, sys, urllib.parse
s, pw = os.environ["RGT_CANARY"], os.environ["RGT_CANARY_PW"]
print("step 1 token", s, flush=True)
print("b64", base64.b64encode(s.encode()).decode())
for pre in (b"", b"k", b"ke", b"key="):  # inside longer base64, at each alignment
    print("b64 inside", base64.b64encode(pre + s.encode() + b"!").decode())
    print("urlsafe inside", base64.urlsafe_b64encode(pre + pw.encode()).decode())
print("url", urllib.parse.quote(pw, safe=""), urllib.parse.quote_plus(pw), urllib.parse.quote(s))
print("json", json.dumps({"pw": pw, "s": s}))
print("not a secret: step 2 loss 0.5", flush=True)
if sys.argv[1] == "fail":
    print("step 3 pw", pw, file=sys.stderr, flush=True)
    raise RuntimeError("auth failed with token " + s + " and password " + pw)
"""


def _needles() -> List[Tuple[str, bytes]]:
    """(what, bytes) of each form of the two secrets a leak could take. Computed here, not
    with onbox.redact, so that the test does not share the redactor's idea of an encoding."""
    out = []
    for name, value in (("canary", CANARY), ("pw", CANARY_PW)):
        raw = value.encode()
        out.append((name, raw))
        out.append((f"{name} json", json.dumps(value)[1:-1].encode()))
        for form in (
            urllib.parse.quote(value, safe=""),
            urllib.parse.quote(value),
            urllib.parse.quote_plus(value),
        ):
            out.append((f"{name} url", form.encode()))
        for k in range(3):  # the middle of its base64 at each alignment (edges mix neighbours)
            for enc in (base64.b64encode, base64.urlsafe_b64encode):
                mid = enc(b"\0" * k + raw)[4:-4]
                out.append((f"{name} b64/{k}", mid))
    return out


def _hits(data: bytes) -> List[str]:
    return sorted({what for what, needle in _needles() if needle in data})


def _grep_tree(root: str, skip: Any = lambda path: False) -> Dict[str, List[str]]:
    found = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            if skip(path) or os.path.islink(path):
                continue
            with open(path, "rb") as f:
                hits = _hits(f.read())
            if hits:
                found[os.path.relpath(path, root)] = hits
    return found


def _set_secrets(cli: Cli, name: str) -> None:
    p = subprocess.run(
        [*agent_exe(), "secrets", name],
        input=json.dumps({"RGT_CANARY": CANARY, "RGT_CANARY_PW": CANARY_PW}),
        env=cli.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    assert _hits((p.stdout + p.stderr).encode()) == []


def _start(cli: Cli, tmp_path: Any, name: str, mode: str) -> Tuple[str, str]:
    """Start the job under a real agent with a file:// store; returns (store root, workdir)."""
    _set_secrets(cli, name)
    store = str(tmp_path / "durable")
    work = str(tmp_path / f"work-{name}")
    os.makedirs(store, exist_ok=True)
    os.makedirs(work)
    with open(os.path.join(work, "job.py"), "w") as f:
        f.write(JOB)
    toml = (
        f'name = "{name}"\ncommand = {json.dumps([sys.executable, "job.py", mode])}\n'
        f'store = "file://{store}"\n'
        '[restart]\nmax_error_restarts = 1\nstart_grace = "0.1s"\nbackoff_initial = "0.1s"\n'
    )
    with open(os.path.join(work, "job.toml"), "w") as f:
        f.write(toml)
    cli("start", os.path.join(work, "job.toml"), check=True, cwd=work)
    return store, work


def _assert_nothing_rgt_wrote_holds_it(cli: Cli, store: str, name: str) -> None:
    secrets_dir = os.path.join(cli.home, "secrets")
    run_dir = os.path.join(cli.home, "runs", name)
    logs = {os.path.join(run_dir, "attempts", a, "output.log") for a in os.listdir(
        os.path.join(run_dir, "attempts"))}  # fmt: skip

    # The job's own log is the job's: unaltered, it holds what the job printed.
    for log in logs:
        with open(log, "rb") as f:
            assert f"step 1 token {CANARY}".encode() in f.read()
    assert _grep_tree(cli.home, lambda p: p in logs or p.startswith(secrets_dir + os.sep)) == {}
    assert _grep_tree(store) == {}
    for args in (
        ["status", name, "--json"],
        ["status", name],
        ["list", "--json"],
        ["logs", name, "--agent"],
    ):
        p = cli(*args, check=True)
        assert _hits((p.stdout + p.stderr).encode()) == [], args
    # An error line that would quote the secret (a run named after it) is redacted too.
    p = cli("status", CANARY)
    assert p.returncode == 8 and "[redacted]" in p.stderr
    assert _hits((p.stdout + p.stderr).encode()) == []


def test_a_failing_job_that_raises_with_its_secret_leaks_it_nowhere(
    cli: Cli, tmp_path: Any
) -> None:
    store, _ = _start(cli, tmp_path, "canary-fail", "fail")
    st = cli.wait_state("canary-fail", "FAILED", timeout=90)
    assert st["attempt"] == 2  # the exit was classified, the job restarted once, then failed
    reason = st["last_exit"]["reason"]
    assert "RuntimeError: auth failed with token [redacted] and password [redacted]" in reason
    assert "last output:" in reason and "step 2 loss 0.5" in reason  # the rest is kept
    exits = [e for e in cli.events("canary-fail") if e["kind"] == "exit"]
    assert len(exits) == 2 and all("[redacted]" in e["reason"] for e in exits)
    assert st["warnings"] == []  # a failed run seals no logs
    cli.wait_for("canary-fail", lambda s: not s["agent"]["alive"], 30, "the agent to exit")
    _assert_nothing_rgt_wrote_holds_it(cli, store, "canary-fail")


def test_a_succeeding_job_that_printed_its_secret_gets_a_redacted_log_sealed_and_a_warning(
    cli: Cli, tmp_path: Any, controller_env: Dict[str, str]
) -> None:
    name = "canary-ok"
    store, _ = _start(cli, tmp_path, name, "ok")
    cli.wait_state(name, "SUCCEEDED", timeout=90)
    st = cli.wait_for(name, lambda s: not s["agent"]["alive"], 30, "the agent to exit")

    # status warns which log held which secret, never the value.
    [warn] = st["warnings"]
    assert warn["kind"] == "secret_in_log" and warn["attempt"] == 1
    assert warn["found"] == ["RGT_CANARY", "RGT_CANARY_PW"]
    assert warn["key"] == f"{name}/logs/attempt-0001.log"
    assert warn["log"] == os.path.join(cli.home, "runs", name, "attempts", "0001", "output.log")
    [ev] = [e for e in cli.events(name) if e["kind"] == "secret_in_log"]
    assert ev["class"] == "usage" and "redacted copy" in ev["reason"]

    # The store's copy of the log: redacted, the rest of it intact, marked so in DONE.json.
    with open(os.path.join(store, name, "logs", "attempt-0001.log"), "rb") as fb:
        sealed = fb.read()
    assert b"step 1 token [redacted]\n" in sealed and b"not a secret: step 2 loss 0.5" in sealed
    with open(os.path.join(store, name, "DONE.json")) as f:
        [log] = [e for e in json.load(f)["files"] if e["key"].endswith("attempt-0001.log")]
    assert log["redacted"] is True and log["size"] == len(sealed)
    # The mirrored state carries the warning to `rgt status` reading the store.
    with open(os.path.join(store, name, "state", "state.json")) as f:
        assert json.load(f)["warnings"] == st["warnings"]
    _assert_nothing_rgt_wrote_holds_it(cli, store, name)

    # The laptop's `rgt pull` (a local target: the store is readable from the laptop) brings
    # the redacted log, verified against DONE.json, and nothing else that holds the secret.
    rec = RunRecord(
        name,
        Target("local"),
        profile="local",
        store=f"file://{store}",
        box_home=cli.home,
        agent=agent_exe(),
    )
    dest = str(tmp_path / "pulled")
    receipt = pull(rec, dest, "auto")
    assert "logs/attempt-0001.log" in {f.path for f in receipt.files}
    with open(os.path.join(dest, "logs", "attempt-0001.log"), "rb") as fb:
        assert fb.read() == sealed
    assert _grep_tree(dest) == {}
    assert _grep_tree(controller_env["RGT_CONTROLLER_HOME"]) == {}


def test_the_shims_own_stderr_is_redacted_on_its_way_to_agent_log(cli: Cli, tmp_path: Any) -> None:
    """The shim's stdout and stderr are agent.log: a traceback of the shim that quotes a secret
    (here its run directory, for a run named after the canary) is redacted there, as the
    agent's own tracebacks are. A real shim, started as the runner starts it."""
    _set_secrets(cli, "canary-shim")  # every run's secrets are masked everywhere on the box
    name = CANARY  # a valid run name
    run_dir = os.path.join(cli.home, "runs", name)
    os.makedirs(os.path.join(run_dir, "attempts", "0001"))
    log = str(tmp_path / "agent.log")
    with open(log, "wb") as out:  # no launch.json: the shim dies with a traceback naming it
        p = subprocess.run(
            [sys.executable, "-m", "onbox.shim", run_dir, "1", "1"],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=cli.env,
            cwd=ROOT,
            timeout=60,
        )
    with open(log, "rb") as f:
        data = f.read()
    assert p.returncode == 1 and b"Traceback" in data, data
    assert b"runs/[redacted]/attempts/0001/launch.json" in data, data
    assert _hits(data) == []
