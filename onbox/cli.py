"""``rgt-agent``: the on-box command line.

    rgt-agent start [JOB.toml] [--name N] [--ckpt-dir D] [--store URL] [--grace S]
                    [--output PATH ...] [--profile NAME] [--on-done NAME]
                    [--deadline DURATION | --max-cost AMOUNT --price PER_HOUR] [-- CMD ...]
    rgt-agent run   (the same; stays in the foreground: Slurm, Kubernetes, containers; inside a
                    Slurm job it seals on the warning and requeues, onbox.agent.slurm)
    rgt-agent status [N] [--json]
    rgt-agent logs N [-f] [--agent]
    rgt-agent stop N [--grace S]
    rgt-agent list [--json]
    rgt-agent boot  (after a power-on: start again every interrupted run; the boot hook's)

Only the click commands live here: claiming a run is onbox.agent.claim, asking its agent to stop
or seal is onbox.agent.mailbox, what a store holds of a run is onbox.agent.catalog. An
``RgtError`` is printed as one line (redacted) and exits with its code (onbox.common.climain);
anything else is a bug and shows its traceback.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import click

import onbox

# Only what declaring the commands needs is imported here: `rgt deploy` and `rgt status` run
# `rgt-agent status NAME --json` on the box, often more than once, and each start pays for every
# module imported at the top. A command imports the rest of what it runs in its body
# (tests/unit/test_agent_start.py lists what the status start must not import).
from onbox.agent.cliflags import job_options, pod_option, store_options
from onbox.common.climain import run_cli
from onbox.common.errors import FINAL_EXIT_CODES, HostError, NotFound, RgtError, UsageError
from onbox.common.rundir import RunDir, all_runs

if TYPE_CHECKING:
    from onbox.agent.lock import RunLock
    from onbox.agent.spec import JobSpec


def _emit(text: str = "") -> None:
    click.echo(text)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name=onbox.DIST_NAME, prog_name="rgt-agent")
def cli() -> None:
    """Keep a training job alive on this box: detached, restarted with resume, never twice."""


def _warn(text: str) -> None:
    click.echo(text, err=True)


def _claim(
    job_file: Optional[str],
    name: Optional[str],
    ckpt_dir: Optional[str],
    store: Optional[str],
    grace: Optional[str],
    outputs: Sequence[str],
    platform: Dict[str, Optional[str]],
    in_slurm: bool = False,
) -> Optional[Tuple[JobSpec, RunDir, RunLock]]:
    """The spec, the run's directory and its lock, for start and run (onbox.agent.claim); None
    when the store says the run is finished. Claimed: the secrets a deploy staged for it are
    the run's (onbox.agent.claim.take_secrets); else they are removed, and the run's own too
    when no runs/N is there (drop_refused_secrets)."""
    # Lazily: the commands people poll (status, logs; `rgt watch` every 2 s) skip the supervisor.
    from onbox.agent import claim, slurm  # (and their modules)
    from onbox.agent.cliflags import platform_overrides

    command: Optional[List[str]] = click.get_current_context().obj.get("command")
    named = name
    try:
        more = platform_overrides(platform)  # --profile, --on-done, the meter cap
        spec = claim.resolve_spec(job_file, command, name, ckpt_dir, store, grace, outputs, more)
        named = spec.name
        if in_slurm:  # before anything is created
            slurm.check_trigger(spec.trigger)
        rd = claim.prepare_run(spec, _emit, _warn)
        if rd is None:
            claim.drop_refused_secrets(named)
            return None
        lock = claim.take_run(spec, rd)
    except Exception:
        claim.drop_refused_secrets(named)
        raise
    try:
        claim.take_secrets(rd)
    except BaseException:
        lock.release()
        raise
    return spec, rd, lock


@cli.command(context_settings={"ignore_unknown_options": False})
@job_options
@click.option(
    "--boot-hook",
    is_flag=True,
    help="On a generic box (profile boot.hook = cron): install an @reboot entry in /etc/cron.d "
    "so the run resumes after a reboot. This is OS persistence; off unless asked.",
)
def start(
    job_file: Optional[str],
    name: Optional[str],
    ckpt_dir: Optional[str],
    store: Optional[str],
    grace: Optional[str],
    outputs: Tuple[str, ...],
    boot_hook: bool = False,
    **platform: Optional[str],
) -> int:
    """Check everything, then detach the agent and return with the run's name and paths."""
    claimed = _claim(job_file, name, ckpt_dir, store, grace, outputs, platform)
    if claimed is None:
        return 0
    spec, rd, lock = claimed
    if boot_hook:
        from onbox.agent.boot import record_opt_in

        record_opt_in(rd)
    from onbox.agent.detach import detach  # (lazily, as in _claim)

    # Raises what the agent said when the run did not start (FAILED, or ended before its job
    # started: onbox/agent/detach.py). Meanwhile what it does (a restore) goes on stderr.
    msg = detach(rd, lock, _warn)
    verb = "re-attached to" if msg.get("adopted") else "started"
    _emit(
        f"{verb} run {rd.name}: agent pid {msg['pid']}, job pid {msg.get('job_pid')}, "
        f"attempt {msg.get('attempt')}, {msg.get('state')}"
    )
    _emit(f"  run dir   {rd.path}")
    _emit(f"  ckpt dir  {spec.ckpt_dir}")
    _emit(f"  logs      rgt-agent logs {rd.name} -f")
    _emit(f"  status    rgt-agent status {rd.name}")
    return 0


