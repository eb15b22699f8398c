"""Running commands on the box: over the system OpenSSH client, or on this machine (``local``).

Every command is an argv list, and arrives byte for byte whatever the box's login shell is.
sshd hands the command line to the user's login shell, which rentals set to bash, dash, zsh or
fish (fish parses backslashes and quotes its own way), so no argument ever reaches it: the line
ssh sends is always ``exec /bin/sh -c 'eval "$(printf "...")"'``, where ``...`` is a POSIX
script (argv quoted for sh) with every byte outside a small plain set written as a printf octal
escape (``box_line``). That line has no character any of those shells (nor csh/tcsh) treats
specially inside single quotes, so each of them runs ``/bin/sh`` with the same argument, and sh
alone parses the script. Stdin stays free for data (secrets, file streams); no decoder beyond
sh's own printf is needed on the box. The ssh client is the system one, so
``~/.ssh/config``, ProxyJump and agents work, with rgt's options put first (ssh takes the first
value it sees): ``BatchMode`` (never a prompt), keepalives, connection multiplexing (one TCP
connection for a whole deploy), and rgt's own known_hosts next to the user's with
``StrictHostKeyChecking=accept-new``. A changed host key is a hard stop that shows both
fingerprints; it is never accepted.

Ciphers: AES-GCM first where no configuration chose them (controller/sshcipher.py).

Errors: ssh's exit status 255 becomes RemoteUnreachable (exit 3), AuthError (exit 4, refused
key), HostKeyChanged or HostKeyUnknown (exit 4; the box's key or a jump host's:
controller/hostkey.py); a box without /bin/sh, HostError (exit 9); the remote command's own
status is returned to the caller. A jump host's ssh says why it failed to /dev/null (ssh does
so under ControlPersist): a connection its proxy closed before the handshake is tried once more
without multiplexing, to hear it (controller/hostkey.py ``proxy_words``).

Control sockets (multiplexing) live in a directory rgt made itself, mode 0700, checked before
each use (controller/controldir.py): whoever can write there could put a socket of their own in
ssh's way and see every command and byte of the connection. Each is named for the target's
identity and route (key, jump host, user, host, port, ssh configuration: ``control_path``), so
commands share a connection only with the same target's, and each target logs in as itself.
ssh expands ``%`` tokens in the paths rgt gives it (ControlPath, UserKnownHostsFile, a key) and
in a jump host: each ``%`` goes as ``%%`` (controller/target.py ``ssh_literal``).

Output: what the box prints is untrusted, and is kept bounded (controller/capture.py): a
command's stdout to ``limit`` bytes (MAX_OUTPUT unless the caller needs more), its stderr to a
head and a tail; a command printing more is stopped, not waited for.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shlex
import subprocess
from typing import IO, Dict, Iterator, List, Mapping, Optional, Sequence

from controller import envnames
from controller.capture import Relayed, TooMuch, capture, command_name, relayed, show_lines
from controller.controldir import control_dir, control_path, let_go_dir, use_dir
from controller.hostkey import PROXY_CLOSED, Route, key_refused, known_name, proxy_words
from controller.hostkey import HostKeyChanged as HostKeyChanged  # (re-exported)
from controller.hostkey import HostKeyUnknown as HostKeyUnknown  # (re-exported)
from controller.sshahead import Ahead
from controller.sshcipher import cipher_preference, ssh_settings
from controller.target import Target, ssh_destination_args, ssh_literal, ssh_unexpandable
from onbox.common.errors import AuthError, HostError, RemoteUnreachable, RgtError, UsageError
from onbox.common.size import human
from onbox.common.terminal import printable


def controller_home() -> str:
    """Where the laptop keeps rgt's state: the run registry, known_hosts, ssh control sockets."""
    env = os.environ.get(envnames.CONTROLLER_HOME)
    if env:
        return os.path.abspath(env)
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "rgt")


@dataclasses.dataclass
class Result:
    """A finished remote command; ``held``: the error lines its relay did not show (``run``)."""

    rc: int
    stdout: bytes
    stderr: bytes
    held: bytes = b""

    @property
    def text(self) -> str:
        return self.stdout.decode("utf-8", "replace")

    @property
    def err(self) -> str:
        return self.stderr.decode("utf-8", "replace")


