"""``rgt-agent``: the on-box command line.

    rgt-agent start [JOB.toml] [--name N] [--ckpt-dir D] [--store URL] [--grace S]
                    [--output PATH ...] [-- CMD ...]
    rgt-agent run   (the same; stays in the foreground: Slurm, Kubernetes, containers)
    rgt-agent status [N] [--json]
    rgt-agent logs N [-f] [--agent]
    rgt-agent stop N [--grace S]
    rgt-agent list [--json]

An ``RgtError`` is printed as one line and exits with its code (onbox.common.errors); anything else
is a
bug and shows its traceback.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import signal
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import click

from onbox.agent import observe, procfs
from onbox.agent.daemon import spawn_agent
from onbox.agent.lock import RunLock, is_held, read_holder
from onbox.agent.loop import Agent
from onbox.agent.runner import read_ready
from onbox.agent.spec import (
    JobSpec,
    Overrides,
    build_spec,
    check_outputs,
    default_name,
    parse_duration,
)
from onbox.agent.states import TERMINAL
from onbox.agent.title import set_title
from onbox.common.durable import make_dirs, read_json, remove_dirs, write_json
from onbox.common.errors import (
    FINAL_EXIT_CODES,
    HostError,
    LockedError,
    NotFound,
    RgtError,
    StopFailed,
    UsageError,
)
from onbox.common.rundir import RunDir, all_runs, check_name, rgt_home, unwritable

TERMINAL_NAMES = {s.value for s in TERMINAL}
READY_TIMEOUT = 10.0


def _emit(text: str = "") -> None:
    click.echo(text)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="remote-gpu-trainer", prog_name="rgt-agent")
def cli() -> None:
    """Keep a training job alive on this box: detached, restarted with resume, never twice."""


def _job_options(f: Any) -> Any:
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


def _resolve_spec(
    job_file: Optional[str],
    name: Optional[str],
    ckpt_dir: Optional[str],
    store: Optional[str],
    grace: Optional[str],
    outputs: Sequence[str] = (),
) -> JobSpec:
    command: Optional[List[str]] = click.get_current_context().obj.get("command")
    home = rgt_home()
    if job_file is None and not command:
        if name is None:
            raise UsageError(
                "command",
                "is empty",
                "give the job after --, e.g. `rgt-agent start -- python train.py`",
            )
        rd = RunDir(check_name(name, "--name"), home)
        doc = read_json(rd.spec)
        if doc is None:
            raise UsageError(
                "command",
                f"is empty and there is no run {name!r} to start again",
                "give the job after --",
            )
        spec = JobSpec.from_json(doc)
        changes: Dict[str, Any] = {}
        if grace is not None:
            changes["grace"] = parse_duration(grace, "--grace", allow_zero=True)
        if ckpt_dir is not None:
            changes["ckpt_dir"] = os.path.abspath(ckpt_dir)
        if store is not None:
            from onbox.sealing.stores import parse_store_url

            changes["store"] = parse_store_url(store, "--store").url
        if outputs:
            changes["outputs"] = tuple(
                dict.fromkeys(spec.outputs + check_outputs(list(outputs), "--output"))
            )
        return dataclasses.replace(spec, **changes)
    if job_file is not None and not job_file.endswith(".toml") and not os.path.isfile(job_file):
        raise UsageError(
            "JOB.toml",
            f"{job_file!r} is not a job file",
            "put the command after --, e.g. `rgt-agent start -- python train.py`",
        )
    return build_spec(
        job_file,
        Overrides(
            name=name,
            command=command,
            ckpt_dir=ckpt_dir,
            store=store,
            grace=grace,
            outputs=list(outputs),
        ),
        cwd=os.getcwd(),
        environ=os.environ,
        default_name=default_name(command or []),
        run_dir_of=lambda n: RunDir(n, home).path,
    )


def _ckpt_unwritable(spec: JobSpec, why: str) -> HostError:
    return HostError(
        f"checkpoint dir {spec.ckpt_dir} is not writable: {why}",
        "pick another --ckpt-dir, one this user can write",
    )


def _check_dirs(spec: JobSpec) -> RunDir:
    """The run's directory, once it and the checkpoint dir look makeable and writable; creates
    nothing (a failed start must leave no runs/N behind)."""
    rd = RunDir(spec.name)
    rd.check()
    why = unwritable(spec.ckpt_dir)
    if why:
        raise _ckpt_unwritable(spec, why)
    return rd


def _make_dirs(spec: JobSpec, rd: RunDir) -> List[str]:
    """Make the run and checkpoint directories (0700, parents too; an existing --ckpt-dir is
    left as it is) and prove them writable; the directories made. Only making a directory
    proves it can be made (/proc says yes to access()), so a failure here removes what this
    call made before it raises."""
    created = rd.create()
    try:
        created += make_dirs(spec.ckpt_dir)
        if not os.access(spec.ckpt_dir, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
    except OSError as e:
        remove_dirs(created)
        raise _ckpt_unwritable(spec, e.strerror or str(e)) from None
    return created


def _existing(path: str) -> str:
    """``path`` or its nearest parent that exists (the checkpoint dir is made after the store
    check, whose same-filesystem test needs a path that is there)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def _check_store(spec: JobSpec) -> bool:
    """Preflight the store before anything starts; False when the run is finished already."""
    if not spec.store:
        return True
    from onbox.sealing import manifest as mf
    from onbox.sealing.stores import open_store

    store = open_store(spec.store)
    for finding in store.preflight(spec.name):
        _emit(("store: " if finding.ok else "WARNING: store: ") + finding.what)
    if store.same_filesystem_as(_existing(spec.ckpt_dir)):
        click.echo(
            f"WARNING: the store {store.url} is on the same filesystem as the checkpoint dir "
            f"{spec.ckpt_dir}: it dies with this disk. Is the durable mount really mounted?",
            err=True,
        )
    done = store.get_bytes(mf.done_key(spec.name))
    if done is not None:
        _emit(
            f"run {spec.name} is finished: {store.url}/{spec.name}/DONE.json exists; not "
            "training again (to train again, start under a new --name)"
        )
        return False
    return True


