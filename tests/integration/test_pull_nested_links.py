"""`rgt pull` of a run without a store: the links below the top of its checkpoint dir.

A checkpoint saved as a directory often shares a file with an older one by a link in it
(``step-200/tokenizer.json -> ../step-100/tokenizer.json``, a saver that deduplicates); pulled
without it, ``from_pretrained("step-200")`` fails on the laptop. Such a link is made when its
target, judged by name from the link's own directory, is a pulled file or directory in the
checkpoint dir; a link that leads out of it (a '..' escape, an absolute path, through another
link), to nothing pulled, or to a directory holding it, is left out and named; a link in a
directory no file pulled is in gets that directory made for it. A real agent run, a real sshd
on loopback.
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any, Dict, Iterator, Tuple

import pytest

from controller.remote import SshRemote
from controller.results.entries import STAGE
from controller.results.pull import covers_newest, pull
from controller.results.receipt import receipt_path
from controller.target import Target
from onbox.common.safepath import UnsafePath
from tests.conftest import Cli
from tests.integration.test_pull import RUN, _finals, _read, _rec, _ssh_target
from tests.sshd import SshServer

# Two checkpoint dirs, the newer sharing the older's tokenizer by a link, and links a hostile
# (or careless) box could hold beside it. argv[1]: a directory outside the checkpoint dir.
_JOB = """
import os, sys
elsewhere = sys.argv[1]
ckpt = os.environ["RGT_CKPT_DIR"]
def put(rel, data):
    os.makedirs(os.path.dirname(os.path.join(ckpt, rel)), exist_ok=True)
    with open(os.path.join(ckpt, rel), "wb") as f:
        f.write(data)
def link(target, rel):
    os.makedirs(os.path.dirname(os.path.join(ckpt, rel)), exist_ok=True)
    os.symlink(target, os.path.join(ckpt, rel))
put("step-100/model.dat", b"weights 100")
put("step-100/tokenizer.json", b'{"vocab": 7}')
put("step-200/model.dat", b"weights 200")
put("step-200/sub/config.json", b"{}")
link("../step-100/tokenizer.json", "step-200/tokenizer.json")
link(os.path.join(ckpt, "step-100", "model.dat"), "step-200/prev.dat")
link("../step-100", "step-200/prev")
link("../../step-100/tokenizer.json", "step-200/sub/tok.json")
link(os.path.join(elsewhere, "secret.txt"), "step-200/abs-out")
link("../../" + os.path.basename(elsewhere) + "/secret.txt", "step-200/escape")
link("../../..", "step-200/up")
link(".", "step-200/self")
link("..", "step-200/parent")
link("../step-300/model.dat", "step-200/gone")
link("../out-link/secret.txt", "step-200/via")
link(elsewhere, "out-link")
link("../step-100/model.dat", "only-links/model.dat")
"""


@pytest.fixture
def ssh_box(sshd: SshServer, laptop: str) -> Iterator[Target]:
    """The real sshd on loopback, as the laptop reaches a box."""
    target = _ssh_target(sshd)
    yield target
    SshRemote(target).close()  # the control master ssh keeps for a while


def test_links_below_the_top_of_the_checkpoint_dir_to_pulled_files_are_made_others_left_out(
    cli: Cli, tmp_path: Any, ssh_box: Target
) -> None:
    """Before: every link below the top of the checkpoint dir was left out ("a link below the
    top of the checkpoint dir is not pulled as a link"), so step-200 arrived without its
    tokenizer. Now those to a pulled file or directory in the dir are made, relative to their
    own directory; the escapes are not made and are named in the receipt."""
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    (elsewhere / "secret.txt").write_text("not the run's")
    ckpt = work / "ckpt"
    (work / "job.py").write_text(_JOB)
    argv = [sys.executable, "job.py", str(elsewhere)]
    cli("run", "--name", RUN, "--ckpt-dir", str(ckpt), "--", *argv, check=True, cwd=str(work))
    rec = _rec(None, cli.home, ssh_box)
    dest = str(tmp_path / "dest")
    for _ in range(2):  # pulled again into the same DEST: the links are there, and stay
        receipt = pull(rec, dest, "box")
        got = os.path.join(dest, "checkpoints")
        want = {
            "step-200/tokenizer.json": "../step-100/tokenizer.json",
            "step-200/prev.dat": "../step-100/model.dat",
            "step-200/prev": "../step-100",
            "step-200/sub/tok.json": "../../step-100/tokenizer.json",
        }
        for name, target in want.items():
            assert os.readlink(os.path.join(got, *name.split("/"))) == target, name
        assert _read(os.path.join(got, "step-200", "tokenizer.json")) == b'{"vocab": 7}'
        assert _read(os.path.join(got, "step-200", "sub", "tok.json")) == b'{"vocab": 7}'
        assert _read(os.path.join(got, "step-200", "prev", "model.dat")) == b"weights 100"
        left = "\n".join(receipt.sealed.left_out)
        for name in ("abs-out", "escape", "up", "parent"):
            assert f"checkpoints/step-200/{name} -> " in left, (name, left)
            assert not os.path.lexists(os.path.join(got, "step-200", name)), name
        for name in ("self", "gone", "via"):
            assert f"checkpoints/step-200/{name} -> " in left, (name, left)
            assert not os.path.lexists(os.path.join(got, "step-200", name)), name
        # A directory of links only (a checkpoint that shares every file with an older one):
        # its directory is made for it, not left out ("no file pulled is in its directory").
        assert os.readlink(os.path.join(got, "only-links", "model.dat")) == "../step-100/model.dat"
        assert _read(os.path.join(got, "only-links", "model.dat")) == b"weights 100"
        assert "only-links" not in left, left
        assert "checkpoints/out-link -> " in left, left
        assert len(receipt.sealed.left_out) == 8, left
        assert receipt.not_covered == []
        home = os.path.realpath(dest) + os.sep
        for here, dirs, files in os.walk(dest):
            for name in dirs + files:
                path = os.path.join(here, name)
                if os.path.islink(path):
                    assert os.path.realpath(path).startswith(home), (path, os.readlink(path))
        assert not any("secret" in p for p in _finals(dest))
        assert covers_newest(rec, receipt)
    # The directory made for a link is never made through a link on the laptop: one planted
    # there (to a directory outside DEST) is refused, and nothing lands where it leads. It is
    # refused before anything is fetched (no stage made) or changed: the older pull's receipt
    # and files stay as they were (before, they were replaced and the receipt removed first).
    shutil.rmtree(os.path.join(got, "only-links"))
    os.symlink(str(elsewhere), os.path.join(got, "only-links"))
    before = _snapshot(dest)
    with open(receipt_path(dest), "rb") as f:
        older = f.read()
    with pytest.raises(UnsafePath, match="only-links is a symlink"):
        pull(rec, dest, "box")
    assert sorted(os.listdir(elsewhere)) == ["secret.txt"]
    assert not os.path.lexists(os.path.join(dest, STAGE))
    assert _snapshot(dest) == before
    with open(receipt_path(dest), "rb") as f:
        assert f.read() == older


def _snapshot(dest: str) -> Dict[str, Tuple[int, int]]:
    """Each name under ``dest`` (links not followed): its inode and mtime, which a file
    replaced or rewritten changes."""
    got: Dict[str, Tuple[int, int]] = {}
    for here, dirs, files in os.walk(dest):
        for name in dirs + files:
            st = os.lstat(os.path.join(here, name))
            got[os.path.relpath(os.path.join(here, name), dest)] = (st.st_ino, st.st_mtime_ns)
    return got
