"""``rgt``: the laptop side. It deploys, observes, pulls and verifies results, and stops the
meter only after explicit confirmation; the box runs on without it.

    rgt deploy TARGET [--profile P] [--on-done A] [--store URL] [--name N] [--python PATH]
               [--secret-env VAR ...] [--output PATH ...] [--offline] [--instance ID]
               [--time T --partition P --gpus N --cpus N --mem SIZE --sbatch OPT --seal-time S]
               [JOB.toml] [-- CMD ...]
    rgt status [N] [--json]    rgt watch [N]    rgt logs N [-f]    rgt stop N
    rgt report [N] [--out FILE.html]
    rgt pull N [--to DIR] [--from box|store] [--stall S]
    rgt down N [--instance ID]
    rgt doctor TARGET [--profile P] [--store URL] [--budget SIZE] [--verbose] [--json]
    rgt runs
    rgt sweep PLAN.toml [--dry-run] [--no-wait]    rgt reconcile PLAN.toml [--json]
    rgt profiles [--json]    rgt profiles show PROFILE [--json]
    rgt smoke [JOB.toml] [--steps N | --seconds S] [--exact] [--keep DIR] [-- CMD ...]

Errors print one line (what, why, what to do) and exit with the code of their kind
(onbox/common/errors.py).
"""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, Any, List, Optional

import click

from controller import hangup
from controller.emit.cli import emit
from controller.smoke.cli import run_smoke, smoke_cmd
from controller.sweep.cli import reconcile_cmd, sweep_cmd
from onbox.common.climain import run_cli
from onbox.common.duration import parse_duration
from onbox.common.errors import FINAL_EXIT_CODES, NotFound, UsageError
from onbox.common.terminal import printable

if TYPE_CHECKING:
    from controller.registry import Registry, RunRecord

# Every `rgt` command pays for the modules imported here, at its start: what only some commands
# need (observing a run, a pull, a sweep) is imported inside them (tests/unit/test_cli_start.py).


def _emit(text: str = "") -> None:
    click.echo(text)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="remote-gpu-trainer", prog_name="rgt")
def cli() -> None:
    """rgt: train on a rented GPU without losing work.

    `rgt deploy TARGET -- CMD` puts a run on a box and returns; the box's agent keeps it alive,
    checkpointed and sealed to durable storage without this laptop."""


def _registry() -> Registry:
    """This laptop's record of its runs (imported here: with it comes the ssh layer, which
    `rgt --help`, `rgt profiles` or `rgt emit` never use)."""
    from controller.registry import Registry

    return Registry()


def _pick(name: Optional[str]) -> RunRecord:
    reg = _registry()
    if name:
        return reg.get(name)
    runs = reg.all()
    if len(runs) == 1:
        return runs[0]
    if not runs:
        raise UsageError("N", "no runs deployed from this laptop yet", "rgt deploy TARGET -- CMD")
    latest = max(runs, key=lambda r: r.updated)
    return latest


def _stall(value: Optional[str]) -> Optional[float]:
    """`rgt pull --stall`, checked as `rgt-agent restore --stall` is (a bad one: exit 2, before
    anything is read or made); None: the run's recorded ``[store] stall``."""
    return None if value is None else parse_duration(value, "--stall")


def _instance(value: Optional[str]) -> Optional[str]:
    from controller.meter.api import check_instance

    return None if value is None else check_instance(value)


