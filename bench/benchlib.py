"""What every benchmark here reports the same way: the machine, the filesystem under a path, a
cold page cache, a target's verdict, the versions of the code and tools measured, and its
section of bench/README.md. Imported by the scripts beside it (bench/ is their
sys.path[0])."""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
from typing import List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def verdict(ok: bool) -> str:
    return "**pass**" if ok else "**FAIL**"


def machine() -> str:
    cpu = mem = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem = f"{int(line.split()[1]) / (1 << 20):.0f} GiB RAM"
                break
    return f"{os.cpu_count()} cores ({cpu}), {mem}, {platform.system()} {platform.release()}"


def fs_type(path: str) -> str:
    best, kind = "", "unknown"
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            mount = parts[1]
            if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) > len(
                best
            ):
                best, kind = mount, parts[2]
    return kind


def can_drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def tool_version(argv: List[str]) -> str:
    """The first line a tool prints about its version ("unknown" when it cannot say)."""
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        return (p.stdout or p.stderr).strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown"


def commit_of(part: str) -> str:
    """The commit measured, and whether the working tree of ``part`` (onbox, controller)
    differed from it: the figures belong to that code."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=ROOT, text=True, capture_output=True, timeout=10, check=True
        ).stdout.strip()

    try:
        head, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", part)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + (f" with uncommitted changes to {part}/" if dirty else "")


def replace_section(text: str, begin: str, end: str, block: str) -> Optional[str]:
    """``text`` with what lies from ``begin`` to ``end`` (the markers included) replaced by
    ``block``; None when the markers are missing (the caller adds the section)."""
    if begin not in text or end not in text:
        return None
    head, rest = text.split(begin, 1)
    return head + block + rest.split(end, 1)[1]


def write_section(path: str, begin: str, end: str, block: str) -> None:
    """The section of ``path`` from ``begin`` to ``end`` replaced by ``block`` (which carries
    the markers); SystemExit, the file unchanged, where it has no such section."""
    with open(path) as f:
        text = f.read()
    new = replace_section(text, begin, end, block)
    if new is None:
        raise SystemExit(f"{path} has no {begin} ... {end} section")
    with open(path, "w") as f:
        f.write(new)
