"""Claiming a run on this box for ``rgt-agent start`` and ``run``: the JobSpec from a job file
and flags (or the run's last spec, when started again without a command), the run and
checkpoint directories looked at and then made, the store's preflight, and the run's lock taken
with its spec.json written. Nothing is created until every check passed. The run's secrets
too: `rgt-agent secrets` writes them (``keep_secrets``), `rgt deploy` as staged for its start,
which become the run's once the start is claimed (``take_secrets``) and go when it is refused
(``drop_refused_secrets``)."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
from typing import Any, Callable, Dict, List, Optional, Sequence

from onbox.agent.lock import RunLock
from onbox.agent.profileuse import apply_again
from onbox.agent.spec import (
    JobSpec,
    Overrides,
    build_spec,
    check_outputs,
    default_name,
    store_override,
)
from onbox.agent.states import TERMINAL_NAMES
from onbox.common.durable import fsync_dir, make_dirs, read_json, remove_dirs, write_json
from onbox.common.duration import parse_duration
from onbox.common.errors import HostError, UsageError
from onbox.common.rundir import (
    RunDir,
    check_name,
    drop_secrets,
    is_name,
    rgt_home,
    unwritable,
)

Say = Callable[[str], None]


def _again(
    spec: JobSpec,
    ckpt_dir: Optional[str],
    store: Optional[str],
    grace: Optional[str],
    outputs: Sequence[str],
) -> JobSpec:
    """The run's last spec with the flags given this time."""
    changes: Dict[str, Any] = {}
    if grace is not None:
        changes["grace"] = parse_duration(grace, "--grace", allow_zero=True)
    if ckpt_dir is not None:
        changes["ckpt_dir"] = os.path.abspath(ckpt_dir)
    if store is not None:
        endpoint = spec.store.endpoint_url if spec.store else None
        changes["store"] = store_override(store, endpoint, "--store")
    if outputs:
        changes["outputs"] = tuple(
            dict.fromkeys(spec.outputs + check_outputs(list(outputs), "--output"))
        )
    return dataclasses.replace(spec, **changes)


def resolve_spec(
    job_file: Optional[str],
    command: Optional[List[str]],
    name: Optional[str],
    ckpt_dir: Optional[str],
    store: Optional[str],
    grace: Optional[str],
    outputs: Sequence[str] = (),
    platform: Optional[Overrides] = None,
) -> JobSpec:
    """The spec ``start`` and ``run`` were asked for: from the job file and flags, or, with no
    command and no job file, the named run's last spec with the flags given. ``platform``
    holds the profile, on-done and meter-cap flags (onbox/agent/profileuse.py)."""
    home = rgt_home()
    more = platform or Overrides()
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
        spec = _again(JobSpec.from_json(doc), ckpt_dir, store, grace, outputs)
        return apply_again(spec, more, os.environ)
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
            profile=more.profile,
            on_done=more.on_done,
            deadline=more.deadline,
            max_cost=more.max_cost,
            price=more.price,
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


# How `start` begins its line for a run whose store says it is finished (nothing started): the
# laptop's deploy reads it (controller/deploy/boxstart.py), so as not to wait for a job.
FINISHED_SAY = "run {run} is finished: "


def _check_store(spec: JobSpec, rd: RunDir, say: Say, warn: Say) -> bool:
    """Preflight the store before anything starts; False when the run is finished already."""
    if not spec.store:
        return True
    from onbox.sealing import manifest as mf
    from onbox.sealing.stores import open_box_store
    from onbox.sealing.stores.local import LocalStore

    store = open_box_store(spec.store, spec.name, staged=True)  # the secrets it will start with
    if isinstance(store, LocalStore) and store.root == os.path.join(rd.home, "store"):
        # rgt's own default on the `local` target (controller/deploy/flow.py): no path a user
        # typed, so no typo to refuse (stores/localpreflight.py); rgt makes it.
        make_dirs(store.root)
    # A hung mount fails `start` here (exit 14), not holds it for ever (stores/hangbound.py).
    with store.calls_bounded(spec.restore_stall):
        for finding in store.preflight(spec.name):
            say(("store: " if finding.ok else "WARNING: store: ") + finding.what)
        if store.same_filesystem_as(_existing(spec.ckpt_dir)):
            warn(
                f"WARNING: the store {store.url} is on the same filesystem as the checkpoint "
                f"dir {spec.ckpt_dir}: it dies with this disk. Is the durable mount really "
                "mounted?"
            )
        done = store.get_bytes(mf.done_key(spec.name))
    if done is not None:
        say(
            FINISHED_SAY.format(run=spec.name)
            + f"{store.url}/{spec.name}/DONE.json exists; not training again (to train "
            "again, start under a new --name)"
        )
        return False
    return True


