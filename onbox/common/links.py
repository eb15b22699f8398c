"""A symlink in a checkpoint dir: the one rule of where it may lead.

The sealer never follows a link at the top of the checkpoint dir (onbox/sealing/discovery.py;
a link to a regular file *inside* a checkpoint directory is sealed as that file), so what such a
link names is in the store only when it lies in the checkpoint dir itself, sealed there under
its own name (Lightning's ``save_last="link"`` ``last.ckpt``, a user's ``step_N`` link to a
checkpoint beside it); the link itself is recorded with the checkpoint it leads to, and a
restore makes it again (onbox/sealing/dirlinks.py). Resume (onbox/train/ckptdir.py
``newest_verified``, the adapters' resume helpers), rotation (``ckptdir.prune``), the sealer
and the completion seal all judge a link by ``within``: a link inside the dir stands for its
target, one out of it for nothing rgt keeps. What deletes checkpoints (rotation, the sealer's
room on a low disk: onbox/sealing/room.py) never deletes one that a link it leaves
(``inbound``) leads to: the link would dangle.

Standard library only.
"""

from __future__ import annotations

import os
from typing import List, Optional, Tuple


def within(path: str) -> Optional[str]:
    """Where ``path`` leads: itself when it is no symlink; its real target when it is a symlink
    (or a chain of them) whose target lies inside the directory it is in (that directory's
    real path: a checkpoint dir that is itself a link is fine), existing or not; None for a
    link out of it."""
    if not os.path.islink(path):
        return path
    home = os.path.realpath(os.path.dirname(path))
    real = os.path.realpath(path)
    return real if real.startswith(home.rstrip(os.sep) + os.sep) else None


def inbound(ckpt_dir: str, deep: bool = False) -> List[Tuple[str, str]]:
    """(path, real target) of each symlink in ``ckpt_dir`` that leads to a path in it (its real
    path, existing or not): the links in the dir itself, and with ``deep`` those anywhere under
    it too (a checkpoint's ``tokenizer.json`` linked to the one of an older checkpoint; no link
    to a directory is descended into)."""
    home = os.path.realpath(ckpt_dir).rstrip(os.sep) + os.sep
    out: List[Tuple[str, str]] = []
    for dirpath, dirnames, filenames in os.walk(ckpt_dir):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            if os.path.islink(path):
                real = os.path.realpath(path)
                if real.startswith(home):
                    out.append((path, real))
        if not deep:
            break
    return out
