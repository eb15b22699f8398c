"""Symlinks in the checkpoint dir itself come back with a restore on a new box.

Lightning's ``ModelCheckpoint(save_last="link")`` makes ``last.ckpt`` a symlink to the newest
checkpoint, and ``trainer.fit(ckpt_path="last")`` looks for ``last*.ckpt`` in the checkpoint
dir: restored without it, Lightning warns and trains from step 0 (weeks of GPU time redone).
The seal records each link of the dir that leads to the checkpoint it seals (its MANIFEST's
``links``), and the restore makes them again once the checkpoint's files are verified in place.
A real Lightning run, a real seal to a ``file://`` store, a real restore into an empty directory
(a new box), a real resume; a real ``rgt pull`` makes them in DEST/checkpoints. A store is
untrusted: a MANIFEST whose link leads out of the dir, or names a path instead of a name, is
refused whole (the restore quarantines it, the pull stops) and nothing is made.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from typing import Any, Dict, Iterator, List

import pytest

from controller.cli import main as rgt_main
from controller.registry import Registry
from controller.remote import SshRemote
from controller.results.pull import covers_newest, pull
from controller.target import Target
from onbox.common.errors import IntegrityError
from onbox.sealing import manifest as mf
from onbox.sealing.restore import NoVerifiedCheckpoint, restore_latest
from onbox.sealing.stores import open_store
from tests.conftest import Cli, require
from tests.integration.test_pull import RUN, _rec, _ssh_target
from tests.integration.test_sealing import _sealer
from tests.sshd import SshServer

# A tiny model that checkpoints every 2 steps with save_last="link", and prints the step it
# starts training from (0 unless it resumed).
_SCRIPT = """
import os, sys, time, torch, lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
ckpt, steps, resume = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "resume"
pad = int(sys.argv[4]) if len(sys.argv) > 4 else 0  # floats of padding: a bigger checkpoint
gate = sys.argv[5] if len(sys.argv) > 5 else ""  # after step 2's checkpoint, wait for this file

class M(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        self.register_buffer("pad", torch.zeros(pad))
    def training_step(self, batch, _):
        return self.lin(batch[0]).pow(2).mean()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)
    def on_train_start(self):
        print(f"training from step {self.trainer.global_step}", flush=True)

class Gate(L.Callback):
    def on_train_batch_start(self, trainer, *_):
        if gate and trainer.global_step == 2:
            print("checkpointed step 2", flush=True)
            for _ in range(3000):  # bounded: 300 s
                if os.path.exists(gate):
                    break
                time.sleep(0.1)

torch.manual_seed(0)
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 4)), batch_size=1)
cb = ModelCheckpoint(dirpath=ckpt, every_n_train_steps=2, save_top_k=-1, save_last="link")
t = L.Trainer(max_steps=steps, callbacks=[cb, Gate()], logger=False, enable_progress_bar=False,
              enable_model_summary=False, accelerator="cpu", devices=1)
