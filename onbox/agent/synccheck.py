"""What `rgt-agent sync` exits 0 on: the box's newest complete checkpoint is sealed.

A sync's pass may seal nothing and still end: the checkpoint changed or was deleted while it
was sealed, the store failed, another box took the run over, or the run's sealing is frozen on
purpose (a NaN loss: onbox/agent/freeze.py). So after the pass, the newest complete checkpoint
on the box when the sync was asked (and still there: one the job wrote since is not what was
asked, one it removed since is not to be sealed any more) is compared with the store's LATEST;
when LATEST is older, the sync fails and says which step, why (the freeze, or what the agent
said of the seal meanwhile: its events) and what to do.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

from onbox.agent import freeze
from onbox.common import jsondoc
from onbox.common.errors import NotSealed, UnsafeRefused
from onbox.common.rundir import RunDir
from onbox.sealing import manifest as mf
from onbox.sealing.discovery import newest_complete_step, newest_local_step
from onbox.sealing.stores.base import Store

# The events that say why a seal took nothing.
WHY = ("seal_skipped", "seal_cut", "seal_error", "seal_failed", "seal_bug")
TAKEN_OVER = ("stale_epoch", "superseded")  # another box's agent owns the run: exit 7


class Asked:
    """What the box held when the sync was asked: its newest complete checkpoint, and where
    the run's events stood (the agent's word on the seal is what it writes after)."""

    def __init__(self, rd: RunDir, ckpt_dir: str) -> None:
        self.rd, self.ckpt_dir = rd, ckpt_dir
        self.step = newest_complete_step(ckpt_dir)
        try:
            self.events_at = os.path.getsize(rd.events)
        except OSError:
            self.events_at = 0

    def said(self) -> List[Dict[str, Any]]:
        """The events written since the sync was asked (a torn last line skipped)."""
        try:
            with open(self.rd.events, "rb") as f:
                f.seek(self.events_at)
                lines = f.read().splitlines()
        except OSError:
            return []
        return jsondoc.objects(lines)

    def check(self, store: Store) -> None:
        """Raise when the checkpoint asked for is not sealed in ``store``: UnsafeRefused (exit
        7) when that was on purpose (the run's sealing frozen, or another box owns the run),
        else NotSealed (exit 22: a sync again may seal it)."""
        # What is on the box now, complete or being written again: a checkpoint the job has
        # removed since is not asked for any more (rotated away: what is left, if older).
        now = newest_local_step(self.ckpt_dir)
        if self.step is None or now is None:
            return  # nothing was asked for, or the job has removed it: nothing left to seal
        step = min(self.step, now)
        doc = mf.parse_latest(store.get_bytes(mf.latest_key(self.rd.name)))
        sealed: Optional[int] = doc["step"] if doc else None
        if sealed is not None and sealed >= step:
            return
        name = self.rd.name
        what = (
            f"run {name!r}: its newest complete checkpoint on the box, step {step}, is not "
            f"sealed (LATEST is step {'none' if sealed is None else sealed} in {store.url})"
        )
        frozen = freeze.read(self.rd)
        if frozen is not None and step > frozen["above"]:
            kept = "nothing was sealed" if frozen["above"] < 0 else f"step {frozen['above']}"
            raise UnsafeRefused(
                f"{what}, on purpose: a training signal stopped the run and its sealing was "
                f"frozen at {kept}, so that no checkpoint written after it becomes LATEST"
                + (f" ({frozen['reason']})" if frozen.get("reason") else ""),
                str(frozen.get("remedy") or "")
                or "fix the cause and start the run again: it resumes from LATEST",
            )
        said = [e for e in self.said() if e.get("kind") in WHY + TAKEN_OVER]
        if said and said[-1]["kind"] in TAKEN_OVER:
            raise UnsafeRefused(f"{what}: {said[-1].get('reason')}", said[-1].get("remedy"))
        why = f"the agent said: {said[-1].get('reason')}" if said else "the seal did not take it"
        raise NotSealed(
            f"{what}: {why}",
            f"run `rgt-agent sync {name}` again: a checkpoint that changed while it was sealed "
            f"is sealed once it holds still; see {self.rd.agent_log}",
        )
