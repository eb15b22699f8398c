"""What ``rgt down`` checks and shows before it does anything: its plan, read-only.

``plan_down`` refuses (UnsafeRefused) unless the laptop's verification receipt covers the
run's newest sealed state, read again now from the store or the box; else it lists what will be
lost, what is kept (a store that outlives the box: storekept.py), what keeps billing and what
the meter-stop leaves (meterplan.py), and what down will do. ``DownPlan.lines`` is what the
user is shown before typing the run's name; controller/results/down.py carries it out.
"""

from __future__ import annotations

import dataclasses
import posixpath
import re
from typing import Any, Dict, List, Optional, Tuple

from controller import boxrun
from controller.deploy.release import release_path
from controller.meter.api import check_instance, client, noun
from controller.profiles import user_dirs as profile_dirs
from controller.registry import RunRecord
from controller.remote import Remote
from controller.results import boxlosses, meterplan, settle, storekept
from controller.results.boxlosses import human
from controller.results.receipt import Coverage, Receipt, load_state_receipt, state_receipt_path
from controller.results.sealed import covers_newest
from onbox.agent.states import TERMINAL_NAMES
from onbox.common.errors import UnsafeRefused, UsageError
from onbox.common.rundir import RunDir, check_name
from onbox.common.terminal import printable
from onbox.profiles.load import load as load_profile
from onbox.profiles.schema import Profile


@dataclasses.dataclass
class DownPlan:
    """What ``down`` found and will do; ``lines()`` is what the user is shown."""

    rec: RunRecord
    receipt: Receipt
    coverage: Coverage
    state: Optional[str]  # the run's state on the box; None when its directory is gone
    lost: List[str]
    kept: List[str]
    billing: List[str]
    actions: List[str]
    grace: float = 30.0
    done: List[str] = dataclasses.field(default_factory=list)
    profile: Optional[Profile] = None  # None: the record's profile could not be loaded
    instance: Optional[str] = None  # the provider's id of the box, when rgt was told it
    after: List[str] = dataclasses.field(default_factory=list)  # what the meter-stop leaves
    stopping: List[str] = dataclasses.field(default_factory=list)  # a live run's stop (below)
    # The job's logs a store that outlives the box holds (ENDED.json's, with a receipt of
    # nothing sealed: its agent sealed them as the run ended, after the pull).
    store_logs: int = 0
    # A live run whose stop seals the job's logs into a store that outlives the box.
    stop_seals_logs: bool = False
    store_at: Optional[str] = None  # where a file:// store is on the box (boxlosses.store_dir)

    def lines(self) -> List[str]:
        r = self.receipt
        out = [
            f"run {self.rec.name} on {self.rec.target.label} (profile {self.rec.profile}): "
            + (f"{self.state}" if self.state else "nothing of it is left on the box"),
            f"verified pull: {len(r.files)} file{'' if len(r.files) == 1 else 's'}, "
            f"{human(r.total_bytes())} in {r.dest} "
            f"({r.sealed.describe()}; from the {r.source}); it covers the newest sealed state",
        ]
        if r.sealed.nothing and self.store_logs:  # the logs are in the store, not pulled
            n = self.store_logs
            out[1] = (
                f"verified pull: nothing was sealed when {r.dest} was pulled (from the "
                f"{r.source}); since, the store holds the job's log{'s' if n > 1 else ''} of "
                f"{n} attempt{'s' if n > 1 else ''} (sealed as its agent let go of the run), "
                "still no sealed checkpoint: "
                f"rgt pull {self.rec.name} brings {'them' if n > 1 else 'it'}"
            )
        elif r.sealed.nothing and self.stop_seals_logs:  # the kept lines say the log's line
            out[1] = (
                f"verified pull: nothing was sealed when {r.dest} was pulled (from the "
                f"{r.source}), and no checkpoint is sealed now; the stop seals the job's log "
                "into the store (ENDED.json)"
            )
        elif r.sealed.nothing:  # the receipt holds no file: all of the run on the box is lost
            out[1] = (
                f"verified pull: nothing was sealed when {r.dest} was pulled (from the "
                f"{r.source}), and nothing is sealed now: no file of the run is in a pull or "
                "in the store"
            )
        out.append(
            "will be lost (on the box only: not in the receipt, nor in a store that outlives "
            "the box):"
        )
        out += [f"  {x}" for x in self.lost[:20]] or ["  nothing"]
        if len(self.lost) > 20:
            out.append(f"  ... and {len(self.lost) - 20} more")
        if self.kept:
            out.append("kept:")
            out += [f"  {x}" for x in self.kept]
        out.append("billing:")
        out += [f"  {x}" for x in self.billing]
        if self.after and self.profile is not None:
            out.append(f"after the meter-stop ({self.profile.meter.verb}):")
            out += [f"  {x}" for x in self.after]
        if self.stopping:
            out.append(f"the run is {self.state}: down stops it first, {self.stopping[0]}")
            out += [f"  {x}" for x in self.stopping[1:]]
        out.append("down will:")
        out += [f"  {x}" for x in self.actions]
        # Names and the state come from the box (its files, spec.json, status): an escape
        # sequence or a newline in one must not redraw or forge what the user is asked to
        # confirm. Each line stays one line, control characters shown as '?'.
        return [printable(line) for line in out]


