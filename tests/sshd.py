"""A throwaway OpenSSH server on loopback, for tests that need a real ssh session.

``start_sshd(dir)`` generates a host key and a client key in ``dir``, writes an sshd_config that
accepts only that client key, starts ``/usr/sbin/sshd -D -e`` (not a daemon: it stays our child)
on a free port of 127.0.0.1 and returns once the port accepts connections. ``SshServer.stop``
ends it, and every per-connection sshd process it left, by PID. ``start_sshd(dir, address=...,
netns=...)`` runs it inside a network namespace instead (tests/netns.py), listening on the
namespace's own address: a box the tests can cut off the network.

The client runs ``ssh -F /dev/null`` (no user or system config: no ControlMaster, no agent
keys) with the generated key. Remote commands run under the user's login shell with sshd's
minimal environment: pass what they need inline (``remote_env``) and call programs by absolute
path.

The user is the one running the tests (root). Logged in as that user, a session's ``HOME`` is
the server's own empty directory (``dir/home``), not the user's real one, and its ``PATH`` the
tests' own with the Python the tests run on first (``box_path``): the box is this machine as a
fresh rental is, not as the developer's dotfiles made it. Those run in every remote command's
login shell (bash reads ``~/.bashrc`` for ssh): this machine's root initialises pyenv there,
half a second of every remote command, most of a deploy test's time.
``start_sshd(dir, users=[...])`` also lets the
client key log in as each of those users: ``shell_user(name)`` makes (once; idempotent, root
only) a user ``rgt-sh-NAME`` whose login shell is that shell (``LOGIN_SHELLS``: bash, dash, zsh,
fish, tcsh), as rentals set them; ``SshServer.as_user(user)`` is the same server reached as that
user. Their authorized keys are in a directory of the server's own under /tmp that they can read
(sshd reads the file as the user; the tests' directories are root's alone), removed by ``stop``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pwd
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Dict, Iterator, List, Mapping, Optional, Sequence

from onbox.agent import procfs
from tests.polling import wait

SSHD = "/usr/sbin/sshd"
SFTP_SERVER = "/usr/lib/openssh/sftp-server"
PRIVSEP_DIR = "/run/sshd"  # sshd refuses to start without its privilege separation directory


def ssh_naming(d: str) -> List[int]:
    """The ssh client processes whose command line names ``d`` (a control directory or socket):
    found by their name (comm), as a master rewrites its command line (``ssh: SOCKET [mux]``)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/cmdline", "rb") as g:
                cmdline = g.read()
        except OSError:
            continue
        if name == "ssh" and d.encode() in cmdline:
            out.append(int(pid))
    return out


