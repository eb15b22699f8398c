"""A run without a store, as ``rgt pull`` takes it from the box: once the run has ended and its
agent has let go of it, every file of its checkpoint dir, outputs and job logs, hashed on the box
(controller/results/pull.py's docstring says which); every name the box prints is checked."""

from __future__ import annotations

import re
import time
from typing import Any, Dict, List, Tuple

from controller import boxrun
from controller.registry import RunRecord
from controller.remote import Remote
from controller.results import boxlinks
from controller.results.entries import (
    MAX_SIZE_DIGITS,
    SHA256_HEX,
    Entry,
    Sealed,
    box_join,
    checked,
    sha_hex,
)
from controller.results.receipt import SealedId
from controller.shell import script
from onbox.agent.states import TERMINAL_NAMES
from onbox.common.errors import HostError, IntegrityError, NotFound, UsageError
from onbox.common.safepath import UnsafePath, safe_abs, safe_rel

_LIST_SCRIPT = script("boxfiles.sh")  # each file listed: kind, sha256, size, path
# The most bytes of that listing read (some 2,000,000 files of 100-byte paths); a box listing
# more is refused rather than held.
MAX_LISTING = 256 << 20


def box_files(rec: RunRecord, remote: Remote) -> Sealed:
    """A run without a store: its files on the box, hashed there (controller/results/pull.py's
    docstring says which).

    Every name the box prints must lie under the directory it was asked to list (absolute,
    normalised, as ``boxrun.spec_dirs`` requires of the roots); the staging name is that path on
    the box, the final name the part under the root, both checked by ``checked``."""
    run = boxrun.read(rec, remote)  # the spec and the status in one round trip
    status = _let_go(rec, remote, run.status)
    ckpt, workdir = boxrun.spec_dirs(rec, run.spec, remote)
    attempts = boxrun.run_dir(rec).attempts
    # (kind, the path listed, the directory final names are relative to, their prefix)
    roots = [("checkpoint", ckpt, ckpt, "checkpoints/"), ("log", attempts, attempts, "logs/")]
    outputs = run.spec.get("outputs") or []
    if not isinstance(outputs, list):
        raise IntegrityError(f"spec.json of {rec.name!r}: outputs is not a list")
    for out in outputs:
        # The agent keeps outputs as the job file gave them ("out/", "./out"): normalised
        # here, then refused if anything but a plain path under the workdir is left.
        parts = [p for p in str(out).split("/") if p not in ("", ".")]
        rel = (
            safe_rel("/".join(parts), f"spec.json of {rec.name!r}: output {out!r}") if parts else ""
        )
        roots.append(("output", box_join(workdir, rel) if rel else workdir, workdir, "outputs/"))
    entries, logs, listed, real = _listed(rec, remote, roots)
    entries.update(_job_logs(rec, remote, status, logs))
    if not entries:
        raise NotFound(f"run {rec.name!r} has no files on {remote.target.label} to pull")
    # The links are not in the listing's hash: as a MANIFEST's are not in a receipt's
    # comparison, the files tell one state from another (and a receipt written before links
    # were pulled still covers the same files).
    links, left = boxlinks.judged(listed, ckpt, set(entries), real)
    listing = "".join(
        f"{e.path}\0{e.size}\0{e.sha256}\n" for e in sorted(entries.values(), key=lambda e: e.path)
    )
    return checked(
        Sealed(
            SealedId(
                listing_sha256=sha_hex(listing.encode("utf-8", "surrogateescape")),
                left_out=tuple(left),
                links=tuple(links),
            ),
            list(entries.values()),
            "box",
            box_root="/",
        ),
        f"pull of {rec.name}",
    )


_Root = Tuple[str, str, str, str]


