"""The box's record of a run, runs/N/spec.json, as the laptop reads it: ``box_job`` (its
command, workdir, store and profile, for a start by name, controller/deploy/again.py) and
``record_box_store`` (the store the box runs a deployed run with, its endpoint and stall, for
the laptop's record).

The box is untrusted input: the file is read by a bounded, shell-neutral command, parsed by the
laptop's JSON loader, and each field checked (the store as a store URL, its endpoint as a plain
http(s)://host[:port] URL and its stall as a duration, as the agent checks them) before the
laptop keeps any of it."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional

from controller.registry import Registry, RunRecord
from controller.remote import Remote
from controller.runstore import store_fields
from onbox.common import jsondoc
from onbox.common.duration import parse_duration
from onbox.common.errors import HostError, NotFound, RgtError
from onbox.common.rundir import RunDir
from onbox.common.storeurl import parse_store_url, with_endpoint
from onbox.common.terminal import printable

# The run's spec.json, or exit 7 when there is none (the run is not on the box).
_READ_SPEC = '[ -f "$1" ] || exit 7; exec cat -- "$1"'
SPEC_LIMIT = 1 << 20  # an agent's spec.json is a few KiB


@dataclasses.dataclass(frozen=True)
class BoxJob:
    """What the laptop reads of the box's spec.json of a run (the box's record, untrusted)."""

    command: List[str]
    workdir: str
    store: Optional[str]
    profile: Optional[str]
    endpoint_url: Optional[str] = None  # the store's (s3:// only), where the agent reaches it
    stall: Optional[float] = None  # the store's [store] stall, in seconds


def box_job(remote: Remote, box_home: str, name: str, label: str) -> BoxJob:
    """The box's record of run ``name``: NotFound when the box has none, HostError when it
    is not a run's spec as an agent writes it."""
    path = RunDir(name, box_home).spec
    r = remote.sh(_READ_SPEC, path, timeout=60, limit=SPEC_LIMIT, what=f"cat {path}")
    if r.rc == 7:
        raise NotFound(
            f"there is no run {name} on {label} to start again (no {path})",
            f"give its job: `rgt deploy {label} --name {name} -- CMD ...` or a JOB.toml",
        )
    try:
        doc: Any = jsondoc.loads(r.stdout) if r.rc == 0 else None
    except ValueError:
        doc = None
    job = _job(doc) if isinstance(doc, dict) else None
    if job is None:
        why = r.err.strip()[-300:] if r.rc != 0 else "it is not a run's spec"
        raise HostError(
            f"{label}: cannot read run {name}'s record {path}: {printable(why)}",
            f"give the job again: `rgt deploy {label} --name {name} -- CMD ...`",
        )
    return job


def _job(doc: Dict[str, Any]) -> Optional[BoxJob]:
    """The fields the laptop uses, checked; None when one is not what an agent writes."""
    command, workdir = doc.get("command"), doc.get("workdir")
    store, profile = doc.get("store"), doc.get("profile")
    if not (isinstance(command, list) and command and all(isinstance(c, str) for c in command)):
        return None
    if not (isinstance(workdir, str) and workdir.startswith("/")):
        return None
    if not all(v is None or isinstance(v, str) for v in (store, profile)):
        return None
    endpoint, stall = doc.get("store_endpoint_url"), doc.get("restore_stall")
    try:  # the agent wrote them parsed (onbox/agent/spec.py): anything else is not its
        if store:
            with_endpoint(parse_store_url(store), endpoint, "store_endpoint_url")
        stall = None if stall is None else parse_duration(stall, "restore_stall")
    except RgtError:
        return None
    if not store:
        store = endpoint = None
    return BoxJob(command, workdir, store, profile, endpoint, stall)


def record_box_store(
    remote: Remote, registry: Registry, rec: RunRecord, label: str, say: Callable[[str], None]
) -> RunRecord:
    """``rec`` (recorded already) recorded again with the store the box's agent runs it with,
    as its spec.json says: a job file's store is the agent's to read, so the laptop keeps what
    the agent took (`rgt status` reads it when the box does not answer, `rgt pull --from store`
    and `rgt down` need it). When the box's record cannot be read (the link went, it is not an
    agent's), that is said and ``rec`` stays as it is: the run has started all the same."""
    try:
        job = box_job(remote, rec.box_home, rec.name, label)
    except RgtError as e:
        say(
            f"rgt: warning: the store run {rec.name} runs with could not be read from "
            f"{label} ({e.what}): the laptop's record names none, so `rgt status` cannot read "
            "it from the store while the box does not answer"
        )
        return rec
    fields = store_fields(job.store, job.endpoint_url, job.stall)
    if any(getattr(rec, k) != v for k, v in fields.items()):
        rec = dataclasses.replace(rec, **fields)
        registry.put(rec)
    return rec
