"""`rgt deploy`: put a run on a box and return.

0. The request is checked here, before the box is touched (controller/deploy/request.py), and the
   platform profile chosen: ``--profile``, else guessed from the host name, else from the marker
   files and init variables the audit finds (controller/deploy/guess.py); one line says which and
   why, and the first time this laptop meets the target under that profile, its danger clocks and
   conveniences are shown (controller/contacts.py).
1. Preflight audit (controller/deploy/audit.py): every problem is shown before anything is changed.
2. Push the code as an immutable, content-addressed release (controller/deploy/release.py); the job
   runs inside it, so a later deploy never changes a running job's files.
3. Install the agent into its own environment from the box's Python (controller/deploy/install.py).
4. Secrets: each ``--secret-env`` value travels on stdin to ``rgt-agent secrets`` (0600 file
   outside the release and run directories), never in argv, a command line, a log or the store.
   Staged for the start; a deploy with none removes what a cut-off one left staged (boxstart).
5. Start the agent detached (``rgt-agent start --profile NAME [--on-done ACTION]`` returns within a
   second; a user override of the profile on this laptop is first put at
   $RGT_HOME/profiles/NAME.toml, so that the box resolves the same profile), then watch until the
   job runs and has printed its first line (at most 60 s), and say where to look.

Running deploy again is idempotent: the same code is not pushed again, an installed agent is
reused, and a run that is already live on the same release is left alone. A deploy cut off
halfway leaves the old release or the new one, never a mix; one that fails after its push (or
is interrupted before its start) removes the release it pushed again where nothing uses it
(controller/deploy/leftrelease.py).

Round trips: the audit's one script also reads the box's Python for the agent, the marker of the
agent's install for it and whether the release is complete (controller/deploy/audit.py); and,
where this laptop has a record of the run, it runs the recorded agent's ``status NAME --json
--with-version`` (the run's status and what the agent's ``--version`` would say, in one start;
``--version`` itself only where that fails) and reads the run's spec.json (the look). That look
counts only if the recorded agent is the install the audit found; else (or with no record) the
look is one more command. A deploy of unchanged code whose run is live, from the laptop that
deployed it, runs the audit alone. Anything missing or wrong is then fixed as before, each by
its own command: the push, an install (also when the agent's ``--version`` fails), then the look
again with the agent installed. The connection (ssh's control master) is opened in the
background once the project's files are listed, so that its handshake overlaps the hashing of
the project and the building of the agent's wheel; the audit waits for it
(controller/sshahead.py).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import posixpath
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from controller import contacts, envnames
from controller.deploy import audit as auditmod
from controller.deploy import guess as guessmod
from controller.deploy.boxspec import record_box_store
from controller.deploy.install import AgentInstall, found_install, install_agent
from controller.deploy.leftrelease import Left
from controller.deploy.look import Live, live_refusal, look, look_args, refuse_live_elsewhere
from controller.deploy.probe import Probed
from controller.deploy.project import project_files, release_id
from controller.deploy.release import PushResult, push_release, switch_current
from controller.deploy.request import DeployRequest, Plan, check_on_done, check_request
from controller.deploy.wheel import AgentWheel
from controller.deploy.wheelcache import kept_agent_wheel
from controller.registry import Registry, RunRecord
from controller.remote import Remote, controller_home, open_remote
from controller.runstore import store_fields
from controller.target import Target
from onbox.common import jobenv
from onbox.common.errors import (
    HostError,
    NotFound,
    UsageError,
)
from onbox.common.rundir import profiles_dir
from onbox.common.terminal import printable, say
from onbox.profiles.load import SHIPPED_DIR

# Imported inside deploy(), where they are used: controller.deploy.boxstart (a deploy that finds
# its run live, as one of unchanged code does, starts nothing) and controller.slurm.submit (a
# Slurm deploy's alone); `rgt deploy` pays for every module imported here at its start.

_say = say  # progress lines; one stderr will not take is dropped (terminal.say)


def box_home_for(remote: Remote, home: str) -> str:
    """RGT_HOME on the box: $RGT_BOX_HOME when set here, else ~/.rgt of the box's user (""
    while the box's $HOME, ``home``, is not known yet)."""
    override = os.environ.get(envnames.BOX_HOME)
    if override:
        return override
    if remote.target.kind == "local":
        return os.path.abspath(os.environ.get(jobenv.HOME) or os.path.expanduser("~/.rgt"))
    if not home:
        return ""
    if not home.startswith("/"):
        raise HostError(f"{remote.target.label}: the box's $HOME is {home!r}, not a path")
    return posixpath.join(home, ".rgt")


