"""The box's ssh connection opened ahead of the first command (controller/sshahead.py, used by
`rgt deploy` while it hashes the project), against a real sshd on loopback.

- Opened ahead, the master is listening once ``ready`` returns, before any command ran, and the
  commands ride it: one login, and no session of its own on the box (sshd's log).
- Where it cannot connect, the command fails as it did without it: an unreachable box is
  RemoteUnreachable (exit 3) with ssh's reason, a changed host key HostKeyChanged (exit 4), word
  for word the error of a command that opened the connection itself; `rgt deploy` to a port
  nobody listens on exits 3 saying so, and leaves no ssh process of its own.
- Another master that took the socket meanwhile (a concurrent rgt): the ssh opening ahead is
  stopped by its pid, not left holding a connection, and the command rides the other master.
- Closed before anything waited for it: its ssh is stopped and reaped, and no master is left.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
from pathlib import Path
from typing import Iterator, List, Optional

import pytest

from controller.remote import HostKeyChanged, SshRemote
from controller.sshahead import Ahead, ahead_argv
from controller.target import Target, ssh_destination_args
from onbox.common.errors import RemoteUnreachable
from tests.laptop import laptop_env, run_rgt
from tests.sshd import SshServer, free_port


@pytest.fixture
def target(sshd: SshServer, laptop: str) -> Iterator[Target]:
    """The test sshd as the laptop reaches it; its master stopped at the end (by ``close``)."""
    t = Target("ssh", host="127.0.0.1", user=sshd.user, port=sshd.port, identity=sshd.client_key)
    yield t
    SshRemote(t).close()


def _logins(sshd: SshServer) -> int:
    return len(re.findall(r"Accepted publickey for ", sshd.log()))


def _sessions(sshd: SshServer) -> int:
    return sshd.log().count("Starting session: ")


def _master_running(remote: SshRemote) -> bool:
    p = subprocess.run(
        [*remote.base, "-O", "check", *ssh_destination_args(remote.target)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=30,
    )
    return p.returncode == 0


def _ssh_pids(needle: str) -> List[int]:
    """The ssh processes whose command line names ``needle`` (this test's directory)."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if argv and os.path.basename(argv[0]) == b"ssh" and needle.encode() in b" ".join(argv):
            out.append(int(pid))
    return out


def test_a_connection_opened_ahead_is_the_one_the_commands_ride(
    target: Target, sshd: SshServer
) -> None:
    remote = SshRemote(target)
    logins, sessions = _logins(sshd), _sessions(sshd)
    remote.connect_ahead()
    remote.ready()
    assert _master_running(remote)  # before any command
    assert _sessions(sshd) == sessions  # it ran nothing on the box
    for _ in range(2):
        assert remote.run(["true"]).rc == 0
    assert _logins(sshd) == logins + 1
    assert _sessions(sshd) == sessions + 2
    remote.close()
    assert not _master_running(remote)


def test_an_unreachable_box_fails_as_the_command_itself_did(target: Target) -> None:
    nobody = Target("ssh", host="127.0.0.1", user=target.user, port=free_port(),
                    identity=target.identity)  # fmt: skip
    with pytest.raises(RemoteUnreachable) as plain:
        SshRemote(nobody).run(["true"])
    ahead = SshRemote(nobody)
    ahead.connect_ahead()
    with pytest.raises(RemoteUnreachable) as info:
        ahead.run(["true"])
    assert info.value.exit_code == 3
    assert str(info.value) == str(plain.value)
    assert "Connection refused" in str(info.value)


def test_a_changed_host_key_is_refused_as_before(target: Target, laptop: str) -> None:
    remote = SshRemote(target)
    # rgt's known_hosts records another key for the box (as after a rebuild, or an attack).
    other = os.path.join(laptop, "other_host_key")
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", other],
        check=True,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=30,
    )
    with open(other + ".pub") as f:
        key = " ".join(f.read().split()[:2])
    with open(remote.known_hosts, "w") as f:
        f.write(f"[127.0.0.1]:{target.port} {key}\n")
    with pytest.raises(HostKeyChanged) as plain:
        SshRemote(target).run(["true"])
    remote.connect_ahead()
    with pytest.raises(HostKeyChanged) as info:
        remote.run(["true"])
    assert info.value.exit_code == 4
    # The same error but for the fingerprint ssh saw, which the message names.
    assert str(info.value) == str(plain.value)


