"""Taking an epoch: the fencing token an agent writes a run's store prefix under.

Each agent start creates ``epochs/<n>`` (created only if absent, so one number has one taker)
and the newest epoch owns the run; the ledger (onbox/sealing/ledger.py) checks it at every write
and says how an older one is kept from doing harm. Separate from the ledger because taking the
token comes before any ledger exists (``Sealer.for_run``, the ownership rules of
onbox/agent/ownership.py) and never needs one.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, Optional

from onbox.common import jsondoc
from onbox.common.errors import PreconditionFailed
from onbox.sealing import manifest as mf
from onbox.sealing.ledger import newest_epoch
from onbox.sealing.stores.base import Store


def _create_epoch(store: Store, run: str, n: int, writer: Optional[str]) -> bool:
    """Create ``epochs/<n>`` for this process; False when another writer has it already.
    ``writer``: the mark of the box's run directory that takes it (onbox/agent/ownership.py)."""
    doc: Dict[str, Any] = {"epoch": n, "pid": os.getpid(), "host": os.uname().nodename}
    doc["at"] = time.time()
    if writer is not None:
        doc["writer"] = writer
    try:
        store.put_bytes(mf.epoch_key(run, n), json.dumps(doc).encode(), if_absent=True)
        return True
    except PreconditionFailed:
        return False


def take_epoch(store: Store, run: str, writer: Optional[str] = None) -> int:
    """A new epoch for this agent start: the first to create ``epochs/<n>`` owns ``n``."""
    n = newest_epoch(store, run) + 1
    while not _create_epoch(store, run, n, writer):
        n += 1
    return n


def epoch_doc(store: Store, run: str, epoch: int) -> Dict[str, Any]:
    """What ``epochs/<epoch>`` says of its taker ({} when absent or not rgt's JSON object)."""
    try:
        doc = jsondoc.loads(store.get_bytes(mf.epoch_key(run, epoch)) or b"")
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def take_epoch_after(
    store: Store, run: str, own: int, writer: Optional[str] = None
) -> Optional[int]:
    """A new epoch that goes on from ``own`` (the one this box's last writer of the run took),
    or None, taking none, when a newer epoch than ``own`` exists: another writer has taken the
    run over. Created only if absent: one that took the next number first is the newer one."""
    newest = newest_epoch(store, run)
    if newest > own:
        return None
    n = max(newest, own) + 1
    return n if _create_epoch(store, run, n, writer) else None
