"""The preflight audit of `rgt deploy`: what the box is, read in one round trip, and judged before
anything on it is changed.

Checked: the box answers; its Python (the ``--python`` given, else ``python3`` on the
non-interactive PATH, which often lacks conda) is 3.9 or newer; GPUs and driver (nvidia-smi);
free bytes and inodes where rgt writes (RGT_HOME) and on a file:// store's mount; the cgroup
memory limit; the clock's skew against the laptop's; rsync and tar. Each finding is ok, a
warning (shown, deploy goes on) or a problem (deploy stops with them all listed).

The same round trip looks, changing nothing, at what the next steps of a deploy would otherwise
each ask the box for: the Python as the agent's install sees it and the install of this
controller's wheel for it (controller/deploy/install.py ``PROBE_SH``), and whether the release of
the
project's code is complete there (controller/deploy/release.py ``SEEN_SH``). Each piece is a shell
function of the module that owns it, prints its own section and is read by that module, so its
errors stay its own; a deploy of unchanged code then needs no other round trip for them. Asked
to (``look``), it also runs an agent's ``--version`` and the run's status through it
(``rgt_look``, read by controller/deploy/flow.py).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Dict, List, Optional, Sequence

from controller.deploy import install as installmod
from controller.deploy import release as releasemod
from controller.remote import Remote
from onbox.common.errors import HostError

# A shell function: `rgt_look CHECK SPEC NAME AGENT...` runs the agent AGENT... (its argv, its
# environment first, as RunRecord.agent_argv gives it): its --version when CHECK is 1, in the
# background while its `status NAME --json` runs (output kept until --version is done, so each
# section comes out whole and the two starts overlap), then prints the run's SPEC (spec.json).
# Sections: @@version, @@version-rc, @@status, @@status-rc, @@spec (controller/deploy/flow.py reads
# them).
LOOK_SH = r"""
rgt_look() {
  rgt_check=$1; rgt_spec=$2; rgt_name=$3; shift 3
  if [ "$rgt_check" = 1 ]; then
    { echo "@@version"; "$@" --version 2>&1; printf '\n@@version-rc\n%s\n' "$?"; } &
  fi
  rgt_st=$("$@" status "$rgt_name" --json 2>/dev/null); rgt_rc=$?
  wait
  printf '@@status\n%s\n@@status-rc\n%s\n@@spec\n' "$rgt_st" "$rgt_rc"
  cat -- "$rgt_spec" 2>/dev/null
}
"""
LOOK_SECTIONS = ("version", "version-rc", "status", "status-rc", "spec")

# $1 RGT_HOME on the box ("": ~/.rgt), $2 a file:// store's path (or ""), $3.. $7 the Python
# probe's arguments (install.probe_args: the Python, the probe's code, and the version, sha256 and
# extras of the wheel whose install to look for, or ""), $8 a release id (or ""), $9 the deploy's
# name (or ""); then, optionally, rgt_look's arguments: the look at a run through the agent that
# ran it last time, saving a deploy of unchanged code its second round trip.
PROBE = r"""
home=${1:-$HOME/.rgt}; durable=$2; rel=$8; name=$9
py=$3; code=$4; ver=$5; sha=$6; extras=$7; shift 9
# The look starts first and runs beside the rest (its two Python starts are most of the
# script's time), its output held in a temporary file until the end; without mktemp, after.
look_out=
if [ "$#" -gt 0 ] && look_out=$(mktemp 2>/dev/null); then
  rgt_look "$@" >"$look_out" 2>/dev/null &
  look_pid=$!
fi
echo "@@home"; printf '%s\n' "$HOME"
echo "@@python"
rgt_python_probe "$home" "$py" "$code" "$ver" "$sha" "$extras"
echo "@@gpu"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
  2>/dev/null
echo "@@df"; for d in "$home" "$durable"; do
  [ -n "$d" ] || continue; p=$d; while [ ! -e "$p" ]; do p=$(dirname "$p"); done
  printf '%s\n' "$d"; df -Pk "$p" | tail -n 1; df -Pi "$p" | tail -n 1; done
echo "@@cgroup"; cat /sys/fs/cgroup/memory.max 2>/dev/null ||
  cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null
