"""`rgt deploy --profile slurm LOGIN_NODE`: the Slurm flags checked before anything changes,
and, in place of ``rgt-agent start``, the batch job submitted through the login node.

The deploy's earlier steps are the usual ones (audit, release, agent install on the login node:
a cluster's login and compute nodes share the filesystem). Then, in one command on the login
node (``_SUBMIT``), under a lock in the run's directory: the user's live jobs named for the run
are looked up (one writer: a run whose job is queued or running is never submitted twice, from
this laptop or another), the batch script (controller/slurm/batch.py) is put in the run's
directory atomically from stdin, and ``sbatch --parsable`` submits it. The user's resource flags
travel as sbatch's own arguments ("$@", never text of the script); rgt's own (the warning signal,
requeue, output, job name) are the script's and refused in ``--sbatch``.

The warning lead comes from the run's seal time (controller/sealbudget.py), never a constant:
``lead(assumed=<the profile's grace>, slack=SLACK)``; the deploy says where it came from, and
says loudly when nothing was measured.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from controller import sealbudget
from controller.registry import Registry, RunRecord
from controller.remote import Remote
from controller.slurm import batch, queue
from controller.slurm.queue import job_ref
from onbox.common.errors import HostError, LockedError, RemoteUnreachable, UsageError
from onbox.common.rundir import RunDir
from onbox.common.sealtime import SealTime

SLACK = 60  # seconds: slurmctld checks signal deadlines about every 30 s, and may be late
SCRIPT = "slurm-batch.sh"
SBATCH_TIMEOUT = 120
# Options rgt sets itself (the script's, or a flag of its own): refused in --sbatch.
OWNED = {
    "signal": "rgt sets it from the measured seal time (--seal-time to give one)",
    "requeue": "rgt's batch script requeues itself",
    "no-requeue": "rgt's batch script requeues itself",
    "open-mode": "rgt appends every attempt to one output file",
    "output": "the output goes under the run's directory (rgt logs N)",
    "error": "the output goes under the run's directory (rgt logs N)",
    "job-name": "rgt finds the run's job by its name",
    "array": "job arrays are rgt sweep's",
    "wrap": "rgt submits its own batch script",
    "parsable": "rgt reads the job id itself",
    "time": "use rgt's --time",
    "partition": "use rgt's --partition",
    "gpus": "use rgt's --gpus",
    "cpus-per-task": "use rgt's --cpus",
    "mem": "use rgt's --mem",
    "chdir": "the job runs in its release directory",
    "signal-time": "rgt sets the warning from the measured seal time",
    "export": "the agent gives the job its environment",
    "wait": "rgt deploy returns once the job is submitted",
}
_OPT = re.compile(r"--([a-z][a-z0-9-]{0,40})(?:=(.{1,512}))?\Z", re.S)

Say = Callable[[str], None]


@dataclasses.dataclass(frozen=True)
class SlurmAsk:
    """What the user asked Slurm for, checked."""

    time: str  # as given (sbatch's format)
    walltime: int  # the same, in seconds
    partition: Optional[str] = None
    gpus: Optional[str] = None
    cpus: Optional[int] = None
    mem: Optional[str] = None
    sbatch: Tuple[str, ...] = ()
    seal_time: Optional[str] = None

    def sbatch_args(self, job_name: str) -> List[str]:
        """sbatch's arguments for these resources (before the script's path)."""
        args = [f"--job-name={job_name}", f"--time={self.time}"]
        if self.partition:
            args.append(f"--partition={self.partition}")
        if self.gpus:
            args.append(f"--gpus={self.gpus}")
        if self.cpus:
            args.append(f"--cpus-per-task={self.cpus}")
        if self.mem:
            args.append(f"--mem={self.mem}")
        return [*args, *self.sbatch]


def _word(value: Optional[str], field: str, pattern: str, example: str) -> Optional[str]:
    if value is None:
        return None
    if not re.fullmatch(pattern, value):
        raise UsageError(field, f"{value!r} is not one Slurm accepts here", f"e.g. {example}")
    return value


def check_sbatch(opts: Sequence[str]) -> Tuple[str, ...]:
    """Each ``--sbatch "--opt=value"``: one long option, no control characters, none of the
    options rgt sets itself."""
    out = []
    for opt in opts:
        m = _OPT.match(opt)
        if not m or any(not c.isprintable() for c in opt):
            raise UsageError(
                "--sbatch",
                f"{opt!r} is not one long sbatch option",
                'give one per --sbatch, as --name or --name=value, e.g. --sbatch "--qos=low"',
            )
        why = OWNED.get(m.group(1))
        if why is not None:
            raise UsageError("--sbatch", f"--{m.group(1)} is rgt's to set", why)
        out.append(opt)
    return tuple(out)


def check_ask(
    *,
    kind: Optional[str],
    time: Optional[str],
    partition: Optional[str] = None,
    gpus: Optional[str] = None,
    cpus: Optional[int] = None,
    mem: Optional[str] = None,
    sbatch: Sequence[str] = (),
    seal_time: Optional[str] = None,
) -> Optional[SlurmAsk]:
    """The Slurm flags for a profile of ``kind`` (None: not chosen yet), checked; None for a
    profile that is not Slurm's (whose deploy refuses them)."""
    given = [
        f
        for f, v in (
            ("--time", time),
            ("--partition", partition),
            ("--gpus", gpus),
            ("--cpus", cpus),
            ("--mem", mem),
            ("--sbatch", list(sbatch) or None),
            ("--seal-time", seal_time),
        )
        if v is not None
    ]
    if kind != "slurm":
        if given:
            raise UsageError(
                given[0], "is a Slurm flag", "deploy with --profile slurm to a login node"
            )
        return None
    if time is None:
        raise UsageError(
            "--time",
            "is required with --profile slurm",
            "give the job's walltime as sbatch takes it (e.g. --time 4:00:00): rgt plans the "
            "warning before the limit against it",
        )
    if cpus is not None and not 1 <= cpus <= 100000:
        raise UsageError("--cpus", f"{cpus} is not a number of CPUs", "e.g. --cpus 8")
    if seal_time is not None:
        sealbudget.given(seal_time)  # refuses 0, negatives, words
    return SlurmAsk(
        time=time,
        walltime=queue.parse_walltime(time),
        partition=_word(partition, "--partition", r"[A-Za-z0-9_.,-]{1,128}", "--partition gpu"),
        gpus=_word(gpus, "--gpus", r"[A-Za-z0-9_.:,-]{1,128}", "--gpus 2 or --gpus a100:2"),
        cpus=cpus,
        mem=_word(mem, "--mem", r"[0-9]{1,9}[KMGT]?", "--mem 32G"),
        sbatch=check_sbatch(sbatch),
        seal_time=seal_time,
    )