def quote_argv(argv: Sequence[str]) -> str:
    """One POSIX sh line that runs ``argv`` exactly (run by the box's /bin/sh, see box_line)."""
    if not argv:
        raise ValueError("empty command")
    return " ".join(shlex.quote(a) for a in argv)


BOX_SH = "/bin/sh"  # the one shell every remote command runs under (POSIX requires it there)
# The bytes the fixed line carries as themselves: printable ASCII without ' and \ (special in
# fish's single quotes; ' ends them in every shell), ! (csh history, even quoted), " $ ` (special
# in sh's double quotes, where the text sits next) and % (printf's conversions). Every other byte
# is an octal escape, a backslash and three digits, which no shell's single quotes change: fish
# and csh keep a backslash as it is unless a quote, a backslash, a newline or ! follows.
_PLAIN = frozenset(b for b in range(0x20, 0x7F) if chr(b) not in "'\\!\"$`%")
# sshd runs the login shell with the line as one argument, and that shell runs sh with the
# script as one: Linux caps one argument at 128 KiB (MAX_ARG_STRLEN), so stay below it.
MAX_LINE = 120 * 1024


def _no_box_sh(stderr: bytes) -> Optional[str]:
    """The line of ``stderr`` in which a login shell says BOX_SH does not exist (bash, dash,
    zsh, fish, tcsh, in that order), or None: not a failure of a command BOX_SH ran."""
    sh = re.escape(os.fsencode(BOX_SH))
    m = re.search(
        rb"(?m)^\S+: line 1: " + sh + rb": No such file or directory$"
        rb"|^.*: exec: " + sh + rb": not found$"
        rb"|^.*:1: no such file or directory: " + sh + rb"$"
        rb"|^fish: Unknown command: " + sh + rb"$"
        rb"|^" + sh + rb": Command not found\.$",
        stderr,
    )
    return m.group(0).decode("utf-8", "replace") if m else None


def box_line(script: str) -> str:
    """The line ssh sends to run the POSIX sh ``script`` on the box: the same command in every
    login shell (module docstring). Non-UTF-8 bytes in ``script`` (surrogate escapes, as
    ``os.fsdecode`` makes) are sent as the bytes they stand for."""
    # The script never starts with "-" (callers begin it with a word), which printf would read
    # as an option.
    body = "".join(chr(b) if b in _PLAIN else f"\\{b:03o}" for b in os.fsencode(script))
    return f'exec {BOX_SH} -c \'eval "$(printf "{body}")"\''


