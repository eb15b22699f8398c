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
says loudly when nothing was measured. A job array's one lead is every task's: the slowest seal
measured over its cells' runs.
"""

from __future__ import annotations

import dataclasses
import posixpath
import re
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

from controller import sealbudget
from controller.registry import Registry, RunRecord
from controller.remote import Remote
from controller.slurm import batch, queue
from controller.slurm.queue import job_ref
from controller.target import Target
from onbox.common import jobenv
from onbox.common.errors import HostError, LockedError, RemoteUnreachable, RgtError, UsageError
from onbox.common.rundir import RunDir
from onbox.common.sealtime import SealTime
from onbox.common.storeurl import StoreURL

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
    """What the batch job was asked to be, checked: the walltime and resources, extra sbatch
    options, the warning lead (and where it came from), and what it runs: the job's command,
    or a sweep's cells (controller/slurm/batch.py's Cell: index, run name, argv, env)."""

    time: str  # as given (sbatch's format)
    walltime: int  # the same, in seconds
    partition: Optional[str] = None
    gpus: Optional[str] = None
    cpus: Optional[int] = None
    mem: Optional[str] = None
    sbatch: Tuple[str, ...] = ()
    seal_time: Optional[str] = None
    lead: int = 0  # seconds of warning before the limit
    lead_line: str = ""  # the lead, and where it came from, in words
    command: Tuple[str, ...] = ()
    cells: Tuple[batch.Cell, ...] = ()

    def script(
        self, rec: RunRecord, output_dir: str, opts: Sequence[str], job_file: Optional[str]
    ) -> str:
        """The batch script for ``rec``'s run (``opts``: more ``rgt-agent run`` flags)."""
        return batch.batch_script(
            name=rec.name,
            agent_argv=rec.agent or ["rgt-agent"],
            release_dir=rec.workdir or output_dir,
            output_dir=output_dir,
            time_limit=self.time,
            lead=self.lead,
            command=self.command,
            job_file=job_file,
            env={jobenv.HOME: rec.box_home or "/", **rec.agent_env},
            agent_args=opts,
            partition=self.partition,
            gpus=self.gpus,
            cpus_per_task=self.cpus,
            mem=self.mem,
            extra=self.sbatch,
            cells=list(self.cells) if self.cells else None,
        )


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
    run: str = "run",
    store: Union[str, StoreURL, None] = None,
    grace: float = 30.0,
    command: Sequence[str] = (),
    job_file: Optional[str] = None,
    cells: Sequence[batch.Cell] = (),
) -> Optional[SlurmAsk]:
    """The Slurm flags for a profile of ``kind`` (None: not chosen yet), checked, with the
    warning lead planned (the run's seal time from ``--seal-time`` or ``store``, else
    ``grace`` assumed); None for a profile that is not Slurm's (whose deploy refuses them).
    The batch script is written here once, so that every value it cannot hold is refused
    before anything on the cluster changes."""
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
    ask = SlurmAsk(
        time=time,
        walltime=queue.parse_walltime(time),
        partition=_word(partition, "--partition", r"[A-Za-z0-9_.,-]{1,128}", "--partition gpu"),
        gpus=_word(gpus, "--gpus", r"[A-Za-z0-9_.:,-]{1,128}", "--gpus 2 or --gpus a100:2"),
        cpus=cpus,
        mem=_word(mem, "--mem", r"[0-9]{1,9}[KMGT]?", "--mem 32G"),
        sbatch=check_sbatch(sbatch),
        seal_time=seal_time,
        command=tuple(command),
        cells=tuple(cells),
    )
    # One --signal lead for every task of an array: the slowest cell's seal is what it must fit.
    lead, line = lead_for(ask, store, [c[1] for c in cells] or [run], grace)
    ask = dataclasses.replace(ask, lead=lead, lead_line=line)
    # The script with stand-in paths: its own checks (the lead against --time, each #SBATCH
    # value) refuse here what it would refuse after the push.
    stand_in = RunRecord(name=run, target=Target("local"), agent=["rgt-agent"], box_home="/")
    ask.script(stand_in, "/", [], job_file)
    return ask


def job_name(run: str) -> str:
    """The Slurm job name of run ``run`` (how a later deploy finds its live job): the run's
    (or the sweep's) own name, as the batch script sets it."""
    return run


