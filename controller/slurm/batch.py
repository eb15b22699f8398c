"""The batch script `rgt deploy --profile slurm` submits, and which side requeues a Slurm job.

``batch_script(...)`` returns the text of an sbatch script (``#!/bin/bash``, run by sbatch, not
a login shell) that runs ``rgt-agent run`` in the foreground: ``exec``'d, so the agent IS the
batch shell and gets ``#SBATCH --signal=B:USR2@LEAD`` (B: the batch shell only, never the job's
processes), with ``--requeue``, ``--open-mode=append`` (a requeued job appends to the same
output) and ``--output`` under ``output_dir``. The stable signature (keyword-only):

    batch_script(
        name,                 # the run's name (one run) or the sweep's (an array); --job-name
        agent_argv,           # the agent on the cluster: ["/home/u/.rgt/agent/venv/bin/rgt-agent"]
        release_dir,          # `cd` here before the exec (the pushed code)
        output_dir,           # --output DIR/slurm-%j.out (DIR/slurm-%A_%a.out for an array);
                              # the caller makes DIR before sbatch (Slurm does not)
        time_limit,           # sbatch --time: "30", "1:30:00", "2-00:00:00" (minutes resolution)
        lead,                 # seconds of warning: SealTime.lead(assumed, slack=60); < time_limit
        command=(),           # the job's argv (one run)
        store=None,           # --store URL
        job_file=None,        # a JOB.toml path on the cluster (relative to release_dir or absolute)
        env=None,             # exported before the exec: RGT_HOME and the agent's own variables
        agent_args=(),        # more `rgt-agent run` flags: ["--grace", "45", "--output", "out"]
        profile="slurm",
        partition=None, gpus=None, cpus_per_task=None, mem=None,
        extra=(),             # more #SBATCH options, each one "--opt" or "--opt=value"
        cells=None,           # an array: [(index, run name, argv, env, outputs), ...]
        array_limit=None,     # at most this many cells at once (--array=...%N)
    ) -> str

With ``cells``, ``command`` must be empty: the script is a job array (``--array`` of the cells'
indices) and a ``case "$SLURM_ARRAY_TASK_ID" in`` has one ``exec`` per cell, each its own run
(``--name`` the cell's name, its argv after ``--``, its env exported in its branch only).

Quoting: every shell word is ``shlex.quote``d. ``#SBATCH`` lines are parsed by sbatch itself,
not by a shell (it splits at blanks, strips double quotes, takes ``\\`` as an escape and ``#`` as
the start of a comment), so their values are checked instead: only characters that mean nothing
to that parser, else a UsageError naming the field. The agent learns the lead from
``RGT_SLURM_LEAD`` (onbox/agent/slurm.py: its own timer fires if the signal comes late).

``requeue_side(command, workdir)`` says in a sentence which side requeues (rgt, always) and, when
the job uses Lightning, why Lightning's own SLURM auto-requeue stays idle. ``check_trigger`` and
``check_lead`` are the refusals the laptop makes before anything is submitted.
"""

from __future__ import annotations

import re
import shlex
from typing import Mapping, Optional, Sequence, Tuple

from onbox.agent.slurm import LEAD_VAR, check_trigger, uses_lightning
from onbox.common.errors import UsageError
from onbox.common.rundir import check_name

__all__ = ["Cell", "batch_script", "check_lead", "check_trigger", "requeue_side", "time_seconds"]

# One array cell: (array index, run name, the job's argv, variables for that cell only).
# (array index, run name, argv, environment, outputs): each cell's outputs are its own paths
# (`rgt-agent run --output`), so no two cells share one.
Cell = Tuple[int, str, Sequence[str], Mapping[str, str], Sequence[str]]

MAX_LEAD = 65535  # sbatch: sig_time is 0..65535 seconds
# What an #SBATCH value may hold: nothing sbatch's own line parser (blanks, '"', '\', '#')
# or a reader of the script would take apart.
_SAFE_VALUE = re.compile(r"[A-Za-z0-9._/:=,+@%-]+")
_SAFE_PATH = re.compile(r"/[A-Za-z0-9._/+-]*")
_OPTION = re.compile(r"--[a-z][a-z0-9-]*(=[A-Za-z0-9._/:=,+@%-]+)?")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Options this script owns: a second value would change what rgt relies on.
_OWNED = (
    "--signal",
    "--requeue",
    "--no-requeue",
    "--output",
    "--error",
    "--open-mode",
    "--job-name",
    "--time",
    "--array",
    "--wrap",
    "--partition",
    "--gpus",
    "--cpus-per-task",
    "--mem",
)
_TIME = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?")