@cli.command(context_settings={"ignore_unknown_options": False})
@click.argument("target")
@click.argument("job_file", required=False, metavar="[JOB.toml]")
@click.option(
    "--profile", metavar="P",
    help="The platform profile (rgt profiles); default: guessed from the host and the box.",
)  # fmt: skip
@click.option(
    "--on-done", "on_done", metavar="ACTION",
    help="A reversible action of the profile's the agent runs after a verified DONE "
    "(e.g. autodl's poweroff).",
)  # fmt: skip
@click.option("--store", metavar="URL", help="Durable store: file:///mnt/x, s3://b/p, hf://u/r.")
@click.option("--name", metavar="N", help="Run name (default: from the job file or command).")
@click.option("--python", metavar="PATH", help="The box's Python, when python3 is not it.")
@click.option(
    "--secret-env", "secret_env", multiple=True, metavar="VAR",
    help="Pass this variable's value to the job, on stdin only. Repeatable.",
)  # fmt: skip
@click.option(
    "--output", "outputs", multiple=True, metavar="PATH",
    help="A result the agent seals when the job succeeds (relative to the job's workdir; "
    "added to the job file's outputs). Repeatable.",
)  # fmt: skip
@click.option("--offline", is_flag=True, help="Bring the agent's dependencies from here.")
@click.option("--project", default=".", metavar="DIR", help="The code to push (default: .).")
@click.option(
    "--instance", metavar="ID", callback=lambda c, p, v: _instance(v),
    help="The provider's id of the box (pod, instance, machine): rgt down stops its meter.",
)  # fmt: skip
@click.option(
    "--time", "slurm_time", metavar="T",
    help="Slurm: the walltime, as sbatch takes it (90, 4:00:00, 1-00:00:00); required.",
)  # fmt: skip
@click.option("--partition", metavar="P", help="Slurm: the partition.")
@click.option("--gpus", metavar="N", help="Slurm: sbatch --gpus (2, a100:2).")
@click.option("--cpus", type=int, metavar="N", help="Slurm: CPUs per task.")
@click.option("--mem", metavar="SIZE", help="Slurm: memory per node (32G).")
@click.option(
    "--sbatch", "sbatch", multiple=True, metavar="OPT",
    help='Slurm: one more sbatch option, "--opt=value" (checked). Repeatable.',
)  # fmt: skip
@click.option(
    "--seal-time", "seal_time", metavar="S",
    help="Slurm: the measured seal time the warning is planned from (default: the run's own "
    "seals in its store).",
)  # fmt: skip
@click.option("--smoke", is_flag=True, help="Run `rgt smoke` here first; deploy only if it passes.")
@click.pass_context
def deploy(ctx: click.Context, /, outputs: List[str], sbatch: List[str], **options: Any) -> int:
    """Put a run on TARGET (an ssh alias, user@host[:port], ssh://user@host:port, a pasted
    `ssh ...` line, or local) and return once its job has printed its first line."""
    from controller.deploy.flow import deploy as do_deploy
    from controller.deploy.request import DeployRequest

    # The options are DeployRequest's fields by name (target, job_file, profile, store, name,
    # python, secret_env, offline, project): click hands them over as they are.
    command = list((ctx.obj or {}).get("command") or [])
    if options.pop("smoke"):  # before anything is created on the box (controller/smoke/)
        run_smoke(options["job_file"], command, options["project"])
    req = DeployRequest(command=command, outputs=list(outputs), sbatch=list(sbatch), **options)
    rec = do_deploy(req, raise_ended=True)  # a run FAILED at once exits 11, as run does
    _emit(rec.name)
    return 0


@cli.command()
@click.argument("target")
@click.option(
    "--profile", metavar="P", help="The profile to hold the box against (default: guessed)."
)
@click.option(
    "--store", metavar="URL", help="Check this store instead of the profile's durable path."
)
@click.option("--budget", default="20G", metavar="SIZE", help="Checkpoint budget (default 20G).")
@click.option("--verbose", is_flag=True, help="Show the first-contact notes again.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object.")
def doctor(target: str, **options: Any) -> int:
    """Hold TARGET against its platform profile: durable mount, egress, proxy, Python, CUDA,
    stale facts; every problem with its remedy (exit 9 when there is one)."""
    from controller.doctor import run as run_doctor

    return run_doctor(target, _emit, **options)


@cli.command()
@click.argument("name", required=False)
@click.option("--json", "as_json", is_flag=True, help="One JSON object.")
def status(name: Optional[str], as_json: bool) -> int:
    """The run's state, from the box, or from the store when the box does not answer or the
    run was taken down (rgt down)."""
    from controller import observe

    rec = _pick(name)
    doc, why = observe.status(rec)
    if as_json:
        if why:
            doc["box_unreachable"] = why
        _emit(json.dumps(doc, indent=1, sort_keys=True))
    else:
        _emit(observe.describe(doc, why))
    return 0


@cli.command()
@click.argument("name", required=False)
@click.option("--interval", default=2.0, metavar="S", help="Seconds between refreshes.")
@click.option("--once", is_flag=True, help="One frame, then exit.")
@click.option("--until-done", is_flag=True, help="Exit when the run ends.")
def watch(name: Optional[str], interval: float, once: bool, until_done: bool) -> int:
    """A live view: state, attempt, step rate, loss, GPU, disk, memory, sealed age, events."""
    from controller.watch import watch as live_view

    rec = _pick(name)
    final = live_view(rec, interval=interval, once=once, until_done=until_done, out=sys.stdout)
    if until_done:
        return FINAL_EXIT_CODES.get(final, 0)
    return 0