def _durable_path(store: Optional[str]) -> Optional[str]:
    return store[len("file://") :] if store and store.startswith("file://") else None


def store_extras(store: Optional[str]) -> List[str]:
    """The agent's install extras a run with ``store`` needs."""
    if store and store.startswith("s3://"):
        return ["s3"]
    if store and store.startswith("hf://"):
        return ["hf"]
    return []


def deploy(
    req: DeployRequest,
    *,
    registry: Optional[Registry] = None,
    environ: Optional[Dict[str, str]] = None,
    say: Callable[[str], None] = _say,
    raise_ended: bool = False,
) -> RunRecord:
    """Run every step of a deploy; the run's record once its job printed a first line.
    ``raise_ended``: a run seen FAILED, STOPPED or PREEMPTED by then is raised, with its state's
    exit code (`rgt deploy`); else it is said, and returned (a sweep follows its cells)."""
    environ = dict(os.environ if environ is None else environ)
    registry = registry or Registry()
    plan = check_request(req, environ)
    # The agent this laptop last ran the run with is most likely still the one: look at the run
    # through it within the audit's command (checked against what the audit finds). Read before
    # anything else, so that a corrupt registry stops the deploy with nothing changed.
    prev = previous_record(registry, plan.name, plan.target)
    # What the audit looks for on the box, computed here first: the release's id (a project
    # that cannot be pushed is refused before the box is touched) and the agent's wheel.
    # (None for a start by name alone: nothing is pushed, controller/deploy/again.py.)
    files = None if plan.again else project_files(plan.project)
    remote = open_remote(plan.target)
    try:  # ssh's handshake, in the background while the hashing goes on (sshahead.py)
        remote.connect_ahead()
        rid = None if files is None else release_id(plan.project, files)
        wheel = kept_agent_wheel(controller_home())  # (built again only for other code)
        say(f"rgt: auditing {plan.target.label} ...")
        report, box_home, store, plan = _audit(remote, plan, rid, wheel, prev, say, registry)
        if files is None:
            from controller.deploy.again import start_again  # (it builds on this module)

            return start_again(remote, registry, plan, report, box_home, wheel, say, raise_ended)
        refuse_live_elsewhere(remote, plan, prev, report.look, wheel.version, rid)
        _warn_no_store(plan, say)
        pushed = push_release(
            remote, plan.project, box_home, name=plan.name, files=files, seen=report.release
        )
        say(_pushed_line(pushed))
        # A job file's store is recorded at once (the box's record confirms it after the
        # start): a start cut off, or a Slurm job still queued, has no box record to read yet.
        record = _recorder(plan, store or plan.job_store, box_home, pushed)
        # A failure from here to the start or submit leaves the release unused: it goes again.
        left = Left(remote, pushed, box_home, plan.name, say)
        with left.until_start():
            agent, rec, live = agent_and_run(
                remote, req, box_home, wheel, store_extras(store or plan.job_store),
                report.probed, record, prev, report.look,
            )  # fmt: skip
            say(_agent_line(agent))
            if live is not None:
                return _already_live(remote, registry, plan, rec, live, pushed, say)
            staged = store_secrets(remote, rec, plan.secrets, say)
            _put_override(remote, plan, box_home)
        if plan.slurm is not None and plan.guess is not None:
            # A batch job runs the agent (controller/slurm/submit.py): submitted, not started.
            from controller.slurm.submit import submit_run  # (see the imports above)

            opts = _agent_args("run", plan, store, tail=False)[5:]  # after --profile P
            return submit_run(
                remote, registry, plan.slurm, rec, opts, plan.job_rel, prev, say, staged,
                unsubmitted=lambda: left.drop("the cluster refused the submit"),
            )  # fmt: skip
        from controller.deploy import boxstart  # (see the imports above)

        argv = rec.agent_argv(*_agent_args("start", plan, store))
        again = functools.partial(push_release, remote, plan.project, box_home, files=files)
        started = boxstart.start_pushed(remote, registry, rec, argv, pushed, staged, say, again)
        registry.put(rec)
        if not started:  # the run is finished: it never runs in this release
            say(boxstart.finished_line(plan.name))
            return rec
        if plan.req.store is None and plan.job_store:  # the job file's, as the agent took it
            rec = record_box_store(remote, registry, rec, plan.target.label, say)
        switch_current(remote, box_home, plan.name, pushed.id)
        boxstart.after_start(remote, rec, plan.target.label, say, raise_ended)
        return rec
    finally:
        remote.close()