def job_name(run: str) -> str:
    """The Slurm job name of run ``run`` (how a later deploy finds its live job)."""
    return f"rgt-{run}"


def lead_line(st: SealTime, lead: int, assumed: float, walltime: int) -> str:
    """What the deploy says about the warning: the lead and where it came from."""
    if st.seconds is None:
        head = (
            f"rgt: Slurm signals USR2 {lead} s before the limit. NOT MEASURED: assumed "
            f"{assumed:.0f} s per seal ({st.source}); run `rgt smoke` or a first run, then "
            "deploy again"
        )
    else:
        head = (
            f"rgt: Slurm signals USR2 {lead} s before the limit: 2 x the measured "
            f"{st.seconds:.0f} s seal + {SLACK} s slack ({st.source})"
        )
    if lead >= walltime:
        head += (
            f". WARNING: that is not shorter than --time ({walltime} s): each allocation is "
            "warned as soon as Slurm next looks (about 30 s), so the job gets little done per "
            "allocation; ask for a longer --time"
        )
    return head


def lead_for(ask: SlurmAsk, store: Optional[str], run: str, grace: float) -> Tuple[int, str]:
    """The warning lead in seconds and the line that explains it."""
    st = sealbudget.seal_time(ask.seal_time, store, run)
    lead = st.lead(assumed=grace, slack=SLACK)
    return lead, lead_line(st, lead, grace, ask.walltime)


# Under a lock in the run's directory ($1): refuse (45) when one of the user's jobs named $3 is
# live, else put stdin at $1/$2 atomically and sbatch it with the rest of the arguments.
_SUBMIT = r"""
umask 077
d=$1; f=$2; jn=$3; shift 3
mkdir -p "$d" || exit 9
if command -v flock >/dev/null 2>&1; then
  exec 9>"$d/.submit.lock" && flock -w 60 9 || { echo "the submit lock is held" >&2; exit 46; }
fi
live=$(squeue -h -u "$(id -un)" -n "$jn" -o "%i %T" 2>&1) || { printf '%s\n' "$live" >&2; exit 47; }
if [ -n "$live" ]; then printf '%s\n' "$live" | head -c 4096; exit 45; fi
cat >"$d/.$f.part.$$" && chmod 700 "$d/.$f.part.$$" && mv -f "$d/.$f.part.$$" "$d/$f" || exit 9
exec sbatch --parsable "$@" "$d/$f"
"""


def parse_job_id(text: str) -> Optional[str]:
    """The job id of ``sbatch --parsable`` (``ID`` or ``ID;CLUSTER``), None when not one."""
    lines = [x for x in text.strip().splitlines() if x.strip()]
    if not lines:
        return None
    m = re.fullmatch(r"([0-9]{1,12})(;[A-Za-z0-9_.-]{1,64})?", lines[-1].strip())
    return m.group(1) if m else None


