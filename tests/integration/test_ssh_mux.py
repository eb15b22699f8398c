"""ssh connection multiplexing (controller/remote.py) against a real sshd on loopback: each
target authenticates as itself.

The test sshd authorizes one key only (tests/sshd.py). With a control master open for a target
that logs in with that key, a target for the same user, host and port that names another key, or
none, must not ride that master: it makes its own connection, which the box refuses (AuthError,
exit 4). Before, the control socket was named by ssh's %C (local host, host, port, user), so it
ran over the open master and "worked", and the run's recorded target failed on its own once the
master closed. The same target still shares one connection (one login for many commands), and a
run's `rgt status` goes through its recorded target's own key.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

from controller.registry import Registry, RunRecord
from controller.remote import SshRemote
from controller.target import Target
from onbox.common.errors import AuthError
from tests.laptop import laptop_env, run_rgt
from tests.sshd import SshServer


@pytest.fixture
def authorized(sshd: SshServer, laptop: str) -> Iterator[Target]:
    """The sshd as the laptop reaches it with the one key it accepts; its master stopped at the
    end (``close``: ``ssh -O stop``)."""
    target = Target(
        "ssh", host="127.0.0.1", user=sshd.user, port=sshd.port, identity=sshd.client_key
    )
    yield target
    SshRemote(target).close()


def _other_key(tmp_path: Path) -> str:
    key = str(tmp_path / "other_ed25519")
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "rgt-other", "-f", key],
        check=True,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=30,
    )
    return key


def _logins(sshd: SshServer) -> int:
    return len(re.findall(r"Accepted publickey for ", sshd.log()))


@pytest.mark.parametrize("key", ["another key", "no key"])
def test_a_target_with_another_identity_does_not_ride_an_open_master(
    authorized: Target, tmp_path: Path, key: str
) -> None:
    assert SshRemote(authorized).run(["true"]).rc == 0  # the master, left open (ControlPersist)
    other = dataclasses.replace(
        authorized, identity=_other_key(tmp_path) if key == "another key" else None
    )
    with pytest.raises(AuthError) as info:
        SshRemote(other).run(["true"])
    assert info.value.exit_code == 4
    assert "refused the login" in str(info.value)
    # The authorized target is still fine over its own master.
    assert SshRemote(authorized).run(["true"]).rc == 0


def test_the_same_target_shares_one_connection(authorized: Target, sshd: SshServer) -> None:
    before = _logins(sshd)
    for _ in range(3):  # separate SshRemote objects, as separate rgt commands make
        assert SshRemote(authorized).run(["true"]).rc == 0
    assert _logins(sshd) == before + 1


def test_rgt_status_of_a_run_uses_its_recorded_targets_own_key(
    authorized: Target, tmp_path: Path, laptop: str
) -> None:
    """A run recorded with a key the box refuses: `rgt status` fails with exit 4 even while a
    master of the authorized key is open, instead of reading the box through it."""
    assert SshRemote(authorized).run(["true"]).rc == 0
    recorded = dataclasses.replace(authorized, identity=_other_key(tmp_path))
    Registry().put(
        RunRecord(
            "r1",
            recorded,
            profile="generic-ssh",
            store="file://" + str(tmp_path / "store"),
            box_home=str(tmp_path / "box"),
            agent=["/bin/false"],
            release="a1b2c3d4e5f6",
            workdir=str(tmp_path / "box"),
        )
    )
    p = run_rgt(["status", "r1"], laptop_env(laptop, str(tmp_path / "box")), str(tmp_path))
    assert p.returncode == 4, (p.returncode, p.stdout, p.stderr)
    assert "refused the login" in p.stderr
