"""A run's sealing freeze, kept on the box's disk: a training signal (a NaN loss) stopped the
run, and nothing newer than its last good step is sealed, so that LATEST stays the last good
checkpoint (onbox/agent/sealservice.py ``freeze``).

On disk (RunDir.sealing_frozen), not only in the agent's memory: an agent the shim respawns
while the job is being ended, and `rgt-agent sync` of the run once its agent is gone, must not
seal the checkpoints the job wrote after the NaN either; and the sync says why it sealed
nothing (onbox/agent/synccheck.py). A new incarnation of the run clears it.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Dict, Optional

from onbox.common.durable import read_json, write_json
from onbox.common.rundir import RunDir


def write(rd: RunDir, above: int, reason: str, remedy: str) -> None:
    """Nothing newer than ``above`` (-1: nothing at all) is sealed from now on."""
    write_json(
        rd.sealing_frozen, {"above": above, "reason": reason, "remedy": remedy, "at": time.time()}
    )


def read(rd: RunDir) -> Optional[Dict[str, Any]]:
    """The freeze (``above``, ``reason``, ``remedy``), or None when the run is not frozen. A
    file that does not parse is a freeze all the same, of everything: sealing a checkpoint
    written after a NaN would make it LATEST."""
    try:
        doc = read_json(rd.sealing_frozen)
    except ValueError:
        doc = []  # torn or not ours: below
    if doc is None:
        return None
    if not isinstance(doc, dict):
        doc = {"reason": f"{rd.sealing_frozen} does not parse"}
    try:
        doc["above"] = int(doc.get("above", -1))
    except (TypeError, ValueError):
        doc["above"] = -1
    return doc


def clear(rd: RunDir) -> None:
    """A new incarnation: the run is trained again from LATEST, and its checkpoints sealed."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(rd.sealing_frozen)