@cli.command()
@click.argument("name", required=False)
@click.option("--out", metavar="FILE.html", help="Where (default ./NAME-report.html).")
def report(name: Optional[str], out: Optional[str]) -> int:
    """One self-contained HTML file of the run over time: step rate, loss, GPU, disk, memory,
    attempts, preemptions, seals, stalls, restarts and every event; from the box, or from
    the store when the box does not answer."""
    from controller.report import write

    _emit(write(_pick(name), out))
    return 0


@cli.command()
@click.argument("name")
@click.option("-f", "--follow", is_flag=True, help="Keep printing until interrupted.")
def logs(name: str, follow: bool) -> int:
    """The job's own output, every attempt, from the box."""
    from controller import observe

    return observe.logs(_registry().get(name), follow, sys.stdout.buffer)


@cli.command()
@click.argument("name")
@click.option("--grace", metavar="S", help="Seconds the job gets before SIGKILL.")
def stop(name: str, grace: Optional[str]) -> int:
    """Stop the run's job (it can be deployed again; nothing is deleted)."""
    from controller import observe

    return observe.stop(_registry().get(name), grace)


@cli.command()
@click.argument("name")
@click.option("--to", "dest", metavar="DIR", help="Where (default ./rgt-results/NAME).")
@click.option(
    "--from", "source", type=click.Choice(["auto", "box", "store"]), default="auto",
    help="Read from the box or the store (auto: the store when the laptop can reach it).",
)  # fmt: skip
@click.option(
    "--stall", metavar="S", callback=lambda c, p, v: _stall(v),
    help="A store call or download moving nothing this long fails (exit 14; default the job "
    "file's [store] stall, else 5m).",
)  # fmt: skip
def pull(name: str, dest: Optional[str], source: str, stall: Optional[float]) -> int:
    """Fetch the newest sealed state, verify every file (sha256, then opened as its framework
    would), rename into place, and write a verification receipt. Resumable."""
    from controller.results.destination import RESULTS_DIR
    from controller.results.pull import pull as do_pull
    from controller.results.pull import terminal_progress
    from onbox.agent.observe import warning_lines

    rec = _registry().get(name)
    # The default is a directory of rgt's own, which git (and deploy) then ignore.
    results = None if dest else RESULTS_DIR
    dest = dest or os.path.join(RESULTS_DIR, name)
    with terminal_progress() as progress:
        receipt = do_pull(rec, dest, source, progress, results=results, stall=stall)
    where = os.path.join(receipt.dest, ".rgt-receipt.json")
    if receipt.sealed.nothing:  # failed or stopped before its first checkpoint was sealed
        _emit(
            f"{name}: nothing is sealed yet in the store (no LATEST.json, DONE.json, "
            f"ENDED.json nor job log): nothing pulled; receipt {where} records that. rgt down "
            f"{name} goes only while no checkpoint nor DONE.json is sealed, and loses the run's "
            "files on the box (its plan lists them)"
        )
        _not_covered(receipt)
        return 0
    _emit(
        f"{name}: {receipt.sealed.pulled()} pulled to {receipt.dest} and verified: "
        f"{len(receipt.files)} files; receipt {where}"
    )
    _not_covered(receipt)
    if receipt.sealed.note:  # LATEST names a quarantined step: which one was pulled, and why
        # Its reason is the store's quarantine record: control characters shown as '?'.
        _emit(f"  {printable(receipt.sealed.note)}")
    # The names come from DONE.json (the box's): shown as status shows warnings, control
    # characters as '?'.
    missing = [
        {
            "reason": f"declared output {out} was missing when the job succeeded: it was never "
            "sealed, so it is not here"
        }
        for out in receipt.sealed.missing_outputs
    ]
    # Files the job left that the completion seal could not take (a FIFO, a symlink, a name
    # pull refuses): not here, and only on the box. Without a store: the links the pull left
    # out (controller/results/boxlinks.py).
    left = receipt.sealed.left_out
    box = receipt.sealed.listing_sha256 is not None
    why = "not pulled" if box else "not sealed at the job's end"
    missing += [{"reason": f"{x}: {why}, so not here (only on the box)"} for x in left[:20]]
    if len(left) > 20:
        where = "in the receipt" if box else f"in `rgt-agent logs {name} --agent` on the box"
        missing.append({"reason": f"and {len(left) - 20} more {why}: {where}"})
    for line in warning_lines({"warnings": missing}):
        _emit(f"  warning: {line}")
    for f in receipt.files:
        if f.redacted:  # its name is DONE.json's: control characters (a newline) as '?'
            _emit(
                f"  {printable(f.path)}: pulled redacted (the job's log on the box holds a "
                "secret; each match is masked here, the box's log is unaltered; from "
                f"{printable(f.source)})"
            )
    return 0


