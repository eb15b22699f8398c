"""Pushing code to the box (controller/deploy/release.py) over a real sshd on loopback and to
``local``.

The box is this machine (loopback), so what arrived is checked by reading the box's files
directly. Covered:

- which files a project has: git's tracked + untracked-not-ignored files; every file of a plain
  tree except VCS metadata, caches, venvs and rgt's state; links inside kept, outside refused;
- hostile file names and a hostile RGT_HOME arrive byte for byte, with rsync and with tar;
- a second push of unchanged code moves nothing; a changed file is the only one sent (the rest are
  copied on the box from the previous release: copies, not hard links, so a job that rewrites a
  file of its release in place leaves the other release alone);
- a push cut off halfway (the rsync client killed, or the whole controller killed) leaves
  ``current`` on the old release and nothing under ``releases/<new id>``; the leftover
  temporary directory is removed by a later push once it is stale, and kept while it may be live;
- ``current`` switches atomically (a reader never sees a missing or half release) and only to a
  complete release; two pushes of the same code at once make one release.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import pytest

from controller.deploy.project import project_files
from controller.deploy.release import (
    MARKER,
    PushResult,
    current_release,
    push_release,
    switch_current,
)
from controller.remote import LocalRemote, Remote, SshRemote
from controller.target import Target
from onbox.agent import procfs
from onbox.common.errors import HostError, RemoteUnreachable, UsageError
from tests.conftest import ROOT
from tests.polling import wait
from tests.sshd import SshServer

TIMEOUT = 30.0

# Every name a file system allows that a shell, rsync or tar could get wrong.
HOSTILE = [
    "plain.py",
    "with space.txt",
    "quote'single",
    'quote"double',
    "semi;colon",
    "new\nline",
    "$(touch pwned)",
    "`touch pwned2`",
    "-leading-dash",
    "--rsync-option=evil",
    "back\\slash",
    "tab\there",
    "star*glob?[x]",
    "trailing space ",
    ".hidden",
    "ünïcödé.txt",
    os.fsdecode(b"latin1-\xff\xfe"),  # not UTF-8
    "dir with space/nested -x/file;1",
    "-dir/$(x)/a",
]
HOSTILE_HOME = "box home 'q' \"dq\" $(touch pwned); `x` -n"


def _sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _tree(root: str) -> Dict[str, Tuple[str, str]]:
    """relative path -> (kind, sha256 or link target) of everything under root but the marker."""
    out = {}
    for here, dirs, files in os.walk(root):
        for name in list(dirs):
            if os.path.islink(os.path.join(here, name)):
                files.append(name)
        for name in files:
            path = os.path.join(here, name)
            rel = os.path.relpath(path, root)
            if rel == MARKER:
                continue
            if os.path.islink(path):
                out[rel] = ("link", os.readlink(path))
            else:
                kind = "exec" if os.stat(path).st_mode & 0o100 else "file"
                out[rel] = (kind, _sha(path))
    return out


def _write(root: Path, rel: str, data: bytes, mode: int = 0o644) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    path.chmod(mode)


def _hostile_project(root: Path) -> None:
    for i, name in enumerate(HOSTILE):
        _write(root, name, f"{i}: {name!r}\n".encode(errors="surrogateescape"))
    _write(root, "run me.sh", b"#!/bin/sh\necho hi\n", 0o755)
    os.symlink("with space.txt", root / "link to 'space'")
    os.symlink("dir with space", root / "dir link")


class Box:
    """A box to push to: a Remote and its RGT_HOME (on this machine, so checkable directly)."""

    def __init__(self, remote: Remote, home: str) -> None:
        self.remote = remote
        self.home = home

    def releases(self) -> List[str]:
        d = os.path.join(self.home, "releases")
        return sorted(os.listdir(d)) if os.path.isdir(d) else []

    def complete(self) -> List[str]:
        return [r for r in self.releases() if os.path.exists(self.release(r, MARKER))]

    def temps(self) -> List[str]:
        return [r for r in self.releases() if r.startswith(".tmp-")]

    def release(self, rid: str, *parts: str) -> str:
        return os.path.join(self.home, "releases", rid, *parts)


def _ssh_remote(sshd: SshServer) -> SshRemote:
    return SshRemote(
        Target("ssh", host="127.0.0.1", port=sshd.port, user=sshd.user, identity=sshd.client_key)
    )


@pytest.fixture(params=["ssh", "local"])
def box(
    request: pytest.FixtureRequest, tmp_path: Path, controller_env: Dict[str, str]
) -> Iterator[Box]:
    home = str(tmp_path / HOSTILE_HOME)
    if request.param == "local":
        yield Box(LocalRemote(), home)
        return
    remote = _ssh_remote(request.getfixturevalue("sshd"))
    try:
        yield Box(remote, home)
    finally:
        remote.close()


@pytest.fixture
def ssh_box(sshd: SshServer, tmp_path: Path, controller_env: Dict[str, str]) -> Iterator[Box]:
    remote = _ssh_remote(sshd)
    try:
        yield Box(remote, str(tmp_path / HOSTILE_HOME))
    finally:
        remote.close()


# --- which files ---------------------------------------------------------------------------------


def _git(root: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-C", str(root), *args],
        check=True,
        capture_output=True,
        timeout=60,
        env={**os.environ, "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_CONFIG_NOSYSTEM": "1"},
    )


def test_project_files_of_a_git_work_tree(tmp_path: Path) -> None:
    root = tmp_path / "proj"
    _write(root, "tracked.py", b"1")
    _write(root, "gone.py", b"2")
    _write(root, "sub dir/tracked-x", b"3")
    _write(root, ".gitignore", b"ignored/\n*.ckpt\n")
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "x")
    (root / "gone.py").unlink()  # tracked but deleted: skipped
    _write(root, "untracked new.py", b"4")
    _write(root, "new dir/deep/file", b"5")
    _write(root, "ignored/big.bin", b"6")
    _write(root, "model.ckpt", b"7")
    _write(root, "new\nline", b"8")
    assert project_files(str(root)) == [
        ".gitignore",
        "new\nline",  # sorted as bytes
        "new dir/deep/file",
        "sub dir/tracked-x",
        "tracked.py",
        "untracked new.py",
    ]


def test_project_files_of_a_plain_tree(tmp_path: Path) -> None:
    root = tmp_path / "proj"
    for rel in [
        "a.py",
        "pkg/b.py",
        ".git/config",  # not a work tree (no HEAD): still never pushed
        "__pycache__/a.cpython-311.pyc",
        "pkg/__pycache__/b.pyc",
        ".venv/bin/python",
        ".venv-old/lib/x",
        ".rgt/state.json",
        ".env.example",
    ]:
        _write(root, rel, b"x")
    os.symlink("a.py", root / "inside")
    os.symlink("pkg", root / "pkg link")
    os.mkfifo(root / "fifo")
    # not a git work tree, although it has a .git: git refuses it
    (root / ".git").rename(root / ".git-not")
    assert project_files(str(root)) == [
        ".env.example",
        ".git-not/config",
        "a.py",
        "inside",
        "pkg link",
        "pkg/b.py",
    ]


def test_a_directory_that_ignores_itself_is_left_out_of_a_plain_tree_as_git_would(
    tmp_path: Path,
) -> None:
    """`rgt pull`'s rgt-results (and a .pytest_cache, a .mypy_cache) hold a ``.gitignore`` of
    ``*``: git leaves them out, and so does a project outside git. Before, every pulled
    checkpoint, receipt and log of a plain project went back to the box in the next release."""
    root = tmp_path / "proj"
    _write(root, "train.py", b"1")
    _write(root, "rgt-results/.gitignore", b"# Made by `rgt pull`\n*\n")
    _write(root, "rgt-results/r1/checkpoints/step_1.pt", b"2")
    _write(root, "sub/.pytest_cache/.gitignore", b"*")
    _write(root, "sub/.pytest_cache/v/cache/lastfailed", b"3")
    _write(root, "data/.gitignore", b"*\n!keep.txt\n")  # not all of it: walked
    _write(root, "data/keep.txt", b"4")
    _write(root, "logs/.gitignore", b"")  # empty: ignores nothing
    _write(root, "logs/a.log", b"5")
    assert project_files(str(root)) == [
        "data/.gitignore",
        "data/keep.txt",
        "logs/.gitignore",
        "logs/a.log",
        "train.py",
    ]
    _git(root, "init", "-q")  # in git: the same two directories left out, by git
    in_git = project_files(str(root))
    assert "train.py" in in_git and not [f for f in in_git if "rgt-results" in f or "cache" in f]


def test_rgt_state_is_never_pushed_from_a_git_work_tree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # git lists an un-ignored .rgt/ as untracked (and a committed one as tracked): the box would
    # get the laptop's registry, receipts or a `local` box's runs and secrets.
    root = tmp_path / "proj"
    _write(root, "train.py", b"1")
    _write(root, ".rgt/committed.json", b"2")
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "x")
    _write(root, ".rgt/runs/r/state.json", b"3")
    _write(root, ".rgt/secrets/r", b"4")
    _write(root, ".rgt-demo/box/runs/x", b"5")
    _write(root, "sub/.rgt/x", b"6")
    _write(root, "state/ctl/runs.json", b"7")  # RGT_CONTROLLER_HOME, inside the project
    _write(root, "boxhome/releases/x", b"8")  # RGT_BOX_HOME, inside the project
    _write(root, ".rgt.py", b"9")  # a file that only looks like it: pushed
    monkeypatch.setenv("RGT_CONTROLLER_HOME", str(root / "state" / "ctl"))
    monkeypatch.setenv("RGT_BOX_HOME", str(root / "boxhome"))
    assert project_files(str(root)) == [".rgt.py", "train.py"]
    (root / ".git").rename(root / ".git-not")  # the same outside git
    assert project_files(str(root)) == [".git-not/" + f for f in _git_files(root)] + [
        ".rgt.py",
        "train.py",
    ]


def _git_files(root: Path) -> List[str]:
    base = root / ".git-not"
    return sorted(
        os.path.relpath(os.path.join(here, f), base) for here, _, fs in os.walk(base) for f in fs
    )


def _dir_modes(home: str) -> Dict[str, str]:
    out = {}
    for here, dirs, _ in os.walk(home):
        for d in [".", *dirs] if here == home else dirs:
            path = os.path.normpath(os.path.join(here, d))
            if not os.path.islink(path):
                out[os.path.relpath(path, home)] = oct(os.stat(path).st_mode & 0o777)
    return out


@pytest.mark.parametrize("method", ["rsync", "tar"])
def test_releases_and_rgt_directories_on_the_box_are_0700(
    box: Box, tmp_path: Path, method: str
) -> None:
    # A release was chmod 755 and rgt's directories 0755 (mkdir -p under umask 022): on a shared
    # box every user could read the code. The project's own directories are 0755 here.
    proj = tmp_path / "proj"
    _write(proj, "a.py", b"x")
    _write(proj, "pkg/b.py", b"y")
    proj.chmod(0o755)
    old = os.umask(0o022)
    try:
        res = push_release(box.remote, str(proj), box.home, method=method, name="run-1")
        switch_current(box.remote, box.home, "run-1", res.id)
    finally:
        os.umask(old)
    modes = _dir_modes(box.home)
    rid = res.id
    for d in (".", "releases", f"releases/{rid}", "deploys", "deploys/run-1"):
        assert modes[d] == "0o700", (d, modes)


@pytest.mark.parametrize("target", ["../outside.txt", "/etc/passwd", "sub/../../outside.txt"])
def test_a_link_out_of_the_project_is_refused_by_name(tmp_path: Path, target: str) -> None:
    root = tmp_path / "proj"
    _write(root, "a.py", b"x")
    _write(tmp_path, "outside.txt", b"secret")
    (root / "sub").mkdir()
    os.symlink(target, root / "bad link")
    with pytest.raises(UsageError) as e:
        project_files(str(root))
    assert e.value.field == "project"
    assert "'bad link'" in str(e.value) and target in str(e.value)


def test_an_absolute_link_into_the_project_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "proj"
    _write(root, "a.py", b"x")
    os.symlink(str(root / "a.py"), root / "abs")
    with pytest.raises(UsageError, match="'abs'"):
        project_files(str(root))


# --- byte for byte -------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["rsync", "tar"])
def test_hostile_names_arrive_byte_for_byte(
    box: Box, tmp_path: Path, method: str, sshd: SshServer
) -> None:
    proj = tmp_path / "proj"
    _hostile_project(proj)
    files = project_files(str(proj))
    assert len(files) == len(HOSTILE) + 3
    res = push_release(box.remote, str(proj), box.home, method=method)
    assert res.method == method
    assert res.path == box.release(res.id)
    assert box.complete() == [res.id] and box.temps() == []
    assert _tree(res.path) == _tree(str(proj))
    assert res.transferred_files == len(HOSTILE) + 1  # regular files; the two links carry none
    assert res.transferred_bytes == sum(
        os.path.getsize(proj / f) for f in files if not os.path.islink(proj / f)
    )
    marker = json.loads(Path(res.path, MARKER).read_text())
    assert marker["id"] == res.id and marker["files"] == len(files)
    # nothing was run by a shell: no command substitution happened anywhere
    for d in (os.path.expanduser("~"), sshd.home, os.getcwd(), str(tmp_path), box.home):
        assert not os.path.exists(os.path.join(d, "pwned"))
        assert not os.path.exists(os.path.join(d, "pwned2"))
    switch_current(box.remote, box.home, "run-1", res.id)
    assert os.readlink(os.path.join(box.home, "deploys", "run-1", "current")) == (
        f"../../releases/{res.id}"
    )
    assert current_release(box.remote, box.home, "run-1") == res.id


def test_the_same_code_has_the_same_id_by_either_method(box: Box, tmp_path: Path) -> None:
    proj = tmp_path / "proj"
    _hostile_project(proj)
    a = push_release(box.remote, str(proj), box.home, method="tar")
    b = push_release(box.remote, str(proj), box.home, method="rsync")
    assert (a.method, b.method, a.id) == ("tar", "existing", b.id)


# --- moving nothing, then only what changed ------------------------------------------------------


def _many_files(root: Path, n: int = 40) -> None:
    for i in range(n):
        _write(root, f"pkg/mod_{i:02d}.py", f"# module {i}\n".encode() * 50)


def test_a_second_push_of_unchanged_code_moves_nothing(box: Box, tmp_path: Path) -> None:
    proj = tmp_path / "proj"
    _many_files(proj)
    first = push_release(box.remote, str(proj), box.home)
    assert first.method == "rsync" and first.transferred_files == 40
    marker = Path(first.path, MARKER)
    stamp = marker.stat().st_mtime_ns
    again = push_release(box.remote, str(proj), box.home, name="run-1")
    assert again == PushResult(first.id, first.path, 0, 0, "existing")
    assert marker.stat().st_mtime_ns == stamp and box.releases() == [first.id]


@pytest.mark.parametrize("method", ["rsync", "tar"])
def test_a_changed_file_makes_a_new_release(ssh_box: Box, tmp_path: Path, method: str) -> None:
    box = ssh_box
    proj = tmp_path / "proj"
    _many_files(proj)
    old = push_release(box.remote, str(proj), box.home, method=method)
    switch_current(box.remote, box.home, "run-1", old.id)
    _write(proj, "pkg/mod_07.py", b"changed\n")
    new = push_release(box.remote, str(proj), box.home, name="run-1", method=method)
    assert new.id != old.id and box.complete() == sorted([old.id, new.id])
    assert _tree(new.path) == _tree(str(proj))
    assert Path(old.path, "pkg/mod_07.py").read_bytes() == b"# module 7\n" * 50  # untouched
    if method == "rsync":
        assert (new.transferred_files, new.transferred_bytes) == (1, len(b"changed\n"))
        # Not sent, and not a hard link either: rewriting it in place leaves the old release's.
        with open(Path(new.path, "pkg/mod_00.py"), "w") as f:
            f.write("rewritten by a job\n")
        assert Path(old.path, "pkg/mod_00.py").read_bytes() == b"# module 0\n" * 50
    else:
        assert new.transferred_files == 40  # tar has no previous release to link from
    assert current_release(box.remote, box.home, "run-1") == old.id  # until switched
    switch_current(box.remote, box.home, "run-1", new.id)
    assert current_release(box.remote, box.home, "run-1") == new.id


# --- cut off halfway -----------------------------------------------------------------------------


def _descendants(pid: int) -> List[procfs.Identity]:
    """Live processes below ``pid``, children first."""
    out: List[procfs.Identity] = []
    frontier = [pid]
    while frontier:
        parent = frontier.pop(0)
        for p in procfs.pids():
            st = procfs.read_stat(p)
            if st is not None and st.ppid == parent and st.state not in ("Z", "X"):
                ident = procfs.identity(p)
                if ident is not None:
                    out.append(ident)
                    frontier.append(p)
    return out


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _parent(pid: int) -> Optional[int]:
    st = procfs.read_stat(pid)
    return st.ppid if st is not None else None


def _wait_partial(box: Box, timeout: float = TIMEOUT) -> str:
    """Until a push in progress has part of the big file on the box; its temporary directory."""

    def partial() -> Optional[str]:
        for t in box.temps():
            for here, _, files in os.walk(box.release(t)):
                for f in files:
                    if "big" in f and os.path.getsize(os.path.join(here, f)) > 0:
                        return t
        return None

    found: str = wait(partial, timeout, f"a partial upload under {box.home}/releases", poll=0.02)
    return found


def _with_big_file(proj: Path) -> None:
    _write(proj, "data/big.bin", os.urandom(6 << 20))


SLOW = ["--bwlimit=1000"]  # 1000 KiB/s: the 6 MiB file takes about six seconds


def test_killing_rsync_midway_leaves_the_old_release(ssh_box: Box, tmp_path: Path) -> None:
    box = ssh_box
    proj = tmp_path / "proj"
    _many_files(proj)
    old = push_release(box.remote, str(proj), box.home)
    switch_current(box.remote, box.home, "run-1", old.id)
    _with_big_file(proj)
    outcome: List[BaseException] = []

    def push() -> None:
        try:
            push_release(box.remote, str(proj), box.home, name="run-1", rsync_options=SLOW)
        except BaseException as e:
            outcome.append(e)

    t = threading.Thread(target=push)
    t.start()
    try:
        _wait_partial(box)
        # the client only: the box's rsync is below the test sshd, also a child of this process
        rsyncs = [
            i
            for i in _descendants(os.getpid())
            if _comm(i.pid) == "rsync" and _parent(i.pid) == os.getpid()
        ]
        assert rsyncs, "no rsync client found"
        for ident in rsyncs:
            os.kill(ident.pid, signal.SIGKILL)
    finally:
        t.join(TIMEOUT)
    assert not t.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], (RemoteUnreachable, HostError)), outcome
    assert current_release(box.remote, box.home, "run-1") == old.id
    assert box.complete() == [old.id] and box.releases() == [old.id]  # its temp dir removed
    assert _tree(old.path) == {k: v for k, v in _tree(str(proj)).items() if "big" not in k}
    # deploy again: the new release, complete
    new = push_release(box.remote, str(proj), box.home, name="run-1")
    assert new.transferred_files == 1 and box.complete() == sorted([old.id, new.id])
    assert _tree(new.path) == _tree(str(proj))


def _push_in_child(box: Box, proj: Path, env: Dict[str, str]) -> subprocess.Popen[bytes]:
    code = (
        "import sys; from controller.remote import SshRemote; from controller.target import Target;"
        "from controller.deploy.release import push_release;"
        "r = SshRemote(Target('ssh', host='127.0.0.1', port=int(sys.argv[1]), user=sys.argv[2],"
        " identity=sys.argv[3]));"
        "push_release(r, sys.argv[4], sys.argv[5], rsync_options=['--bwlimit=1000'])"
    )
    assert isinstance(box.remote, SshRemote)
    t = box.remote.target
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            code,
            str(t.port),
            t.user or "",
            t.identity or "",
            str(proj),
            box.home,
        ],
        cwd=ROOT,
        env={**os.environ, **env},
        stdin=subprocess.DEVNULL,
    )


def _kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the controller first (so that it cannot clean up), then what it started."""
    below = _descendants(proc.pid)
    proc.kill()
    proc.wait(TIMEOUT)
    for ident in below:
        if procfs.is_alive(ident):
            os.kill(ident.pid, signal.SIGKILL)


