"""Two targets for the same box that go by two jump hosts (-J) never share a connection
(controller/controldir.py ``control_path``: the jump is part of the socket's name).

A command of a target riding a master opened through another jump host would "work" and go the
other way; once that master closed, the target would fail on its own (its own jump host down,
or refusing it). Real ssh, ProxyJump and the suite's sshd on loopback, with a second sshd of this
module's own as the other jump host. ssh runs a jump host's own ssh with the ``-F`` file alone
(none of rgt's ``-o``), so the test gives rgt a configuration file (RGT_SSH_CONFIG) with the test
key and known_hosts for every host.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

from controller.remote import SshRemote
from controller.target import Target
from onbox.common.errors import RemoteUnreachable
from tests.sshd import SshServer, free_port, sibling_sshd


@pytest.fixture(scope="module")
def jump2(tmp_path_factory: pytest.TempPathFactory, sshd: SshServer) -> Iterator[SshServer]:
    """A second sshd on loopback (a jump host of its own), sharing the session sshd's keys."""
    with sibling_sshd(str(tmp_path_factory.mktemp("sshd-jump2")), sshd) as server:
        yield server


@pytest.fixture
def jump_config(
    sshd: SshServer, controller_env: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> str:
    """rgt's ssh configuration file: the test key and a known_hosts of the test's own for every
    host, jump hosts included."""
    cfg = tmp_path / "ssh_config"
    cfg.write_text(
        "Host *\n"
        f"  IdentityFile {sshd.client_key}\n"
        "  IdentitiesOnly yes\n"
        f"  UserKnownHostsFile {tmp_path / 'known_hosts'}\n"
        "  StrictHostKeyChecking accept-new\n"
        "  BatchMode yes\n"
        "  ConnectTimeout 10\n"
    )
    monkeypatch.setenv("RGT_SSH_CONFIG", str(cfg))
    return str(cfg)


def _target(sshd: SshServer, jump: str) -> Target:
    return Target(
        "ssh",
        host="127.0.0.1",
        port=sshd.port,
        user=sshd.user,
        identity=sshd.client_key,
        jump=jump,
    )


def _master_pid(remote: SshRemote) -> int:
    p = subprocess.run(
        remote.ssh_argv("-O", "check"),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=30,
    )
    found = re.search(r"pid=(\d+)", p.stderr)
    assert p.returncode == 0 and found, p.stderr
    return int(found.group(1))


def _logins(server: SshServer) -> int:
    return len(re.findall(r"Accepted publickey for ", server.log()))


def test_two_jump_routes_to_one_box_get_two_masters_each_its_own_way(
    sshd: SshServer, jump2: SshServer, jump_config: str
) -> None:
    a = SshRemote(_target(sshd, f"{sshd.user}@localhost:{sshd.port}"))
    b = SshRemote(_target(sshd, f"{jump2.user}@127.0.0.1:{jump2.port}"))
    try:
        before = _logins(jump2)
        for r in (a, b, a, b):
            got = r.run(["echo", "here"], timeout=60)
            assert (got.rc, got.text) == (0, "here\n"), got.err
        assert a.control_path != b.control_path
        assert _master_pid(a) != _master_pid(b)
        # b's connection went through the second jump host, once (its commands share it).
        assert _logins(jump2) - before == 1, jump2.log()[-4000:]
    finally:
        a.close()
        b.close()


def test_a_target_whose_jump_host_is_down_does_not_ride_another_routes_master(
    sshd: SshServer, jump_config: str
) -> None:
    up = SshRemote(_target(sshd, f"{sshd.user}@localhost:{sshd.port}"))
    port = free_port()
    down = SshRemote(_target(sshd, f"{sshd.user}@localhost:{port}"))
    try:
        got = up.run(["true"], timeout=60)
        assert got.rc == 0, got.err
        with pytest.raises(RemoteUnreachable) as info:
            down.run(["true"], timeout=60)
        # The jump host's ssh's own words (ssh sends them to /dev/null under ControlPersist:
        # before, all that was said was "kex_exchange_identification: Connection closed").
        assert f"through the jump host {sshd.user}@localhost:{port}: ssh: connect to host " in (
            info.value.what
        ), info.value.what
        assert "Connection refused" in info.value.what, info.value.what
    finally:
        up.close()
        down.close()
