"""status, logs and stop, as seen from the laptop (`rgt watch` draws status: controller/watch.py).

Everything is read from the box over ssh (the agent's own ``rgt-agent status --json``, its
events, disk, memory and GPU in one round trip). When the box does not answer, status comes from
the state the agent mirrors to the store, labelled with where and when it was read: a silent box
is "unknown since T", never "dead" (a laptop on a train cannot tell a preempted box from a
stalled network).
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from typing import IO, Any, Dict, List, Optional, Tuple

from controller import boxrun
from controller.capture import box_float, box_int
from controller.registry import RunRecord
from controller.remote import Remote, open_remote
from controller.shell import script
from onbox.agent.observe import health_lines, public_state, shaped, warning_lines
from onbox.common import jsondoc
from onbox.common.errors import IntegrityError, NotFound, RemoteUnreachable, RgtError
from onbox.common.terminal import printable, printable_lines

# One round trip: the agent's status, then the box's view of what limits the run.
SNAPSHOT = script("observe.sh")


def _now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _sections(text: str) -> Dict[str, List[str]]:
    out: Dict[str, List[str]] = {}
    cur = ""
    for line in text.splitlines():
        if line.startswith("@@"):
            cur = line[2:].strip()
            out[cur] = []
        elif cur:
            out[cur].append(line)
    return out


def snapshot(rec: RunRecord, remote: Optional[Remote] = None) -> Dict[str, Any]:
    """The run as the box sees it now; raises RemoteUnreachable when the box does not answer.
    A remote it opens itself (none given) it closes."""
    if remote is None:
        own = open_remote(rec.target)
        try:  # its ssh master does not stay on for a minute after rgt (ControlPersist)
            return snapshot(rec, own)
        finally:
            own.close()
    res = remote.sh(
        SNAPSHOT,
        boxrun.look_dir(rec).path,
        rec.workdir or rec.box_home,
        *boxrun.status_argv(rec),
        timeout=60,
        what=f"the look at {rec.name} (rgt-agent status, events.jsonl, df, nvidia-smi)",
    )
    parts = _sections(res.text)
    try:
        status = jsondoc.loads("\n".join(parts.get("status", [])))
        if not isinstance(status, dict):
            raise ValueError("not a JSON object")
    except ValueError:
        raise NotFound(
            f"the agent on {rec.target.label} knows no run {rec.name!r}",
            "was the box reset? `rgt status --json` shows the store's copy",
        ) from None
    status = shaped(status)
    status["source"] = "box"
    status["read_at"] = _now_iso()
    status["box"] = _box_facts(parts)
    return status


def _object(line: str) -> Optional[Dict[str, Any]]:
    """One line the box printed as a JSON object, or None: a line being written, or damaged."""
    try:
        doc = jsondoc.loads(line)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def _box_facts(parts: Dict[str, List[str]]) -> Dict[str, Any]:
    facts: Dict[str, Any] = {}
    facts["events"] = jsondoc.objects(parts.get("events", []))
    for line in parts.get("sealed", []):
        sealed = _object(line)
        if sealed is not None:
            facts["sealed"] = sealed
    # Each number as the box printed it, or the fact is left out (box_int: never a traceback).
    disk = [line.split() + ["-"] * 4 for line in parts.get("disk", [])]
    space = [box_int(x) for x in disk[0][2:4]] if disk else []
    if len(space) == 2 and None not in space:
        facts["disk"] = {"used_kb": space[0], "avail_kb": space[1]}
    inodes = [box_int(x) for x in disk[1][1:4]] if len(disk) >= 2 else []
    if len(inodes) == 3 and None not in inodes:
        facts["inodes"] = {"used": inodes[1], "free": inodes[2]}
    mem = {}
    for line in parts.get("mem", []):
        k, _, v = line.partition(":")
        kb = box_int((v.split() or [""])[0])
        if kb is not None:
            mem[k.strip()] = kb
    if mem:
        facts["memory_kb"] = mem
    gpus = []
    for line in parts.get("gpu", []):
        f = [box_float(x) for x in line.split(",")]
        if len(f) == 3 and None not in f:
            gpus.append({"util": f[0], "mem_used_mib": f[1], "mem_mib": f[2]})
    facts["gpus"] = gpus
    now = box_int((parts.get("now") or [""])[0])
    if now is not None:
        facts["box_time"] = now
    return facts


def from_store(rec: RunRecord) -> Dict[str, Any]:
    """The state the agent last mirrored to the store; raises NotFound when there is none."""
    if not rec.store:
        raise NotFound(
            f"{rec.target.label} does not answer and run {rec.name!r} has no store",
            "nothing else knows its state; try again when the box is reachable",
        )
    from controller.runstore import open_run_store  # (here: a box that answers needs no store)
    from onbox.sealing import manifest as mf
    from onbox.sealing.quarantine import quarantine_reasons
    from onbox.sealing.restore import in_effect, sealed_steps

    store = open_run_store(rec)
    raw = store.get_bytes(mf.state_key(rec.name, "state.json"))
    if raw is None:
        raise NotFound(f"the store {rec.store} holds no state of run {rec.name!r} yet")
    try:
        mirrored = jsondoc.loads(raw)
    except ValueError:
        mirrored = None
    if not isinstance(mirrored, dict):
        raise IntegrityError(
            f"the store's copy of run {rec.name!r}'s state "
            f"({mf.state_key(rec.name, 'state.json')} in {rec.store}) is not a JSON object",
            "try again when the box answers: its agent holds the live state and rewrites this "
            "copy; `rgt pull --from store` checks each checkpoint on its own",
        )
    doc = public_state(mirrored)
    latest = store.get_bytes(mf.latest_key(rec.name))
    if latest is not None:
        try:
            pointer = jsondoc.loads(latest)
        except ValueError:
            pointer = None
        # A damaged LATEST is shown as none: `rgt pull` falls back to the newest sealed step.
        doc["latest"] = pointer if isinstance(pointer, dict) else None
        step = doc["latest"].get("step") if isinstance(doc["latest"], dict) else None
        bad = quarantine_reasons(store, rec.name)
        if isinstance(step, int) and step in bad:
            # The step a fresh box resumes from and `rgt pull` takes, and why it is not LATEST's.
            effective, note = in_effect(step, sealed_steps(store, rec.name), bad)
            doc["in_effect"] = {
                "step": effective,
                "note": printable(note or ""),
            }  # the store's words
    doc["done"] = store.get_bytes(mf.done_key(rec.name)) is not None
    # The state mirror changes only with the state, so a run RUNNING for days was last written
    # when it started; a later seal is later proof that it was still alive.
    seen = (mirrored.get("updated_ts"), (doc.get("latest") or {}).get("updated"))
    newest = max((float(t) for t in seen if isinstance(t, (int, float))), default=None)
    if newest is not None:
        doc["known_at"] = datetime.datetime.fromtimestamp(newest, datetime.timezone.utc).isoformat(
            timespec="seconds"
        )
    doc["source"] = "store"
    doc["read_at"] = _now_iso()
    return doc


def status(rec: RunRecord) -> Tuple[Dict[str, Any], Optional[str]]:
    """(status, why the box was not used); falls back to the store when the box is silent, and
    reads only the store for a run taken down (``rgt down``: nothing of it is on a box). A run a
    Slurm job runs joins Slurm's side (controller/slurm/runs.py)."""
    if rec.down_at is not None:
        return dict(from_store(rec), taken_down=rec.taken_down()), None
    if rec.scheduler.get("kind") == "slurm":
        from controller.slurm import runs

        return runs.status(rec)
    try:
        return snapshot(rec), None
    except RemoteUnreachable as e:
        why = e.what
    doc = from_store(rec)
    return doc, why


