"""The documents that make a sealed checkpoint real: MANIFEST.json, LATEST.json, DONE.json.

Layout under a run's prefix in the store (shared/DESIGN.md)::

    checkpoints/<step>/e<epoch>/...     the files, uploaded first, under the writer's epoch
    checkpoints/<step>/MANIFEST.json    written after every file is verified
    LATEST.json                         advanced last, only to a verified checkpoint, never back
    epochs/<n>                          one per agent start; the highest epoch is the writer
    quarantine/<step>.json              a checkpoint found corrupt: kept, flagged, reported
    pinned/<step>                       a checkpoint pruning never deletes
    state/                              the run's state and events, mirrored
    results/, outputs/                  sealed at completion: the other files of the checkpoint
                                        dir, the declared outputs
    logs/e<epoch>/attempt-NNNN.log      the job's logs, sealed by the agent of that epoch as it
                                        lets go of the run (any end but a superseded one)
    logs/e<epoch>.json                  that agent's list of them, written after them
    DONE.json                           the completion receipt (results, outputs, logs)
    ENDED.json                          the logs of a run that ended FAILED or STOPPED

A checkpoint without a MANIFEST does not exist. A MANIFEST's ``links`` (absent from those written
before it, and where there is none) are the symlinks of the checkpoint dir itself that led to the
checkpoint when it was sealed (Lightning's ``last.ckpt``, a user's ``latest``), each {name: one
name in the dir, target: the path it led to, relative to the dir, the checkpoint's root or a path
under it}: a restore makes them again (onbox/sealing/dirlinks.py); a link is never an object of
its own. Each file entry of a MANIFEST names the object
that holds its bytes (``key``): the files of a checkpoint sealed by epoch E live under
``checkpoints/<step>/e<E>/`` (so two agents of one run never write the same object), and an
entry may name an object an earlier checkpoint of the same epoch holds (same sha256). MANIFESTs
from before epoch-scoped keys name ``checkpoints/<step>/<path>``; readers take the key as
written (``object_key``), so both read the same way.

LATEST names the step, the epoch of the MANIFEST it points to (``epoch``) and the epoch of the
agent that wrote it (``writer``, the fencing token: an agent never replaces a LATEST whose writer
is newer than itself). A LATEST from before ``writer`` existed counts as written by its
``epoch``.

Standard library only: the training API reads these too.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any, Dict, List, Optional

from onbox.common import jsondoc
from onbox.common.errors import IntegrityError
from onbox.common.safepath import UnsafePath, conflicts, safe_rel

SCHEMA = 1
_SHA = re.compile(r"[0-9a-f]{64}\Z")


# Every key of a run in the store is made here: RUN/checkpoints/, epochs/, pinned/,
# quarantine/, state/, LATEST.json and DONE.json.


def checkpoints_prefix(run: str) -> str:
    return f"{run}/checkpoints/"


def checkpoint_prefix(run: str, step: int) -> str:
    return f"{checkpoints_prefix(run)}{step}/"


def manifest_key(run: str, step: int) -> str:
    return f"{run}/checkpoints/{step}/MANIFEST.json"


def manifest_step(run: str, key: str) -> Optional[int]:
    """The step of ``key`` when it is a MANIFEST's key (``RUN/checkpoints/<step>/MANIFEST.json``),
    else None: a checkpoint's own file named MANIFEST.json lies deeper and is none."""
    head = f"{run}/checkpoints/"
    if not key.startswith(head) or not key.endswith("/MANIFEST.json"):
        return None
    middle = key[len(head) : -len("/MANIFEST.json")]
    # As manifest_key writes a step: ASCII digits, no leading zero ("²" is a digit to
    # str.isdigit, and int() takes "007"; neither is a key rgt wrote).
    if not (middle.isascii() and middle.isdigit()) or str(int(middle)) != middle:
        return None
    return int(middle)


def epoch_prefix(run: str, step: int, epoch: int) -> str:
    """Where the agent of ``epoch`` uploads the files of checkpoint ``step``: a prefix no other
    epoch writes under, so an agent that lost the run (frozen, preempted, come back) can never
    overwrite an object the newer one sealed."""
    return f"{run}/checkpoints/{step}/e{epoch}/"


def new_object_key(run: str, step: int, epoch: int, path: str) -> str:
    """The key a file sealed now gets (see ``epoch_prefix``); ``path`` is relative to
    RGT_CKPT_DIR."""
    return epoch_prefix(run, step, epoch) + path


def object_key(run: str, step: int, entry: Dict[str, Any]) -> str:
    """The store key holding the bytes of one MANIFEST file entry; restore and pull read each
    file from here (they read ``entry["key"]``, which is the same for every MANIFEST rgt
    wrote). It is the entry's ``key`` as sealed: epoch-scoped since fencing
    (``checkpoints/<step>/e<epoch>/<path>``), ``checkpoints/<step>/<path>`` before it, an
    earlier step's object when deduplicated. ``parse_manifest`` requires a key; an entry
    without one (a hand-made document) means the original layout."""
    key = entry.get("key")
    if isinstance(key, str) and key:
        return key
    return checkpoint_prefix(run, step) + str(entry["path"])


