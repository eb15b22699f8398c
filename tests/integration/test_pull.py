"""`rgt pull` with real stores, a real agent, real rsync and a real sshd on loopback.

What a user relies on: a pull puts on the laptop exactly the run's newest sealed state, every
file checked against its manifest and opened as its framework would, and says so in a receipt;
a damaged file anywhere (bit flip, truncation; in the store or on the box) stops the pull with
the file named, nothing under a final name and no receipt; a pull that is killed continues
where it stopped.

Sealed states are made by a real agent (with a job that writes a real torch checkpoint, a
safetensors file and outputs, and exits 0, so the agent writes DONE.json), or, where only the
store matters, by the real Sealer in this process.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest

from controller.cli import main as rgt_main
from controller.registry import Registry, RunRecord
from controller.remote import SshRemote
from controller.results.pull import covers_newest, pull, terminal_progress
from controller.results.receipt import load_receipt, load_state_receipt, receipt_path
from controller.target import Target, ssh_destination_args
from onbox.common.errors import IntegrityError, StoreError, UsageError
from onbox.sealing import manifest as mf
from onbox.sealing.epochs import take_epoch
from onbox.sealing.sealer import Sealer
from onbox.sealing.stores import open_store
from onbox.sealing.stores.base import Store
from tests.conftest import ROOT, Cli, agent_exe, require
from tests.laptop import nesting as _nesting
from tests.mounts import tmpfs
from tests.netns import Netns
from tests.polling import wait
from tests.relay import Relay
from tests.seaweed import SeaweedServer
from tests.sshd import SshServer

RUN = "r1"
HOSTILE = '-odd dir/we\'ird "name" $(touch pwned);\nx.txt'


def _torch_bytes(n: int = 64) -> bytes:
    """A real torch.save checkpoint (the train extra installs torch)."""
    try:
        import torch
    except ImportError:
        require(False, "torch (pip install -e '.[train]')")
    buf = io.BytesIO()
    torch.save({"w": torch.arange(n, dtype=torch.float32), "step": torch.tensor(7)}, buf)
    return buf.getvalue()


def _safetensors(n: int = 64) -> bytes:
    """A safetensors file, written by hand to the format: u64 header length, JSON, data."""
    data = struct.pack(f"<{n}f", *range(n))
    header = json.dumps(
        {
            "__metadata__": {"format": "pt"},
            "w": {"dtype": "F32", "shape": [n], "data_offsets": [0, len(data)]},
        }
    ).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + data


def _seal(base: str, store: Store, step: int, files: Dict[str, bytes], run: str = RUN) -> None:
    """Write a directory checkpoint step_STEP/ and seal it with the real Sealer."""
    ckpt = os.path.join(base, "ckpt")
    d = os.path.join(ckpt, f"step_{step}")
    for rel, data in files.items():
        path = os.path.join(d, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    with open(os.path.join(d, ".rgt-complete"), "w") as f:
        json.dump({"step": step}, f)
    sealer = Sealer(
        run,
        ckpt,
        store,
        os.path.join(base, "staging"),
        epoch=take_epoch(store, run),
        event=lambda *a, **k: None,
        state_path=os.path.join(base, "sealer.json"),
    )
    sealer.load()
    assert sealer.seal_pending() == 1
    assert sealer.latest == step


def _store(tmp_path: Any) -> Store:
    root = tmp_path / "store"
    root.mkdir(exist_ok=True)
    return open_store(f"file://{root}")


def _rec(store: Optional[str], box_home: str, target: Optional[Target] = None) -> RunRecord:
    return RunRecord(
        RUN,
        target or Target("local"),
        profile="local" if target is None else "generic-ssh",
        store=store,
        box_home=box_home,
        agent=agent_exe(),
    )


def _ssh_target(sshd: SshServer) -> Target:
    return Target("ssh", host="127.0.0.1", user=sshd.user, port=sshd.port, identity=sshd.client_key)


@pytest.fixture
def ssh_target(sshd: SshServer, laptop: str) -> Iterator[Target]:
    target = _ssh_target(sshd)
    yield target
    SshRemote(target).close()  # the control master ssh keeps for 60 s


def _finals(dest: str) -> List[str]:
    """Every file under a final name in ``dest`` (the temporary area left out)."""
    out = []
    for dirpath, dirnames, files in os.walk(dest):
        dirnames[:] = [d for d in dirnames if d != ".rgt-part"]
        out += [os.path.relpath(os.path.join(dirpath, f), dest) for f in files]
    return sorted(out)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _damage(path: str, how: str) -> None:
    data = bytearray(_read(path))
    if how == "flip":
        data[len(data) // 2] ^= 0x10
    else:
        data = data[: len(data) - 100]
    with open(path, "wb") as f:
        f.write(data)


def _store_file(store: Store, key: str) -> str:
    return os.path.join(store.url[len("file://") :], *key.split("/"))


def _object_key(store: Store, step: int, path: str) -> str:
    """The store key of ``path`` (relative to RGT_CKPT_DIR) of checkpoint ``step``: the one
    its MANIFEST names, whatever the sealer's key layout."""
    doc = json.loads(store.get_bytes(mf.manifest_key(RUN, step)) or b"")
    (key,) = [e["key"] for e in doc["files"] if e["path"] == path]
    return str(key)