def time_seconds(value: str, field: str = "--time") -> int:
    """Seconds of an sbatch ``--time`` value (``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``,
    ``D-H:M:S``); UsageError for anything else, zero, or an unlimited one (the warning needs an
    end)."""
    m = _TIME.fullmatch(value.strip()) if isinstance(value, str) else None
    if m is None:
        raise UsageError(
            field,
            f"{value!r} is not a Slurm time limit",
            "e.g. --time 30 (minutes), 4:00:00, or 2-00:00:00; rgt needs a finite one",
        )
    days, a, b, c = m.groups()
    nums = [int(x) for x in (a, b, c) if x is not None]
    if days is not None:  # D-H, D-H:M, D-H:M:S
        h, mi, s = (nums + [0, 0])[:3]
        secs = ((int(days) * 24 + h) * 60 + mi) * 60 + s
    elif len(nums) == 1:  # minutes
        secs = nums[0] * 60
    elif len(nums) == 2:  # minutes:seconds
        secs = nums[0] * 60 + nums[1]
    else:  # hours:minutes:seconds
        secs = (nums[0] * 60 + nums[1]) * 60 + nums[2]
    if secs <= 0:
        raise UsageError(field, f"{value!r} is no time at all", "give a time limit > 0")
    return secs


def check_lead(lead: int, time_limit: str) -> int:
    """The warning lead, checked against the time limit: UsageError naming --time when the
    warning would come before the job could even start."""
    limit = time_seconds(time_limit)
    if not isinstance(lead, int) or isinstance(lead, bool) or lead < 1 or lead > MAX_LEAD:
        raise UsageError(
            "lead",
            f"{lead!r} is not a warning lead in seconds (1..{MAX_LEAD})",
            "derive it from the run's seal time (SealTime.lead)",
        )
    if lead >= limit:
        raise UsageError(
            "--time",
            f"{time_limit} ({limit} s) leaves no time to train: the seal needs a {lead} s "
            "warning before the limit (twice the measured seal time plus Slurm's 60 s)",
            f"ask for a longer --time (more than {lead} s), or make checkpoints faster to seal",
        )
    return lead


def _value(field: str, value: object) -> str:
    text = str(value)
    if not _SAFE_VALUE.fullmatch(text):
        raise UsageError(
            field,
            f"{text!r} has a character an #SBATCH line cannot hold safely",
            "use letters, digits and . _ / : = , + @ - only",
        )
    return text


def _path(field: str, value: str) -> str:
    if not isinstance(value, str) or not _SAFE_PATH.fullmatch(value) or "/../" in value + "/":
        raise UsageError(
            field,
            f"{value!r} must be an absolute path of letters, digits and . _ / + - "
            "(sbatch reads it from an #SBATCH line, and expands '%')",
            "pick a directory without blanks, quotes, '%' or '#'",
        )
    return value.rstrip("/") or "/"


def _extra(items: Sequence[str]) -> Sequence[str]:
    out = []
    for item in items:
        if not isinstance(item, str) or not _OPTION.fullmatch(item):
            raise UsageError(
                "--sbatch",
                f"{item!r} is not one long option for an #SBATCH line",
                "give --opt or --opt=value (letters, digits, . _ / : = , + @ - %)",
            )
        if item.split("=", 1)[0] in _OWNED:
            raise UsageError(
                "--sbatch",
                f"{item.split('=', 1)[0]} is set by rgt's batch script",
                "use rgt's own flag for it (--time, --partition, --gpus, ...); rgt sets the "
                "signal, requeue, output and job name itself",
            )
        out.append(item)
    return out


def _exports(env: Optional[Mapping[str, str]], indent: str = "") -> Sequence[str]:
    lines = []
    for k, v in sorted((env or {}).items()):
        if not _ENV_NAME.fullmatch(k):
            raise UsageError("env", f"{k!r} is not a variable name", "letters, digits and _")
        if not isinstance(v, str) or "\0" in v:
            raise UsageError("env", f"the value of {k} is not text", "give a string")
        lines.append(f"{indent}export {k}={shlex.quote(v)}")
    return lines


def _exec(
    agent_argv: Sequence[str],
    name: str,
    profile: str,
    store: Optional[str],
    job_file: Optional[str],
    agent_args: Sequence[str],
    command: Sequence[str],
) -> str:
    argv = [*agent_argv, "run", "--name", name, "--profile", profile]
    if store:
        argv += ["--store", store]
    argv += list(agent_args)
    if job_file:
        argv.append(job_file)
    if command:
        argv += ["--", *command]
    for word in argv:
        if not isinstance(word, str) or "\0" in word:
            raise UsageError("command", f"{word!r} is not an argument", "give strings")
    return "exec " + " ".join(shlex.quote(w) for w in argv)


def _header(
    name: str,
    time_limit: str,
    lead: int,
    out: str,
    partition: Optional[str],
    gpus: Optional[str],
    cpus_per_task: Optional[int],
    mem: Optional[str],
    extra: Sequence[str],
) -> Sequence[str]:
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={_value('--job-name', name)}",
        f"#SBATCH --time={_value('--time', time_limit)}",
        f"#SBATCH --signal=B:USR2@{lead}",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        f"#SBATCH --output={out}",
    ]
    if partition:
        lines.append(f"#SBATCH --partition={_value('--partition', partition)}")
    if gpus:
        lines.append(f"#SBATCH --gpus={_value('--gpus', gpus)}")
    if cpus_per_task is not None:
        if (
            not isinstance(cpus_per_task, int)
            or isinstance(cpus_per_task, bool)
            or cpus_per_task < 1
        ):
            raise UsageError("--cpus-per-task", f"{cpus_per_task!r} is not a count", "e.g. 8")
        lines.append(f"#SBATCH --cpus-per-task={cpus_per_task}")
    if mem:
        lines.append(f"#SBATCH --mem={_value('--mem', mem)}")
    lines += [f"#SBATCH {item}" for item in _extra(extra)]
    return lines


