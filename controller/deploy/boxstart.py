"""The deploy's last steps: ``rgt-agent start`` on the box (``start_on_box``), what the laptop
says when it fails (``start_failed``), and the wait for the job's first line
(``wait_first_line``), which also says how a run that ended at once ended (``ended``). A run
whose store holds its DONE.json is finished: the agent starts nothing, and the deploy says so
(``finished_line``) rather than wait for a first line (a fresh box has no run to wait on).

The start returns once the job runs, so it waits for the agent's restore: minutes for a large
checkpoint. Meanwhile it says what the agent is doing on its stderr (onbox/agent/detach.py),
shown as it comes, so START_SILENCE bounds its silence, not its run; ssh's keepalive finds a
dead link. Whatever ends the laptop's wait (the link gone, a person's Ctrl-C), the run is
recorded: its agent may well be starting it. So is a run that ended before its job started
(below): the box holds it in that state, and `rgt deploy` there again resumes it.

Most failures are said as the box said them, once: the start's stderr is shown as it comes, but
for the rgt error it ends with, which rgt's own error says (controller/capture.py LineRelay). A
start that ends without one (the agent's program gone from the box: ``env: ...: No such file``)
was shown whole: rgt's error points at it, and says what to do. The start holds its release
first (``deploys/N/pending``, controller/shell/release_use.sh); one gone by then is NotFound
(exit 8), unless the deploy found it complete rather than pushed it: then another deploy's failed
start or `rgt down` removed it meanwhile, and the deploy pushes it again and starts, once
(``start_pushed``). The start never takes secrets another deploy
left staged (one cut off before its start): unless this deploy staged its own, the same line
removes them first (HostError, exit 9, when it cannot). One is not a failure of the start at
all: the box's agent took its epoch and restored the run's checkpoint, and a SIGTERM (the box
preempted) or a stop came before the job started, so the run ended PREEMPTED (exit 13) or
STOPPED (exit 12) before its first attempt (onbox/agent/detach.py ``NotStarted``). That is said
as what happened, with what to do, and `rgt deploy` exits with the box's code (13 or 12), as
`rgt-agent run` does. Any other refusal of the box's agent keeps its code too where it is one of
rgt's (2 a job the box cannot run, 5 a run held by another agent, 14 the store...). A code means
what rgt means by it only when it came with rgt's own error line (``rgt: ...``): a start that
exits without one failed before or outside rgt's code (Python's "can't open file" exits 2, a
killed shell anything), which is the box's failure, HostError (exit 9) naming the code, whatever
its number.

A start that fails in a release this deploy pushed removes that release again where nothing
uses it, in the same command (``START_SH``, controller/deploy/leftrelease.py), and says so in
one line before the box's error. A run the box holds after the failure (FAILED, or another
agent's) that this laptop has no record of is recorded from the box's record
(controller/deploy/heldrun.py), so that `rgt status` and `rgt down` find it.

A job may end as soon as it started (a missing import). When the wait sees the run already in a
final state, the deploy says so, with the box's reason and what to do, and exits with that state's
code as `rgt-agent run` does (11 FAILED, 12 STOPPED, 13 PREEMPTED; 0 SUCCEEDED), so that
`rgt deploy ... && next` does not go on after a job that failed. A run still live keeps exit 0.
(A sweep's deploy of a cell only says it: the sweep's own poll marks the cell FAILED.)
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from controller import boxrun
from controller.deploy import leftrelease
from controller.deploy.heldrun import record_held
from controller.deploy.release import PushResult, deploy_path
from controller.registry import Registry, RunRecord
from controller.remote import Remote, Result
from controller.shell import script
from onbox.agent.claim import FINISHED_SAY
from onbox.agent.lock import HELD_REMEDY
from onbox.agent.states import TERMINAL_NAMES
from onbox.common.errors import (
    FINAL_EXIT_CODES,
    HostError,
    IntegrityError,
    LockedError,
    NotFound,
    RemoteUnreachable,
    RgtError,
    StoreError,
    UnsafeRefused,
    UsageError,
    WaitInterrupted,
)
from onbox.common.rundir import RunDir

# The longest silence of `rgt-agent start` (it says how its agent's restore goes every few
# seconds: onbox/agent/detach.py PROGRESS_EVERY).
START_SILENCE = 120.0
FIRST_LINE_TIMEOUT = 60.0
FIRST_BYTES = 64 << 10  # of the job's log read for its first line

_WHY = {
    "PREEMPTED": "the box was preempted (SIGTERM to its agent)",
    "STOPPED": "a stop (Ctrl-C on the box, `rgt stop`) came",
}
_REMEDY = {
    "PREEMPTED": "run the same `rgt deploy` again, on this box once it is back or on another "
    "with the same store: the run restores its newest sealed checkpoint and resumes from it",
    "STOPPED": "run the same `rgt deploy` again to start it; it restores its newest sealed "
    "checkpoint",
}
# The codes a refusing `rgt-agent start` means as rgt means them (not 3 and 4: on the laptop
# they say the box did not answer or refused the login, which it did not).
_BOX_CODES = {
    c.exit_code
    for c in (
        UsageError,
        LockedError,
        IntegrityError,
        UnsafeRefused,
        NotFound,
        HostError,
        StoreError,
    )
}


# The start's shell found no release directory to run in, or could not remove secrets another
# deploy left staged (not rgt's exit codes).
_NO_RELEASE = 44
_STALE_KEPT = 45
# The line the start runs on the box: $1 the release directory, $2 the staged secrets to remove
# first ("" when this deploy staged them), $3 the run's directory, $4 its deploy's directory,
# $5 "drop" where this deploy created the release ("" else), then the agent's argv. The deploy
# holds the release first (deploys/N/pending, controller/shell/release_use.sh): no other
# deploy's drop or `rgt down` removes it from then on; one that did before is _NO_RELEASE.
# The release the run's spec named before the start goes after it, failed or not, where the
# start moved the spec off it and nothing else names it (rgt_release_left: one a failed
# redeploy left, which the run's spec named until now).
# Not exec'd (a failure lets go of the hold):
# a start that exits non-zero is followed, in the same command, by the drop of the release
# ($5: controller/deploy/leftrelease.py) and a look at runs/N and deploys/N/current
# (controller/deploy/heldrun.py), said last on stdout, after MARK, in three words: the drop's
# ("-" without one), "held" or "none" (runs/N/spec.json there or not), and the id of the
# release deploys/N/current names ("-" for none).
MARK = "rgt-start-failed: "
START_SH = script("release_use.sh") + "\n".join(
    (
        "rel=${1%/} run=$3 deploy=$4 drop=$5",
        f'rgt_locked "${{deploy%/*}}" rgt_release_hold "$rel" "$deploy" || exit {_NO_RELEASE}',
        f'cd "$rel" 2>/dev/null || exit {_NO_RELEASE}',
        'was=$(rgt_release_named "$run" "${rel%/*}") dd=${deploy%/*}',
        'if { [ -z "$2" ] || rm -f -- "$2"; }; then shift 5; "$@"; rc=$?',
        f"else rc={_STALE_KEPT}; fi",
        # In a subshell: the functions' names are the shell's own (rel, run, deploy).
        '[ -n "$was" ] && [ "$was" != "$rel" ] &&',
        '  (rgt_locked "$dd" rgt_release_left "$was" "$run" "$deploy")',
        '[ "$rc" -eq 0 ] && exit 0; cd / || exit "$rc"',
        "left=-",
        'if [ -z "$drop" ]; then rgt_locked "$dd" rgt_release_unhold "$rel" "$deploy"',
        'else left=$(rgt_locked "$dd" rgt_release_drop "$rel" "$run" "$deploy") || left=failed',
        "fi",
        'held=none; [ -f "$run/spec.json" ] && held=held',
        'cur=$(readlink "$deploy/current" 2>/dev/null) || cur=-',
        f'printf "\\n{MARK}%s %s %s\\n" "$left" "$held" "${{cur##*/}}"; exit "$rc"',
        "",
    )
)
# What to do when the start failed without an rgt error: the box's shell or Python said why.
_UNSAID = (
    "run the same `rgt deploy` again: it checks the agent's install on the box and installs it "
    "again where it does not run; if it fails the same way, report it as a bug in rgt, with "
    "the box's lines above"
)


def start_failed(label: str, name: str, rc: int, said: str, shown: bool = False) -> RgtError:
    """The error for ``rgt-agent start`` of run ``name`` exiting ``rc`` on ``label``, which
    printed ``said`` (its stderr, or its stdout when that is empty). ``shown``: its stderr is on
    the terminal already (the relay), all but the rgt error it ended with, which is ``said``
    ("" when it ended with none)."""
    if not _rgt_said(said):  # not rgt's refusal, so not rgt's meaning of the code either
        why = "the box's lines above say why" if shown else _its_error(said) or "it said nothing"
        return HostError(
            f"rgt-agent start failed on {label} (exit {rc}) without an error of rgt's: {why}",
            _UNSAID,
        )
    state = next((s for s, code in FINAL_EXIT_CODES.items() if code == rc and s in _WHY), None)
    if rc == LockedError.exit_code:  # the box's remedy names its commands: the laptop's here
        what = _its_error(said).replace(f" ({HELD_REMEDY.format(run=name)})", "")
        return LockedError(
            f"rgt-agent start failed on {label}: {what}",
            f"another agent is supervising the run: `rgt status {name}` shows it, "
            f"`rgt stop {name}` stops it; then deploy again",
        )
    if state is None:
        err = RgtError(f"rgt-agent start failed on {label} (exit {rc}): {_its_error(said)}")
        if rc in _BOX_CODES:
            err.exit_code = rc
        return err
    err = RgtError(
        f"run {name} did not start on {label}: {_WHY[state]} while its agent restored the "
        f"run's checkpoint, before the job started; the run is {state}",
        _REMEDY[state],
    )
    err.exit_code = rc
    return err


def _rgt_said(said: str) -> bool:
    """Whether the start ended with rgt's own error line (onbox/common/climain.py)."""
    return any(line.startswith("rgt: ") for line in said.splitlines())


