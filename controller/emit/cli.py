"""The ``rgt emit`` command group: ``rgt emit k8s`` and ``rgt emit skypilot``.

Both read the job file as the agent will (controller/emit/common.py load_job), find the seal
time the grace is derived from (controller/sealbudget.py), and write one file (atomically) or
stdout. Bad input is a UsageError naming its field (exit 2), raised before anything is written.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, List, Optional, Tuple, Union

import click

from onbox.common.errors import UsageError

if TYPE_CHECKING:
    from onbox.common.storeurl import StoreURL

# This module is imported by every `rgt` command (controller/cli.py registers the group): what
# the emitters need (the job file's reader, the spec) is imported inside the commands.


@click.group("emit")
def emit() -> None:
    """Write what another engine runs (a Kubernetes Job, a SkyPilot task) with rgt inside."""


def _seal(flag: Optional[str], store: Union[str, StoreURL, None], runs: List[str]) -> Any:
    """The seal time (controller/sealbudget.py) over ``runs``: the job's run, or a sweep's
    cells, whose pods share one grace: the longest seal measured of them."""
    from controller.sealbudget import seal_time_over

    return seal_time_over(flag, store, runs)


def _sweep_cells(plan_path: str) -> Tuple[List[Any], str, Optional[str]]:
    from controller.emit.k8s import Cell
    from controller.sweep.plan import load_plan

    plan = load_plan(plan_path)  # a bad plan is its own UsageError, naming the field
    cells = [Cell(c.name, list(c.command), dict(c.env), list(c.outputs)) for c in plan.cells]
    if not cells:
        raise UsageError("--sweep", f"{plan_path} has no cells")
    return cells, plan.name, plan.store


@emit.command("k8s")
@click.argument("job_file", metavar="JOB.toml")
@click.option("--image", required=True, metavar="IMG", help="The image (rgt and the code in it).")
@click.option(
    "--store", metavar="URL", help="A bucket store (s3://, hf://) in place of the file's."
)
@click.option("--pvc", metavar="NAME", help="A PersistentVolumeClaim mounted at the durable path.")
@click.option("--gpus", type=click.IntRange(min=0), default=0, help="nvidia.com/gpu per pod.")
@click.option("--secret", metavar="NAME", help="The Secret the agent's environment comes from.")
@click.option("--sweep", "plan", metavar="PLAN.toml", help="An Indexed Job, one index per cell.")
@click.option("--seal-time", metavar="S", help="The measured seal time (45, 90s, 2m).")
@click.option(
    "--seal-from",
    metavar="URL",
    help="A store holding this run's events (when the pod's is a PVC).",
)
@click.option("--image-dir", default="/app", show_default=True, help="The project in the image.")
@click.option("--job-image", metavar="IMG", help="The job container's image (default: --image).")
@click.option("--out", metavar="FILE", help="Write here (replaced atomically); default stdout.")
def emit_k8s(
    job_file: str,
    image: str,
    store: Optional[str],
    pvc: Optional[str],
    gpus: int,
    secret: Optional[str],
    plan: Optional[str],
    seal_time: Optional[str],
    seal_from: Optional[str],
    image_dir: str,
    job_image: Optional[str],
    out: Optional[str],
) -> int:
    """A Kubernetes Job manifest: rgt-agent run --pod as a native sidecar, the job in its own
    container, the pod's grace from the measured seal time, disruptions ignored, rgt's
    permanent exit codes fail the Job.

    An OOM kill of the job's container takes the job, never the agent, which seals what is
    complete; the next pod restores the last sealed checkpoint (Kubernetes >= 1.29)."""
    from controller import profiles as prof
    from controller.emit import k8s
    from controller.emit.common import write_out

    _check_k8s_names(pvc, secret, image_dir)
    profile = prof.load(k8s.PROFILE)
    cells, sweep_name, plan_store = _sweep_cells(plan) if plan else (None, None, None)
    if plan_store and store is None and pvc is None:
        store = plan_store  # the sweep's store root: each cell is its own run under it
    spec = k8s.load(job_file, store, pvc, profile)
    measured_in = seal_from or spec.store  # the job file's store at its endpoint
    # A sweep's runs are its cells (the job file's name is no run there): one grace for each.
    runs = [c.name for c in cells] if cells else [spec.name]
    seal = _seal(seal_time, measured_in, runs)
    opts = k8s.K8sOptions(image, pvc, gpus, secret, image_dir, job_image=job_image)
    text = k8s.render(spec, opts, profile, seal, job_file, dict(os.environ), cells, sweep_name)
    write_out(text, out)
    return 0


def _check_k8s_names(pvc: Optional[str], secret: Optional[str], image_dir: str) -> None:
    import re

    for field, v in (("--pvc", pvc), ("--secret", secret)):
        if v is not None and not re.fullmatch(r"[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?", v):
            raise UsageError(field, f"{v!r} is not a Kubernetes object name", "e.g. ckpt-pvc")
    if not image_dir.startswith("/"):
        raise UsageError("--image-dir", f"{image_dir!r} is not an absolute path", "e.g. /app")


@emit.command("skypilot")
@click.argument("job_file", metavar="JOB.toml")
@click.option("--store", metavar="URL", help="The task's bucket (s3://BUCKET/rgt, hf://USER/REPO).")
@click.option("--gpus", "accelerators", metavar="NAME:N", help="resources.accelerators (A100:8).")
@click.option("--spot", is_flag=True, help="resources.use_spot: true.")
@click.option("--install", metavar="REQ", help="What setup pip-installs (a wheel path works).")
@click.option("--secret-env", multiple=True, metavar="VAR", help="A secret's name. Repeatable.")
@click.option("--seal-time", metavar="S", help="The measured seal time (45, 90s, 2m).")
@click.option("--out", metavar="FILE", help="Write here (replaced atomically); default stdout.")
def emit_skypilot(
    job_file: str,
    store: Optional[str],
    accelerators: Optional[str],
    spot: bool,
    install: Optional[str],
    secret_env: Tuple[str, ...],
    seal_time: Optional[str],
    out: Optional[str],
) -> int:
    """A SkyPilot task YAML (sky jobs launch): rgt-agent run as the run step, the bucket as the
    store, a preemption hook that asks rgt for the final seal."""
    from controller.emit import skypilot
    from controller.emit.common import load_job, write_out
    from onbox.agent.spec import Overrides

    spec = load_job(job_file, Overrides(store=store))
    seal = _seal(seal_time, spec.store, [spec.name])
    opts = skypilot.SkyOptions(accelerators, spot, install, tuple(secret_env))
    write_out(skypilot.render(spec, opts, seal, job_file, dict(os.environ)), out)
    return 0
