"""A directory rgt makes is fsynced into its parent before anything is made durable inside it.

What a user relies on: a file that rgt reports sealed, restored or pulled is still there after
the box or the laptop loses power, and so is the directory that holds it. fsyncing the file
and its own directory is not enough when that directory is new: its entry lives in the parent,
which must be fsynced too (ext4's journal happens to order this; NFS, FUSE volumes and other
filesystems need not). The calls are the real ones, recorded in order (tests/dirsync.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from onbox.common.durable import make_dirs
from onbox.common.safepath import open_beneath, open_dir
from tests.conftest import ROOT, require
from tests.dirsync import DirSyncSpy

NOBODY = 65534


def test_open_beneath_fsyncs_the_parent_of_every_directory_it_makes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    os.mkdir(tmp_path / "a")  # exists already: not rgt's to sync
    spy = DirSyncSpy(monkeypatch)
    fd = open_beneath(
        str(tmp_path), "a/b/c/f", os.O_WRONLY | os.O_CREAT | os.O_EXCL, create_dirs=True
    )
    os.close(fd)
    made = spy.made(str(tmp_path))
    assert made == [str(tmp_path / "a" / "b"), str(tmp_path / "a" / "b" / "c")]
    assert spy.not_durable(str(tmp_path)) == []
    assert spy.events.index(("fsync", str(tmp_path / "a"))) > spy.events.index(("mkdir", made[0]))


def test_open_dir_without_create_makes_and_syncs_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    os.makedirs(tmp_path / "x" / "y")
    spy = DirSyncSpy(monkeypatch)
    os.close(open_dir(str(tmp_path), ["x", "y"], create=True))  # all there: nothing to make
    with pytest.raises(FileNotFoundError):
        open_dir(str(tmp_path), ["x", "z"])
    assert spy.events == []


def test_make_dirs_fsyncs_each_parent_oldest_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = DirSyncSpy(monkeypatch)
    created = make_dirs(str(tmp_path / "p" / "q" / "r"))
    assert created == [
        str(tmp_path / "p"),
        str(tmp_path / "p" / "q"),
        str(tmp_path / "p" / "q" / "r"),
    ]
    assert spy.made(str(tmp_path)) == created
    assert spy.not_durable(str(tmp_path)) == []
    # each parent is synced before the next directory is made inside it
    kinds = [e for e in spy.events if e[1].startswith(str(tmp_path))]
    assert kinds == [
        ("mkdir", created[0]),
        ("fsync", str(tmp_path)),
        ("mkdir", created[1]),
        ("fsync", created[0]),
        ("mkdir", created[2]),
        ("fsync", created[1]),
    ]


def test_make_dirs_under_a_parent_it_may_not_read_still_makes_them(tmp_path: Path) -> None:
    """A parent with mode -wx (write and enter, not read) cannot be opened to be fsynced; the
    directories are still made, as before, rather than failing a start. Run as another user
    (root reads everything)."""
    require(os.geteuid() == 0, "root, to run a process as another user")
    # This venv's Python may live under /root, which another user cannot enter.
    py = next((p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if os.path.isfile(p)), "")
    require(bool(py), "a system python3 that another user can run")
    base = tempfile.mkdtemp(prefix="rgt-t-wx-", dir="/tmp")  # tmp_path is root's alone (0700)
    try:
        os.chown(base, NOBODY, NOBODY)
        os.chmod(base, 0o333)
        code = (
            "import sys; from onbox.common.durable import make_dirs; print(make_dirs(sys.argv[1]))"
        )

        def as_nobody() -> None:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)

        out = subprocess.run(
            [py, "-c", code, os.path.join(base, "a", "b")],
            cwd=str(ROOT),
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            preexec_fn=as_nobody,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == str([os.path.join(base, "a"), os.path.join(base, "a", "b")])
        assert os.path.isdir(os.path.join(base, "a", "b"))
    finally:
        shutil.rmtree(base, ignore_errors=True)