def _not_covered(receipt: Any) -> None:
    """Say which files in DEST the pull did not bring (an older pull's): not covered."""
    left = receipt.not_covered
    if left:
        shown = ", ".join(printable(x) for x in left[:5]) + (" ..." if len(left) > 5 else "")
        _emit(
            f"  warning: {receipt.dest} also holds files this pull did not bring "
            f"(an older pull's, or put there by hand): not covered by the receipt, which names "
            f"them in not_covered: {shown}"
        )


@cli.command()
@click.argument("name")
@click.option("--yes", is_flag=True, help="Do not ask (only when not on a terminal).")
@click.option(
    "--instance", metavar="ID", callback=lambda c, p, v: _instance(v),
    help="The provider's id of the box, when rgt deploy was not told it.",
)  # fmt: skip
def down(name: str, yes: bool, instance: Optional[str]) -> int:
    """Stop the run and remove it from the box, once a verified pull covers its newest sealed
    state; shows what will be lost and what keeps billing, and asks for the run's name."""
    from controller.results.down import down as do_down
    from controller.results.receipt import state_receipt_path

    try:
        rec = _registry().get(name)
    except NotFound:
        if os.path.exists(state_receipt_path(name)):
            _emit(f"{name} was taken down already; its receipt is {state_receipt_path(name)}")
            return 0
        raise
    do_down(
        rec,
        instance=instance,
        yes=yes,
        interactive=sys.stdin.isatty(),
        ask=lambda prompt: click.prompt(prompt, default="", show_default=False, prompt_suffix=""),
        show=_emit,
    )
    return 0


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="A JSON array.")
def runs(as_json: bool) -> int:
    """The runs this laptop deployed, and where they went."""
    recs = _registry().all()
    if as_json:
        _emit(json.dumps([r.to_json() for r in recs], indent=1))
        return 0
    if not recs:
        _emit("no runs yet: rgt deploy TARGET -- CMD")
    for r in recs:
        down = f"  {r.taken_down()}" if r.down_at is not None else ""  # its store alone left
        _emit(f"{r.name}  {r.target.label}  {r.profile}  store={r.store or '-'}{down}")
    return 0


@cli.group(invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="A JSON array.")
@click.pass_context
def profiles(ctx: click.Context, as_json: bool) -> int:
    """The platform profiles rgt knows (shipped, and yours in $RGT_CONTROLLER_HOME/profiles)."""
    from controller import profiles as prof

    if ctx.invoked_subcommand is not None:
        return 0
    found = prof.load_all()
    _emit(json.dumps([prof.row(p) for p in found], indent=1) if as_json else prof.table(found))
    return 0


@profiles.command("show")
@click.argument("name", metavar="PROFILE")
@click.option("--json", "as_json", is_flag=True, help="One JSON object.")
def profiles_show(name: str, as_json: bool) -> int:
    """Every fact of one profile: reach, storage survival, billing, danger clocks, env, origin."""
    from controller import profiles as prof

    p = prof.load(name)
    _emit(json.dumps(prof.to_json(p), indent=1, sort_keys=True) if as_json else prof.describe(p))
    return 0


cli.add_command(emit)  # rgt emit k8s|skypilot (controller/emit/cli.py)


cli.add_command(sweep_cmd)  # rgt sweep PLAN.toml (controller/sweep/cli.py)
cli.add_command(reconcile_cmd)  # rgt reconcile PLAN.toml
cli.add_command(smoke_cmd)  # rgt smoke [JOB.toml] -- CMD (controller/smoke/cli.py)


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point: run, map errors to exit codes (onbox.common.climain); a hang-up or a
    SIGTERM ends it as a Ctrl-C does, with 128 + the signal (controller/hangup.py)."""
    with hangup.handled() as got:
        try:
            rc = run_cli(cli, "rgt", argv)
        except BaseException:
            if hangup.outside(got) is None:
                raise
            rc = 1  # (the terminal gone: the line click writes on a Ctrl-C fails, EIO)
    return hangup.ended(got, rc)


if __name__ == "__main__":
    sys.exit(main())
