"""A run's store as the laptop opens it: at the endpoint the box reads and writes it at.

A job file may name an S3-compatible store (MinIO, Cloudflare R2, Backblaze) with its own
``[store] endpoint_url``; the box's agent opens the store there, not at boto3's configured
endpoint. The run's record (controller/registry.py) keeps that endpoint and the store's
``stall``, and every laptop read of a run's store (`rgt status` while the box does not answer,
`rgt pull`, `rgt down`, `rgt report`) opens it through ``open_run_store``, so that none reaches
AWS (or whatever ``AWS_ENDPOINT_URL`` says on the laptop) in its place, and none waits on
a store that stopped answering longer than that stall (or `rgt pull --stall`'s). A sweep's reads
of its store root (`rgt sweep`, `rgt reconcile`) are bounded as well (``open_sweep_store``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Optional

from onbox.agent.spec import store_override
from onbox.common.duration import parse_duration
from onbox.common.errors import UsageError
from onbox.common.storeurl import RESTORE_STALL, StoreURL, parse_store_url, with_endpoint

if TYPE_CHECKING:
    from controller.registry import RunRecord
    from onbox.sealing.stores.base import Store


def store_fields(
    url: Optional[str], endpoint_url: Optional[str], stall: Optional[float]
) -> Dict[str, Any]:
    """The record's store fields for a run whose store is ``url``: ``endpoint_url`` (the job
    file's, else the box's record's) is kept only for an s3:// store, by the box's own rule for
    a ``--store`` that replaces the job file's (onbox/agent/spec.py ``store_override``)."""
    if not url:
        return {"store": None, "store_endpoint_url": None, "store_stall": stall}
    store = store_override(url, endpoint_url, "store.endpoint_url")
    return {"store": store.url, "store_endpoint_url": store.endpoint_url, "store_stall": stall}


def store_at(url: str, endpoint_url: Optional[str], field: str) -> StoreURL:
    """The store ``url`` at ``endpoint_url`` (None: boto3's), both checked again (the laptop's
    records are files a user may edit): a malformed one raises UsageError naming ``field``."""
    return with_endpoint(parse_store_url(url, field), endpoint_url, f"{field}'s endpoint_url")


def run_store_url(rec: RunRecord) -> StoreURL:
    """``rec``'s store with its endpoint (``store_at``)."""
    if not rec.store:
        raise UsageError("store", f"run {rec.name!r} has no store")
    return store_at(rec.store, rec.store_endpoint_url, f"run {rec.name}'s store")


def open_run_store(rec: RunRecord, stall: Optional[float] = None) -> Store:
    """``rec``'s store, opened where the box opens it (its recorded endpoint), each of its calls
    before a download bounded by ``stall`` (a command's ``--stall``), else by the run's stall
    (``run_store_stall``): a hung mount or a stopped server ends the command (exit 14,
    onbox/sealing/stores/hangbound.py), not holds the user's terminal; its error names the
    setting that gave the bound."""
    from onbox.sealing.stores import open_store  # imports the store's extra (boto3, the Hub)

    store = open_store(run_store_url(rec))
    if stall is None:
        store.bound_calls(run_store_stall(rec))
    else:
        store.bound_calls(stall, "--stall")
    return store


def open_sweep_store(url: str, endpoint_url: Optional[str], stall: Optional[Any] = None) -> Store:
    """A sweep's store root (every cell's run under it), at the endpoint its base job file
    gives its cells' boxes (controller/sweep/plan.py ``Plan.store_endpoint``), each of its
    calls before a download bounded by that job file's ``[store] stall`` (``stall``; None: the
    default), as ``open_run_store``'s: `rgt sweep` and `rgt reconcile` read every cell's
    documents, and a hung store ends them (exit 14), not holds them."""
    from onbox.sealing.stores import open_store

    store = open_store(store_at(url, endpoint_url, "the sweep's store"))
    store.bound_calls(sweep_store_stall(stall))
    return store


def sweep_store_stall(stall: Optional[Any]) -> float:
    """A sweep's bound on its store (its record's ``store_stall``; None: the default): on each
    call before a download, and on a download that moves nothing (controller/sweep/reconcile.py).
    Checked again: the sweep's record is a file a user may edit."""
    return RESTORE_STALL if stall is None else parse_duration(stall, "store_stall")


def run_store_stall(rec: RunRecord) -> float:
    """How long a download from ``rec``'s store may move no byte: the job file's ``[store]
    stall`` as recorded, else the default (onbox/common/storeurl.py RESTORE_STALL)."""
    if rec.store_stall is None:
        return RESTORE_STALL
    return parse_duration(rec.store_stall, f"run {rec.name}'s store_stall")
