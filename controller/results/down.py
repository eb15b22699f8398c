"""``rgt down``: stop a run and remove its files from the box, only once its results are safe.

Refused (UnsafeRefused, exit 7) while a cell of a sweep that ran on the run's box is not
reconciled (controller/sweep/reconcile.py ``gate``: remedy ``rgt reconcile PLAN.toml``), and
unless the laptop holds a verification receipt of the run
(controller/results/receipt.py, written by ``rgt pull``) that covers its newest sealed state, read
again
now from the store or the box, and whose files are still in the receipt's destination (a
receipt of a pull that found nothing sealed covers a run whose store still has no sealed
checkpoint nor DONE.json: the plan then lists every checkpoint of the run on the box as lost,
and each job log as lost or, once its agent sealed them as the run ended, ENDED.json, kept in
the store, which its first line then says). Before
anything is done it shows what will be lost (files in the run's directory on the box that the
receipt does not cover, nor a store that outlives the box holds: checkpoints not sealed, job
logs not pulled nor sealed (a run with a store seals them as it ends FAILED, STOPPED or
PREEMPTED, the stop down makes too: ENDED.json, and each agent's ``logs/e<epoch>.json``; a log
on the box is judged by the name its box's newest agent gave it there, boxlosses.py), rgt's
own records; and what the job wrote in its release,
the workdir it runs in, when down removes that release: every file changed since the push
marked it complete that is no pulled output, controller/results/boxlosses.py), what that store
holds (the sealed steps its rotation left, controller/results/storekept.py),
what keeps billing, and for a live run that the checkpoint its stop may seal goes into the store
only (with how to have it pulled too: stop, pull, then down), then asks for the run's name to
be typed. ``--yes`` replaces the typing only when stdin is not a terminal (a script), and never
replaces the receipt.

The plan (what down checks and shows, read-only) is controller/results/downplan.py.

What down does on the box, each step idempotent so that running it again after a failure is
safe: ``rgt-agent stop N`` (waits until no process of the run is left; a run already gone is
fine; of a run that has ended it only checks that no process is left; if the stop fails
nothing is removed), then removes ``secrets/N`` (and ``secrets/.N.staged``, which the plan
names where a deploy cut off before its start left it), ``deploys/N``, the
release the run was deployed from when no other deploy or run uses it (and the release the
run's spec names, where a redeploy whose start failed after it claimed the run left it, when
nothing else names it and the job wrote nothing in it: the plan names it), and ``runs/N`` (with the
default checkpoint dir inside it; a checkpoint dir inside the release goes with the release,
and the plan says so). Never the store, never a checkpoint dir outside the run dir and the
release (where its files are: a link in the run dir to one on a data disk goes, what it leads
to stays), never a release another run uses.

Then the meter (controller/meter/stop.py), from the run's platform profile: where it has an API
and rgt was given the box's id (``--instance``), the profile's meter-stop verb is sent once,
journaled, and polled until the provider no longer has the box; where it has none, its console
steps are shown. The plan shows, before anything is done, what survives that verb (each storage
tier), what keeps billing after it, what it makes irreversible, and the profile's danger clocks.
A meter-stop that was refused, not sent, or whose end is unknown fails down and keeps the run's
record; for the last, a second ``rgt down N`` finds the journal, never re-sends the call, and
only polls. Last, the laptop's record of the run (controller/results/settle.py): kept, marked
taken down, when the run's store outlives the box, so that ``rgt pull N`` fetches from the store
afterwards (``rgt down N`` again then forgets the run, confirmed as the first down is, doing
nothing on a box nor to the meter); else removed. Its receipt stays in
``$RGT_CONTROLLER_HOME/receipts/``.
"""

from __future__ import annotations

from typing import Callable, Optional

from controller.deploy.release import deploy_path, release_path
from controller.meter import stop as meter
from controller.registry import Registry, RunRecord
from controller.remote import Remote, open_remote
from controller.results import settle
from controller.results.boxlosses import RELEASE
from controller.results.downplan import DownPlan, off_the_box, plan_down, run_profile
from controller.shell import script
from onbox.agent.states import TERMINAL_NAMES
from onbox.common.errors import HostError, StopFailed, UnsafeRefused
from onbox.common.rundir import RunDir, check_name
from onbox.profiles.schema import Profile

# The plan's names too: callers read it and take it down through this module.
__all__ = ["DownPlan", "down", "plan_down", "run_profile"]

# The shell of down on the box: functions (controller/shell/release_use.sh, down.sh), and the
# call of one.
_REMOVE = script("release_use.sh") + script("down.sh") + 'rgt_remove "$@"\n'


