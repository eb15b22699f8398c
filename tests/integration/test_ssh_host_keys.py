"""A host key ssh will not accept, against real sshds on loopback (controller/hostkey.py): the
error says whose key it is and whether it changed or is only not known.

- A jump host (``-J``, a second sshd of this module's own) whose key is not in the known_hosts
  of the ssh configuration: HostKeyUnknown (exit 4) naming the jump host, never "presents a
  different host key"; ssh checks a jump host with the configuration alone (rgt's accept-new is
  the box's), whether it asks (StrictHostKeyChecking ask: no terminal, ssh does not name the
  host) or refuses (yes: ssh names it). Recording its key as the remedy says lets the next
  command through.
- A jump host whose recorded key changed: HostKeyChanged naming the jump host and its recorded
  fingerprint, not the box's.
- The box reached by an ssh configuration alias (HostName, Port): a changed key shows the
  fingerprint recorded for the address ssh resolves the alias to (``[host]:port``), which is
  where ssh records it; before, it looked up the alias and showed "recorded (unreadable)".
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Iterator, List

import pytest

from controller.hostkey import HostKeyChanged, HostKeyUnknown
from controller.remote import SshRemote
from controller.target import Target
from onbox.common.errors import AuthError
from tests.sshd import SshServer, sibling_sshd


@pytest.fixture(scope="module")
def jump(tmp_path_factory: pytest.TempPathFactory, sshd: SshServer) -> Iterator[SshServer]:
    """A second sshd on loopback, the jump host, accepting the session sshd's client key."""
    with sibling_sshd(str(tmp_path_factory.mktemp("sshd-jump")), sshd) as server:
        yield server


@pytest.fixture
def remotes(controller_env: object) -> Iterator[List[SshRemote]]:
    """The remotes a test made; each closed at the end (its master stopped)."""
    made: List[SshRemote] = []
    yield made
    for r in made:
        r.close()


def _config(path: Path, sshd: SshServer, known_hosts: Path, extra: str = "") -> str:
    """An ssh configuration (RGT_SSH_CONFIG) with the test key and ``known_hosts`` for every
    host: a jump host's ssh reads this file alone."""
    path.write_text(
        f"{extra}"
        "Host *\n"
        f"  IdentityFile {sshd.client_key}\n"
        "  IdentitiesOnly yes\n"
        f"  UserKnownHostsFile {known_hosts}\n"
        "  BatchMode yes\n"
        "  ConnectTimeout 10\n"
    )
    return str(path)