def test_a_master_that_took_the_socket_first_stops_the_one_opened_ahead(
    target: Target, sshd: SshServer
) -> None:
    remote = SshRemote(target)
    assert remote.run(["true"]).rc == 0  # another rgt's master, left open (ControlPersist)
    # The race: the socket appeared after the look for one (Ahead.start), before ssh bound it.
    dest = ssh_destination_args(target)
    proc = subprocess.Popen(ahead_argv(remote.base, dest), stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    try:
        assert Ahead(proc).join(60) is None  # no error: the command goes on
        assert proc.returncode == -signal.SIGKILL  # stopped, not left holding a connection
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert remote.run(["true"]).rc == 0  # over the other master
    assert _master_running(remote)


def test_a_master_that_took_the_socket_first_is_seen_whatever_ssh_says(
    target: Target, sshd: SshServer
) -> None:
    """The same race with an ssh that says nothing of it (LogLevel QUIET: as an OpenSSH that
    words it otherwise): the master answering at the socket is what stops the one opened
    ahead, not its words. Before, ``join`` waited for its whole bound (here 600 s; a deploy's
    first command's own timeout): the thread waiting for it is given 120 s to return, and the
    ssh is stopped by its pid in any case."""
    remote = SshRemote(target)
    assert remote.run(["true"]).rc == 0  # another rgt's master, left open (ControlPersist)
    dest = ssh_destination_args(target)
    quiet = [remote.base[0], "-o", "LogLevel=QUIET", *remote.base[1:]]
    proc = subprocess.Popen(ahead_argv(quiet, dest), stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    ahead = Ahead(proc, [*remote.base, "-O", "check", *dest], remote.control_path)
    got: List[Optional[bytes]] = []
    waiter = threading.Thread(target=lambda: got.append(ahead.join(600)), daemon=True)
    try:
        waiter.start()
        waiter.join(120)
        assert not waiter.is_alive(), "still waiting for an ssh that lost the socket"
        assert got == [None]  # no error: the command goes on
        assert proc.returncode == -signal.SIGKILL  # stopped, not left holding a connection
    finally:
        if proc.poll() is None:
            proc.kill()
        waiter.join(60)
    assert remote.run(["true"]).rc == 0  # over the other master
    assert _master_running(remote)


def test_closed_before_it_was_waited_for_nothing_of_it_is_left(target: Target) -> None:
    remote = SshRemote(target)
    remote.connect_ahead()
    ahead = remote._ahead
    assert ahead is not None
    remote.close()
    assert ahead.proc.returncode is not None  # stopped and reaped
    assert not _master_running(remote)
    assert not os.path.exists(remote.control_path)


def test_a_deploy_to_a_port_nobody_listens_on_exits_3_and_leaves_no_ssh(
    tmp_path: Path, laptop: str, sshd: SshServer
) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("print('hi')\n")
    port = free_port()
    p = run_rgt(
        ["deploy", f"ssh -p {port} -i {sshd.client_key} {sshd.user}@127.0.0.1", "--name",
         "r1", "--", "python3", "train.py"],
        laptop_env(laptop, str(tmp_path / "box")),
        str(project),
        timeout=120,
    )  # fmt: skip
    assert p.returncode == 3, (p.returncode, p.stderr)
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith(f"rgt: cannot reach {sshd.user}@127.0.0.1:{port}: "), p.stderr
    assert "Connection refused" in last, p.stderr
    assert _ssh_pids(laptop) == []
