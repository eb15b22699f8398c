"""The FAKE Hub (tests/fakehub.py) in a process of its own, for a test that SIGSTOPs it as a Hub
that stops answering (its TCP listener still takes connections: the kernel queues them, and no
answer ever comes). Not the real Hub.

``python -m tests.hubproc TOKEN USER`` serves until its stdin closes, after printing the Hub's
URL on one line. ``hub_process`` starts one and, when left, SIGCONTs it (it may be stopped),
closes its stdin and ends it by PID.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
from typing import Iterator, Tuple

from tests.conftest import ROOT

START_WAIT = 30.0  # seconds for the child to say its URL


@contextlib.contextmanager
def hub_process(token: str, user: str) -> Iterator[Tuple[int, str]]:
    """A fake Hub process knowing ``token`` (of ``user``, may write): (its PID, its URL)."""
    p = subprocess.Popen(
        [sys.executable, "-m", "tests.hubproc", token, user],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stdout is not None
        ready, _, _ = select.select([p.stdout], [], [], START_WAIT)
        url = p.stdout.readline().strip() if ready else ""  # a whole line, or EOF: it exited
        assert url.startswith("http://"), f"the fake Hub process said {url!r}"
        yield p.pid, url
    finally:
        os.kill(p.pid, signal.SIGCONT)  # a stopped process takes no SIGKILL until continued
        p.kill()
        p.communicate(timeout=START_WAIT)


def main() -> None:
    from tests.fakehub import FakeHub

    hub = FakeHub().start()
    hub.add_token(sys.argv[1], sys.argv[2])
    print(hub.url, flush=True)
    sys.stdin.read()  # until the test closes it (or kills this process)
    hub.stop()


if __name__ == "__main__":
    main()