def run_profile(rec: RunRecord, home: Optional[str] = None) -> Optional[Profile]:
    """The run's platform profile (the laptop's user dir over the shipped ones), or None when
    it cannot be loaded: down then says only that the machine keeps billing."""
    try:
        return load_profile(rec.profile, profile_dirs(home))
    except UsageError:
        return None


def held_receipt(name: str, home: Optional[str]) -> Receipt:
    """The run's verification receipt on this laptop; UnsafeRefused when there is none."""
    receipt = load_state_receipt(name, home)
    if receipt is None:
        raise UnsafeRefused(
            f"run {name}: no verification receipt on this laptop "
            f"({state_receipt_path(name, home)}): taking it down could lose its results",
            f"rgt pull {name} first",
        )
    return receipt


def plan_down(
    rec: RunRecord,
    remote: Remote,
    home: Optional[str] = None,
    *,
    profile: Optional[Profile] = None,
    instance: Optional[str] = None,
) -> DownPlan:
    """Everything down checks and shows, read-only; UnsafeRefused when no receipt covers the
    newest sealed state. ``profile``: the run's (loaded when not given); ``instance``: the
    provider's id of the box (the record's when not given)."""
    name = check_name(rec.name)
    receipt = held_receipt(name, home)
    profile = profile or run_profile(rec, home)
    instance = instance or rec.instance
    run_dir = boxrun.run_dir(rec).path
    staged = RunDir(name, rec.box_home.rstrip("/")).staged_secrets_file
    present, staged_there = _present(remote, run_dir, staged)
    if present or rec.store:
        coverage = covers_newest(rec, receipt, remote)
    else:  # no store, and its directory is gone: the box holds nothing of it to lose
        coverage = Coverage(True, "nothing of the run is left on the box")
    if not coverage:
        raise UnsafeRefused(
            f"run {name}: the verification receipt does not cover the newest sealed state: "
            f"{coverage.reason}",
            f"rgt pull {name} again, then rgt down {name}",
        )
    state, keep = None, None
    spec: Dict[str, Any] = {}
    lost: List[str] = []
    kept: List[str] = []
    with_release = ""  # the checkpoint dir that goes with the release, when it is inside it
    grace = 30.0
    at = boxlosses.store_dir(rec, remote)  # a file:// store, judged where it is on the box
    gone, held, logs = _store_holds(rec, remote, profile, at)
    if present:
        run = boxrun.read(rec, remote)  # the spec and the status in one round trip
        spec = run.spec
        grace = float(spec.get("grace") or 30.0)
        keep = spec.get("keep") if isinstance(spec.get("keep"), int) else None
        state = str(run.status.get("state"))
        if logs is not None and state not in TERMINAL_NAMES:  # its stop seals the job's logs
            logs = dataclasses.replace(logs, stop_seals=True)
        lost, kept, with_release = boxlosses.losses(
            rec, receipt, spec, run_dir, remote, profile, held, logs
        )
    if rec.store and gone:
        lost.append(f"the store {rec.store}{_gone_holds(rec, remote, receipt)}: {gone}")
    elif rec.store:
        kept.append(storekept.store_line(rec.store, held, keep))
    if not receipt.sealed.nothing:  # a pull of nothing sealed put no file there
        kept.append(f"the pulled files in {receipt.dest}")
    actions = []
    if state in TERMINAL_NAMES:  # nothing runs: the stop only checks that none is left
        actions.append(f"check that no process of the run is left (rgt-agent stop {name})")
    elif present:
        actions.append(f"stop the agent and the job (rgt-agent stop {name}; now {state})")
    actions += _removals(rec, run_dir, staged if staged_there else "", with_release)
    named = spec_release(rec, spec)
    if named:
        actions.append(
            f"remove {release_path(rec.box_home.rstrip('/'), named)} (the release run {name}'s "
            "spec names, which a deploy whose start failed pushed) unless another run or deploy "
            "uses it or the job wrote in it"
        )
    billing, after = meterplan.billing(rec, profile, instance)
    if profile is not None and profile.meter.api != "none" and instance:
        check_instance(instance)
        client(profile.meter.api)  # no API key: refused now, before anything is done
        actions.append(f"{profile.meter.verb} the {noun(profile.meter.api)} {instance}")
    actions.append(settle.plan_line(rec, profile, at))
    plan = DownPlan(rec, receipt, coverage, state, lost, kept, billing, actions, grace)
    plan.profile, plan.instance, plan.after, plan.store_at = profile, instance, after, at
    plan.store_logs = len(logs.held) if logs is not None else 0
    plan.stop_seals_logs = logs is not None and logs.stop_seals
    if rec.store and state is not None and state not in TERMINAL_NAMES:
        plan.stopping = _stop_seals(rec.name, rec.store, receipt, gone)
    return plan


