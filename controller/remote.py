"""Running commands on the box: over the system OpenSSH client, or on this machine (``local``).

Every command is an argv list; over ssh each argument is shell-quoted, so names with spaces,
quotes, ``;``, ``$()`` or newlines arrive byte for byte. The ssh client is the system one, so
``~/.ssh/config``, ProxyJump and agents work, with rgt's options put first (ssh takes the first
value it sees): ``BatchMode`` (never a prompt), keepalives, connection multiplexing (one TCP
connection for a whole deploy), and rgt's own known_hosts next to the user's with
``StrictHostKeyChecking=accept-new``. A changed host key is a hard stop that shows both
fingerprints; it is never accepted.

Ciphers: where neither the user's nor the system's ssh configuration chooses them (``ssh -G``
gives the same list as with no configuration at all), AES-GCM goes first in OpenSSH's own
list. OpenSSH's default, chacha20-poly1305, runs in software; AES-GCM runs on the AES and
carry-less multiply instructions every laptop and server CPU of the last decade has, at a
third of the CPU per byte, which is what bounds a pull over ssh. A configured list is left
alone, and the server still picks from the whole default list.

Errors: ssh's exit status 255 becomes RemoteUnreachable (exit 3), AuthError (exit 4, refused
key) or HostKeyChanged (exit 4); the remote command's own status is returned to the caller.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
from typing import Dict, List, Mapping, Optional, Sequence

from controller.target import Target, ssh_destination_args
from onbox.errors import AuthError, RemoteUnreachable


class HostKeyChanged(AuthError):
    """The box presents a host key other than the one recorded for it."""


def controller_home() -> str:
    """Where the laptop keeps rgt's state: the run registry, known_hosts, ssh control sockets."""
    env = os.environ.get("RGT_CONTROLLER_HOME")
    if env:
        return os.path.abspath(env)
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "rgt")


@dataclasses.dataclass
class Result:
    """A finished remote command."""

    rc: int
    stdout: bytes
    stderr: bytes

    @property
    def text(self) -> str:
        return self.stdout.decode("utf-8", "replace")

    @property
    def err(self) -> str:
        return self.stderr.decode("utf-8", "replace")


def quote_argv(argv: Sequence[str]) -> str:
    """One POSIX shell line that runs ``argv`` exactly (for the remote login shell)."""
    if not argv:
        raise ValueError("empty command")
    return " ".join(shlex.quote(a) for a in argv)