# The most bytes of a remote command's stdout kept by default: a state document, a status, a
# short listing. Callers that legitimately read more (an events file or a health series for
# `rgt report`, a store's MANIFEST, the listing of a run's files) pass their own ``limit``.
MAX_OUTPUT = 4 << 20


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
        limit: int = MAX_OUTPUT,
        over: str = "fail",
        what: Optional[str] = None,
        relay: bool = False,
    ) -> Result:
        """Run to the end; ssh failures raise, the command's own status is returned. Of its
        stdout at most ``limit`` bytes are kept (``over``: controller/capture.py); past them,
        with "fail", HostError (exit 9) naming the command (``what``, else its argv) and the
        limit. With ``relay`` its stderr is shown as it comes and ``timeout`` bounds its
        silence, not its run (controller/capture.py); the error a failed command ends with is
        not shown but returned (``Result.held``) for the caller's error to say, unless ssh
        failed (then it is shown before ssh's error is raised)."""
        stalled = f"sent nothing for {timeout:.0f} s" if relay else None
        self.ready(timeout)
        try:
            with self._unreachable(argv, stalled or f"did not finish within {timeout:.0f} s"):
                got = capture(
                    self.argv(argv, env),
                    timeout=timeout,
                    limit=limit,
                    over=over,
                    input=input,
                    relay=relay,
                )
        except TooMuch as e:
            raise HostError(
                f"{self.target.label}: {printable(what or f'`{command_name(list(argv))}`')} "
                f"printed more than {human(e.limit)} on its standard output, more than rgt "
                "reads of it: "
                "it was stopped, and nothing of what it printed was used",
                "look at what that command prints on the box: rgt's own never print that "
                "much, so a file there is damaged or altered, or a command runs away",
            ) from None
        try:
            self.check_transport(got.rc, got.stderr)
        except RgtError:
            # The box's error the relay held back for the caller's error, which is now this
            # one (ssh lost the connection): shown, or nothing would say what the box said.
            show_lines(got.held)
            raise
        return Result(got.rc, got.stdout, got.stderr, got.held)

    def sh(
        self,
        script: str,
        *args: str,
        input: Optional[bytes] = None,
        env: Optional[Mapping[str, str]] = None,
        timeout: float = 120,
        limit: int = MAX_OUTPUT,
        over: str = "fail",
        what: Optional[str] = None,
        relay: bool = False,
    ) -> Result:
        """Run a POSIX sh script on the box with ``args`` as $1, $2, ... (quoted, never
        interpolated into the script)."""
        argv = ["sh", "-c", script, "rgt", *args]
        return self.run(
            argv,
            input=input,
            env=env,
            timeout=timeout,
            limit=limit,
            over=over,
            what=what,
            relay=relay,
        )

    def stream(self, argv: Sequence[str], out: IO[bytes], *, idle: float = 300) -> Result:
        """Run ``argv``, writing its stdout to ``out`` as it comes (none of it kept: the
        Result's stdout is empty), its stderr kept as ``run`` keeps it; RemoteUnreachable when
        it sends nothing for ``idle`` seconds."""
        self.ready(idle)
        with self._unreachable(argv, f"sent nothing for {idle:.0f} s"):
            got = capture(self.argv(argv), timeout=idle, limit=0, over="tail", sink=out)
        self.check_transport(got.rc, got.stderr)
        return Result(got.rc, b"", got.stderr)

    @contextlib.contextmanager
    def _unreachable(self, argv: Sequence[str], stalled: str) -> Iterator[None]:
        """A command's timeout (``stalled`` says how) or a missing ssh: RemoteUnreachable."""
        try:
            yield
        except subprocess.TimeoutExpired:
            raise RemoteUnreachable(
                f"{self.target.label}: `{argv[0]}` {stalled}",
                "the box or the network is stalled; try again, or check the box",
            ) from None
        except FileNotFoundError as e:
            raise RemoteUnreachable(f"cannot run {e.filename}: {e.strerror}") from None

    def popen(self, argv: Sequence[str], env: Optional[Mapping[str, str]] = None) -> Relayed:
        """Start ``argv`` on the box with its stdout piped back (for following a log), its
        stderr shown as it comes, each line through ``printable`` (controller/capture.py)."""
        return relayed(self.argv(argv, env))

    def check_transport(self, rc: int, stderr: bytes) -> None:
        """Raise when ``rc`` is the transport's failure rather than the command's."""

    def connect_ahead(self) -> None:
        """Start opening the connection, in the background (controller/sshahead.py)."""

    def ready(self, bound: float = 120) -> None:
        """Wait (``bound`` s at most) for ``connect_ahead``'s connection; ssh's error if none."""

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
        dest = ssh_destination_args(target)  # (a key ssh cannot be given: refused first)
        config = os.environ.get(envnames.SSH_CONFIG)  # tests: -F /dev/null
        self.config_args = ["-F", config] if config else []
        settings = ssh_settings(self.config_args, dest)  # (a config ssh cannot read: too)
        self.home = home or controller_home()
        _ssh_path(self.home)  # refused before anything is made in it
        os.makedirs(self.home, mode=0o700, exist_ok=True)
        self.known_hosts = os.path.join(self.home, "known_hosts")
        self.control_dir = control_dir(self.home)
        use_dir(self.control_dir, self)
        # One socket per identity and route, not ssh's %C (controller/controldir.py).
        self.control_path = control_path(self.control_dir, [*self.config_args, *dest], settings)
        alive = os.environ.get(envnames.SSH_KEEPALIVE, "15")
        user_known = os.path.join(os.path.expanduser("~"), ".ssh", "known_hosts")
        self.options = [
            "-o", "BatchMode=yes",
            "-o", f"ConnectTimeout={os.environ.get('RGT_SSH_CONNECT_TIMEOUT', '15')}",
            "-o", f"ServerAliveInterval={alive}",
            "-o", "ServerAliveCountMax=3",
            "-o", "ControlMaster=auto",
            "-o", f"ControlPath={_ssh_path(self.control_path)}",
            "-o", "ControlPersist=60",
            "-o", "StrictHostKeyChecking=accept-new",
            # New keys are recorded in rgt's file (the first); the user's are honoured too.
            "-o", f"UserKnownHostsFile={_ssh_path(self.known_hosts)} {_ssh_path(user_known)}",
            "-o", "LogLevel=ERROR",
        ]  # fmt: skip
        self.options += cipher_preference(self.config_args, dest, settings)
        self.base = ["ssh", *self.config_args, *self.options]
        self.route = Route(target.label, self.config_args, dest, settings,
                           [self.known_hosts, user_known])  # fmt: skip
        self._ahead: Optional[Ahead] = None

    def connect_ahead(self) -> None:
        dest = ssh_destination_args(self.target)
        self._ahead = self._ahead or Ahead.start(self.base, dest, self.control_path)

    def ready(self, bound: float = 120) -> None:
        ahead, self._ahead = self._ahead, None
        failed = ahead.join(bound) if ahead is not None else None
        if failed is not None:  # ssh's own error: unreachable, refused, a changed host key
            self.check_transport(255, failed)

    def ssh_argv(self, *extra: str) -> List[str]:
        return [*self.base, *extra, *ssh_destination_args(self.target)]

    def argv(self, argv: Sequence[str], env: Optional[Mapping[str, str]] = None) -> List[str]:
        self.ready()  # (run and stream have waited already, within their own timeouts)
        # exec: the command is sh's own process, as with a login shell running one command, so
        # a hangup or a signal from sshd reaches it and its status is the session's.
        script = "exec " + quote_argv([*env_prefix(dict(env or {})), *argv])
        line = box_line(script)
        if len(line) > MAX_LINE:
            raise HostError(
                f"the command for {self.target.label} ({argv[0]!r} with {len(argv) - 1} "
                f"arguments) is {len(line)} bytes once encoded, more than one ssh command can "
                f"carry ({MAX_LINE})",
                "this is a bug in rgt: please report it",
            )
        # "--" before the host (ssh_destination_args): neither the host nor the line can be
        # read as an option by ssh.
        return [*self.ssh_argv("-T"), line]

    def check_transport(self, rc: int, stderr: bytes) -> None:
        missing_sh = _no_box_sh(stderr) if rc in (1, 127) else None
        if missing_sh:
            raise HostError(
                f"{self.target.label} has no {BOX_SH}, which rgt runs every command on the "
                f"box with ({missing_sh})",
                f"install a POSIX shell at {BOX_SH} (dash, bash or busybox) on the box",
            )
        if rc != 255:
            return
        text = stderr.decode("utf-8", "replace")
        jump = PROXY_CLOSED.search(text) and self.route.proxy
        if jump:  # its own ssh said why to /dev/null: ask it again, where it is heard
            no_mux = ["-o", "ControlMaster=no", "-o", "ControlPath=none", "-o", "ControlPersist=no"]
            argv = ["ssh", *no_mux, *self.base[1:], *ssh_destination_args(self.target)]
            text = proxy_words([*argv, box_line("exit 0")]) or text
        target_name = known_name(self.route.settings, self.target.host or "", self.target.port)
        refused = key_refused(text, self.route, target_name)
        if refused is not None:
            raise refused
        if re.search(_REFUSED, text):
            raise AuthError(
                f"{f'{self.route.hop} on the way to ' if jump else ''}{self.target.label} "
                f"refused the login: {_last_line(text, _REFUSED)}",
                "check the user and key (-i), or that your ssh agent holds the key",
            )
        reason = f": {_transport_line(text)}"
        # Through a jump host: what its ssh said first (it, or the box from it, unreachable).
        said = re.search(r"^(ssh: .*|channel \d+: open failed.*)$", text, re.MULTILINE)
        if jump and said:
            reason = f" through {self.route.hop}: {printable(said.group(1).strip())}"
        raise RemoteUnreachable(
            f"cannot reach {self.target.label}{reason}",
            "check the address and port, that the box is running, and your network",
        )

    def rsync_shell(self) -> Optional[List[str]]:
        """ssh for rsync's ``-e``, without the host (rsync puts it, from ``path_arg``, after
        these). Callers must pass rsync ``-s`` (``--protect-args``): then the command rsync has
        ssh send is only ``rsync --server [--sender] -LETTERS`` (option letters, ``.`` and
        ``-``), which every login shell parses alike, and every path and every option with a
        value travels inside rsync's own protocol instead of the command line. Without ``-s``,
        rsync quotes them for a POSIX shell, which fish reads otherwise (module docstring)."""
        self.ready()
        return [*self.base, *ssh_destination_args(self.target)[:-2]]

    def path_arg(self, path: str) -> str:
        # rsync's "host:path" (the host never starts with "-"; with -s no shell sees the path);
        # rsync ends the host at its first ":": an IPv6 one (fe80::1%eth0) goes in brackets.
        host = self.target.host or ""
        return f"[{host}]:{path}" if ":" in host else f"{host}:{path}"

    def close(self) -> None:
        if self._ahead is not None:  # never waited for: stopped by its pid (its master below)
            self._ahead.stop()
        try:  # the master's answer is one line: a bounded tail is all there is to keep
            capture(self.ssh_argv("-O", "stop"), timeout=30, limit=4096, over="tail")
        except (subprocess.TimeoutExpired, FileNotFoundError):
            pass
        let_go_dir(self.home, self.control_dir, self)


