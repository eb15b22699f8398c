"""Letting go of a run: what the agent does once its run is terminal, before it exits.

The loop (onbox/agent/loop.py) decides and supervises; this is its one way out, kept apart
because its order is the point: the watchers stop, no process of the last attempt outlives the
run (onbox/agent/leftovers.py), the sealing closes (or, with no store, the box's logs are
redacted), the profile's on-done action runs (onbox/agent/ondone.py), the notifier sends its
last ping, a Slurm requeue comes last of the work, and only then does the lock go.

``left_unended`` is the other way out: a store error that ends the loop before the run is
terminal (the completion seal of a success that the store cut, onbox/agent/completion.py
``run_said``). The run stays as it is for the next agent to take, and the agent says so and
lets go of it, without a traceback; the sealing's close (the final mirror of the state, each
store call bounded), the notifier's last ping and Slurm's after step are done as on the first
way out.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

from onbox.agent.journal import log
from onbox.agent.leftovers import end_leftovers
from onbox.agent.logredact import redact_box_logs
from onbox.agent.ondone import after_finish
from onbox.common import redact
from onbox.common.errors import StoreError, event_class

if TYPE_CHECKING:
    from onbox.agent.loop import Agent


def let_go(agent: Agent) -> None:
    """Make sure nothing of the last attempt outlives the run, then let go of it."""
    event = agent.journal.event
    if agent.notice is not None:
        agent.notice.stop()
    if agent.health is not None:
        agent.health.stop()
    why = "processes of the last attempt outlived it; stopping them"
    end_leftovers(agent.runner, event, why)
    if agent.seal is not None:
        # A run that ended FAILED or STOPPED gets its job's logs sealed here (a secret in one
        # is a status warning, saved with the state).
        _close_seal(agent)
    else:
        # No store: the box's logs are what `rgt pull` brings home. Done before the lock
        # goes, and the pull waits for the lock, so it never finds a log not yet scanned.
        try:
            if redact_box_logs(agent.rd, event, agent.warnings):
                agent.sup.save()
        except Exception as e:  # must not keep the agent from letting go of the run
            event(
                "redact_bug",
                f"{type(e).__name__}: {e}; the job's logs were not scanned for secrets",
                klass="permanent",
                remedy="report this; `rgt pull` may bring a log that holds a secret",
            )
    _last_words(agent)
    log(agent.rd.agent_log, f"agent pid {os.getpid()} exits: run is {agent.sup.state}")
    agent.runner.close()
    agent.lock.release()


def _close_seal(agent: Agent) -> None:
    """The sealing closes: its thread stops, the last seals and the final mirror of the run's
    state, each store call bounded (SealService.close: a hung store never holds the agent)."""
    assert agent.seal is not None
    if agent.seal.close(agent.sup.state.value):
        agent.sup.save()
        agent.seal.mirror_quietly()  # the store's copy of the state has the warning too


def _last_words(agent: Agent, why: str = "") -> None:
    """What follows the sealing on every way out: the profile's on-done action (only after a
    verified DONE, onbox/agent/ondone.py), the notifier's last ping (``why``: what it says
    besides the state) and a bounded drain, then Slurm's requeue, or why not (last: a requeue
    ends this allocation's processes)."""
    after_finish(agent.spec, agent.rd, agent.sup.state, agent.seal, agent.journal.event)
    if agent.notifier is not None:
        agent.notifier.finish(agent.sup.state.value, why=why)
    if agent.slurm is not None:
        sealed = agent.seal.sealed_step() if agent.seal is not None else None
        stuck = agent.sup.policy.max_stuck_restarts
        asked = functools.partial(os.path.exists, agent.rd.stop_request)  # a stop came late
        agent.slurm.after(
            agent.sup.state.value, agent.sup.extra, agent.sup.save, sealed, stuck, asked
        )


def left_unended(agent: Agent, e: StoreError) -> StoreError:
    """The store error ``e`` ended the loop before the run was terminal: say why the run is
    left as it is (an ``agent_left`` event, agent.log, ``last_exit`` for the status commands),
    end what is left of the attempt, let go of the lock; the error to exit with (exit 14).

    A success whose completion seal was cut stays RUNNING (or STARTING), not SUCCEEDED: no
    DONE.json claims its results, and the next agent (``rgt-agent start --name N``) completes
    it, as after a crash before DONE.json. Its last exit says so, for `rgt-agent status` and
    `rgt status`; that next agent records the exit again."""
    sup, name = agent.sup, agent.rd.name
    last, ended = sup.last_exit, sup.exit_seen
    remedy = f"`rgt-agent start --name {name}` once the store answers: it takes the run on"
    why = e.what
    if sup.exit_seen and last is not None and last.get("kind") == "success":
        why = (
            f"attempt {sup.attempt} succeeded, but its results are not sealed (no DONE.json): {why}"
        )
        remedy += " and seals the rest"
        last["reason"] = f"{last.get('reason')}; its results are not sealed (no DONE.json)"
        last["remedy"] = remedy
        # Saved as not seen: the next agent's adopt takes the exit again (Supervisor.on_exit
        # ignores one seen) and completes the run; else it would stay RUNNING for ever.
        sup.exit_seen = False
    what = f"run {name}: the agent exits, leaving the run {sup.state.value}: {why}"
    event = agent.journal.event
    event("agent_left", what, klass=event_class(e), remedy=remedy)
    sup.save()
    if agent.notice is not None:
        agent.notice.stop()
    if agent.health is not None:
        agent.health.stop()
    if ended:  # a job still running is left to its shim, which starts the next agent
        why_end = "processes of the last attempt outlived it; stopping them"
        end_leftovers(agent.runner, event, why_end)
    # As on the other ways out: the store's copy of the state (what `rgt status` reads while
    # the box does not answer) says what the box does, where the store takes it within its
    # bound; then the notifier's last ping says why the run is left, and what to do.
    if agent.seal is not None:
        _close_seal(agent)
    _last_words(agent, redact.for_run_file(agent.rd.events).redact(f"{why}; {remedy}"))
    out = StoreError(what, remedy)
    log(agent.rd.agent_log, f"agent pid {os.getpid()} exits {out.exit_code}: run is "
        f"{sup.state}: {out.line()}")  # fmt: skip
    agent.runner.close()
    agent.lock.release()
    return out
