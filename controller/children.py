"""The laptop's child processes (ssh, rsync, the tar stream, git, pip): each started out of reach
of the terminal's Ctrl-C, and stopped by rgt itself, by its PID, when rgt decides.

A terminal sends its Ctrl-C (SIGINT) to every process of its foreground process group, which
rgt's children used to share with it. rgt promises to finish some work after a Ctrl-C (`rgt
sweep` lets the deploys in flight end and records them: controller/sweep/run.py ``drive``), and
the ssh carrying that work died of the same SIGINT, so the deploy failed instead. So every child
is started in a session of its own (``Child``: setsid in the child, safe beside threads where a
``preexec_fn`` is not, and on Python 3.9). Nothing of rgt's needs the terminal there: ssh runs
with BatchMode (no prompt for a password, a passphrase or a host key: controller/remote.py). A
prompt that ssh does not control, a jump host's own ssh (ProxyJump passes it none of rgt's
options), cannot reach the terminal either: it fails at once (no /dev/tty), where a background
process group of the terminal's session would stop on it (SIGTTIN) until rgt's timeout.

rgt stops each child itself, by its PID, with the process group it leads (``Child.kill``): the
thread that started one kills it on an error, a timeout or a Ctrl-C raised there
(controller/capture.py, controller/results/transport.py, controller/deploy/release.py, ``run``
here), and ``stop_all`` kills every child still running when rgt leaves the work of other
threads (a second Ctrl-C in `rgt sweep`). A thread whose child ``stop_all`` killed gets a
KeyboardInterrupt from its ``wait``, as a Ctrl-C would have given it, and starts no other child.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import weakref
from typing import Any, Optional, Sequence, Set

_lock = threading.Lock()
_live: weakref.WeakSet[Child] = weakref.WeakSet()  # started, maybe running
_cut: weakref.WeakSet[Child] = weakref.WeakSet()  # killed by stop_all
_stopping = False


class Child(subprocess.Popen):  # type: ignore[type-arg]
    """A process rgt starts (module docstring): in a session of its own, known to ``stop_all``
    until it is collected. Once ``stop_all`` ran, a thread other than the main one (which
    stops what is left: the ssh control masters) starts none: KeyboardInterrupt."""

    def __init__(self, args: Sequence[str], **kwargs: Any) -> None:
        with _lock:  # (stop_all cannot run between the start and the entry in _live)
            if _stopping and threading.current_thread() is not threading.main_thread():
                raise KeyboardInterrupt
            super().__init__(list(args), start_new_session=True, **kwargs)
            _live.add(self)

    def kill(self) -> None:
        """SIGKILL to its process group, which it leads: what it started there goes with it
        (an rsync's ssh, a jump host's ssh), as a terminal's Ctrl-C took them all. Polled first,
        as Popen.send_signal does: a child reaped already may have a new process's PID; one not
        reaped (a zombie) still holds its PID, and with it its group's."""
        if self.poll() is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait(self, timeout: Optional[float] = None) -> int:
        """Popen's; KeyboardInterrupt when ``stop_all`` killed it (the caller's work was left
        by the person's Ctrl-C, not failed)."""
        rc = super().wait(timeout)
        if self in _cut:
            raise KeyboardInterrupt
        return rc


def run(
    argv: Sequence[str], *, timeout: float, stdout: int = subprocess.PIPE
) -> subprocess.CompletedProcess[bytes]:
    """``subprocess.run`` of ``argv`` as a ``Child``, its stdin /dev/null and its stderr kept
    (``stdout``: kept, or DEVNULL): killed by its PID on any exception (TimeoutExpired past
    ``timeout``, a Ctrl-C)."""
    with Child(argv, stdin=subprocess.DEVNULL, stdout=stdout, stderr=subprocess.PIPE) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except BaseException:
            p.kill()
            raise
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def started() -> Set[int]:
    """The PIDs of the children started and not collected yet, running or not."""
    with _lock:
        return {p.pid for p in _live}


def stop_all() -> None:
    """Kill every child still running, each with its process group (its own session's, which
    the child leads), and start no more outside the main thread (``Child``)."""
    global _stopping
    with _lock:
        _stopping = True
        for p in list(_live):
            if p.poll() is None:
                _cut.add(p)
                p.kill()