def latest_key(run: str) -> str:
    return f"{run}/LATEST.json"


def done_key(run: str) -> str:
    return f"{run}/DONE.json"


def ended_key(run: str) -> str:
    """The job's logs of a run that ended FAILED or STOPPED (onbox/agent/endlogs.py): not
    DONE.json, which means success."""
    return f"{run}/ENDED.json"


def results_prefix(run: str) -> str:
    """Files the job left in its checkpoint dir that no checkpoint rule covers (completion)."""
    return f"{run}/results/"


def outputs_prefix(run: str) -> str:
    """The declared outputs (``outputs`` in the job file), sealed at completion."""
    return f"{run}/outputs/"


def logs_prefix(run: str) -> str:
    """The job's logs, one per attempt (redacted copies where they held a secret)."""
    return f"{run}/logs/"


def log_name(epoch: int, attempt: int) -> str:
    """The name, under ``logs_prefix``, of the job's log of ``attempt`` that the agent of
    ``epoch`` seals: ``e<epoch>/attempt-NNNN.log``. A new box numbers its attempts from 1
    again, so the epoch keeps two boxes' logs from ever sharing a key (one replacing the other
    under a pull that had read the older document). Documents from before it name
    ``attempt-NNNN.log``; both are read."""
    return f"e{epoch}/attempt-{attempt:04d}.log"


def logs_doc_key(run: str, epoch: int) -> str:
    """The document listing the job's logs the agent of ``epoch`` sealed as it let go of the
    run (onbox/agent/endlogs.py), whatever the run's end: one per epoch, never replaced by
    another box's, so `rgt pull` finds every box's logs (``logs_doc_epoch``)."""
    return f"{logs_prefix(run)}e{epoch}.json"


def logs_doc_epoch(run: str, key: str) -> Optional[int]:
    """The epoch of ``key`` when it is a log document's (``logs_doc_key``), else None."""
    head = logs_prefix(run)
    if not key.startswith(head + "e") or not key.endswith(".json"):
        return None
    middle = key[len(head) + 1 : -len(".json")]
    if not (middle.isascii() and middle.isdigit()) or str(int(middle)) != middle:
        return None
    return int(middle)


def epochs_prefix(run: str) -> str:
    return f"{run}/epochs/"


def epoch_key(run: str, epoch: int) -> str:
    return f"{epochs_prefix(run)}{epoch:08d}"


def pins_prefix(run: str) -> str:
    return f"{run}/pinned/"


def pin_key(run: str, step: int) -> str:
    return f"{pins_prefix(run)}{step}"


def state_key(run: str, name: str) -> str:
    """The store's mirror of the run's ``name`` (state.json, events.jsonl, a log): what
    ``rgt status`` reads when the box is gone."""
    return f"{run}/state/{name}"


def quarantine_prefix(run: str) -> str:
    return f"{run}/quarantine/"


def quarantine_key(run: str, step: int) -> str:
    return f"{quarantine_prefix(run)}{step}.json"


def quarantine_attempt_key(run: str, step: int, epoch: int) -> str:
    """Where a quarantine record of ``step`` is kept once a newer epoch seals that step again,
    named by the epoch of the checkpoint it had refused."""
    return f"{quarantine_prefix(run)}{step}.e{epoch}.json"


def _check_schema(doc: Any, what: str) -> Dict[str, Any]:
    if not isinstance(doc, dict):
        raise IntegrityError(f"{what} is not a JSON object")
    schema = doc.get("schema")
    if not isinstance(schema, int):
        raise IntegrityError(f"{what} has no schema version")
    if schema > SCHEMA:
        raise IntegrityError(
            f"{what} was written by a newer rgt (schema {schema})", "upgrade rgt on this box"
        )
    return doc


def _load(data: bytes, what: str) -> Dict[str, Any]:
    try:
        return _check_schema(jsondoc.loads(data), what)
    except ValueError:  # nested too deep for the parser too (jsondoc): damage, not a bug
        raise IntegrityError(f"{what} is not valid JSON") from None