def _prepare_run(spec: JobSpec) -> Optional[RunDir]:
    """Everything ``start`` and ``run`` check before the lock, in the order that creates
    nothing until all of it passed: the directories (looked at), the store's preflight (which
    writes only in the store, and removes its probe), then the directories made. None when the
    store says the run is finished."""
    rd = _check_dirs(spec)
    if not _check_store(spec):
        return None
    _make_dirs(spec, rd)
    return rd


def _take_run(spec: JobSpec, rd: RunDir) -> RunLock:
    """Lock the run and write its spec; refuses to swap the command of a live run."""
    lock = RunLock.acquire(rd.lock, rd.name)
    try:
        old = read_json(rd.spec)
        state = read_json(rd.state) or {}
        live = state.get("state") not in TERMINAL_NAMES and state.get("attempt")
        if old is not None and live and tuple(old["command"]) != spec.command:
            raise UsageError(
                "command",
                f"run {rd.name!r} is {state.get('state')} with command "
                f"{' '.join(old['command'])!r}",
                "stop it first, or choose another --name",
            )
        write_json(rd.spec, spec.to_json())
    except BaseException:
        lock.release()
        raise
    return lock


@cli.command(context_settings={"ignore_unknown_options": False})
@_job_options
def start(
    job_file: Optional[str],
    name: Optional[str],
    ckpt_dir: Optional[str],
    store: Optional[str],
    grace: Optional[str],
    outputs: Tuple[str, ...],
) -> int:
    """Check everything, then detach the agent and return with the run's name and paths."""
    spec = _resolve_spec(job_file, name, ckpt_dir, store, grace, outputs)
    rd = _prepare_run(spec)
    if rd is None:
        return 0
    lock = _take_run(spec, rd)
    r, w = os.pipe()
    try:
        spawn_agent(rd, lock.fd, ready_fd=w)
    finally:
        os.close(w)
        lock.release()  # the agent holds the lock through its own copy of the fd
    try:
        msg = read_ready(r, READY_TIMEOUT)
    except HostError:
        raise HostError(
            f"the agent for {rd.name!r} did not come up", f"see {rd.agent_log}"
        ) from None
    finally:
        os.close(r)
    if msg.get("ok") is False:  # it could not begin (onbox/agent/loop.py): the run is FAILED, why
        err = RgtError(str(msg.get("what")), msg.get("remedy"))
        err.exit_code = int(msg.get("exit_code") or 1)
        raise err
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
@_job_options
def run(
    job_file: Optional[str],
    name: Optional[str],
    ckpt_dir: Optional[str],
    store: Optional[str],
    grace: Optional[str],
    outputs: Tuple[str, ...],
) -> int:
    """Like start, but supervise in the foreground; exit code tells the final state."""
    spec = _resolve_spec(job_file, name, ckpt_dir, store, grace, outputs)
    rd = _prepare_run(spec)
    if rd is None:
        return 0
    lock = _take_run(spec, rd)
    os.umask(0o077)
    set_title(f"rgt-agent run {rd.name}")
    agent = Agent(rd, lock)
    agent.prepare(may_begin=True)
    final = agent.run()
    _emit(f"run {rd.name} ended {final.value}")
    return FINAL_EXIT_CODES.get(final.value, 1)