def _run(argv: List[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, check=True, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30
    )


def _other_host_key(tmp_path: Path) -> tuple[str, str]:
    """A host key no server here has: its known_hosts text and its fingerprint."""
    other = str(tmp_path / "other_host_key")
    _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", other])
    fp = _run(["ssh-keygen", "-l", "-f", other + ".pub"])
    with open(other + ".pub") as f:
        return " ".join(f.read().split()[:2]), fp.stdout.split()[1]


def _via(sshd: SshServer, jump: SshServer) -> Target:
    return Target("ssh", host="127.0.0.1", port=sshd.port, user=sshd.user,
                  identity=sshd.client_key, jump=f"{jump.user}@127.0.0.1:{jump.port}")  # fmt: skip


@pytest.mark.parametrize("strict", ["ask", "yes"])
def test_a_jump_host_whose_key_is_not_known_is_said_so_and_not_called_changed(
    sshd: SshServer,
    jump: SshServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    remotes: List[SshRemote],
    strict: str,
) -> None:
    known = tmp_path / "known_hosts"  # empty: the jump host was never seen
    known.write_text("")
    cfg = _config(tmp_path / "ssh_config", sshd, known, f"StrictHostKeyChecking {strict}\n")
    monkeypatch.setenv("RGT_SSH_CONFIG", cfg)
    remotes.append(SshRemote(_via(sshd, jump)))
    with pytest.raises(HostKeyUnknown) as info:
        remotes[0].run(["true"], timeout=60)
    err = info.value
    assert err.exit_code == 4
    assert "different host key" not in err.what and "changed" not in err.what, err.what
    # Named as ssh resolves it (the known_hosts name, or ProxyJump's user@[host]:port), and
    # the box it was on the way to.
    assert "the host key of the jump host " in err.what, err.what
    where = f"[127.0.0.1]:{jump.port} on the way to {sshd.user}@127.0.0.1:{sshd.port} "
    assert where in err.what, err.what
    assert err.remedy is not None
    assert f"ssh-keyscan -p {jump.port} 127.0.0.1" in err.remedy, err.remedy
    assert f"-J {jump.user}@127.0.0.1:{jump.port}" in err.remedy, err.remedy
    # The remedy works: the jump host's key recorded where its ssh looks, the command goes.
    scan = _run(["ssh-keyscan", "-p", str(jump.port), "127.0.0.1"])
    known.write_text(scan.stdout)
    remotes.append(SshRemote(_via(sshd, jump)))
    got = remotes[1].run(["echo", "through"], timeout=60)
    assert (got.rc, got.text) == (0, "through\n"), got.err


def test_a_jump_host_whose_key_changed_is_named_with_its_own_recorded_key(
    sshd: SshServer,
    jump: SshServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    remotes: List[SshRemote],
) -> None:
    key, fingerprint = _other_host_key(tmp_path)
    known = tmp_path / "known_hosts"
    known.write_text(f"[127.0.0.1]:{jump.port} {key}\n")
    cfg = _config(tmp_path / "ssh_config", sshd, known, "StrictHostKeyChecking accept-new\n")
    monkeypatch.setenv("RGT_SSH_CONFIG", cfg)
    remotes.append(SshRemote(_via(sshd, jump)))
    with pytest.raises(HostKeyChanged) as info:
        remotes[0].run(["true"], timeout=60)
    err = info.value
    assert err.exit_code == 4
    assert f"the jump host [127.0.0.1]:{jump.port}" in err.what, err.what
    assert f"recorded {fingerprint}, now SHA256:" in err.what, err.what
    assert err.remedy is not None and str(known) in err.remedy, err.remedy


def test_a_changed_host_key_of_an_ssh_config_alias_shows_the_key_recorded_for_its_address(
    sshd: SshServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, remotes: List[SshRemote]
) -> None:
    alias = f"Host rgt-test-box\n  HostName 127.0.0.1\n  Port {sshd.port}\n  User {sshd.user}\n"
    cfg = _config(tmp_path / "ssh_config", sshd, tmp_path / "known_hosts", alias)
    monkeypatch.setenv("RGT_SSH_CONFIG", cfg)
    remotes.append(SshRemote(Target("ssh", host="rgt-test-box")))
    key, fingerprint = _other_host_key(tmp_path)
    # rgt's known_hosts records another key for the address the alias stands for (as ssh
    # itself records it: [host]:port), as after a rebuild, or an attack.
    with open(remotes[0].known_hosts, "w") as f:
        f.write(f"[127.0.0.1]:{sshd.port} {key}\n")
    with pytest.raises(HostKeyChanged) as info:
        remotes[0].run(["true"], timeout=60)
    err = info.value
    assert err.exit_code == 4
    assert f"recorded {fingerprint}, now SHA256:" in err.what, err.what
    assert "(unreadable)" not in err.what


def test_a_jump_host_that_refuses_the_login_is_named_as_the_one_that_refused(
    sshd: SshServer,
    jump: SshServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    remotes: List[SshRemote],
) -> None:
    """The jump host's own ssh logs in with the configuration's key, which it does not
    accept; the box would take the target's own (-i). Before, ssh's words went to /dev/null
    and the box was called unreachable (exit 3)."""
    refused = tmp_path / "refused_ed25519"
    _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(refused)])
    cfg = tmp_path / "ssh_config"
    cfg.write_text(
        "Host *\n"
        f"  IdentityFile {refused}\n"
        "  IdentitiesOnly yes\n"
        f"  UserKnownHostsFile {tmp_path / 'known_hosts'}\n"
        "  StrictHostKeyChecking accept-new\n"
        "  BatchMode yes\n"
        "  ConnectTimeout 10\n"
    )
    monkeypatch.setenv("RGT_SSH_CONFIG", str(cfg))
    remotes.append(SshRemote(_via(sshd, jump)))
    with pytest.raises(AuthError) as info:
        remotes[0].run(["true"], timeout=60)
    err = info.value
    assert err.exit_code == 4
    where = f"[127.0.0.1]:{jump.port} on the way to {sshd.user}@127.0.0.1:{sshd.port} "
    assert f"the jump host {jump.user}@{where}refused the login: " in err.what, err.what
    assert "Permission denied" in err.what, err.what