def test_a_killed_controller_leaves_no_half_release_and_its_leftover_is_swept(
    ssh_box: Box, tmp_path: Path, controller_env: Dict[str, str]
) -> None:
    box = ssh_box
    proj = tmp_path / "proj"
    _many_files(proj)
    old = push_release(box.remote, str(proj), box.home)
    switch_current(box.remote, box.home, "run-1", old.id)
    _with_big_file(proj)
    child = _push_in_child(box, proj, controller_env)
    try:
        tmp = _wait_partial(box)
    finally:
        _kill_tree(child)
    new_id = tmp.split("-")[1]
    assert not os.path.exists(box.release(new_id))
    assert current_release(box.remote, box.home, "run-1") == old.id
    assert box.complete() == [old.id] and box.temps() == [tmp]
    # A later push leaves a temporary directory that may still be live alone...
    new = push_release(box.remote, str(proj), box.home, name="run-1")
    assert new.id == new_id and box.temps() == [tmp]
    switch_current(box.remote, box.home, "run-1", new.id)
    assert _tree(new.path) == _tree(str(proj))
    # ...and removes it once it is stale (here: at once)
    _write(proj, "pkg/mod_00.py", b"again\n")
    push_release(box.remote, str(proj), box.home, name="run-1", stale_after_min=0)
    assert box.temps() == []


