"""What ``rgt down`` leaves of a run on this laptop, once the run is off its box and the meter
is stopped.

The run's record is kept, marked taken down (``RunRecord.down_at``), when its store outlives the
box: an ``s3://`` or ``hf://`` store, or a ``file://`` one on storage the provider's stop or
destroy does not delete (controller/results/meterplan.py, from the profile's storage tiers,
judged where the store is on the box: boxlosses.store_dir).
``rgt pull N`` then fetches the run's newest sealed state from that store (a stop of a live
run may have sealed one newer than the pull down checked) and ``rgt status N`` reads it there;
no command tries the box again. Without a store, or with one that goes with the box, the record
is removed, as nothing is left to reach. ``rgt down N`` of a run taken down already forgets
it, once confirmed as the first down is (the run's name typed, or ``--yes`` from a script):
nothing is left on a box to do, and the meter is not called again; its last line says how the
store's checkpoints are reached without the record (``rgt-agent restore --store URL``).
"""

from __future__ import annotations

import os
from typing import Callable, List, Optional

from controller.registry import Registry, RunRecord
from controller.results import meterplan, storekept
from onbox.common.errors import RgtError
from onbox.profiles.schema import Profile


def store_outlives(rec: RunRecord, profile: Optional[Profile], at: Optional[str] = None) -> bool:
    """Whether ``rec`` has a store that the meter-stop of its box does not delete; ``at``:
    where a ``file://`` one is on the box (boxlosses.store_dir), else judged by its name."""
    if not rec.store:
        return False
    where = at if at is not None else meterplan.file_path(rec.store)
    return not meterplan.deleted_by_meter_stop(where, profile)


def plan_line(rec: RunRecord, profile: Optional[Profile], at: Optional[str] = None) -> str:
    """Down's last action, as its plan shows it."""
    name = rec.name
    if store_outlives(rec, profile, at):
        return (
            f"keep the run's record on this laptop, marked taken down, for its store: "
            f"`rgt pull {name}` fetches from it afterwards, `rgt down {name}` again forgets the "
            "run (its receipt stays)"
        )
    return "forget the run on this laptop (its receipt stays)"


def settle(
    rec: RunRecord,
    profile: Optional[Profile],
    registry: Registry,
    show: Callable[[str], None],
    at: Optional[str] = None,
) -> str:
    """Keep ``rec`` marked taken down, or remove it (module docstring); what was done. ``at``:
    as for store_outlives."""
    name = rec.name
    if store_outlives(rec, profile, at) and registry.mark_down(name) is not None:
        show(
            f"run {name} is down; its record stays on this laptop for its store {rec.store}: "
            f"`rgt pull {name}` fetches from it, `rgt status {name}` reads it, "
            f"`rgt down {name}` again forgets the run"
        )
        return "kept the run's record for its store, marked taken down"
    registry.remove(name)
    show(f"run {name} is down")
    return "forgot the run on this laptop"


def forget_plan(rec: RunRecord) -> List[str]:
    """What ``rgt down N`` of a run taken down already shows before it asks: it only forgets
    the laptop's record, and what the store still holds of the run."""
    name = rec.name
    return [
        f"run {name} was {rec.taken_down()}: nothing of it is left on {rec.target.label}; down "
        "now only forgets it on this laptop (nothing is done on a box nor to the meter, and its "
        "receipt stays)",
        f"kept: {_holds(rec)}",
        f"afterwards `rgt pull {name}` and `rgt status {name}` no longer find it by name",
    ]


def forget(rec: RunRecord, registry: Registry, show: Callable[[str], None]) -> str:
    """``rgt down N`` of a run taken down already (confirmed): only its record is left; remove
    it, and say how the store's checkpoints are reached without it."""
    registry.remove(rec.name)
    show(f"run {rec.name} is forgotten on this laptop; {reach(rec)}")
    return "forgot the run on this laptop"


def _holds(rec: RunRecord) -> str:
    """What the run's store holds, read from this laptop where it is reached from here (an
    s3:// or hf:// store, a file:// one of a run on this machine); else the rotation's rule
    (a file:// store of a box is that box's mount, whatever a path of that name is here)."""
    path = meterplan.file_path(str(rec.store))
    if path is None or (rec.target.kind == "local" and os.path.isdir(path)):
        try:
            return storekept.store_line(str(rec.store), storekept.held(rec, None), None)
        except RgtError:  # not readable from here now: say the rule instead
            pass
    return (
        f"the store {rec.store}: the sealed checkpoints its rotation left (the newest "
        "[checkpoint] keep, 3 unless the job file set it, with the one LATEST names, the one "
        "before it and any pinned; down deletes nothing in it)"
    )


def reach(rec: RunRecord) -> str:
    """How the run's sealed checkpoints in its store are reached once the laptop forgot it."""
    name, store = rec.name, str(rec.store)
    env = f"AWS_ENDPOINT_URL={rec.store_endpoint_url} " if rec.store_endpoint_url else ""
    where = ""
    if meterplan.file_path(store) is not None and rec.target.kind != "local":
        where = " on a machine that mounts it"
    return (
        f"its sealed checkpoints stay in {store}{where}: "
        f"`{env}rgt-agent restore --store {store} --name {name} --to DIR` fetches the newest "
        f"and checks it, `{env}rgt-agent checkpoints --store {store} --name {name}` lists them"
    )
