"""The sweep's two commands, registered on ``rgt`` by controller/cli.py:

rgt sweep PLAN.toml [--dry-run] [--no-wait] [--interval S]
rgt reconcile PLAN.toml [--json]
"""

from __future__ import annotations

import json

import click

# This module is imported by every `rgt` command (controller/cli.py registers these two): the
# plan's reader and the sweep itself are imported inside the commands.


@click.command("sweep")
@click.argument("plan_file", metavar="PLAN.toml")
@click.option("--dry-run", is_flag=True, help="Show the cells and their boxes; deploy nothing.")
@click.option("--no-wait", is_flag=True, help="Deploy each idle box's next cell and return.")
@click.option("--interval", default=3.0, metavar="S", help="Seconds between polls (default 3).")
def sweep_cmd(plan_file: str, dry_run: bool, no_wait: bool, interval: float) -> int:
    """Fan PLAN.toml's grid out over its boxes (one sequential queue per box, split by cost),
    each cell its own run, outputs and store prefix; track them to the end. Run it again to
    resume: finished cells are skipped, a cell whose box died resumes from its store."""
    from controller.sweep.plan import load_plan
    from controller.sweep.run import sweep

    return sweep(load_plan(plan_file), dry_run=dry_run, wait=not no_wait, interval=interval)


@click.command("reconcile")
@click.argument("plan_file", metavar="PLAN.toml")
@click.option("--json", "as_json", is_flag=True, help="One JSON object.")
def reconcile_cmd(plan_file: str, as_json: bool) -> int:
    """The sweep's roster against the store: every cell's DONE.json and each of its files
    verified (sha256 against its manifest, loaded where a format); lists missing, failed,
    unverified and duplicate cells. Exit 0 only when all is reconciled, else 18."""
    from controller.sweep import record
    from controller.sweep.plan import check_store_here, load_plan
    from controller.sweep.reconcile import raise_unless_ok, reconcile, remember
    from onbox.common.errors import UsageError

    plan = load_plan(plan_file)
    check_store_here(plan)
    record.begin(plan)  # the roster checked against the record (made when never swept)
    doc = record.load(plan.name)
    if doc is None:  # pragma: no cover - begin made it
        raise UsageError("PLAN.toml", f"sweep {plan.name} has no record")
    report = reconcile(doc)
    remember(report)
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=1, sort_keys=True))
    else:
        for line in report.lines(plan.path):
            click.echo(line)
    raise_unless_ok(report, plan.path)
    return 0