def describe(doc: Dict[str, Any], why_not_box: Optional[str] = None) -> str:
    """The few lines `rgt status N` prints."""
    lines = []
    slurm = (doc.get("scheduler") or {}).get("line")
    if doc.get("source") == "slurm":  # queued: no agent has started yet
        from controller.slurm.runs import first_line

        lines.append(str(first_line(doc)))
    elif doc.get("source") == "store":
        since = doc.get("known_at") or doc.get("updated_at") or "an unknown time"
        head = f"unknown since {since}, when it was {doc.get('state')} (the box does not answer: "
        if doc.get("taken_down"):
            head = f"{doc['taken_down']}, {doc.get('state')} at {since} ("
            why_not_box = "rgt down: nothing of it is left on its box"
        read = f"{why_not_box}; read from the store at {doc['read_at']})"
        lines.append(f"{doc.get('name')}: {head}{read}")
    else:
        lines.append(
            f"{doc.get('name')}: {doc.get('state')}, attempt {doc.get('attempt')}, "
            f"job {'running' if doc.get('job_alive') else 'not running'} "
            f"(read from the box at {doc.get('read_at')})"
        )
    prog = doc.get("progress") or {}
    if slurm:
        lines.append(f"  {slurm}")
    if prog:
        lines.append(f"  step {prog.get('step')}" + metrics_line(prog))
    sealed = (doc.get("box") or {}).get("sealed") or {}
    if sealed:
        how = "restored from the store" if sealed.get("kind") == "restored" else ""
        lines.append(
            f"  newest sealed checkpoint: step {sealed.get('step')} "
            + (f"({how} at {sealed.get('time')})" if how else f"at {sealed.get('time')}")
        )
    elif doc.get("in_effect"):
        lines.append(f"  newest verified: step {doc['in_effect'].get('step')}")
        lines.append(f"  {doc['in_effect'].get('note')}")
    elif doc.get("latest"):
        lines.append(f"  newest sealed: step {doc['latest'].get('step')}")
    if le := doc.get("last_exit"):  # kept across attempts: say whose it is
        of = ", ".join(
            f"{k} {le[k]}" if k == "attempt" else f"at {le[k]}"
            for k in ("attempt", "at")
            if le.get(k) is not None
        )
        head = f"  last exit ({of})" if of else "  last exit"
        said = f"{head}: {le.get('kind')}: {le.get('reason', '')}".rstrip(": ")
        lines.append(said + (f" ({le['remedy']})" if le.get("remedy") else ""))  # what to do
    lines += [f"  warning: {line}" for line in warning_lines(doc)]
    lines += [f"  {line}" for line in health_lines(doc, box_now(doc))]
    # Names, states, steps, metrics and reasons are the box's words (its agent's status, its
    # events.jsonl): no escape sequence of theirs reaches the terminal.
    return "\n".join(printable(line) for line in lines)


