"""Which platform profile a target is on, when the user names none (`rgt deploy`, `rgt doctor`).

First the target's host name against each profile's ``reach.host_patterns`` (fnmatch, no round
trip); else what the box shows: the profiles' ``reach.markers`` files that exist there and the
``reach.env_markers`` names its init process holds (controller/shell/markers.sh, ``rgt_markers``,
run inside the audit's round trip; names only, never values); else ``generic-ssh``. The
``local`` target is always ``local``, and ``local`` fits no other target. The guess says in one
line which profile it chose and why.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import List, Optional, Sequence, Set, Tuple

from controller import shell
from controller.target import Target
from onbox.profiles.load import load, load_all
from onbox.profiles.schema import Profile

MARKERS_SH = shell.script("markers.sh")
FALLBACK = "generic-ssh"


@dataclasses.dataclass(frozen=True)
class Guess:
    """The profile chosen and why (``why`` ends the line ``rgt: profile NAME (WHY)``)."""

    profile: Profile
    why: str

    @property
    def line(self) -> str:
        return f"rgt: profile {self.profile.name} ({self.why})"


def candidates(dirs: Sequence[str]) -> List[Profile]:
    """Every profile a box could be guessed to be (all but ``local``)."""
    return [p for p in load_all(dirs) if p.name != "local"]


def by_host(target: Target, profiles: Sequence[Profile]) -> Optional[Guess]:
    """The first profile one of whose host patterns matches the target's host."""
    host = (target.host or "").lower()
    if not host:
        return None
    for p in profiles:
        for pat in p.reach.host_patterns:
            if fnmatch.fnmatchcase(host, pat.lower()):
                return Guess(p, f"host matches {pat}")
    return None


def marker_args(profiles: Sequence[Profile]) -> Tuple[str, str]:
    """rgt_markers' two arguments: every profile's marker files and init-variable names."""
    files = sorted({m for p in profiles for m in p.reach.markers if "\n" not in m})
    names = sorted({n for p in profiles for n in p.reach.env_markers if n.isidentifier()})
    return "\n".join(files), "\n".join(names)


def parse_markers(lines: Sequence[str]) -> Tuple[Set[str], Set[str]]:
    """rgt_markers' output (untrusted): the marker files found, the variable names found."""
    files: Set[str] = set()
    names: Set[str] = set()
    for line in lines:
        kind, _, what = line.partition(" ")
        if kind == "file" and what:
            files.add(what)
        elif kind == "env" and what:
            names.add(what)
    return files, names


def by_markers(profiles: Sequence[Profile], files: Set[str], names: Set[str]) -> Optional[Guess]:
    """The profile with the most of its markers on the box (ties: the first by name)."""
    best: Optional[Tuple[int, Profile, List[str]]] = None
    for p in profiles:
        seen = [m for m in p.reach.markers if m in files]
        seen += [f"${n}" for n in p.reach.env_markers if n in names]
        if seen and (best is None or len(seen) > best[0]):
            best = (len(seen), p, seen)
    if best is None:
        return None
    return Guess(best[1], f"the box has {', '.join(best[2])}")


def chosen(
    target: Target,
    dirs: Sequence[str],
    markers: Optional[Sequence[str]] = None,
    profiles: Sequence[Profile] = (),
) -> Guess:
    """The profile for ``target`` with no --profile: by host, then by ``markers`` (rgt_markers'
    output, when the box was asked), else generic-ssh. ``profiles``: the candidates, where the
    caller has read them already (else they are read here)."""
    if target.kind == "local":
        return Guess(load("local", dirs), "the local target")
    profiles = profiles or candidates(dirs)
    guess = by_host(target, profiles)
    if guess is None and markers is not None:
        guess = by_markers(profiles, *parse_markers(markers))
    if guess is None:
        why = "no host pattern or marker of another profile matched"
        return Guess(
            load(FALLBACK, dirs), why if markers is not None else "no host pattern matched"
        )
    return guess
