"""Paths with ``%`` in them reach ssh as themselves (controller/remote.py, controller/target.py).

ssh expands ``%`` tokens (``%h`` the host, ``%d`` the home, ...) in ControlPath,
UserKnownHostsFile and IdentityFile, a ``-i`` path included, and in ProxyJump. Before, a
controller home whose path held ``%h`` put the control socket and rgt's known_hosts where ssh
expanded them to (a directory that does not exist: no multiplexing, no recorded host key), and a
key under such a path was not found, or refused by ssh ("unknown key"). Now each reaches ssh
with ``%`` written as ``%%``, which ssh reads as one ``%``; a path ssh would expand ``${VAR}``
in is refused before anything runs. A real ssh client against the suite's loopback sshd.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import tempfile
from typing import Iterator

import pytest

from controller.remote import SshRemote
from controller.target import Target, parse_target, ssh_destination_args
from onbox.common.errors import UsageError
from tests.sshd import SshServer


@pytest.fixture
def pct_home(controller_env: object) -> Iterator[str]:
    """A controller home whose path holds ``%h`` and ``%d``, short enough that its control
    sockets live in it (controller/controldir.py ``control_dir``: HOME/cm)."""
    home = tempfile.mkdtemp(prefix="rgt%h%d-", dir="/tmp")
    try:
        yield home
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _key_in(home: str, sshd: SshServer) -> str:
    """The test sshd's client key, copied to a directory of ``home`` with ``%r`` in its name."""
    d = os.path.join(home, "keys%r")
    os.makedirs(d, mode=0o700)
    key = os.path.join(d, "id")
    shutil.copyfile(sshd.client_key, key)
    os.chmod(key, 0o600)
    return key


def test_a_home_with_percent_in_its_path_holds_the_socket_and_the_host_keys(
    sshd: SshServer, pct_home: str
) -> None:
    target = Target(
        "ssh", host="127.0.0.1", port=sshd.port, user=sshd.user, identity=sshd.client_key
    )
    remote = SshRemote(target, home=pct_home)
    try:
        got = remote.run(["echo", "here"], timeout=60)
        assert (got.rc, got.text) == (0, "here\n"), got.err
        # The master's socket is in the home's own control directory, named as rgt named it.
        assert os.path.dirname(remote.control_path) == os.path.join(pct_home, "cm")
        assert stat.S_ISSOCK(os.stat(remote.control_path).st_mode)
        # The box's host key was recorded in rgt's known_hosts, in the home.
        with open(os.path.join(pct_home, "known_hosts")) as f:
            assert f.read().strip(), "no host key recorded"
    finally:
        remote.close()


def test_a_key_with_percent_in_its_path_logs_in(sshd: SshServer, pct_home: str) -> None:
    key = _key_in(pct_home, sshd)
    remote = SshRemote(
        Target("ssh", host="127.0.0.1", port=sshd.port, user=sshd.user, identity=key)
    )
    try:
        got = remote.run(["echo", "here"], timeout=60)
        assert (got.rc, got.text) == (0, "here\n"), got.err
    finally:
        remote.close()


def test_a_home_ssh_would_expand_a_variable_in_is_refused_before_ssh_runs(
    sshd: SshServer, tmp_path: object
) -> None:
    home = tempfile.mkdtemp(prefix="rgt${HOME}-", dir="/tmp")
    try:
        with pytest.raises(UsageError) as e:
            SshRemote(Target("ssh", host="127.0.0.1", port=sshd.port, user=sshd.user), home=home)
        assert "${" in e.value.what and "RGT_CONTROLLER_HOME" in (e.value.remedy or "")
        assert os.listdir(home) == []  # nothing made in it (no cm/, no known_hosts)
    finally:
        shutil.rmtree(home, ignore_errors=True)


def test_a_jump_host_with_a_zone_reaches_ssh_with_its_percent(sshd: SshServer, laptop: str) -> None:
    """A link-local jump host's zone (``%lo``): ssh once failed on it as a token of its own
    ("unknown key %l") before connecting anywhere; now the jump's own ssh is given the host as
    written and tries it (nothing answers there)."""
    target = Target(
        "ssh",
        host="127.0.0.1",
        port=sshd.port,
        user=sshd.user,
        identity=sshd.client_key,
        jump="nobody@[fe80::1%lo]:1",
    )
    remote = SshRemote(target)
    try:
        argv = remote.argv(["true"])
        # -v: ssh says what it runs for the jump (and passes -v to that ssh).
        p = subprocess.run([argv[0], "-v", *argv[1:]], capture_output=True, text=True, timeout=60)
        assert p.returncode == 255
        assert "unknown key" not in p.stderr, p.stderr
        ran = re.search(r"Executing proxy command: exec ssh .* (\S+)$", p.stderr, re.M)
        assert ran and ran.group(1) == "fe80::1%lo", p.stderr
    finally:
        remote.close()


@pytest.mark.parametrize("key", ["/keys${HOME}/id", "/keys %r/id"])
def test_a_key_ssh_cannot_be_given_as_written_is_refused(key: str) -> None:
    """ssh would put a variable in for ``${HOME}``; ``%`` with a blank needs an IdentityFile
    option, which splits at the blank."""
    with pytest.raises(UsageError) as e:
        ssh_destination_args(Target("ssh", host="127.0.0.1", identity=key))
    assert e.value.field == "TARGET" and key in e.value.what


def test_a_key_ssh_would_expand_a_variable_in_is_refused_before_the_home_is_made(
    tmp_path: object,
) -> None:
    """The key is checked before rgt makes its home and the home's control directory (cm/):
    bad input leaves nothing behind."""
    home = os.path.join(str(tmp_path), "home")
    with pytest.raises(UsageError) as e:
        SshRemote(Target("ssh", host="127.0.0.1", identity="/keys${HOME}/id"), home=home)
    assert e.value.field == "TARGET" and "${" in e.value.what
    assert not os.path.exists(home)


def test_a_pasted_line_with_a_key_ssh_cannot_be_given_is_refused_as_it_is_parsed() -> None:
    with pytest.raises(UsageError) as e:
        parse_target("ssh -i '/keys${HOME}/id' -p 2222 root@box.example.com")
    assert e.value.field == "TARGET" and "${" in e.value.what
