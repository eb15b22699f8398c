"""What ``rgt down`` loses on the box: the files of the run's directory, and what the job wrote
in its release, that the verification receipt does not hold, nor a store that outlives the box
(controller/results/storekept.py). Sizes are read on the box (controller/shell/down.sh); names
and sizes are the box's, shown to the user as down's plan (controller/results/downplan.py)."""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Dict, List, Optional, Set, Tuple

from controller.deploy.release import deploy_path, release_path
from controller.registry import RunRecord
from controller.remote import Remote
from controller.results import meterplan, storekept
from controller.results.receipt import Receipt
from controller.shell import script
from onbox.common import jsondoc
from onbox.common.safepath import UnsafePath, safe_abs
from onbox.profiles.schema import Profile
from onbox.sealing import discovery

# A release's name as rgt makes one (a content hash).
RELEASE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
# A job's log in the run directory, or the redacted copy the agent wrote next to it.
_JOB_LOG = re.compile(r"attempts/(\d{4,})/output(\.redacted)?\.log\Z")
# down's shell on the box (controller/shell/down.sh, after release_use.sh where it looks at who
# uses a release), with the call of one of its functions.
_SIZES = script("down.sh") + 'rgt_sizes "$@"\n'
_REAL = script("down.sh") + 'rgt_real "$@"\n'
_JOB_FILES = script("release_use.sh") + script("down.sh") + 'rgt_job_files "$@"\n'


