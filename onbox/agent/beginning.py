"""The beginning of an incarnation, as the agent tells it: the epoch and the restore that come
before its first attempt (``SealService.start``, onbox/agent/sealservice.py).

What failed there is said as it is (``begin_failure``): "nothing to resume from" only when
checkpoints were sealed and none of them is usable; a store that refuses the credentials when
the epoch is taken is a failed epoch, not a missing checkpoint. A SIGTERM or SIGINT while it runs
cuts it short (``Interrupted``, ``tell_interrupted``); which step it resumed from when newer ones
were unusable becomes a warning for status (``fallback_warning``). A new run that `rgt-agent
start` made and that could not begin goes from the box whole (``forget_unbegun``).
"""

from __future__ import annotations

import os
import shutil
import signal
from typing import Any, Callable, Dict, List, Optional

from onbox.common.errors import RgtError
from onbox.common.rundir import RunDir
from onbox.sealing.restore import NoVerifiedCheckpoint


class Interrupted(BaseException):
    """SIGTERM or SIGINT while the agent takes the epoch and restores: raised in the main thread
    to end the restore where it is (a BaseException: no ``except Exception`` on the way keeps
    it; the restore's own ``finally`` blocks stop its workers and let its stage go)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def tell_interrupted(event: Callable[..., None], signum: int) -> None:
    """The ``restore_interrupted`` event: the beginning stopped; the agent ends the run as the
    signal asks, before any attempt. The signal may come mid-restore or just as the restore
    completed (a ``restored`` event before this one): the words hold for both."""
    event(
        "restore_interrupted",
        f"{signal.Signals(signum).name} while the agent took its epoch and restored from the "
        "store, before its first attempt: it went no further and the job did not start; a "
        "checkpoint is in place only once restored whole and verified",
        klass="transient",
        remedy="start the run again (a power-on does: `rgt-agent boot`); it restores afresh",
    )


def begin_failure(e: RgtError, doing: str) -> str:
    """Why the beginning failed, for the ``restore_failed`` event and ``last_exit``: ``doing``
    is the step it was at (``SealService.doing``)."""
    if isinstance(e, NoVerifiedCheckpoint):
        return f"nothing to resume from: {e.what}"
    return f"{doing or 'beginning the run'} failed: {e.what}"


def fallback_warning(warnings: List[Dict[str, Any]], restored: Optional[Dict[str, Any]]) -> bool:
    """Status says which step this incarnation resumed from when newer ones were unusable
    (quarantined): one ``quarantined`` warning in ``warnings``, replacing the one an earlier
    incarnation left, so `rgt-agent status` and `rgt status` print it. True when one was added
    (the caller saves the state)."""
    warnings[:] = [w for w in warnings if w.get("kind") != "quarantined"]
    skipped = (restored or {}).get("skipped")
    if not restored or not skipped:
        return False
    newer = "; ".join(f"step {s['step']}: {s['reason']}" for s in skipped)
    warnings.append(
        {
            "kind": "quarantined",
            "step": restored["step"],
            "skipped": [s["step"] for s in skipped],
            "reason": f"resumed from step {restored['step']}, the newest verified "
            f"checkpoint; newer ones are quarantined ({newer})",
        }
    )
    return True


def forget_unbegun(rd: RunDir, ckpt_dir: str) -> bool:
    """Remove run ``rd`` from the box whole: a new run (no agent had recorded its state) that a
    `start` made and that could not begin, FAILED before any attempt. Its deploy failed, so the
    laptop keeps no record of it: left here, `rgt status` and `rgt down` would not know it, and
    the next deploy of the name would find a FAILED run to start again rather than a new one.
    Kept (False) when its checkpoint dir, inside the run's, holds a file (nothing that may be
    someone's checkpoint is deleted). The directory is renamed aside first, so runs/N is there
    whole or not at all; a removal that fails halfway leaves only that hidden directory."""
    path = os.path.abspath(rd.path)
    inside = os.path.commonpath([os.path.abspath(ckpt_dir), path]) == path
    if inside and any(files for _, _, files in os.walk(ckpt_dir)):
        return False
    aside = os.path.join(os.path.dirname(path), f".{rd.name}.unbegun.{os.getpid()}")
    try:
        os.rename(path, aside)
    except OSError:
        return False
    shutil.rmtree(aside, ignore_errors=True)
    return True
