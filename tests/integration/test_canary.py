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
from typing import Any, Dict, List, Optional, Tuple

import pytest

from controller import observe
from controller.registry import RunRecord
from controller.remote import open_remote
from controller.results.down import plan_down
from controller.results.pull import pull
from controller.target import Target
from onbox.agent.logredact import redact_box_logs
from onbox.common.durable import write_json
from onbox.common.errors import HostError
from onbox.common.rundir import RunDir
from onbox.sealing.stores.base import StoreError
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
os.makedirs("out", exist_ok=True)
with open("out/result.txt", "w") as f:
    f.write("loss 0.5\n")
"""


def _needles() -> List[Tuple[str, bytes]]:
    """(what, bytes) of each form of the two secrets a leak could take. Computed here, not
    with onbox.common.redact, so that the test does not share the redactor's idea of an encoding."""
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


def _start(
    cli: Cli, tmp_path: Any, name: str, mode: str, url: Optional[str] = "file"
) -> Tuple[str, str]:
    """Start the job under a real agent with a store: a file:// one by default, ``url``
    otherwise, none when ``url`` is None. Returns (the file:// store's root or "", workdir)."""
    _set_secrets(cli, name)
    store = ""
    if url == "file":
        store = str(tmp_path / "durable")
        os.makedirs(store, exist_ok=True)
        url = f"file://{store}"
    work = str(tmp_path / f"work-{name}")
    os.makedirs(work)
    with open(os.path.join(work, "job.py"), "w") as f:
        f.write(JOB)
    toml = (
        f'name = "{name}"\ncommand = {json.dumps([sys.executable, "job.py", mode])}\n'
        'outputs = ["out/"]\n'
        + (f"store = {json.dumps(url)}\n" if url else "")
        + '[restart]\nmax_error_restarts = 1\nstart_grace = "0.1s"\nbackoff_initial = "0.1s"\n'
    )
    with open(os.path.join(work, "job.toml"), "w") as f:
        f.write(toml)
    cli("start", os.path.join(work, "job.toml"), check=True, cwd=work)
    return store, work


def _assert_nothing_rgt_wrote_holds_it(cli: Cli, store: str, name: str) -> None:
    """``store``: a file:// store's root, or "" (none, or one checked by the caller)."""
    secrets_dir = os.path.join(cli.home, "secrets")
    run_dir = os.path.join(cli.home, "runs", name)
    logs = {os.path.join(run_dir, "attempts", a, "output.log") for a in os.listdir(
        os.path.join(run_dir, "attempts"))}  # fmt: skip

    # The job's own log is the job's: unaltered, it holds what the job printed.
    for log in logs:
        with open(log, "rb") as f:
            assert f"step 1 token {CANARY}".encode() in f.read()
    assert _grep_tree(cli.home, lambda p: p in logs or p.startswith(secrets_dir + os.sep)) == {}
    if store:
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
    st = cli.wait_for("canary-fail", lambda s: not s["agent"]["alive"], 30, "the agent to exit")
    # A failed run's logs are sealed as it ends (ENDED.json), each attempt's redacted, and
    # status warns of each, never with the value.
    assert sorted(w["attempt"] for w in st["warnings"]) == [1, 2], st["warnings"]
    assert all(w["kind"] == "secret_in_log" for w in st["warnings"])
    with open(os.path.join(store, "canary-fail", "ENDED.json")) as f:
        ended = json.load(f)
    assert ended["state"] == "FAILED" and all(e["redacted"] for e in ended["files"]), ended
    assert len(ended["files"]) == 2, ended
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
    assert warn["key"] == f"{name}/logs/e1/attempt-0001.log"
    assert warn["log"] == os.path.join(cli.home, "runs", name, "attempts", "0001", "output.log")
    [ev] = [e for e in cli.events(name) if e["kind"] == "secret_in_log"]
    assert ev["class"] == "usage" and "redacted copy" in ev["reason"]

    # The store's copy of the log: redacted, the rest of it intact, marked so in DONE.json.
    with open(os.path.join(store, name, "logs", "e1", "attempt-0001.log"), "rb") as fb:
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
    # `--from box` reads a file:// store on the box: the same redacted copy.
    for source in ("auto", "box"):
        dest = str(tmp_path / f"pulled-{source}")
        receipt = pull(rec, dest, source)
        [got] = [f for f in receipt.files if f.path == "logs/e1/attempt-0001.log"]
        assert got.redacted and got.source.endswith(f"{name}/logs/e1/attempt-0001.log")
        with open(os.path.join(dest, "logs", "e1", "attempt-0001.log"), "rb") as fb:
            assert fb.read() == sealed
        assert _grep_tree(dest) == {}
    assert _grep_tree(controller_env["RGT_CONTROLLER_HOME"]) == {}
    _assert_status_warns(cli, rec, ["the job's log of attempt 1 holds RGT_CANARY, RGT_CANARY_PW"])
    _assert_down_counts_logs_pulled_redacted(rec, controller_env, dest, [1])