def human(n: float) -> str:
    """``n`` bytes for a person, as down shows sizes: "512 B", "4.0 KiB"."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _pairs(fields: List[bytes]) -> Dict[str, int]:
    """The (size, path) pairs of NUL-separated ``fields`` (rgt_sizes), by path; a pair whose
    size is no number is left out."""
    out = {}
    for i in range(0, len(fields) - 1, 2):
        try:
            out[fields[i + 1].decode("utf-8", "surrogateescape")] = int(fields[i])
        except ValueError:
            continue
    return out


def _box_sizes(remote: Remote, *dirs: str) -> Dict[str, int]:
    return _pairs(remote.sh(_SIZES, *dirs, timeout=600).stdout.split(b"\0"))


def _inside(path: str, d: str) -> bool:
    return path == d or path.startswith(d.rstrip("/") + "/")


def _box_real(remote: Remote, ckpt: str, run_dir: str, release: str) -> Tuple[str, str, str]:
    """(checkpoint dir, run dir, release) where they physically are on the box, every symlink
    on their paths followed; the first two as given when either is no directory there, or the
    box's answer is not absolute paths (then down judges by the names, as before); the release
    as given when it is not there (``release`` "": the run has none)."""
    dirs = [ckpt, run_dir] + ([release] if release else [])
    fields = remote.sh(_REAL, *dirs, timeout=60).stdout.split(b"\0")
    real = [f.decode("utf-8", "surrogateescape") for f in fields[:-1]]
    if len(fields) != len(dirs) + 1 or fields[-1] != b"":
        return ckpt, run_dir, release
    try:
        real_rel = safe_abs(real[2]) if release and real[2] else release
    except UnsafePath:
        real_rel = release
    try:
        return safe_abs(real[0]), safe_abs(real[1]), real_rel
    except UnsafePath:
        return ckpt, run_dir, real_rel


def store_dir(rec: RunRecord, remote: Remote) -> Optional[str]:
    """Where the run's ``file://`` store physically is on the box (every symlink on its path
    followed: a store named on a mount that outlives the box but linked to the box's own disk
    goes with that disk); its path as named when it is no directory there or the box's answer
    is not an absolute path; None for a store off the box (or none)."""
    path = meterplan.file_path(rec.store or "")
    if path is None:
        return None
    fields = remote.sh(_REAL, path, timeout=60).stdout.split(b"\0")
    if len(fields) != 2 or fields[-1] != b"" or not fields[0]:
        return path
    try:
        return safe_abs(fields[0].decode("utf-8", "surrogateescape"))
    except UnsafePath:
        return path


def _job_files(
    rec: RunRecord, run_dir: str, remote: Remote
) -> Tuple[str, str, Optional[Dict[str, int]]]:
    """(release, fate, files): the run's release on the box ("": none), what down does with it
    ("removed"; "unmarked": removed, and it has no marker; "kept": another run uses it;
    "none": not there) and the files the job wrote in it: changed since the push marked it
    complete, so no pushed file the job left alone (rgt_job_files: one round trip); None where
    that cannot be told (no marker)."""
    if not rec.release or not RELEASE.match(rec.release):
        return "", "none", {}
    home = rec.box_home.rstrip("/")
    release = release_path(home, rec.release)
    fields = remote.sh(
        _JOB_FILES, run_dir, deploy_path(home, rec.name), release, timeout=600
    ).stdout.split(b"\0")
    fate = fields[0].decode("ascii", "replace") if len(fields) > 1 else ""
    if fate == "unmarked":
        return release, fate, None
    # An answer that is none of the words: judged as a release removed without its marker,
    # which shows the most lost.
    if fate not in ("removed", "kept", "none"):
        return release, "unmarked", None
    return release, fate, _pairs(fields[1:]) if fate == "removed" else {}


def _real(path: str, given: str, real: str) -> str:
    """``path`` under the directory ``given`` where it is on the box (``given`` at ``real``)."""
    return real + path[len(given.rstrip("/")) :] if _inside(path, given) else path


def _in_release(ckpt: str, real: str, release: str, fate: str) -> Tuple[List[str], List[str]]:
    """(lost, kept): the line of a checkpoint dir inside the run's release (the job's workdir):
    it goes with the release, which down removes unless another run uses it."""
    name = ckpt if real == ckpt else f"{ckpt} -> {real}"
    rel = os.path.basename(release)
    if fate in ("removed", "unmarked"):
        return [f"the checkpoint dir {name} (in the release {rel}: removed with it, as no "
                "other run uses it)"], []  # fmt: skip
    if fate == "kept":
        return [], [f"the checkpoint dir {name} on the box (in the release {rel}, which "
                    "another run uses: not removed)"]  # fmt: skip
    return [], []


def _outside(ckpt: str, real: str, profile: Optional[Profile]) -> Tuple[List[str], List[str]]:
    """(lost, kept): the line of a checkpoint dir that is not in the run dir, so not removed
    (``real``: where it is on the box; a dir linked to a data disk is there): lost only when
    the meter-stop deletes the storage it is on."""
    name = ckpt if real == ckpt else f"{ckpt} -> {real}"
    gone = meterplan.deleted_by_meter_stop(real, profile)
    if gone:
        return [f"the checkpoint dir {name} (outside the run dir, not removed): {gone}"], []
    return [], [f"the checkpoint dir {name} on the box (outside the run dir: not removed)"]


def losses(
    rec: RunRecord,
    receipt: Receipt,
    spec: Dict[str, Any],
    run_dir: str,
    remote: Remote,
    profile: Optional[Profile],
    held: storekept.Held,
    logs: Optional[Logs] = None,
) -> Tuple[List[str], List[str], str]:
    """(lost, kept, with_release): lines of the run dir's files the receipt does not cover,
    and the checkpoint dir that goes with the release, for down's line that removes it ("":
    none; ``in_release``). A job log pulled redacted (its box copy holds a secret) is covered,
    whatever its size: what the receipt has is that log with each secret masked, and the kept
    lines say so. A checkpoint file that ``held`` (a store that outlives the box) has sealed is
    kept there, not lost; so is a job log ``logs`` says it holds. ``logs`` also says whether
    the stop down makes seals the logs into that store (a live run's: its agent seals them as
    the run ends STOPPED)."""
    pulled = {f.path: f.size for f in receipt.files}
    redacted = {f.path for f in receipt.files if f.redacted}
    ckpt = str(spec.get("ckpt_dir") or "")
    kept: List[str] = []
    lost: List[str] = []
    release, fate, job_files = _job_files(rec, run_dir, remote)
    # Judged where the dirs are: down removes the run dir without following a link in it, so a
    # checkpoint dir linked to a data disk stays (said so), one linked into the run dir goes;
    # one in the release (the job's workdir) goes with it where down removes the release.
    real_ckpt, real_run, real_rel = (
        _box_real(remote, ckpt, run_dir, release) if ckpt else ("", run_dir, release)
    )
    inside = bool(ckpt) and _inside(real_ckpt, real_run)
    in_rel = bool(ckpt and release) and not inside and _inside(real_ckpt, real_rel)
    if in_rel:
        lost, kept = _in_release(ckpt, real_ckpt, release, fate)
    elif ckpt and not inside:
        lost, kept = _outside(ckpt, real_ckpt, profile)
    # Its files are judged as checkpoints where they go: with the run dir, or with the release.
    skip = real_ckpt if in_rel and fate in ("removed", "unmarked") else ""
    found = job_files or {}
    workdir = str(spec.get("workdir") or rec.workdir or release)
    # In the release, only what the job wrote there: the pushed code (a checkpoint dir may be
    # the release itself, `--ckpt-dir .`) is on the laptop. A release without its marker does
    # not tell them apart: every file of the checkpoint dir is judged, which shows the most.
    files = _box_sizes(remote, run_dir, *([skip] if skip and job_files is None else []))
    files.update(
        (p, n) for p, n in found.items() if skip and _inside(_real(p, release, real_rel), skip)
    )
    records, records_bytes = 0, 0
    in_store: List[Tuple[int, str, int]] = []
    # Its logs' names in the store: the epoch each was sealed under, else the newest writer's.
    epoch, sealed = _box_epochs(remote, run_dir) if rec.store else (None, {})
    for path, size in sorted(files.items()):
        # rgt_sizes and find follow no link below the dirs: the rest of the path is where it is.
        at = _real(path, release, real_rel) if release else path
        at = _real(at, run_dir, real_run)
        if (inside or skip) and _inside(at, real_ckpt):
            held_as = (pulled, held, workdir, not skip or job_files is not None)
            _checkpoint(os.path.relpath(at, real_ckpt), path, size, held_as, (lost, in_store))
            continue
        m = _JOB_LOG.match(os.path.relpath(path, run_dir))
        if m:
            if not m.group(2):  # else the agent's redacted copy of the log: counted with it
                receipt_has = (pulled, redacted, receipt.dest)
                was = [e for e in (sealed.get(int(m.group(1))), epoch) if e is not None]
                _job_log((m.group(1), was), size, receipt_has, logs, rec, (lost, kept))
            continue
        records += 1
        records_bytes += size
    kept += storekept.grouped(in_store, str(rec.store), human)
    lost += _workdir_losses(workdir, pulled, (release, real_rel), found, skip)
    if records:
        lost.append(
            f"rgt's records of the run (state, events, agent log): {records} files, "
            f"{human(records_bytes)}"
            + (" (the store keeps a mirror of state and events)" if rec.store else "")
        )
    return lost, kept, in_release(real_ckpt, real_rel) if in_rel and fate != "none" else ""


def _job_log(
    attempt_of: Tuple[str, List[int]],
    size: int,
    receipt: Tuple[Dict[str, int], Set[str], str],
    logs: Optional[Logs],
    rec: RunRecord,
    into: Tuple[List[str], List[str]],
) -> None:
    """Judge the job's log of the attempt numbered ``digits`` (``size`` bytes on the box), of
    the epochs it may be sealed under (``attempt_of``: the one the box's record says, and the
    box's newest writer's; none known: []): covered where the receipt (its files by path,
    those pulled redacted, its dest) holds it whole or redacted, kept where the store holds it
    (``logs``), else lost (``into``: the lost and kept lines). In a store the log is named by
    such an epoch (``logs/e<epoch>/attempt-NNNN.log``: another box's log of the same attempt
    number is another log), or by the name agents from before epochs gave it."""
    digits, epochs = attempt_of
    pulled, redacted, dest = receipt
    lost, kept = into
    attempt = int(digits)
    names = [f"logs/attempt-{digits}.log"]
    names += [f"logs/e{epoch}/attempt-{digits}.log" for epoch in epochs]
    if any(log in redacted for log in names):
        kept.append(f"job log of attempt {attempt}: pulled redacted (each secret masked) in {dest}")
    elif all(pulled.get(log) != size for log in names):
        where = ""  # the kept words, once the store is found to hold it
        for log in names:
            where = where or _log_in_store(log, size, logs, str(rec.store))
        line = f"job log of attempt {attempt}"
        (kept if where else lost).append(line + (where or f" ({human(size)})"))


def _box_epochs(remote: Remote, run_dir: str) -> Tuple[Optional[int], Dict[int, int]]:
    """The epoch the box's newest writer of the run took (its run dir's epoch.json,
    onbox/agent/ownership.py), or None when it has none or what the box says is not one; and
    {attempt: the epoch its log was sealed under} (logs-sealed.json, onbox/agent/sealedlogs.py),
    each entry that is not one left out. One command reads both, each followed by an ASCII
    record separator (a JSON document holds none unescaped)."""
    r = remote.sh(
        'for f in "$1" "$2"; do [ -f "$f" ] && head -c 1048576 -- "$f"; printf \'\\036\'; done',
        os.path.join(run_dir, "epoch.json"),
        os.path.join(run_dir, "logs-sealed.json"),
        timeout=60,
    )
    parts = r.stdout.split(b"\x1e") if r.rc == 0 else []
    epoch = _doc(parts[0]).get("epoch") if parts else None
    attempts = _doc(parts[1]).get("attempts") if len(parts) > 1 else None
    sealed: Dict[int, int] = {}
    for key, was in attempts.items() if isinstance(attempts, dict) else ():
        at = _epoch(was.get("epoch")) if isinstance(was, dict) else None
        if isinstance(key, str) and key.isdigit() and len(key) < 10 and at is not None:
            sealed[int(key)] = at
    return _epoch(epoch), sealed


def _doc(text: bytes) -> Dict[str, Any]:
    """The JSON object ``text`` holds, or {} when it holds none."""
    try:
        doc = jsondoc.loads(text) if text else {}
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def _epoch(value: Any) -> Optional[int]:
    """``value`` when it is an epoch (an integer, not a bool, from 1 below 2**63), else None."""
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 < value < 1 << 63
    return value if ok else None


def in_release(real_ckpt: str, real_rel: str) -> str:
    """The checkpoint dir at ``real_ckpt``, inside the release at ``real_rel``, as down's line
    that removes the release names it: by its place there."""
    if real_ckpt.rstrip("/") == real_rel.rstrip("/"):
        return "the checkpoint dir, which is the release itself"
    return f"the checkpoint dir {os.path.relpath(real_ckpt, real_rel)}/ inside it"


def _checkpoint(
    rel: str,
    path: str,
    size: int,
    held_as: Tuple[Dict[str, int], storekept.Held, str, bool],
    into: Tuple[List[str], List[Tuple[int, str, int]]],
) -> None:
    """Judge the file ``rel`` of the checkpoint dir (``path`` as the box listed it): nothing
    where the receipt holds it (as ``checkpoints/<rel>``, or as a declared output: a checkpoint
    dir may be the workdir), else its lost line or its entry in the store that holds it
    (``into``: the lost lines and those entries). ``held_as``: the receipt's files by path, what
    the store holds, the workdir, and whether the job wrote the file (False: a release without
    its marker, where a pushed file cannot be told from the job's). A file that is no
    checkpoint (``_is_checkpoint``) is lost as the file it is, not as a checkpoint."""
    pulled, held, workdir, written = held_as
    if pulled.get(f"checkpoints/{rel}") == size or _pulled_output(path, size, workdir, pulled):
        return
    step = storekept.holding(held, rel, size)
    if step is not None:
        into[1].append((step, rel, size))
    elif _is_checkpoint(rel):
        into[0].append(f"checkpoint {rel} ({human(size)})")
    else:  # notes.txt in a checkpoint dir that is the workdir (`--ckpt-dir .`), a config
        who = "the job wrote " if written else ""
        into[0].append(f"file {rel} {who}in the checkpoint dir ({human(size)})")


def _is_checkpoint(rel: str) -> bool:
    """Whether the file ``rel`` of the checkpoint dir is worded as a checkpoint in down's plan:
    a loose file in a checkpoint format (onbox/sealing/discovery.py), or a file of a directory
    named for a step (``checkpoint-500/config.json``); no hidden or temporary name on the way.
    Only words: the file is judged (kept, pulled or lost) the same either way."""
    parts = rel.split("/")
    if any(discovery.skip(p) for p in parts):
        return False
    if len(parts) == 1:
        return discovery.is_ckpt_file(rel)
    return discovery.step_from_name(parts[0]) is not None or discovery.is_ckpt_file(parts[-1])


def _pulled_output(path: str, size: int, workdir: str, pulled: Dict[str, int]) -> bool:
    """Whether the receipt holds ``path`` as a declared output: ``outputs/<path under the
    workdir>``, with its size."""
    return (
        _inside(path, workdir) and pulled.get(f"outputs/{os.path.relpath(path, workdir)}") == size
    )


@dataclasses.dataclass(frozen=True)
class Logs:
    """The job's logs a store that outlives the box holds (storekept.logs: by their name in a
    pull, (size, redacted)), and whether down's stop seals them there (a live run)."""

    held: Dict[str, Tuple[int, bool]]
    stop_seals: bool = False