def _object_file(store: Store, step: int, path: str) -> str:
    """Where the file:// store holds the bytes of ``path`` of checkpoint ``step``."""
    return _store_file(store, _object_key(store, step, path))


def _stage_of(store: Store, dest: str, step: int, path: str) -> str:
    """The staging directory of a pull into ``dest`` that holds ``path`` of ``step``: files
    are staged under their store keys."""
    return os.path.join(
        dest, ".rgt-part", *os.path.dirname(_object_key(store, step, path)).split("/")
    )


# ---- a real agent run


JOB = """
import json, os, shutil, sys, time
src, ckpt = sys.argv[1], os.environ["RGT_CKPT_DIR"]
d = os.path.join(ckpt, "step_7")
os.makedirs(d + ".tmp")
for name in os.listdir(src):
    shutil.copyfile(os.path.join(src, name), os.path.join(d + ".tmp", name))
with open(os.path.join(d + ".tmp", ".rgt-complete"), "w") as f:
    json.dump({"step": 7}, f)
os.rename(d + ".tmp", d)
os.makedirs("out", exist_ok=True)
with open("out/result.json", "w") as f:
    json.dump({"loss": 0.25}, f)
print("trained to step 7", flush=True)
while len(sys.argv) > 2 and not os.path.exists(sys.argv[2]):  # hold on until told to finish
    time.sleep(0.05)
"""


def _agent_run(
    cli: Cli, tmp_path: Any, store: Optional[str], while_running: Optional[Any] = None
) -> str:
    """A real agent run of JOB that ends SUCCEEDED; returns its workdir. ``while_running`` is
    called once the job has written everything and waits to be let finish."""
    work = tmp_path / "work"
    src = tmp_path / "src"
    work.mkdir()
    src.mkdir()
    (src / "model.pt").write_bytes(_torch_bytes())
    (src / "model.safetensors").write_bytes(_safetensors())
    (work / "job.py").write_text(JOB)
    go = tmp_path / "finish"
    argv = [sys.executable, "job.py", str(src)] + ([str(go)] if while_running else [])
    toml = f'name = {json.dumps(RUN)}\ncommand = {json.dumps(argv)}\noutputs = ["out/"]\n'
    (work / "job.toml").write_text(toml)
    args = ["start", str(work / "job.toml")] + (["--store", store] if store else [])
    cli(*args, check=True, cwd=str(work))
    if while_running is not None:
        wait(lambda: (work / "out" / "result.json").exists(), 60, "the job to write its output")
        while_running()
        go.write_text("")
    cli.wait_state(RUN, "SUCCEEDED", timeout=60)
    if store:
        done = os.path.join(store[len("file://") :], RUN, "DONE.json")
        wait(lambda: os.path.exists(done), 60, "DONE.json")
    return str(work)