def batch_script(
    *,
    name: str,
    agent_argv: Sequence[str],
    release_dir: str,
    output_dir: str,
    time_limit: str,
    lead: int,
    command: Sequence[str] = (),
    store: Optional[str] = None,
    job_file: Optional[str] = None,
    env: Optional[Mapping[str, str]] = None,
    agent_args: Sequence[str] = (),
    profile: str = "slurm",
    partition: Optional[str] = None,
    gpus: Optional[str] = None,
    cpus_per_task: Optional[int] = None,
    mem: Optional[str] = None,
    extra: Sequence[str] = (),
    cells: Optional[Sequence[Cell]] = None,
    array_limit: Optional[int] = None,
) -> str:
    """The sbatch script's text (see the module's docstring); UsageError before anything is
    written when a value cannot go into it safely."""
    check_name(name, "--name")
    check_lead(lead, time_limit)
    if not agent_argv:
        raise UsageError("agent", "no rgt-agent command", "give the agent's path on the cluster")
    out_dir = _path("output dir", output_dir)
    release = _path("release dir", release_dir)
    if cells is not None and command:
        raise UsageError("command", "a job array's cells carry their own argv", "give one")
    if cells is None and not command and not job_file:
        raise UsageError("command", "is empty", "give the job after --, or a job file")
    exports = _exports({**(env or {}), LEAD_VAR: str(lead)})
    pattern = "slurm-%A_%a.out" if cells is not None else "slurm-%j.out"
    lines = list(
        _header(
            name,
            time_limit,
            lead,
            f"{out_dir}/{pattern}",
            partition,
            gpus,
            cpus_per_task,
            mem,
            extra,
        )
    )
    body = [
        "# Written by rgt (controller/slurm/batch.py). The agent is exec'd: it is the batch",
        "# shell, so the B:USR2 warning reaches it; it seals, then requeues this job itself.",
        "# A warning before the agent's handler is in place must not end the job (bash's",
        "# default for USR2): ignored until then (the agent's own timer covers a lost one).",
        "trap '' USR2",
        *exports,
        f"cd -- {shlex.quote(release)} || exit 1",
    ]
    if cells is None:
        body.append(_exec(agent_argv, name, profile, store, job_file, agent_args, command))
        return "\n".join([*lines, *body]) + "\n"
    lines.append(f"#SBATCH --array={_array_spec(cells, array_limit)}")
    body.append('case "$SLURM_ARRAY_TASK_ID" in')
    for index, cell_name, argv, cell_env, outputs in cells:
        check_name(cell_name, "cell name")
        if not argv and not job_file:
            raise UsageError("cells", f"cell {cell_name} has no command", "give its argv")
        body.append(f"  {index})")
        body += _exports(cell_env, "    ")
        args = [*agent_args, *(w for o in outputs for w in ("--output", o))]
        exe = _exec(agent_argv, cell_name, profile, store, job_file, args, argv)
        body += [f"    {exe}", "    ;;"]
    body += [
        "  *)",
        '    echo "rgt: this job array has no cell $SLURM_ARRAY_TASK_ID" >&2',
        "    exit 2",
        "    ;;",
        "esac",
    ]
    return "\n".join([*lines, *body]) + "\n"


def _array_spec(cells: Sequence[Cell], limit: Optional[int]) -> str:
    indices = [c[0] for c in cells]
    if not indices:
        raise UsageError("cells", "a job array needs at least one cell", "give the cells")
    if any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in indices):
        raise UsageError("cells", "array indices are whole numbers >= 0", "number them 0..N-1")
    if len(set(indices)) != len(indices):
        raise UsageError("cells", "two cells have the same array index", "number them 0..N-1")
    spec = ",".join(str(i) for i in sorted(indices))
    if limit is not None:
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise UsageError("array limit", f"{limit!r} is not a count >= 1", "e.g. 4")
        spec += f"%{limit}"
    return spec


def requeue_side(command: Sequence[str], workdir: str) -> str:
    """In a sentence, who requeues this job under Slurm: rgt, always; and when the job uses
    Lightning (its entry script imports lightning or pytorch_lightning), why Lightning's own
    SLURMEnvironment auto-requeue stays idle."""
    base = (
        "rgt requeues this job: on Slurm's USR2 warning (or its own timer) the agent asks the "
        "job for a checkpoint, seals it, then runs `scontrol requeue`; the requeued job "
        "restores from the store and continues"
    )
    script = uses_lightning(command, workdir)
    if script is None:
        return base + "."
    return (
        f"{base}. {script} uses Lightning: its SLURMEnvironment auto-requeue (on SIGUSR1) never "
        "triggers, because rgt asks Slurm for no SIGUSR1 and installs no handler on it; do not "
        "add --signal=SIGUSR1 yourself, or both would requeue the job."
    )