class Remote:
    """A box to run commands on. Subclasses: SshRemote, LocalRemote."""

    target: Target

    def argv(self, argv: Sequence[str], env: Optional[Mapping[str, str]] = None) -> List[str]:
        """The local argv that runs ``argv`` on the box (with ``env`` set for it only)."""
        raise NotImplementedError

    def run(
        self,
        argv: Sequence[str],
        *,
        input: Optional[bytes] = None,
        env: Optional[Mapping[str, str]] = None,
        timeout: float = 120,
    ) -> Result:
        """Run to the end; ssh failures raise, the command's own status is returned."""
        try:
            p = subprocess.run(
                self.argv(argv, env),
                input=input,
                stdin=None if input is not None else subprocess.DEVNULL,
                capture_output=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            raise RemoteUnreachable(
                f"{self.target.label}: `{argv[0]}` did not finish within {timeout:.0f} s",
                "the box or the network is stalled; try again, or check the box",
            ) from None
        except FileNotFoundError as e:
            raise RemoteUnreachable(f"cannot run {e.filename}: {e.strerror}") from None
        self.check_transport(p.returncode, p.stderr)
        return Result(p.returncode, p.stdout, p.stderr)

    def sh(
        self,
        script: str,
        *args: str,
        input: Optional[bytes] = None,
        env: Optional[Mapping[str, str]] = None,
        timeout: float = 120,
    ) -> Result:
        """Run a POSIX sh script on the box with ``args`` as $1, $2, ... (quoted, never
        interpolated into the script)."""
        return self.run(["sh", "-c", script, "rgt", *args], input=input, env=env, timeout=timeout)

    def popen(
        self, argv: Sequence[str], env: Optional[Mapping[str, str]] = None
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` on the box with its stdout piped back (for following a log)."""
        return subprocess.Popen(
            self.argv(argv, env), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE
        )

    def check_transport(self, rc: int, stderr: bytes) -> None:
        """Raise when ``rc`` is the transport's failure rather than the command's."""

    def rsync_shell(self) -> Optional[List[str]]:
        """The ``-e`` of rsync to reach this box, or None for local paths."""
        return None

    def path_arg(self, path: str) -> str:
        """How rsync names ``path`` on the box."""
        return path

    def close(self) -> None:
        """Release the connection (the ssh control master), if any."""


class LocalRemote(Remote):
    """``local``: this machine, no ssh."""

    def __init__(self) -> None:
        self.target = Target("local")

    def argv(self, argv: Sequence[str], env: Optional[Mapping[str, str]] = None) -> List[str]:
        if env:
            return ["env", *[f"{k}={v}" for k, v in env.items()], *argv]
        return list(argv)


class SshRemote(Remote):
    """A box over the system ssh client."""

    def __init__(self, target: Target, home: Optional[str] = None) -> None:
        assert target.kind == "ssh"
        self.target = target
        self.home = home or controller_home()
        os.makedirs(self.home, mode=0o700, exist_ok=True)
        self.known_hosts = os.path.join(self.home, "known_hosts")
        self.control_dir = _control_dir(self.home)
        alive = os.environ.get("RGT_SSH_KEEPALIVE", "15")
        user_known = os.path.join(os.path.expanduser("~"), ".ssh", "known_hosts")
        self.options = [
            "-o", "BatchMode=yes",
            "-o", f"ConnectTimeout={os.environ.get('RGT_SSH_CONNECT_TIMEOUT', '15')}",
            "-o", f"ServerAliveInterval={alive}",
            "-o", "ServerAliveCountMax=3",
            "-o", "ControlMaster=auto",
            "-o", f"ControlPath={os.path.join(self.control_dir, '%C')}",
            "-o", "ControlPersist=60",
            "-o", "StrictHostKeyChecking=accept-new",
            # New keys are recorded in rgt's file (the first); the user's are honoured too.
            "-o", f"UserKnownHostsFile={_ssh_path(self.known_hosts)} {_ssh_path(user_known)}",
            "-o", "LogLevel=ERROR",
        ]  # fmt: skip
        config = os.environ.get("RGT_SSH_CONFIG")  # tests: -F /dev/null
        self.config_args = ["-F", config] if config else []
        self.options += cipher_preference(self.config_args, ssh_destination_args(target))
        self.base = ["ssh", *self.config_args, *self.options]

    def ssh_argv(self, *extra: str) -> List[str]:
        return [*self.base, *extra, *ssh_destination_args(self.target)]

    def argv(self, argv: Sequence[str], env: Optional[Mapping[str, str]] = None) -> List[str]:
        line = quote_argv(argv)
        if env:
            line = quote_argv(["env", *[f"{k}={v}" for k, v in env.items()]]) + " " + line
        return [*self.ssh_argv("-T"), line]

    def check_transport(self, rc: int, stderr: bytes) -> None:
        if rc != 255:
            return
        text = stderr.decode("utf-8", "replace")
        if "IDENTIFICATION HAS CHANGED" in text or "Host key verification failed" in text:
            raise self._host_key_changed(text)
        if "Permission denied" in text or "Too many authentication failures" in text:
            raise AuthError(
                f"{self.target.label} refused the login: {_last_line(text)}",
                "check the user and key (-i), or that your ssh agent holds the key",
            )
        raise RemoteUnreachable(
            f"cannot reach {self.target.label}: {_transport_line(text)}",
            "check the address and port, that the box is running, and your network",
        )

    def _host_key_changed(self, text: str) -> HostKeyChanged:
        new = re.search(r"(SHA256:[A-Za-z0-9+/=]+)", text)
        known = self._known_fingerprints()
        return HostKeyChanged(
            f"{self.target.label} presents a different host key than the one recorded: "
            f"recorded {', '.join(known) or '(unreadable)'}, now "
            f"{new.group(1) if new else '(see ssh -v)'}. Not connecting.",
            "if the box was rebuilt, remove its line from "
            f"{self.known_hosts} (ssh-keygen -R HOST -f FILE) and deploy again; "
            "otherwise someone may be intercepting the connection",
        )

    def _known_fingerprints(self) -> List[str]:
        host = self.target.host or ""
        key = f"[{host}]:{self.target.port}" if self.target.port not in (None, 22) else host
        out = []
        for f in (self.known_hosts, os.path.join(os.path.expanduser("~"), ".ssh", "known_hosts")):
            if not os.path.exists(f):
                continue
            p = subprocess.run(
                ["ssh-keygen", "-l", "-F", key, "-f", f],
                capture_output=True,
                text=True,
                timeout=30,
            )
            out += re.findall(r"(SHA256:[A-Za-z0-9+/=]+)", p.stdout)
        return out

    def rsync_shell(self) -> Optional[List[str]]:
        return [*self.base, *ssh_destination_args(self.target)[:-2]]

    def path_arg(self, path: str) -> str:
        # rsync's remote side: "host:path"; protect_args (-s) keeps the path from the shell.
        return f"{self.target.host}:{path}"

    def close(self) -> None:
        subprocess.run(
            [*self.ssh_argv("-O", "exit")],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=30,
        )


FAST_CIPHERS = ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com")


def _effective_ciphers(config_args: Sequence[str], dest: Sequence[str]) -> Optional[str]:
    try:
        p = subprocess.run(
            ["ssh", *config_args, "-G", *dest],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"^ciphers (\S+)$", p.stdout, re.MULTILINE) if p.returncode == 0 else None
    return found.group(1) if found else None


def cipher_preference(config_args: Sequence[str], dest: Sequence[str]) -> List[str]:
    """``-o Ciphers=...`` with AES-GCM first, or nothing where a configuration chose the
    ciphers, the CPU lacks AES instructions, or ssh cannot say (module docstring)."""
    if not _has_aes():
        return []
    ours = _effective_ciphers(config_args, dest)
    bare = _effective_ciphers(["-F", os.devnull], dest)
    if ours is None or ours != bare:
        return []
    default = ours.split(",")
    fast = [c for c in FAST_CIPHERS if c in default]
    if not fast:
        return []
    return ["-o", "Ciphers=" + ",".join(fast + [c for c in default if c not in fast])]


def _has_aes() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return bool(re.search(r"^(flags|Features)\s*:.*\baes\b", f.read(), re.MULTILINE))
    except OSError:
        return True  # not Linux (a Mac): every Apple and Intel Mac CPU has AES instructions


def open_remote(target: Target) -> Remote:
    return LocalRemote() if target.kind == "local" else SshRemote(target)


def _control_dir(home: str) -> str:
    # A unix socket path must fit in 108 bytes; %C adds 40.
    d = os.path.join(home, "cm")
    if len(d) > 60:
        d = f"/tmp/rgt-cm-{os.getuid()}"
    os.makedirs(d, mode=0o700, exist_ok=True)
    return d


def _ssh_path(path: str) -> str:
    if any(c in path for c in ' "\\'):
        raise RemoteUnreachable(
            f"the path {path!r} has characters ssh options cannot carry",
            "set RGT_CONTROLLER_HOME to a path without spaces or quotes",
        )
    return path


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


# What ssh (or rsync about its ssh) says when the connection fails; the remote command's own
# stderr shares the stream and must not be taken for the reason.
_TRANSPORT = re.compile(
    r"^(ssh:|ssh_|mux_|client_loop|kex_|rsync error:|Timeout, server|Connection |"
    r"Shared connection|Bad |Could not|Received disconnect|Disconnected)"
)


def _transport_line(text: str) -> str:
    """The last line of ``text`` that is the transport's, or a plain reason when the connection
    went without a word (a control master killed by its keepalive)."""
    lines = [ln.strip() for ln in text.strip().splitlines() if _TRANSPORT.match(ln.strip())]
    return lines[-1] if lines else "the connection was lost (ssh exited 255)"


def env_prefix(env: Dict[str, str]) -> List[str]:
    """``env K=V ...`` argv prefix (never for secrets: those go on stdin)."""
    return ["env", *[f"{k}={v}" for k, v in env.items()]] if env else []