def _audit(
    remote: Remote,
    plan: Plan,
    rid: Optional[str],
    wheel: AgentWheel,
    prev: Optional[RunRecord],
    say: Callable[[str], None],
    registry: Registry,
) -> Tuple[auditmod.Audit, str, Optional[str], Plan]:
    """The audit, shown line by line: HostError with every problem, before anything on the box
    is changed. Returns it, RGT_HOME on the box, the run's store and the plan with its profile
    chosen (from the box's markers when neither --profile nor the host told). A deploy that
    would drop the store the laptop recorded for the run is refused then (``_keeps_store``)."""
    known = box_home_for(remote, "")  # "" on an ssh box: its $HOME/.rgt, read by the audit
    store = _store(plan, known)
    report = auditmod.audit(
        remote,
        python=plan.req.python,
        box_home=known,
        durable=_durable_path(store or plan.job_store),
        wheel=wheel,
        extras=store_extras(store or plan.job_store),
        release_id=rid,
        deploy=plan.name,
        look=look_args(prev, wheel.version) if prev is not None else (),
        markers=None if plan.guess else guessmod.marker_args(plan.candidates),
    )
    if plan.guess is None:
        guess = guessmod.chosen(plan.target, plan.dirs, report.markers or [], plan.candidates)
        check_on_done(guess.profile, plan.req.on_done)
        plan = dataclasses.replace(plan, guess=guess)
        store = _store(plan, known)
    assert plan.guess is not None
    say(plan.guess.line)
    for line in contacts.first_contact(plan.target.label, plan.guess.profile):
        say(line)
    box_home = known or box_home_for(remote, report.home)
    for f in report.findings:
        say(f"  {'ok  ' if f.level == 'ok' else f.level.upper() + ':'} {f.what}")
    if report.problems:
        raise HostError(
            f"{plan.target.label} is not ready: "
            + "; ".join(f.what for f in report.problems)
            + ". Nothing was changed on the box.",
            "fix these, then deploy again",
        )
    _keeps_store(registry, plan, store)
    return report, box_home, store, plan


def _keeps_store(registry: Registry, plan: Plan, store: Optional[str]) -> None:
    """Refuse (UsageError, nothing changed yet) a deploy that names no store (no --store, none
    in the job file) under the name of a run this laptop recorded with one, when the store it
    would use is not that one: the run would go on without it (its sealed checkpoints neither
    restored nor added to, the record's store forgotten), after a warning that said only that
    the checkpoints stay on the box. A start by name alone keeps the box's spec, store too."""
    if plan.again or plan.req.store is not None or plan.job_store:
        return
    try:
        kept = registry.get(plan.name).store
    except NotFound:
        return
    if not kept or kept == store:
        return
    url = printable(kept)  # the record's store may have come from the box (record_box_store)
    raise UsageError(
        "--store",
        f"run {plan.name} was deployed with store {url} (this laptop's record of it), and this "
        "deploy names none: the run would go on without it, its sealed checkpoints there "
        "neither restored nor added to",
        f"give --store {url} again (or a job file naming it), or deploy under another --name",
    )