@cli.command()
@job_options
@pod_option
def run(
    job_file: Optional[str],
    name: Optional[str],
    ckpt_dir: Optional[str],
    store: Optional[str],
    grace: Optional[str],
    outputs: Tuple[str, ...],
    pod: bool = False,
    **platform: Optional[str],
) -> int:
    """Like start, but supervise in the foreground; exit code tells the final state."""
    if pod:  # the agent sidecar of a Kubernetes pod; the job has its own container
        from onbox.agent.podrunner import run_pod  # (lazily, as in _claim)

        again = (job_file, name, ckpt_dir, store, grace, outputs, platform)
        return run_pod(name, lambda: _claim(*again), _emit)
    from onbox.agent import slurm

    in_slurm = slurm.SlurmJob.from_env(os.environ) is not None
    claimed = _claim(job_file, name, ckpt_dir, store, grace, outputs, platform, in_slurm)
    if claimed is None:
        return 0
    spec, rd, lock = claimed
    from onbox.agent.loop import Agent  # (lazily, as in _claim)
    from onbox.agent.title import set_title

    os.umask(0o077)
    set_title(f"rgt-agent run {rd.name}")
    agent = Agent(rd, lock)
    agent.slurm = slurm.watch_for(os.environ, spec.grace, rd.events, agent.journal.event)
    agent.prepare(may_begin=True)
    final = agent.run()
    _emit(f"run {rd.name} ended {final.value}")
    return FINAL_EXIT_CODES.get(final.value, 1)


@cli.command()
def boot() -> int:
    """Start again every run a power-off interrupted (the boot hook runs this; idempotent)."""
    from onbox.agent.boot import boot as resume_all

    resume_all(_emit)
    return 0


def _pick_run(name: Optional[str]) -> Optional[RunDir]:
    if name:
        return RunDir(name).require()
    runs = all_runs()
    return runs[0] if len(runs) == 1 else None


@cli.command()
@click.argument("name", required=False)
@click.option("--json", "as_json", is_flag=True, help="One JSON object.")
@click.option("--with-version", "with_version", is_flag=True, hidden=True)
def status(name: Optional[str], as_json: bool, with_version: bool) -> int:
    """The run's state, job pid, attempt, restarts and last exit."""
    from onbox.agent import observe

    rd = _pick_run(name)
    if rd is None:
        return _list(as_json)
    st = observe.run_status(rd)
    if as_json:
        if with_version:  # what --version says (rgt deploy's look: one start, not two)
            st["agent_version"] = onbox.version()
        _emit(json.dumps(st, sort_keys=True))
        return 0
    from onbox.agent import slurmlogin
    from onbox.agent.states import TERMINAL_NAMES

    agent = st["agent"]
    _emit(
        f"{st['name']}: {st['state']}  attempt {st.get('attempt')}  restarts "
        f"{st.get('restarts')}  job pid {st.get('pid')}"
        + ("" if st["job_alive"] or st["state"] in TERMINAL_NAMES else " (not running)")
    )
    _emit(f"  agent      {'pid ' + str(agent['pid']) if agent['alive'] else 'not running'}")
    last = st.get("last_exit")
    if last:
        _emit(f"  last exit  attempt {last.get('attempt')}: {last.get('reason')}")
        if last.get("remedy"):
            _emit(f"             {last['remedy']}")
    prog = st.get("progress")
    if prog:
        metrics = "".join(f", {k} {v}" for k, v in (prog.get("metrics") or {}).items())
        _emit(f"  progress   step {prog['step']} (attempt {prog.get('attempt')}){metrics}")
    for line in slurmlogin.status_lines(st):  # inside a Slurm job: its id and allocation attempt
        _emit(f"  slurm      {line}")
    for line in observe.warning_lines(st):
        _emit(f"  warning    {line}")
    for line in observe.health_lines(st, time.time()):
        _emit(f"  {line}")
    _emit(f"  updated    {st.get('updated_at')}")
    _emit(f"  run dir    {st['run_dir']}")
    return 0