def _pick_run(name: Optional[str]) -> Optional[RunDir]:
    if name:
        return RunDir(name).require()
    runs = all_runs()
    return runs[0] if len(runs) == 1 else None


@cli.command()
@click.argument("name", required=False)
@click.option("--json", "as_json", is_flag=True, help="One JSON object.")
def status(name: Optional[str], as_json: bool) -> int:
    """The run's state, job pid, attempt, restarts and last exit."""
    rd = _pick_run(name)
    if rd is None:
        return _list(as_json)
    st = observe.run_status(rd)
    if as_json:
        _emit(json.dumps(st, sort_keys=True))
        return 0
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
    for line in observe.warning_lines(st):
        _emit(f"  warning    {line}")
    _emit(f"  updated    {st.get('updated_at')}")
    _emit(f"  run dir    {st['run_dir']}")
    return 0


def _list(as_json: bool) -> int:
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
def secrets(name: str) -> int:
    """Store the run's secrets from stdin: a JSON object of VAR to value, never an argument.

    They go to $RGT_HOME/secrets/NAME (mode 0600, in a 0700 directory, outside every run
    directory); the job gets them in its environment at every start, restarts included. An
    empty object removes them. Values are never printed."""
    rd = RunDir(name)
    raw = sys.stdin.buffer.read()
    try:
        doc = json.loads(raw or b"{}")
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or not all(
        isinstance(k, str) and k.isidentifier() and isinstance(v, str) for k, v in doc.items()
    ):
        raise UsageError(
            "stdin",
            "is not a JSON object of variable names to string values",
            'pipe e.g. {"WANDB_API_KEY": "..."}',
        )
    path = rd.secrets_file
    make_dirs(os.path.dirname(path))  # RGT_HOME too, when this is the first command: 0700
    os.chmod(os.path.dirname(path), 0o700)
    if not doc:
        if os.path.exists(path):
            os.unlink(path)
        _emit(f"secrets of {name}: none")
        return 0
    write_json(path, doc)  # atomic, 0600
    _emit(f"secrets of {name}: {', '.join(sorted(doc))} (values not shown)")
    return 0


def _signal_agent(rd: RunDir) -> bool:
    holder = read_holder(rd.lock)
    if not holder or holder.get("host") != os.uname().nodename:
        return False
    ident = procfs.Identity(holder["pid"], holder.get("start_ticks") or -1)
    if not procfs.is_alive(ident):
        return False
    os.kill(ident.pid, signal.SIGUSR2)
    return True


@cli.command()
@click.argument("name")
@click.option("--grace", metavar="S", help="Seconds the job gets before SIGKILL.")
def stop(name: str, grace: Optional[str]) -> int:
    """Stop the job (stop signal, grace, SIGKILL of the whole group); ends STOPPED."""
    rd = RunDir(name).require()
    g = parse_duration(grace, "--grace", allow_zero=True) if grace is not None else None
    doc = read_json(rd.state) or {}
    if doc.get("state") in TERMINAL_NAMES:
        _emit(f"run {name} is already {doc['state']}")
        return 0
    spec = JobSpec.from_json(read_json(rd.spec) or {})
    wait = (g if g is not None else spec.grace) + 30.0
    deadline = time.monotonic() + wait
    while True:
        if is_held(rd.lock):
            write_json(rd.stop_request, {"grace": g, "requested_at": time.time()})
            if _signal_agent(rd):
                break
        else:
            try:
                lock = RunLock.acquire(rd.lock, rd.name)
            except LockedError:
                continue  # an agent just came up (a shim restarting it): ask that one
            # No agent: this command does the stop itself, with the same machine.
            agent = Agent(rd, lock)
            if agent.prepare(may_begin=False):
                agent.run(stop=("stop", g))
            else:
                lock.release()
            break
        if time.monotonic() > deadline:
            raise StopFailed(f"the agent of {name!r} does not answer", f"see {rd.agent_log}")
        time.sleep(0.1)
    while True:
        doc = read_json(rd.state) or {}
        left = observe.tagged_alive(rd, doc.get("attempt") or 0)
        if doc.get("state") in TERMINAL_NAMES and not left and not is_held(rd.lock):
            break
        if time.monotonic() > deadline:
            raise StopFailed(
                f"run {name!r} is {doc.get('state')} after {wait:.0f}s"
                + (f"; processes still alive: {left}" if left else ""),
                f"see {rd.agent_log}",
            )
        time.sleep(0.1)
    _emit(f"run {name} is {doc['state']}: no process of attempt {doc.get('attempt')} remains")
    return 0


