"""What a store holds of a run, for ``rgt-agent restore`` and ``checkpoints``: the store and the
run located from ``--store`` and ``--name``, proof that the store holds the run, pins set and
cleared, and the run's sealed checkpoints as rows (step, size, sealed time, verified, pinned,
quarantined, which one LATEST marks)."""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

from onbox.agent.journal import iso
from onbox.common.errors import IntegrityError, NotFound, UsageError
from onbox.common.rundir import check_name
from onbox.sealing import manifest as mf
from onbox.sealing.stores import open_box_store
from onbox.sealing.stores.base import Store


def store_and_run(url: str, name: Optional[str], stall: float) -> Tuple[Store, str]:
    """The store and the run: ``--store ROOT --name N``, or ``--store ROOT/N``; opened with the
    run's store secrets where this box has them (onbox.sealing.stores.open_box_store), every
    call of it bounded by ``stall`` (``--stall``): a hung mount or a stopped server ends the
    command (exit 14, stores/hangbound.py), not holds the user's terminal."""
    store, run = _located(url, name)
    store.bound_calls(stall, "--stall")
    return store, run


def _located(url: str, name: Optional[str]) -> Tuple[Store, str]:
    if name is None:
        root, _, last = url.rstrip("/").rpartition("/")
        if "://" not in root or not last:
            raise UsageError(
                "--name",
                "is needed with a store root URL",
                "give --name N, or the run's own URL (ROOT/N)",
            )
        # file:///NAME: the root is file:/// (rpartition leaves "file://")
        root = root + "/" if root.endswith((":/", "://")) else root
        run = check_name(last, "run")
        return open_box_store(root, run), run
    run = check_name(name, "--name")
    return open_box_store(url, run), run


def require_in_store(store: Store, run: str) -> None:
    """NotFound (exit 8, as ``restore`` says it) when the store holds nothing of ``run``, so
    that a mistyped URL or name never reads as "no checkpoints yet"; a ``file://`` store whose
    directory is missing is named as such. Every run that ever started with a store has taken
    an epoch there."""
    # The store's own (bounded) calls first: a look at the directory of a hung mount would
    # hang unbounded, and one that answered them answers it.
    for prefix in (mf.epochs_prefix(run), mf.checkpoints_prefix(run)):
        if next(iter(store.list(prefix)), None) is not None:
            return
    if store.stat(mf.latest_key(run)) is not None:
        return
    root = getattr(store, "root", None)  # a LocalStore's directory
    if isinstance(root, str) and not os.path.isdir(root):
        raise NotFound(
            f"the store {store.url} does not exist (no directory {root}), so neither does run "
            f"{run!r} in it",
            "check the URL, and that the durable mount is mounted",
        )
    raise NotFound(
        f"the store {store.url} holds no run {run!r}",
        "check --name and the store root (or give the run's own URL, ROOT/NAME)",
    )


def set_pins(store: Store, run: str, pin: Optional[int], unpin: Optional[int]) -> None:
    """Pin ``pin`` (a sealed step: NotFound otherwise) and unpin ``unpin``."""
    if pin is not None:
        if store.stat(mf.manifest_key(run, pin)) is None:
            raise NotFound(f"run {run!r} has no sealed step {pin} in {store.url}")
        store.put_bytes(mf.pin_key(run, pin), b"pinned\n")
    if unpin is not None:
        store.delete(mf.pin_key(run, unpin))


def checkpoint_rows(store: Store, run: str) -> Tuple[List[Dict[str, Any]], Optional[str]]:
    """One row per sealed or quarantined step, oldest first, and the line that says why LATEST
    marks another step than LATEST's own (None when it does not)."""
    from onbox.sealing.quarantine import quarantine_reasons
    from onbox.sealing.restore import in_effect, sealed_steps

    pins = {
        int(i.key.rsplit("/", 1)[-1])
        for i in store.list(mf.pins_prefix(run))
        if i.key.rsplit("/", 1)[-1].isdigit()
    }
    latest = mf.parse_latest(store.get_bytes(mf.latest_key(run)))
    bad = quarantine_reasons(store, run)
    sealed = sealed_steps(store, run)
    effective, why = in_effect(latest["step"] if latest else None, sealed, bad)
    rows: List[Dict[str, Any]] = []
    for step in sorted(set(sealed) | set(bad)):
        row: Dict[str, Any] = {"step": step, "verified": False, "latest": step == effective}
        if step in bad:
            row["quarantined"] = bad[step]
        data = store.get_bytes(mf.manifest_key(run, step)) if step in sealed else None
        try:
            doc = mf.parse_manifest(data or b"", mf.manifest_key(run, step))
        except IntegrityError as e:
            rows.append({**row, "problem": e.what if data else "its MANIFEST is missing"})
            continue
        row.update(
            root=doc["root"],
            files=len(doc["files"]),
            size=sum(f["size"] for f in doc["files"]),
            sealed_at=iso(doc["created"]),
            epoch=doc["epoch"],
            verified=step not in bad,
            pinned=step in pins,
        )
        rows.append(row)
    return rows, why
