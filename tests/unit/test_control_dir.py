"""The ssh control directory (controller/controldir.py ``control_dir``): rgt's own, 0700, checked
before each use, on the real file system.

- a short controller home: ``HOME/cm``, made 0700; one that is open to others, a symlink, not a
  directory or someone else's is refused (UsageError, exit 2) naming it and what to do;
- a home too long for a socket path: a private mkdtemp directory under /tmp, recorded in the home
  and used again; one that no longer checks (replaced by a 0777 directory, a symlink, another
  user's, or a record pointing elsewhere) is left alone and a fresh one made; ``close`` removes it;
- each socket's name (``control_path``): short enough for any target, and one per identity and
  route (key, agent, jump, user, host, port, ssh configuration), the same for the same target.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import stat
import threading
from pathlib import Path
from typing import Callable, Iterator, List

import pytest

from controller import controldir
from controller.remote import SshRemote
from controller.target import Target
from onbox.common.errors import UsageError
from tests.conftest import require

NOBODY = 65534


def _remote(home: str) -> SshRemote:
    # No connection is made: the constructor only sets up the directory and ssh's options.
    return SshRemote(Target("ssh", host="127.0.0.1", port=22), home=home)


@pytest.fixture
def made() -> Iterator[Callable[[str], str]]:
    """``made(home)``: the control directory of a remote for ``home``; any under /tmp is removed
    at the end."""
    dirs: List[str] = []

    def control_dir(home: str) -> str:
        d = _remote(home).control_dir
        if d.startswith("/tmp/"):
            dirs.append(d)
        return d

    yield control_dir
    for d in dirs:
        if os.path.islink(d):
            os.unlink(d)
        else:
            shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def short_home() -> Iterator[str]:
    """A controller home short enough for its own ``cm`` (tmp_path is too long on most
    machines), under /tmp; removed at the end."""
    home = f"/tmp/rgt-t-{os.getpid()}-{os.urandom(3).hex()}"
    assert len(os.path.join(home, "cm")) <= controldir.CONTROL_DIR_MAX
    try:
        yield home
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _private(d: str) -> None:
    st = os.lstat(d)
    assert stat.S_ISDIR(st.st_mode)
    assert st.st_uid == os.getuid()
    assert stat.S_IMODE(st.st_mode) == 0o700


def test_short_home_uses_its_own_cm(short_home: str, made: Callable[[str], str]) -> None:
    d = made(short_home)
    assert d == os.path.join(short_home, "cm")
    _private(d)
    assert made(short_home) == d  # and again


@pytest.mark.parametrize("case", ["mode-0755", "mode-0777", "symlink", "file", "other-owner"])
def test_short_home_refuses_a_cm_it_cannot_trust(
    short_home: str, tmp_path: Path, made: Callable[[str], str], case: str
) -> None:
    cm = os.path.join(short_home, "cm")
    os.makedirs(short_home, mode=0o700)
    if case.startswith("mode-"):
        os.mkdir(cm)
        os.chmod(cm, int(case[5:], 8))
        why = "has mode"
    elif case == "symlink":
        target = tmp_path / "elsewhere"
        target.mkdir(mode=0o700)
        os.symlink(target, cm)
        why = "is a symlink"
    elif case == "file":
        Path(cm).write_text("")
        why = "is not a directory"
    else:
        require(os.geteuid() == 0, "root, to give a directory to another user")
        os.mkdir(cm, 0o700)
        os.chown(cm, NOBODY, NOBODY)
        why = f"belongs to uid {NOBODY}"
    with pytest.raises(UsageError) as e:
        made(short_home)
    assert e.value.exit_code == 2
    assert cm in e.value.what and why in e.value.what, e.value.what
    assert e.value.remedy and "RGT_CONTROLLER_HOME" in e.value.remedy
    assert os.path.lexists(cm)  # refused, not repaired or removed


def test_long_home_gets_a_private_tmp_dir_used_again(
    tmp_path: Path, made: Callable[[str], str]
) -> None:
    home = str(tmp_path / ("h" * 50))
    d = made(home)
    assert d.startswith(f"/tmp/rgt-cm-{os.getuid()}-") and d != f"/tmp/rgt-cm-{os.getuid()}"
    assert len(d) <= controldir.CONTROL_DIR_MAX
    _private(d)
    assert Path(home, "cm-dir").read_text().strip() == d
    assert made(home) == d
    # close: no master is running, so the directory is empty and goes; the next use makes one.
    _remote(home).close()
    assert not os.path.lexists(d)
    again = made(home)
    assert again != d
    _private(again)


def test_a_tmp_dir_another_remote_of_this_process_uses_stays_when_one_closes(
    tmp_path: Path, made: Callable[[str], str]
) -> None:
    """Two remotes of one process (a sweep's deploys to two boxes at once) share the directory:
    the first to close leaves it to the other, whose master has yet to bind its socket there;
    the last one removes it. Before the fix the first close removed it, and the other's master
    failed ("unix_listener: cannot bind to path ...: No such file or directory")."""
    home = str(tmp_path / ("h" * 50))
    d = made(home)
    one, other = _remote(home), _remote(home)
    assert one.control_dir == other.control_dir == d
    one.close()
    assert os.path.isdir(d)
    _private(d)
    other.close()
    assert not os.path.lexists(d)


@pytest.mark.parametrize("case", ["mode-0777", "symlink", "other-owner", "elsewhere", "gone"])
def test_long_home_never_uses_a_recorded_dir_that_fails(
    tmp_path: Path, made: Callable[[str], str], case: str
) -> None:
    """What another user of the machine could do to the recorded directory (or a reboot):
    rgt leaves it alone and makes a fresh private one."""
    home = str(tmp_path / ("h" * 50))
    d = made(home)
    record = Path(home, "cm-dir")
    if case == "mode-0777":
        os.chmod(d, 0o777)
    elif case == "symlink":
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.rmdir(d)
        os.symlink(theirs, d)
    elif case == "other-owner":
        require(os.geteuid() == 0, "root, to give a directory to another user")
        os.chown(d, NOBODY, NOBODY)
    elif case == "elsewhere":
        record.write_text(str(tmp_path) + "\n")
    else:
        os.rmdir(d)
    fresh = made(home)
    assert fresh != d
    _private(fresh)
    assert record.read_text().strip() == fresh
    if case == "mode-0777":
        assert stat.S_IMODE(os.lstat(d).st_mode) == 0o777  # theirs now: left as it is


def test_socket_paths_fit(short_home: str) -> None:
    """The longest directory used, with the socket's name and the suffix of ssh's temporary
    socket name, fits a unix socket path on macOS (104 bytes with the NUL) and Linux (108),
    whatever the target."""
    assert controldir.CONTROL_DIR_MAX + 1 + controldir.SOCKET_NAME + 17 + 1 <= 104
    long = Target("ssh", host="h" * 200, user="u" * 30, port=65535, identity="/k" * 100, jump="j")
    path = SshRemote(long, home=short_home).control_path
    assert path == os.path.join(short_home, "cm", path[-controldir.SOCKET_NAME :])
    assert re.fullmatch(r"[0-9a-f]+", os.path.basename(path))  # no %token for ssh to expand


BASE = Target("ssh", host="box", user="root", port=2222, identity="/keys/a")


@pytest.mark.parametrize(
    "other",
    [
        dataclasses.replace(BASE, identity="/keys/b"),
        dataclasses.replace(BASE, identity=None),
        dataclasses.replace(BASE, jump="bastion"),
        dataclasses.replace(BASE, user="ubuntu"),
        dataclasses.replace(BASE, user=None),
        dataclasses.replace(BASE, port=22),
        dataclasses.replace(BASE, host="box2"),
    ],
    ids=["key", "no-key", "jump", "user", "no-user", "port", "host"],
)
def test_targets_that_log_in_otherwise_never_share_a_socket(short_home: str, other: Target) -> None:
    """controller/controldir.py control_path: each identity and route its own master; the same
    target (a new SshRemote, as each rgt command makes) the same socket."""
    ours = SshRemote(BASE, home=short_home).control_path
    assert SshRemote(BASE, home=short_home).control_path == ours
    assert SshRemote(other, home=short_home).control_path != ours


def test_a_changed_ssh_config_or_agent_gets_its_own_socket(
    short_home: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What ssh -G resolves for an alias (its IdentityFile, ProxyJump), and the ssh agent a
    target without -i logs in with, are part of a socket's name."""
    config = tmp_path / "ssh_config"
    monkeypatch.setenv("RGT_SSH_CONFIG", str(config))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    alias = Target("ssh", host="gpu1")

    def path(text: str) -> str:
        config.write_text(f"Host gpu1\n  HostName 10.0.0.7\n  User root\n{text}")
        return SshRemote(alias, home=short_home).control_path

    plain = path("")
    assert path("") == plain
    keyed = path("  IdentityFile /keys/a\n")
    assert keyed != plain and path("  IdentityFile /keys/b\n") != keyed
    assert path("  ProxyJump bastion\n") != plain
    assert path("  ServerAliveInterval 5\n") == plain  # nothing to do with who logs in
    monkeypatch.setenv("SSH_AUTH_SOCK", "/tmp/agent.1")
    assert path("") != plain


def test_threads_of_one_process_making_the_directory_at_once_each_get_one(tmp_path: Path) -> None:
    """`rgt sweep` opens its boxes' connections side by side, in threads of one process: each
    wrote the record through the same temporary name (the PID alone), and the threads after
    the first failed (FileNotFoundError: that name was renamed away), ending the sweep."""
    made: List[str] = []
    failed: List[BaseException] = []
    try:
        for round in range(10):
            home = str(tmp_path / f"{round:02d}" / ("h" * 60))
            os.makedirs(home)
            start = threading.Barrier(8)

            def make(home: str = home, start: threading.Barrier = start) -> None:
                start.wait()
                try:
                    made.append(controldir.control_dir(home))
                except BaseException as e:  # (kept for the assertion, in the main thread)
                    failed.append(e)

            threads = [threading.Thread(target=make) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        assert failed == []
    finally:
        for d in set(made):
            os.rmdir(d)