def prepare_run(spec: JobSpec, say: Say, warn: Say) -> Optional[RunDir]:
    """Everything ``start`` and ``run`` check before the lock, in the order that creates
    nothing until all of it passed: the directories (looked at), the store's preflight (which
    writes only in the store, and removes its probe), then the directories made. None when the
    store says the run is finished. ``say`` prints a line, ``warn`` one for stderr."""
    rd = _check_dirs(spec)
    if not _check_store(spec, rd, say, warn):
        return None
    _make_dirs(spec, rd)
    return rd


def take_run(spec: JobSpec, rd: RunDir) -> RunLock:
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


def keep_secrets(rd: RunDir, raw: bytes, for_start: bool) -> str:
    """``rgt-agent secrets``: ``raw``, a JSON object of VAR to value, as the run's secrets
    file (0600, in a 0700 directory), or as its staged one (``for_start``: the next claimed
    start takes them, ``take_secrets``); an empty object removes that file. What to say."""
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
    path = rd.staged_secrets_file if for_start else rd.secrets_file
    make_dirs(os.path.dirname(path))  # RGT_HOME too, when this is the first command: 0700
    os.chmod(os.path.dirname(path), 0o700)
    if not doc:
        drop_secrets(path)
        return f"secrets of {rd.name}: none"
    write_json(path, doc)  # atomic, 0600
    return f"secrets of {rd.name}: {', '.join(sorted(doc))} (values not shown)"


def take_secrets(rd: RunDir) -> None:
    """The secrets a deploy staged for this start (``RunDir.staged_secrets_file``) become the
    run's, replacing what it had: the start is claimed (every check passed, the lock held)."""
    try:
        os.replace(rd.staged_secrets_file, rd.secrets_file)
        fsync_dir(os.path.dirname(rd.secrets_file))
    except FileNotFoundError:  # none staged: the run keeps its own
        return
    except OSError as e:
        raise HostError(
            f"cannot make {rd.staged_secrets_file} the run's secrets {rd.secrets_file}: "
            f"{e.strerror or e}",
            "check the secrets directory's owner and permissions, then start again",
        ) from None


def drop_refused_secrets(name: Optional[str]) -> None:
    """After ``start`` or ``run`` of run ``name`` was refused (or found the run finished): the
    secrets a deploy staged for it removed, and its secrets file too when no run of that name is
    on this box (no runs/N). `rgt deploy` stages the secrets just before the start, and keeps no
    record of a run whose start was refused, so no `rgt down` would ever remove them. The box
    decides, not the laptop: it looks at runs/N after its own refusal (the claim makes runs/N
    only once every check passed, and removes it again when making it failed), where the laptop
    knows only what its look saw before the push, and a run made since (another deploy of the
    name) would lose its secrets. A run that is there keeps its own (`rgt down` removes them
    with it); the refused start's new values are never put in their place (``take_secrets``)."""
    if name is None or not is_name(name):
        return
    # A clean-up on the way out of a refusal: it must never put its own error in place of the
    # refusal's (RGT_HOME a file, an unreadable secrets dir: the refusal says what is wrong).
    with contextlib.suppress(OSError):
        rd = RunDir(name)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(rd.staged_secrets_file)
        if not os.path.lexists(rd.path):
            os.unlink(rd.secrets_file)