def box_now(doc: Dict[str, Any]) -> float:
    """The box's clock when the document was read (the verdicts' ages are the box's)."""
    box_time = (doc.get("box") or {}).get("box_time")
    return float(box_time) if isinstance(box_time, int) else time.time()


def metrics_line(prog: Dict[str, Any]) -> str:
    m = prog.get("metrics") or {}
    return "".join(f", {k} {v:.4g}" if isinstance(v, float) else f", {k} {v}" for k, v in m.items())


# A Slurm run's logs in one round trip: the agent's once it made the run ($1, its spec.json,
# exists), else NOT_MADE and nothing else. 97 is no exit code of rgt-agent's (1 to 20,
# onbox/common/errors.py), nor a shell's (126, 127, 128+N) nor ssh's (255).
NOT_MADE = 97
_IF_MADE = (
    "# rgt logs: the agent's, once it made the run\n"
    f'[ -f "$1" ] || exit {NOT_MADE}\nshift\nexec "$@"\n'
)


def logs(rec: RunRecord, follow: bool, out: IO[bytes]) -> int:
    """Copy the job's output from the box (following it with ``follow``); for a Slurm run,
    controller/slurm/runs.py's (the batch output while no agent started)."""
    rec.check_on_box("rgt logs")  # taken down: nothing of it is left on a box
    if rec.scheduler.get("kind") == "slurm":
        from controller.slurm import runs

        return runs.logs(rec, follow, out)
    agent_logs(rec, follow, out)
    return 0


