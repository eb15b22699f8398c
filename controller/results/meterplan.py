"""What ``rgt down`` says of the meter-stop: what keeps billing, and what the provider deletes.

Down removes the run's files on the box and, where the platform profile has an API, stops or
destroys the box (controller/meter/stop.py). What the provider's stop or destroy then deletes
is the profile's storage facts (onbox/profiles): a store or a checkpoint dir that down leaves
alone still goes with the storage it lies on, and the plan the user confirms must say so.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from controller.meter.api import noun, title
from controller.registry import RunRecord
from onbox.profiles.schema import Profile


def billing(
    rec: RunRecord, profile: Optional[Profile], instance: Optional[str]
) -> Tuple[List[str], List[str]]:
    """(billing, after): what keeps billing and how down stops the meter; what survives the
    meter-stop verb, what it makes irreversible, and the danger clocks."""
    if rec.profile == "local":
        return ["nothing keeps billing: the target is this machine"], []
    console = [
        f"the box {rec.target.label} keeps billing until you stop it in your provider's "
        "console: rgt stops the agent and the job and removes the run's files on the box, "
        "it does not stop the machine"
    ]
    if profile is None:
        return console, []
    m = profile.meter
    what = noun(m.api)
    if m.api == "none":
        billing = console + [f"  {i}. {x}" for i, x in enumerate(m.console_steps, 1)]
    elif instance:
        billing = [
            f"down will {m.verb} the {what} {instance} through {title(m.api)}'s API "
            f"({'reversible' if m.reversible else 'irreversible'}) once the run is off the box, "
            f"and poll until it is {'off' if m.reversible else 'gone'}"
        ]
    else:
        billing = [
            f"rgt was not told the {what}'s id: down will stop nothing and the {what} keeps "
            f"billing (pass it: rgt down {rec.name} --instance ID)"
        ]
    billing += [f"keeps billing after the {m.verb}: {x}" for x in m.keeps_billing]
    after = []
    for t in profile.storage:
        kept = t.survives_stop if m.reversible else t.survives_destroy
        after.append(
            f"{t.name} ({t.path}): {'survives' if kept else 'LOST'} "
            f"(survives a stop: {yes(t.survives_stop)}, a destroy: {yes(t.survives_destroy)})"
        )
    after += [f"irreversible: {x}" for x in m.irreversible]
    for d in profile.danger:
        after.append(f"danger, {d.name}: {d.what} ({d.remedy})")
    return billing, after


def file_path(store: str) -> Optional[str]:
    """The box directory of a ``file://`` store URL; None for a store off the box."""
    return store[len("file://") :] if store.startswith("file://") else None


def deleted_by_meter_stop(path: Optional[str], profile: Optional[Profile]) -> str:
    """Why the box path ``path`` goes at the meter-stop, or "" when it outlives it: down removes
    neither a store nor a checkpoint dir outside the run dir, but the provider's stop or destroy
    deletes the storage they lie on (a file:// store on a RunPod pod's volume disk). Where the
    profile lists two tiers at one path it is said for the one that does not survive; where
    only the catch-all tier (/) holds it, a mount the profile does not know may outlive it."""
    if path is None or profile is None or profile.name == "local":
        return ""
    m = profile.meter
    tiers = profile.tiers_at(path)
    gone = [t for t in tiers if not (t.survives_stop if m.reversible else t.survives_destroy)]
    if not gone:
        return ""
    on = " or ".join(f"{t.name} ({t.path})" for t in gone)
    kept = [t.name for t in tiers if t not in gone]
    why = f"the provider deletes it at the meter-stop ({m.verb})"
    if kept:
        return f"{why} if it is on the {on}, not the {' or '.join(kept)}"
    if all(t.path.rstrip("/") == "" for t in gone):
        return f"{why} with the {on}, unless {path} is a mount that outlives the box"
    return f"{why} with the {on}"


def yes(b: bool) -> str:
    return "yes" if b else "no"
