"""What every benchmark here reports the same way: the machine, the filesystem under a path, a
cold page cache, and a target's verdict. Imported by the scripts beside it (bench/ is their
sys.path[0])."""

from __future__ import annotations

import contextlib
import os
import platform


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
