"""A box's ssh connection opened ahead of its first command (controller/remote.py ``SshRemote``),
so that the handshake, most of what a command of a deploy of unchanged code waits for, overlaps
the laptop's own work (`rgt deploy` hashes the project and builds the agent's wheel meanwhile).

``Ahead.start`` runs ``ssh -N -T`` with the target's own options and ``ControlMaster=yes`` put
first (ssh takes an option's first value): it only ever becomes the control master, never a
client of another (``ssh -N`` riding a master would open a login shell on the box), and with
``ControlPersist`` it goes to the background once logged in; its foreground process exits 0
then, with the socket listening. The first command waits for
that (``Ahead.join``) and rides the master, as it would ride one it had opened itself. What the
commands see does not change:

- a socket already at the control path (another rgt's master, or a stale one): nothing is
  started, and the command rides that master (or replaces a stale one) as it always did;
- the foreground ssh exits 255: it could not connect or log in, and says why as the command's
  ssh would have; the caller raises that (``Remote.check_transport``), so an unreachable box is
  not waited for twice;
- another master took the socket meanwhile (ssh then goes on without multiplexing, and would
  hold a connection of its own open): it is stopped, and the command goes on as it always did.
  ssh says so ("disabling multiplexing"), which is taken at once; an ssh that words it
  otherwise, or says nothing (its LogLevel), is known by the master that answers at the socket
  (``ssh -O check``) while it is still running, looked for each LOOK seconds of silence;
- not done within the wait: stopped, and the command connects itself, within its own timeout;
- any other end (a signal, an ssh that cannot be run): the command goes on as it always did.

Every process this starts is stopped by its pid (``stop``), also when the connection is closed
before it was waited for.
"""

from __future__ import annotations

import os
import select
import subprocess
import time
from typing import List, Optional, Sequence, Tuple

from controller import children
from controller.children import Child

# What ssh says when the master it was to become lost the socket to another one: it then goes on
# without multiplexing, and with -N would hold its connection open until stopped.
LOST_SOCKET = b"disabling multiplexing"
# How long a silent foreground ssh runs before the socket is looked at (module docstring): the
# look is a stat, and ``ssh -O check`` only once a socket is there. Its own master's socket
# appears just before the foreground exits, so a deploy rarely pays for a check at all.
LOOK = 0.1
# The most one ``ssh -O check`` may take (a master that does not answer is no master).
CHECK_BOUND = 5.0
# The most of its stderr kept: ssh's error is a few lines.
MAX_ERR = 64 << 10


class Ahead:
    """The foreground ``ssh -N`` opening a control master, until it is joined or stopped."""

    def __init__(
        self, proc: subprocess.Popen[bytes], check: Sequence[str] = (), control_path: str = ""
    ) -> None:
        self.proc = proc
        self.check = list(check)  # ssh -O check for the same socket (none: words alone)
        self.control_path = control_path

    @classmethod
    def start(
        cls, base: Sequence[str], destination: Sequence[str], control_path: str
    ) -> Optional[Ahead]:
        """Start ssh (``base``: ssh and the target's options; ``destination``: its own options
        and host) opening the master alone (``ahead_argv``), or None where a socket is already
        at ``control_path`` or ssh cannot be started."""
        if os.path.lexists(control_path):
            return None
        check = [*base, "-O", "check", *destination]
        try:
            proc = Child(
                ahead_argv(base, destination),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
        except OSError:
            return None  # the command's own ssh says what is missing
        return cls(proc, check, control_path)

    def join(self, bound: float) -> Optional[bytes]:
        """Wait (at most ``bound`` seconds) for the foreground ssh to end. Its stderr when it
        exited 255 (it could not connect or log in); None otherwise: a master is up, or there
        is none and the command connects itself (ssh was stopped: it lost the socket to another
        master, or ran past ``bound``; or it ended some other way)."""
        rc, err = self._wait(bound)
        return err if rc == 255 else None

    def _wait(self, bound: float) -> Tuple[Optional[int], bytes]:
        """The foreground ssh's exit status (None: stopped here) and stderr."""
        deadline = time.monotonic() + bound
        err = bytearray()
        assert self.proc.stderr is not None
        fd = self.proc.stderr.fileno()
        try:
            # EOF once the foreground ssh has exited: the master it leaves behind has put its
            # own standard streams on /dev/null by then.
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.stop()
                    return None, bytes(err)
                if not select.select([fd], [], [], min(left, LOOK))[0]:
                    if self._master_answers(left):  # another's, or its own in the background
                        self.stop()
                        return None, bytes(err)
                    continue
                chunk = os.read(fd, 4096)
                if not chunk:
                    break
                err += chunk[: max(0, MAX_ERR - len(err))]
                if LOST_SOCKET in err:
                    self.stop()
                    return None, bytes(err)
            try:
                return self.proc.wait(timeout=max(0.0, deadline - time.monotonic())), bytes(err)
            except subprocess.TimeoutExpired:
                self.stop()
                return None, bytes(err)
        except BaseException:  # interrupted: not left running (its master: the caller's close)
            self.stop()
            raise
        finally:
            self.proc.stderr.close()

    def _master_answers(self, left: float) -> bool:
        """Whether a master answers at the control path (``ssh -O check``, within ``left``
        seconds and CHECK_BOUND): the command can ride it, and the foreground ssh is not
        needed any more, in whatever words it lost the socket."""
        if not self.check or not os.path.lexists(self.control_path):
            return False
        try:
            p = children.run(self.check, timeout=min(left, CHECK_BOUND), stdout=subprocess.DEVNULL)
        except (OSError, subprocess.SubprocessError):  # no answer in time: no master
            return False
        return p.returncode == 0

    def stop(self) -> None:
        """Stop the foreground ssh by its pid (a master it already made is the caller's to stop:
        ``ssh -O stop``), and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        if self.proc.stderr is not None:
            self.proc.stderr.close()


def ahead_argv(base: Sequence[str], destination: Sequence[str]) -> List[str]:
    """The ssh command line (``base``: ssh and the target's options) that opens the master and
    nothing else: a master or nothing, no command, no session (``-N``), no tty."""
    return [base[0], "-o", "ControlMaster=yes", *base[1:], "-N", "-T", *destination]