def _log_in_store(log: str, size: int, logs: Optional[Logs], store: str) -> str:
    """The kept words for the box's job log ``log`` of ``size`` bytes that the store holds
    (as it is, or redacted), or that down's stop seals there; "" when neither."""
    if logs is None:
        return ""
    there = logs.held.get(log)
    if there is not None and there[1]:
        return f": sealed redacted (each secret masked) in the store {store}"
    if there is not None and there[0] == size:
        return f": sealed in the store {store}"
    if logs.stop_seals:
        return f": the stop seals it into the store {store} (ENDED.json)"
    return ""


def _workdir_losses(
    workdir: str,
    pulled: Dict[str, int],
    releases: Tuple[str, str],
    found: Dict[str, int],
    skip: str,
) -> List[str]:
    """Lost lines for what the job wrote in its release (it runs there, ``workdir``, and down
    removes the release unless another run uses it: ``found``, rgt_job_files) that the receipt
    does not hold as a declared output; anything else is lost. ``releases``: the release's
    path and where it is on the box; a file there under ``skip`` (a checkpoint dir, judged with
    the checkpoints) is left out."""
    release, real_rel = releases
    lost = []
    for path, size in sorted(found.items()):
        if skip and _inside(_real(path, release, real_rel), skip):
            continue
        if _pulled_output(path, size, workdir, pulled):
            continue
        lost.append(
            f"written by the job in its workdir: {os.path.relpath(path, release)} ({human(size)})"
        )
    return lost