def lead_line(st: SealTime, lead: int, assumed: float) -> str:
    """What the deploy says about the warning: the lead and where it came from."""
    if st.seconds is None:
        head = (
            f"rgt: Slurm signals USR2 {lead} s before the limit. NOT MEASURED: assumed "
            f"{assumed:.0f} s per seal ({st.source}); run `rgt smoke` or a first run, then "
            "deploy again"
        )
    else:
        how = "given" if st.source.startswith("given") else "measured"
        head = (
            f"rgt: Slurm signals USR2 {lead} s before the limit: 2 x the {how} "
            f"{st.seconds:.0f} s seal + {SLACK} s slack ({st.source})"
        )
    return head


def lead_for(
    ask: SlurmAsk, store: Union[str, StoreURL, None], runs: Sequence[str], grace: float
) -> Tuple[int, str]:
    """The warning lead in seconds and the line that explains it: from the longest seal
    measured over ``runs`` (the run, or an array's cells)."""
    st = sealbudget.seal_time_over(ask.seal_time, store, runs)
    lead = st.lead(assumed=grace, slack=SLACK)
    return lead, lead_line(st, lead, grace)


# Under a lock in the run's directory ($1): refuse (45) when one of the user's jobs named $3 is
# live, else remove the staged secrets stdin names first (a count line, then one path a line:
# those a cut-off deploy left for the job's agents to claim; 48 and the index of the one that
# stays, when one does), put the rest of stdin at $1/$2 atomically and sbatch it with the rest
# of the arguments. The paths travel on stdin, not as arguments: an array of 10,000 cells would
# pass the length a command line may have. `read` takes one line of a pipe, no byte more.
_STALE_KEPT = 48
_SUBMIT = r"""
umask 077
d=$1; f=$2; jn=$3; shift 3
mkdir -p "$d" || exit 9
if command -v flock >/dev/null 2>&1; then
  exec 9>"$d/.submit.lock" && flock -w 60 9 || { echo "the submit lock is held" >&2; exit 46; }
fi
live=$(squeue -h -u "$(id -un)" -n "$jn" -o "%i %T" 2>&1) || { printf '%s\n' "$live" >&2; exit 47; }
if [ -n "$live" ]; then printf '%s\n' "$live" | head -c 4096; exit 45; fi
IFS= read -r n || exit 9
i=0
while [ "$i" -lt "$n" ]; do
  IFS= read -r s || exit 9
  if [ -e "$s" ] || [ -L "$s" ]; then rm -f -- "$s" || { echo "$i"; exit 48; }; fi
  i=$((i + 1))
done
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
    stale: Sequence[str] = (),
    refused: Callable[[], None] = lambda: None,
) -> str:
    """Put ``script`` in the run's directory and submit it; the job id. LockedError when the
    run has a live job already (nothing submitted). ``stale``: staged secrets a cut-off deploy
    left (``RunDir.staged_secrets_file`` of the run, or of each cell of an array), removed
    first in the same command (HostError, nothing submitted, when one cannot be).
    ``refused``: called before the error of a submit that submitted nothing is raised (not a
    live job's LockedError: the caller's to judge)."""
    label = remote.target.label
    if any("\n" in path for path in stale):  # one a line on stdin; a run name holds none
        raise UsageError("box_home", f"{stale[0]!r}: a path with a newline", "choose another")
    head = "".join(f"{path}\n" for path in [str(len(stale)), *stale])
    r = remote.sh(
        _SUBMIT,
        run_dir.path,
        SCRIPT,
        job_name(name),
        *sbatch_args,
        input=head.encode("utf-8", "surrogateescape") + script.encode(),
        timeout=SBATCH_TIMEOUT,
    )
    if r.rc == 45:
        live = queue.parse_live(r.text)
        raise LockedError(
            f"run {name} has a live Slurm job on {label} already ({', '.join(live) or '?'})",
            f"`rgt status {name}`; `rgt stop {name}` first to submit it again",
        )
    if 0 < r.rc < 128:  # sbatch, or the command before it, refused: no job (not one killed)
        refused()
    if r.rc == _STALE_KEPT and stale:
        said = r.text.strip()  # the index of the one kept: digits, else the box's noise
        ok = said.isascii() and said.isdigit() and len(said) < 7 and int(said) < len(stale)
        kept = stale[int(said)] if ok else stale[0]
        owner = posixpath.basename(kept)[1 : -len(".staged")] or name
        raise HostError(
            f"cannot remove {kept} on {label}: secrets a deploy cut off before its submit left "
            f"for run {owner}, which this job must not take; nothing was submitted",
            "check the owner and permissions of the box's rgt secrets directory, then run the "
            "same `rgt deploy` or `rgt sweep` again",
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


def scheduler_doc(ask: SlurmAsk, job: str, **more: Any) -> Dict[str, Any]:
    """The run record's ``scheduler`` for a Slurm job."""
    return {
        "kind": "slurm",
        "job": job,
        "time": ask.time,
        "walltime": ask.walltime,
        "lead": ask.lead,
        "script": SCRIPT,
        **more,
    }


