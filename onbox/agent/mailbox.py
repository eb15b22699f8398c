"""The agent's mailbox, for ``rgt-agent stop`` and ``sync``: a request file in the run directory
(``stop.request``, ``sync.request``) and SIGUSR2 to the agent that holds the run's lock, then a
wait for the answer; with no agent, a sync is done from here, as the run's writer.

A stop of a live run with no agent (killed with its shim) starts one, adopting the run as the
shim starts a dead agent, which reads the same request: the stop always goes on in an agent, so
a person's Ctrl-C (or a SIGTERM) to `rgt-agent stop` ends only the command's wait for it, at once,
and says so (``WaitInterrupted``); it never cuts the job's grace short nor leaves the run
STOPPING with nobody to end it. A run found over with processes of its last attempt alive has
them ended from here (onbox/agent/leftovers.py ``end_found_leftovers``)."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import time
from typing import Any, Dict, Optional

from onbox.agent import freeze, observe, procfs, slurmlogin
from onbox.agent.leftovers import Cut, cut_by_signals
from onbox.agent.lock import RunLock, is_held, read_holder
from onbox.agent.spec import JobSpec
from onbox.agent.states import TERMINAL_NAMES
from onbox.common.durable import read_json, write_json
from onbox.common.errors import (
    HostError,
    LockedError,
    StopFailed,
    WaitInterrupted,
    error_from_code,
)
from onbox.common.rundir import RunDir
from onbox.sealing.stores.base import Store


def signal_agent(rd: RunDir) -> bool:
    """Wake the run's agent (SIGUSR2) to read its mailbox; False when none runs on this host
    (or, for a Slurm job's agent on another node, when Slurm could not signal it)."""
    holder = read_holder(rd.lock)
    if not holder:
        return False
    if holder.get("host") != os.uname().nodename:
        # Another node of a cluster holds it (a Slurm job's agent on a compute node, this
        # command on the login node): slurmctld delivers the signal there.
        return slurmlogin.wake_agent(read_json(rd.state) or {})
    if holder.get("role", "agent") != "agent":  # SIGUSR2 would kill a `sync` or a `start`
        return False
    ident = procfs.Identity(holder["pid"], holder.get("start_ticks") or -1)
    if not procfs.is_alive(ident):
        return False
    os.kill(ident.pid, signal.SIGUSR2)
    return True


def _ask_to_stop(rd: RunDir, grace: Optional[float], deadline: float) -> Optional[int]:
    """Ask the run's agent to stop the job; with no agent, start one that reads the request (the
    read end of its ready pipe is returned), or end the leftovers of a run found over here."""
    while True:
        if is_held(rd.lock):
            write_json(rd.stop_request, {"grace": grace, "requested_at": time.time()})
            if signal_agent(rd):
                return None
        else:
            try:
                lock = RunLock.acquire(rd.lock, rd.name)
            except LockedError:
                continue  # an agent just came up (a shim restarting it): ask that one
            try:
                live = (read_json(rd.state) or {}).get("state") not in (None, *TERMINAL_NAMES)
            except ValueError:
                live = False  # the in-process agent below says what is wrong with it
            if live:
                write_json(rd.stop_request, {"grace": grace, "requested_at": time.time()})
                return _agent_for_stop(rd, lock)
            _end_found_leftovers_here(rd, lock, grace)
            return None
        if time.monotonic() > deadline:
            raise StopFailed(f"the agent of {rd.name!r} does not answer", f"see {rd.agent_log}")
        time.sleep(0.1)


def _agent_for_stop(rd: RunDir, lock: RunLock) -> int:
    """Start an agent for the live run ``rd`` holding ``lock`` (handed over): it adopts the run,
    as the shim starts one (never begins it again), and reads the stop request from its
    mailbox. The read end of its ready pipe."""
    from onbox.agent.daemon import spawn_agent  # (lazily: status and friends stay small)

    r, w = os.pipe()
    try:
        spawn_agent(rd, lock.fd, ready_fd=w, adopt_only=True)
    except BaseException:
        os.close(r)
        raise
    finally:
        os.close(w)
        lock.release()  # the agent holds its own copy of the lock
    return r


def _agent_up(rd: RunDir, ready: int, deadline: float) -> None:
    """Wait for the agent ``_agent_for_stop`` started to say it is up (its stop requested);
    raise what it said when it could not take the run over."""
    from onbox.agent.runner import read_ready

    try:
        msg = read_ready(ready, max(deadline - time.monotonic(), 1.0))
    except HostError:
        raise StopFailed(
            f"the agent started to stop {rd.name!r} did not come up", f"see {rd.agent_log}"
        ) from None
    if msg.get("ok") is False:
        code = int(msg.get("exit_code") or 1)
        raise error_from_code(code, str(msg.get("what")), msg.get("remedy"))


def _end_found_leftovers_here(rd: RunDir, lock: RunLock, grace: Optional[float]) -> None:
    """No agent, and the run over (or never begun): what its last attempt left alive ends as
    that agent would have ended it, from here (imported only here, so that `rgt-agent status`
    and friends start without the supervisor)."""
    from onbox.agent.leftovers import end_found_leftovers
    from onbox.agent.loop import Agent

    agent = Agent(rd, lock)
    if agent.prepare(may_begin=False):  # live after all (a state.json edited meanwhile)
        agent.run(stop=("stop", grace))
        return
    n = agent.sup.attempt
    agent.runner.adopt(n)
    try:  # a Ctrl-C here raises StopFailed with what is left (onbox/agent/leftovers.py)
        left = functools.partial(observe.tagged_alive, rd, n)
        end_found_leftovers(rd.name, n, agent.runner, agent.journal.event, left)
    finally:
        agent.runner.close()
        lock.release()


def over(rd: RunDir) -> Optional[Dict[str, Any]]:
    """The run's state document when it is over and no process of its last attempt is alive
    (a stop has nothing to do); else None."""
    doc = read_json(rd.state) or {}
    if doc.get("state") in TERMINAL_NAMES and not observe.tagged_alive(rd, doc.get("attempt") or 0):
        return doc
    return None


def stop_run(rd: RunDir, grace: Optional[float]) -> Dict[str, Any]:
    """Stop the run (stop signal, ``grace`` or the spec's, SIGKILL of the whole group) and wait
    until it is terminal with no process of its attempt left; its state document then. A
    Ctrl-C or SIGTERM during the wait raises WaitInterrupted: the stop goes on in the agent."""
    spec = JobSpec.from_json(read_json(rd.spec) or {})
    wait = (grace if grace is not None else spec.grace) + 30.0
    deadline = time.monotonic() + wait
    ready = _ask_to_stop(rd, grace, deadline)
    try:
        with cut_by_signals():
            if ready is not None:
                _agent_up(rd, ready, deadline)
            return _wait_stopped(rd, wait, deadline)
    except Cut as cut:
        doc = read_json(rd.state) or {}
        final = "PREEMPTED" if (doc.get("stop") or {}).get("reason") == "preempt" else "STOPPED"
        raise WaitInterrupted(
            f"interrupted ({signal.Signals(cut.signum).name}) while waiting for run {rd.name!r} "
            f"to stop: the stop was asked and goes on in its agent, which gives the job its "
            f"grace; the run will be {final}",
            f"`rgt-agent status {rd.name}` to see it",
        ) from None
    finally:
        if ready is not None:
            os.close(ready)


def _wait_stopped(rd: RunDir, wait: float, deadline: float) -> Dict[str, Any]:
    """Until the run is terminal, with no process of its attempt left and no agent."""
    while True:
        doc = read_json(rd.state) or {}
        left = observe.tagged_alive(rd, doc.get("attempt") or 0)
        if doc.get("state") in TERMINAL_NAMES and not left and not is_held(rd.lock):
            return doc
        if time.monotonic() > deadline:
            raise StopFailed(
                f"run {rd.name!r} is {doc.get('state')} after {wait:.0f}s"
                + (f"; processes still alive: {left}" if left else ""),
                f"see {rd.agent_log}",
            )
        time.sleep(0.1)


def _seal_here(rd: RunDir, spec: JobSpec) -> Store:
    """With no agent: take the run's lock and seal its pending checkpoints as its writer, in
    a new epoch; or, when another box has taken the run over since this box's last writer,
    write nothing to the store and raise Superseded (onbox/agent/ownership.py)."""
    from onbox.agent.journal import FileJournal
    from onbox.agent.ownership import Superseded, take_epoch_here
    from onbox.agent.podlaunch import POD
    from onbox.sealing.sealer import Sealer
    from onbox.sealing.stores import open_box_store

    assert spec.store is not None
    lock = RunLock.acquire(rd.lock, rd.name, role="sync")
    try:
        journal = FileJournal(rd.state, rd.events, rd.agent_log)
        store = open_box_store(spec.store, spec.name)
        try:
            epoch = take_epoch_here(store, rd, going_on=True)
        except Superseded as e:
            e.tell(journal.event)
            raise
        sealer = Sealer.for_run(
            rd, store, spec.ckpt_dir, keep=spec.keep, event=journal.event, epoch=epoch
        )
        # In a pod the job's files may be another container's filesystem, which a sync has no
        # launcher to tell: a link in a checkpoint is then not followed (discovery.py).
        sealer.follow_links = lambda: not os.path.isdir(os.path.join(rd.path, POD))
        sealer.load()
        if freeze.read(rd) is None:  # frozen by a NaN loss: as its agent, nothing newer
            sealer.seal_pending()
    finally:
        lock.release()
    return store


def sync_run(rd: RunDir, spec: JobSpec, wait: float) -> Store:
    """Seal the run's complete checkpoints now: its agent is asked and waited for (``wait``
    seconds at most), or, with none, they are sealed from here. The run's store, once the
    newest complete checkpoint the box held when asked is sealed there; else NotSealed, or
    UnsafeRefused where that is on purpose (onbox/agent/synccheck.py)."""
    from onbox.agent.synccheck import Asked

    asked = Asked(rd, spec.ckpt_dir)
    store = _sync(rd, spec, wait)
    asked.check(store)
    return store


def _sync(rd: RunDir, spec: JobSpec, wait: float) -> Store:
    """``sync_run``'s seal, not checked.

    An agent that dies while it is asked or waited on (the OOM killer, a kill, a preemption of
    the agent alone) lets go of the run's lock: then the seal is made from here, at once,
    rather than the wait running out (or "does not answer" the moment the lock came free)."""
    from onbox.sealing.stores import open_box_store

    assert spec.store is not None
    deadline = time.monotonic() + wait
    asked = woken = False
    while True:
        if not is_held(rd.lock):
            try:
                store = _seal_here(rd, spec)
            except LockedError:
                pass  # an agent came up meanwhile (the shim's respawn): ask that one
            else:
                if asked:  # no agent is to answer it now; a later one need not seal again
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(rd.sync_request)
                return store
        elif not asked:
            write_json(rd.sync_request, {"at": time.time()})
            asked = True
        if asked and not woken:
            woken = signal_agent(rd)  # an agent still starting is woken once it can read it
        elif woken and not os.path.exists(rd.sync_request):
            return open_box_store(spec.store, spec.name)
        if time.monotonic() > deadline:
            if not woken:
                raise StopFailed(f"the agent of {rd.name!r} does not answer", f"see {rd.agent_log}")
            raise StopFailed(
                f"the seal of {rd.name!r} did not finish in {wait:.0f}s", f"see {rd.agent_log}"
            )
        time.sleep(0.1)