def sbatch(
    remote: Remote,
    run_dir: RunDir,
    script: str,
    sbatch_args: Sequence[str],
    name: str,
) -> str:
    """Put ``script`` in the run's directory and submit it; the job id. LockedError when the
    run has a live job already (nothing submitted)."""
    label = remote.target.label
    r = remote.sh(
        _SUBMIT,
        run_dir.path,
        SCRIPT,
        job_name(name),
        *sbatch_args,
        input=script.encode(),
        timeout=SBATCH_TIMEOUT,
    )
    if r.rc == 45:
        live = queue.parse_live(r.text)
        raise LockedError(
            f"run {name} has a live Slurm job on {label} already ({', '.join(live) or '?'})",
            f"`rgt status {name}`; `rgt stop {name}` first to submit it again",
        )
    if r.rc != 0:
        raise HostError(
            f"{label}: sbatch failed (exit {r.rc}): {queue.clean((r.err or r.text).strip())}",
            "check the --partition, --gpus, --mem and --sbatch values against the cluster's "
            "limits (sinfo, scontrol show partition)",
        )
    job = parse_job_id(r.text)
    if job is None:
        raise HostError(f"{label}: sbatch printed no job id: {queue.clean(r.text[-300:])!r}")
    return job


def scheduler_doc(ask: SlurmAsk, job: str, lead: int, **more: Any) -> Dict[str, Any]:
    """The run record's ``scheduler`` for a Slurm job."""
    return {
        "kind": "slurm",
        "job": job,
        "time": ask.time,
        "walltime": ask.walltime,
        "lead": lead,
        "script": SCRIPT,
        **more,
    }


def unsure(e: RemoteUnreachable, name: str) -> RemoteUnreachable:
    """The link went during sbatch: the job may well be queued."""
    return RemoteUnreachable(
        f"{e.what} (while submitting: the job of {name} may be queued)",
        f"`rgt status {name}` shows it; a deploy again finds it by name and submits no second",
    )


def submit_run(
    remote: Remote,
    registry: Registry,
    rec: RunRecord,
    ask: SlurmAsk,
    grace: float,
    store: Optional[str],
    agent_args: Sequence[str],
    prev: Optional[RunRecord],
    say: Say,
) -> RunRecord:
    """Submit the run's batch job (in place of ``rgt-agent start``: ``agent_args`` are
    ``rgt-agent run``'s) and record it; a run whose job is live already is left alone (this
    laptop's record of that job, same release) or refused (LockedError), never submitted
    twice. ``grace``: the profile's, the seal time assumed when none was measured."""
    lead, line = lead_for(ask, store, rec.name, grace)
    say(line)
    rd = RunDir(rec.name, rec.box_home)
    script = _script(rec, rd, agent_args, lead)
    args = [f"--chdir={rec.workdir or rec.box_home}", *ask.sbatch_args(job_name(rec.name))]
    try:
        job = sbatch(remote, rd, script, args, rec.name)
    except LockedError:
        known = (prev.scheduler if prev is not None else {}).get("job")
        if prev is None or prev.release != rec.release or not known:
            raise
        if job_ref(prev.scheduler) not in queue.live_jobs(remote, job_name(rec.name)):
            raise
        registry.put(prev)
        _switch(remote, prev)
        say(f"rgt: {rec.name} is already queued or running as Slurm job {known}; nothing to do")
        return prev
    except RemoteUnreachable as e:
        registry.put(rec)  # so that `rgt status` finds the run; the next deploy finds its job
        raise unsure(e, rec.name) from None
    rec = dataclasses.replace(rec, scheduler=scheduler_doc(ask, job, lead))
    registry.put(rec)
    _switch(remote, rec)
    say(f"rgt: submitted {rec.name} as Slurm job {job} ({' '.join(args[1:])})")
    say(
        f"rgt: the agent requeues the job when it is warned or preempted; follow it with "
        f"`rgt status {rec.name}`, `rgt logs {rec.name} -f`; `rgt stop {rec.name}` ends it"
    )
    return rec


def _switch(remote: Remote, rec: RunRecord) -> None:
    """deploys/NAME/current to the run's release, as after a start."""
    from controller.deploy.release import switch_current

    if rec.release:
        switch_current(remote, rec.box_home, rec.name, rec.release)


def _script(rec: RunRecord, rd: RunDir, agent_args: Sequence[str], lead: int) -> str:
    """The batch script (controller/slurm/batch.py's; INTERIM until it lands)."""
    make = getattr(batch, "batch_script", None)
    if make is not None:
        return str(
            make(name=rec.name, agent=rec.agent_argv(*agent_args), run_dir=rd.path, lead=lead)
        )
    from controller.remote import quote_argv

    return (
        "#!/bin/sh\n"
        f"#SBATCH --signal=B:USR2@{lead}\n"
        "#SBATCH --requeue\n"
        "#SBATCH --open-mode=append\n"
        f"#SBATCH --output={rd.path}/slurm-%j.out\n"
        f"exec {quote_argv(rec.agent_argv(*agent_args))}\n"
    )
