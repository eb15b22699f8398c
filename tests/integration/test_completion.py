"""Nothing lost at the edges of a run: a low disk and a successful end.

What a user relies on: when the checkpoint disk runs low, rgt deletes only local bytes the
store holds exactly (never the newest local state, never an in-place ``ckpt.pt`` that holds
a newer step than the one sealed under its name, never a file open for writing); and when the
job succeeds, every file it left in RGT_CKPT_DIR (``result.txt``, ``metrics.json``, any
format) and every declared output (job file ``outputs`` and ``--output``) is sealed and
verified before DONE.json, and comes back with ``rgt pull``; a declared output that is missing
is said in an event, in status and in the pull's output.

Real agents, real jobs, a real file:// store, a real small tmpfs for the low disk (mounted as
root; under CI a failure to mount fails the test), and the laptop's real ``rgt pull``.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from typing import Any, Dict, Iterator, List

import pytest

from controller.cli import main as rgt_main
from controller.registry import Registry, RunRecord
from controller.results.pull import pull
from controller.target import Target
from onbox.agent.completion import Completion
from onbox.agent.journal import MemoryJournal
from onbox.agent.spec import JobSpec
from onbox.common.rundir import RunDir
from onbox.sealing.epochs import take_epoch
from onbox.sealing.room import is_low
from onbox.sealing.sealer import Sealer
from onbox.sealing.stores import open_store
from tests.conftest import Cli, agent_exe, require
from tests.laptop import nesting

MiB = 1 << 20


def _tmpfs(path: str, size: str) -> bool:
    os.makedirs(path, exist_ok=True)
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path])
    return p.returncode == 0


@pytest.fixture
def small(tmp_path: Any) -> Iterator[str]:
    """An 8 MiB tmpfs: a checkpoint disk that really runs low."""
    path = str(tmp_path / "small")
    require(_tmpfs(path, "8m"), "root, to mount a small tmpfs")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path])


def _sealer(tmp_path: Any, ckpt_dir: str, events: List[Dict[str, Any]]) -> Sealer:
    os.makedirs(tmp_path / "durable", exist_ok=True)
    store = open_store("file://" + str(tmp_path / "durable"))
    s = Sealer(
        "r",
        ckpt_dir,
        store,
        str(tmp_path / "stage"),
        epoch=take_epoch(store, "r"),
        keep=10,
        event=lambda kind, reason, **kw: events.append(dict(kw, kind=kind, reason=reason)),
        state_path=str(tmp_path / "seq.json"),
    )
    s.load()
    return s


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:  # in place: same inode, truncated, rewritten (torch.save's way)
        f.write(data)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _fill_until_low(ckpt_dir: str, name: str = "filler.dat") -> None:
    """Grow a file (no checkpoint format: never sealed, never deleted) until under 5 % free."""
    with open(os.path.join(ckpt_dir, name), "ab") as f:
        while not is_low(ckpt_dir):
            f.write(b"\0" * (64 << 10))
            f.flush()


def test_a_low_disk_never_deletes_an_in_place_checkpoint_holding_the_newest_step(
    small: str, tmp_path: Any
) -> None:
    """ckpt.pt, rewritten in place, is one root for steps 0, 1, 2: every MANIFEST names it.
    Deleting it as the sealed copy of step 0 (what happened) deletes step 2, the newest state."""
    events: List[Dict[str, Any]] = []
    s = _sealer(tmp_path, small, events)
    ckpt = os.path.join(small, "ckpt.pt")
    _write(ckpt, os.urandom(MiB))
    _fill_until_low(small)
    for step in range(3):
        data = os.urandom(MiB)
        _write(ckpt, data)
        assert s.seal_pending() == 1  # sealed, then free_room ran with the disk low
        assert s.manifests[step]["files"][0]["sha256"] == _sha(data)
        with open(ckpt, "rb") as f:
            assert f.read() == data, f"the newest local state (step {step}) was deleted"
    assert is_low(small)
    for _ in range(3):  # the sealer asks again after each seal: one event, not a loop of them
        s.free_room()
    assert [e["kind"] for e in events].count("room_exhausted") == 1
    assert "freed_local" not in [e["kind"] for e in events]
    [stuck] = [e for e in events if e["kind"] == "room_exhausted"]
    assert stuck["klass"] == "permanent" and "df -i" in stuck["remedy"]
    # A remedy is printed inside one pair of parentheses: none of its own in it.
    assert nesting(stuck["remedy"]) == 0, stuck["remedy"]


def test_a_low_disk_deletes_only_bytes_sealed_exactly_and_reached_by_latest(
    small: str, tmp_path: Any
) -> None:
    """Four sealed checkpoints. step_1.pt was rewritten after it was sealed (its bytes are not
    the store's), step_2.pt is open for writing, step_4.pt is the newest: only step_3.pt, whose
    bytes are exactly the sealed ones, may go."""
    events: List[Dict[str, Any]] = []
    s = _sealer(tmp_path, small, events)
    blobs = {n: os.urandom(1536 << 10) for n in range(1, 5)}
    for n, data in blobs.items():
        _write(os.path.join(small, f"step_{n}.pt"), data)
    assert s.seal_pending() == 4 and not is_low(small)
    assert not [e for e in events if e["kind"] in ("freed_local", "room_exhausted")]
    rewritten = os.urandom(1536 << 10)
    _write(os.path.join(small, "step_1.pt"), rewritten)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; f = open(sys.argv[1], 'r+b'); sys.stdin.read()"]
        + [os.path.join(small, "step_2.pt")],
        stdin=subprocess.PIPE,
    )
    try:
        time.sleep(0.3)  # it has the file open
        _fill_until_low(small)
        freed = s.free_room()
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(10)
    assert sorted(os.listdir(small)) == ["filler.dat", "step_1.pt", "step_2.pt", "step_4.pt"]
    with open(os.path.join(small, "step_1.pt"), "rb") as f:
        assert f.read() == rewritten
    [ev] = [e for e in events if e["kind"] == "freed_local"]
    assert ev["step"] == 3 and ev["freed"] == freed == len(blobs[3])
    assert "step_3.pt" in ev["reason"] and f"{len(blobs[3])} bytes freed" in ev["reason"]
    # What went is in the store, byte for byte.
    [entry] = s.manifests[3]["files"]
    with open(os.path.join(str(tmp_path / "durable"), entry["key"]), "rb") as f:
        assert _sha(f.read()) == _sha(blobs[3]) == entry["sha256"]


# ---- completion

JOB = r"""
import json, os, sys
ck = os.environ["RGT_CKPT_DIR"]
with open(os.path.join(ck, "step_1.pt"), "wb") as f:
    f.write(b"weights " * 100)
with open(os.path.join(ck, "result.txt"), "w") as f:
    f.write("accuracy 0.93\n")
with open(os.path.join(ck, "metrics.json"), "w") as f:
    json.dump({"loss": 0.125}, f)
os.makedirs(os.path.join(ck, "eval"), exist_ok=True)
with open(os.path.join(ck, "eval", "preds.csv"), "w") as f:
    f.write("id,label\n1,cat\n")
with open(os.path.join(ck, ".scratch.tmp"), "w") as f:
    f.write("temporary: never sealed\n")
os.makedirs("out", exist_ok=True)
with open("out/table.csv", "w") as f:
    f.write("a,b\n")
with open("summary.md", "w") as f:
    f.write("# done\n")
print("finished", flush=True)
"""


def _job(tmp_path: Any, name: str, outputs: List[str]) -> str:
    root = str(tmp_path / "durable")
    os.makedirs(root, exist_ok=True)
    work = tmp_path / "work"
    work.mkdir()
    (work / "job.py").write_text(JOB)
    (work / "job.toml").write_text(
        f'name = "{name}"\ncommand = {json.dumps([sys.executable, "job.py"])}\n'
        f'outputs = {json.dumps(outputs)}\nstore = "file://{root}"\n'
    )
    return str(work)


def _done(root: str, run: str) -> Dict[str, Any]:
    with open(os.path.join(root, run, "DONE.json")) as f:
        doc: Dict[str, Any] = json.load(f)
    return doc


def _rec(name: str, root: str, cli: Cli) -> RunRecord:
    return RunRecord(
        name,
        Target("local"),
        profile="local",
        store=f"file://{root}",
        box_home=cli.home,
        agent=agent_exe(),
    )


def test_files_the_job_leaves_in_the_ckpt_dir_are_sealed_at_success_and_pulled(
    cli: Cli, tmp_path: Any, controller_env: Dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """result.txt, metrics.json and eval/preds.csv in RGT_CKPT_DIR were never sealed, so the
    pull brought the logs and not the result."""
    work = _job(tmp_path, "done1", ["out/", "summary.md"])
    root = str(tmp_path / "durable")
    os.makedirs(root, exist_ok=True)
    ckpt = str(tmp_path / "ckpt")
    cli("start", "job.toml", "--ckpt-dir", ckpt, check=True, cwd=work)
    cli.wait_state("done1", "SUCCEEDED", timeout=60)
    done = _done(root, "done1")
    by_path = {(e.get("root"), e["path"]): e for e in done["files"]}
    for rel in ("result.txt", "metrics.json", "eval/preds.csv"):
        e = by_path[("ckpt", rel)]
        with open(os.path.join(ckpt, rel), "rb") as f:
            data = f.read()
        with open(os.path.join(root, e["key"]), "rb") as f:  # sealed, and verified: same bytes
            assert f.read() == data and _sha(data) == e["sha256"]
    assert (None, "summary.md") in by_path and (None, "out/table.csv") in by_path
    assert ("ckpt", ".scratch.tmp") not in by_path and ("ckpt", "step_1.pt") not in by_path
    assert done["missing_outputs"] == [] and done["latest"] == 1
    assert not [e for e in cli.events("done1") if e["kind"] == "result_left_out"]

    rec = _rec("done1", root, cli)
    Registry().put(rec)
    dest = str(tmp_path / "dest")
    assert rgt_main(["pull", "done1", "--to", dest, "--from", "store"]) == 0
    said = capsys.readouterr().out
    assert "warning" not in said
    for rel, want in (
        ("checkpoints/result.txt", "accuracy 0.93\n"),
        ("checkpoints/metrics.json", '{"loss": 0.125}'),
        ("checkpoints/eval/preds.csv", "id,label\n1,cat\n"),
        ("checkpoints/step_1.pt", "weights " * 100),
        ("outputs/summary.md", "# done\n"),
        ("outputs/out/table.csv", "a,b\n"),
    ):
        with open(os.path.join(dest, rel)) as text:
            assert text.read() == want, rel
    assert not os.path.exists(os.path.join(dest, "checkpoints", ".scratch.tmp"))
    # From the box too (the store's documents, the box's bytes): the same files.
    receipt = pull(rec, str(tmp_path / "dest-box"), "box")
    assert "checkpoints/result.txt" in {f.path for f in receipt.files}


def test_a_missing_declared_output_is_an_event_a_status_line_and_a_pull_line(
    cli: Cli, tmp_path: Any, controller_env: Dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """`--output` (repeatable) adds to the job file's outputs; one that is missing when the
    job succeeds is said, and the rest is sealed."""
    work = _job(tmp_path, "done2", ["out/", "nowhere/"])
    root = str(tmp_path / "durable")
    os.makedirs(root, exist_ok=True)
    p = cli(
        "run", "job.toml", "--output", "summary.md", "--output", "missing.txt", "--output",
        "out/", cwd=work, timeout=120,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    done = _done(root, "done2")
    assert done["missing_outputs"] == ["nowhere/", "missing.txt"]
    sealed = {e["path"] for e in done["files"]}
    assert {"out/table.csv", "summary.md"} <= sealed  # the rest is sealed, out/ once
    assert [e["path"] for e in done["files"]].count("out/table.csv") == 1
    evs = [e for e in cli.events("done2") if e["kind"] == "output_missing"]
    assert [e["path"] for e in evs] == ["nowhere/", "missing.txt"]
    assert all(e["class"] == "usage" and "--output" in e["remedy"] for e in evs)
    assert "missing.txt does not exist" in evs[1]["reason"]

    lines = cli("status", "done2", check=True).stdout.splitlines()
    for out in ("missing.txt", "nowhere/"):
        [line] = [x for x in lines if f"declared output {out} did not exist" in x]
        assert line.split()[0] == "warning", line
    kinds = [w["kind"] for w in cli.status("done2")["warnings"]]
    assert kinds == ["output_missing", "output_missing"]

    rec = _rec("done2", root, cli)
    Registry().put(rec)
    capsys.readouterr()
    assert rgt_main(["status", "done2"]) == 0
    assert "warning: declared output missing.txt did not exist" in capsys.readouterr().out
    assert rgt_main(["pull", "done2", "--to", str(tmp_path / "dest"), "--from", "store"]) == 0
    said = capsys.readouterr().out
    assert "warning: declared output missing.txt was missing when the job succeeded" in said
    assert "warning: declared output nowhere/ was missing" in said


def test_a_crash_before_done_leaves_no_done_and_the_next_agent_finishes(
    cli: Cli, tmp_path: Any
) -> None:
    """Killed at finish.before_done (results sealed, DONE.json not yet written): no DONE.json
    claims anything; the next start of the run completes it, result included."""
    work = _job(tmp_path, "done3", ["out/"])
    root = str(tmp_path / "durable")
    os.makedirs(root, exist_ok=True)
    env = dict(cli.env, RGT_CRASH_AT="finish.before_done")
    p = subprocess.run(
        [*agent_exe(), "run", "job.toml"], env=env, cwd=work, capture_output=True, timeout=120
    )
    assert p.returncode == 137, p.stderr
    assert not os.path.exists(os.path.join(root, "done3", "DONE.json"))
    # Started again by name (the saved spec), with an output added on the way.
    cli("run", "--name", "done3", "--output", "summary.md", cwd=work, timeout=120)
    done = _done(root, "done3")
    listed = {(e.get("root"), e["path"]) for e in done["files"]}
    assert ("ckpt", "result.txt") in listed and (None, "summary.md") in listed
    for e in done["files"]:
        with open(os.path.join(root, e["key"]), "rb") as f:
            assert _sha(f.read()) == e["sha256"], e["key"]


@pytest.mark.parametrize("bad", ["/etc/passwd", "../up.txt", ""])
def test_output_flags_outside_the_workdir_are_refused_before_anything_starts(
    cli: Cli,
    tmp_path: Any,
    controller_env: Dict[str, str],
    capsys: pytest.CaptureFixture[str],
    bad: str,
) -> None:
    p = cli("start", "--name", "o1", "--output", bad, "--", sys.executable, "-c", "pass")
    assert p.returncode == 2 and "--output: must be a path relative to the workdir" in p.stderr
    assert not os.path.exists(os.path.join(cli.home, "runs", "o1"))
    code = rgt_main(["deploy", "local", "--name", "o1", "--output", bad, "--", "true"])
    err = capsys.readouterr().err
    assert code == 2 and "--output: must be a path relative to the workdir" in err, err


def test_deploy_passes_each_output_to_the_agent(
    cli: Cli,
    tmp_path: Any,
    controller_env: Dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`rgt deploy --output PATH` (repeatable) reaches the box's `rgt-agent start`: the run's
    spec holds both, the present one is sealed, the missing one is said by `rgt pull`."""
    monkeypatch.setenv("RGT_BOX_HOME", cli.home)
    root = str(tmp_path / "durable")
    os.makedirs(root)
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "job.py").write_text("open('res.txt', 'w').write('hi\\n')\nprint('go', flush=True)\n")
    code = rgt_main(
        ["deploy", "local", "--name", "dep1", "--python", sys.executable, "--project", str(proj),
         "--store", f"file://{root}", "--output", "res.txt", "--output", "gone.txt",
         "--", sys.executable, "job.py"]
    )  # fmt: skip
    assert code == 0, capsys.readouterr().err
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(root, "dep1", "DONE.json")):
        assert time.monotonic() < deadline, "no DONE.json"
        time.sleep(0.1)
    with open(os.path.join(cli.home, "runs", "dep1", "spec.json")) as f:
        assert json.load(f)["outputs"] == ["res.txt", "gone.txt"]
    done = _done(root, "dep1")
    assert "dep1/outputs/res.txt" in {e["key"] for e in done["files"]}
    assert done["missing_outputs"] == ["gone.txt"]
    capsys.readouterr()
    assert rgt_main(["pull", "dep1", "--to", str(tmp_path / "dest")]) == 0
    assert "warning: declared output gone.txt was missing" in capsys.readouterr().out
    with open(tmp_path / "dest" / "outputs" / "res.txt") as f:
        assert f.read() == "hi\n"