def _assert_down_counts_logs_pulled_redacted(
    rec: RunRecord, controller_env: Dict[str, str], dest: str, attempts: List[int]
) -> None:
    """`rgt down`'s plan: the logs (whose box copies differ from what was pulled) are not
    "lost", they are "pulled redacted"."""
    box = open_remote(rec.target)
    try:
        plan = plan_down(rec, box, controller_env["RGT_CONTROLLER_HOME"])
    finally:
        box.close()
    assert not [x for x in plan.lost if "job log" in x], plan.lost
    assert [x for x in plan.kept if "pulled redacted" in x] == [
        f"job log of attempt {n}: pulled redacted (each secret masked) in {dest}" for n in attempts
    ]


def _assert_status_warns(cli: Cli, rec: RunRecord, want: List[str]) -> None:
    """`rgt-agent status` and `rgt status` (from the box, and from the store's mirror when
    there is one) print one warning line each, naming the secrets, never their values."""
    p = cli("status", rec.name, check=True)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("  warning    ")]
    assert len(lines) == len(want) and all(w in ln for w, ln in zip(want, lines)), p.stdout
    docs = [observe.snapshot(rec)] + ([observe.from_store(rec)] if rec.store else [])
    for doc in docs:
        text = observe.describe(doc, "a test")
        lines = [ln for ln in text.splitlines() if ln.startswith("  warning: ")]
        assert len(lines) == len(want) and all(w in ln for w, ln in zip(want, lines)), text
        assert _hits(text.encode()) == []


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
            [sys.executable, "-m", "onbox.agent.shim", run_dir, "1", "1"],
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


def _local_rec(cli: Cli, name: str, store: Optional[str]) -> RunRecord:
    return RunRecord(
        name, Target("local"), profile="local", store=store, box_home=cli.home, agent=agent_exe()
    )


def test_a_run_without_a_store_pulled_from_the_box_brings_its_logs_redacted(
    cli: Cli, tmp_path: Any, controller_env: Dict[str, str]
) -> None:
    """No store: the box's files are the result. When the run ends, the agent writes a redacted
    copy next to each log that holds a secret; `rgt pull --from box` takes that copy (marked
    redacted in the receipt), the box's own log stays unaltered, and `rgt down` counts the log
    as pulled (redacted), not lost."""
    name = "canary-nostore"
    _start(cli, tmp_path, name, "fail", url=None)
    st = cli.wait_state(name, "FAILED", timeout=90)
    assert st["attempt"] == 2
    rec = _local_rec(cli, name, None)
    dest = str(tmp_path / "pulled")
    receipt = pull(rec, dest, "box")  # waits for the agent to let go of the run

    attempts = os.path.join(cli.home, "runs", name, "attempts")
    st = cli.status(name)
    assert [w["attempt"] for w in st["warnings"]] == [1, 2]
    for n in (1, 2):
        raw = os.path.join(attempts, f"{n:04d}", "output.log")
        copy = os.path.join(attempts, f"{n:04d}", "output.redacted.log")
        w = st["warnings"][n - 1]
        assert w["kind"] == "secret_in_log" and w["log"] == raw and w["copy"] == copy
        assert w["found"] == ["RGT_CANARY", "RGT_CANARY_PW"]
        with open(raw, "rb") as fb:
            assert f"step 1 token {CANARY}".encode() in fb.read()  # the job's, unaltered
        [got] = [f for f in receipt.files if f.path == f"logs/attempt-{n:04d}.log"]
        assert got.redacted and got.source == copy
        with open(os.path.join(dest, got.path), "rb") as fb:
            pulled = fb.read()
        assert b"step 1 token [redacted]\n" in pulled and b"step 2 loss 0.5" in pulled
    assert not any(f.redacted for f in receipt.files if not f.path.startswith("logs/"))
    assert [e["kind"] for e in cli.events(name)].count("secret_in_log") == 2
    assert _grep_tree(dest) == {}
    assert _grep_tree(controller_env["RGT_CONTROLLER_HOME"]) == {}
    _assert_nothing_rgt_wrote_holds_it(cli, "", name)
    _assert_status_warns(cli, rec, [f"attempt {n} holds RGT_CANARY, RGT_CANARY_PW" for n in (1, 2)])

    # The receipt covers the box's files; down counts each log as pulled redacted, not lost.
    _assert_down_counts_logs_pulled_redacted(rec, controller_env, dest, [1, 2])

    # A copy the agent cannot write (a directory in the way of its temporary name, as real a
    # failure as a full disk): the warning says so, and the pull refuses that log instead of
    # bringing the raw one.
    rd = RunDir(name, cli.home)
    os.unlink(rd.redacted_log(2))
    os.mkdir(os.path.join(rd.attempt_dir(2), ".output.redacted.log.tmp"))
    warnings = list(st["warnings"])
    seen: List[Dict[str, Any]] = []
    assert redact_box_logs(
        rd, lambda kind, reason, **kw: seen.append(dict(kw, kind=kind)), warnings
    )
    assert warnings[0] == st["warnings"][0] and warnings[1]["copy"] is None
    assert "no redacted copy could be written" in warnings[1]["reason"]
    assert [e["kind"] for e in seen] == ["secret_in_log"] and seen[0]["klass"] == "usage"
    assert not os.path.exists(rd.redacted_log(2))
    with open(rd.state) as f:
        doc = json.load(f)
    write_json(rd.state, dict(doc, warnings=warnings))  # as the agent saves it
    again = str(tmp_path / "again")
    with pytest.raises(HostError) as info:
        pull(rec, again, "box")
    assert info.value.exit_code == 9
    assert "the job's log of attempt 2" in info.value.what and "rgt logs" in str(info.value.remedy)
    assert not os.path.exists(again)


