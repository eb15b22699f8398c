"""onbox.common.safepath: the one gate for paths from a box or a store, and its no-follow file
helpers.

Hostile names are refused with an IntegrityError (exit 6) that names the path and says why;
names that look odd but are plain file names (spaces, quotes, shell syntax, unicode, a newline)
are accepted unchanged. The helpers run against real directories with real symlinks, each
test twice: with the kernel's openat2 resolving the directories on the way in one call (Linux
5.6+), and with the walk of one component at a time that older kernels, sandboxes that forbid
openat2, and other systems get.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import List

import pytest

from onbox.common import safepath
from onbox.common.errors import IntegrityError
from onbox.common.safepath import (
    UnsafePath,
    conflicts,
    lstat_beneath,
    open_beneath,
    open_dir,
    replace_beneath,
    safe_abs,
    safe_join,
    safe_rel,
    unlink_beneath,
)
from tests.conftest import require


@pytest.fixture(autouse=True, params=["openat2", "walk"])
def resolver(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """How the directories on the way are opened in this run of the test."""
    if request.param == "walk":
        monkeypatch.setattr(safepath, "_openat2", None)
    else:
        require(safepath._openat2 is not None, "a Linux kernel with openat2 (5.6 or later)")
    return str(request.param)


HOSTILE = [
    pytest.param("../x", "'..' component", id="dotdot"),
    pytest.param("/etc/x", "absolute", id="absolute"),
    pytest.param("a/../../b", "'..' component", id="dotdot-inside"),
    pytest.param("a\\..\\b", "backslash", id="backslash"),
    pytest.param("a\x00b", "NUL", id="nul"),
    pytest.param("x" * 300, "300 bytes long", id="component-300"),
    pytest.param("/".join(["d" * 200] * 21), "bytes long (at most 4096)", id="total-4220"),
    pytest.param("", "empty", id="empty"),
    pytest.param(".", "'.' component", id="dot"),
    pytest.param("a/./b", "'.' component", id="dot-inside"),
    pytest.param("a//b", "empty component", id="double-slash"),
    pytest.param("a/", "empty component", id="trailing-slash"),
    pytest.param("..", "'..' component", id="dotdot-alone"),
    pytest.param("a\x1b[2Jb", "control character", id="escape"),
    pytest.param("a\rb", "control character", id="cr"),
    pytest.param("a\x7fb", "control character", id="del"),
    pytest.param("a\x85b", "control character", id="c1"),
    pytest.param("a\ud800b", "lone surrogate", id="lone-surrogate"),
    pytest.param("é" * 128, "256 bytes long", id="component-256-bytes-in-utf8"),
]

FINE = [
    "a 0",
    "a'; echo pwned",
    '-odd dir/we\'ird "name" $(touch pwned);\nx.txt',  # the name test_pull seals and pulls
    "step_7/model.safetensors",
    "模型/權重.pt",
    "ünïcödé/naïve café.bin",
    "emoji 🚀.pt",
    "tab\there",
    "...",  # a name, not a component trick
    ".hidden/..x/x..",
    "x" * 255,
    "/".join(["d" * 200] * 20),  # 4019 bytes: under the total cap
    "\udcff-undecodable-byte",  # a non-UTF-8 byte as os.fsdecode gives it: round-trips
]


@pytest.mark.parametrize("path,why", HOSTILE)
def test_hostile_names_are_refused_with_the_name_and_why(path: str, why: str) -> None:
    with pytest.raises(UnsafePath) as info:
        safe_rel(path, "store key")
    err = info.value
    assert isinstance(err, IntegrityError) and err.exit_code == 6
    assert err.what.startswith("store key ") and why in err.what, err.what
    assert err.path == path
    shown = repr(path) if len(path) <= 160 else repr(path[:120])
    assert shown in err.what
    assert "\n" not in err.line() and len(err.line()) < 400  # one readable line, even for 4 KiB


@pytest.mark.parametrize("path", FINE)
def test_fine_names_round_trip_unchanged(path: str) -> None:
    assert safe_rel(path) == path
    assert safe_join("/base", path) == os.path.join("/base", *path.split("/"))


def test_fine_names_round_trip_through_a_real_directory(tmp_path: Path) -> None:
    """Each fine name is created, renamed into place and read back under its own name."""
    base = str(tmp_path)
    for i, path in enumerate(p for p in FINE if len(p) < 1000):
        stage, final = f"stage/{i}", f"dest/{path}"
        fd = open_beneath(base, stage, os.O_WRONLY | os.O_CREAT | os.O_EXCL, create_dirs=True)
        os.write(fd, path.encode("utf-8", "surrogateescape"))
        os.close(fd)
        replace_beneath(base, stage, base, final)
        with open(safe_join(base, final), "rb") as f:
            assert f.read() == path.encode("utf-8", "surrogateescape")


@pytest.mark.parametrize("value", [None, 3, b"a", ["a"]])
def test_a_path_that_is_not_a_string_is_refused(value: object) -> None:
    with pytest.raises(UnsafePath, match="not a string"):
        safe_rel(value)


@pytest.mark.parametrize(
    "path,ok",
    [
        ("/root/.rgt/runs/r/ckpt", True),
        ("/", False),
        ("relative/dir", False),
        ("/../../../../some/laptop/dir", False),
        ("/a/./b", False),
        ("/a/b/", False),
        ("/a\x00b", False),
    ],
)
def test_safe_abs_accepts_only_normalised_absolute_paths(path: str, ok: bool) -> None:
    if ok:
        assert safe_abs(path, "ckpt_dir") == path
    else:
        with pytest.raises(UnsafePath) as info:
            safe_abs(path, "ckpt_dir")
        assert repr(path) in info.value.what and info.value.exit_code == 6


def test_conflicts_finds_a_file_that_is_also_a_directory_on_the_way() -> None:
    assert conflicts(["a/b", "c", "a/b/d"]) == ("a/b", "a/b/d")
    assert conflicts(["a/b", "a/c", "ab/c", "a/b"]) is None


# ---- the no-follow helpers, against real symlinks


def _tree(tmp_path: Path) -> str:
    base = tmp_path / "base"
    (base / "d").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "victim").write_bytes(b"laptop bytes")
    os.symlink(str(tmp_path / "outside"), str(base / "linkdir"))
    os.symlink(str(tmp_path / "outside" / "victim"), str(base / "d" / "linkfile"))
    os.symlink(str(tmp_path / "nowhere"), str(base / "d" / "dangling"))
    (base / "file").write_bytes(b"f")
    return str(base)


def _victim(tmp_path: Path) -> bytes:
    return (tmp_path / "outside" / "victim").read_bytes()


@pytest.mark.parametrize(
    "rel", ["linkdir/victim", "linkdir/new", "d/linkfile", "d/dangling"], ids=lambda r: r
)
def test_no_helper_writes_through_a_symlink(tmp_path: Path, rel: str) -> None:
    base = _tree(tmp_path)
    for flags in (os.O_WRONLY | os.O_CREAT | os.O_TRUNC, os.O_WRONLY | os.O_APPEND):
        with pytest.raises(UnsafePath, match="is a symlink"):
            open_beneath(base, rel, flags)
    with pytest.raises((UnsafePath, FileExistsError)):  # O_EXCL: any existing name
        open_beneath(base, rel, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    (tmp_path / "src").write_bytes(b"box bytes")
    with pytest.raises(UnsafePath, match="is a symlink"):
        replace_beneath(str(tmp_path), "src", base, rel)
    assert _victim(tmp_path) == b"laptop bytes"
    assert sorted(os.listdir(tmp_path / "outside")) == ["victim"]


def test_a_symlink_between_two_directories_on_the_way_is_refused(tmp_path: Path) -> None:
    """Not only the last directory: ``d/mid`` links out, and ``d/mid/sub`` exists out there."""
    base = _tree(tmp_path)
    (tmp_path / "outside" / "sub").mkdir()
    (tmp_path / "outside" / "sub" / "secret").write_bytes(b"laptop bytes")
    os.symlink(str(tmp_path / "outside"), os.path.join(base, "d", "mid"))
    with pytest.raises(UnsafePath, match="mid is a symlink"):
        os.close(open_dir(base, ["d", "mid", "sub"]))
    with pytest.raises(UnsafePath, match="mid is a symlink"):
        open_beneath(base, "d/mid/sub/secret", os.O_RDONLY)
    with pytest.raises(UnsafePath, match="mid is a symlink"):
        open_beneath(base, "d/mid/sub/new", os.O_WRONLY | os.O_CREAT, create_dirs=True)
    with pytest.raises(UnsafePath, match="mid is a symlink"):
        lstat_beneath(base, "d/mid/sub/secret")
    (tmp_path / "src").write_bytes(b"box bytes")
    with pytest.raises(UnsafePath, match="mid is a symlink"):
        replace_beneath(str(tmp_path), "src", base, "d/mid/sub/secret")
    assert sorted(os.listdir(tmp_path / "outside" / "sub")) == ["secret"]
    assert (tmp_path / "outside" / "sub" / "secret").read_bytes() == b"laptop bytes"


def test_reading_and_stat_do_not_follow_either(tmp_path: Path) -> None:
    base = _tree(tmp_path)
    with pytest.raises(UnsafePath, match="linkdir is a symlink"):
        open_beneath(base, "linkdir/victim", os.O_RDONLY)
    with pytest.raises(UnsafePath, match="linkdir is a symlink"):
        lstat_beneath(base, "linkdir/victim")
    with pytest.raises(UnsafePath, match="is a symlink"):
        os.close(open_dir(base, ["linkdir"]))
    st = lstat_beneath(base, "d/dangling")  # the link itself, not an error, not its target
    assert st is not None and os.path.islink(os.path.join(base, "d", "dangling"))
    assert lstat_beneath(base, "d/missing") is None
    assert lstat_beneath(base, "missing/x") is None
    with pytest.raises(NotADirectoryError):
        lstat_beneath(base, "file/x")


def test_unlink_removes_a_symlink_itself_and_never_through_a_linked_dir(tmp_path: Path) -> None:
    base = _tree(tmp_path)
    assert unlink_beneath(base, "d/linkfile")
    assert not os.path.lexists(os.path.join(base, "d", "linkfile"))
    with pytest.raises(UnsafePath):
        unlink_beneath(base, "linkdir/victim")
    assert _victim(tmp_path) == b"laptop bytes"
    assert not unlink_beneath(base, "d/never")


def test_directories_made_on_the_way_are_reported(tmp_path: Path) -> None:
    made: List[str] = []
    fd = open_beneath(
        str(tmp_path),
        "a/b/c",
        os.O_WRONLY | os.O_CREAT | os.O_EXCL,
        create_dirs=True,
        dir_mode=0o700,
        made=made,
    )
    os.close(fd)
    assert made == [str(tmp_path / "a"), str(tmp_path / "a" / "b")]
    assert (os.stat(made[0]).st_mode & 0o777) == 0o700


def test_open_regular_refuses_links_fifos_and_sockets_without_blocking(tmp_path: Path) -> None:
    """A file listed as regular may be replaced before it is read: the read must not follow a
    link out of the checkpoint, nor wait forever on a FIFO with no writer."""
    import socket

    real = tmp_path / "real"
    real.write_bytes(b"bytes")
    os.symlink(str(real), str(tmp_path / "link"))
    os.mkfifo(str(tmp_path / "fifo"))
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "sock"))
    try:
        for name, kind in (("link", "a symlink"), ("fifo", "a FIFO"), ("sock", "a socket")):
            with pytest.raises(safepath.NotRegularFile, match=f"is {kind}, not a regular file"):
                safepath.open_regular(str(tmp_path / name))
    finally:
        sock.close()
    fd = safepath.open_regular(str(real))
    try:
        assert os.read(fd, 10) == b"bytes"
    finally:
        os.close(fd)


def test_open_regular_reopens_this_process_own_descriptor_through_proc(tmp_path: Path) -> None:
    # A pod's outputs reach the uploader as /proc/self/fd/N (onbox/agent/jobroot.py: opened
    # with the checks already); that path is a link by nature, and refusing it as one left
    # every pod output unsealed and the agent dead at completion.
    real = tmp_path / "out.bin"
    real.write_bytes(b"out")
    own = os.open(str(real), os.O_RDONLY)
    fifo = tmp_path / "fifo"
    os.mkfifo(str(fifo))
    pipe = os.open(str(fifo), os.O_RDONLY | os.O_NONBLOCK)
    try:
        fd = safepath.open_regular(f"/proc/self/fd/{own}")
        with os.fdopen(fd, "rb") as f:
            assert f.read() == b"out"
        with pytest.raises(safepath.NotRegularFile, match="a FIFO"):
            safepath.open_regular(f"/proc/self/fd/{pipe}")  # still only a regular file
        link = tmp_path / "link"
        link.symlink_to(f"/proc/self/fd/{own}")
        with pytest.raises(safepath.NotRegularFile, match="a symlink"):
            safepath.open_regular(str(link))  # only the path itself, not a link to it
    finally:
        os.close(own)
        os.close(pipe)
