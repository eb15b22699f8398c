"""rsync reaches the box ssh reaches, whatever form its address takes (controller/remote.py
``SshRemote.path_arg``).

rsync reads ``HOST:PATH`` up to the first colon: an IPv6 address written bare (``::1``,
``fe80::2%eth0``) gave it another host (``fe80``, or none and then a daemon's ``::``), so a
deploy's push and a pull went elsewhere than the commands over ssh, or failed. rsync takes an
IPv6 address in brackets (``[fe80::2%eth0]:PATH``) and hands ssh the address inside them.
Real rsync and ssh against a test sshd on ``::1``, and on a link-local address (with its zone)
of a network namespace's veth pair (tests/netns.py).
"""

from __future__ import annotations

import os
import socket
import subprocess
from typing import Iterator, Optional

import pytest

from controller.remote import SshRemote, rsync_e
from controller.target import parse_target
from onbox.common.errors import UsageError
from tests import netns as netnsmod
from tests.conftest import require
from tests.sshd import SshServer, missing, start_sshd


def _no_ipv6() -> Optional[str]:
    """Why this machine has no IPv6 loopback to listen on, or None."""
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
    except OSError as e:
        return f"IPv6 on loopback (::1: {e.strerror})"
    return None


@pytest.fixture(scope="module")
def sshd_v6(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshServer]:
    """A test sshd listening on IPv6 loopback alone (``::1``)."""
    why = missing() or _no_ipv6()
    require(why is None, why or "")
    server = start_sshd(str(tmp_path_factory.mktemp("sshd-v6")), address="::1")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def sshd_zone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshServer]:
    """A test sshd on a network namespace's link-local address, reached from here with the zone
    of this machine's end of the pair (``fe80::2%vh-NAME``)."""
    why = netnsmod.missing() or missing() or _no_ipv6()
    require(why is None, why or "")
    ns = netnsmod.create_netns("rgtz")
    try:
        server = start_sshd(
            str(tmp_path_factory.mktemp("sshd-zone")),
            address=ns.link_local(),
            netns=ns.name,
            reach=ns.link_local_here,
        )
        try:
            yield server
        finally:
            server.stop()
    finally:
        ns.delete()


def _rsync(remote: SshRemote, src: str, dst: str) -> subprocess.CompletedProcess[str]:
    """rsync as rgt runs it (-s, its -e), bounded."""
    shell = remote.rsync_shell()
    assert shell is not None
    argv = ["rsync", "-a", "-s", "-e", rsync_e(shell), src, dst]
    return subprocess.run(
        argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120
    )


def _push_and_pull(remote: SshRemote, root: str) -> None:
    src, box, back = (os.path.join(root, d) for d in ("src", "box", "back"))
    os.makedirs(src)
    with open(os.path.join(src, "f"), "w") as f:
        f.write("payload\n")
    got = remote.run(["true"], timeout=60)  # ssh itself reaches the box
    assert got.rc == 0, got.err
    p = _rsync(remote, src + "/", remote.path_arg(box) + "/")
    assert p.returncode == 0, p.stderr
    with open(os.path.join(box, "f")) as f:  # the namespace shares this file system
        assert f.read() == "payload\n"
    p = _rsync(remote, remote.path_arg(box) + "/", back + "/")
    assert p.returncode == 0, p.stderr
    with open(os.path.join(back, "f")) as f:
        assert f.read() == "payload\n"


def test_rsync_reaches_a_box_at_an_ipv6_address(
    sshd_v6: SshServer, laptop: str, tmp_path: object
) -> None:
    s = sshd_v6
    remote = SshRemote(parse_target(f"ssh -p {s.port} -i {s.client_key} {s.user}@::1"))
    try:
        _push_and_pull(remote, str(tmp_path))
    finally:
        remote.close()


def test_rsync_reaches_a_box_at_a_link_local_address_with_its_zone(
    sshd_zone: SshServer, laptop: str, tmp_path: object
) -> None:
    s = sshd_zone
    remote = SshRemote(parse_target(f"ssh -i {s.client_key} {s.user}@[{s.host}]:{s.port}"))
    assert remote.target.host == s.host  # fe80::2%vh-NAME, the brackets gone
    try:
        _push_and_pull(remote, str(tmp_path))
    finally:
        remote.close()


def _config(tmp_path: object, hostname: str, s: SshServer) -> str:
    path = os.path.join(str(tmp_path), "ssh_config")
    with open(path, "w") as f:
        f.write(
            f"Host zbox\n  Hostname {hostname}\n  Port {s.port}\n  User {s.user}\n"
            f"  IdentityFile {s.client_key}\n  IdentitiesOnly yes\n"
        )
    return path


def test_an_alias_whose_hostname_has_a_zone_written_for_ssh_is_reached_by_rsync(
    sshd_zone: SshServer, laptop: str, tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ssh expands % tokens in a configuration's Hostname: a zone is written %% there, as ssh
    itself needs, and rgt (ssh and rsync alike) goes by the alias."""
    hostname = sshd_zone.host.replace("%", "%%")
    monkeypatch.setenv("RGT_SSH_CONFIG", _config(tmp_path, hostname, sshd_zone))
    remote = SshRemote(parse_target("zbox"))
    try:
        _push_and_pull(remote, str(tmp_path))
    finally:
        remote.close()


def test_an_alias_whose_hostname_has_a_percent_ssh_cannot_read_is_refused_first(
    sshd_zone: SshServer, controller_env: object, tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Hostname fe80::2%vh-x``: ssh reads ``%v`` as a token it does not know, and would fail
    every command with no word rgt could show (exit 3, "the connection was lost"). It is
    refused as the configuration's fault, saying to write %%, before rgt makes anything."""
    monkeypatch.setenv("RGT_SSH_CONFIG", _config(tmp_path, sshd_zone.host, sshd_zone))
    home = os.path.join(str(tmp_path), "home")
    with pytest.raises(UsageError) as e:
        SshRemote(parse_target("zbox"), home=home)
    assert "%v" in e.value.what and "%%" in (e.value.remedy or ""), e.value.what
    assert not os.path.exists(home)
