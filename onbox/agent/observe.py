"""Reading a run without changing it: its status (with the health verdicts), its logs, and what
``rgt report`` draws.

What status prints and what ``logs --agent`` copies pass through the box's redactor
(onbox/common/redact.py); the job's own output (``logs`` without ``--agent``) is the job's,
unaltered.
"""

from __future__ import annotations

import time
from typing import IO, Any, Dict, List, Optional

from onbox.agent import procfs
from onbox.agent.lock import is_held, read_holder
from onbox.agent.states import TERMINAL_NAMES, State
from onbox.common import progress, redact
from onbox.common.durable import read_json
from onbox.common.rundir import RunDir
from onbox.common.terminal import printable

# Fields of state.json that are bookkeeping for the agent, not for people.
_PRIVATE = (
    "started_ts",
    "updated_ts",
    "attempt_started_ts",
    "backoff_until_ts",
    "oom_before",
    "kmsg_before",
    "exit_seen",
    "quick_failures",
    "last_cuda_oom_step",
    "resume_check",  # its verdicts are events
)


# Fields of a status document that are objects, and lists, where present.
_OBJECTS = ("agent", "last_exit", "progress", "health", "scheduler", "stop", "kill", "budgets")
_LISTS = ("warnings", "command")


def public_state(doc: Dict[str, Any]) -> Dict[str, Any]:
    """state.json without the agent's own bookkeeping: what status shows, from the box or from
    the store's mirror alike (``shaped``)."""
    return shaped({k: v for k, v in doc.items() if k not in _PRIVATE})


def shaped(doc: Dict[str, Any]) -> Dict[str, Any]:
    """A status document whose object fields are objects (or None) and list fields lists, so
    that every reader may ``.get`` them: on the laptop the document is the box's or the store's
    (untrusted), and on the box a damaged state.json must not end ``status`` in a traceback."""
    out = dict(doc)
    for k in _OBJECTS:
        if k in out and not isinstance(out[k], dict):
            out[k] = None
    for k in _LISTS:
        if k in out and not isinstance(out[k], list):
            out[k] = []
    return out


def run_status(rd: RunDir) -> Dict[str, Any]:
    """state.json for people: plus whether an agent holds the run and whether the job lives."""
    doc = read_json(rd.state) or {
        "name": rd.name,
        "state": State.PENDING.value,
        "pid": None,
        "attempt": 0,
        "restarts": 0,
        "last_exit": None,
        "started_at": None,
        "updated_at": None,
    }
    out = public_state(doc)
    held = is_held(rd.lock)
    holder = read_holder(rd.lock) if held else None
    out["agent"] = {
        "alive": held,
        "pid": holder.get("pid") if holder else None,
        "host": holder.get("host") if holder else None,
    }
    job_alive = False
    if doc.get("attempt"):
        rec = read_json(rd.job_record(doc["attempt"]))
        if rec is not None and doc.get("state") not in TERMINAL_NAMES:
            job_alive = procfs.is_alive(procfs.Identity(rec["pid"], rec["start_ticks"]))
    out["job_alive"] = job_alive
    out["run_dir"] = rd.path
    out["log"] = rd.output_log(doc["attempt"]) if doc.get("attempt") else None
    out["progress"] = last_progress(rd)
    # Secret values the job printed into its sealed logs (onbox/agent/sealservice.py): which log,
    # never
    # the value. Always present, so that a reader can tell "none" from "not reported".
    out.setdefault("warnings", [])
    # state.json is redacted when written; this also covers the job's progress report and a
    # state written before a secret was added.
    redacted: Dict[str, Any] = redact.for_home(rd.home).redact_obj(out)
    return redacted


def warning_lines(doc: Dict[str, Any]) -> List[str]:
    """One line per entry of a status document's ``warnings``, for people (``rgt-agent
    status``, ``rgt status``): its ``reason``, which rgt writes from names (which log, which
    secret), never values. Control characters are shown as '?': on the laptop the document
    comes from the box or the store, and must not drive the terminal."""
    out = []
    warnings = doc.get("warnings")
    for w in warnings if isinstance(warnings, list) else []:
        text = str((w.get("reason") or w.get("kind")) if isinstance(w, dict) else w)
        out.append(printable(text))
    return out


# Levels of concern first: what a line is shown for (ok and unavailable go in the summary).
_CONCERN = ("alert", "warn", "unknown")