def missing() -> Optional[str]:
    """What this machine lacks to run a test sshd, or None when nothing is missing."""
    if not os.access(SSHD, os.X_OK):
        return f"OpenSSH server at {SSHD}"
    for tool in ("ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"the OpenSSH client tool {tool!r} on PATH"
    try:
        os.makedirs(PRIVSEP_DIR, exist_ok=True)
        os.chmod(PRIVSEP_DIR, 0o755)
    except OSError as e:
        if not os.path.isdir(PRIVSEP_DIR):
            return f"sshd's privilege separation directory {PRIVSEP_DIR} ({e.strerror})"
    return None


# Login shells rentals ship, by name, at the path a Debian package puts them.
LOGIN_SHELLS = {
    "bash": "/bin/bash",
    "dash": "/bin/dash",
    "zsh": "/usr/bin/zsh",
    "fish": "/usr/bin/fish",
    "tcsh": "/usr/bin/tcsh",
}
SHELL_USER_PREFIX = "rgt-sh-"


def shell_missing(name: str) -> Optional[str]:
    """What this machine lacks to log in with the login shell ``name``, or None."""
    if not os.access(LOGIN_SHELLS[name], os.X_OK):
        return f"the login shell {LOGIN_SHELLS[name]} (apt-get install {name})"
    if os.geteuid() != 0:
        return f"root, to create a user whose login shell is {name}"
    if shutil.which("useradd") is None:
        return "useradd (passwd), to create test users"
    return None


def shell_user(name: str) -> str:
    """The user ``rgt-sh-NAME`` whose login shell is ``LOGIN_SHELLS[name]``, made when missing
    (root only; idempotent, and safe when two test sessions make it at once)."""
    user, shell = SHELL_USER_PREFIX + name, LOGIN_SHELLS[name]
    why = shell_missing(name)
    if why is not None:
        raise RuntimeError(f"cannot make the test user {user}: needs {why}")
    try:
        if pwd.getpwnam(user).pw_shell == shell:
            return user
        cmd = ["usermod", "-s", shell, user]
    except KeyError:
        # -p '*': no password works, and the account is not locked ("!"), which sshd without
        # PAM would refuse even for a key.
        cmd = ["useradd", "-m", "-s", shell, "-p", "*", user]
    p = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    try:
        ok = pwd.getpwnam(user).pw_shell == shell  # another session may have made it first
    except KeyError:
        ok = False
    if not ok:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr.strip()}")
    return user


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def remote_env(env: Mapping[str, str]) -> str:
    """``export K=V; ...`` for the start of a remote command line, each value shell-quoted."""
    return "".join(f"export {k}={shlex.quote(v)}; " for k, v in env.items())


