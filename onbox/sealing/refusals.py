"""What the sealer never seals, said once: the checkpoints and entries it refuses or leaves out.

Kept apart from the sealer (onbox/sealing/sealer.py), which makes what it may seal durable: this
is the screening ``Sealer.scan`` puts each checkpoint through first, and the memory of what was
said already, so a refusal is one event, not one each scan.

A checkpoint with a name that restore and ``rgt pull`` refuse (onbox/common/safepath.py: a CR, a
backslash, another control character, an over-long component) is never sealed: it could not come
back. Nor is one with a name that is not UTF-8 (undecodable bytes): a store's keys are UTF-8
text, so it could not be stored by its name. One ``unsafe_name`` event (class usage) names it,
and it is skipped at each scan after that until it changes, while the other checkpoints are
sealed as usual.

Only regular files, and links to one inside a checkpoint, are sealed (onbox/sealing/discovery.py
says which links and why): a link to a directory, a dangling one, a FIFO, a socket or a device
in a checkpoint is left out, and the rest of the checkpoint sealed; one ``left_out`` event
(class usage) names what was left out, again only when the checkpoint changes. A symlink
in the checkpoint dir itself (``latest``, Lightning's ``last.ckpt``) is never sealed either: one
event the first time it is seen: ``left_out`` when it leads out of the dir (those bytes are never
sealed), ``ckpt_link`` (info) when it leads to a path in it, sealed under its own name.
"""

from __future__ import annotations

import os
from typing import Callable, Dict, List, Tuple

from onbox.common import links
from onbox.common.safepath import UnsafePath, safe_rel
from onbox.sealing.discovery import Candidate


def _utf8(rel: str) -> None:
    """UnsafePath when the name ``rel`` is no UTF-8 text (os.listdir gives undecodable bytes
    as lone surrogates, and safe_rel lets them round-trip): a store key must be UTF-8 (S3
    raised UnicodeEncodeError, an error of no store's), so it is refused alike for all."""
    try:
        rel.encode("utf-8")
    except UnicodeEncodeError:
        shown = repr(rel) if len(rel) <= 160 else f"{rel[:120]!r}..."
        raise UnsafePath(f"the name {shown} is refused: it is not UTF-8", rel) from None


class Refusals:
    """The sealer's screen of one run's checkpoints, and what it has said of them already."""

    def __init__(self, event: Callable[..., None]) -> None:
        self.event = event
        self.refused: Dict[str, Tuple[int, int, int]] = {}  # unsafe names, reported once each
        self.left_out: Dict[str, Tuple[int, int, int]] = {}  # non-regular files, reported once
        # symlinks in the checkpoint dir, reported once each: whether it leads inside it
        self.links: Dict[str, bool] = {}

    def safe_names(self, root: str, files: List[str], sig: Tuple[int, int, int]) -> bool:
        """Whether every name of the checkpoint ``root`` is one restore and pull accept
        (safepath.safe_rel). A refused one is reported once (again only when the checkpoint
        changes) and never uploaded: a MANIFEST naming it could never be restored or pulled,
        and retrying could not help."""
        for rel in [root, *files]:
            try:
                why = "restore and `rgt pull` would refuse it, so it could never come back"
                safe_rel(rel, "the name")
                why = "every store's keys are UTF-8 text, so it could not be stored by its name"
                _utf8(rel)
            except UnsafePath as e:
                if self.refused.get(root) != sig:
                    self.refused[root] = sig
                    self.event(
                        "unsafe_name",
                        f"checkpoint {root!r} is not sealed: {e.what}; {why}",
                        klass="usage",
                        remedy="rename it (letters, digits, '.', '_', '-'); the other "
                        "checkpoints are sealed as usual",
                        path=rel,
                    )
                return False
        self.refused.pop(root, None)
        return True

    def report_left_out(self, cand: Candidate) -> None:
        """One ``left_out`` event for the entries of ``cand`` that are not regular files
        (discovery: never followed, never read), again only when the checkpoint changes."""
        if not cand.left_out or self.left_out.get(cand.root) == cand.signature:
            return
        self.left_out[cand.root] = cand.signature
        shown = ", ".join(f"{rel!r} ({what})" for rel, what in cand.left_out[:5])
        more = len(cand.left_out) - 5
        self.event(
            "left_out",
            f"checkpoint {cand.root!r}: {shown}{f' and {more} more' if more > 0 else ''} "
            "not sealed: only regular files and links to one are (a link to a directory is "
            "never followed, a dangling link, a FIFO, socket or device holds no bytes to keep)",
            klass="usage",
            remedy="put what a resume needs in the checkpoint as a regular file, or a link to "
            "one (a copy where the job runs in its own container); the rest of the checkpoint "
            "is sealed",
            paths=[rel for rel, _ in cand.left_out],
        )

    def report_links(self, ckpt_dir: str, names: List[str]) -> None:
        """Say once of each symlink in the checkpoint dir (discovery.listing's, or any the
        completion seal meets) that it is not sealed, again only when where it leads changes
        side: one that leads to a path in the dir (Lightning's ``last.ckpt``) loses nothing,
        its target being sealed under its own name and the link recorded with it
        (onbox/sealing/dirlinks.py; info, ``ckpt_link``); one out of it leads
        to bytes never sealed (``left_out``, usage)."""
        for name in names:
            path = os.path.join(ckpt_dir, name)
            if not os.path.islink(path):
                # Gone since the listing (Lightning re-links last.ckpt by removing it first),
                # or a file now: no link to speak of; said when it is one again.
                continue
            real = links.within(path)
            if self.links.get(name) == (real is not None):
                continue
            self.links[name] = real is not None
            if real is not None:
                target = os.path.relpath(real, os.path.realpath(ckpt_dir))
                self.event(
                    "ckpt_link",
                    f"{name!r} in the checkpoint dir is a symlink to {target!r} in it: "
                    "what it leads to is sealed (under its own name, as any checkpoint or "
                    "file there), and the link is recorded with the checkpoint it leads to; a "
                    "restore of that checkpoint makes the link again",
                    remedy="nothing",
                    path=name,
                    target=target,
                )
                continue
            self.event(
                "left_out",
                f"{name!r} in the checkpoint dir is a symlink out of it (to "
                f"{os.path.realpath(path)!r}): not sealed, nor what it leads to (a link is "
                "never followed)",
                klass="usage",
                remedy="save checkpoints as real files or directories in the checkpoint dir",
                paths=[name],
            )