def test_a_missing_attempt_log_is_no_failure_and_an_output_that_is_no_file_is_the_jobs(
    tmp_path: Any,
) -> None:
    """seal_missing had class usage for every cause. An attempt whose job never started (its
    shim or launcher never opened the log: the attempt dir holds only launch.json) has no log
    to seal: nothing the user did, nothing lost (class null). A declared output that exists but
    is no regular file nor directory (a FIFO) is the job's to change (usage)."""
    rd = RunDir("r", home=str(tmp_path / "home"))
    os.makedirs(rd.attempt_dir(1))  # the job never started: no output.log
    os.makedirs(rd.attempt_dir(2))
    with open(rd.output_log(2), "w") as f:
        f.write("trained\n")
    work, ckpt = tmp_path / "work", tmp_path / "ckpt"
    work.mkdir()
    ckpt.mkdir()
    os.mkfifo(work / "pipe")
    spec = JobSpec("r", ("true",), str(work), str(ckpt), outputs=("pipe",))
    journal = MemoryJournal()
    sealer = _sealer(tmp_path, str(ckpt), journal.events)
    Completion(
        spec, rd, sealer.store, sealer, event=journal.event, warnings=[], mirror=lambda: None
    ).run()
    missing = [e for e in journal.events if e["kind"] == "seal_missing"]
    assert len(missing) == 2, journal.events
    by = {"/0001/output.log" in e["reason"]: e for e in missing}
    assert by[True]["class"] is None, missing  # the attempt's log
    assert by[False]["reason"].startswith("pipe ") and by[False]["class"] == "usage", missing
    done = _done(str(tmp_path / "durable"), "r")
    assert [e["path"] for e in done["files"]] == ["e1/attempt-0002.log"]
