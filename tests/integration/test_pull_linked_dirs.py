"""`rgt pull` of a run without a store whose outputs and checkpoint dir are symlinks.

On a rented box with a small system disk (AutoDL: the data disk at /root/autodl-tmp) users
link their results and checkpoint dirs to the data disk (``out -> /root/autodl-tmp/out``).
The completion seal follows a declared output itself; a pull without a store must too, or it
"succeeds" without the results and checkpoints. Nothing below the declared path is followed:
a link under it stays a link, left out and named. A declared output that is a link to a file
is pulled as that file, by either transport. A real agent run, a real sshd on loopback.
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any, Iterator

import pytest

from controller.remote import SshRemote
from controller.results.pull import covers_newest, pull
from controller.target import Target
from tests.conftest import Cli
from tests.integration.test_pull import RUN, _finals, _read, _rec, _ssh_target
from tests.sshd import SshServer

# The job writes through the links the user made: its checkpoint (two links to it, one by
# its real path, and one in the checkpoint dir that leads out of it), its outputs (and a link
# in them to a directory elsewhere, whose file must not come).
_JOB = """
import os, sys
elsewhere = sys.argv[1]
ckpt = os.environ["RGT_CKPT_DIR"]
with open(os.path.join(ckpt, "step_3.pt"), "wb") as f:
    f.write(b"weights of step 3")
os.symlink("step_3.pt", os.path.join(ckpt, "latest"))
os.symlink(os.path.realpath(os.path.join(ckpt, "step_3.pt")), os.path.join(ckpt, "resolved"))
os.symlink(elsewhere, os.path.join(ckpt, "escape"))
# '..' from where the dir really is (the data disk's ckpt-disk), not from its name (ckpt)
real = os.path.basename(os.path.realpath(ckpt))
os.symlink("../" + real + "/step_3.pt", os.path.join(ckpt, "up-real"))
os.symlink("../" + os.path.basename(ckpt) + "/step_3.pt", os.path.join(ckpt, "up-named"))
os.makedirs("out/sub", exist_ok=True)
with open("out/result.json", "w") as f:
    f.write('{"loss": 0.25}')
with open("out/sub/metrics.jsonl", "w") as f:
    f.write('{"step": 3}\\n')
os.symlink(elsewhere, "out/inner")
"""


@pytest.fixture
def ssh_box(sshd: SshServer, laptop: str) -> Iterator[Target]:
    """The real sshd on loopback, as the laptop reaches a box."""
    target = _ssh_target(sshd)
    yield target
    SshRemote(target).close()  # the control master ssh keeps for a while


def test_outputs_and_a_checkpoint_dir_linked_to_a_data_disk_are_pulled_and_links_under_them_not(
    cli: Cli, tmp_path: Any, ssh_box: Target
) -> None:
    """Before: the box's lister ran `find` on each declared path without following it, so an
    output dir or a checkpoint dir that is a symlink listed nothing: the pull succeeded with
    the job's log only, no result and no checkpoint."""
    work, data, elsewhere = tmp_path / "work", tmp_path / "data", tmp_path / "elsewhere"
    for d in (work, data / "out", data / "ckpt-disk", elsewhere):
        d.mkdir(parents=True)
    (elsewhere / "secret.txt").write_text("not the run's")
    (work / "out").symlink_to(data / "out")
    (work / "ckpt").symlink_to(data / "ckpt-disk")
    (work / "job.py").write_text(_JOB)
    argv = [sys.executable, "job.py", str(elsewhere)]
    cli("run", "--name", RUN, "--ckpt-dir", str(work / "ckpt"), "--output", "out/", "--",
        *argv, check=True, cwd=str(work))  # fmt: skip
    rec = _rec(None, cli.home, ssh_box)
    for transport in ["stream"] + (["rsync"] if shutil.which("rsync") else []):
        dest = str(tmp_path / f"dest-{transport}")
        receipt = pull(rec, dest, "box", transport=transport)
        want = {
            "checkpoints/step_3.pt": b"weights of step 3",
            "outputs/out/result.json": b'{"loss": 0.25}',
            "outputs/out/sub/metrics.jsonl": b'{"step": 3}\n',
        }
        paths = {f.path for f in receipt.files}
        assert {p for p in paths if not p.startswith("logs/")} == set(want), paths
        for path, data_ in want.items():
            assert _read(os.path.join(dest, *path.split("/"))) == data_, path
        # The links under the declared paths are not followed: those to the checkpoint are
        # made, relative (one names its real path on the data disk: the seal records it so);
        # the two to the directory elsewhere are left out and named.
        for name in ("latest", "resolved", "up-real"):
            assert os.readlink(os.path.join(dest, "checkpoints", name)) == "step_3.pt", name
        left = "\n".join(receipt.sealed.left_out)
        assert "checkpoints/escape ->" in left and "outputs/out/inner ->" in left, left
        # A '..' is resolved where the linked dir really is, as the box resolves it: by its
        # name (ckpt/../ckpt) "up-named" led into the dir; on the box, out of it (to nothing).
        assert "checkpoints/up-named -> '../ckpt/step_3.pt': it leads out of" in left, left
        assert not os.path.lexists(os.path.join(dest, "checkpoints", "up-named"))
        assert not any("secret" in p for p in _finals(dest))
        assert covers_newest(rec, receipt)


def test_a_declared_output_linked_to_a_file_is_pulled_as_that_file_by_both_transports(
    cli: Cli, tmp_path: Any, ssh_box: Target
) -> None:
    """The box's lister hashes a declared output that is a link to a file as that file (the
    completion seal takes it so too). Before: the stream pulled it, but rsync (the default
    where both ends have it) skipped the link, so the whole pull failed on it: "missing"."""
    work, data = tmp_path / "work", tmp_path / "data"
    work.mkdir()
    data.mkdir()
    (data / "best.txt").write_text("")
    (work / "best.txt").symlink_to(data / "best.txt")
    (work / "job.py").write_text('open("best.txt", "w").write("best: step 3")\n')
    argv = [sys.executable, "job.py"]
    cli("run", "--name", RUN, "--output", "best.txt", "--", *argv, check=True, cwd=str(work))
    rec = _rec(None, cli.home, ssh_box)
    for transport in ["stream"] + (["rsync"] if shutil.which("rsync") else []):
        dest = str(tmp_path / f"dest-{transport}")
        receipt = pull(rec, dest, "box", transport=transport)
        assert {f.path for f in receipt.files} == {"outputs/best.txt", "logs/attempt-0001.log"}
        assert not os.path.islink(os.path.join(dest, "outputs", "best.txt"))
        assert _read(os.path.join(dest, "outputs", "best.txt")) == b"best: step 3", transport
        assert covers_newest(rec, receipt)
