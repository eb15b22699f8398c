"""A reference process run beside the one under test, rather than before it: e.g. the
uninterrupted training whose final hashes a resumed run must equal, started while the run under
test waits on its scheduler or sleeps through its steps.

``Beside(argv, cwd, env)`` starts it with stdout and stderr in files of ``cwd`` (a pipe nobody
reads could fill and stall it); ``output(timeout)`` waits for it, bounded, and returns its stdout
once it exited 0 (else an AssertionError with its stderr). Used as a context manager, it is
killed by PID on the way out if it still runs.
"""

from __future__ import annotations

import os
import subprocess
from types import TracebackType
from typing import Dict, Optional, Sequence, Type


class Beside:
    """One reference process, its output in ``cwd``/beside.out and beside.err."""

    def __init__(self, argv: Sequence[str], cwd: str, env: Dict[str, str]) -> None:
        self.out = os.path.join(cwd, "beside.out")
        self.err = os.path.join(cwd, "beside.err")
        with open(self.out, "wb") as fo, open(self.err, "wb") as fe:
            self.argv = list(argv)
            self.proc = subprocess.Popen(self.argv, stdout=fo, stderr=fe, cwd=cwd, env=env)

    def output(self, timeout: float) -> str:
        """Its stdout, once it exited 0 within ``timeout`` seconds."""
        try:
            rc = self.proc.wait(timeout=timeout)
        finally:
            self.kill()
        with open(self.err, errors="replace") as f:
            err = f.read()
        assert rc == 0, f"{self.argv} exited {rc}: {err[-3000:]}"
        with open(self.out, errors="replace") as f:
            return f.read()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> Beside:
        return self

    def __exit__(
        self,
        kind: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        self.kill()