t.fit(M(), data, ckpt_path="last" if resume else None)
"""


def _lightning(tmp_path: Any, ckpt: str, steps: int, resume: bool, pad: int = 0) -> str:
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    p = subprocess.run(  # bounded: run() kills it at the timeout
        [sys.executable, str(script), ckpt, str(steps), "resume" if resume else "new", str(pad)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(tmp_path),
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return p.stdout


def _seal_all(store: Any, run: str, ckpt: str, tmp_path: Any) -> List[Dict[str, Any]]:
    events: List[Dict[str, Any]] = []
    s = _sealer(store, run, ckpt, tmp_path, events)
    while s.seal_pending():
        pass
    return events


def _store(tmp_path: Any) -> Any:
    root = tmp_path / "durable"
    root.mkdir()
    return open_store(f"file://{root}")


def test_lightning_last_link_comes_back_and_resume_last_goes_on_from_it(tmp_path: Any) -> None:
    missing = [m for m in ("torch", "lightning") if importlib.util.find_spec(m) is None]
    require(not missing, f"{', '.join(missing)} (pip install -e '.[train,frameworks]')")
    store = _store(tmp_path)
    ckpt = str(tmp_path / "old-box" / "ckpt")
    _lightning(tmp_path, ckpt, 4, resume=False)
    assert os.readlink(os.path.join(ckpt, "last.ckpt")) == "epoch=0-step=4.ckpt"
    _seal_all(store, "lit", ckpt, tmp_path)

    new = str(tmp_path / "new-box" / "ckpt")  # the box preempted: an empty one
    said: List[str] = []
    doc = restore_latest(store, "lit", new, lambda kind, reason, **kw: said.append(reason))
    assert doc is not None and doc["step"] == 4, said
    assert sorted(os.listdir(new)) == ["epoch=0-step=4.ckpt", "last.ckpt"], said
    assert os.readlink(os.path.join(new, "last.ckpt")) == "epoch=0-step=4.ckpt"
    assert "last.ckpt" in said[-1], said

    out = _lightning(tmp_path, new, 6, resume=True)
    assert "training from step 4" in out, out[-2000:]


def test_a_latest_link_to_a_checkpoint_dir_comes_back_and_one_out_of_the_dir_does_not(
    tmp_path: Any,
) -> None:
    store = _store(tmp_path)
    ckpt = tmp_path / "ckpt"
    for step in (1, 2):
        d = ckpt / f"step_{step}"
        d.mkdir(parents=True)
        (d / "model.bin").write_bytes(b"w" * step)
        (d / ".rgt-complete").write_text(json.dumps({"step": step}))
    os.symlink("step_2", str(ckpt / "latest"))
    os.symlink(str(ckpt / "step_2" / "model.bin"), str(ckpt / "model.bin"))  # absolute, in
    os.symlink("step_1", str(ckpt / "previous"))  # leads to a step not restored
    (tmp_path / "elsewhere.pt").write_bytes(b"x")
    os.symlink(str(tmp_path / "elsewhere.pt"), str(ckpt / "out.pt"))  # out of the dir
    _seal_all(store, "own", str(ckpt), tmp_path)
    sealed = json.loads((tmp_path / "durable" / mf.manifest_key("own", 2)).read_bytes())
    assert sealed["links"] == [
        {"name": "latest", "target": "step_2"},
        {"name": "model.bin", "target": "step_2/model.bin"},
    ]

    new = str(tmp_path / "new-box")
    doc = restore_latest(store, "own", new, lambda *a, **kw: None)
    assert doc is not None and doc["step"] == 2
    assert sorted(os.listdir(new)) == ["latest", "model.bin", "step_2"]
    assert os.readlink(os.path.join(new, "latest")) == "step_2"
    with open(os.path.join(new, "model.bin"), "rb") as f:  # relative now: it moved boxes
        assert f.read() == b"ww"
    # Again, on a box where the link is there: nothing to say. One the job moved on is its
    # own: kept, and said.
    said: List[str] = []
    restore_latest(store, "own", new, lambda kind, reason, **kw: said.append(reason))
    assert "already on this box" in said[-1] and "link" not in said[-1], said
    os.unlink(os.path.join(new, "latest"))
    os.symlink("step_9", os.path.join(new, "latest"))
    restore_latest(store, "own", new, lambda kind, reason, **kw: said.append(reason))
    assert os.readlink(os.path.join(new, "latest")) == "step_9"
    assert "links left as the box holds them: latest" in said[-1], said


def test_a_fake_filesystem_that_refuses_symlinks_keeps_the_restore_and_says_so(
    tmp_path: Any, monkeypatch: Any
) -> None:
    """A checkpoint dir on a mount without symlinks (rclone or goofys without link support,
    vfat): the files are restored and verified, the restore succeeds, and its words say the
    links are missing. Fake: os.symlink refuses, as such a filesystem does (none mounts here)."""
    store = _store(tmp_path)
    ckpt = tmp_path / "ckpt"
    (ckpt / "step_1").mkdir(parents=True)
    (ckpt / "step_1" / "model.bin").write_bytes(b"w")
    (ckpt / "step_1" / ".rgt-complete").write_text(json.dumps({"step": 1}))
    os.symlink("step_1", str(ckpt / "latest"))
    _seal_all(store, "own", str(ckpt), tmp_path)

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "symlink", refuse)
    new = str(tmp_path / "new-box")
    said: List[str] = []
    doc = restore_latest(store, "own", new, lambda kind, reason, **kw: said.append(reason))
    assert doc is not None and doc["step"] == 1, said
    assert sorted(os.listdir(new)) == ["step_1"]
    assert "links could not be made again" in said[-1] and "starts over" in said[-1], said


@pytest.mark.parametrize(
    "link",
    [
        {"name": "last.ckpt", "target": "/etc/passwd"},
        {"name": "last.ckpt", "target": "../../outside"},
        {"name": "last.ckpt", "target": "step_1/../../outside"},
        {"name": "../evil", "target": "step_1.pt"},
        {"name": "sub/evil", "target": "step_1.pt"},
        {"name": "last.ckpt", "target": "other.pt"},  # in the dir, but not this checkpoint
        {"name": "step_1.pt", "target": "step_1.pt"},  # over the checkpoint itself
        {"name": ".rgt-restore-x", "target": "step_1.pt"},
    ],
)
def test_a_manifest_whose_link_leads_out_is_refused_and_nothing_is_made(
    tmp_path: Any, link: Dict[str, str]
) -> None:
    store = _store(tmp_path)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "step_1.pt").write_bytes(b"weights")
    _seal_all(store, "evil", str(ckpt), tmp_path)
    key = tmp_path / "durable" / mf.manifest_key("evil", 1)
    doc = json.loads(key.read_bytes())
    doc["links"] = [link]
    key.write_bytes(mf.dump(doc))

    box = tmp_path / "box"
    box.mkdir()
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(NoVerifiedCheckpoint, match="link") as e:
        restore_latest(store, "evil", str(box / "ckpt"), lambda *a, **kw: None)
    assert "step 1" in e.value.what
    assert sorted(os.listdir(tmp_path)) == before
    assert not [p for p in box.rglob("*") if p.is_symlink()]
    assert not os.path.lexists(str(box / "evil")) and not os.path.lexists("/etc/outside")


def _latest_to(tmp_path: Any, store: Any, step: int) -> None:
    ckpt = tmp_path / "ckpt"
    d = ckpt / f"step_{step}"
    d.mkdir(parents=True)
    (d / "model.bin").write_bytes(b"w" * step)
    (d / ".rgt-complete").write_text(json.dumps({"step": step}))
    if os.path.lexists(str(ckpt / "latest")):
        os.unlink(str(ckpt / "latest"))
    os.symlink(f"step_{step}", str(ckpt / "latest"))
    _seal_all(store, RUN, str(ckpt), tmp_path)


def test_a_pull_makes_the_link_in_dest_and_moves_it_on_at_the_next_pull(
    tmp_path: Any, laptop: str
) -> None:
    store = _store(tmp_path)
    rec = _rec(store.url, str(tmp_path / "box"))
    dest = str(tmp_path / "dest")
    _latest_to(tmp_path, store, 2)
    pull(rec, dest, "store")
    assert os.readlink(os.path.join(dest, "checkpoints", "latest")) == "step_2"
    _latest_to(tmp_path, store, 4)
    receipt = pull(rec, dest, "store")
    assert os.readlink(os.path.join(dest, "checkpoints", "latest")) == "step_4"
    assert receipt.sealed.links == (("latest", "step_4"),)
    with open(os.path.join(dest, "checkpoints", "latest", "model.bin"), "rb") as f:
        assert f.read() == b"wwww"


@pytest.mark.parametrize("target", ["/etc", "../../../outside", "step_2/../../x"])
def test_a_pull_refuses_a_link_out_of_dest_before_anything_is_made(
    tmp_path: Any, laptop: str, target: str
) -> None:
    store = _store(tmp_path)
    _latest_to(tmp_path, store, 2)
    key = tmp_path / "durable" / mf.manifest_key(RUN, 2)
    doc = json.loads(key.read_bytes())
    doc["links"] = [{"name": "latest", "target": target}]
    key.write_bytes(mf.dump(doc))
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(IntegrityError, match="latest"):
        pull(_rec(store.url, str(tmp_path / "box")), str(tmp_path / "dest"), "store")
    assert sorted(os.listdir(tmp_path)) == before


# ---- a run without a store, pulled from the box itself


@pytest.fixture
def ssh_box(sshd: SshServer, laptop: str) -> Iterator[Target]:
    """The real sshd on loopback, as the laptop reaches a box."""
    target = _ssh_target(sshd)
    yield target
    SshRemote(target).close()  # the control master ssh keeps for a while


def test_a_pull_from_the_box_without_a_store_brings_last_ckpt_and_resume_last_goes_on(
    cli: Cli, tmp_path: Any, ssh_box: Target
) -> None:
    """Before: the box's lister took regular files only, so a run without a store arrived
    without Lightning's ``last.ckpt`` link, and ``fit(ckpt_path="last")`` on the pulled dir
    trained from step 0. A real Lightning job on a real box (sshd on loopback), pulled."""
    missing = [m for m in ("torch", "lightning") if importlib.util.find_spec(m) is None]
    require(not missing, f"{', '.join(missing)} (pip install -e '.[train,frameworks]')")
    work = tmp_path / "work"
    work.mkdir()
    head = "import os, sys\nsys.argv[1:] = [os.environ['RGT_CKPT_DIR'], '4', 'new']\n"
    (work / "job.py").write_text(head + _SCRIPT)
    cli(
        "run", "--name", RUN, "--", sys.executable, "job.py", check=True, cwd=str(work), timeout=300
    )
    box_ckpt = os.path.join(cli.home, "runs", RUN, "ckpt")
    assert os.readlink(os.path.join(box_ckpt, "last.ckpt")) == "epoch=0-step=4.ckpt"

    dest = str(tmp_path / "dest")
    receipt = pull(_rec(None, cli.home, ssh_box), dest, "box")
    pulled = os.path.join(dest, "checkpoints")
    assert os.readlink(os.path.join(pulled, "last.ckpt")) == "epoch=0-step=4.ckpt"
    assert ("last.ckpt", "epoch=0-step=4.ckpt") in receipt.sealed.links
    assert receipt.sealed.left_out == ()
    assert covers_newest(_rec(None, cli.home, ssh_box), receipt)
    # Pulled again into the same DEST: the link is there already, and stays.
    again = pull(_rec(None, cli.home, ssh_box), dest, "box")
    assert again.sealed.listing_sha256 == receipt.sealed.listing_sha256
    assert os.readlink(os.path.join(pulled, "last.ckpt")) == "epoch=0-step=4.ckpt"

    out = _lightning(tmp_path, pulled, 6, resume=True)
    assert "training from step 4" in out, out[-2000:]


# A job that leaves, beside its checkpoint, links a hostile (or careless) box could hold: out
# of the dir (absolute, '..'), to nothing pulled, under a name the laptop refuses, and one in
# its outputs. Only the link to the checkpoint, relative (the absolute one made so), comes.
_LINKS_JOB = """
import os
ckpt = os.environ["RGT_CKPT_DIR"]
os.makedirs(ckpt, exist_ok=True)
with open(os.path.join(ckpt, "weights.dat"), "wb") as f:
    f.write(b"weights")