def _warn_no_store(plan: Plan, say: Callable[[str], None]) -> None:
    """One line when the run gets no store at all (no --store, none in the job file, no durable
    mount of the profile's to default to): its checkpoints then live on the box alone. Also when
    the profile's durable default is durable only on some of the storage its path may be (a
    RunPod /workspace is a Network Volume, or the pod's own volume disk, deleted with it)."""
    assert plan.guess is not None
    prof = plan.guess.profile
    if plan.req.store is not None or plan.job_store or plan.profile == "local":
        return
    path = prof.durable.path
    tiers = prof.tiers_at(path) if path else ()
    lost = [s.name for s in tiers if not s.survives_destroy]
    if lost:
        kept = [s.name for s in tiers if s.survives_destroy]
        say(
            f"rgt: warning: no --store, so checkpoints go to profile {prof.name}'s durable "
            f"default {path}, which outlives the box only on {' or '.join(kept) or 'nothing'}, "
            f"not on {' or '.join(lost)} ({prof.durable.note}): check with the provider which "
            f"the box has at {path}, or give --store s3://BUCKET/PREFIX"
        )
    if path:
        return
    say(
        f"rgt: warning: no --store, and profile {prof.name} has no durable mount to default "
        "to: checkpoints and results stay only on the box, gone if it is destroyed (give "
        "--store s3://BUCKET/PREFIX, or --store file:///a/durable/mount)"
    )


def _store(plan: Plan, known: str) -> Optional[str]:
    """The run's store: --store; else the job file's (None here: the agent reads it, and the
    record takes it from the box after the start, boxspec.record_box_store); else on
    local $RGT_HOME/store (as before profiles), else the profile's durable default, else none."""
    if plan.req.store is not None:
        return plan.req.store
    if plan.job_store:
        return None  # the job file's, read by the agent
    if plan.profile == "local":
        return "file://" + os.path.join(known, "store")
    default = plan.guess.profile.default_store() if plan.guess is not None else None
    # A default naming the box's variables (Slurm's /scratch/$USER) is the agent's to expand.
    if default and "$" not in default and "~" not in default:
        return default
    return None


# stdin into $1/$2 atomically, replacing what is there (the user's override may have changed).
_PUT_OVERRIDE = (
    'umask 077; mkdir -p "$1" && cat >"$1/.$2.part.$$" && mv -f "$1/.$2.part.$$" "$1/$2"'
)


def _put_override(remote: Remote, plan: Plan, box_home: str) -> None:
    """The laptop's user override of the run's profile, at $RGT_HOME/profiles/NAME.toml on
    the box, so that the agent resolves the same profile (a shipped profile needs nothing)."""
    assert plan.guess is not None
    prof = plan.guess.profile
    mine = prof.override or (prof.file if not _shipped(prof.file) else None)
    if mine is None:
        return
    try:
        with open(mine, "rb") as f:
            data = f.read()
    except OSError as e:
        raise HostError(f"cannot read the profile override {mine}: {e.strerror}") from None
    d = profiles_dir(box_home)
    r = remote.sh(_PUT_OVERRIDE, d, f"{prof.name}.toml", input=data, timeout=60)
    if r.rc != 0:
        raise HostError(f"{plan.target.label}: cannot write {d}/{prof.name}.toml: {r.err.strip()}")


def _shipped(path: str) -> bool:
    return os.path.dirname(os.path.abspath(path)) == os.path.abspath(SHIPPED_DIR)


def _pushed_line(pushed: PushResult) -> str:
    """What the push did, in one line."""
    return f"rgt: release {pushed.id}: " + (
        "already on the box, nothing sent"
        if pushed.method == "existing"
        else f"{pushed.transferred_files} files, {pushed.transferred_bytes} bytes "
        f"sent ({pushed.method})"
    )


def _agent_line(agent: AgentInstall) -> str:
    """Which agent runs the run, in one line."""
    return (
        f"rgt: agent {'installed' if agent.installed else 'already installed'} "
        f"({agent.method}, Python {agent.python_version})"
    )


def _recorder(
    plan: Plan, store: Optional[str], box_home: str, pushed: PushResult
) -> Callable[[AgentInstall], RunRecord]:
    """The run's record, given the agent that runs it."""

    def record(agent: AgentInstall) -> RunRecord:
        return RunRecord(
            name=plan.name,
            target=plan.target,
            profile=plan.profile,
            **store_fields(store, plan.store_endpoint, plan.store_stall),
            box_home=box_home,
            agent=list(agent.argv),
            agent_env=dict(agent.env),
            release=pushed.id,
            workdir=pushed.path,
            instance=plan.req.instance,
        )

    return record


