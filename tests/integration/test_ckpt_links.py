"""Symlinks inside a checkpoint: a link to a regular file is sealed as that file's bytes.

Users assemble checkpoints from links (``step_N/tokenizer.json`` into the Hugging Face cache, a
frozen base model's weights, ``ln -s``). Left out, a restore on a new box gives an incomplete
checkpoint and the resume fails or silently uses another file. Real files, a real seal to a
``file://`` store, a real restore into an empty directory; a real load for rgt's Checkpointer.
A link that holds no bytes to keep (to a directory, dangling, to a FIFO or a device) is still
left out, never read; and where the job's files are another filesystem (a pod) none is followed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import threading
from typing import Any, Callable, Dict, List

import pytest

from onbox.common.safepath import UnsafePath
from onbox.sealing.epochs import take_epoch
from onbox.sealing.restore import restore_latest
from onbox.sealing.room import is_low
from onbox.sealing.sealer import Sealer
from onbox.sealing.stores import open_store
from tests.conftest import Cli, require
from tests.mounts import tmpfs

_MISSING = [m for m in ("torch", "safetensors") if importlib.util.find_spec(m) is None]


def _sealer(store: Any, run: str, ckpt: str, tmp_path: Any, events: List[Dict[str, Any]]) -> Sealer:
    s = Sealer(
        run,
        ckpt,
        store,
        str(tmp_path / "stage"),
        epoch=take_epoch(store, run),
        event=lambda kind, reason, **kw: events.append(dict(kw, kind=kind, reason=reason)),
        state_path=str(tmp_path / "seq.json"),
    )
    s.load()
    return s


def _bounded(fn: Callable[[], Any], seconds: float = 20) -> Any:
    """``fn()`` in a thread, failing the test (not hanging it) when it still runs after
    ``seconds``: a seal that opened the FIFO a link leads to would wait forever."""
    out: List[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive() and out, f"hung or raised (see the thread's traceback): {out}"
    return out[0]


def _write(path: str, data: bytes) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return path


def _hub(tmp_path: Any) -> str:
    """A file in a stand-in for the Hugging Face cache, outside the checkpoint dir."""
    return _write(str(tmp_path / "hub" / "blobs" / "0a1b2c"), b'{"vocab": ["a", "b"]}')


def _step_1(ckpt: str, tmp_path: Any) -> str:
    d = os.path.join(ckpt, "step_1")
    _write(os.path.join(d, "model.bin"), b"w" * 100)
    _write(os.path.join(ckpt, "shared", "config.json"), b'{"layers": 2}')
    os.symlink(_hub(tmp_path), os.path.join(d, "tokenizer.json"))  # absolute, out of the dir
    os.symlink("../shared/config.json", os.path.join(d, "config.json"))  # relative
    os.symlink(str(tmp_path / "gone"), os.path.join(d, "dangling"))
    os.symlink(str(tmp_path), os.path.join(d, "dirlink"))
    os.symlink("/dev/null", os.path.join(d, "devnull"))
    os.mkfifo(str(tmp_path / "fifo"))
    os.symlink(str(tmp_path / "fifo"), os.path.join(d, "pipe"))
    _write(os.path.join(d, ".rgt-complete"), json.dumps({"step": 1}).encode())
    return d


def test_a_link_to_a_file_in_a_checkpoint_is_sealed_as_that_file_and_restored_whole(
    tmp_path: Any,
) -> None:
    root = str(tmp_path / "durable")
    os.makedirs(root)
    store = open_store("file://" + root)
    ckpt = str(tmp_path / "ckpt")
    _step_1(ckpt, tmp_path)
    events: List[Dict[str, Any]] = []
    s = _sealer(store, "links", ckpt, tmp_path, events)
    s.follow_links = lambda: True
    assert _bounded(s.seal_pending) == 1
    assert _bounded(s.seal_pending) == 0
    (ev,) = [e for e in events if e["kind"] == "left_out"]
    assert ev["paths"] == ["step_1/dangling", "step_1/devnull", "step_1/dirlink", "step_1/pipe"]
    assert "(a symlink to a character device)" in ev["reason"]
    assert "(a symlink to a FIFO)" in ev["reason"]
    assert "(a symlink that leads nowhere)" in ev["reason"]

    dest = str(tmp_path / "new-box")
    doc = restore_latest(store, "links", dest, lambda *a, **kw: None)
    assert doc is not None and doc["step"] == 1
    got = os.path.join(dest, "step_1")
    assert sorted(os.listdir(got)) == [
        ".rgt-complete",
        "config.json",
        "model.bin",
        "tokenizer.json",
    ]
    for name, want in (
        ("tokenizer.json", b'{"vocab": ["a", "b"]}'),
        ("config.json", b'{"layers": 2}'),
    ):
        path = os.path.join(got, name)
        assert not os.path.islink(path)
        with open(path, "rb") as f:
            assert f.read() == want


def test_a_restore_on_the_same_box_takes_the_linked_checkpoint_as_it_is(tmp_path: Any) -> None:
    """The agent restores at each start: on the box that sealed it, the checkpoint with its
    link is already there (the link leads to the sealed bytes), not a symlink to refuse."""
    root = str(tmp_path / "durable")
    os.makedirs(root)
    store = open_store("file://" + root)
    ckpt = str(tmp_path / "ckpt")
    d = _step_1(ckpt, tmp_path)
    s = _sealer(store, "again", ckpt, tmp_path, [])
    s.follow_links = lambda: True
    assert _bounded(s.seal_pending) == 1
    said: List[str] = []
    doc = restore_latest(store, "again", ckpt, lambda kind, reason, **kw: said.append(reason))
    assert doc is not None and doc["step"] == 1 and "already on this box" in said[-1], said
    assert os.path.islink(os.path.join(d, "tokenizer.json"))
    # Once the target's bytes differ from the sealed ones, the link is not taken as the file:
    # the restore refuses to write through it (and says so) rather than trust it.
    _write(_hub(tmp_path), b"another tokenizer")
    with pytest.raises(UnsafePath, match="is a symlink: rgt neither writes nor reads"):
        restore_latest(store, "again", ckpt, lambda *a, **kw: None)


def test_a_linked_file_still_open_for_writing_defers_the_seal(tmp_path: Any) -> None:
    """The writers check is the target's: a tokenizer still being written through its real
    path keeps the checkpoint from being sealed until it is closed."""
    root = str(tmp_path / "durable")
    os.makedirs(root)
    store = open_store("file://" + root)
    ckpt = str(tmp_path / "ckpt")
    _step_1(ckpt, tmp_path)
    s = _sealer(store, "busy", ckpt, tmp_path, [])
    s.follow_links = lambda: True
    with open(_hub(tmp_path), "ab"):
        assert s.scan() == []
    (cand,) = s.scan()
    assert "step_1/tokenizer.json" in cand.files


def test_in_another_filesystem_a_link_in_a_checkpoint_is_never_followed(tmp_path: Any) -> None:
    """A pod's job container: an absolute target would be resolved in the agent's own
    filesystem (its credentials), so the link is left out, said why."""
    root = str(tmp_path / "durable")
    os.makedirs(root)
    store = open_store("file://" + root)
    ckpt = str(tmp_path / "ckpt")
    _step_1(ckpt, tmp_path)
    events: List[Dict[str, Any]] = []
    s = _sealer(store, "pod", ckpt, tmp_path, events)
    s.follow_links = lambda: False
    assert _bounded(s.seal_pending) == 1
    (ev,) = [e for e in events if e["kind"] == "left_out"]
    assert "step_1/tokenizer.json" in ev["paths"] and "not followed" in ev["reason"]
    stored = [f for _, _, files in os.walk(root) for f in files]
    assert "tokenizer.json" not in stored and "config.json" not in stored


def test_a_checkpointer_checkpoint_with_linked_weights_restores_and_loads(tmp_path: Any) -> None:
    """A frozen base model's weights linked into an rgt checkpoint (the marker lists them;
    ckptdir.verify hashes through the link): the restored checkpoint loads on a new box."""
    require(not _MISSING, f"{', '.join(_MISSING)} (pip install -e '.[train]' torch==2.13.0)")
    import torch

    from onbox.train import Checkpointer

    ckpt = str(tmp_path / "ckpt")
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    ck = Checkpointer(ckpt, handle_signals=False, safetensors=True, model=model)
    ck.save(7)
    ck.close()
    weights = os.path.join(ckpt, "step_7", "model.safetensors")
    cached = str(tmp_path / "hub" / "base.safetensors")
    os.makedirs(os.path.dirname(cached))
    os.rename(weights, cached)
    os.symlink(cached, weights)
    os.symlink(_hub(tmp_path), os.path.join(ckpt, "step_7", "tokenizer.json"))
    assert Checkpointer(ckpt, handle_signals=False, model=torch.nn.Linear(8, 8)).load() == 7

    root = str(tmp_path / "durable")
    os.makedirs(root)
    store = open_store("file://" + root)
    s = _sealer(store, "ck", ckpt, tmp_path, [])
    s.follow_links = lambda: True
    assert s.seal_pending() == 1
    dest = str(tmp_path / "new-box")
    assert restore_latest(store, "ck", dest, lambda *a, **kw: None) is not None
    fresh = torch.nn.Linear(8, 8)
    assert Checkpointer(dest, handle_signals=False, model=fresh).load() == 7
    assert torch.equal(fresh.weight, model.weight)
    assert os.path.isfile(os.path.join(dest, "step_7", "tokenizer.json"))


JOB = r"""
import json, os
ck = os.environ["RGT_CKPT_DIR"]
os.makedirs("hub", exist_ok=True)
with open("hub/tokenizer.json", "w") as f:
    f.write("vocab")