def _its_error(said: str) -> str:
    """What the start said of its failure: from its last ``rgt:`` line on (its error, with the
    lines that error carries), else all of it. Its progress and warnings were on the terminal
    as they came (the relay): not again in the error."""
    lines = said.strip().splitlines()
    last = max((i for i, ln in enumerate(lines) if ln.startswith("rgt: ")), default=None)
    if last is None:
        return "\n".join(lines)
    return "\n".join([lines[last][len("rgt: ") :], *lines[last + 1 :]])


class ReleaseGone(NotFound):
    """The release the start was to run in is not on the box (exit 8): removed since the deploy
    found it complete there, before its start held it."""


def start_pushed(
    remote: Remote,
    registry: Registry,
    rec: RunRecord,
    argv: Sequence[str],
    pushed: PushResult,
    staged: bool,
    say: Callable[[str], None],
    push_again: Callable[..., PushResult],
) -> bool:
    """``start_on_box`` in the release ``pushed``. One this deploy found complete on the box
    (another run's, maybe) that another deploy's failed start or `rgt down` removed before this
    start held it is pushed again (``push_again(name=N)``: release.push_release), once, and the
    start runs in that: the deploy goes on rather than ask to be run again. Nothing of the
    start ran in the first."""
    label = rec.target.label
    try:
        return start_on_box(remote, registry, rec, label, argv, pushed.path, staged, pushed, say)
    except ReleaseGone:
        if pushed.method != "existing":
            raise
    say(f"rgt: release {pushed.id} went from the box before the start took it: pushing it again")
    pushed = push_again(name=rec.name)
    say(f"rgt: release {pushed.id}: {pushed.transferred_files} files sent again")
    return start_on_box(remote, registry, rec, label, argv, pushed.path, staged, pushed, say)