_ID = re.compile(r"[0-9a-f]{16}\Z")  # a release's id (controller/deploy/release.py)


def spec_release(rec: RunRecord, spec: Dict[str, Any]) -> str:
    """The id of the release the run's ``spec`` on the box names as its workdir where that is
    not the record's (a redeploy whose start failed after it claimed the run pushed it, and its
    spec names it: controller/shell/release_use.sh), which down removes too; "" for none (the
    box's spec is only compared, never used as a path)."""
    workdir = spec.get("workdir")
    if not isinstance(workdir, str):
        return ""
    parent, base = posixpath.split(workdir.rstrip("/"))
    releases = release_path(rec.box_home.rstrip("/"), "").rstrip("/")
    if parent != releases or not _ID.match(base) or base == rec.release:
        return ""
    return base


def _removals(rec: RunRecord, run_dir: str, staged: str, with_release: str) -> List[str]:
    """The plan's lines of what down removes on the box: every path _execute removes is named,
    the staged secrets (``staged``) only where a deploy left them, and a checkpoint dir that
    goes with the release (``with_release``, boxlosses.losses) with it."""
    home, name = rec.box_home.rstrip("/"), rec.name
    left = f", {staged} (secrets a deploy cut off before its start left for it)"
    out = [
        f"remove {run_dir}, {home}/secrets/{name}{left if staged else ''} and {home}/deploys/{name}"
    ]
    if rec.release:
        out.append(
            f"remove {home}/releases/{rec.release} unless another run uses it"
            + (f", and with it {with_release}" if with_release else "")
        )
    return out


