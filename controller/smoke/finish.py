"""The last two checks of ``rgt smoke`` (controller/smoke/walk.py runs them after the resume).

6. exact (``--exact``): the resumed run goes on to its end, and the state hashes it prints last
   (``weights sha256 HEX``, ``optimizer sha256 HEX``, ``rng sha256 HEX``, as the examples print
   them with examples/statehash.py) equal those of the same job run uninterrupted under its own
   agent (``reference``, started beside the walk at its beginning, on its own copy of the
   project). A checkpoint without the optimizer, the scheduler, the scaler or the data-loader
   position resumes to different weights, and fails here.
7. outputs: what ``rgt pull`` would bring back (DONE.json's files when the run finished, else
   LATEST's checkpoint and the logs), the files the job left in its workdir that no declared
   output covers (they stay on the box: shown as warnings), and the shell scripts among the
   project's files with CRLF line endings (they break on Linux boxes: FAIL).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from controller.smoke.checks import (
    crlf_scripts,
    hash_mismatch,
    left_behind,
    short_list,
    state_hashes,
    tree,
)
from onbox.common import jsondoc
from onbox.sealing import manifest as mf
from onbox.sealing.discovery import is_ckpt_file
from onbox.sealing.stores import open_store

if TYPE_CHECKING:
    from controller.smoke.walk import Walk

REFERENCE = "reference"
CKPT_REMEDY = (
    "write each checkpoint under $RGT_CKPT_DIR, complete by rgt's rules (a directory with "
    ".rgt-complete or trainer_state.json, or a step_N.pt file), and declare checkpoint.trigger "
    '("file" or "signal:USR2") in the job file so that rgt can ask; onbox.train\'s '
    "Checkpointer does both"
)
EXACT_REMEDY = (
    "register every stateful object with the Checkpointer (model, optimizer, scheduler, "
    "scaler, loader), seed every RNG, and load RGT_RESUME_FROM before the first step"
)


def is_ckpt_name(rel: str) -> bool:
    return is_ckpt_file(rel.rsplit("/", 1)[-1])


def _ended(walk: Walk, name: str) -> Optional[Dict[str, Any]]:
    st = walk.box.status(name)
    return st if st.get("state") in ("SUCCEEDED", "FAILED", "STOPPED", "PREEMPTED") else None


def exact(walk: Walk) -> Dict[str, Any]:
    """Check 6; the resumed run's final status."""
    from controller.smoke.walk import RUN, wait_for

    report, box, timeout = walk.report, walk.box, walk.req.timeout
    runs: Dict[str, Dict[str, Any]] = {}
    for name in (RUN, REFERENCE):
        st = wait_for(functools.partial(_ended, walk, name), timeout)
        if st is None or st.get("state") != "SUCCEEDED":
            which = "the resumed run" if name == RUN else "the uninterrupted run"
            walk.crash(6, box.status(name))
            why = "did not finish" if st is None else f"ended {st.get('state')}"
            raise report.fail(6, f"{which} {why} in {timeout:.0f} s",
                              "give the job a bounded number of steps under RGT_SMOKE=1, or "
                              "raise --timeout")  # fmt: skip
        runs[name] = st
    reference = state_hashes(box.log(REFERENCE))
    resumed = state_hashes(box.log(RUN))
    if not reference:
        raise report.fail(
            6,
            "the job printed no state hash at its end",
            "print 'weights sha256 HEX' and 'optimizer sha256 HEX' (and 'rng sha256 HEX') "
            "last, as examples/statehash.py computes them, or drop --exact",
        )
    bad = hash_mismatch(reference, resumed)
    if bad:
        raise report.fail(
            6,
            f"after the resume the {' and '.join(bad)} state "
            f"{'differs' if len(bad) == 1 else 'differ'} from the uninterrupted run's",
            EXACT_REMEDY,
        )
    report.ok(6, f"the resumed run ends with the uninterrupted run's {', '.join(reference)} "
              "sha256")  # fmt: skip
    return runs[RUN]


def _pulled(walk: Walk, done: Optional[Dict[str, Any]]) -> str:
    """What ``rgt pull`` would bring back, in words."""
    from controller.smoke.walk import RUN

    store = open_store(walk.box.store_url)
    latest = mf.parse_latest(store.get_bytes(mf.latest_key(RUN)))
    parts = [f"the checkpoint of step {latest['step']}" if latest else "no checkpoint"]
    raw = store.get_bytes(mf.done_key(RUN)) if done else None
    if raw:
        files = jsondoc.loads(raw).get("files") or []
        names = [str(f.get("path") or f.get("key") or "?") for f in files if isinstance(f, dict)]
        parts.append(f"{len(names)} file(s): {short_list(names)}" if names else "no other file")
    else:
        parts.append("the job's logs")
    return "rgt pull would bring back " + ", ".join(parts)


def outputs(walk: Walk, done: Optional[Dict[str, Any]]) -> None:
    """Check 7. The run is stopped first when it is still training (no --exact)."""
    from controller.smoke.walk import RUN

    box, report = walk.box, walk.report
    if done is None:
        box.preempt(RUN, walk.req.grace + 15)
    spec = walk.spec
    declared = list(spec.outputs) if spec else []
    fact = _pulled(walk, done)
    missing: List[str] = []
    for e in box.events(RUN):
        if e.get("kind") == "done":
            missing = [str(m) for m in e.get("missing_outputs") or []]
    crlf = crlf_scripts(walk.project, walk.files)
    if crlf:
        raise report.fail(
            7,
            f"shell scripts with CRLF line endings: {short_list(crlf)}",
            "convert them to LF (dos2unix FILE; git config core.autocrlf input): bash on a "
            "Linux box reads each \\r as part of the command",
        )
    if missing:
        raise report.fail(
            7,
            f"declared outputs missing when the job succeeded: {short_list(missing)}",
            "write them under the job's workdir, or correct outputs in the job file",
        )
    report.ok(7, fact)
    left = left_behind(set(walk.files), tree(walk.work), declared)
    if left:
        report.note(f"warning: left in the workdir, not pulled: {short_list(left)} "
                    "(declare them in outputs, or write them under $RGT_CKPT_DIR)")  # fmt: skip