def health_lines(doc: Dict[str, Any], now: Optional[float] = None) -> List[str]:
    """The health probes' verdicts of a status document (state.json's ``health``), for people:
    one line per probe of concern (alert, warn, unknown; with its remedy), then a summary such
    as ``health: ok (7 probes, 12 s ago)``. None of it when the run has no probes. Control
    characters are shown as '?' (the document may come from the box or the store)."""
    health = doc.get("health")
    probes = health.get("probes") if isinstance(health, dict) else None
    if not isinstance(probes, dict) or not probes:
        return []
    out = []
    levels: Dict[str, List[str]] = {}
    for name, v in sorted(probes.items()):
        v = v if isinstance(v, dict) else {}
        level = str(v.get("level") or "unknown")
        levels.setdefault(level, []).append(str(name))
        if level in _CONCERN:
            line = f"{name}: {level}: {v.get('reason') or v.get('code') or ''}"
            if v.get("remedy"):
                line += f" ({v['remedy']})"
            out.append(printable(line))
    worst = next((lv for lv in _CONCERN if lv in levels), "ok" if "ok" in levels else "")
    worst = worst or "unavailable"  # no probe could run here: not "ok"
    parts = [f"{len(probes)} probes"]
    if levels.get("unavailable"):
        parts.append(f"unavailable here: {', '.join(levels['unavailable'])}")
    at = health.get("at") if isinstance(health, dict) else None
    if isinstance(at, (int, float)) and now is not None:
        parts.append(f"{max(0, int(now - at))} s ago")
    out.append(printable(f"health: {worst} ({'; '.join(parts)})"))
    return out


def report_data(rd: RunDir, max_rows: int = 5000, max_events: int = 2000) -> Dict[str, Any]:
    """What ``rgt report`` draws, in one document (``rgt-agent report-data``): the status, the
    health samples (onbox/health/series.py; at most ``max_rows``, evenly thinned, the last
    kept) and the last ``max_events`` events."""
    from onbox.agent.journal import read_events
    from onbox.health import series

    rows = series.read(rd.health)
    if len(rows) > max_rows:
        stride = -(-len(rows) // max_rows)
        rows = rows[::stride] + ([rows[-1]] if (len(rows) - 1) % stride else [])
    # Written redacted by the journal; again here for lines written before a secret was added.
    events = redact.for_home(rd.home).redact_obj(read_events(rd.events)[-max_events:])
    return {"status": run_status(rd), "samples": rows, "events": events, "now": time.time()}


def last_progress(rd: RunDir) -> Optional[Dict[str, Any]]:
    """The job's last progress report (onbox/common/progress.py), or None when it made none: its
    ``step``, the ``attempt`` that made it, its ``time`` (epoch seconds) and ``metrics``."""
    rep = progress.read(rd.path)
    if rep is None:
        return None
    out = {"step": rep["step"], "attempt": rep.get("attempt"), "time": rep.get("time")}
    if isinstance(rep.get("metrics"), dict):
        out["metrics"] = rep["metrics"]
    return out


def copy_logs(rd: RunDir, out: IO[bytes], agent: bool = False) -> Dict[str, int]:
    """Write every attempt's output (or the agent's log), oldest first, unaltered.

    Returns how far each file was read, for ``follow``.
    """
    paths = [rd.agent_log] if agent else [rd.output_log(a) for a in rd.attempt_numbers()]
    offsets: Dict[str, int] = {}
    for p in paths:
        offsets[p] = _copy_from(p, 0, out, redact.for_home(rd.home) if agent else None)
    return offsets


def _copy_from(
    path: str, offset: int, out: IO[bytes], redactor: Optional[redact.Redactor] = None
) -> int:
    """Copy ``path`` from ``offset`` on, through ``redactor`` when given (the agent's log)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            if redactor is not None:
                # The agent's log is written by the journal (redacted) and by the stderr of
                # rgt's own processes (the shim's is raw): redact on the way out as well. Its
                # lines are whole (one write each), so no secret is split between two reads.
                data = f.read()
                out.write(redactor.redact_bytes(data))
                offset += len(data)
            else:
                while True:
                    chunk = f.read(1 << 16)
                    if not chunk:
                        break
                    out.write(chunk)
                    offset += len(chunk)
    except FileNotFoundError:
        pass
    out.flush()
    return offset


def follow(
    rd: RunDir,
    out: IO[bytes],
    offsets: Dict[str, int],
    agent: bool = False,
    interval: float = 0.2,
    until_terminal: bool = True,
) -> None:
    """Keep writing what is appended (new attempts too) until the run ends."""
    while True:
        paths: List[str] = (
            [rd.agent_log] if agent else [rd.output_log(a) for a in rd.attempt_numbers()]
        )
        red = redact.for_home(rd.home) if agent else None
        for p in paths:
            offsets[p] = _copy_from(p, offsets.get(p, 0), out, red)
        doc = read_json(rd.state) or {}
        if until_terminal and doc.get("state") in TERMINAL_NAMES and not is_held(rd.lock):
            for p in paths:  # what was written between the last read and the end
                offsets[p] = _copy_from(p, offsets.get(p, 0), out, red)
            return
        time.sleep(interval)


def tagged_alive(rd: RunDir, attempt: int) -> List[int]:
    """Pids of live processes of ``attempt`` (zombies excluded)."""
    from onbox.agent.daemon import TAG_VAR  # (here: status and logs need not import the spawner)

    rec = read_json(rd.job_record(attempt)) if attempt else None
    if not rec:
        return []
    job = procfs.Identity(rec["pid"], rec["start_ticks"])
    shim = rec.get("shim")
    roots = [procfs.Identity(shim["pid"], shim["start_ticks"])] if shim else []
    found = {i.pid for i in procfs.find_attempt(TAG_VAR, rec["tag"], job, roots)}
    if procfs.is_alive(job):
        found.add(job.pid)
    return sorted(found)
