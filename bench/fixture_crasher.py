"""Benchmark fixture: record a start, run healthy, record a crash, exit 1.

    fixture_crasher.py LOG SECONDS

Appends ``start <time.time()> <pid>`` to LOG first thing, sleeps SECONDS (longer than the
supervisor's start grace, so both rgt-agent and supervisord see a crash after a healthy run and
restart it at once, without backoff), appends ``crash <time.time()> <pid>`` and exits with 1.

Only builtin modules are imported, so that the interpreter start, which every supervisor pays
equally, stays small. The pid lets the benchmark stop a stray copy by pid.
"""

import os
import sys
import time


def note(path: str, what: str) -> None:
    # One write to an O_APPEND file: lines from successive attempts never interleave. No fsync:
    # its cost would land inside the latency being measured and only add disk noise.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, f"{what} {time.time():.6f} {os.getpid()}\n".encode())
    finally:
        os.close(fd)


def main() -> None:
    log, seconds = sys.argv[1], float(sys.argv[2])
    note(log, "start")
    time.sleep(seconds)
    note(log, "crash")
    # os._exit: no interpreter teardown between the recorded crash and the exit, so the gap
    # the benchmark measures is the supervisor's, not this script's.
    os._exit(1)


if __name__ == "__main__":
    main()
