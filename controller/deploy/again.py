"""`rgt deploy TARGET --name N` with no job file and no command: start run N on the box again,
from the box's own record of it, as `rgt-agent start --name N` does there.

The box keeps each run's job spec (runs/N/spec.json: its command, the release directory it runs
in, its store); `rgt-agent start --name N` with no command starts that spec again, a new
incarnation that restores the newest sealed checkpoint. The laptop keeps no copy of the job, so
what the box holds is what starts: nothing is pushed (the run starts in the release it ran in;
a deploy with the command pushes the code as it is now). The audit and the agent's install are
the deploy's own (controller/deploy/flow.py). Refused before anything starts:

- no run N on the box (no spec.json there): NotFound (exit 8), saying to give the command;
- run N's directory gone from the box (its release removed): NotFound (exit 8), the same;
- run N live there (its agent supervises it): LockedError (exit 5), naming `rgt status N`,
  `rgt logs N -f` and `rgt stop N`; starting it again would only re-attach.

The start and the wait for the job's first line are the deploy's (controller/deploy/boxstart.py):
a run that ends at once exits with its state's code, as after any deploy. Once started, the
deploy's ``current`` link moves to the release the run runs in, as after a deploy's start (a
failed redeploy left the spec on a newer release than the link), and the release the link named
before goes where nothing names it (controller/shell/release_switch.sh).
"""

from __future__ import annotations

import posixpath
import shlex
from typing import Callable, List

from controller.deploy import flow
from controller.deploy.audit import Audit
from controller.deploy.boxspec import box_job
from controller.deploy.boxstart import after_start, finished_line, start_on_box
from controller.deploy.install import AgentInstall
from controller.deploy.release import release_path, switch_current
from controller.deploy.request import Plan, check_again
from controller.deploy.wheel import AgentWheel
from controller.registry import Registry, RunRecord
from controller.remote import Remote
from controller.runstore import store_fields
from onbox.common.errors import LockedError, NotFound
from onbox.common.terminal import printable


def start_again(
    remote: Remote,
    registry: Registry,
    plan: Plan,
    report: Audit,
    box_home: str,
    wheel: AgentWheel,
    say: Callable[[str], None],
    raise_ended: bool,
) -> RunRecord:
    """Start run ``plan.name`` on the box again from its spec there (module docstring); its
    record once the job printed a first line."""
    assert plan.guess is not None
    check_again(plan.guess.profile)  # a profile guessed from the box's markers only now
    label = plan.target.label
    job = box_job(remote, box_home, plan.name, label)
    if remote.sh('[ -d "$1" ]', job.workdir, timeout=60).rc != 0:
        raise NotFound(
            f"run {plan.name}'s directory {printable(job.workdir)} is no longer on {label}: "
            "there is nothing to start it in again",
            f"give its command, which pushes the code again: "
            f"`rgt deploy {label} --name {plan.name} -- CMD ...`",
        )
    releases = release_path(box_home, "")

    def record(agent: AgentInstall) -> RunRecord:
        here = posixpath.dirname(job.workdir.rstrip("/")) == releases.rstrip("/")
        return RunRecord(
            name=plan.name,
            target=plan.target,
            profile=job.profile or plan.profile,
            # --store given this time: the box's now (with the endpoint, when S3 too)
            **store_fields(plan.req.store or job.store, job.endpoint_url, job.stall),
            box_home=box_home,
            agent=list(agent.argv),
            agent_env=dict(agent.env),
            release=posixpath.basename(job.workdir.rstrip("/")) if here else None,
            workdir=job.workdir,
            instance=plan.req.instance,
        )

    prev = flow.previous_record(registry, plan.name, plan.target)
    extras = flow.store_extras(plan.req.store or job.store)
    agent, rec, live = flow.agent_and_run(
        remote, plan.req, box_home, wheel, extras, report.probed, record, prev, report.look
    )
    if live is not None:
        raise LockedError(
            f"run {plan.name} is {live[0]} on {label}: there is nothing to start again",
            f"`rgt status {plan.name}` and `rgt logs {plan.name} -f` show it; "
            f"`rgt stop {plan.name}` first to start it again",
        )
    say(
        f"rgt: starting run {plan.name} again from the box's record: "
        f"{printable(shlex.join(job.command))[:200]} (in {printable(job.workdir)})"
    )
    staged = flow.store_secrets(remote, rec, plan.secrets, say)
    argv = rec.agent_argv(*_start_args(plan))
    started = start_on_box(remote, registry, rec, label, argv, job.workdir, staged, None, say)
    registry.put(rec)
    if not started:
        say(finished_line(plan.name))
        return rec
    if rec.release is not None:  # its deploy's current link follows, as after a deploy's start
        switch_current(remote, box_home, plan.name, rec.release)
    after_start(remote, rec, label, say, raise_ended)
    return rec


def _start_args(plan: Plan) -> List[str]:
    """``rgt-agent start``'s arguments: the name, and only the flags given this time (the box
    keeps the rest, and refuses a --profile other than the run's)."""
    req = plan.req
    args = ["start", "--name", plan.name]
    for flag, value in (("--profile", req.profile), ("--on-done", req.on_done)):
        if value is not None:
            args += [flag, value]
    if req.store is not None:
        args += ["--store", req.store]
    for out in req.outputs:
        args += ["--output", out]
    return args