def _list(as_json: bool) -> int:
    from onbox.agent import observe

    rows = [observe.run_status(rd) for rd in all_runs()]
    if as_json:
        _emit(json.dumps(rows, sort_keys=True))
        return 0
    if not rows:
        _emit("no runs (start one with `rgt-agent start -- CMD`)")
        return 0
    _emit(f"{'NAME':24} {'STATE':10} {'ATTEMPT':>7} {'PID':>8}  UPDATED")
    for r in rows:
        _emit(
            f"{r['name']:24} {r['state']:10} {r.get('attempt') or 0:>7} "
            f"{r.get('pid') or '-':>8}  {r.get('updated_at') or '-'}"
        )
    return 0


@cli.command(name="report-data", hidden=True)
@click.argument("name")
def report_data(name: str) -> int:
    """One JSON object for `rgt report`: status, health samples, events (onbox.agent.observe)."""
    from onbox.agent import observe

    _emit(json.dumps(observe.report_data(RunDir(name).require()), sort_keys=True))
    return 0


@cli.command(name="list")
@click.option("--json", "as_json", is_flag=True, help="A JSON array.")
def list_runs(as_json: bool) -> int:
    """Every run on this box."""
    return _list(as_json)


@cli.command()
@click.argument("name")
@click.option("-f", "--follow", is_flag=True, help="Keep printing until the run ends.")
@click.option("--agent", is_flag=True, help="The agent's log instead of the job's output.")
def logs(name: str, follow: bool, agent: bool) -> int:
    """The job's own output, every attempt, oldest first, unaltered."""
    from onbox.agent import observe

    rd = RunDir(name).require()
    out = sys.stdout.buffer
    offsets = observe.copy_logs(rd, out, agent=agent)
    if follow:
        try:
            observe.follow(rd, out, offsets, agent=agent)
        except KeyboardInterrupt:
            return 0
    return 0


@cli.command()
@click.argument("name")
@click.option(
    "--for-start",
    is_flag=True,
    help="Keep them for the next start of the run: they become its secrets only once that "
    "start is claimed, and a refused start removes them (what `rgt deploy` does).",
)
def secrets(name: str, for_start: bool) -> int:
    """Store the run's secrets from stdin: a JSON object of VAR to value, never an argument.

    They go to $RGT_HOME/secrets/NAME (mode 0600, in a 0700 directory, outside every run
    directory); the job gets them in its environment at every start, restarts included, and
    the run's store its own variables among them (onbox.sealing.stores.open_box_store). An
    empty object removes them. Values are never printed. ``--for-start``: to
    RunDir.staged_secrets_file instead, until the next start takes them (onbox.agent.claim)."""
    from onbox.agent.claim import keep_secrets

    _emit(keep_secrets(RunDir(name), sys.stdin.buffer.read(), for_start))
    return 0


@cli.command()
@click.argument("name")
@click.option("--grace", metavar="S", help="Seconds the job gets before SIGKILL.")
def stop(name: str, grace: Optional[str]) -> int:
    """Stop the job (stop signal, grace, SIGKILL of the whole group); ends STOPPED."""
    from onbox.agent import slurmlogin
    from onbox.agent.mailbox import over, stop_run
    from onbox.common.duration import parse_duration

    rd = RunDir(name).require()
    g = parse_duration(grace, "--grace", allow_zero=True) if grace is not None else None
    doc = over(rd)  # over, and nothing of its last attempt left alive
    if doc is not None:
        _emit(f"run {name} is already {doc['state']}")
    else:
        doc = stop_run(rd, g)
        _emit(f"run {name} is {doc['state']}: no process of attempt {doc.get('attempt')} remains")
    requeued = slurmlogin.cancel_requeued(doc)  # its Slurm job, queued to run it again
    if requeued:
        _emit(requeued)
    return 0


@cli.command()
@click.argument("name")
@click.option("--timeout", "timeout_s", default="10m", metavar="S",
              help="How long to wait for the seal (default 10m).")  # fmt: skip