def start_on_box(
    remote: Remote,
    registry: Registry,
    rec: RunRecord,
    label: str,
    argv: Sequence[str],
    path: str,
    staged: bool = False,
    pushed: Optional[PushResult] = None,
    say: Callable[[str], None] = lambda line: None,
) -> bool:
    """``argv`` (the agent's start of run ``rec``) in the release's directory ``path`` on
    ``label``; returns once the job runs: True, or False when the agent started nothing, the
    run's store holding its DONE.json (``finished_line`` says so). ``staged``: this deploy
    staged secrets for the start (flow.store_secrets); else any staged there were left by a
    deploy cut off before its start, and are removed first, never taken by this one.
    ``pushed``: the release at ``path`` this deploy pushed; a start that fails removes it again
    where this deploy created it and nothing uses it, and ``say`` gets a line of what became
    of it (controller/deploy/leftrelease.py), and one when the run, which the box holds, is
    recorded on this laptop only now (controller/deploy/heldrun.py)."""
    stale = "" if staged else RunDir(rec.name, rec.box_home).staged_secrets_file
    r, out, words = _start(remote, registry, rec, label, argv, path, stale, pushed)
    if r.rc == _NO_RELEASE:
        raise ReleaseGone(
            f"the release {path} that run {rec.name} starts in is not on {label}: it was "
            "removed since it was pushed",
            "run the same `rgt deploy` again: it pushes the code again",
        )
    if r.rc != 0:
        if pushed is not None:
            leftrelease.tell(say, leftrelease.line(pushed, rec.name, words[0] if words else None))
        err = _failure(r, out, label, rec.name, stale)
        if err.exit_code in (FINAL_EXIT_CODES["PREEMPTED"], FINAL_EXIT_CODES["STOPPED"]):
            registry.put(rec)  # the run is there, in that state: `rgt status` must find it
        elif words[1:2] == ["held"]:  # the box holds the run: this laptop must know it too
            record_held(remote, registry, rec, label, say, words[2:])
        raise err
    said = FINISHED_SAY.format(run=rec.name)
    return not any(line.startswith(said) for line in out.splitlines())