@dataclasses.dataclass
class SshServer:
    """One running test sshd and how to reach it."""

    dir: str
    port: int
    user: str
    client_key: str
    known_hosts: str
    log_path: str
    proc: subprocess.Popen[bytes]
    host: str = "127.0.0.1"  # the address it listens on
    netns: Optional[str] = None  # the network namespace it runs in, if any
    keys_dir: Optional[str] = None  # the authorized keys of ``users`` (start_sshd), if any

    def as_user(self, user: str) -> SshServer:
        """This server, logged into as ``user`` (one of start_sshd's ``users``)."""
        return dataclasses.replace(self, user=user)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def home(self) -> str:
        """``HOME`` of a session logged in as the tests' own user (module docstring)."""
        return os.path.join(self.dir, "home")

    def ssh_argv(self, command: str, *, tty: bool = False) -> List[str]:
        """argv of an ssh client that runs ``command`` (one shell line) on this server."""
        return [
            "ssh", "-F", "/dev/null", "-p", str(self.port), "-i", self.client_key,
            "-o", "IdentitiesOnly=yes",
            "-o", "StrictHostKeyChecking=accept-new",
            "-o", f"UserKnownHostsFile={self.known_hosts}",
            "-o", "BatchMode=yes",
            "-o", "ConnectTimeout=10",
            *(["-tt"] if tty else ["-T"]),
            f"{self.user}@{self.host}", command,
        ]  # fmt: skip

    def run(
        self, command: str, *, tty: bool = False, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """Run ``command`` over ssh to the end; stdout and stderr captured as text."""
        return subprocess.run(
            self.ssh_argv(command, tty=tty),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def session_pids(self) -> List[int]:
        """Live per-connection sshd processes (the listener's children)."""
        out = []
        for pid in procfs.pids():
            st = procfs.read_stat(pid)
            if st is not None and st.ppid == self.pid and st.state not in ("Z", "X"):
                out.append(pid)
        return sorted(out)

    def wait_no_sessions(self, timeout: float = 15) -> None:
        """Until the server has torn down every connection (e.g. after a client was killed)."""
        wait(
            lambda: not self.session_pids(),
            timeout,
            "sshd's sessions to end",
            info=lambda: f"sessions {self.session_pids()}; its log:\n{self.log()[-4000:]}",
        )

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def stop(self, timeout: float = 10) -> None:
        """Stop the listener, then any connection it left behind, by PID."""
        leftovers = [procfs.identity(pid) for pid in self.session_pids()]
        _stop_pid(self.proc, timeout)
        for ident in leftovers:
            if ident is not None and procfs.is_alive(ident):
                try:
                    os.kill(ident.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if self.keys_dir is not None:
            shutil.rmtree(self.keys_dir, ignore_errors=True)


def _stop_pid(proc: subprocess.Popen[bytes], timeout: float) -> None:
    if proc.poll() is None:
        try:
            os.kill(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout)


def _keygen(path: str) -> None:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "rgt-test", "-f", path],
        check=True,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=30,
    )


def _config(
    d: str,
    port: int,
    set_env: Mapping[str, str],
    address: str = "127.0.0.1",
    keys_dir: Optional[str] = None,
    user: str = "",
) -> str:
    keys = os.path.join(d, "authorized_keys")
    if keys_dir is not None:  # %u: the user logging in; a user without a file there gets no key
        keys += " " + os.path.join(keys_dir, "%u")
    lines = [
        f"Port {port}",
        f"ListenAddress {address}",
        f"HostKey {os.path.join(d, 'host_ed25519')}",
        f"PidFile {os.path.join(d, 'sshd.pid')}",
        f"AuthorizedKeysFile {keys}",
        "PermitRootLogin prohibit-password",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "PubkeyAuthentication yes",
        "UsePAM no",
        "StrictModes no",
        f"Subsystem sftp {SFTP_SERVER}",
        "LogLevel VERBOSE",
    ]
    if set_env:  # one line: sshd keeps the first SetEnv it reads and ignores any other
        lines.append(_set_env(set_env))
    if user:  # the tests' own user: the server's home, set_env's variables besides
        own = {"HOME": os.path.join(d, "home"), "PATH": box_path(), **set_env}
        lines += [f"Match User {user}", "  " + _set_env(own)]
    return "\n".join(lines) + "\n"


def _set_env(env: Mapping[str, str]) -> str:
    for k, v in env.items():
        if not k or any(c in k + v for c in '"\n') or "=" in k:
            raise ValueError(f"cannot pass {k!r}={v!r} through SetEnv")
    return "SetEnv " + " ".join(f'"{k}={v}"' for k, v in env.items())


def box_path() -> str:
    """``PATH`` on the test box for the tests' own user: the directory of the Python the tests
    run on (its base interpreter, not a venv's, which has rgt installed) first, then the tests'
    own ``PATH``: ``python3`` on the box is that Python, as the developer's shell set-up made it
    before the box got a home of its own."""
    base = getattr(sys, "_base_executable", sys.executable)
    return os.pathsep.join([os.path.dirname(os.path.realpath(base)), os.environ.get("PATH", "")])


def _wait_listening(
    proc: subprocess.Popen[bytes], port: int, timeout: float, address: str = "127.0.0.1"
) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with socket.create_connection((address, port), timeout=1):
                return True
        except OSError:
            time.sleep(0.05)
    return False


def start_sshd(
    d: str,
    *,
    set_env: Optional[Mapping[str, str]] = None,
    timeout: float = 15,
    address: str = "127.0.0.1",
    netns: Optional[str] = None,
    users: Sequence[str] = (),
    reach: Optional[str] = None,
) -> SshServer:
    """Start a test sshd whose files live in ``d``; raises RuntimeError with its log if not.

    ``address``: where it listens. ``netns``: the network namespace to run it in (through
    ``ip netns exec``, which execs sshd itself, so the PID is still sshd's); ``address`` must then
    be the namespace's own, reachable from here. ``users``: other users the client key logs in
    as too (``shell_user``; reach them with ``SshServer.as_user``). ``reach``: the address this
    machine connects to, where it is not ``address`` (a link-local address's zone is the
    interface of its own end: tests/netns.py ``Netns.link_local``)."""
    why = missing()
    if why is not None:
        raise RuntimeError(f"cannot start a test sshd: needs {why}")
    os.makedirs(d, exist_ok=True)
    host_key = os.path.join(d, "host_ed25519")
    client_key = os.path.join(d, "client_ed25519")
    for key in (host_key, client_key):
        if not os.path.exists(key):
            _keygen(key)
    auth = os.path.join(d, "authorized_keys")
    shutil.copyfile(client_key + ".pub", auth)
    os.chmod(auth, 0o600)
    user = pwd.getpwuid(os.geteuid()).pw_name
    os.makedirs(os.path.join(d, "home"), mode=0o700, exist_ok=True)
    env: Dict[str, str] = dict(set_env or {})
    keys_dir = _keys_dir(client_key + ".pub", users) if users else None
    try:
        return _serve(d, user, client_key, env, timeout, address, netns, keys_dir, reach)
    except BaseException:
        if keys_dir is not None:
            shutil.rmtree(keys_dir, ignore_errors=True)
        raise


@contextlib.contextmanager
def sibling_sshd(d: str, first: SshServer) -> Iterator[SshServer]:
    """A second test sshd in ``d`` (a jump host, another route) that accepts ``first``'s client
    key, so one ssh configuration reaches both; stopped by PID when the block ends."""
    os.makedirs(d, exist_ok=True)
    for name in ("client_ed25519", "client_ed25519.pub"):
        shutil.copyfile(os.path.join(first.dir, name), os.path.join(d, name))
    os.chmod(os.path.join(d, "client_ed25519"), 0o600)
    server = start_sshd(d)
    try:
        yield server
    finally:
        server.stop()


def _serve(
    d: str,
    user: str,
    client_key: str,
    env: Mapping[str, str],
    timeout: float,
    address: str,
    netns: Optional[str],
    keys_dir: Optional[str],
    reach: Optional[str] = None,
) -> SshServer:
    reach = reach or address
    cfg = os.path.join(d, "sshd_config")
    log_path = os.path.join(d, "sshd.log")
    text = ""
    for _ in range(3):  # another process may take the free port before sshd binds it
        port = free_port()
        with open(cfg, "w") as f:
            f.write(_config(d, port, env, address, keys_dir, user))
        inside = ["ip", "netns", "exec", netns] if netns else []
        check = subprocess.run(  # in the namespace: its addresses are there alone
            [*inside, SSHD, "-t", "-f", cfg],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=30,
        )
        if check.returncode != 0:
            raise RuntimeError(f"sshd -t rejects {cfg}: {check.stderr.strip()}")
        with open(log_path, "ab") as logf:
            proc = subprocess.Popen(
                [*inside, SSHD, "-D", "-e", "-f", cfg],
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
            )
        if _wait_listening(proc, port, timeout, reach):
            return SshServer(
                dir=d,
                port=port,
                user=user,
                client_key=client_key,
                known_hosts=os.path.join(d, "known_hosts"),
                log_path=log_path,
                proc=proc,
                host=reach,
                netns=netns,
                keys_dir=keys_dir,
            )
        _stop_pid(proc, 10)
        with open(log_path, errors="replace") as f:
            text = f.read()
        if "Address already in use" not in text:
            raise RuntimeError(
                f"sshd did not listen on {address}:{port}; {log_path}:\n{text[-4000:]}"
            )
    raise RuntimeError(f"sshd found no free port; {log_path}:\n{text[-4000:]}")


def _keys_dir(public_key: str, users: Sequence[str]) -> str:
    """A directory under /tmp with ``public_key`` as the authorized keys of each of ``users``,
    readable by them (a public key is no secret; StrictModes is off, so the owner is root)."""
    keys_dir = tempfile.mkdtemp(prefix="rgt-sshd-keys-", dir="/tmp")
    os.chmod(keys_dir, 0o755)
    for u in users:
        path = os.path.join(keys_dir, u)
        shutil.copyfile(public_key, path)
        os.chmod(path, 0o644)
    return keys_dir
