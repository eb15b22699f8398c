"""The sweep record: what this laptop knows of a sweep, so that ``rgt sweep PLAN.toml`` run again
resumes where it was and ``rgt down`` knows which cells ran on a box.

One JSON file per sweep, ``$RGT_CONTROLLER_HOME/sweeps/NAME.json``: the store, the targets and,
per cell, its box (as the TARGET string and the parsed target), its runs (the first is the
cell's name; a fresh re-run of the identical config gets ``NAME-rK``, since a run whose store
holds DONE.json never trains again), the current run, its state (pending, running, succeeded,
failed) and the last reconcile's verdict. Every change is read-modify-write under an flock
(``update``), so a reconcile and a running sweep never lose each other's changes; a sweep
invocation also holds ``NAME.run.lock`` for its life, so two never drive one sweep at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from typing import Any, Dict, Iterator, List, Optional

from controller.remote import controller_home
from controller.sweep.plan import Plan, assign
from controller.target import Target, parse_target
from onbox.common import jsondoc
from onbox.common.durable import make_dirs, write_json
from onbox.common.errors import IntegrityError, LockedError, UsageError

SCHEMA = 1
STATES = ("pending", "running", "succeeded", "failed")


def sweeps_dir(home: Optional[str] = None) -> str:
    return os.path.join(home or controller_home(), "sweeps")


def _path(name: str, home: Optional[str]) -> str:
    return os.path.join(sweeps_dir(home), f"{name}.json")


def _read(path: str) -> Optional[Dict[str, Any]]:
    try:
        with open(path, "rb") as f:
            doc = jsondoc.loads(f.read())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise IntegrityError(
            f"the sweep record {path} cannot be read ({e})",
            "fix it by hand or move it aside (rgt sweep then starts the roster afresh; the "
            "store's DONE.json of each finished cell is still honoured)",
        ) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("cells"), dict):
        raise IntegrityError(f"the sweep record {path} is not a sweep record")
    return doc


@contextlib.contextmanager
def _flock(path: str, blocking: bool = True) -> Iterator[None]:
    make_dirs(os.path.dirname(path))
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            raise LockedError(
                f"another rgt sweep drives {os.path.basename(path).split('.')[0]} now",
                "wait for it to end (or stop it), then run rgt sweep again",
            ) from None
        yield
    finally:
        os.close(fd)


def load(name: str, home: Optional[str] = None) -> Optional[Dict[str, Any]]:
    """The sweep's record, or None when this laptop never ran it."""
    return _read(_path(name, home))


@contextlib.contextmanager
def update(name: str, home: Optional[str] = None) -> Iterator[Dict[str, Any]]:
    """The record to change in place; written back atomically when the block ends."""
    path = _path(name, home)
    with _flock(path + ".lock"):
        doc = _read(path)
        if doc is None:
            raise UsageError("PLAN.toml", f"sweep {name} has no record", "rgt sweep PLAN.toml")
        yield doc
        write_json(path, doc)


@contextlib.contextmanager
def driving(name: str, home: Optional[str] = None) -> Iterator[None]:
    """Held while one ``rgt sweep`` drives the sweep (LockedError for a second)."""
    with _flock(os.path.join(sweeps_dir(home), f"{name}.run.lock"), blocking=False):
        yield


def all_records(home: Optional[str] = None) -> List[Dict[str, Any]]:
    """Every sweep record on this laptop (for ``rgt down``'s gate)."""
    d = sweeps_dir(home)
    names = sorted(n for n in os.listdir(d) if n.endswith(".json")) if os.path.isdir(d) else []
    return [doc for doc in (_read(os.path.join(d, n)) for n in names) if doc is not None]


def _new_cell(plan: Plan, index: int, box: str) -> Dict[str, Any]:
    c = plan.cells[index]
    return {
        "index": c.index,
        "params": c.params,
        "box": box,
        "target": parse_target(box).to_json(),
        "runs": [],
        "run": c.name,
        "state": "pending",
        "verdict": None,
        "error": None,
    }