def _store_holds(
    rec: RunRecord, remote: Remote, profile: Optional[Profile], at: Optional[str]
) -> Tuple[str, storekept.Held, Optional[boxlosses.Logs]]:
    """(why the meter-stop deletes the run's store, "" when it does not or there is none; what
    a store that outlives the box holds, by sealed step; the job's logs it holds, DONE.json's
    or ENDED.json's, None when there is no such store). ``at``: where a file:// one is."""
    if not rec.store:
        return "", {}, None
    gone = meterplan.deleted_by_meter_stop(at, profile)
    if gone and at != meterplan.file_path(rec.store):
        gone = f"at {at} on the box, {gone}"
    if gone:
        return gone, {}, None
    return "", storekept.held(rec, remote), boxlosses.Logs(storekept.logs(rec, remote))


def _gone_holds(rec: RunRecord, remote: Remote, receipt: Receipt) -> str:
    """What the plan says a store the meter-stop deletes holds, after its name. A receipt of a
    pull that found nothing sealed is the pull's word, not the store's now: the job's logs its
    agent sealed there with ENDED.json since (a run that ended FAILED or STOPPED; covers_newest
    lets down go on them) are read, as a store that outlives the box has them read."""
    if receipt.sealed.nothing:
        if storekept.logs(rec, remote):
            return (
                " (it holds the job's logs, sealed as the run ended, which the receipt does not"
                " have, and no sealed checkpoint)"
            )
        return " (it holds no sealed checkpoint nor job log of the run)"
    if receipt.sealed.step is None and not receipt.sealed.done:
        return " (it holds the job's logs, which the receipt has, and no sealed checkpoint)"
    return ", every sealed checkpoint in it (the receipt holds the newest)"


def _present(remote: Remote, run_dir: str, staged: str) -> Tuple[bool, bool]:
    """Whether the run's directory and the secrets a deploy staged for its start are on the box
    (one round trip; the box's answer is only compared with two fixed words)."""
    said = remote.sh(
        '[ -d "$1" ] && echo run; if [ -e "$2" ] || [ -L "$2" ]; then echo staged; fi',
        run_dir,
        staged,
    ).text.split()
    return "run" in said, "staged" in said


def _stop_seals(name: str, store: str, receipt: Receipt, gone: str) -> List[str]:
    """What the plan says of a live run's stop: the checkpoint it may seal (the job's save as
    it is stopped, onbox/agent/budgetseal.py) goes into the store only, after the pull the
    receipt covers. Where the store outlives the box, down keeps the run's record for it
    (controller/results/settle.py), so `rgt pull` fetches it afterwards; where the store goes
    with the box, down forgets the run and it is lost unless pulled first. (A live run without
    a store never gets here: its box files cannot be pulled while it runs, so no receipt covers
    them.)"""
    into = (
        f"it goes into the store {store} only: not into {receipt.dest} (the pull has "
        f"{receipt.sealed.pulled()})"
    )
    if not gone:
        return [
            "and the stop may seal a newer checkpoint (what the job saves as it is stopped):",
            f"{into}; down keeps the run's record on this laptop for the store, so "
            f"`rgt pull {name}` fetches it afterwards",
        ]
    return [
        "and the stop may seal a newer checkpoint (what the job saves as it is stopped):",
        f"{into}, and the store goes with the box (above); down then forgets the run on this "
        f"laptop, so `rgt pull {name}` cannot fetch it",
        f"to have it here too: rgt stop {name}, then rgt pull {name} --from store, "
        f"then rgt down {name}",
    ]


def off_the_box(rec: RunRecord, home: Optional[str], why: str) -> DownPlan:
    """The plan of a down whose run an earlier one took off the box (its receipt must still be
    here): nothing on the box is looked at."""
    return DownPlan(rec, held_receipt(rec.name, home), Coverage(True, why), None, [], [], [], [])