def dump(doc: Dict[str, Any]) -> bytes:
    return (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()


def new_manifest(
    run: str, step: int, epoch: int, root: str, kind: str, files: List[Dict[str, Any]]
) -> Dict[str, Any]:
    """A MANIFEST: ``root`` is the checkpoint's path relative to RGT_CKPT_DIR (a file or a
    directory), ``files`` are {path (relative to RGT_CKPT_DIR), size, sha256, key}. The
    sealer adds ``links`` (the module docstring) when the dir has any to it."""
    return {
        "schema": SCHEMA,
        "run": run,
        "step": step,
        "epoch": epoch,
        "root": root,
        "kind": kind,
        "files": files,
        "created": time.time(),
    }


def parse_manifest(data: bytes, what: str = "MANIFEST") -> Dict[str, Any]:
    """A checked MANIFEST; anything malformed is an IntegrityError."""
    doc = _load(data, what)
    step = doc.get("step")
    if not isinstance(step, int) or step < 0:
        raise IntegrityError(f"{what}: step {step!r} is not a step")
    safe_rel(doc.get("root"), f"{what}: root")
    files = doc.get("files")
    if not isinstance(files, list) or not files:
        raise IntegrityError(f"{what}: no files")
    seen = set()
    for f in files:
        if not isinstance(f, dict):
            raise IntegrityError(f"{what}: a file entry is not an object")
        path = safe_rel(f.get("path"), f"{what}: path")
        if path in seen:
            raise IntegrityError(f"{what}: {path} is listed twice")
        seen.add(path)
        if not isinstance(f.get("size"), int) or f["size"] < 0:
            raise IntegrityError(f"{what}: {path} has no size")
        if not isinstance(f.get("sha256"), str) or not _SHA.match(f["sha256"]):
            raise IntegrityError(f"{what}: {path} has a malformed sha256")
        safe_rel(f.get("key"), f"{what}: the key of {path!r}")
    both = conflicts(sorted(seen))
    if both is not None:  # restored, one would be renamed over the other's directory
        raise UnsafePath(
            f"{what}: the file {both[0]!r} is listed, and so is {both[1]!r} under it", both[1]
        )
    if "epoch" in doc and (not isinstance(doc["epoch"], int) or doc["epoch"] < 0):
        raise IntegrityError(f"{what}: epoch {doc['epoch']!r} is not an epoch")
    links = doc.get("links", [])
    if not isinstance(links, list):
        raise IntegrityError(f"{what}: links is not a list")
    for link in links:
        check_link(link, doc, what)
    return doc


def check_link(link: object, doc: Dict[str, Any], what: str = "MANIFEST") -> Dict[str, str]:
    """``link`` when it is a link the sealer could have recorded in ``doc`` (a checked
    MANIFEST, its ``links`` aside): a plain name in the checkpoint dir (no '/', not rgt's own
    ``.rgt-`` names, not the checkpoint's nor a top-level name of its files) and a plain
    relative ``target`` that is the checkpoint's root or a path under it. Anything else would
    lead out of the dir, or over a file, once made: UnsafePath (a store is untrusted)."""
    if not isinstance(link, dict):
        raise IntegrityError(f"{what}: a link entry is not an object")
    name = safe_rel(link.get("name"), f"{what}: the link name")
    if "/" in name or name.startswith(".rgt-"):
        raise UnsafePath(
            f"{what}: the link name {name!r} is refused: not a name in the checkpoint dir", name
        )
    target = safe_rel(link.get("target"), f"{what}: the target of link {name!r}")
    root = doc["root"]
    if target != root and not target.startswith(root + "/"):
        raise UnsafePath(
            f"{what}: the link {name!r} leads to {target!r}, which is not this checkpoint "
            f"({root!r}): a link is recorded only with the checkpoint it leads to",
            target,
        )
    if name == root.split("/")[0] or any(f["path"].split("/")[0] == name for f in doc["files"]):
        raise UnsafePath(f"{what}: the link {name!r} would take the place of a sealed file", name)
    return link


def manifest_epoch(doc: Dict[str, Any]) -> int:
    """The epoch of the agent that sealed a MANIFEST (0 for one older than epochs)."""
    epoch = doc.get("epoch")
    return epoch if isinstance(epoch, int) else 0


def new_latest(run: str, step: int, epoch: int, writer: Optional[int] = None) -> Dict[str, Any]:
    """LATEST naming checkpoint ``step`` whose MANIFEST epoch ``epoch`` sealed, written by the
    agent of epoch ``writer`` (default: ``epoch``)."""
    return {
        "schema": SCHEMA,
        "run": run,
        "step": step,
        "epoch": epoch,
        "writer": epoch if writer is None else writer,
        "manifest": manifest_key(run, step),
        "updated": time.time(),
    }


def latest_writer(doc: Dict[str, Any]) -> int:
    """The epoch of the agent that wrote a LATEST: ``writer``, else (older documents) ``epoch``."""
    for field in ("writer", "epoch"):
        value = doc.get(field)
        if isinstance(value, int):
            return value
    return 0


def parse_latest(data: Optional[bytes]) -> Optional[Dict[str, Any]]:
    if data is None:
        return None
    doc = _load(data, "LATEST")
    if not isinstance(doc.get("step"), int):
        raise IntegrityError("LATEST names no step")
    return doc