def begin(plan: Plan, home: Optional[str] = None) -> Dict[str, Any]:
    """The sweep's record, made with its assignment the first time; on a later run checked
    against the plan: the roster must be the same (UsageError otherwise: a changed grid is a new
    sweep), and a cell not yet started whose box left ``targets`` is assigned again."""
    path = _path(plan.name, home)
    with _flock(path + ".lock"):
        doc = _read(path)
        if doc is None:
            # A Slurm sweep's cells all go to its login node (one job array); SSH boxes get
            # one queue each, by cost.
            queues = (
                assign(plan.cells, plan.targets)
                if plan.targets
                else {str(plan.slurm): list(plan.cells)}
            )
            box_of = {c.name: box for box, q in queues.items() for c in q}
            doc = {
                "schema": SCHEMA,
                "sweep": plan.name,
                "plan": plan.path,
                "store": plan.store,
                "store_endpoint_url": plan.store_endpoint,
                "store_stall": plan.store_stall,
                "targets": plan.targets,
                "cells": {c.name: _new_cell(plan, c.index, box_of[c.name]) for c in plan.cells},
            }
        else:
            _check_same(plan, doc)
            _reassign(plan, doc)
            # Not part of the sweep's identity: the job file's bound as it is now.
            doc["store_stall"] = plan.store_stall
        write_json(path, doc)
        return doc


def _at(url: Optional[str], endpoint: Optional[str]) -> str:
    return f"{url} at {endpoint}" if endpoint else str(url)


def _check_same(plan: Plan, doc: Dict[str, Any]) -> None:
    had, now = set(doc["cells"]), {c.name for c in plan.cells}
    # A record from before the endpoint was kept takes the plan's (its cells' boxes had it).
    old = (doc.get("store"), doc.setdefault("store_endpoint_url", plan.store_endpoint))
    new = (plan.store, plan.store_endpoint)
    if had != now or old != new:
        what = (
            f"store {_at(*old)} -> {_at(*new)}"
            if had == now
            else f"{len(now - had)} cell(s) added, {len(had - now)} removed"
        )
        raise UsageError(
            "PLAN.toml",
            f"sweep {plan.name} was started with another roster or store ({what})",
            "give the changed sweep a new name (its cells get new runs); this one's record "
            "is kept as it is",
        )


def _reassign(plan: Plan, doc: Dict[str, Any]) -> None:
    if not plan.targets:  # a Slurm sweep: the array's login node has every cell
        return
    gone = [
        c for c in plan.cells
        if doc["cells"][c.name]["box"] not in plan.targets
        and doc["cells"][c.name]["state"] == "pending"
        and not doc["cells"][c.name]["runs"]
    ]  # fmt: skip
    if gone:
        for box, q in assign(gone, plan.targets).items():
            for c in q:
                doc["cells"][c.name].update(box=box, target=parse_target(box).to_json())
    doc["targets"] = plan.targets


def submitted(plan: Plan, cells: Dict[str, Any], home: Optional[str] = None) -> None:
    """A Slurm sweep's cells, submitted as one job array (controller/slurm/array.py's
    ``cells``: name -> {"job", "array_task"}): each is its own run now, running on the login
    node's cluster, so reconcile and ``down``'s gate know where it ran."""
    with update(plan.name, home) as doc:
        for name, job in cells.items():
            c = doc["cells"][name]
            if name not in c["runs"]:
                c["runs"].append(name)
            c.update(run=name, state="running", slurm=job)


def cell_target(cell: Dict[str, Any]) -> Target:
    """The box a cell was assigned to, as a parsed target."""
    return Target.from_json(cell["target"])


def queue(doc: Dict[str, Any], box: str) -> List[str]:
    """The cells assigned to ``box``, in roster order."""
    cells = doc["cells"]
    return sorted((n for n, c in cells.items() if c["box"] == box), key=lambda n: cells[n]["index"])
