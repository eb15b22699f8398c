"""Putting the newest verified checkpoint back on a box that lacks it (a fresh box).

LATEST names a MANIFEST; every file it lists is downloaded under a temporary name, its sha256
checked, and renamed into place at the same relative path under RGT_CKPT_DIR it was sealed
from, so the script's own resume logic finds it. A checkpoint whose MANIFEST or files are
missing or corrupt is quarantined (kept, flagged, reported) and the previous one is tried.
"""

from __future__ import annotations

import functools
import json
import os
import time
from typing import Any, Callable, Dict, List, Optional

from onbox import manifest as mf
from onbox.durable import fsync_dir, sha256_file
from onbox.errors import IntegrityError
from onbox.stores.base import Store, StoreError, with_retries


def local_matches(doc: Dict[str, Any], ckpt_dir: str, verify: bool = False) -> bool:
    """Whether every file of the manifest is present locally (with its size; and sha256 when
    ``verify``)."""
    for f in doc["files"]:
        path = os.path.join(ckpt_dir, *f["path"].split("/"))
        try:
            if os.path.getsize(path) != f["size"]:
                return False
        except OSError:
            return False
        if verify and sha256_file(path)[0] != f["sha256"]:
            return False
    return True


def sealed_steps(store: Store, run: str) -> List[int]:
    steps = []
    for info in store.list(f"{run}/checkpoints/"):
        if info.key.endswith("/MANIFEST.json"):
            try:
                steps.append(int(info.key.split("/")[-2]))
            except ValueError:
                continue
    return sorted(steps)


def quarantined(store: Store, run: str) -> List[int]:
    out = []
    for info in store.list(f"{run}/quarantine/"):
        name = info.key.rsplit("/", 1)[-1]
        if name.endswith(".json") and name[:-5].isdigit():
            out.append(int(name[:-5]))
    return out


def _download(store: Store, doc: Dict[str, Any], dest_dir: str) -> None:
    for f in doc["files"]:
        final = os.path.join(dest_dir, *f["path"].split("/"))
        os.makedirs(os.path.dirname(final), exist_ok=True)
        tmp = os.path.join(os.path.dirname(final), f".{os.path.basename(final)}.rgt-restore")
        try:
            with_retries(functools.partial(store.get_file, f["key"], tmp))
            size = os.path.getsize(tmp)
            got = sha256_file(tmp)[0]
            if size != f["size"] or got != f["sha256"]:
                raise IntegrityError(
                    f"{f['key']}: {size} bytes sha256 {got[:12]} in the store, the MANIFEST says "
                    f"{f['size']} bytes {f['sha256'][:12]}"
                )
            os.replace(tmp, final)
            fsync_dir(os.path.dirname(final))
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


def restore_latest(
    store: Store, run: str, ckpt_dir: str, event: Callable[..., None]
) -> Optional[Dict[str, Any]]:
    """Make sure the newest good sealed checkpoint is in ``ckpt_dir``; return its MANIFEST
    (with ``"local": abs path of its root``), or None when nothing was ever sealed."""
    latest = mf.parse_latest(store.get_bytes(mf.latest_key(run)))
    bad = set(quarantined(store, run))
    steps = [s for s in sealed_steps(store, run) if s not in bad]
    if latest is not None:
        steps = [s for s in steps if s <= latest["step"]]
    for step in reversed(steps):
        key = mf.manifest_key(run, step)
        try:
            data = store.get_bytes(key)
            if data is None:
                raise IntegrityError(f"{key} is missing")
            doc = mf.parse_manifest(data, key)
            if local_matches(doc, ckpt_dir, verify=True):
                how = "already on this box"
            else:
                t0 = time.monotonic()
                _download(store, doc, ckpt_dir)
                how = f"downloaded and verified in {time.monotonic() - t0:.1f}s"
        except IntegrityError as e:
            store.put_bytes(
                mf.quarantine_key(run, step),
                json.dumps({"step": step, "reason": e.what, "at": time.time()}).encode(),
            )
            event(
                "quarantined",
                f"sealed step {step} is corrupt in the store: {e.what}; it is "
                "kept and flagged, and the previous verified checkpoint is used",
                klass="integrity",
                remedy="look at the store; the files are left as they are",
                step=step,
            )
            continue
        doc["local"] = os.path.join(ckpt_dir, *doc["root"].split("/"))
        event("restored", f"checkpoint step {step} ({doc['root']}) {how}", step=step)
        return doc
    return None


__all__ = ["restore_latest", "local_matches", "sealed_steps", "StoreError"]
