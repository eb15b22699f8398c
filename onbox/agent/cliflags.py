"""The ``rgt-agent`` flags that several commands share: start's and run's (the job's, and those
that pick a platform profile, its on-done action and the meter cap: what they do is
onbox/agent/profileuse.py), and those of the commands that read a run from its store. Kept
beside the command line, not in it, so onbox/cli.py stays a list of commands."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Optional

import click

from onbox.common.duration import parse_duration

if TYPE_CHECKING:  # the job file's module is imported by start and run only, not by every start
    from onbox.agent.spec import Overrides


def platform_options(f: Any) -> Any:
    """--profile, --on-done, --deadline, --max-cost and --price."""
    f = click.option(
        "--price", metavar="PER_HOUR", help="The box's price per hour, for --max-cost."
    )(f)
    f = click.option(
        "--max-cost", metavar="AMOUNT", help="Stop the run once it has cost AMOUNT (with --price)."
    )(f)
    f = click.option(
        "--deadline",
        metavar="DURATION",
        help="Stop the run (checkpoint, final seal) this long after its first start, e.g. 72h.",
    )(f)
    f = click.option(
        "--on-done",
        metavar="NAME",
        help="Run the profile's on-done action NAME (e.g. poweroff) once DONE.json is verified.",
    )(f)
    return click.option(
        "--profile", metavar="NAME", help="The platform profile (grace, env, default store)."
    )(f)


def job_options(f: Any) -> Any:
    """The job's flags of start and run: JOB.toml, --name, --ckpt-dir, --store, --grace,
    --output and the platform's."""
    f = platform_options(f)
    f = click.option(
        "--output",
        "outputs",
        multiple=True,
        metavar="PATH",
        help="A result to seal when the job succeeds (relative to the workdir; added to the "
        "job file's outputs). Repeatable.",
    )(f)
    f = click.option(
        "--grace",
        metavar="S",
        help="Seconds (or 30s/5m) the job gets after the stop signal; also the preemption budget.",
    )(f)
    f = click.option("--store", metavar="URL", help="Durable store root (file://, s3://, hf://).")(
        f
    )
    f = click.option("--ckpt-dir", metavar="D", help="The job's checkpoint directory.")(f)
    f = click.option(
        "--name", metavar="N", help="Run name (default: from the job file or the command)."
    )(f)
    return click.argument("job_file", metavar="[JOB.toml]", required=False)(f)


def store_options(f: Any) -> Any:
    """--store URL, --name N and --stall S, for the commands that read a run from its store."""
    f = click.option("--stall", callback=lambda c, p, v: parse_duration(v, "--stall"), default="5m",
                     metavar="S", help="A store call or download moving nothing this long fails "
                     "(exit 14; default 5m).")(f)  # fmt: skip
    f = click.option("--name", metavar="N", help="The run.")(f)
    return click.option(
        "--store",
        "url",
        required=True,
        metavar="URL",
        help="The store root (with --name) or the run's URL (ROOT/NAME).",
    )(f)


def platform_overrides(given: Mapping[str, Optional[str]]) -> Overrides:
    """The flags of ``platform_options`` as the Overrides ``resolve_spec`` takes."""
    from onbox.agent.spec import Overrides

    return Overrides(
        profile=given.get("profile"),
        on_done=given.get("on_done"),
        deadline=given.get("deadline"),
        max_cost=given.get("max_cost"),
        price=given.get("price"),
    )


# `rgt-agent run --pod` (onbox/agent/podrunner.py); defined here with the other flags so that
# the CLI's commands that people poll need not import the pod runner (and the supervisor).
pod_option = click.option(
    "--pod",
    is_flag=True,
    help="As a Kubernetes pod's agent sidecar: the job runs in its own container, started "
    "there by `python3 -m onbox.agent.podlaunch RUN_DIR` (onbox/agent/podrunner.py). Needs --name.",
)
