"""A run's sealing freeze, kept on the box's disk: a training signal (a NaN loss) stopped the
run, and nothing newer than its last good step is sealed, so that LATEST stays the last good
checkpoint (onbox/agent/sealservice.py ``freeze``).

On disk (RunDir.sealing_frozen), not only in the agent's memory: an agent the shim respawns
while the job is being ended, and `rgt-agent sync` of the run once its agent is gone, must not
seal the checkpoints the job wrote after the NaN either; and the sync says why it sealed
nothing (onbox/agent/synccheck.py).

A new incarnation of the run lifts it (``lift``): first the checkpoints the job wrote after the
freeze's step are moved aside, into ``RGT_CKPT_DIR/.rgt-quarantine/frozen-<time>/`` with a copy
of the freeze (a hidden ``.rgt-`` name: never sealed, never resumed from), and a ``set_aside``
event says where. Left in place, the new agent sealed them and made the newest LATEST, and the
restarted job resumed from it, its weights NaN. Nothing is deleted: they are there to inspect.

A run with no store has no sealer, and its freeze all the same: the agent writes it where the
NaN is handled (onbox/agent/healthuse.py), at the newest checkpoint on the box at or before the
last good loss (``last_good``), and its next incarnation lifts it (onbox/agent/loop.py), so the
job resumes from that checkpoint and not from one the NaN run wrote.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from onbox.common.durable import read_json, write_json
from onbox.common.errors import HostError
from onbox.common.rundir import RunDir
from onbox.sealing.discovery import dir_step, is_ckpt_file, skip, step_from_name

# Inside the checkpoint dir, on its filesystem: each move is a rename, never a copy.
ASIDE = ".rgt-quarantine"
# What a beginning is doing while it lifts a freeze (restore_failed says it when that fails).
LIFTING = "setting aside the checkpoints written after the run was frozen"


def write(rd: RunDir, above: int, reason: str, remedy: str) -> None:
    """Nothing newer than ``above`` (-1: nothing at all) is sealed from now on."""
    write_json(
        rd.sealing_frozen, {"above": above, "reason": reason, "remedy": remedy, "at": time.time()}
    )


def read(rd: RunDir) -> Optional[Dict[str, Any]]:
    """The freeze (``above``, ``reason``, ``remedy``), or None when the run is not frozen. A
    file that does not parse is a freeze all the same, of everything: sealing a checkpoint
    written after a NaN would make it LATEST."""
    try:
        doc = read_json(rd.sealing_frozen)
    except ValueError:
        doc = []  # torn or not ours: below
    if doc is None:
        return None
    if not isinstance(doc, dict):
        doc = {"reason": f"{rd.sealing_frozen} does not parse"}
    try:
        doc["above"] = int(doc.get("above", -1))
    except (TypeError, ValueError):
        doc["above"] = -1
    return doc


def clear(rd: RunDir) -> None:
    """The run is not frozen (any more)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(rd.sealing_frozen)


def lift(rd: RunDir, ckpt_dir: str, event: Callable[..., None]) -> None:
    """A new incarnation: the run is trained again from LATEST, and its checkpoints sealed.
    What the job wrote after the frozen step is set aside first; a move that fails raises
    HostError and leaves the run frozen, so that a start once it is fixed sets aside the rest."""
    frozen = read(rd)
    if frozen is not None:
        set_aside(ckpt_dir, frozen, event)
    clear(rd)


def set_aside(ckpt_dir: str, frozen: Dict[str, Any], event: Callable[..., None]) -> None:
    """Move the complete checkpoints of ``ckpt_dir`` newer than ``frozen["above"]`` (and the
    links there that lead to one) into a directory of ASIDE, with the freeze beside them."""
    above = frozen["above"]
    newer = _newer(ckpt_dir, above)
    if not newer:
        return
    at = frozen.get("at")
    at = at if isinstance(at, (int, float)) else time.time()  # a freeze of a file that is not ours
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(at))
    dest = os.path.join(ckpt_dir, ASIDE, f"frozen-{stamp}")
    names = [name for _, name in newer]
    real = {os.path.realpath(os.path.join(ckpt_dir, n)) for n in names}
    for name in sorted(os.listdir(ckpt_dir)):  # a link to one (last.ckpt) goes with it
        path = os.path.join(ckpt_dir, name)
        if os.path.islink(path) and os.path.realpath(path) in real:
            names.append(name)
    try:
        os.makedirs(dest, exist_ok=True)
        write_json(os.path.join(dest, "sealing-frozen.json"), frozen)
        for name in names:
            os.rename(os.path.join(ckpt_dir, name), os.path.join(dest, name))
    except OSError as e:
        raise HostError(
            f"moving the checkpoints written after the run was frozen aside to {dest}: {e}",
            "free the disk or fix the checkpoint dir's permissions, then start the run again",
        ) from None
    steps = sorted(step for step, _ in newer)
    after = f"after step {above}" if above >= 0 else "with no good checkpoint before them"
    event(
        "set_aside",
        f"moved the checkpoints written {after} ({_steps(steps)}) aside to "
        f"{dest}: the run's sealing was frozen ({frozen.get('reason') or 'a training stop'}); "
        "they are never sealed, and the job resumes from the last good checkpoint",
        remedy=f"look at them there if you wish, then delete {dest} to free the disk",
        steps=steps,
        above=above,
        path=dest,
    )


def _steps(steps: List[int]) -> str:
    return ("step " if len(steps) == 1 else "steps ") + ", ".join(map(str, steps))


def last_good(ckpt_dir: str, good: int) -> Optional[int]:
    """The step of the newest complete checkpoint in ``ckpt_dir`` at or before ``good`` (the
    last step whose loss was good), None when there is none: what a run with no store keeps."""
    steps = [step for step, _ in _newer(ckpt_dir, -1) if step <= good]
    return steps[-1] if steps else None


def _newer(ckpt_dir: str, above: int) -> List[Tuple[int, str]]:
    """(step, name) of each complete checkpoint in ``ckpt_dir`` newer than ``above``, oldest
    first, as the sealer and the job's resume would take it (onbox/sealing/discovery.py): a
    directory with a completeness marker, a loose file in a checkpoint format named with its
    step."""
    try:
        names = os.listdir(ckpt_dir)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        path = os.path.join(ckpt_dir, name)
        if skip(name) or os.path.islink(path):
            continue
        if os.path.isdir(path):
            step = dir_step(name, path)
        else:
            step = step_from_name(name) if is_ckpt_file(name) else None
        if step is not None and step > above:
            out.append((step, name))
    return sorted(out)
