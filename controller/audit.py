"""The preflight audit of `rgt deploy`: what the box is, read in one round trip, and judged before
anything on it is changed.

Checked: the box answers; its Python (the ``--python`` given, else ``python3`` on the
non-interactive PATH, which often lacks conda) is 3.9 or newer; GPUs and driver (nvidia-smi);
free bytes and inodes where rgt writes (RGT_HOME) and on a file:// store's mount; the cgroup
memory limit; the clock's skew against the laptop's; rsync and tar. Each finding is ok, a
warning (shown, deploy goes on) or a problem (deploy stops with them all listed).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Dict, List, Optional

from controller.remote import Remote
from onbox.errors import HostError

PROBE = r"""
py=$1; home=${2:-$HOME/.rgt}; durable=$3
echo "@@home"; printf '%s\n' "$HOME"
echo "@@python"; command -v "$py" 2>/dev/null &&
  "$py" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>&1
echo "@@gpu"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
  2>/dev/null
echo "@@df"; for d in "$home" "$durable"; do
  [ -n "$d" ] || continue; p=$d; while [ ! -e "$p" ]; do p=$(dirname "$p"); done
  printf '%s\n' "$d"; df -Pk "$p" | tail -n 1; df -Pi "$p" | tail -n 1; done
echo "@@cgroup"; cat /sys/fs/cgroup/memory.max 2>/dev/null ||
  cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null
echo "@@tools"; for t in rsync tar; do command -v "$t" >/dev/null 2>&1 && echo "$t"; done
echo "@@clock"; date +%s
"""

MIN_FREE_BYTES = 2 << 30
MIN_FREE_INODES = 10000
MAX_SKEW_S = 120


@dataclasses.dataclass
class Finding:
    """One line of the audit: ``level`` is "ok", "warn" or "problem"."""

    level: str
    what: str


@dataclasses.dataclass
class Audit:
    """What the audit found."""

    findings: List[Finding]
    home: str  # the box user's $HOME
    python: str
    python_version: str
    tools: List[str]
    skew_s: float

    @property
    def problems(self) -> List[Finding]:
        return [f for f in self.findings if f.level == "problem"]


def _sections(text: str) -> Dict[str, List[str]]:
    out: Dict[str, List[str]] = {}
    cur = ""
    for line in text.splitlines():
        if line.startswith("@@"):
            cur = line[2:]
            out[cur] = []
        elif cur:
            out[cur].append(line)
    return out


def audit(
    remote: Remote, *, python: Optional[str], box_home: str, durable: Optional[str] = None
) -> Audit:
    """Read the box and judge it; raises nothing for findings (see Audit.problems)."""
    t0 = time.time()
    res = remote.sh(PROBE, python or "python3", box_home, durable or "", timeout=60)
    t1 = time.time()
    s = _sections(res.text)
    found: List[Finding] = []
    home = (s.get("home") or [""])[0]
    py_lines = s.get("python") or []
    py_path = py_lines[0] if py_lines else ""
    version = py_lines[1].strip() if len(py_lines) > 1 else ""
    if not py_path:
        found.append(
            Finding(
                "problem",
                f"no {python or 'python3'} on the box's non-interactive PATH "
                "(conda is often only on the interactive one): pass --python /path/to/python",
            )
        )
    elif not version or tuple(int(x) for x in version.split(".")[:2]) < (3, 9):
        found.append(Finding("problem", f"{py_path} is Python {version or '?'}; rgt needs 3.9+"))
    else:
        found.append(Finding("ok", f"python {version} at {py_path}"))
    gpus = [g for g in s.get("gpu") or [] if g.strip()]
    if gpus:
        found.append(Finding("ok", f"{len(gpus)} GPU(s): {gpus[0].strip()}"))
    else:
        found.append(Finding("warn", "no NVIDIA GPU visible (nvidia-smi found none): CPU only"))
    df = s.get("df") or []
    for i in range(0, len(df) - 2, 3):  # per path: its name, a bytes line, an inodes line
        where, space, inodes = df[i], df[i + 1].split(), df[i + 2].split()
        if len(space) >= 4 and space[-3].isdigit():
            free = int(space[-3]) * 1024
            level = "problem" if free < MIN_FREE_BYTES else "ok"
            found.append(Finding(level, f"{free / (1 << 30):.1f} GiB free at {where}"))
        # Some filesystems (btrfs, many FUSE) report no inode counts at all: nothing to judge.
        if len(inodes) >= 4 and inodes[-3].isdigit() and inodes[-5] not in ("0", "-"):
            level = "problem" if int(inodes[-3]) < MIN_FREE_INODES else "ok"
            found.append(Finding(level, f"{inodes[-3]} inodes free at {where}"))
    cg = (s.get("cgroup") or [""])[0].strip()
    if cg.isdigit() and int(cg) < (1 << 60):
        found.append(Finding("ok", f"cgroup memory limit {int(cg) / (1 << 30):.1f} GiB"))
    tools = [t.strip() for t in s.get("tools") or [] if t.strip()]
    if "tar" not in tools and "rsync" not in tools:
        found.append(Finding("problem", "neither rsync nor tar on the box: cannot push code"))
    skew = 0.0
    clock = (s.get("clock") or [""])[0].strip()
    if clock.isdigit():
        skew = int(clock) - (t0 + t1) / 2
        level = "warn" if abs(skew) > MAX_SKEW_S else "ok"
        found.append(Finding(level, f"clock {skew:+.0f} s from this laptop's"))
    if res.rc != 0 and not py_path:
        raise HostError(f"the audit script failed on the box: {res.err.strip()[-300:]}")
    return Audit(found, home, py_path, version, tools, skew)
