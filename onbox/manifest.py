"""The documents that make a sealed checkpoint real: MANIFEST.json, LATEST.json, DONE.json.

Layout under a run's prefix in the store (shared/DESIGN.md)::

    checkpoints/<step>/...              the files, uploaded first
    checkpoints/<step>/MANIFEST.json    written after every file is verified
    LATEST.json                         advanced last, only to a verified checkpoint, never back
    epochs/<n>                          one per agent start; the highest epoch is the writer
    quarantine/<step>.json              a checkpoint found corrupt: kept, flagged, reported
    pinned/<step>                       a checkpoint pruning never deletes
    state/                              the run's state and events, mirrored
    DONE.json                           the completion receipt

A checkpoint without a MANIFEST does not exist. Standard library only: the training API reads
these too.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any, Dict, List, Optional

from onbox.errors import IntegrityError
from onbox.safepath import safe_rel

SCHEMA = 1
_SHA = re.compile(r"[0-9a-f]{64}\Z")


def checkpoint_prefix(run: str, step: int) -> str:
    return f"{run}/checkpoints/{step}/"


def manifest_key(run: str, step: int) -> str:
    return f"{run}/checkpoints/{step}/MANIFEST.json"


def latest_key(run: str) -> str:
    return f"{run}/LATEST.json"


def done_key(run: str) -> str:
    return f"{run}/DONE.json"


def epoch_key(run: str, epoch: int) -> str:
    return f"{run}/epochs/{epoch:08d}"


def pin_key(run: str, step: int) -> str:
    return f"{run}/pinned/{step}"


def quarantine_key(run: str, step: int) -> str:
    return f"{run}/quarantine/{step}.json"


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
        return _check_schema(json.loads(data), what)
    except ValueError:
        raise IntegrityError(f"{what} is not valid JSON") from None


def dump(doc: Dict[str, Any]) -> bytes:
    return (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()


def new_manifest(
    run: str, step: int, epoch: int, root: str, kind: str, files: List[Dict[str, Any]]
) -> Dict[str, Any]:
    """A MANIFEST: ``root`` is the checkpoint's path relative to RGT_CKPT_DIR (a file or a
    directory), ``files`` are {path (relative to RGT_CKPT_DIR), size, sha256, key}."""
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
    return doc


def new_latest(run: str, step: int, epoch: int) -> Dict[str, Any]:
    return {
        "schema": SCHEMA,
        "run": run,
        "step": step,
        "epoch": epoch,
        "manifest": manifest_key(run, step),
        "updated": time.time(),
    }


def parse_latest(data: Optional[bytes]) -> Optional[Dict[str, Any]]:
    if data is None:
        return None
    doc = _load(data, "LATEST")
    if not isinstance(doc.get("step"), int):
        raise IntegrityError("LATEST names no step")
    return doc
