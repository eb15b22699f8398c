"""A symlink in a checkpoint dir: the one rule of where it may lead.

The sealer never follows a link (onbox/sealing/discovery.py), so what a link names is in the
store only when it lies in the checkpoint dir itself, sealed there under its own name
(Lightning's ``save_last="link"`` ``last.ckpt``, a user's ``step_N`` link to a checkpoint
beside it). Resume (onbox/train/ckptdir.py ``newest_verified``, the adapters' resume helpers),
rotation (``ckptdir.prune``), the sealer and the completion seal all judge a link by
``within``: a link inside the dir stands for its target, one out of it for nothing rgt keeps.

Standard library only.
"""

from __future__ import annotations

import os
from typing import Optional


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
