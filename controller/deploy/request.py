"""What the user asked `rgt deploy` for, checked before anything anywhere changes.

``check_request`` refuses (UsageError) what the box would refuse only after the push and the
install: a profile that is not one (shipped, or the user's in $RGT_CONTROLLER_HOME/profiles or
$RGT_PROFILES_DIR) or does not fit the target, an ``--on-done`` the profile does not offer, nothing
to run (no job, and no ``--name`` of a run to start again), a job file outside the project or
with a setting the box would refuse, a bad run name, store URL or ``--output``, a ``--secret-env``
with no value here, a Slurm flag (``--time``, ``--sbatch``, ...) off a Slurm profile or a bad one
on it. What it returns, a ``Plan``, is what controller/deploy/flow.py carries through the steps
of the deploy.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence, Tuple

from controller.deploy import guess as guessmod
from controller.profiles import user_dirs as profile_dirs
from controller.runstore import store_at
from controller.target import Target, parse_target
from onbox.agent.profileuse import meter_deadline
from onbox.agent.spec import (
    Overrides,
    check_outputs,
    check_settings,
    default_name,
    naming_file,
    store_override,
)
from onbox.common.errors import UsageError
from onbox.common.rundir import check_name
from onbox.common.storeurl import StoreURL, parse_store_setting, restore_stall
from onbox.profiles.load import load
from onbox.profiles.schema import Profile

if TYPE_CHECKING:
    from controller.slurm.submit import SlurmAsk


@dataclasses.dataclass
class DeployRequest:
    """What the user asked `rgt deploy` for."""

    target: str
    command: List[str]
    job_file: Optional[str] = None
    profile: Optional[str] = None
    on_done: Optional[str] = None  # --on-done: one of the profile's [[meter.on_done]] names
    store: Optional[str] = None
    name: Optional[str] = None
    python: Optional[str] = None
    secret_env: Sequence[str] = ()
    outputs: Sequence[str] = ()  # --output: passed to `rgt-agent start`, added to the job file's
    offline: bool = False
    project: str = "."
    instance: Optional[str] = None  # --instance: the provider's id of the box, for rgt down
    # --profile slurm only (controller/slurm/submit.py checks them): the walltime, resources,
    # extra sbatch options and the seal time the warning is planned from.
    slurm_time: Optional[str] = None
    partition: Optional[str] = None
    gpus: Optional[str] = None
    cpus: Optional[int] = None
    mem: Optional[str] = None
    sbatch: Sequence[str] = ()
    seal_time: Optional[str] = None
    # A sweep's cells as one Slurm job array (controller/slurm/array.py): (array index, run
    # name, command, environment, outputs) each (controller/slurm/batch.py's Cell).
    cells: Sequence[Tuple[int, str, Sequence[str], Mapping[str, str], Sequence[str]]] = ()


def _read_toml(path: str) -> Dict[str, Any]:
    """The job file's document; OSError or ValueError when it cannot be read as TOML."""
    if sys.version_info >= (3, 11):
        import tomllib  # novermin
    else:  # pragma: no cover - older laptops
        import tomli as tomllib
    with open(path, "rb") as f:
        return tomllib.load(f)


def _job_name(req: DeployRequest, project: str) -> str:
    if req.name is not None:  # given empty is refused, never replaced by a default
        return check_name(req.name, "--name")
    if req.job_file:
        try:
            doc = _read_toml(req.job_file)
        except (OSError, ValueError) as e:
            raise UsageError("JOB.toml", f"cannot read {req.job_file}: {e}") from None
        if isinstance(doc.get("name"), str):
            return check_name(doc["name"], "name")
        cmd = doc.get("command")
        if isinstance(cmd, list) and cmd:
            return default_name([str(c) for c in cmd])
    return default_name(req.command)


def _check_job_file(req: DeployRequest) -> None:
    """Refuse a job file the box would refuse for its keys or values (a typo: ``comand``,
    ``[checkpoint] intervall``), checked here with the box's own parser, before the push and the
    install; what only the box can tell (its PATH, the workdir, the profile) is left to it."""
    if not req.job_file:
        return
    try:
        doc = _read_toml(req.job_file)
    except (OSError, ValueError):
        return  # _job_name has read it already
    check_settings(doc, flag_command=bool(req.command))
    meter_deadline(doc, Overrides())


