"""The final seal of a stop or a preemption: only what fits in what is left of its budget.

When the job is gone and the run is about to end STOPPED or PREEMPTED, the agent
(onbox/agent/sealservice.py ``before_terminal``) seals the complete checkpoints not yet sealed,
but only if the sealer's measured throughput says they reach the store before the budget ends:
a seal cut by SIGKILL or the machine's end would be wasted, and LATEST must stay a checkpoint
that is whole. It is apart because it is the one seal judged against a deadline beforehand; the
meter cap's unhurried, checked final seal is onbox/agent/meter.py's ``final_seal``.
"""

from __future__ import annotations

import os
import time
from typing import Callable, List

from onbox.sealing.sealer import Sealer


def seal_in_budget(
    sealer: Sealer, ckpt_dir: str, reason: str, budget_end: float, event: Callable[..., None]
) -> bool:
    """Seal what is pending if it fits before ``budget_end`` (monotonic); False when it does
    not (nothing is sealed: a ``final_not_sealed`` event says so), else True."""
    pending = sealer.scan()
    if not pending:
        return True
    need = sum(_size(ckpt_dir, c.files) for c in pending)
    estimate = need / max(sealer.bytes_per_s, 1.0) + 0.5
    left = budget_end - time.monotonic()
    if estimate > left:
        event(
            "final_not_sealed",
            f"{reason}: sealing {need} bytes needs ~{estimate:.1f}s"
            f" at {sealer.bytes_per_s / 1e6:.0f} MB/s, {max(left, 0):.1f}s are left; "
            f"LATEST stays at step {sealer.latest}",
            klass="transient",
            remedy="a longer grace (--grace), or smaller checkpoints; the checkpoint stays on "
            "this box's disk",
        )
        return False
    sealer.seal_pending(budget_end)
    return True


def _size(base: str, files: List[str]) -> int:
    """The bytes of ``files`` (paths relative to ``base``, '/'-separated) that are there."""
    n = 0
    for rel in files:
        try:
            n += os.path.getsize(os.path.join(base, *rel.split("/")))
        except OSError:
            pass
    return n
