"""The ``rgt-agent start/run`` flags that pick a platform profile, its on-done action and the
meter cap (what they do is onbox/agent/profileuse.py): kept beside the command line, not in it,
so onbox/cli.py stays a list of commands."""

from __future__ import annotations

from typing import Any, Mapping, Optional

import click

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


def platform_overrides(given: Mapping[str, Optional[str]]) -> Overrides:
    """The flags of ``platform_options`` as the Overrides ``resolve_spec`` takes."""
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
