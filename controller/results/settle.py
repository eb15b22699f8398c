"""What ``rgt down`` leaves of a run on this laptop, once the run is off its box and the meter
is stopped.

The run's record is kept, marked taken down (``RunRecord.down_at``), when its store outlives the
box: an ``s3://`` or ``hf://`` store, or a ``file://`` one on storage the provider's stop or
destroy does not delete (controller/results/meterplan.py, from the profile's storage tiers).
``rgt pull N`` then fetches the run's newest sealed state from that store (a stop of a live
run may have sealed one newer than the pull down checked) and ``rgt status N`` reads it there;
no command tries the box again. Without a store, or with one that goes with the box, the record
is removed, as nothing is left to reach. ``rgt down N`` of a run taken down already forgets it:
nothing is left on a box to do, and the meter is not called again.
"""

from __future__ import annotations

from typing import Callable, Optional

from controller.registry import Registry, RunRecord
from controller.results import meterplan
from onbox.profiles.schema import Profile


def store_outlives(rec: RunRecord, profile: Optional[Profile]) -> bool:
    """Whether ``rec`` has a store that the meter-stop of its box does not delete."""
    if not rec.store:
        return False
    return not meterplan.deleted_by_meter_stop(meterplan.file_path(rec.store), profile)


def plan_line(rec: RunRecord, profile: Optional[Profile]) -> str:
    """Down's last action, as its plan shows it."""
    name = rec.name
    if store_outlives(rec, profile):
        return (
            f"keep the run's record on this laptop, marked taken down, for its store: "
            f"`rgt pull {name}` fetches from it afterwards, `rgt down {name}` again forgets the "
            "run (its receipt stays)"
        )
    return "forget the run on this laptop (its receipt stays)"


def settle(
    rec: RunRecord, profile: Optional[Profile], registry: Registry, show: Callable[[str], None]
) -> str:
    """Keep ``rec`` marked taken down, or remove it (module docstring); what was done."""
    name = rec.name
    if store_outlives(rec, profile) and registry.mark_down(name) is not None:
        show(
            f"run {name} is down; its record stays on this laptop for its store {rec.store}: "
            f"`rgt pull {name}` fetches from it, `rgt status {name}` reads it, "
            f"`rgt down {name}` again forgets the run"
        )
        return "kept the run's record for its store, marked taken down"
    registry.remove(name)
    show(f"run {name} is down")
    return "forgot the run on this laptop"


def forget(rec: RunRecord, registry: Registry, show: Callable[[str], None]) -> str:
    """``rgt down N`` of a run taken down already: only its record is left; remove it."""
    name = rec.name
    show(
        f"run {name} was {rec.taken_down()}: nothing of it is left on {rec.target.label} and "
        "nothing is done there nor to the meter now; forgetting the run on this laptop"
    )
    registry.remove(name)
    show(
        f"run {name} is forgotten; its store {rec.store} keeps every sealed checkpoint (rgt "
        f"never deletes it), but `rgt pull {name}` no longer finds it by name"
    )
    return "forgot the run on this laptop"