d = os.path.join(ck, ".step_1.tmp")
os.makedirs(d)
with open(os.path.join(d, "model.bin"), "wb") as f:
    f.write(b"w" * 64)
os.symlink(os.path.abspath("hub/tokenizer.json"), os.path.join(d, "tokenizer.json"))
with open(os.path.join(d, ".rgt-complete"), "w") as f:
    json.dump({"step": 1}, f)
os.rename(d, os.path.join(ck, "step_1"))
print("finished", flush=True)
"""


def test_the_agent_on_a_box_seals_a_linked_file_of_a_checkpoint(cli: Cli, tmp_path: Any) -> None:
    """The real agent (one filesystem with its job) follows the link; its MANIFEST holds the
    target's bytes under the link's name."""
    root = str(tmp_path / "durable")
    os.makedirs(root)
    work = tmp_path / "work"
    work.mkdir()
    (work / "job.py").write_text(JOB)
    (work / "job.toml").write_text(
        f'name = "lnk"\ncommand = {json.dumps([sys.executable, "job.py"])}\n'
        f'store = "file://{root}"\n'
    )
    cli("start", "job.toml", "--ckpt-dir", str(tmp_path / "ckpt"), check=True, cwd=str(work))
    cli.wait_state("lnk", "SUCCEEDED", timeout=60)
    with open(os.path.join(root, "lnk", "checkpoints", "1", "MANIFEST.json")) as f:
        doc = json.load(f)
    files = {e["path"]: e["size"] for e in doc["files"]}
    assert files.get("step_1/tokenizer.json") == len("vocab"), files
    assert not [e for e in cli.events("lnk") if e["kind"] == "left_out"]


@pytest.mark.parametrize("how", ["best", "nested"])
def test_a_low_disk_never_deletes_a_checkpoint_a_link_leads_to(tmp_path: Any, how: str) -> None:
    """Sealed steps 2, 3, 4 on a disk that runs low: step 2 may go (sealed, oldest) unless a
    link leads to it, a user's ``best`` or step 4's ``tokenizer.json`` linked to step 2's: then
    step 3 goes instead, and the link still leads to its bytes."""
    with tmpfs(str(tmp_path / "small"), "size=8m") as small:
        events: List[Dict[str, Any]] = []
        root = str(tmp_path / "durable")
        os.makedirs(root)
        s = _sealer(open_store("file://" + root), "room", small, tmp_path, events)
        s.follow_links = lambda: True
        for n in (2, 3, 4):
            d = os.path.join(small, f"step_{n}")
            _write(os.path.join(d, "model.bin"), os.urandom(1536 << 10))
            tok = os.path.join(d, "tokenizer.json")
            if n == 4 and how == "nested":
                os.symlink("../step_2/tokenizer.json", tok)
            else:
                _write(tok, b"vocab %d" % n)
            _write(os.path.join(d, ".rgt-complete"), json.dumps({"step": n}).encode())
        if how == "best":
            os.symlink("step_2", os.path.join(small, "best"))
        assert _bounded(s.seal_pending) == 3
        with open(os.path.join(small, "filler.dat"), "ab") as f:  # never a checkpoint
            while not is_low(small):
                f.write(b"\0" * (64 << 10))
                f.flush()
        assert s.free_room() > 0
        assert not os.path.exists(os.path.join(small, "step_3"))
        (ev,) = [e for e in events if e["kind"] == "freed_local"]
        assert ev["root"] == "step_3"
        via = "best/tokenizer.json" if how == "best" else "step_4/tokenizer.json"
        with open(os.path.join(small, via), "rb") as f:
            assert f.read() == b"vocab 2"


def _fill(small: str) -> None:
    """Fill ``small`` with a file that is never a checkpoint until its disk is low."""
    with open(os.path.join(small, "filler.dat"), "ab") as f:
        while not is_low(small):
            f.write(b"\0" * (64 << 10))
            f.flush()


@pytest.mark.parametrize("follow", [True, False])
def test_a_low_disk_frees_a_sealed_checkpoint_with_a_linked_file_by_its_link(
    tmp_path: Any, follow: bool
) -> None:
    """Every checkpoint links the HF cache's tokenizer (out of the disk): sealed as the target's
    bytes under the link's name, a sealed step goes when the disk runs low, by deleting the
    link, never the target, and counting only the bytes it freed. Step 3 also links a directory
    (left out of its MANIFEST): not ours to judge, it stays. In a pod (no link followed) no
    link was sealed, so none of them is judged: the disk stays low, said once."""
    hub = str(tmp_path / "hub" / "tokenizer.json")
    _write(hub, b"t" * (512 << 10))
    with tmpfs(str(tmp_path / "small"), "size=8m") as small:
        events: List[Dict[str, Any]] = []
        root = str(tmp_path / "durable")
        os.makedirs(root)
        s = _sealer(open_store("file://" + root), "hf", small, tmp_path, events)
        s.follow_links = lambda: follow
        sizes = {}
        for n in (2, 3, 4):
            d = os.path.join(small, f"step_{n}")
            _write(os.path.join(d, "model.bin"), os.urandom(1536 << 10))
            os.symlink(hub, os.path.join(d, "tokenizer.json"))
            if n == 2:  # a link within the checkpoint: it goes with its target
                os.symlink("model.bin", os.path.join(d, "weights.bin"))
            if n == 3:
                os.symlink(str(tmp_path / "hub"), os.path.join(d, "hub"))
            marker = _write(os.path.join(d, ".rgt-complete"), json.dumps({"step": n}).encode())
            sizes[n] = (1536 << 10) + os.path.getsize(marker)
        assert _bounded(s.seal_pending) == 3
        _fill(small)
        freed = s.free_room()
        kinds = [e["kind"] for e in events]
        if not follow:
            assert freed == 0 and kinds.count("room_exhausted") == 1, kinds
            _says_left_out_link(events)
            assert all(os.path.isdir(os.path.join(small, f"step_{n}")) for n in (2, 3, 4))
            return
        gone = [e for e in events if e["kind"] == "freed_local"]
        assert [e["root"] for e in gone] == ["step_2"], kinds
        assert gone[0]["freed"] == sizes[2] and freed == sizes[2]  # not the tokenizer's bytes
        assert not os.path.lexists(os.path.join(small, "step_2"))
        assert os.path.isdir(os.path.join(small, "step_3"))  # its directory link: not judged
        with open(hub, "rb") as f:  # the target stays, whole
            assert f.read() == b"t" * (512 << 10)
        _fill(small)  # again: step 3 is not judged, step 4 is LATEST
        assert s.free_room() == 0 and os.path.isdir(os.path.join(small, "step_3"))
        assert [e["kind"] for e in events].count("room_exhausted") == 1
        _says_left_out_link(events)


def _says_left_out_link(events: List[Dict[str, Any]]) -> None:
    """The ``room_exhausted`` event names the reason that kept a checkpoint holding a symlink
    the sealer left out, as docs/events.md's row does (before, its message gave four reasons,
    and this one was only implied)."""
    [stuck] = [e for e in events if e["kind"] == "room_exhausted"]
    reason = "holds a symlink the sealer left out"
    assert reason in stuck["reason"], stuck
    docs = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "events.md")
    with open(docs) as f:
        [row] = [x for x in f if x.startswith("| `room_exhausted` |")]
    assert reason in row, row


def test_a_low_disk_counts_only_the_bytes_it_freed_of_a_hard_linked_checkpoint(
    tmp_path: Any,
) -> None:
    """Step 2's weights are hard-linked outside the checkpoint dir, on its disk (a user's
    ``cp -l`` of a good step): when the disk runs low, deleting step 2 frees only its marker,
    which its ``freed_local`` says, and, the disk still low, step 3 goes too, whose two names
    of one file (hard-linked within it) free that file's bytes once. Before the fix step 2 was
    said to free its weights' bytes as well, which stayed on the disk, and step 3 twice its."""
    with tmpfs(str(tmp_path / "small"), "size=8m") as small:
        ckpt = os.path.join(small, "ckpt")
        events: List[Dict[str, Any]] = []
        root = str(tmp_path / "durable")
        os.makedirs(root)
        s = _sealer(open_store("file://" + root), "hard", ckpt, tmp_path, events)
        sizes = {}
        for n in (2, 3, 4):
            d = os.path.join(ckpt, f"step_{n}")
            _write(os.path.join(d, "model.bin"), os.urandom(1536 << 10))
            if n == 3:
                os.link(os.path.join(d, "model.bin"), os.path.join(d, "ema.bin"))
            marker = _write(os.path.join(d, ".rgt-complete"), json.dumps({"step": n}).encode())
            sizes[n] = os.path.getsize(marker)
        best = os.path.join(small, "best")
        os.makedirs(best)
        os.link(os.path.join(ckpt, "step_2", "model.bin"), os.path.join(best, "model.bin"))
        assert _bounded(s.seal_pending) == 3
        _fill(small)
        freed = s.free_room()
        gone = {e["root"]: e["freed"] for e in events if e["kind"] == "freed_local"}
        assert gone == {"step_2": sizes[2], "step_3": (1536 << 10) + sizes[3]}, events
        assert freed == sum(gone.values()) and not is_low(small)
        assert os.path.getsize(os.path.join(best, "model.bin")) == 1536 << 10