def _check_store(req: DeployRequest) -> Tuple[Optional[str], Optional[str], Optional[float]]:
    """Refuse a malformed ``--store``, or ``store`` in the job file, as the box would (it would
    only after the push and the install). Returns the job file's store URL (None when it names
    none, or --store replaces it: the agent's install extras and the audit's disk check follow
    the URL), the endpoint the run's store is read at (the job file's ``endpoint_url``, which
    the box keeps for an s3:// ``--store`` too) and the job file's ``stall`` (None: not given).
    """
    setting: Any = None
    if req.job_file:
        try:
            setting = _read_toml(req.job_file).get("store")
        except (OSError, ValueError):
            pass  # _job_name has read it already; the box names what is wrong with it
    table = setting if isinstance(setting, dict) else {}
    stall = None if table.get("stall") is None else restore_stall(table)
    if req.store is not None:
        endpoint = table.get("endpoint_url")
        return None, store_override(req.store, endpoint, "store.endpoint_url").endpoint_url, stall
    store = None if setting is None else parse_store_setting(setting, "store")
    return (store.url, store.endpoint_url, stall) if store is not None else (None, None, stall)


def _run_store(
    flag: Optional[str], job_store: Optional[str], endpoint: Optional[str]
) -> Optional[StoreURL]:
    """The store the run will use, at its endpoint: ``--store``, else the job file's (a Slurm
    deploy measures the seal time its warning lead is planned from in this store, so a run
    that sealed there before gets its own lead, not the assumed one). None: neither names one
    (the profile's default is the box's to expand, and not the laptop's to read)."""
    if flag is not None:
        return store_at(flag, endpoint, "--store")
    return None if job_store is None else store_at(job_store, endpoint, "store")


def _secrets(names: Sequence[str], environ: Dict[str, str]) -> Dict[str, str]:
    out = {}
    for var in names:
        if not var.isidentifier():
            raise UsageError("--secret-env", f"{var!r} is not an environment variable name")
        if var not in environ:
            raise UsageError(
                "--secret-env",
                f"{var} is not set in this shell, so there is no value to send",
                f"export {var}=... first (its value travels on stdin only)",
            )
        out[var] = environ[var]
    return out


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a deploy was checked to do before anything anywhere changes."""

    req: DeployRequest
    target: Target
    guess: Optional[guessmod.Guess]  # None: to be guessed from the audit's markers
    project: str
    job_rel: Optional[str]  # the job file, relative to the project
    name: str
    secrets: Dict[str, str]
    dirs: Sequence[str] = ()  # the laptop's user profile directories
    job_store: Optional[str] = None  # the job file's store URL (it wins over the profile's)
    slurm: Optional[SlurmAsk] = None  # a Slurm profile's batch job, submitted instead of a start
    again: bool = False  # no job given: run ``name`` started again from the box's record
    # The endpoint and stall of the run's store (--store's or the job file's), from the job file
    store_endpoint: Optional[str] = None
    store_stall: Optional[float] = None
    # The profiles the box's markers choose among, while ``guess`` is None (guess.candidates)
    candidates: Sequence[Profile] = ()

    @property
    def profile(self) -> str:
        """The chosen profile's name ("" while it is still to be guessed)."""
        return self.guess.profile.name if self.guess is not None else ""


def check_again(profile: Profile) -> None:
    """Refuse a start by name alone on a Slurm profile: its batch job is written from the job
    file or command (controller/slurm/submit.py), which the laptop then does not have."""
    if profile.kind == "slurm":
        raise UsageError(
            "command",
            f"nothing to run: profile {profile.name} submits the job as a batch job, which "
            "needs the job file or command",
            "give the JOB.toml or `-- CMD ...` again",
        )


def check_on_done(profile: Profile, on_done: Optional[str]) -> None:
    """Refuse an ``--on-done`` the profile does not offer, naming the ones it does."""
    if on_done is None or profile.on_done(on_done) is not None:
        return
    offered = ", ".join(a.name for a in profile.meter.on_done)
    raise UsageError(
        "--on-done",
        f"profile {profile.name} offers no on-done action {on_done!r}",
        f"allowed: {offered}" if offered else "this profile offers none: leave --on-done out",
    )