echo "@@tools"; for t in rsync tar; do command -v "$t" >/dev/null 2>&1 && echo "$t"; done
echo "@@release"; if [ -n "$rel" ]; then rgt_release_seen "$home" "$rel" "$name"; fi
echo "@@clock"; date +%s
if [ -n "$look_out" ]; then
  wait "$look_pid"; cat -- "$look_out"; rm -f -- "$look_out"
elif [ "$#" -gt 0 ]; then
  rgt_look "$@"
fi
"""
SCRIPT = installmod.PROBE_SH + releasemod.SEEN_SH + LOOK_SH + PROBE

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
    """What the audit found. ``probed``: the box's Python and the agent's install found for it
    (None when the Python is a problem); ``release``: what the box has of the release asked
    about (None when none was asked about, or the answer was not understood)."""

    findings: List[Finding]
    home: str  # the box user's $HOME
    python: str
    python_version: str
    tools: List[str]
    skew_s: float
    probed: Optional[installmod.Probed] = None
    release: Optional[releasemod.BoxRelease] = None
    look: Optional[Dict[str, List[str]]] = None  # rgt_look's sections, when one was asked for

    @property
    def problems(self) -> List[Finding]:
        return [f for f in self.findings if f.level == "problem"]


def sections(text: str) -> Dict[str, List[str]]:
    """The lines of a script's output under each ``@@name`` line, by name."""
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
    remote: Remote,
    *,
    python: Optional[str],
    box_home: str,
    durable: Optional[str] = None,
    wheel: Optional[installmod.AgentWheel] = None,
    extras: Sequence[str] = (),
    release_id: Optional[str] = None,
    deploy: Optional[str] = None,
    look: Sequence[str] = (),
) -> Audit:
    """Read the box and judge it; raises nothing for findings (see Audit.problems).

    With ``wheel``, the look also finds the install of that wheel (with ``extras``) for the box's
    Python; with ``release_id``, whether that release is complete on the box (and whether the
    deploy ``deploy``'s current link is on it). With ``look`` (rgt_look's arguments), that look
    too, its sections in Audit.look."""
    probe_args = installmod.probe_args(python, wheel, extras)  # UsageError before any command
    t0 = time.time()
    res = remote.sh(
        SCRIPT,
        box_home,
        durable or "",
        *probe_args,
        release_id or "",
        deploy or "",
        *look,
        timeout=180 if look else 60,
    )
    t1 = time.time()
    s = sections(res.text)
    if res.rc != 0 and "python" not in s:
        raise HostError(f"the audit script failed on the box: {res.err.strip()[-300:]}")
    found: List[Finding] = []
    home = (s.get("home") or [""])[0]
    probed = _python(python, s.get("python") or [], found)
    _gpus(s.get("gpu") or [], found)
    _disks(s.get("df") or [], found)
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
    seen = releasemod.parse_seen(release_id, s.get("release") or []) if release_id else None
    py = probed.python if probed is not None else None
    return Audit(
        found,
        home,
        py.path if py else "",
        py.version_text if py else "",
        tools,
        skew,
        probed,
        seen,
        {k: s[k] for k in LOOK_SECTIONS if k in s} if look else None,
    )


def _python(
    python: Optional[str], lines: List[str], found: List[Finding]
) -> Optional[installmod.Probed]:
    """The Python probe's finding (install.parse_probe's error is the problem's text)."""
    try:
        probed = installmod.parse_probe(python, lines)
    except HostError as e:
        found.append(Finding("problem", f"{e.what}: {e.remedy}" if e.remedy else e.what))
        return None
    py = probed.python
    found.append(Finding("ok", f"python {py.version_text} at {py.path}"))
    return probed


def _gpus(lines: List[str], found: List[Finding]) -> None:
    gpus = [g for g in lines if g.strip()]
    if gpus:
        found.append(Finding("ok", f"{len(gpus)} GPU(s): {gpus[0].strip()}"))
    else:
        found.append(Finding("warn", "no NVIDIA GPU visible (nvidia-smi found none): CPU only"))


def _disks(df: List[str], found: List[Finding]) -> None:
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