def unsure(e: RemoteUnreachable, name: str) -> RemoteUnreachable:
    """The link went during sbatch: the job may well be queued."""
    return RemoteUnreachable(
        f"{e.what} (while submitting: the job of {name} may be queued)",
        f"`rgt status {name}` shows it; a deploy again finds it by name and submits no second",
    )


def unchecked(locked: LockedError, name: str, known: str, e: RgtError) -> LockedError:
    """The refusal ``locked`` of a submit (a job of run ``name`` is live, nothing submitted)
    whose look at that job failed (``e``): it may be this laptop's own job ``known``. Still
    the refusal, with its exit code: that a job of the run is live is certain, and it is why
    nothing was submitted; the failed look only left open whose job it is."""
    return LockedError(
        f"{locked.what}; whether it is this laptop's own job {known} of the same release "
        f"could not be checked: {e.what.rstrip('.')}",
        f"`rgt status {name}` shows the run's job: if it is {known}, the run is queued or "
        f"running already and a deploy again says so; else `rgt stop {name}` first to submit "
        "it again",
    )


def submit_run(
    remote: Remote,
    registry: Registry,
    ask: SlurmAsk,
    rec: RunRecord,
    opts: Sequence[str],
    job_file: Optional[str],
    prev: Optional[RunRecord],
    say: Say,
    staged: bool = False,
    unsubmitted: Callable[[], None] = lambda: None,
) -> RunRecord:
    """Submit the run's batch job (in place of ``rgt-agent start``; ``opts``: more ``rgt-agent
    run`` flags) and record it. ``staged``: this deploy staged secrets for the job's agent to
    claim; else any staged are a cut-off deploy's, removed by the submit (as a start does,
    controller/deploy/boxstart.py). A run whose job is live already is left alone (this laptop's
    record of that job, same release) or refused (LockedError), never submitted twice. With
    ``ask.cells``, one job array whose task i runs cell i, each cell recorded as a run of its
    own (controller/slurm/array.py). ``unsubmitted``: called before the error of a submit
    that submitted nothing is raised (the deploy drops the release it pushed for the job)."""
    say(ask.lead_line)
    say(f"rgt: {batch.requeue_side(list(ask.command), rec.workdir or '.')}")
    rd = RunDir(rec.name, rec.box_home)
    script = ask.script(rec, rd.path, opts, job_file)
    if ask.cells:
        from controller.slurm.array import submit_cells

        return submit_cells(remote, registry, rec, ask, rd, script, say, unsubmitted)
    try:
        stale = [] if staged else [rd.staged_secrets_file]
        job = sbatch(remote, rd, script, [], rec.name, stale, unsubmitted)
    except LockedError as locked:
        known = (prev.scheduler if prev is not None else {}).get("job")
        if prev is None or prev.release != rec.release or not known:
            unsubmitted()  # another job of the name is live: this one was not submitted
            raise
        try:
            own = job_ref(prev.scheduler) in queue.live_jobs(remote, job_name(rec.name))
        except RgtError as e:  # squeue failed, or the link went: whose job is live is unknown
            unsubmitted()  # nothing was submitted either way
            raise unchecked(locked, rec.name, str(known), e) from None
        except KeyboardInterrupt:  # a Ctrl-C while squeue is slow: nothing was submitted
            unsubmitted()  # one bounded command; a second Ctrl-C ends it (leftrelease.Left)
            raise
        if not own:
            unsubmitted()
            raise
        registry.put(prev)
        _switch(remote, prev)
        say(f"rgt: {rec.name} is already queued or running as Slurm job {known}; nothing to do")
        return prev
    except RemoteUnreachable as e:
        registry.put(rec)  # so that `rgt status` finds the run; the next deploy finds its job
        raise unsure(e, rec.name) from None
    rec = dataclasses.replace(rec, scheduler=scheduler_doc(ask, job))
    registry.put(rec)
    _switch(remote, rec)
    say(f"rgt: submitted {rec.name} as Slurm job {job} (--time {ask.time}; output {rd.path})")
    say(
        f"rgt: follow it with `rgt status {rec.name}`, `rgt logs {rec.name} -f`; "
        f"`rgt stop {rec.name}` ends it"
    )
    return rec


def _switch(remote: Remote, rec: RunRecord) -> None:
    """deploys/NAME/current to the run's release, as after a start."""
    from controller.deploy.release import switch_current

    if rec.release:
        switch_current(remote, rec.box_home, rec.name, rec.release)