def _listed(
    rec: RunRecord, remote: Remote, roots: List[_Root]
) -> Tuple[Dict[str, Entry], Dict[Tuple[str, bool], Entry], List[boxlinks.Listed], str]:
    """The files under ``roots`` as the box lists and hashes them: (entries by final name, the
    job's logs by (attempt, redacted copy?), the links it lists, for boxlinks to judge, where
    the checkpoint dir leads when it is a link, else "")."""
    args: List[str] = []
    for kind, listed, _, _ in roots:
        args += [kind, listed]
    what = f"the listing of {rec.name}'s files (find and sha256sum)"
    r = remote.sh(_LIST_SCRIPT, *args, timeout=3600, limit=MAX_LISTING, what=what)
    if r.rc != 0:
        raise HostError(
            f"listing and hashing the files of {rec.name!r} on {remote.target.label} failed: "
            f"{r.err.strip()[-300:]}"
        )
    fields = r.stdout.split(b"\0")
    if len(fields) % 4 != 1 or fields[-1] != b"":
        raise IntegrityError(
            f"the listing of {rec.name!r}'s files on {remote.target.label} does not add up "
            f"({len(fields) - 1} fields, not four per file)"
        )
    entries: Dict[str, Entry] = {}
    logs: Dict[Tuple[str, bool], Entry] = {}  # (attempt, redacted copy?) -> its entry
    links: List[boxlinks.Listed] = []
    real = ""
    for i in range(0, len(fields) - 1, 4):
        kind, sha, size, raw = (x.decode("utf-8", "surrogateescape") for x in fields[i : i + 4])
        if kind == "root":  # "root", "checkpoint", where the checkpoint dir leads, its path
            if sha != "checkpoint" or raw != roots[0][1]:
                raise IntegrityError(f"the box listed {raw!r} as a root it was not asked for")
            real = safe_abs(size, f"where the checkpoint dir {raw!r} leads on the box")
            continue
        if kind == "link":  # "link", the kind, its target, its path: judged once all are in
            kind, target = sha, size
            base, prefix = _root_of(roots, kind, raw)
            links.append((kind, prefix + raw[len(base) + 1 :], raw[len(base) + 1 :], target))
            continue
        size_ok = size.isascii() and size.isdigit() and len(size) <= MAX_SIZE_DIGITS
        if not SHA256_HEX.match(sha) or not size_ok:
            raise IntegrityError(f"the box listed {raw!r} with a malformed hash or size")
        base, prefix = _root_of(roots, kind, raw)
        rel = raw[len(base) + 1 :]
        if kind == "log":
            m = re.match(r"(\d{4,})/output(\.redacted)?\.log\Z", rel)
            if m:  # else the attempt's job.json/exit.json: rgt's records, not the job's log
                path = f"{prefix}attempt-{m.group(1)}.log"
                red = m.group(2) is not None
                logs[(m.group(1), red)] = Entry(path, kind, int(size), sha, None, raw[1:], raw, red)
            continue
        path = prefix + rel
        entries[path] = Entry(path, kind, int(size), sha, None, raw[1:], raw)
    return entries, logs, links, real


def _root_of(roots: List[_Root], kind: str, raw: str) -> Tuple[str, str]:
    """(the directory final names are relative to, their prefix) of the path ``raw`` the box
    listed as a ``kind``; UnsafePath when it lies under no directory it was asked to list."""
    root = next(
        (x for x in roots if x[0] == kind and (raw == x[1] or raw.startswith(x[1] + "/"))),
        None,
    )
    if root is None:
        raise UnsafePath(
            f"the box listed {raw!r} as a {kind}, outside every directory it was asked to list",
            raw,
        )
    return root[2], root[3]


# Seconds a pull of a run without a store waits for the agent of a run that has ended to let go
# of it (it stops what is left of the attempt, then writes the redacted copies of the logs).
AGENT_EXIT_WAIT = 60.0


def _let_go(
    rec: RunRecord, remote: Remote, status: Dict[str, Any], wait: float = AGENT_EXIT_WAIT
) -> Dict[str, Any]:
    """The status of a run without a store (``status`` as first read), once it has ended and
    its agent has let go of it (then no file of it is being written, and each job log that
    holds a secret has its redacted copy). A run that has not ended is refused."""
    deadline = time.monotonic() + wait
    while True:
        state = status.get("state")
        if state not in TERMINAL_NAMES:
            raise UsageError(
                "run",
                f"{rec.name!r} is {state} and has no store: its files are still being written",
                f"stop it first (rgt stop {rec.name}), or deploy with --store",
            )
        agent = status.get("agent")
        if not (isinstance(agent, dict) and agent.get("alive")):
            return status
        if time.monotonic() >= deadline:
            raise HostError(
                f"run {rec.name!r} is {state}, but its agent on {remote.target.label} has not "
                f"let go of it after {wait:.0f}s",
                f"look at `rgt-agent logs {rec.name} --agent` on the box, then pull again",
            )
        time.sleep(0.2)
        status = boxrun.status(rec, remote)


def _job_logs(
    rec: RunRecord, remote: Remote, status: Dict[str, Any], logs: Dict[Tuple[str, bool], Entry]
) -> Dict[str, Entry]:
    """The job's log of each attempt as a run without a store is pulled: the redacted copy
    where the agent wrote one (the log holds a secret), else the log. A log the agent found a
    secret in but could not copy (its warning has ``copy`` null) is refused (HostError): rgt
    does not bring the secret to the laptop."""
    no_copy = set()
    for w in status.get("warnings") or []:
        if isinstance(w, dict) and w.get("kind") == "secret_in_log" and w.get("copy", 0) is None:
            no_copy.add(w.get("attempt"))
    out = {}
    for attempt in sorted({a for a, _ in logs}):
        e = logs.get((attempt, True)) or logs[(attempt, False)]
        if not e.redacted and int(attempt) in no_copy:
            raise HostError(
                f"pull of {rec.name}: the job's log of attempt {int(attempt)} on "
                f"{remote.target.label} ({e.origin}) holds a secret and the agent could not "
                "write a redacted copy of it, so rgt does not bring it to the laptop; nothing "
                "was fetched",
                f"read it on the box (rgt logs {rec.name}); to pull the rest, move it out of "
                "the run's directory there and pull again",
            )
        out[e.path] = e
    return out