def test_a_run_with_an_s3_store_pulled_from_the_box_takes_its_redacted_log_from_the_store(
    cli: Cli, tmp_path: Any, controller_env: Dict[str, str], s3_server: Any, monkeypatch: Any
) -> None:
    """s3:// and `--from box`: the bytes come from the box's own copies, but the box's log holds
    the secret and DONE.json has the sha256 of the store's redacted copy. That log comes from
    the store, verified; when the store cannot give it, the pull stops and says which log and
    why, and the box's raw log is not pulled in its place."""
    cli.env.update(s3_server.env(cli.env))
    for k, v in s3_server.env({}).items():
        monkeypatch.setenv(k, v)
    bucket = s3_server.bucket()
    url = f"s3://{bucket}/rgt"
    name = "canary-s3"
    _start(cli, tmp_path, name, "ok", url=url)
    cli.wait_state(name, "SUCCEEDED", timeout=90)
    st = cli.wait_for(name, lambda s: not s["agent"]["alive"], 30, "the agent to exit")
    assert [w["key"] for w in st["warnings"]] == [f"{name}/logs/e1/attempt-0001.log"]
    rec = _local_rec(cli, name, url)
    dest = str(tmp_path / "pulled")
    receipt = pull(rec, dest, "box")
    files = {f.path: f for f in receipt.files}
    assert set(files) == {"logs/e1/attempt-0001.log", "outputs/out/result.txt"}
    log = files["logs/e1/attempt-0001.log"]
    assert log.redacted and log.source == f"{name}/logs/e1/attempt-0001.log"  # the store's key
    out = files["outputs/out/result.txt"]
    assert not out.redacted and out.source.startswith("/")  # from the box, as asked
    client = s3_server.client()
    sealed = client.get_object(Bucket=bucket, Key=f"rgt/{name}/logs/e1/attempt-0001.log")["Body"]
    with open(os.path.join(dest, "logs", "e1", "attempt-0001.log"), "rb") as fb:
        assert fb.read() == sealed.read()
    assert _grep_tree(dest) == {}
    assert _grep_tree(controller_env["RGT_CONTROLLER_HOME"]) == {}
    for obj in client.list_objects_v2(Bucket=bucket, Prefix="rgt/")["Contents"]:
        body = client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
        assert _hits(body) == [], obj["Key"]
    _assert_nothing_rgt_wrote_holds_it(cli, "", name)

    # The store's copy is gone: the pull names the log and why, and puts nothing in place.
    client.delete_object(Bucket=bucket, Key=f"rgt/{name}/logs/e1/attempt-0001.log")
    again = str(tmp_path / "again")
    with pytest.raises(StoreError) as info:
        pull(rec, again, "box")
    msg = info.value.line()
    assert info.value.exit_code == 14
    assert f"logs/e1/attempt-0001.log is sealed as a redacted copy ({name}/logs/" in msg, msg
    assert "never pulls the box's raw log in its place" in msg, msg
    assert not os.path.exists(os.path.join(again, "logs"))
    assert not os.path.exists(os.path.join(again, ".rgt-receipt.json"))
    assert _grep_tree(again) == {}  # the staging area too: the raw log was never fetched