def _already_live(
    remote: Remote,
    registry: Registry,
    plan: Plan,
    rec: RunRecord,
    live: Live,
    pushed: PushResult,
    say: Callable[[str], None],
) -> RunRecord:
    """A run already live on the box: left alone on this release, refused on another."""
    state, release = live
    if release != pushed.id:
        raise live_refusal(plan, live)
    # A deploy cut off after the start may not have switched the link yet.
    switch_current(remote, rec.box_home, plan.name, pushed.id)
    registry.put(rec)
    if plan.req.store is None and plan.job_store:
        rec = record_box_store(remote, registry, rec, plan.target.label, say)
    say(f"rgt: {plan.name} is already {state} on this release; nothing to do")
    return rec


def store_secrets(
    remote: Remote, rec: RunRecord, secrets: Dict[str, str], say: Callable[[str], None]
) -> bool:
    """Each secret's value on stdin to ``rgt-agent secrets --for-start`` (never in argv): the
    run takes them only once the start that follows is claimed, so a start the box refuses
    leaves the run's own in place and the new values nowhere (onbox.agent.claim). Whether it
    staged any (else the start removes what another deploy left staged: boxstart.py)."""
    if not secrets:
        return False
    argv = rec.agent_argv("secrets", "--for-start", rec.name)
    r = remote.run(argv, input=json.dumps(secrets).encode())
    if r.rc != 0:
        raise HostError(f"storing the secrets on the box failed: {r.err.strip()}")
    say(f"rgt: secrets {', '.join(sorted(secrets))} stored on the box (0600)")
    return True


def _agent_args(verb: str, plan: Plan, store: Optional[str], tail: bool = True) -> List[str]:
    """``rgt-agent VERB``'s arguments for the run (``tail``: with the job file and command)."""
    req = plan.req
    args = [verb, "--name", plan.name, "--profile", plan.profile]
    if req.on_done is not None:
        args += ["--on-done", req.on_done]
    # The profile's own default store is the agent's to pick (it checks the durable path is
    # there first); the record keeps it all the same, for `rgt pull --from store`.
    profile_default = plan.guess.profile.default_store() if plan.guess is not None else None
    if store and (req.store is not None or store != profile_default):
        args += ["--store", store]
    for out in req.outputs:
        args += ["--output", out]
    if plan.job_rel and tail:
        args.append(plan.job_rel)
    if req.command and tail:
        args += ["--", *req.command]
    return args


def agent_and_run(
    remote: Remote,
    req: DeployRequest,
    box_home: str,
    wheel: AgentWheel,
    extras: Sequence[str],
    probed: Optional[Probed],
    record: Callable[[AgentInstall], RunRecord],
    prev: Optional[RunRecord] = None,
    seen: Optional[Dict[str, List[str]]] = None,
) -> Tuple[AgentInstall, RunRecord, Optional[Live]]:
    """The agent to run (the install the audit found, once it answers as this version; else one
    installed now), the run's record with it, and the run's live state, if it is live.

    ``seen``: the audit's look at the run through ``prev``'s agent (the one this laptop last
    recorded for it); it stands for this look only where that is the agent found now."""
    found = found_install(probed, box_home, wheel, extras) if probed is not None else None
    if found is not None:
        rec = record(found)
        same = (
            prev is not None
            and seen is not None
            and prev.agent_argv() == rec.agent_argv()
            and prev.name == rec.name
        )
        sound, live = look(remote, rec, wheel.version, seen if same else None)
        if sound:
            return found, rec, live
    agent = install_agent(
        remote,
        box_home,
        req.python,
        req.offline,
        extras,
        wheel=wheel,
        probed=probed,
        broken=found is not None,
    )
    rec = record(agent)
    return agent, rec, look(remote, rec)[1]


def previous_record(registry: Registry, name: str, target: Target) -> Optional[RunRecord]:
    """This laptop's record of run ``name`` on ``target``, if it has one with an agent (one
    taken down by ``rgt down`` has none: nothing of the run is left on its box)."""
    try:
        rec = registry.get(name)
    except NotFound:
        return None
    if rec.target != target or not rec.agent or not rec.box_home or rec.down_at is not None:
        return None
    return rec
