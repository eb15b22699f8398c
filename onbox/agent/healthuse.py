"""The run's health probes (onbox/health/), built from its spec: which paths they watch, what
marks the run's processes, where stacks go. The health wing knows nothing of JobSpec or the
runner; this module hands each probe the plain values it reads.

The order is the order they run each tick: a later probe reads the earlier ones' readings (the
stall probe asks the GPU probe whether the device is idle).
"""

from __future__ import annotations

import os
import time
from typing import Callable, List, Optional, Tuple

from onbox.agent import freeze
from onbox.agent.journal import FileJournal
from onbox.agent.profileuse import load_profile
from onbox.agent.runner import ShimRunner
from onbox.agent.sealservice import SealService
from onbox.agent.spec import JobSpec
from onbox.agent.supervisor import Supervisor
from onbox.agent.watchedpaths import disk_paths
from onbox.common.errors import RgtError
from onbox.common.rundir import RunDir
from onbox.health.clocks import ClocksProbe
from onbox.health.disk import DiskProbe
from onbox.health.gpu import GpuProbe
from onbox.health.memory import MemoryProbe
from onbox.health.pipeline import SealingProbe
from onbox.health.series import Series
from onbox.health.stall import StallProbe
from onbox.health.training import TrainingProbe
from onbox.health.verdict import Context, Probe
from onbox.health.watcher import HealthWatcher


def tag_owner(run: str) -> Callable[[Optional[str], Optional[str]], Optional[str]]:
    """``owner(tag, current)``: "current" for a process of the running attempt, "earlier" for
    one an earlier attempt of this run left (a stale GPU memory holder), None for anyone else.
    A tag is ``NAME:ATTEMPT:NONCE`` (onbox/agent/runner.py)."""

    def owner(tag: Optional[str], current: Optional[str]) -> Optional[str]:
        if not tag or not tag.startswith(run + ":"):
            return None
        return "current" if tag == current else "earlier"

    return owner


def build(spec: JobSpec, rd: RunDir, event: Callable[..., None]) -> List[Probe]:
    """The run's probes; none when ``[health] enabled = false``."""
    cfg = spec.health
    if not cfg.enabled:
        return []
    owner = tag_owner(spec.name)
    # Each probe's construction is one statement, owned with its module.
    probes: List[Probe] = [
        DiskProbe(
            cfg.disk,
            disk_paths(spec, rd.path),
            rd.checkpoint_hold,
            has_store=spec.store is not None,
        ),
        MemoryProbe(cfg.memory, owner),
        GpuProbe(cfg.gpu, owner, event),
        StallProbe(cfg.stall, rd, spec.progress_pattern, owner, event),
        TrainingProbe(cfg.training, rd, local_keep(spec)),
        SealingProbe(cfg.sealing, spec.ckpt_interval, has_store=spec.store is not None),
        ClocksProbe(danger_clocks(spec)),
    ]
    return probes


def local_keep(spec: JobSpec) -> Optional[Callable[[int], Optional[int]]]:
    """A run with no store keeps, at a NaN loss, the newest checkpoint on the box at or before
    the last good loss (freeze.py ``last_good``); one with a store keeps LATEST."""
    if spec.store is not None:
        return None
    return lambda good: freeze.last_good(spec.ckpt_dir, good)


def danger_clocks(spec: JobSpec) -> List[Tuple[str, float, str, str]]:
    """(name, seconds, what, remedy) of the profile's danger clocks with a fixed length."""
    if not spec.profile:
        return []
    try:
        prof = load_profile(spec.profile, os.environ)
    except RgtError:  # the profile went away since `start` checked it: no clocks, no crash
        return []
    return [(d.name, d.after, d.what, d.remedy) for d in prof.danger if d.after]


class AgentHealth:
    """The agent's side of the watcher: the context it reads, and the actions it asked for,
    carried out on the agent's loop (``act``), the one thread that changes the run's state."""

    def __init__(
        self,
        watcher: HealthWatcher,
        sup: Supervisor,
        runner: ShimRunner,
        seal: Optional[SealService],
        rd: RunDir,
    ) -> None:
        self.watcher, self.sup, self.runner, self.seal = watcher, sup, runner, seal
        self.rd = rd

    def context(self) -> Context:
        sup = self.sup
        return Context(
            now=time.monotonic(),
            wall=time.time(),
            state=sup.state.value,
            attempt=sup.attempt,
            attempt_started=sup.attempt_started,
            job_pid=sup.pid,
            tag=self.runner.tag,
            sealing=self.seal.view() if self.seal is not None else None,
            run_started=sup.started_at,
        )

    def act(self) -> None:
        sup, seal = self.sup, self.seal
        for a in self.watcher.take_actions():
            if a.kind == "save":
                sup.extra["health"] = self.watcher.to_doc()
                sup.save()
            elif a.kind == "free_room" and seal is not None:
                seal.want_room()
            elif a.kind in ("restart", "fail"):
                if a.kind == "fail":
                    self._freeze(a.data.get("keep_step"), a.reason, a.remedy)
                default = "stalled" if a.kind == "restart" else "health"
                kind = str(a.data.get("exit_kind", default))
                sup.kill_attempt(a.reason, then=a.kind, kind=kind, klass=a.klass, remedy=a.remedy)

    def _freeze(self, keep_step: Optional[int], reason: str, remedy: str) -> None:
        """Nothing newer than ``keep_step`` is sealed, nor resumed from once the run is started
        again (freeze.py). A run with no store has no sealer to freeze, and the freeze all the
        same: its next incarnation sets aside what the job writes after the NaN."""
        if self.seal is not None:
            self.seal.freeze(keep_step, reason, remedy)
        else:
            freeze.write(self.rd, -1 if keep_step is None else keep_step, reason, remedy)

    def stop(self) -> None:
        # Short: the run's end is recorded already, and a preemption's budget may be nearly
        # spent; the thread is a daemon, and each probe's close() ends what it started.
        self.watcher.stop(timeout=1.0)
        self.sup.extra["health"] = self.watcher.to_doc()


def start(
    spec: JobSpec,
    rd: RunDir,
    journal: FileJournal,
    sup: Supervisor,
    runner: ShimRunner,
    seal: Optional[SealService],
    wake_fd: int,
) -> Optional[AgentHealth]:
    """Start the run's probes in their thread; None when it has none. ``wake_fd`` is the
    agent loop's wakeup pipe: a tick that asks for an action writes a byte there."""
    probes = build(spec, rd, journal.event)
    if not probes:
        return None

    def wake() -> None:
        try:
            os.write(wake_fd, b"h")
        except OSError:  # full: the loop is awake already
            pass

    holder: List[AgentHealth] = []
    watcher = HealthWatcher(
        spec.health,
        probes,
        lambda: holder[0].context(),
        journal.event,
        series=Series(rd.health),
        wake=wake,
    )
    health = AgentHealth(watcher, sup, runner, seal, rd)
    holder.append(health)
    for p in probes:  # the GPU probe holds a restart until the last attempt's memory is free
        gate = getattr(p, "may_start", None)
        if gate is not None:
            sup.start_gate = gate
    watcher.start()
    return health