def sync(name: str, timeout_s: str) -> int:
    """Seal the run's complete checkpoints now, and wait until they are sealed."""
    from onbox.agent.mailbox import sync_run
    from onbox.agent.spec import JobSpec
    from onbox.common.durable import read_json
    from onbox.common.duration import parse_duration
    from onbox.sealing import manifest as mf

    rd = RunDir(name).require()
    spec = JobSpec.from_json(read_json(rd.spec) or {})
    if not spec.store:
        raise UsageError("store", f"run {name!r} has no store", "start it with --store URL")
    store = sync_run(rd, spec, parse_duration(timeout_s, "--timeout"))
    latest = mf.parse_latest(store.get_bytes(mf.latest_key(name)))
    _emit(f"run {name}: LATEST is step {latest['step'] if latest else 'none'} in {store.url}")
    return 0


@cli.command()
@store_options
@click.option("--to", "dest", metavar="DIR", help="Where to put it (default ./NAME-restored).")
def restore(url: str, name: Optional[str], stall: float, dest: Optional[str]) -> int:
    """Download the newest verified checkpoint of a run and check every sha256."""
    # Nothing is created before a checkpoint to download is found, and a restore that fails
    # removes the directories it made: a bad URL, name or --to leaves no empty --to behind.
    # An unusable checkpoint is quarantined and the previous one used (onbox/sealing/restore.py);
    # when none is left, NoVerifiedCheckpoint (exit 6) lists each step tried and why.
    from onbox.agent.catalog import store_and_run
    from onbox.sealing.restore import restore_latest

    store, run = store_and_run(url, name, stall)
    target = os.path.abspath(dest or f"{run}-restored")
    probe = target
    while not os.path.lexists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
        raise HostError(
            f"cannot restore into {target}: {probe} is "
            + ("not a directory" if not os.path.isdir(probe) else "not writable"),
            "pass --to a directory this user can write",
        )

    def event(kind: str, reason: str, **kw: Any) -> None:
        _emit(reason)

    made: List[str] = []
    doc = None
    try:
        doc = restore_latest(store, run, target, event, made, stall, "--stall")
    finally:
        if doc is None:
            for d in reversed(made):
                try:
                    os.rmdir(d)
                except OSError:
                    pass
    if doc is None:
        root = getattr(store, "root", None)  # a file:// store's directory
        raise NotFound(
            f"run {run!r} has no sealed checkpoint in {store.url}",
            f"{root} does not exist: is the durable mount there?"
            if isinstance(root, str) and not os.path.isdir(root)
            else "check --name and the store URL (rgt-agent checkpoints lists what is sealed)",
        )
    _emit(f"{doc['local']}")
    return 0


@cli.command()
@store_options
@click.option("--json", "as_json", is_flag=True, help="A JSON array.")
@click.option("--pin", "pin", type=int, metavar="STEP", help="Keep STEP whatever `keep` says.")
@click.option("--unpin", "unpin", type=int, metavar="STEP", help="Let pruning take STEP again.")
def checkpoints(
    url: str,
    name: Optional[str],
    stall: float,
    as_json: bool,
    pin: Optional[int],
    unpin: Optional[int],
) -> int:
    """The run's sealed checkpoints: step, size, sealed time, verified, pinned, quarantined.

    LATEST marks the step a restore and ``rgt pull`` take: LATEST's own, or when that one is
    quarantined the newest verified step before it (a line says so); a quarantined step is
    never marked LATEST."""
    from onbox.agent.catalog import checkpoint_rows, require_in_store, set_pins, store_and_run

    store, run = store_and_run(url, name, stall)
    require_in_store(store, run)
    set_pins(store, run, pin, unpin)
    rows, why = checkpoint_rows(store, run)
    if as_json:
        _emit(json.dumps(rows, sort_keys=True))
        return 0
    if not rows:
        _emit(f"no sealed checkpoints for {run} in {store.url}")
        return 0
    _emit(f"{'STEP':>10} {'SIZE':>12} {'SEALED':24} VERIFIED  ROOT")
    for r in rows:
        _emit(
            f"{r['step']:>10} {r.get('size', 0):>12} {r.get('sealed_at', '-'):24} "
            f"{'yes' if r['verified'] else 'NO':8}  {r.get('root', '-')}"
            + ("  <- LATEST" if r.get("latest") else "")
            + ("  (pinned)" if r.get("pinned") else "")
            + (f"  QUARANTINED: {r['quarantined']}" if "quarantined" in r else "")
        )
    if why:
        _emit(why)
    return 0


def _redacted(e: RgtError) -> str:
    from onbox.common.redact import for_home  # a message may quote a run's state or a store's URL

    return for_home().redact(e.line())


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point: run, map errors to exit codes (onbox.common.climain), redacted."""
    return run_cli(cli, "rgt-agent", argv, line=_redacted)


if __name__ == "__main__":
    sys.exit(main())
