"""The training API: what a job's own Python imports (standard library and torch only).

``from onbox.train import Checkpointer`` is the plain API (onbox/train/checkpointer.py); the
framework callbacks are ``onbox.train.hf`` (Transformers), ``onbox.train.lightning`` and
``onbox.train.accelerate``. Nothing here imports the agent (``onbox.agent``, ``onbox.sealing``)
or ``controller``: the job and the agent meet only in files (the checkpoint directory, its
``.rgt-complete`` marker, ``progress.json``) and in the job environment's names.
"""

from onbox.train.checkpointer import (
    PREEMPT_EXIT,
    Checkpointer,
    CheckpointError,
    CheckpointWriteFailed,
    SaveToken,
)
from onbox.train.phase import phase

__all__ = [
    "PREEMPT_EXIT",
    "Checkpointer",
    "CheckpointError",
    "CheckpointWriteFailed",
    "SaveToken",
    "phase",
]