def agent_logs(rec: RunRecord, follow: bool, out: IO[bytes], made: Optional[str] = None) -> bool:
    """``rgt-agent logs`` of the run on the box, to ``out``; with ``made`` only once that file
    exists there (in the same round trip): False when it does not, and nothing was run. The
    agent's error is rgt's: NotFound (exit 8) when it knows no such run, as ``rgt status``."""
    remote = open_remote(rec.target)
    try:  # closed: its ssh master does not stay on for a minute after rgt (ControlPersist)
        return _agent_logs(rec, remote, follow, out, made)
    finally:
        remote.close()


def _agent_logs(
    rec: RunRecord, remote: Remote, follow: bool, out: IO[bytes], made: Optional[str]
) -> bool:
    argv = rec.agent_argv("logs", rec.name, *(["-f"] if follow else []))
    if made is not None:
        argv = ["sh", "-c", _IF_MADE, "rgt", made, *argv]
    if not follow:
        # Straight through as it comes, never held: a job's log may be larger than this
        # laptop's memory.
        res = remote.stream(argv, out)
        rc, err, what = res.rc, res.err.strip()[-300:], "rgt-agent logs failed on the box"
    else:
        rc, err = _follow(remote, argv, out, rec.target.label)
        what = f"rgt-agent logs -f failed on the box (exit {rc})"
    if made is not None and rc == NOT_MADE:
        return False
    if rc == NotFound.exit_code:
        raise NotFound(
            f"{what}: {err}", "was the box reset? `rgt status --json` shows the store's copy"
        )
    if rc > 0:  # the agent's own error; with -f shown above as it came
        raise RgtError(f"{what}: {err}")
    return True


def _follow(remote: Remote, argv: List[str], out: IO[bytes], label: str) -> Tuple[int, str]:
    """Follow the agent's log to ``out`` until it ends or ^C: its exit status (negative: the
    signal that ended it), and the last of its stderr as one printable line."""
    proc = remote.popen(argv)
    stream = proc.stdout
    assert stream is not None
    interrupted = False
    try:
        for chunk in iter(lambda: os.read(stream.fileno(), 65536), b""):
            out.write(chunk)
            out.flush()
    except KeyboardInterrupt:
        interrupted = True
        proc.terminate()
    except BaseException:  # ``out`` gone (`| head` done: EPIPE; a closed terminal: EIO): the
        proc.kill()  # ssh ends with rgt, not at the log's next line, however late that comes
        raise
    rc = proc.wait()
    if interrupted:
        # The ssh client, stopped above (the terminal's ^C does not reach it: children.py),
        # exits 255 on it: the person stopped reading, the box was not lost.
        return 0, ""
    if rc == 255:
        raise RemoteUnreachable(f"lost {label} while following the log")
    return rc, printable(proc.err_tail.decode(errors="replace").strip()[-300:])


def stop(rec: RunRecord, grace: Optional[str]) -> int:
    rec.check_on_box("rgt stop")  # taken down: stopped, and nothing of it is left on a box
    if rec.scheduler.get("kind") == "slurm":  # the agent, then scancel
        from controller.slurm import runs

        return runs.stop(rec, grace)
    remote = open_remote(rec.target)
    try:
        res = remote.run(
            rec.agent_argv("stop", rec.name, *(["--grace", grace] if grace else [])),
            timeout=900,
            limit=STOP_OUTPUT,
            over="tail",  # the stop goes on to its end whatever it prints
        )
    finally:
        remote.close()  # its ssh master does not stay on for a minute after rgt
    sys.stdout.write(printable_lines(res.text))  # the box's agent's words
    sys.stderr.write(printable_lines(res.err))
    return res.rc


# What of `rgt-agent stop`'s output is shown, its last bytes (they say how it ended; never cut).
STOP_OUTPUT = 256 << 10
