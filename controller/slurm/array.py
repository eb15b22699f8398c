"""A sweep's cells as one Slurm job array: ``submit_array(plan, say)``, which ``rgt sweep``
calls for a plan with ``slurm = "LOGIN_NODE"`` (controller/sweep/run.py).

It is `rgt deploy --profile slurm` once for the whole sweep (one audit, one release, one agent
install on the login node, controller/deploy/flow.py), whose submission is one ``sbatch
--array=0-(N-1)``: task i runs ``rgt-agent run`` for cell i (controller/slurm/batch.py's script,
``cells=``), each cell with its own run name, run directory and store prefix (the run name), so
no two cells share a write path. Each cell is recorded as a run of its own (the Registry), its
``scheduler`` naming the array job and its task index, so that ``rgt status/logs/stop CELL``
work on it as on any Slurm run. The array's job name is the sweep's: a second submission while
any of its tasks is live is refused (one writer per cell).

The walltime and resources come from ``ask`` (a SlurmAsk), else from the plan's ``[sbatch]``
table (controller/sweep/plan.py: ``time``, ``partition``, ``gpus``, ``cpus``, ``mem``,
``extra``, ``seal_time``); there is no default walltime: rgt plans the warning against it.
Each cell's outputs go to its own task (``--output``), as on an SSH box.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional

from controller.registry import Registry, RunRecord
from controller.remote import Remote
from controller.runstore import store_at
from controller.slurm.batch import Cell
from controller.slurm.submit import Say, SlurmAsk, check_ask, sbatch, scheduler_doc
from onbox.common.errors import LockedError, UsageError
from onbox.common.rundir import RunDir
from onbox.common.terminal import say

_say = say  # progress lines; one stderr will not take is dropped (terminal.say)


def plan_ask(plan: Any) -> SlurmAsk:
    """The Slurm ask of a sweep's plan (its ``[sbatch]`` table), checked as deploy's flags are."""
    sb: Dict[str, Any] = dict(getattr(plan, "sbatch", None) or {})
    ask = check_ask(
        kind="slurm",
        time=sb.get("time"),
        partition=sb.get("partition"),
        gpus=sb.get("gpus"),
        cpus=sb.get("cpus"),
        mem=sb.get("mem"),
        sbatch=list(sb.get("extra") or ()),
        seal_time=sb.get("seal_time"),
        run=plan.name,
        store=store_at(plan.store, getattr(plan, "store_endpoint", None), "store"),
        cells=_cells(plan),
    )
    assert ask is not None
    return ask


def _cells(plan: Any) -> List[Cell]:
    """The plan's cells as the batch script's: each with its own argv, env and outputs."""
    return [(c.index, c.name, list(c.command), dict(c.env), list(c.outputs)) for c in plan.cells]


def submit_array(
    plan: Any,
    say: Say = _say,
    *,
    ask: Optional[SlurmAsk] = None,
    registry: Optional[Registry] = None,
) -> Dict[str, Any]:
    """Deploy the sweep ``plan`` (controller/sweep/plan.py's Plan) as one Slurm job array;
    ``{"job": ARRAY_JOB_ID, "cells": {name: {"job", "array_task"}}}``."""
    from controller.deploy.flow import deploy
    from controller.deploy.request import DeployRequest

    if not plan.slurm:
        raise UsageError("slurm", "the plan names no login node", 'slurm = "LOGIN_NODE"')
    cells = list(plan.cells)
    if not cells or [c.index for c in cells] != list(range(len(cells))):
        raise UsageError("cells", "a job array needs the cells 0..N-1 in order", "fix the plan")
    if plan.secret_env:
        raise UsageError(
            "secret_env",
            "is not passed to the cells of a Slurm array yet",
            "give the job its secrets through the cluster's own means, or deploy cells one by one",
        )
    ask = ask or plan_ask(plan)
    req = DeployRequest(
        target=plan.slurm,
        command=[],
        job_file=plan.job_file,
        profile=plan.profile or "slurm",
        store=plan.store,
        name=plan.name,
        python=plan.python,
        offline=plan.offline,
        project=plan.project,
        slurm_time=ask.time,
        partition=ask.partition,
        gpus=ask.gpus,
        cpus=ask.cpus,
        mem=ask.mem,
        sbatch=ask.sbatch,
        seal_time=ask.seal_time,
        cells=_cells(plan),
    )
    rec = deploy(req, registry=registry, say=say)
    job = str(rec.scheduler.get("job"))
    return {
        "job": job,
        "cells": {c.name: {"job": job, "array_task": c.index} for c in cells},
    }


def submit_cells(
    remote: Remote,
    registry: Registry,
    rec: RunRecord,
    ask: SlurmAsk,
    rd: RunDir,
    script: str,
    say: Say,
    unsubmitted: Callable[[], None] = lambda: None,
) -> RunRecord:
    """Submit the array's ``script`` (``ask.cells``) from the sweep's directory ``rd``, and
    record each cell as a run; the sweep's own record (not registered) naming the array job
    (``unsubmitted``: as submit.submit_run's).
    A sweep stages no secrets (``submit_array`` refuses secret_env), so any staged under a
    cell's name are a cut-off deploy's of that name, which the cell's agent would claim at its
    start: the submit's own command removes them first, as a single run's does."""
    from controller.deploy.release import switch_current

    stale = [RunDir(name, rec.box_home).staged_secrets_file for _, name, *_ in ask.cells]
    try:
        job = sbatch(remote, rd, script, [], rec.name, stale, unsubmitted)
    except LockedError:  # a live job of the sweep's name: nothing submitted
        unsubmitted()
        raise
    for index, name, *_ in ask.cells:
        doc = scheduler_doc(ask, job, array_job=job, array_task=index, sweep=rec.name)
        registry.put(dataclasses.replace(rec, name=name, scheduler=doc))
        if rec.release:
            switch_current(remote, rec.box_home, name, rec.release)
    say(
        f"rgt: submitted {len(ask.cells)} cells of {rec.name} as Slurm job array {job} "
        f"(task i runs cell i; `rgt status CELL` for each; output {rd.path})"
    )
    names = [c[1] for c in ask.cells]
    return dataclasses.replace(
        rec, scheduler={"kind": "slurm", "job": job, "array": len(names), "cells": names}
    )
