"""What a run's store holds of its checkpoints, for ``rgt down``: the sealed steps the store's
rotation left, and each one's files with their sizes; and the job's logs it holds (``logs``:
DONE.json's, or ENDED.json's for a run that ended FAILED or STOPPED, and each epoch's log
document's: every box that sealed its logs, a preempted one too).

Down must not call "lost" a checkpoint on the box that is sealed in a store that outlives the
box, nor promise that the store keeps more than it does: the agent's rotation prunes sealed
steps as it seals new ones (onbox/sealing/ledger.py: it keeps the newest ``[checkpoint] keep``,
3 unless the job file says otherwise, the one LATEST names and the newest before it, and each
pinned one). What the store holds is read from it, where the run's other documents are read
(controller/results/sealed.py ``newest_sealed``): a file:// store of an ssh target on the box,
any other store from the laptop. A quarantined step (a restore found it unusable) counts as not
held, and so does one whose MANIFEST cannot be read as rgt writes it: down then says lost rather
than kept.
"""

from __future__ import annotations

import functools
from typing import Callable, Dict, List, Optional, Tuple

from controller.registry import RunRecord
from controller.remote import Remote
from controller.results.boxdocs import BoxDocs
from controller.results.documents import sealed_logs, store_get, store_log_docs
from controller.runstore import open_run_store
from onbox.common.errors import IntegrityError
from onbox.sealing import manifest as mf
from onbox.sealing.quarantine import quarantine_reasons
from onbox.sealing.restore import sealed_steps
from onbox.sealing.stores.base import with_retries
from onbox.sealing.stores.local import LocalStore

# {sealed step: {path under the checkpoint dir: size}}
Held = Dict[int, Dict[str, int]]


def held(rec: RunRecord, remote: Optional[Remote]) -> Held:
    """The sealed, not quarantined, steps of ``rec`` in its store, with their files; a file://
    store of an ssh target is read on the box through ``remote`` (None: on this machine)."""
    store = open_run_store(rec)
    if isinstance(store, LocalStore) and rec.target.kind != "local" and remote is not None:
        docs = BoxDocs(remote, store.root)
        steps, bad = docs.listing(rec.name)
        keys = [mf.manifest_key(rec.name, s) for s in steps if s not in bad]
        if keys:
            docs.prefetch(keys)  # one round trip for every MANIFEST
        return _files(rec.name, steps, bad, docs.get)
    steps = with_retries(lambda: sealed_steps(store, rec.name))
    bad = quarantine_reasons(store, rec.name)
    return _files(rec.name, steps, bad, functools.partial(store_get, store))


def _files(
    run: str, steps: List[int], bad: Dict[int, str], get: Callable[[str], Optional[bytes]]
) -> Held:
    out: Held = {}
    for step in steps:
        if step in bad:
            continue
        data = get(mf.manifest_key(run, step))
        if data is None:  # pruned since it was listed
            continue
        try:
            doc = mf.parse_manifest(data, mf.manifest_key(run, step))
        except IntegrityError:
            continue
        if doc["step"] == step:
            out[step] = {str(f["path"]): int(f["size"]) for f in doc["files"]}
    return out


def holding(held: Held, path: str, size: int) -> Optional[int]:
    """The newest sealed step that holds the file ``path`` (under the checkpoint dir) with
    ``size`` bytes, or None."""
    found = [s for s, files in held.items() if files.get(path) == size]
    return max(found) if found else None


def steps_text(steps: List[int]) -> str:
    """``[6, 9]`` -> "steps 6 and 9"."""
    names = [str(s) for s in sorted(steps)]
    if len(names) == 1:
        return f"step {names[0]}"
    return f"steps {', '.join(names[:-1])} and {names[-1]}"


def store_line(store: str, held: Held, keep: Optional[int]) -> str:
    """Down's kept line for a store that outlives the box: what it holds now, and its rule."""
    rule = (
        f"its rotation kept the newest {keep} ([checkpoint] keep)"
        if keep is not None
        else "its rotation kept the newest [checkpoint] keep (3 unless the job file set it)"
    )
    what = f"the sealed checkpoints of {steps_text(list(held))}" if held else "no sealed checkpoint"
    return (
        f"the store {store}: {what} ({rule}, with the one LATEST names, the one before it and "
        "any pinned; down deletes nothing in it)"
    )


def grouped(
    found: List[Tuple[int, str, int]], store: str, human: Callable[[float], str]
) -> List[str]:
    """Kept lines for the box's checkpoint files (step, path, size) that the store holds,
    one line per sealed step; ``human`` writes a size."""
    by_step: Dict[int, List[Tuple[str, int]]] = {}
    for step, path, size in found:
        by_step.setdefault(step, []).append((path, size))
    out = []
    for step, files in sorted(by_step.items()):
        names = files[0][0] + (f" and {len(files) - 1} more files" if len(files) > 1 else "")
        out.append(
            f"checkpoint {names} ({human(sum(s for _, s in files))}): not in the receipt, "
            f"sealed in the store {store} (step {step})"
        )
    return out


def logs(rec: RunRecord, remote: Optional[Remote]) -> Dict[str, Tuple[int, bool]]:
    """The job's logs ``rec``'s store holds (DONE.json's, or ENDED.json's: a run that ended
    FAILED or STOPPED), by their name in a pull: (size, redacted). Read where ``held`` reads;
    documents that cannot be read as rgt writes them hold none (down then says lost)."""
    store = open_run_store(rec)
    if isinstance(store, LocalStore) and rec.target.kind != "local" and remote is not None:
        docs = BoxDocs(remote, store.root)
        get: Callable[[str], Optional[bytes]] = docs.get
        log_docs = functools.partial(docs.log_docs, rec.name)
    else:
        get = functools.partial(store_get, store)
        log_docs = functools.partial(store_log_docs, store, rec.name)
    try:
        return sealed_logs(rec.name, get, log_docs)
    except IntegrityError:
        return {}
