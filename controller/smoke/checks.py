"""The checks of ``rgt smoke``: their names and order, the one line each prints, and the pure
facts they are judged on (a step rate, the state hashes a job prints, which project files are
shell scripts with CRLF line endings, what the job left outside what a pull brings back).

A check is ``ok`` with the fact it measured, or ``FAIL`` with the reason and the remedy; the
first FAIL ends the walk with ``SmokeFailed`` (exit 19), whose one line names the check.
Nothing here starts a process or reads the run's directories (controller/smoke/walk.py does).
"""

from __future__ import annotations

import math
import os
import re
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from onbox.common.errors import SmokeFailed
from onbox.common.sealtime import SealTime

NAMES = {
    1: "starts",
    2: "progress",
    3: "checkpoint",
    4: "sealed",
    5: "resume",
    6: "exact",
    7: "outputs",
}
HASHES = ("weights", "optimizer", "rng")
_HASH = re.compile(r"\b(weights|optimizer|rng) sha256 ([0-9a-f]{64})\b")
_SHELLS = re.compile(rb"^#![^\n]*\b(sh|bash|zsh|dash|ksh)\b")
SCRIPT_SUFFIXES = (".sh", ".bash", ".zsh", ".ksh")
# What a job run leaves that is nobody's result: bytecode caches.
_CACHE_PARTS = ("__pycache__",)


class Report:
    """Prints each check's line through ``emit`` as it is decided."""

    def __init__(self, emit: Callable[[str], None]) -> None:
        self.emit = emit

    def ok(self, n: int, fact: str) -> None:
        self.emit(f"ok   {n} {NAMES[n]}: {fact}")

    def note(self, text: str) -> None:
        self.emit(f"       {text}")

    def skip(self, n: int, why: str) -> None:
        self.emit(f"--   {n} {NAMES[n]}: {why}")

    def fail(self, n: int, reason: str, remedy: str) -> SmokeFailed:
        """Print the FAIL line and its remedy; the error to raise (``raise report.fail(...)``)."""
        self.emit(f"FAIL {n} {NAMES[n]}: {reason}")
        self.emit(f"       remedy: {remedy}")
        return SmokeFailed(f"smoke check {n} ({NAMES[n]}) failed: {reason}", remedy)


def step_rate(samples: Sequence[Tuple[float, int]]) -> Optional[float]:
    """Steps per second over ``samples`` ((time, step), in the order seen); None when fewer
    than two distinct times or steps were seen."""
    if len(samples) < 2:
        return None
    (t0, s0), (t1, s1) = samples[0], samples[-1]
    if t1 <= t0 or s1 <= s0:
        return None
    return (s1 - s0) / (t1 - t0)


def rate_text(rate: Optional[float]) -> str:
    if rate is None:
        return "step rate not measured (too few steps)"
    if rate >= 1:
        return f"{rate:.1f} steps/s"
    return f"{1 / rate:.1f} s/step"


def seal_seconds(st: SealTime) -> Optional[int]:
    """The whole seconds to pass as ``--seal-time`` (rounded up, at least 1)."""
    return None if st.seconds is None else max(1, math.ceil(st.seconds))


def seal_text(st: SealTime) -> str:
    s = seal_seconds(st)
    if s is None or st.seconds is None:
        return "seal time not measured"
    what = "upload only: the job was never asked" if st.upload_only else "ask to sealed"
    return f"seal time {st.seconds:.1f} s ({what}; pass --seal-time {s})"


def state_hashes(output: str) -> Dict[str, str]:
    """The last ``weights|optimizer|rng sha256 HEX`` the job printed, by name."""
    return {name: hexd for name, hexd in _HASH.findall(output)}


def hash_mismatch(reference: Dict[str, str], resumed: Dict[str, str]) -> List[str]:
    """The state names whose hashes differ between the uninterrupted and the resumed run (a
    name the reference printed that the resumed run did not counts as differing)."""
    return [n for n in HASHES if n in reference and resumed.get(n) != reference[n]]


def is_shell_script(rel: str, head: bytes) -> bool:
    """A shell script by its name or its shebang (``head``: its first bytes)."""
    return rel.lower().endswith(SCRIPT_SUFFIXES) or bool(_SHELLS.match(head))


def crlf_scripts(root: str, files: Iterable[str]) -> List[str]:
    """The shell scripts among ``files`` (relative to ``root``) with CRLF line endings: bash
    reads ``$'\\r'`` as part of each command on a Linux box."""
    bad = []
    for rel in files:
        path = os.path.join(root, rel)
        if os.path.islink(path) or not os.path.isfile(path):
            continue
        try:
            with open(path, "rb") as f:
                data = f.read(1 << 20)
        except OSError:
            continue
        if b"\r\n" in data and is_shell_script(rel, data[:200]):
            bad.append(rel)
    return bad


def tree(root: str) -> Set[str]:
    """Every file under ``root``, relative to it, except bytecode caches."""
    out: Set[str] = set()
    for here, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _CACHE_PARTS]
        for f in files:
            out.add(os.path.relpath(os.path.join(here, f), root))
    return out


def left_behind(before: Set[str], after: Set[str], outputs: Sequence[str]) -> List[str]:
    """Files the job created in its workdir that no declared output covers: they stay on the
    box, and ``rgt pull`` does not bring them back."""
    heads = [o.strip("/").replace("\\", "/") for o in outputs if o.strip("/")]

    def declared(rel: str) -> bool:
        r = rel.replace(os.sep, "/")
        return any(r == h or r.startswith(h + "/") for h in heads)

    return sorted(r for r in after - before if not declared(r))


def short_list(items: Sequence[str], most: int = 6) -> str:
    shown = ", ".join(items[:most])
    return shown + (f" and {len(items) - most} more" if len(items) > most else "")