def _store_options(f: Any) -> Any:
    """--store URL and --name N, for the commands that read a run from its store."""
    f = click.option("--name", metavar="N", help="The run.")(f)
    return click.option(
        "--store",
        "url",
        required=True,
        metavar="URL",
        help="The store root (with --name) or the run's URL (ROOT/NAME).",
    )(f)


def _store_and_run(url: str, name: Optional[str]) -> tuple[Any, str]:
    """The store and the run: ``--store ROOT --name N``, or ``--store ROOT/N``."""
    from onbox.sealing.stores import open_store

    if name is None:
        root, _, last = url.rstrip("/").rpartition("/")
        if "://" not in root or not last:
            raise UsageError(
                "--name",
                "is needed with a store root URL",
                "give --name N, or the run's own URL (ROOT/N)",
            )
        # file:///NAME: the root is file:/// (rpartition leaves "file://")
        root = root + "/" if root.endswith((":/", "://")) else root
        return open_store(root), check_name(last, "run")
    return open_store(url), check_name(name, "--name")


def _require_in_store(store: Any, run: str) -> None:
    """NotFound (exit 8, as ``restore`` says it) when the store holds nothing of ``run``, so
    that a mistyped URL or name never reads as "no checkpoints yet"; a ``file://`` store whose
    directory is missing is named as such. Every run that ever started with a store has taken
    an epoch there."""
    from onbox.sealing import manifest as mf

    root = getattr(store, "root", None)  # a LocalStore's directory
    if isinstance(root, str) and not os.path.isdir(root):
        raise NotFound(
            f"the store {store.url} does not exist (no directory {root}), so neither does run "
            f"{run!r} in it",
            "check the URL, and that the durable mount is mounted",
        )
    for prefix in (mf.epochs_prefix(run), mf.checkpoints_prefix(run)):
        if next(iter(store.list(prefix)), None) is not None:
            return
    if store.stat(mf.latest_key(run)) is not None:
        return
    raise NotFound(
        f"the store {store.url} holds no run {run!r}",
        "check --name and the store root (or give the run's own URL, ROOT/NAME)",
    )


@cli.command()
@click.argument("name")
@click.option(
    "--timeout",
    "timeout_s",
    default="10m",
    metavar="S",
    help="How long to wait for the seal (default 10m).",
)
def sync(name: str, timeout_s: str) -> int:
    """Seal the run's complete checkpoints now, and wait until they are sealed."""
    from onbox.sealing import manifest as mf
    from onbox.sealing.sealer import Sealer, take_epoch
    from onbox.sealing.stores import open_store

    rd = RunDir(name).require()
    spec = JobSpec.from_json(read_json(rd.spec) or {})
    if not spec.store:
        raise UsageError("store", f"run {name!r} has no store", "start it with --store URL")
    wait = parse_duration(timeout_s, "--timeout")
    if is_held(rd.lock):
        write_json(rd.sync_request, {"at": time.time()})
        if not _signal_agent(rd):
            raise StopFailed(f"the agent of {name!r} does not answer", f"see {rd.agent_log}")
        deadline = time.monotonic() + wait
        while os.path.exists(rd.sync_request):
            if time.monotonic() > deadline:
                raise StopFailed(
                    f"the seal of {name!r} did not finish in {wait:.0f}s", f"see {rd.agent_log}"
                )
            time.sleep(0.1)
        store = open_store(spec.store)
    else:
        lock = RunLock.acquire(rd.lock, rd.name)  # no agent: seal from here, as its writer
        try:
            from onbox.agent.journal import FileJournal

            journal = FileJournal(rd.state, rd.events, rd.agent_log)
            store = open_store(spec.store)
            sealer = Sealer(
                name,
                spec.ckpt_dir,
                store,
                os.path.join(rd.path, "staging"),
                epoch=take_epoch(store, name),
                keep=spec.keep,
                event=journal.event,
                state_path=os.path.join(rd.path, "sealer.json"),
            )
            sealer.load()
            sealer.seal_pending()
        finally:
            lock.release()
    latest = mf.parse_latest(store.get_bytes(mf.latest_key(name)))
    _emit(f"run {name}: LATEST is step {latest['step'] if latest else 'none'} in {store.url}")
    return 0