def _profile(
    req: DeployRequest, target: Target, dirs: Sequence[str]
) -> Tuple[Optional[guessmod.Guess], List[Profile]]:
    """The profile asked for (checked against the target), or guessed from the host; None when
    only the box's markers can tell. With it the profiles it was guessed among (none when it was
    named, or is local's), which the markers' guess is then made among, read only once."""
    if req.profile is None:
        if target.kind == "local":
            return guessmod.chosen(target, dirs), []
        profiles = guessmod.candidates(dirs)
        return guessmod.by_host(target, profiles), profiles
    return named_profile(req.profile, target, dirs), []


def named_profile(name: str, target: Target, dirs: Sequence[str]) -> guessmod.Guess:
    """The profile ``name`` (UsageError naming the known ones), checked against ``target``."""
    profile = load(name, dirs)
    if (profile.name == "local") != (target.kind == "local"):
        raise UsageError(
            "--profile",
            f"profile {profile.name} does not fit target {target.label}",
            "the local target takes only the local profile, and local fits only it",
        )
    return guessmod.Guess(profile, "given with --profile")


def _slurm_ask(
    req: DeployRequest,
    guess: Optional[guessmod.Guess],
    name: str,
    job_rel: Optional[str],
    store: Optional[StoreURL],
) -> Optional[SlurmAsk]:
    """The Slurm flags checked (controller/slurm/submit.py ``check_ask``): the batch job asked
    for, None for a profile that is not Slurm's (or not chosen yet), which refuses the flags."""
    kind = guess.profile.kind if guess is not None else None
    flags = (req.slurm_time, req.partition, req.gpus, req.cpus, req.mem, req.seal_time)
    if kind != "slurm" and all(v is None for v in flags) and not req.sbatch:
        # Nothing to check (check_ask says None): its module, with the batch script's, is not
        # imported, since `rgt deploy` pays for every module it imports at its start.
        return None
    from controller.slurm.submit import check_ask

    return check_ask(
        kind=kind,
        time=req.slurm_time,
        partition=req.partition,
        gpus=req.gpus,
        cpus=req.cpus,
        mem=req.mem,
        sbatch=req.sbatch,
        seal_time=req.seal_time,
        run=name,
        store=store,
        grace=guess.profile.preemption.grace if guess is not None else 0.0,
        command=req.command,
        job_file=job_rel,
        cells=req.cells,
    )


def check_request(req: DeployRequest, environ: Dict[str, str]) -> Plan:
    """The request checked: UsageError for what the box would refuse, before it is touched."""
    target: Target = parse_target(req.target)
    dirs = profile_dirs()
    guess, candidates = _profile(req, target, dirs)
    if guess is not None:
        check_on_done(guess.profile, req.on_done)
    # No job at all, with --name: start run N again from the box's record of it
    # (controller/deploy/again.py); without a name there is nothing to run.
    again = not req.command and not req.job_file and not req.cells
    if again and req.name is None:
        raise UsageError(
            "command",
            "nothing to run",
            "give a JOB.toml or `-- CMD ...`, or --name N to start run N on the box again",
        )
    if again and guess is not None:
        check_again(guess.profile)
    project = os.path.abspath(req.project)
    job_rel = None
    if req.job_file:
        job_rel = os.path.relpath(os.path.abspath(req.job_file), project)
        if job_rel.startswith(".."):
            raise UsageError("JOB.toml", f"{req.job_file} is not inside the project {project}")
    try:  # a bad setting of the job file names the file, as the box's check does
        name = _job_name(req, project)
        _check_job_file(req)
        job_store, endpoint, stall = _check_store(req)
    except UsageError as e:
        raise naming_file(e, req.job_file) from None
    check_outputs(list(req.outputs), "--output")  # as the box would, before anything changes
    secrets = _secrets(req.secret_env, environ)
    slurm = _slurm_ask(req, guess, name, job_rel, _run_store(req.store, job_store, endpoint))
    if slurm is not None and secrets:
        # rgt keeps a run's secrets in a 0600 file on the box's local disk, never on a shared
        # mount; a cluster's $HOME (where the agent's run lives) is shared by every node.
        raise UsageError(
            "--secret-env",
            "a Slurm run lives on the cluster's shared filesystem, where rgt never keeps secrets",
            "put credentials where their tools read them on the cluster (~/.aws/credentials, "
            "~/.cache/huggingface/token, mode 0600), then deploy without --secret-env",
        )
    return Plan(
        req, target, guess, project, job_rel, name, secrets, dirs, job_store, slurm, again,
        store_endpoint=endpoint, store_stall=stall, candidates=candidates,
    )  # fmt: skip