# --- the current link ----------------------------------------------------------------------------


def test_current_switches_atomically(box: Box, tmp_path: Path) -> None:
    ids = []
    for i in range(2):
        proj = tmp_path / f"proj{i}"
        _write(proj, "version.txt", str(i).encode())
        ids.append(push_release(box.remote, str(proj), box.home).id)
    current = os.path.join(box.home, "deploys", "run-1", "current")
    switch_current(box.remote, box.home, "run-1", ids[0])
    stop = threading.Event()
    seen: Dict[str, int] = {}
    bad: List[Optional[str]] = []

    def read() -> None:
        while not stop.is_set():
            try:
                text = Path(current, "version.txt").read_text()
                json.loads(Path(current, MARKER).read_text())
                seen[text] = seen.get(text, 0) + 1
            except (OSError, ValueError) as e:
                bad.append(repr(e))
            time.sleep(0.001)  # leave the switching thread the GIL

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(6):
            switch_current(box.remote, box.home, "run-1", ids[(i + 1) % 2])
    finally:
        stop.set()
        reader.join(TIMEOUT)
    assert bad == [] and set(seen) <= {"0", "1"}
    assert current_release(box.remote, box.home, "run-1") == ids[0]
    assert os.listdir(os.path.dirname(current)) == ["current"]  # no temporary link left