def down(
    rec: RunRecord,
    *,
    yes: bool,
    interactive: bool,
    ask: Callable[[str], str],
    show: Callable[[str], None] = print,
    remote: Optional[Remote] = None,
    home: Optional[str] = None,
    registry: Optional[Registry] = None,
    instance: Optional[str] = None,
) -> DownPlan:
    """Take ``rec`` down (module docstring). ``interactive``: stdin is a terminal; ``ask``
    prompts and returns what was typed; ``show`` prints one line; ``instance``: the provider's
    id of the box (``--instance``; else the record's). Returns the plan, with ``done`` listing
    what was done. Raises UnsafeRefused (exit 7) when refused; MeterRefused (16),
    MeterUnresolved (17) or MeterNotSent (20) when the meter-stop fails, keeping the run's
    record."""
    name = check_name(rec.name)
    if yes and interactive:
        raise UnsafeRefused(
            f"run {name}: --yes works only when stdin is not a terminal",
            f"type the run's name when asked instead (rgt down {name})",
        )
    if rec.down_at is not None:  # an earlier down took it off its box: only the record is left
        plan = off_the_box(rec, home, "taken down already")
        for line in settle.forget_plan(rec):
            show(line)
        _confirm(name, yes, interactive, ask, "to forget it on this laptop")
        plan.done.append(settle.forget(rec, registry or Registry(home), show))
        return plan
    profile = run_profile(rec, home)
    prior = meter.pending(name, home)
    if prior is not None and profile is not None:
        return _resume(rec, profile, instance or prior.instance, show, home, registry)
    # A box that ran cells of a sweep goes down only once each of them is reconciled.
    from controller.sweep.reconcile import gate

    gate(rec, home)
    own = remote is None
    box = remote or open_remote(rec.target)
    try:
        plan = plan_down(rec, box, home, profile=profile, instance=instance)
        for line in plan.lines():
            show(line)
        _confirm(name, yes, interactive, ask, "to take it down")
        _execute(plan, box)
        return _stop_meter(plan, show, home, registry)
    finally:
        if own:
            box.close()


def _confirm(name: str, yes: bool, interactive: bool, ask: Callable[[str], str], what: str) -> None:
    """The run's name typed on a terminal, or ``--yes`` from a script; else UnsafeRefused."""
    if yes:
        return
    if not interactive:
        raise UnsafeRefused(
            f"run {name}: down needs the run's name typed on a terminal",
            "run it in a terminal, or pass --yes from a script",
        )
    typed = ask(f"Type the run's name ({name}) {what}: ")
    if typed.strip() != name:
        raise UnsafeRefused(
            f"run {name}: the typed name {typed.strip()!r} does not match; nothing done"
        )


def _stop_meter(
    plan: DownPlan, show: Callable[[str], None], home: Optional[str], registry: Optional[Registry]
) -> DownPlan:
    """The run is off the box: stop the meter, then keep the run's record for its store or
    forget it (controller/results/settle.py), unless the meter is left running for a later
    ``rgt down N --instance ID`` (then the record stays as it is)."""
    name = plan.rec.name
    if plan.profile is not None and plan.rec.profile != "local":
        step = meter.Step(name, plan.profile, plan.instance, show, home)
        outcome = meter.stop_meter(step)  # refused or unresolved: raised, the record stays
        if outcome.stopped:  # console steps shown, or no id: rgt itself did nothing
            plan.done.append(f"meter: {outcome.kind}: {outcome.what}")
        if outcome.kind == "no-instance":
            show(
                f"run {name} is off the box; its record stays on this laptop so that "
                f"rgt down {name} --instance ID can stop the meter"
            )
            return plan
    plan.done.append(
        settle.settle(plan.rec, plan.profile, registry or Registry(home), show, plan.store_at)
    )
    return plan


def _resume(
    rec: RunRecord,
    profile: Profile,
    instance: str,
    show: Callable[[str], None],
    home: Optional[str],
    registry: Optional[Registry],
) -> DownPlan:
    """An earlier down took the run off the box and sent the meter-stop, whose end it did not
    see: only poll (the receipt must still be here; nothing on the box is touched)."""
    show(f"run {rec.name}: an earlier down took it off the box and sent the meter-stop")
    plan = off_the_box(rec, home, "off the box already")
    plan.profile, plan.instance = profile, instance
    return _stop_meter(plan, show, home, registry)


def _execute(plan: DownPlan, remote: Remote) -> None:
    rec = plan.rec
    name = rec.name
    home = rec.box_home.rstrip("/")
    if not home.startswith("/") or home in ("", "/"):
        raise HostError(f"the record of {name!r} has no usable RGT_HOME on the box ({home!r})")
    release = rec.release or ""
    if release and not RELEASE.match(release):
        raise HostError(f"the record of {name!r} names a release {release!r} rgt never makes")
    if plan.state is not None:
        r = remote.run(  # its last line is the error shown: a tail of what it prints is kept
            rec.agent_argv("stop", name), timeout=plan.grace + 120, limit=64 << 10, over="tail"
        )
        # 8: the agent knows no such run (a down that removed it already): nothing to stop.
        if r.rc not in (0, 8):
            err = (r.err.strip().splitlines() or [f"exit {r.rc}"])[-1]
            cls = StopFailed if r.rc == StopFailed.exit_code else HostError
            raise cls(
                f"rgt-agent stop {name} failed on {rec.target.label}: {err}; nothing was removed",
                f"look at the box, then run rgt down {name} again",
            )
        over = plan.state in TERMINAL_NAMES
        plan.done.append(
            "checked that no process of the run is left"
            if over
            else "stopped the agent and the job"
        )
    rd = RunDir(name, home)
    rel_dir = release_path(home, release) if release else ""
    paths = (rd.path, rd.secrets_file, deploy_path(home, name), rel_dir, rd.staged_secrets_file)
    r = remote.sh(_REMOVE, *paths, timeout=600)
    if r.rc != 0:
        raise HostError(
            f"removing the files of {name} on {rec.target.label} failed: "
            f"{r.err.strip()[-300:] or f'exit {r.rc}'}",
            f"run rgt down {name} again",
        )
    plan.done.append("removed the run's files on the box")
