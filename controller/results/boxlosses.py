"""What ``rgt down`` loses on the box: the files of the run's directory, and what the job wrote
in its release, that the verification receipt does not hold, nor a store that outlives the box
(controller/results/storekept.py). Sizes are read on the box (controller/shell/down.sh); names
and sizes are the box's, shown to the user as down's plan (controller/results/down.py)."""

from __future__ import annotations

import os
import re
from typing import Any, Dict, List, Optional, Tuple

from controller.deploy.release import deploy_path, release_path
from controller.registry import RunRecord
from controller.remote import Remote
from controller.results import meterplan, storekept
from controller.results.receipt import Receipt
from controller.shell import script
from onbox.common.safepath import UnsafePath, safe_abs
from onbox.profiles.schema import Profile

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


def _job_files(rec: RunRecord, run_dir: str, remote: Remote) -> Tuple[str, str, Dict[str, int]]:
    """(release, fate, files): the run's release on the box ("": none), what down does with it
    ("removed", "kept": another run uses it, "none": not there) and, when removed, the files
    the job wrote in it (rgt_job_files: one round trip)."""
    if not rec.release or not RELEASE.match(rec.release):
        return "", "none", {}
    home = rec.box_home.rstrip("/")
    release = release_path(home, rec.release)
    fields = remote.sh(
        _JOB_FILES, run_dir, deploy_path(home, rec.name), release, timeout=600
    ).stdout.split(b"\0")
    fate = fields[0].decode("ascii", "replace") if len(fields) > 1 else ""
    # An answer that is none of the three words: judged as removed, which shows the most lost.
    fate = fate if fate in ("removed", "kept", "none") else "removed"
    return release, fate, _pairs(fields[1:]) if fate == "removed" else {}


def _in_release(ckpt: str, real: str, release: str, fate: str) -> Tuple[List[str], List[str]]:
    """(lost, kept): the line of a checkpoint dir inside the run's release (the job's workdir):
    it goes with the release, which down removes unless another run uses it."""
    name = ckpt if real == ckpt else f"{ckpt} -> {real}"
    rel = os.path.basename(release)
    if fate == "removed":
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
) -> tuple[List[str], List[str]]:
    """(lost, kept) lines: the run dir's files the receipt does not cover. A job log pulled
    redacted (its box copy holds a secret) is covered, whatever its size: what the receipt has
    is that log with each secret masked, and the kept lines say so. A checkpoint file that
    ``held`` (a store that outlives the box) has sealed is kept there, not lost."""
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
    judged = inside or (in_rel and fate == "removed")
    records, records_bytes = 0, 0
    in_store: List[Tuple[int, str, int]] = []
    dirs = [run_dir] + ([real_ckpt] if judged and not inside else [])
    for path, size in sorted(_box_sizes(remote, *dirs).items()):
        # rgt_sizes follows no link below the run dir: the rest of the path is where it is.
        at = real_run + path[len(run_dir.rstrip("/")) :] if _inside(path, run_dir) else path
        if judged and _inside(at, real_ckpt):
            rel = "checkpoints/" + os.path.relpath(at, real_ckpt)
            if pulled.get(rel) == size:
                continue
            step = storekept.holding(held, rel[len("checkpoints/") :], size)
            if step is None:
                lost.append(f"checkpoint {os.path.relpath(at, real_ckpt)} ({human(size)})")
            else:
                in_store.append((step, rel[len("checkpoints/") :], size))
            continue
        m = _JOB_LOG.match(os.path.relpath(path, run_dir))
        if m:
            log = f"logs/attempt-{m.group(1)}.log"
            if m.group(2):  # the agent's redacted copy of the log: counted with the log
                continue
            if log in redacted:
                kept.append(
                    f"job log of attempt {int(m.group(1))}: pulled redacted (each secret "
                    f"masked) in {receipt.dest}"
                )
            elif pulled.get(log) != size:
                lost.append(f"job log of attempt {int(m.group(1))} ({human(size)})")
            continue
        records += 1
        records_bytes += size
    kept += storekept.grouped(in_store, str(rec.store), human)
    skip = real_ckpt if judged and not inside else ""  # its checkpoints are judged above
    lost += _workdir_losses(rec, spec, pulled, (release, real_rel), job_files, skip)
    if records:
        lost.append(
            f"rgt's records of the run (state, events, agent log): {records} files, "
            f"{human(records_bytes)}"
            + (" (the store keeps a mirror of state and events)" if rec.store else "")
        )
    return lost, kept


def _workdir_losses(
    rec: RunRecord,
    spec: Dict[str, Any],
    pulled: Dict[str, int],
    releases: Tuple[str, str],
    found: Dict[str, int],
    skip: str,
) -> List[str]:
    """Lost lines for what the job wrote in its release (it runs there, and down removes the
    release unless another run uses it: ``found``, rgt_job_files) that the receipt does not
    hold: a declared output is held as ``outputs/<path under the workdir>`` with its size;
    anything else is lost. ``releases``: the release's path and where it is on the box; a file
    there under ``skip`` (a checkpoint dir, judged with the checkpoints) is left out."""
    release, real_rel = releases
    workdir = str(spec.get("workdir") or rec.workdir or release)
    lost = []
    for path, size in sorted(found.items()):
        at = real_rel + path[len(release.rstrip("/")) :] if _inside(path, release) else path
        if skip and _inside(at, skip):
            continue
        if (
            _inside(path, workdir)
            and pulled.get(f"outputs/{os.path.relpath(path, workdir)}") == size
        ):
            continue
        lost.append(
            f"written by the job in its workdir: {os.path.relpath(path, release)} ({human(size)})"
        )
    return lost