def _failure(r: Result, out: str, label: str, name: str, stale: str) -> RgtError:
    """The error of a start of run ``name`` that exited non-zero (``out``: its stdout)."""
    if r.rc == _STALE_KEPT:
        return HostError(
            f"cannot remove {stale} on {label}: secrets a deploy cut off before its start left "
            f"for run {name}, which this start must not take; nothing was started",
            "check the owner and permissions of the box's rgt secrets directory, then deploy again",
        )
    # Its stderr was shown as it came, but for the error it held back (r.held). A preemption
    # during the restore is said as such (start_failed).
    shown = bool(r.stderr)
    said = r.held.decode("utf-8", "replace") if shown else out
    return start_failed(label, name, r.rc, said, shown)


def _start(
    remote: Remote,
    registry: Registry,
    rec: RunRecord,
    label: str,
    argv: Sequence[str],
    path: str,
    stale: str,
    pushed: Optional[PushResult],
) -> Tuple[Result, str, List[str]]:
    """The start's command (``START_SH``: with the drop of the release this deploy pushed, where
    it created it); its result, its stdout, and the words said after a failure (the drop's, or
    "-"; whether the box holds the run, "held" or "none"; the release deploys/N/current names,
    or "-"), none else."""
    drop = pushed is not None and pushed.method != "existing"
    rd, where = RunDir(rec.name, rec.box_home), deploy_path(rec.box_home, rec.name)
    try:
        r = remote.sh(
            START_SH, path, stale, rd.path, where, "drop" if drop else "", *argv,
            timeout=START_SILENCE, relay=True,
        )  # fmt: skip
    except RemoteUnreachable:
        # The link went while the agent was starting, so it may well be running: remember
        # the run, so that `rgt status` finds it and the next deploy sees it live.
        registry.put(rec)
        raise
    except KeyboardInterrupt:  # the person's Ctrl-C ends the wait, not the start on the box
        registry.put(rec)
        raise WaitInterrupted(
            f"interrupted while {label}'s agent started run {rec.name}: the start goes on "
            "there (its restore, then the job)",
            f"rgt status {rec.name} to see it; rgt stop {rec.name} to stop it",
        ) from None
    out, words = failure_words(r.text) if r.rc != 0 else (r.text, [])
    return r, out, words


def failure_words(text: str) -> Tuple[str, List[str]]:
    """The stdout ``text`` of a failed start without what ``START_SH`` said last (after MARK),
    and those words (none when it said nothing: the command was cut off). The box's words are
    only ever compared with fixed ones."""
    out, sep, tail = text.rpartition("\n" + MARK)
    return (out, tail.split()) if sep else (text, [])


def finished_line(name: str) -> str:
    """What a deploy says when the box's agent started nothing: run ``name`` is finished."""
    return (
        f"rgt: run {name} is finished (its store holds DONE.json): nothing was started: this "
        f"deploy's code did not run (to train again, deploy under a new --name; its results: "
        f"`rgt pull {name}`)"
    )


