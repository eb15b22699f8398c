"""The quarantine records of a run: ``quarantine/<step>.json``, a checkpoint found unusable.

A restore that finds a sealed checkpoint corrupt in the store flags its step here
(``flag_quarantined``); everyone else lists and reads the records (``quarantined``,
``quarantine_reasons``): the ledger (onbox/sealing/ledger.py) no longer counts the step as
sealed, the room (onbox/sealing/room.py) never deletes its local copy, status and the laptop's
pull say why. Separate from the ledger because these few reads and one write are all most of
those readers need, not the fenced writer of MANIFESTs and LATEST; moving a record aside when a
newer epoch seals the step again stays the ledger's (``Ledger.put_manifest``).
"""

from __future__ import annotations

import functools
import json
import time
from typing import Dict, List, Optional

from onbox.common import jsondoc
from onbox.sealing import manifest as mf
from onbox.sealing.stores.base import Store, with_retries


def quarantined(store: Store, run: str) -> List[int]:
    """The steps flagged in ``quarantine/`` (whether or not their MANIFEST is still there)."""
    out = []
    for info in store.list(mf.quarantine_prefix(run)):
        name = info.key.rsplit("/", 1)[-1]
        if name.endswith(".json") and name[:-5].isdigit():
            out.append(int(name[:-5]))
    return sorted(out)


def quarantine_reason(data: Optional[bytes]) -> str:
    """The reason a quarantine record gives, for people; a record that is not rgt's JSON
    still quarantines its step (it is there), with a reason that says so."""
    try:
        doc = jsondoc.loads(data or b"")
        if isinstance(doc, dict) and isinstance(doc.get("reason"), str):
            return str(doc["reason"])
    except ValueError:
        pass
    return "flagged in quarantine/ (the record gives no reason)"


def quarantine_reasons(store: Store, run: str) -> Dict[int, str]:
    """Every quarantined step and the reason its record gives."""
    out = {}
    for step in with_retries(lambda: quarantined(store, run)):
        key = mf.quarantine_key(run, step)
        out[step] = quarantine_reason(with_retries(functools.partial(store.get_bytes, key)))
    return out


def flag_quarantined(store: Store, run: str, step: int, reason: str) -> None:
    """Write the quarantine record of ``step`` (found unusable in the store by a restore)."""
    record = json.dumps({"step": step, "reason": reason, "at": time.time(), "by": "restore"})
    with_retries(lambda: store.put_bytes(mf.quarantine_key(run, step), record.encode()))
