"""A run the box holds after a start of it failed, which this laptop has no record of: recorded
from the box's own record of it, so that `rgt status N`, `rgt stop N` and `rgt down N` find it.

A deploy records its run once the start succeeded (controller/deploy/flow.py). A start that
fails leaves a run the box held before (deployed from another laptop, or whose laptop record
was lost) FAILED there, or live under another agent (the start refused, exit 5, with a remedy
naming `rgt status N` and `rgt stop N`), and so does a new run that could not begin when its
checkpoint dir holds a file (onbox/agent/beginning.py ``forget_unbegun`` keeps it). This laptop
then knew nothing of it: `rgt status N` said there is no such run, and `rgt down N` could not
remove it. The start's command says whether runs/N/spec.json is there after the failure (a
word, boxstart.START_SH); when it is and this laptop has no record of N, the box's spec is read
(controller/deploy/boxspec.py ``box_job``: one more round trip, on this failure only; every
field checked) and the run recorded as the box holds it: its workdir, store and profile there,
the release ``deploys/N/current`` names (which `rgt down` removes), with the agent this deploy
found. A record this laptop has is left as it is:
the deploy changed nothing the record names (the release it pushed is not the run's).
"""

from __future__ import annotations

import dataclasses
import posixpath
import re
from typing import Callable, Sequence

from controller.deploy.boxspec import box_job
from controller.deploy.release import release_path
from controller.registry import Registry, RunRecord
from controller.remote import Remote
from controller.runstore import store_fields
from onbox.common.errors import NotFound, RgtError

_ID = re.compile(r"[0-9a-f]{16}\Z")  # a release's id (controller/deploy/release.py)


def record_held(
    remote: Remote,
    registry: Registry,
    rec: RunRecord,
    label: str,
    say: Callable[[str], None],
    current: Sequence[str] = (),
) -> None:
    """Record run ``rec.name``, which the box holds after its start failed, as the box's spec
    says, unless this laptop has a record of that name; ``rec`` is this deploy's (its target,
    RGT_HOME there and agent). ``current``: what the start said deploys/N/current names (one
    word, a release's id): recorded as the run's release, the one it last started in, which
    `rgt down` removes (its spec may name the release this failed start pushed, removed again).
    Said in one line; never raises: the start's error is the one the user sees."""
    try:
        registry.get(rec.name)
        return
    except NotFound:
        pass
    try:
        job = box_job(remote, rec.box_home, rec.name, label)
    except RgtError as e:
        say(
            f"rgt: run {rec.name} is on {label}, but its record there could not be read "
            f"({e.what}): this laptop keeps no record of it"
        )
        return
    parent, base = posixpath.split(job.workdir.rstrip("/"))
    here = parent == release_path(rec.box_home, "").rstrip("/") and _ID.match(base)
    linked = current[0] if len(current) == 1 and _ID.match(current[0]) else None
    held = dataclasses.replace(
        rec,
        profile=job.profile or rec.profile,
        **store_fields(job.store, job.endpoint_url, job.stall),
        release=linked or (base if here else None),
        workdir=job.workdir,
    )
    registry.put(held)
    say(
        f"rgt: run {rec.name} is on {label}, which this laptop had no record of: recorded "
        f"from the box's, so `rgt status {rec.name}` and `rgt down {rec.name}` find it"
    )
