"""The preflight audit of `rgt deploy`: what the box is, read in one round trip, and judged before
anything on it is changed.

Checked: the box answers; its Python (the ``--python`` given, else ``python3`` on the
non-interactive PATH, which often lacks conda) is 3.9 or newer; GPUs and driver (nvidia-smi);
free bytes and inodes where rgt writes (RGT_HOME) and on a file:// store's mount; the cgroup
memory limit; the clock's skew against the laptop's; rsync and tar. Each finding is ok, a
warning (shown, deploy goes on) or a problem (deploy stops with them all listed).

The same round trip looks, changing nothing, at what the next steps of a deploy would otherwise
each ask the box for: the Python as the agent's install sees it and the install of this
controller's wheel for it (controller/deploy/probe.py ``PROBE_SH``), and whether the release of
the project's code is complete there (controller/deploy/release.py ``SEEN_SH``). Each piece is
a shell function (in controller/shell/) of the module that owns it, prints its own section and is
read by that module, so its errors stay its own; a deploy of unchanged code then needs no other
round trip for them. Asked to (``look``), it also runs the run's status through an agent, with
the agent's version (``rgt_look``, read by controller/deploy/look.py). And it lists which of the
profiles' marker files and init-process variable names the box has (``rgt_markers``, read by
controller/deploy/guess.py when no profile was named or guessed from the host).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Dict, List, Optional, Sequence, Tuple

from controller import shell
from controller.capture import box_int
from controller.deploy import guess as guessmod
from controller.deploy import probe as probemod
from controller.deploy import release as releasemod
from controller.deploy.wheel import AgentWheel
from controller.remote import Remote
from onbox.common.errors import HostError

# The look at a run (controller/shell/look.sh defines rgt_look; controller/deploy/flow.py reads
# its sections), and the audit's own script, which runs after the functions it calls: each piece
# is its owner's (the Python probe's, the release's, the look's).
LOOK_SH = shell.script("look.sh")
LOOK_SECTIONS = ("version", "version-rc", "status", "status-rc", "spec")
SCRIPT = (
    probemod.PROBE_SH
    + releasemod.SEEN_SH
    + LOOK_SH
    + guessmod.MARKERS_SH
    + shell.script("audit.sh")
)

MIN_FREE_BYTES = 2 << 30
MIN_FREE_INODES = 10000
MAX_SKEW_S = 120


@dataclasses.dataclass
class Finding:
    """One line of the audit: ``level`` is "ok", "warn" or "problem"; ``remedy``, what to do
    about a warning or a problem ("" when the line says it)."""

    level: str
    what: str
    remedy: str = ""


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
    probed: Optional[probemod.Probed] = None
    release: Optional[releasemod.BoxRelease] = None
    look: Optional[Dict[str, List[str]]] = None  # rgt_look's sections, when one was asked for
    markers: Optional[List[str]] = None  # rgt_markers' lines, when markers were asked about

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
    wheel: Optional[AgentWheel] = None,
    extras: Sequence[str] = (),
    release_id: Optional[str] = None,
    deploy: Optional[str] = None,
    look: Sequence[str] = (),
    markers: Optional[Sequence[str]] = None,
) -> Audit:
    """Read the box and judge it; raises nothing for findings (see Audit.problems).

    With ``wheel``, the look also finds the install of that wheel (with ``extras``) for the box's
    Python; with ``release_id``, whether that release is complete on the box (and whether the
    deploy ``deploy``'s current link is on it). With ``look`` (rgt_look's arguments), that look
    too, its sections in Audit.look. With ``markers`` (guess.marker_args), which of them the box
    has, in Audit.markers."""
    probe_args = probemod.probe_args(python, wheel, extras)  # UsageError before any command
    t0 = time.time()
    res = remote.sh(
        SCRIPT,
        box_home,
        durable or "",
        *probe_args,
        release_id or "",
        deploy or "",
        *(markers or ("", "")),
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
    cg = box_int((s.get("cgroup") or [""])[0])
    if cg is not None and cg < (1 << 60):
        found.append(Finding("ok", f"cgroup memory limit {cg / (1 << 30):.1f} GiB"))
    tools = [t.strip() for t in s.get("tools") or [] if t.strip()]
    if "tar" not in tools and "rsync" not in tools:
        found.append(Finding("problem", "neither rsync nor tar on the box: cannot push code"))
    skew = 0.0
    clock = box_int((s.get("clock") or [""])[0])
    if clock is not None:
        skew = clock - (t0 + t1) / 2
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
        (s.get("markers") or []) if markers is not None else None,
    )


def _python(
    python: Optional[str], lines: List[str], found: List[Finding]
) -> Optional[probemod.Probed]:
    """The Python probe's finding (probe.parse_probe's error is the problem's text)."""
    try:
        probed = probemod.parse_probe(python, lines)
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


def df_free(space_line: str, inodes_line: str) -> Tuple[Optional[int], Optional[int]]:
    """Free bytes and free inodes from ``df -Pk`` and ``df -Pi`` lines (None where not read:
    some filesystems, btrfs and many FUSE ones, report no inode counts at all)."""
    space, inodes = space_line.split(), inodes_line.split()
    kb = box_int(space[-3]) if len(space) >= 4 else None
    free_inodes = box_int(inodes[-3]) if len(inodes) >= 5 else None
    ok_inodes = free_inodes is not None and inodes[-5] not in ("0", "-")
    return None if kb is None else kb * 1024, free_inodes if ok_inodes else None


def _disks(df: List[str], found: List[Finding]) -> None:
    for i in range(0, len(df) - 2, 3):  # per path: its name, a bytes line, an inodes line
        where = df[i]
        free, inodes = df_free(df[i + 1], df[i + 2])
        if free is not None:
            level = "problem" if free < MIN_FREE_BYTES else "ok"
            found.append(Finding(level, f"{free / (1 << 30):.1f} GiB free at {where}"))
        if inodes is not None:
            level = "problem" if inodes < MIN_FREE_INODES else "ok"
            found.append(Finding(level, f"{inodes} inodes free at {where}"))
