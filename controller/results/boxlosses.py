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


def _box_sizes(remote: Remote, *dirs: str, script: str = _SIZES) -> Dict[str, int]:
    r = remote.sh(script, *dirs, timeout=600)
    fields = r.stdout.split(b"\0")
    out = {}
    for i in range(0, len(fields) - 1, 2):
        try:
            out[fields[i + 1].decode("utf-8", "surrogateescape")] = int(fields[i])
        except ValueError:
            continue
    return out


def _inside(path: str, d: str) -> bool:
    return path == d or path.startswith(d.rstrip("/") + "/")


def _box_real(remote: Remote, ckpt: str, run_dir: str) -> Tuple[str, str]:
    """(checkpoint dir, run dir) where they physically are on the box, every symlink on their
    paths followed; their names as given when either is no directory there, or the box's
    answer is not two absolute paths (then down judges by the names, as before)."""
    fields = remote.sh(_REAL, ckpt, run_dir, timeout=60).stdout.split(b"\0")
    real = [f.decode("utf-8", "surrogateescape") for f in fields[:-1]]
    try:
        if len(fields) == 3 and fields[-1] == b"":
            return safe_abs(real[0]), safe_abs(real[1])
    except UnsafePath:
        pass
    return ckpt, run_dir


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
    # Judged where the dirs are: down removes the run dir without following a link in it, so a
    # checkpoint dir linked to a data disk stays (said so), one linked into the run dir goes.
    real_ckpt, real_run = _box_real(remote, ckpt, run_dir) if ckpt else ("", run_dir)
    inside = bool(ckpt) and _inside(real_ckpt, real_run)
    if ckpt and not inside:
        lost, kept = _outside(ckpt, real_ckpt, profile)
    records, records_bytes = 0, 0
    in_store: List[Tuple[int, str, int]] = []
    for path, size in sorted(_box_sizes(remote, run_dir).items()):
        # rgt_sizes follows no link below the run dir: the rest of the path is where it is.
        at = real_run + path[len(run_dir.rstrip("/")) :] if _inside(path, run_dir) else path
        if inside and _inside(at, real_ckpt):
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
    lost += _workdir_losses(rec, spec, pulled, run_dir, remote)
    if records:
        lost.append(
            f"rgt's records of the run (state, events, agent log): {records} files, "
            f"{human(records_bytes)}"
            + (" (the store keeps a mirror of state and events)" if rec.store else "")
        )
    return lost, kept


def _workdir_losses(
    rec: RunRecord, spec: Dict[str, Any], pulled: Dict[str, int], run_dir: str, remote: Remote
) -> List[str]:
    """Lost lines for what the job wrote in its release (it runs there, and down removes the
    release unless another run uses it) that the receipt does not hold: a declared output is
    held as ``outputs/<path under the workdir>`` with its size; anything else is lost."""
    if not rec.release or not RELEASE.match(rec.release):
        return []
    home = rec.box_home.rstrip("/")
    release = release_path(home, rec.release)
    workdir = str(spec.get("workdir") or rec.workdir or release)
    found = _box_sizes(
        remote, run_dir, deploy_path(home, rec.name), release, script=_JOB_FILES
    ).items()
    lost = []
    for path, size in sorted(found):
        if (
            _inside(path, workdir)
            and pulled.get(f"outputs/{os.path.relpath(path, workdir)}") == size
        ):
            continue
        lost.append(
            f"written by the job in its workdir: {os.path.relpath(path, release)} ({human(size)})"
        )
    return lost