def wait_first_line(
    remote: Remote, rec: RunRecord, label: str, say: Callable[[str], None]
) -> Optional[RgtError]:
    """Wait (FIRST_LINE_TIMEOUT at most) for the first line of the attempt the start began, or
    for the run's end, and say which; the error of a run seen ended other than SUCCEEDED
    (``ended``), for the caller to raise or to report."""
    deadline = time.monotonic() + FIRST_LINE_TIMEOUT
    doc: Dict[str, Any] = {}
    while time.monotonic() < deadline:
        doc = boxrun.poll_status(rec, remote)
        line = _first_line(remote, rec, doc)
        if line and doc.get("state") not in TERMINAL_NAMES:
            # A job that printed its traceback has most likely ended since the poll: look again
            # (one round trip), rather than call a dead job RUNNING and exit 0.
            doc = boxrun.poll_status(rec, remote) or doc
        if line:
            say(f"rgt: {rec.name} is {doc.get('state')}; its first line: {line[:200]}")
            break
        if doc.get("state") in TERMINAL_NAMES:
            say(f"rgt: {rec.name} ended ({doc.get('state')}) before printing anything")
            break
        time.sleep(0.5)
    else:
        wait = f"{FIRST_LINE_TIMEOUT:.0f} s"
        say(f"rgt: {rec.name} is {doc.get('state')}; no output within {wait} yet")
    if doc.get("state") not in TERMINAL_NAMES:
        say(
            f"rgt: follow it with `rgt watch {rec.name}`, `rgt logs {rec.name} -f`, "
            f"`rgt status {rec.name}`; it runs on without this laptop"
        )
        return None
    err = ended(rec.name, label, doc)
    if err is not None:
        return err
    say(
        f"rgt: run {rec.name} SUCCEEDED already: its results with `rgt pull {rec.name}`, "
        f"its output with `rgt logs {rec.name}`"
    )
    return None


def after_start(
    remote: Remote, rec: RunRecord, label: str, say: Callable[[str], None], raise_ended: bool
) -> None:
    """``wait_first_line``, then a run seen ended other than SUCCEEDED raised (``raise_ended``:
    `rgt deploy`, with its state's exit code) or said (a sweep follows its cells)."""
    ended = wait_first_line(remote, rec, label, say)
    if ended is not None and raise_ended:
        raise ended
    if ended is not None:
        say(ended.line())


def _first_line(remote: Remote, rec: RunRecord, doc: Dict[str, Any]) -> str:
    """The first line the attempt ``doc`` names has printed ("" before it printed one)."""
    attempt = doc.get("attempt")
    # The attempt this start began, not the run's first one: a run started again has the
    # older attempts' output (a traceback that was fixed since) before it.
    if not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < 1:
        return ""
    # Its first line only: the log's beginning is read, then the reader stopped.
    path = boxrun.look_dir(rec).output_log(attempt)
    log = remote.run(["cat", "--", path], timeout=60, limit=FIRST_BYTES, over="cut").text
    return log.strip().splitlines()[0] if log.strip() else ""


def ended(name: str, label: str, doc: Dict[str, Any]) -> Optional[RgtError]:
    """The error for run ``name`` that the deploy saw ended on ``label`` (``doc``: its status),
    with its state's exit code, the box's reason and what to do; None when it SUCCEEDED."""
    state = str(doc.get("state"))
    code = FINAL_EXIT_CODES.get(state)
    if not code:
        return None
    last: Dict[str, Any] = doc.get("last_exit") or {}
    # The reason without the output it quotes: the first line was shown, `rgt logs` has all.
    reason = str(last.get("reason") or _WHY.get(state) or "").split(" | last output: ")[0]
    fix = str(last.get("remedy") or "") if state == "FAILED" else _REMEDY.get(state, "")
    err = RgtError(
        f"run {name} {state} on {label} right after its start"
        + (f": {reason[:400]}" if reason else ""),
        "; ".join(
            x
            for x in (
                fix,
                f"its output: `rgt logs {name}`",
                "then `rgt deploy` again" if state == "FAILED" else "",
            )
            if x
        ),
    )
    err.exit_code = code
    return err
