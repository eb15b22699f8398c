"""``rgt smoke``, registered on ``rgt`` by controller/cli.py (``rgt deploy --smoke`` calls
``run_smoke`` before anything is created on the box):

rgt smoke [JOB.toml] [--steps N | --seconds S] [--exact] [--keep DIR] [--gpu] [--project DIR]
          [--timeout S] [--grace S] [-- CMD ...]
"""

from __future__ import annotations

from typing import Any, List, Optional

import click

from onbox.common.duration import parse_duration


def run_smoke(
    job_file: Optional[str], command: List[str], project: str = ".", **more: object
) -> None:
    """The walk (controller/smoke/walk.py), printing each check's line; SmokeFailed (exit 19)
    at the first that fails."""
    from controller.smoke.walk import SmokeRequest, smoke

    req = SmokeRequest(job_file=job_file, command=list(command), project=project)
    for k, v in more.items():
        if v is not None:
            setattr(req, k, v)
    smoke(req, click.echo)


@click.command("smoke")
@click.argument("job_file", required=False, metavar="[JOB.toml]")
@click.option("--steps", type=int, metavar="N", help="Train N steps before the checkpoint "
              "is asked for (default 10).")  # fmt: skip
@click.option("--seconds", metavar="S", help="Train S seconds after the first step instead.")
@click.option("--exact", is_flag=True, help="Also run it uninterrupted and compare the final "
              "state hashes with the resumed run's (the job must end on its own).")  # fmt: skip
@click.option("--keep", metavar="DIR", help="Keep the runs, store and logs in DIR (new).")
@click.option("--gpu", is_flag=True, help="Let the job see this machine's GPUs.")
@click.option("--project", default=".", metavar="DIR", help="The code, as deploy pushes it "
              "(default: .); the job runs in a copy of it.")  # fmt: skip
@click.option("--timeout", default="120", metavar="S", help="Each wait of the walk at most "
              "(default 120 s).")  # fmt: skip
@click.option("--grace", default="15", metavar="S", help="The preemption's grace before "
              "SIGKILL (default 15 s).")  # fmt: skip
@click.pass_context
def smoke_cmd(
    ctx: click.Context,
    /,
    job_file: Optional[str],
    seconds: Optional[str],
    timeout: str,
    grace: str,
    **options: Any,
) -> int:
    """Run the job here, on the CPU, under a private agent with a temporary store, and walk
    the checks of a real run: it starts, reports progress, checkpoints when asked, is sealed
    and verified, resumes after a preemption on a fresh directory from the sealed step (with
    --exact: to the same state), and leaves what rgt pull brings back. Exit 0 only when every
    check holds, 19 at the first that fails."""
    run_smoke(
        job_file,
        list((ctx.obj or {}).get("command") or []),
        seconds=None if seconds is None else parse_duration(seconds, "--seconds"),
        timeout=parse_duration(timeout, "--timeout"),
        grace=parse_duration(grace, "--grace"),
        **options,
    )
    return 0
