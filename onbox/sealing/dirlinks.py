"""The symlinks of the checkpoint dir itself: recorded with the checkpoint they lead to, made
again by a restore.

Lightning's ``ModelCheckpoint(save_last="link")`` keeps ``last.ckpt`` as a symlink to the newest
checkpoint, and ``trainer.fit(ckpt_path="last")`` resumes only through it: on a new box without
it, Lightning warns and trains from step 0. A user's ``latest -> step_N`` is the same. Such a
link holds no bytes (its target is sealed under its own name: onbox/common/links.py), so the
seal records it in the MANIFEST of the checkpoint it leads to (``links``: name, target relative
to the dir; onbox/sealing/manifest.py ``check_link`` says what a store may name), and the
restore makes it again, relative, once that checkpoint's files are verified in place.

A link is recorded only when it leads to the checkpoint being sealed (its root, or a path under
it), so a restore never makes one to a checkpoint it did not put there. It is made only where
the name is free: a name the box already holds (a link the job moved on to a newer checkpoint,
a file) is the box's own and left as it is. A link out of the dir is never recorded (what it
leads to is not sealed). The link is made through a descriptor of the checkpoint dir opened
without following a symlink on the way (onbox/common/safepath.py), and ``symlink`` never
follows or replaces an existing name.

Standard library only.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Tuple

from onbox.common import links
from onbox.common.errors import IntegrityError
from onbox.common.safepath import lstat_beneath, open_dir
from onbox.sealing.discovery import skip
from onbox.sealing.manifest import check_link


def leading_to(ckpt_dir: str, doc: Dict[str, Any]) -> List[Dict[str, str]]:
    """The links in ``ckpt_dir`` itself that lead to the checkpoint of ``doc`` (a MANIFEST
    about to be written: its root and files), as the MANIFEST records them, by name. A link
    whose name or target the MANIFEST could not hold (``check_link``: an odd name) is left
    out; so is a hidden or temporary name (never a checkpoint's either)."""
    home = os.path.realpath(ckpt_dir)
    out: List[Dict[str, str]] = []
    for path, real in sorted(links.inbound(ckpt_dir)):
        name = os.path.basename(path)
        link = {"name": name, "target": os.path.relpath(real, home).replace(os.sep, "/")}
        if skip(name):
            continue
        try:
            out.append(check_link(link, doc))
        except IntegrityError:
            continue  # another checkpoint's link, or one no MANIFEST may hold
    return out


def make(doc: Dict[str, Any], ckpt_dir: str) -> Tuple[List[str], List[str]]:
    """Make the links of ``doc`` (a checked MANIFEST whose files are verified in ``ckpt_dir``)
    that are missing: (the names made, the names left as the box holds them). A link whose
    target is not there (a hand-made document) is not made, and counted as left."""
    made: List[str] = []
    left: List[str] = []
    recorded = doc.get("links") or []
    if not recorded:
        return made, left
    fd = open_dir(ckpt_dir, [])
    try:
        for link in recorded:
            name, target = link["name"], link["target"]
            try:
                os.stat(name, dir_fd=fd, follow_symlinks=False)
                left.append(name)  # the box's own: never replaced
                continue
            except FileNotFoundError:
                pass
            try:
                there = lstat_beneath(ckpt_dir, target) is not None
            except IntegrityError:  # a symlink on the way: not the checkpoint restored
                there = False
            if not there:
                left.append(name)
                continue
            os.symlink(target, name, dir_fd=fd)
            made.append(name)
        if made:
            os.fsync(fd)  # the links outlive a crash, as the files renamed in place do
    finally:
        os.close(fd)
    return made, left


def said(made: List[str], left: List[str]) -> str:
    """The restore's words for what ``make`` did ('' when the checkpoint has no link)."""
    parts = []
    if made:
        parts.append("links made again: " + ", ".join(made))
    if left:
        parts.append("links left as the box holds them: " + ", ".join(left))
    return "; ".join(parts)