@cli.command()
@_store_options
@click.option("--to", "dest", metavar="DIR", help="Where to put it (default ./NAME-restored).")
def restore(url: str, name: Optional[str], dest: Optional[str]) -> int:
    """Download the newest verified checkpoint of a run and check every sha256."""
    # Nothing is created before a checkpoint to download is found, and a restore that fails
    # removes the directories it made: a bad URL, name or --to leaves no empty --to behind.
    # An unusable checkpoint is quarantined and the previous one used (onbox/sealing/restore.py);
    # when
    # none is left, NoVerifiedCheckpoint (exit 6) lists each step tried and why.
    from onbox.sealing.restore import restore_latest

    store, run = _store_and_run(url, name)
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
        doc = restore_latest(store, run, target, event, made)
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
@_store_options
@click.option("--json", "as_json", is_flag=True, help="A JSON array.")
@click.option("--pin", "pin", type=int, metavar="STEP", help="Keep STEP whatever `keep` says.")
@click.option("--unpin", "unpin", type=int, metavar="STEP", help="Let pruning take STEP again.")
def checkpoints(
    url: str, name: Optional[str], as_json: bool, pin: Optional[int], unpin: Optional[int]
) -> int:
    """The run's sealed checkpoints: step, size, sealed time, verified, pinned, quarantined.

    LATEST marks the step a restore and ``rgt pull`` take: LATEST's own, or when that one is
    quarantined the newest verified step before it (a line says so); a quarantined step is
    never marked LATEST."""
    from onbox.agent.journal import iso
    from onbox.common.errors import IntegrityError
    from onbox.sealing import manifest as mf
    from onbox.sealing.restore import in_effect, quarantine_reasons, sealed_steps

    store, run = _store_and_run(url, name)
    _require_in_store(store, run)
    if pin is not None:
        if store.stat(mf.manifest_key(run, pin)) is None:
            raise NotFound(f"run {run!r} has no sealed step {pin} in {store.url}")
        store.put_bytes(mf.pin_key(run, pin), b"pinned\n")
    if unpin is not None:
        store.delete(mf.pin_key(run, unpin))
    pins = {
        int(i.key.rsplit("/", 1)[-1])
        for i in store.list(mf.pins_prefix(run))
        if i.key.rsplit("/", 1)[-1].isdigit()
    }
    latest = mf.parse_latest(store.get_bytes(mf.latest_key(run)))
    bad = quarantine_reasons(store, run)
    sealed = sealed_steps(store, run)
    effective, why = in_effect(latest["step"] if latest else None, sealed, bad)
    rows: List[Dict[str, Any]] = []
    for step in sorted(set(sealed) | set(bad)):
        row: Dict[str, Any] = {"step": step, "verified": False, "latest": step == effective}
        if step in bad:
            row["quarantined"] = bad[step]
        data = store.get_bytes(mf.manifest_key(run, step)) if step in sealed else None
        try:
            doc = mf.parse_manifest(data or b"", mf.manifest_key(run, step))
        except IntegrityError as e:
            rows.append({**row, "problem": e.what if data else "its MANIFEST is missing"})
            continue
        row.update(
            root=doc["root"],
            files=len(doc["files"]),
            size=sum(f["size"] for f in doc["files"]),
            sealed_at=iso(doc["created"]),
            epoch=doc["epoch"],
            verified=step not in bad,
            pinned=step in pins,
        )
        rows.append(row)
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


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point: split off the job's command after ``--``, run, map errors to exit codes."""
    args = list(sys.argv[1:] if argv is None else argv)
    command = None
    if "--" in args:
        i = args.index("--")
        args, command = args[:i], args[i + 1 :]
    try:
        rv = cli.main(
            args=args, prog_name="rgt-agent", standalone_mode=False, obj={"command": command}
        )
    except RgtError as e:
        from onbox.common.redact import (
            for_home,  # a message may quote a run's state or a store's URL
        )

        click.echo(for_home().redact(e.line()), err=True)
        return e.exit_code
    except click.exceptions.UsageError as e:
        click.echo(f"rgt: {e.format_message()}", err=True)
        return 2
    except click.exceptions.Abort:
        return 130
    except click.exceptions.Exit as e:
        return int(e.exit_code)
    return rv if isinstance(rv, int) else 0


if __name__ == "__main__":
    sys.exit(main())