def open_remote(target: Target) -> Remote:
    return LocalRemote() if target.kind == "local" else SshRemote(target)


def _ssh_path(path: str) -> str:
    """``path`` as a path option of ssh's carries it (``%`` doubled: ssh expands its tokens
    there); a path with what no option carries is refused before ssh runs."""
    why = ssh_unexpandable(path)
    if why:
        raise UsageError(
            envnames.CONTROLLER_HOME,
            f"the path {path!r} {why}",
            "set RGT_CONTROLLER_HOME to a path without those characters",
        )
    return ssh_literal(path)


# How ssh says a host refused the login.
_REFUSED = r"Permission denied|Too many authentication failures"


def _last_line(text: str, saying: str = "") -> str:
    """The last line of ``text`` (that has ``saying``, a pattern, where one does)."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    said = [ln for ln in lines if saying and re.search(saying, ln)]
    return (said or lines or [""])[-1]


# What ssh (or rsync about its ssh) says when the connection fails; the remote command's own
# stderr shares the stream and must not be taken for the reason.
_TRANSPORT = re.compile(
    r"^(ssh:|ssh_|mux_|unix_listener|client_loop|kex_|rsync error:|Timeout, server|Connection |"
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


def rsync_e(shell: Sequence[str]) -> str:
    """rsync's ``-e`` string for an ssh argv (the one quoting of it, for push and pull).

    rsync splits ``-e`` on spaces and honours single and double quotes, not backslashes: an
    argument of plain characters goes as is, another in the quotes it does not contain; one
    with both quote characters or a newline cannot be carried and is refused (exit 2).
    """
    out = []
    for arg in shell:
        if arg and all(c.isalnum() or c in "@%+=:,./_-" for c in arg):
            out.append(arg)
        elif "\n" in arg:
            raise UsageError("ssh option", f"{arg!r} has a newline, which rsync -e cannot carry")
        elif "'" not in arg:
            out.append(f"'{arg}'")
        elif '"' not in arg:
            out.append(f'"{arg}"')
        else:
            raise UsageError(
                "ssh option", f"{arg!r} has both quote characters, which rsync -e cannot carry"
            )
    return " ".join(out)