def test_switch_refuses_what_is_not_a_complete_release(box: Box, tmp_path: Path) -> None:
    proj = tmp_path / "proj"
    _write(proj, "a.py", b"x")
    res = push_release(box.remote, str(proj), box.home)
    os.makedirs(box.release("0123456789abcdef"))  # no marker: not complete
    with pytest.raises(HostError, match="no complete release"):
        switch_current(box.remote, box.home, "run-1", "0123456789abcdef")
    for name in ["a;b", "-rf", "../x", "A b", "$(x)", "new\nline", ""]:
        with pytest.raises(UsageError) as e:
            switch_current(box.remote, box.home, name, res.id)
        assert e.value.field == "name"
    with pytest.raises(UsageError) as e:
        switch_current(box.remote, box.home, "run-1", "../../etc")
    assert e.value.field == "release"
    with pytest.raises(UsageError) as e:
        push_release(box.remote, str(proj), "relative/home")
    assert e.value.field == "RGT_HOME"
    assert current_release(box.remote, box.home, "run-1") is None


def test_two_pushes_of_the_same_code_at_once_make_one_release(ssh_box: Box, tmp_path: Path) -> None:
    box = ssh_box
    proj = tmp_path / "proj"
    _many_files(proj)
    results: List[PushResult] = []
    errors: List[BaseException] = []

    def push() -> None:
        try:
            results.append(push_release(box.remote, str(proj), box.home))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=push) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert errors == [] and len(results) == 3
    assert len({r.id for r in results}) == 1
    assert box.releases() == [results[0].id]  # one release, no temporary directory left
    assert _tree(results[0].path) == _tree(str(proj))
