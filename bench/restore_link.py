"""bench_restore.py ``--link RATE[,RATE...]``: the S3 restore with the store behind a link of a
given rate, as on a rented box whose store is across a network, not on its own loopback.

For each rate the benchmark process enters a fresh network namespace whose loopback is shaped
by ``tc qdisc ... tbf rate RATE`` and runs the S3 arms there (SeaweedFS started inside it, so
rgt's restore, s5cmd and weed all talk across the shaped loopback); it goes back to its own
namespace, and the namespace is deleted, after each rate, also when the run fails. What the
link gives in practice (tbf on a loopback moves less than its nominal rate) is the s5cmd
column: the table is read as a comparison at the same link, not at the nominal rate. Needs
root, ``ip`` and ``tc``.

The section between the ``bench_restore_link`` markers in bench/README.md is written from it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
from typing import TYPE_CHECKING, Iterator, List, Optional, Tuple

from bench_seal import mbps, med

if TYPE_CHECKING:
    from bench_restore import Result

BEGIN = "<!-- bench_restore_link:begin -->"
END = "<!-- bench_restore_link:end -->"
CLONE_NEWNET = 0x40000000
ARMS = ("rgt s3", "s5cmd", "s5cmd && sync")


def _ip(*args: str) -> None:
    p = subprocess.run(["ip", *args], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {p.stderr.strip()}")


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


@contextlib.contextmanager
def shaped_loopback(rate: str) -> Iterator[None]:
    """This process (and what it starts from now on) in a new network namespace whose
    loopback carries at most ``rate`` (tc's notation: 2500mbit, 8gbit); back in its own
    namespace, the new one deleted, at the end."""
    name = f"rgtlink{os.getpid()}"
    own = os.open("/proc/self/ns/net", os.O_RDONLY)
    _ip("netns", "add", name)
    try:
        fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
        try:
            _setns(fd)
        finally:
            os.close(fd)
        try:
            _ip("link", "set", "lo", "up")
            tc = ["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate]
            p = subprocess.run(
                tc + ["burst", "16mb", "latency", "50ms"], capture_output=True, text=True
            )
            if p.returncode != 0:
                raise RuntimeError(f"{' '.join(tc)} failed: {p.stderr.strip()}")
            yield
        finally:
            _setns(own)
    finally:
        os.close(own)
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)


def _speed(r: Result, arm: str) -> Optional[float]:
    xs = r.arms.get(arm)
    return mbps(r.case.total, med([s.seconds for s in xs])) if xs else None


def _cell(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.0f}"


def _ratio(a: Optional[float], b: Optional[float]) -> str:
    return "-" if a is None or b is None else f"{a / b:.2f}x"


def render(runs: List[Tuple[str, List[Result]]], meta: str) -> str:
    """The section: per rate and case, rgt's restore next to s5cmd (and s5cmd && sync)."""
    lines = [BEGIN, meta, ""]
    lines += [
        "| link (tbf rate) | checkpoint | rgt s3:// (MB/s) | s5cmd cp (MB/s) | ratio "
        "| s5cmd cp && sync (MB/s) | ratio to s5cmd cp && sync |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for rate, results in runs:
        for r in results:
            rgt, s5, s5s = (_speed(r, a) for a in ARMS)
            lines.append(
                f"| {rate} | {r.case.name} | {_cell(rgt)} | {_cell(s5)} | {_ratio(rgt, s5)} | "
                f"{_cell(s5s)} | {_ratio(rgt, s5s)} |"
            )
    lines += ["", "Every timed run (s; the client's CPU / weed's), in order:", ""]
    for rate, results in runs:
        for r in results:
            for arm, xs in r.arms.items():
                text = ", ".join(f"{s.seconds:.2f} ({s.cpu:.2f} / {s.server_cpu:.2f})" for s in xs)
                lines.append(f"- {rate}, {r.case.name}, {arm}: {text}")
    lines.append(END)
    return "\n".join(lines) + "\n"
