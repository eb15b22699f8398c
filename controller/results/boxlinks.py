"""The symlinks of a run without a store, as ``rgt pull`` takes them from the box: which it
makes in DEST and which it leaves out, and why.

With a store, the seal records each link of the checkpoint dir that leads to the checkpoint it
seals (onbox/sealing/dirlinks.py), and a pull makes them again. Without one, the box's lister
(controller/shell/boxfiles.sh) prints every link in the checkpoint dir and the outputs with its
target as ``readlink`` gives it; the laptop judges each, as the seal would: a link in the
checkpoint dir, at its top or below it (``step-200/tokenizer.json -> ../step-100/tokenizer.json``,
a saver sharing a file between checkpoints), whose target, resolved by name from the link's own
directory (nothing on the box is followed; where the checkpoint dir is itself a link, as the
box's lister says, a relative target is resolved from where the link really is, as the box
resolves its '..', and an absolute one under where the dir leads is under the dir, as the seal
resolves it),
is a pulled checkpoint file or a directory of them is made, with that target relative to the
link's directory and normalised (nothing absolute; '..' only as far as the directory both are
in), as the restore makes it. A link below the top is made in its directory, made for it
where no file pulled is in it (a checkpoint of links only, each to an older one's file), never
in a directory that is a pulled file or a link, and never to a directory that holds it (a
loop). Every
other link (out of the dir, absolute elsewhere, a '..' escape, to nothing pulled, an odd name,
one whose target the box could not read, one in the outputs) is left out, and named in the
receipt's ``left_out`` so that ``rgt pull`` says so. Nothing here touches the laptop's files:
the names and targets are the box's, untrusted.
"""

from __future__ import annotations

import posixpath
from typing import List, Set, Tuple, Union

from onbox.common.safepath import UnsafePath, safe_rel
from onbox.sealing.discovery import skip

# The most left-out links named one by one in a receipt; the rest are counted (a box holding a
# million links makes no receipt of a million lines).
MAX_NAMED = 100

# One link as listed: (kind, its final name under DEST, its path under the listed root, target)
Listed = Tuple[str, str, str, str]


def judged(
    listed: List[Listed], ckpt: str, pulled: Set[str], real: str = ""
) -> Tuple[List[Tuple[str, str]], List[str]]:
    """(the links to make in DEST/checkpoints: name, target relative to it; each link left
    out: "PATH -> 'TARGET': why"), for the links ``listed`` by the box, whose checkpoint dir
    is ``ckpt`` (absolute, normalised), ``pulled`` the final names of the files pulled.
    ``real``: where ``ckpt`` leads when it is itself a link (a data disk), as the box said;
    an absolute target under it leads into the dir, as the seal resolves it."""
    made: List[Tuple[str, str]] = []
    left: List[str] = []
    home = real.rstrip("/") + "/"
    links = {rel for kind, _, rel, _ in listed if kind == "checkpoint"}
    for kind, final, rel, target in sorted(listed):
        named = target  # judged by name: an absolute path under ``real`` is one under ckpt
        if real and target and not target.startswith("/"):
            # The box resolves '..' from where the link's directory really is (the data disk
            # the dir is linked to), not from the dir's name: so is it judged here.
            here = posixpath.dirname(rel)
            named = posixpath.normpath(posixpath.join(real, here, target))
        if real and named.startswith(home):
            named = ckpt.rstrip("/") + "/" + named[len(home) :]
        why = _why_not(kind, rel, named, ckpt, pulled, links)
        if isinstance(why, tuple):
            made.append(why)
        else:
            shown = final if final.isprintable() else repr(final)
            left.append(f"{shown} -> {target!r}: {why}")
    if len(left) > MAX_NAMED:
        left[MAX_NAMED:] = [f"and {len(left) - MAX_NAMED} more links, left out"]
    return made, left


def _why_not(
    kind: str, rel: str, target: str, ckpt: str, pulled: Set[str], links: Set[str]
) -> Union[str, Tuple[str, str]]:
    """(name, target) to make for one link, or why it is left out; ``links``: the names of
    every link listed in the checkpoint dir."""
    if kind == "output":
        return "a link in the outputs is not pulled (nor sealed at the job's end)"
    if kind != "checkpoint":
        return "a link among the job's logs is not pulled"
    try:
        safe_rel(rel, "the link name")
    except UnsafePath as err:
        return err.what
    parts = rel.split("/")
    if any(skip(p) for p in parts):
        return "a hidden or temporary name, never a checkpoint's"
    if not target:  # no link has an empty target: the lister prints one when readlink failed
        return "its target could not be read on the box"
    mine = "checkpoints/" + rel
    if mine in pulled or any(p.startswith(mine + "/") for p in pulled):
        return "it would take the place of a pulled file"
    here = "/".join(parts[:-1])  # the link's own directory, under the checkpoint dir
    ups = ["/".join(parts[:i]) for i in range(1, len(parts))]  # it and the ones above it
    if any(f"checkpoints/{d}" in pulled for d in ups):
        return "its directory is a pulled file"
    if any(d in links for d in ups):  # no real find prints both: never made through a link
        return "its directory is a link"
    home = ckpt.rstrip("/") + "/"
    # By name only: what the target is on the box is never asked, nor followed.
    full = posixpath.normpath(target if target.startswith("/") else home + here + "/" + target)
    if not full.startswith(home):
        return "it leads out of the checkpoint dir"
    to = full[len(home) :]
    try:
        safe_rel(to, "its target")
    except UnsafePath as err:
        return err.what
    under = "checkpoints/" + to
    if under not in pulled and not any(p.startswith(under + "/") for p in pulled):
        return "it leads to nothing pulled"
    if rel == to or rel.startswith(to + "/"):
        return "it leads to a directory that holds it"  # a loop, for whoever walks it
    return (rel, _relative(to, here))


def _relative(to: str, here: str) -> str:
    """``to`` (a path under the checkpoint dir) as a link in ``here`` (one too, '' its top)
    names it: relative, shortest ('..' only as far as their common directory). Pure string
    work: posixpath.relpath would ask for the working directory, which may be gone."""
    a, b = to.split("/"), here.split("/") if here else []
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return "/".join([".."] * (len(b) - n) + a[n:])