def test_a_clean_pull_from_the_store_verifies_opens_everything_and_writes_the_receipt(
    cli: Cli, tmp_path: Any, laptop: str
) -> None:
    store = _store(tmp_path)
    work = _agent_run(cli, tmp_path, store.url)
    rec = _rec(store.url, cli.home)
    dest = str(tmp_path / "dest")
    seen: List[Any] = []
    receipt = pull(rec, dest, "store", progress=seen.append)

    want = {
        "checkpoints/step_7/.rgt-complete",
        "checkpoints/step_7/model.pt",
        "checkpoints/step_7/model.safetensors",
        "outputs/out/result.json",
        "logs/e1/attempt-0001.log",
    }
    assert {f.path for f in receipt.files} == want
    assert _finals(dest) == sorted(want | {".rgt-receipt.json"})
    assert not os.path.exists(os.path.join(dest, ".rgt-part"))
    src = tmp_path / "src"
    assert _read(os.path.join(dest, "checkpoints/step_7/model.pt")) == _read(str(src / "model.pt"))
    assert json.loads(_read(os.path.join(dest, "outputs/out/result.json"))) == {"loss": 0.25}
    assert b"trained to step 7" in _read(os.path.join(dest, "logs/e1/attempt-0001.log"))
    assert os.path.exists(os.path.join(work, "out/result.json"))

    how = {f.path: f.verified for f in receipt.files}
    assert how["checkpoints/step_7/model.pt"] == "sha256 + torch.load(weights_only=True)"
    assert how["checkpoints/step_7/model.safetensors"] == "sha256 + safetensors header"
    assert how["outputs/out/result.json"] == "sha256"
    assert receipt.sealed.step == 7 and receipt.sealed.done
    assert receipt.source == "store" and receipt.fetched_bytes == receipt.total_bytes()

    # The receipt is in dest and in the laptop's state, identical; it covers the newest state.
    assert load_receipt(receipt_path(dest)) == receipt
    assert load_state_receipt(RUN, laptop) == receipt
    manifest = _read(_store_file(store, mf.manifest_key(RUN, 7)))
    assert receipt.to_json()["sealed"]["manifest_sha256"] == _sha(manifest)
    assert covers_newest(rec, receipt)
    assert {p.phase for p in seen} == {"fetch", "verify", "done"}

    # A pulled file gone from dest: the receipt no longer covers anything.
    os.unlink(os.path.join(dest, "outputs/out/result.json"))
    cov = covers_newest(rec, receipt)
    assert not cov and "result.json" in cov.reason


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_a_run_without_a_store_pulls_its_box_files_once_it_has_ended(
    cli: Cli, tmp_path: Any, laptop: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rec = _rec(None, cli.home)
    dest = str(tmp_path / "dest")

    def refused_while_live() -> None:
        with pytest.raises(UsageError, match="is (STARTING|RUNNING) and has no store"):
            pull(rec, dest, "box")
        assert _finals(dest) == []

    _agent_run(cli, tmp_path, None, while_running=refused_while_live)
    receipt = pull(rec, dest, "auto")
    assert receipt.source == "box" and receipt.sealed.listing_sha256
    paths = {f.path for f in receipt.files}
    assert {
        "checkpoints/step_7/model.pt",
        "checkpoints/step_7/model.safetensors",
        "outputs/out/result.json",
        "logs/attempt-0001.log",
    } <= paths
    assert not any(".rgt-complete" in p for p in paths)  # hidden names are skipped
    how = {f.path: f.verified for f in receipt.files}
    assert how["checkpoints/step_7/model.pt"] == "sha256 + torch.load(weights_only=True)"
    assert covers_newest(rec, receipt)
    # `rgt pull` says what it pulled: the box's files, no step (it said "step None")
    Registry().put(rec)
    capsys.readouterr()
    assert rgt_main(["pull", RUN, "--to", str(tmp_path / "dest-cli")]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(f"{RUN}: the box's files (no store) pulled to "), first
    # A new file on the box: the receipt no longer covers the box's files.
    with open(os.path.join(cli.home, "runs", RUN, "ckpt", "step_9.pt"), "wb") as f:
        f.write(b"later")
    assert not covers_newest(rec, receipt)
    with pytest.raises(UsageError, match="has no store"):
        pull(rec, dest, "store")


# What a job leaves in its outputs under names the sealer skips in a checkpoint dir: hydra's
# config, a lock file, an editor's backup, temporary-named files. All are the job's results.
ODD_OUTPUTS = {
    ".hydra/config.yaml": b"lr: 0.1\n",
    ".hidden": b"dot",
    "run.lock": b"lock",
    "notes.txt~": b"backup",
    "eval.tmp": b"tmp",
    "shard.part": b"part",
    "sub/metrics.jsonl": b'{"loss": 0.5}\n',
}
ODD_JOB = """
import json, os, sys
ckpt = os.environ["RGT_CKPT_DIR"]
os.makedirs(ckpt, exist_ok=True)
with open(os.path.join(ckpt, "step_3.pt"), "wb") as f:
    f.write(b"weights")
with open(os.path.join(ckpt, ".step_4.pt.tmp"), "wb") as f:  # a torn write's leftover
    f.write(b"torn")
for rel, data in json.loads(sys.argv[1]).items():
    os.makedirs(os.path.dirname(os.path.join("out", rel)), exist_ok=True)
    with open(os.path.join("out", rel), "w") as f:
        f.write(data)
"""


def test_a_run_without_a_store_pulls_its_outputs_whole_hidden_and_temporary_names_too(
    cli: Cli, tmp_path: Any, laptop: str, ssh_target: Target
) -> None:
    """Before: the box's lister skipped hidden and temporary names in the outputs as in the
    checkpoint dir, so `out/.hydra/config.yaml` came back with a store (the completion seal
    takes the outputs whole) and was silently missing without one. The checkpoint dir's torn
    leftovers are still skipped. Over real ssh, by both transports."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "job.py").write_text(ODD_JOB)
    outputs = {k: v.decode() for k, v in ODD_OUTPUTS.items()}
    argv = [sys.executable, "job.py", json.dumps(outputs)]
    cli("run", "--name", RUN, "--output", "out/", "--", *argv, check=True, cwd=str(work))
    rec = _rec(None, cli.home, ssh_target)
    for transport in ["stream"] + (["rsync"] if shutil.which("rsync") else []):
        dest = str(tmp_path / f"dest-{transport}")
        receipt = pull(rec, dest, "box", transport=transport)
        paths = {f.path for f in receipt.files}
        want = {f"outputs/out/{rel}" for rel in ODD_OUTPUTS}
        assert {p for p in paths if p.startswith("outputs/")} == want, paths
        for rel, data in ODD_OUTPUTS.items():
            assert _read(os.path.join(dest, "outputs", "out", *rel.split("/"))) == data
        assert {p for p in paths if p.startswith("checkpoints/")} == {"checkpoints/step_3.pt"}
        assert covers_newest(rec, receipt)


# ---- damage, in the store and on the box


def _sealed_store(tmp_path: Any) -> Store:
    store = _store(tmp_path)
    _seal(
        str(tmp_path),
        store,
        5,
        {
            "model.safetensors": _safetensors(4096),
            "opt.bin": os.urandom(300_000),
            HOSTILE: b"a name from the hostile set arrives byte for byte",
        },
    )
    return store


def _assert_refused(
    rec: RunRecord, dest: str, source: str, name: str, laptop: str
) -> IntegrityError:
    with pytest.raises(IntegrityError) as info:
        pull(rec, dest, source)
    assert info.value.exit_code == 6
    assert name in info.value.what, info.value.what
    assert _finals(dest) == []  # nothing under a final name, no receipt
    assert load_state_receipt(RUN, laptop) is None
    return info.value


@pytest.mark.parametrize("how", ["flip", "truncate"])
@pytest.mark.parametrize("name", ["model.safetensors", "opt.bin"])
def test_a_damaged_file_in_the_store_is_caught(
    tmp_path: Any, laptop: str, how: str, name: str
) -> None:
    store = _sealed_store(tmp_path)
    _damage(_object_file(store, 5, f"step_5/{name}"), how)
    err = _assert_refused(
        _rec(store.url, str(tmp_path / "box")), str(tmp_path / "dest"), "store", name, laptop
    )
    # The CLI's line puts the remedy in one pair of parentheses: none of its own inside.
    assert "--from box or --from store" in err.line() and _nesting(err.line()) == 1, err.line()


@pytest.mark.parametrize("transport", ["rsync", "stream"])
def test_a_pull_from_the_box_over_ssh_verifies_and_catches_damage(
    tmp_path: Any, laptop: str, ssh_target: Target, transport: str
) -> None:
    require(transport != "rsync" or bool(shutil.which("rsync")), "rsync")
    store = _sealed_store(tmp_path)
    rec = _rec(store.url, str(tmp_path / "box"), ssh_target)
    good = pull(rec, str(tmp_path / "good"), "box", transport=transport)
    assert good.source == "box" and good.sealed.step == 5
    odd = os.path.join(str(tmp_path / "good"), "checkpoints", "step_5", *HOSTILE.split("/"))
    assert _read(odd).startswith(b"a name from the hostile set")
    assert not os.path.exists("pwned") and not os.path.exists(str(tmp_path / "pwned"))
    assert {f.verified for f in good.files} >= {"sha256 + safetensors header"}
    assert covers_newest(rec, good)

    for how in ("flip", "truncate"):
        path = _object_file(store, 5, "step_5/opt.bin")
        saved = _read(path)
        _damage(path, how)
        with pytest.raises(IntegrityError, match="opt.bin"):
            pull(rec, str(tmp_path / f"bad-{how}"), "box", transport=transport)
        assert _finals(str(tmp_path / f"bad-{how}")) == []
        with open(path, "wb") as f:
            f.write(saved)
    # The laptop's receipt is still the good pull's: a failed pull writes none.
    assert load_state_receipt(RUN, laptop) == good


def test_a_checkpoint_that_matches_its_manifest_but_will_not_open_is_caught(
    tmp_path: Any, laptop: str
) -> None:
    torch_bytes = _torch_bytes()
    store = _store(tmp_path)
    # The job itself wrote these damaged (the sha256 in the manifest is of the damaged bytes).
    _seal(str(tmp_path), store, 3, {"model.safetensors": _safetensors()[:-8]})
    rec = _rec(store.url, str(tmp_path / "box"))
    _assert_refused(rec, str(tmp_path / "d1"), "store", "not a valid safetensors file", laptop)
    _seal(str(tmp_path), store, 4, {"model.pt": torch_bytes[: len(torch_bytes) // 2]})
    _assert_refused(rec, str(tmp_path / "d2"), "store", "torch.load cannot open it", laptop)


# ---- killed halfway


def _pull_in_child(
    rec: RunRecord, dest: str, source: str, extra: str = ""
) -> subprocess.Popen[bytes]:
    code = (
        "import json, os, signal, sys\n"
        "from controller.results.pull import pull\n"
        "from controller.registry import RunRecord\n"
        "rec = RunRecord.from_json(json.loads(sys.argv[1]))\n"
        + extra
        + "pull(rec, sys.argv[2], sys.argv[3], **kw)\n"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code, json.dumps(rec.to_json()), dest, source],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its rsync and ssh die with it
    )


def test_a_pull_from_the_box_killed_halfway_resumes_and_sends_only_the_rest(
    tmp_path: Any, laptop: str, ssh_target: Target
) -> None:
    require(bool(shutil.which("rsync")), "rsync")
    store = _store(tmp_path)
    big, first = 128 << 20, 16 << 20
    _seal(
        str(tmp_path),
        store,
        9,
        {"a.bin": os.urandom(first), "model.bin": os.urandom(big), "z.txt": b"tail"},
    )
    rec = _rec(store.url, str(tmp_path / "box"), ssh_target)
    dest = str(tmp_path / "dest")
    stage = _stage_of(store, dest, 9, "step_9/a.bin")
    child = _pull_in_child(rec, dest, "box", "kw = {'bwlimit': 30000}\n")
    try:
        wait(
            lambda: (
                os.path.exists(os.path.join(stage, "model.bin"))
                and os.path.getsize(os.path.join(stage, "model.bin")) > big * 0.3
                or child.poll() is not None
            ),
            60,
            "the big file to be a third there",
        )
        assert child.poll() is None, child.stderr.read() if child.stderr else ""
        os.killpg(child.pid, signal.SIGKILL)
    finally:
        child.wait()
        if child.stderr:
            child.stderr.close()
    had = os.path.getsize(os.path.join(stage, "model.bin"))
    assert big * 0.3 < had < big
    assert os.path.getsize(os.path.join(stage, "a.bin")) == first
    assert _finals(dest) == []  # nothing is final before everything is verified

    receipt = pull(rec, dest, "box")
    assert {f.path for f in receipt.files} >= {"checkpoints/step_9/model.bin"}
    # Only the rest of the big file travelled again (rsync's own overhead is small); a.bin
    # (16 MiB, finished before the kill) did not.
    assert receipt.fetched_bytes < (big - had) + (4 << 20), (receipt.fetched_bytes, big - had)
    assert _read(os.path.join(dest, "checkpoints/step_9/z.txt")) == b"tail"
    assert os.path.getsize(os.path.join(dest, "checkpoints/step_9/model.bin")) == big
    assert not os.path.exists(os.path.join(dest, ".rgt-part"))


KILL_AFTER_FIRST = """
def kill_after_first(p):
    if p.phase == "fetch" and p.done == p.size and p.size > 1000:
        os.kill(os.getpid(), signal.SIGKILL)
kw = {"progress": kill_after_first}
"""


def test_a_pull_from_the_store_killed_halfway_does_not_download_finished_files_again(
    tmp_path: Any, laptop: str
) -> None:
    store = _store(tmp_path)
    files = {f"part-{i}.bin": os.urandom(8 << 20) for i in range(3)}
    _seal(str(tmp_path), store, 2, files)
    rec = _rec(store.url, str(tmp_path / "box"))
    dest = str(tmp_path / "dest")
    # One file at a time in the killed pull (a pull fetches several at once), so that which
    # files it finished before it died is known: part-0 whole, part-2 not begun.
    one_at_a_time = "import onbox.sealing.fetch as f\nf.FILES = 1\n"
    child = _pull_in_child(rec, dest, "store", one_at_a_time + KILL_AFTER_FIRST)
    assert child.wait(60) == -signal.SIGKILL
    if child.stderr:
        child.stderr.close()
    stage = _stage_of(store, dest, 2, "step_2/part-0.bin")
    sizes = {n: len(d) for n, d in files.items()}
    sizes[".rgt-complete"] = len(json.dumps({"step": 2}))
    done = [n for n in os.listdir(stage) if os.path.getsize(os.path.join(stage, n)) == sizes[n]]
    assert "part-0.bin" in done and "part-2.bin" not in done, os.listdir(stage)
    before = {n: os.stat(os.path.join(stage, n)) for n in done}
    assert _finals(dest) == []

    receipt = pull(rec, dest, "store")
    for n, st in before.items():
        after = os.stat(os.path.join(dest, "checkpoints", "step_2", n))
        assert (after.st_ino, after.st_mtime_ns) == (st.st_ino, st.st_mtime_ns)  # not rewritten
    assert receipt.fetched_bytes == receipt.total_bytes() - sum(sizes[n] for n in done)
    for n, data in files.items():
        assert _read(os.path.join(dest, "checkpoints", "step_2", n)) == data


def test_a_pull_from_the_store_killed_with_downloads_in_flight_resumes_whole(
    tmp_path: Any, laptop: str
) -> None:
    """Killed with several files half-downloaded at once: the next pull keeps what verifies
    (at least the file whose completion killed it), fetches the rest, and every file is whole."""
    store = _store(tmp_path)
    files = {f"part-{i}.bin": os.urandom((i + 1) << 22) for i in range(6)}
    _seal(str(tmp_path), store, 2, files)
    rec = _rec(store.url, str(tmp_path / "box"))
    dest = str(tmp_path / "dest")
    child = _pull_in_child(rec, dest, "store", KILL_AFTER_FIRST)
    assert child.wait(60) == -signal.SIGKILL
    if child.stderr:
        child.stderr.close()
    assert _finals(dest) == []

    receipt = pull(rec, dest, "store")
    assert receipt.fetched_bytes < receipt.total_bytes()  # what had verified was kept
    for n, data in files.items():
        assert _read(os.path.join(dest, "checkpoints", "step_2", n)) == data


# ---- S3


def _s3(s3_server: SeaweedServer, monkeypatch: pytest.MonkeyPatch) -> Tuple[str, Store]:
    """A fresh bucket of the test S3 server, this process's AWS_* set to reach it (as the
    laptop's pull reads them), and its store under the prefix rgt/."""
    for k, v in s3_server.env({}).items():
        monkeypatch.setenv(k, v)
    bucket = s3_server.bucket()
    return bucket, s3_server.store(bucket, "rgt")


# The pull in a child process with the S3 client's read timeout at an hour, so that only
# rgt's own handling can end a receive that stalls (botocore's is 60 s).
PATIENT_PULL = (
    "import json, sys\n"
    "from botocore.config import Config\n"
    "import onbox.sealing.stores.s3.core as core\n"
    "_config = core.config\n"
    "core.config = lambda **kw: _config(**kw).merge(Config(read_timeout=3600))\n"
    "from controller.registry import RunRecord\n"
    "from controller.results.pull import pull\n"
    "pull(RunRecord.from_json(json.loads(sys.argv[1])), sys.argv[2], 'store')\n"
)


def _staged_bytes(dest: str) -> int:
    part = os.path.join(dest, ".rgt-part")
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(part) for n in names)


# What the cut lands in: large files (4 x 24 MiB, ranged GETs), whose connections stall
# mid-body; many small ones (1,500 x 16 KiB), most of whose requests are then waiting for an
# answer whose headers never come; many "large" ones (400 x 64 KiB, with the size above which
# a file is fetched in ranges lowered to 32 KiB in the pull), each of which asks its size and
# ETag with a HEAD first, so that HEADs are among the requests the cut leaves waiting.
RANGED_FROM_32K = "import onbox.sealing.stores.s3.download as d\nd.WHOLE_MAX = 32 << 10\n"
CUT_SHAPES = {
    "mid-body": (4, 24 << 20, ""),
    "awaiting-answers": (1500, 16 << 10, ""),
    "awaiting-heads": (400, 64 << 10, RANGED_FROM_32K),
}


@pytest.mark.parametrize("shape", sorted(CUT_SHAPES))
def test_ctrl_c_ends_a_pull_from_s3_stalled_on_a_cut_network_at_once_and_it_resumes_whole(
    tmp_path: Any,
    laptop: str,
    s3_server: SeaweedServer,
    monkeypatch: pytest.MonkeyPatch,
    netns_sshd: Tuple[Netns, SshServer],
    shape: str,
) -> None:
    """The laptop's network goes away in the middle of a pull from S3 (for real: the pull runs
    in a network namespace whose link is cut, so its connections stall, mid-body or before the
    answer) and the user presses Ctrl-C. The pull ends then, interrupted, rather than when the
    S3 client's read timeout (an hour here) runs out; nothing is final. With the network back,
    the next pull brings every file whole."""
    ns, _ = netns_sshd
    bucket, store = _s3(s3_server, monkeypatch)
    count, size, prelude = CUT_SHAPES[shape]
    files = {f"part-{i}.bin": os.urandom(size) for i in range(count)}
    _seal(str(tmp_path), store, 3, files)
    rec = _rec(f"s3://{bucket}/rgt", str(tmp_path / "box"))
    dest = str(tmp_path / "dest")
    relay = Relay(ns.host_addr, ("127.0.0.1", s3_server.port))
    ns.limit_rate("40mbit")  # 96 MiB in ~20 s: the cut comes with every download in flight
    env = dict(os.environ, AWS_ENDPOINT_URL=f"http://{ns.host_addr}:{relay.port}")
    argv = [sys.executable, "-c", prelude + PATIENT_PULL, json.dumps(rec.to_json()), dest]
    child = subprocess.Popen(
        ns.exec_argv(argv),
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        wait(
            lambda: _staged_bytes(dest) > (8 << 20) or child.poll() is not None,
            60,
            "8 MiB of the pull to arrive",
        )
        assert child.poll() is None, child.stderr.read() if child.stderr else ""
        ns.link_down()
        try:

            def stalled() -> bool:  # nothing more arrives
                before = _staged_bytes(dest)
                time.sleep(1)
                return _staged_bytes(dest) == before

            wait(stalled, 60, "the pull to stall")
            child.send_signal(signal.SIGINT)
            try:
                rc = child.wait(timeout=60)
            except subprocess.TimeoutExpired:
                raise AssertionError("Ctrl-C did not end a pull stalled on the network") from None
        finally:
            ns.link_up()
        assert rc == -signal.SIGINT, (rc, child.stderr.read() if child.stderr else "")
        assert _finals(dest) == []
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
        if child.stderr:
            child.stderr.close()
        ns.unlimit_rate()
        relay.close()

    pull(rec, dest, "store")
    for n, data in files.items():
        assert _read(os.path.join(dest, "checkpoints", "step_3", n)) == data


def test_a_pull_from_s3_verifies_and_catches_a_damaged_object(
    tmp_path: Any, laptop: str, s3_server: SeaweedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket, store = _s3(s3_server, monkeypatch)
    _seal(str(tmp_path), store, 6, {"model.safetensors": _safetensors(1024), "x.bin": b"x" * 5000})
    rec = _rec(f"s3://{bucket}/rgt", str(tmp_path / "box"))
    receipt = pull(rec, str(tmp_path / "good"), "auto")
    assert receipt.source == "store" and receipt.sealed.step == 6
    assert covers_newest(rec, receipt)

    doc = json.loads(store.get_bytes(mf.manifest_key(RUN, 6)) or b"")
    (key,) = ["rgt/" + f["key"] for f in doc["files"] if f["path"] == "step_6/x.bin"]
    s3_server.client().put_object(Bucket=bucket, Key=key, Body=b"x" * 2499 + b"y" + b"x" * 2500)
    with pytest.raises(IntegrityError, match="x.bin"):
        pull(rec, str(tmp_path / "bad"), "store")
    assert _finals(str(tmp_path / "bad")) == []


def test_a_pull_of_many_objects_from_s3_fetches_them_all_and_fails_whole_on_a_missing_one(
    tmp_path: Any, laptop: str, s3_server: SeaweedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sharded checkpoint of 120 objects in nested directories, downloaded several at once:
    every file lands verified under its own name. With one object gone from the bucket, the
    pull fails naming it, and nothing is put in place and no receipt is written, whichever
    downloads were in flight when it failed."""
    bucket, store = _s3(s3_server, monkeypatch)
    files = {f"shard-{i // 40}/part-{i:03d}.bin": os.urandom(4096 + i) for i in range(120)}
    _seal(str(tmp_path), store, 3, files)
    rec = _rec(f"s3://{bucket}/rgt", str(tmp_path / "box"))

    receipt = pull(rec, str(tmp_path / "good"), "store")
    assert receipt.fetched_bytes == receipt.total_bytes() and receipt.sealed.step == 3
    for rel, data in files.items():
        assert _read(str(tmp_path / "good" / "checkpoints" / "step_3" / rel)) == data

    doc = json.loads(store.get_bytes(mf.manifest_key(RUN, 3)) or b"")
    (key,) = [f["key"] for f in doc["files"] if f["path"] == "step_3/shard-2/part-117.bin"]
    store.delete(key)
    with pytest.raises(StoreError, match="part-117"):
        pull(rec, str(tmp_path / "bad"), "store")
    assert _finals(str(tmp_path / "bad")) == []
    assert not os.path.exists(receipt_path(str(tmp_path / "bad")))


def test_an_object_larger_than_sealed_is_refused_before_it_fills_the_laptop(
    tmp_path: Any, laptop: str, s3_server: SeaweedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An object replaced in the store by 64 MiB where 5,000 bytes were sealed, pulled into a
    16 MiB filesystem: refused by the length the store answers, before its bytes, naming the
    file; nothing placed, no receipt, the filesystem not filled."""
    bucket, store = _s3(s3_server, monkeypatch)
    _seal(str(tmp_path), store, 6, {"model.safetensors": _safetensors(1024), "x.bin": b"x" * 5000})
    rec = _rec(f"s3://{bucket}/rgt", str(tmp_path / "box"))
    s3_server.client().put_object(
        Bucket=bucket, Key="rgt/" + _object_key(store, 6, "step_6/x.bin"), Body=os.urandom(64 << 20)
    )
    with tmpfs(str(tmp_path / "small"), "size=16m") as disk:
        dest = os.path.join(disk, "dest")
        with pytest.raises(IntegrityError) as info:
            pull(rec, dest, "store")
        assert (
            "step_6/x.bin" in info.value.what and "the MANIFEST says 5000 bytes" in info.value.what
        )
        assert info.value.exit_code == 6
        assert _finals(dest) == []
        assert load_state_receipt(RUN, laptop) is None
        st = os.statvfs(disk)
        assert (st.f_blocks - st.f_bfree) * st.f_frsize < 1 << 20, "the 64 MiB were received"


def test_progress_of_a_many_file_pull_adds_up_and_ends_at_the_total(
    tmp_path: Any, laptop: str
) -> None:
    """300 files fetched several at once: the fetch reports never go back, every file is
    reported whole, and the last report's total is every byte; off a terminal, a few lines,
    not one per small file."""
    store = _store(tmp_path)
    files = {f"d{i % 3}/f{i:03d}.bin": os.urandom(1000 + i) for i in range(300)}
    _seal(str(tmp_path), store, 4, files)
    reports: List[Any] = []
    receipt = pull(
        _rec(store.url, str(tmp_path / "box")), str(tmp_path / "d"), "store", reports.append
    )
    fetch = [p for p in reports if p.phase == "fetch"]
    totals = [p.total_done for p in fetch]
    assert totals == sorted(totals) and totals[-1] == fetch[-1].total == receipt.total_bytes()
    whole = {p.path for p in fetch if p.done == p.size}
    assert whole == {f"checkpoints/step_4/{rel}" for rel in files} | {
        "checkpoints/step_4/.rgt-complete"
    }
    out = io.StringIO()
    with terminal_progress(out) as show:
        pull(_rec(store.url, str(tmp_path / "box")), str(tmp_path / "d2"), "store", show)
    lines = out.getvalue().splitlines()
    assert lines[-1].startswith("rgt pull: done 100%") and len(lines) < 30, lines


def test_progress_is_plain_lines_off_a_terminal(tmp_path: Any, laptop: str) -> None:
    store = _sealed_store(tmp_path)
    out = io.StringIO()
    with terminal_progress(out) as show:
        pull(_rec(store.url, str(tmp_path / "box")), str(tmp_path / "dest"), "store", show)
    assert "rgt pull: done 100%" in out.getvalue()


@pytest.mark.parametrize("configured", [None, "aes256-ctr"], ids=["unset", "configured"])
def test_ssh_prefers_aes_gcm_unless_a_configuration_chooses_ciphers(
    ssh_target: Target,
    tmp_path: Any,
    monkeypatch: pytest.MonkeyPatch,
    configured: Optional[str],
) -> None:
    """A pull is bounded by ssh's cipher: with no Ciphers configured, rgt puts AES-GCM first
    (chacha20-poly1305, OpenSSH's default, costs three times the CPU per byte on a CPU with
    AES instructions); a user's own Ciphers line is obeyed. Read off what the real sshd and
    client negotiated."""
    if configured is not None:
        cfg = tmp_path / "ssh_config"
        cfg.write_text(f"Host *\n  Ciphers {configured}\n")
        monkeypatch.setenv("RGT_SSH_CONFIG", str(cfg))
    remote = SshRemote(ssh_target)
    # A connection of its own (ssh takes the first value of an option, so these come first),
    # verbose, to read the negotiation off.
    own = ["-o", "ControlMaster=no", "-o", "ControlPath=none", "-o", "LogLevel=DEBUG1"]
    p = subprocess.run(
        ["ssh", *remote.config_args, *own, *remote.options, *ssh_destination_args(ssh_target)]
        + ["true"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    negotiated = re.findall(r"kex: server->client cipher: (\S+)", p.stderr)
    with open("/proc/cpuinfo") as f:
        has_aes = " aes " in f.read().replace("\n", " ")
    want = configured or ("aes128-gcm@openssh.com" if has_aes else "chacha20-poly1305@openssh.com")
    assert negotiated == [want], p.stderr[-2000:]


# ---- names that share bytes, and empty files


@pytest.mark.parametrize(
    "source,transport", [("store", None), ("box", "rsync"), ("box", "stream")], ids=str
)
def test_identical_files_under_two_names_both_land_from_one_download(
    tmp_path: Any, laptop: str, ssh_target: Target, source: str, transport: Optional[str]
) -> None:
    """The sealer uploads identical files once (two MANIFEST entries, one key): the pull
    fetches the key once and puts a copy under the second name, staged like the first."""
    require(transport != "rsync" or bool(shutil.which("rsync")), "rsync")
    store = _store(tmp_path)
    same = os.urandom(50_000)
    _seal(str(tmp_path), store, 4, {"a.bin": same, "sub/b.bin": same, "c.bin": b"other"})
    keys = {
        f["key"]
        for f in mf.parse_manifest(_read(_store_file(store, mf.manifest_key(RUN, 4))))["files"]
    }
    assert len(keys) == 3  # a.bin and sub/b.bin share one key, with .rgt-complete and c.bin
    target = ssh_target if source == "box" else None
    rec = _rec(store.url, str(tmp_path / "box"), target)
    dest = str(tmp_path / "dest")
    receipt = pull(rec, dest, source, transport=transport)
    assert receipt.fetched_bytes < 2 * len(same)
    for name in ("a.bin", "sub/b.bin"):
        assert _read(os.path.join(dest, "checkpoints", "step_4", name)) == same
    assert not os.path.exists(os.path.join(dest, ".rgt-part"))


def test_a_run_without_a_store_and_an_empty_log_pulls_over_the_stream(
    cli: Cli, tmp_path: Any, ssh_target: Target
) -> None:
    """An empty file (a job that printed nothing) arrives as an empty file over the stream too
    (it was never created there, then "missing")."""
    cli("run", "--name", RUN, "--", "true", check=True)
    ckpt = os.path.join(cli.home, "runs", RUN, "ckpt")
    os.makedirs(ckpt, exist_ok=True)
    with open(os.path.join(ckpt, "step_1.bin"), "wb") as f:
        f.write(b"weights")
    rec = _rec(None, cli.home, ssh_target)
    dest = str(tmp_path / "dest")
    receipt = pull(rec, dest, "box", transport="stream")
    assert {f.path: f.size for f in receipt.files} == {
        "checkpoints/step_1.bin": 7,
        "logs/attempt-0001.log": 0,
    }
    assert _read(os.path.join(dest, "logs", "attempt-0001.log")) == b""
