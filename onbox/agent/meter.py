"""The meter cap: a run stopped at an absolute deadline (``--deadline``, ``--max-cost``).

When the deadline in spec.json passes, the agent stops the run as ``rgt-agent stop`` does: it
asks the job for a checkpoint through its trigger, stops the job (stop signal, grace, SIGKILL),
then seals what is complete, unhurried, and the run ends STOPPED. It never starts this in the
middle of a seal: while the sealing thread is in a pass, the cap waits for the pass to end. The
state changes only through the supervisor's ``request_stop``; nothing here writes a state.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Optional

from onbox.agent.journal import iso
from onbox.agent.states import TERMINAL, State
from onbox.common.errors import IntegrityError, StoreError, event_class
from onbox.sealing import manifest as mf
from onbox.sealing.discovery import newest_local_step

# How often the agent looks again while a seal in progress holds the cap back.
POLL = 0.2
_CAPPABLE = (State.STARTING, State.RUNNING, State.BACKOFF)


class MeterCap:
    """One run's cap: ``due`` once, when the deadline passed and no seal is in progress."""

    def __init__(
        self,
        deadline: Optional[float],
        *,
        fired: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.deadline = deadline
        self.fired = fired
        self.clock = clock
        self.stopping = False

    @classmethod
    def resume(cls, deadline: Optional[float], state_doc: Optional[Dict[str, Any]]) -> MeterCap:
        """The cap of an agent that finds the run as ``state_doc`` says: one that fired for
        this very deadline stays fired (a run started again after its cap is not stopped
        again at once; a new --deadline arms it again), and ``stopping`` says whether that
        stop is still under way (an agent taking over a run the cap is stopping)."""
        doc = (state_doc or {}).get("meter_cap") or {}
        fired = deadline is not None and doc.get("deadline") == deadline
        cap = cls(deadline, fired=fired)
        state = (state_doc or {}).get("state")
        cap.stopping = fired and state is not None and State(state) not in TERMINAL
        return cap

    def wait(self, sup: Any, seal: Any) -> Optional[float]:
        """Seconds until ``check`` should look again; None when the cap cannot come now."""
        if self.deadline is None or self.fired or sup.state not in _CAPPABLE:
            return None
        left = self.deadline - self.clock()
        return POLL if left <= 0 and _sealing(seal) else max(0.0, left)

    def due(self, sealing: bool) -> bool:
        """True once: the deadline passed and no seal is in progress."""
        if self.deadline is None or self.fired or sealing or self.clock() < self.deadline:
            return False
        self.fired = True
        return True

    def check(self, sup: Any, seal: Any, event: Callable[..., None]) -> None:
        """Stop the run when the cap is due (``sup`` the Supervisor, ``seal`` the SealService
        or None): a checkpoint asked for, then the stop; the final seal is the sealer's."""
        if sup.state not in _CAPPABLE or not self.due(_sealing(seal)):
            return
        assert self.deadline is not None
        sup.extra["meter_cap"] = {"deadline": self.deadline}
        event(
            "meter_cap",
            f"the meter cap ({iso(self.deadline)}) passed: asking for a checkpoint, stopping "
            "the job, then sealing what is complete",
            deadline=self.deadline,
        )
        if seal is not None:
            seal.capped = True
            seal.ask_job("meter cap")
        sup.request_stop("stop")


def _sealing(seal: Any) -> bool:
    """Whether the sealing thread (a SealService, or None without a store) is in a pass."""
    return bool(seal is not None and seal.sealing)


def final_seal(
    sealer: Any, store: Any, name: str, ckpt_dir: str, event: Callable[..., None]
) -> bool:
    """Seal every complete checkpoint, with no budget (the cap is not a preemption); True when
    the store's LATEST then holds the newest complete checkpoint on the box."""
    try:
        sealer.seal_pending()
        latest = mf.parse_latest(store.get_bytes(mf.latest_key(name)))
    except (StoreError, IntegrityError) as e:
        event(
            "seal_error",
            f"the meter cap's final seal failed: {e.what}",
            klass=event_class(e),
            remedy="the checkpoints stay on the box; `rgt-agent sync` or the next start seals them",
        )
        return False
    newest = newest_local_step(ckpt_dir)
    ok = newest is not None and latest is not None and latest["step"] >= newest
    event(
        "meter_cap_sealed",
        f"final seal after the meter cap: LATEST is step {latest['step'] if latest else 'none'}"
        + ("" if ok else f", the newest complete checkpoint on the box is {newest}"),
        verified=ok,
    )
    return ok