os.symlink("weights.dat", os.path.join(ckpt, "latest"))
os.symlink(os.path.join(ckpt, "weights.dat"), os.path.join(ckpt, "abs"))
os.symlink("/etc/passwd", os.path.join(ckpt, "passwd"))
os.symlink("../../x", os.path.join(ckpt, "up"))
os.symlink("../" + os.path.basename(ckpt) + "/../../x", os.path.join(ckpt, "roundabout"))
os.symlink("missing.dat", os.path.join(ckpt, "gone"))
os.symlink("weights.dat", os.path.join(ckpt, "odd\\x01name"))
os.makedirs("out", exist_ok=True)
with open("out/result.txt", "w") as f:
    f.write("done")
os.symlink("/etc/passwd", "out/evil")
"""


def test_links_a_box_pull_brings_lead_inside_dest_and_the_others_are_said_left_out(
    cli: Cli, tmp_path: Any, ssh_box: Target, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: no link came at all, and nothing said so. Now the links in the checkpoint dir
    that lead to a pulled checkpoint are made, relative; a link out of the dir (absolute, a
    '..' escape), to nothing pulled, or under an odd name, and a link in the outputs, are left
    out, each named in the receipt and by `rgt pull`; no link in DEST leads out of it."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "job.py").write_text(_LINKS_JOB)
    argv = [sys.executable, "job.py"]
    cli("run", "--name", RUN, "--output", "out/", "--", *argv, check=True, cwd=str(work))
    rec = _rec(None, cli.home, ssh_box)
    dest = str(tmp_path / "dest")
    receipt = pull(rec, dest, "box")
    ckpts = os.path.join(dest, "checkpoints")
    assert os.readlink(os.path.join(ckpts, "latest")) == "weights.dat"
    assert os.readlink(os.path.join(ckpts, "abs")) == "weights.dat"
    for name in ("passwd", "up", "roundabout", "gone", "odd\x01name"):
        assert not os.path.lexists(os.path.join(ckpts, name)), name
    assert not os.path.lexists(os.path.join(dest, "outputs", "out", "evil"))
    home = os.path.realpath(dest) + os.sep
    for here, dirs, files in os.walk(dest):
        for name in dirs + files:
            path = os.path.join(here, name)
            if os.path.islink(path):
                assert os.path.realpath(path).startswith(home), (path, os.readlink(path))
    left = "\n".join(receipt.sealed.left_out)
    for name in ("checkpoints/passwd", "checkpoints/up", "checkpoints/roundabout"):
        assert f"{name} -> " in left and "out of the checkpoint dir" in left, left
    assert "checkpoints/gone -> 'missing.dat'" in left and "nothing pulled" in left, left
    assert "odd" in left and "outputs/out/evil -> '/etc/passwd'" in left, left
    assert len(receipt.sealed.left_out) == 6, left
    assert covers_newest(rec, receipt)

    Registry().put(rec)
    capsys.readouterr()
    assert rgt_main(["pull", RUN, "--to", str(tmp_path / "dest-cli")]) == 0
    out = capsys.readouterr().out
    assert "warning: checkpoints/passwd -> '/etc/passwd'" in out, out
    assert "not pulled, so not here (only on the box)" in out, out
