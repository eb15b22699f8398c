"""``rgt reconcile PLAN.toml``: the sweep's expected roster against what is sealed, the hard gate
before any of its boxes is taken down (``gate``, called by ``rgt down``).

Each cell's current run (the sweep record's, controller/sweep/record.py) is read from the store
with this laptop's credentials, as ``rgt pull --from store`` reads it
(controller/results/documents.py ``from_documents``: LATEST -> MANIFEST, and DONE.json), and
every file of its sealed state is fetched into a private temporary directory and verified as a
pull verifies it: size and sha256 against the manifest, then opened as its framework would
(controller/results/loadcheck.py ``check_format``). Existence or a "synced" line does not count.
A cell is

- ``ok``: DONE.json, no declared output missing, every file there with its sha256, loadable;
- ``failed``: no DONE.json and the run FAILED (the store's state mirror, or the sweep saw it);
- ``missing``: no DONE.json otherwise (never ran, still running, or its box died); of a run
  the store holds no trace of, not even its epoch (``RUN/epochs/``, taken by its agent before
  its job starts), the reason says so, as `rgt pull` does (controller/results/sealed.py
  ``has_trace``): its agent has not started, or the store is not the one its box writes to;
- ``unverified``: DONE.json, but a file is missing or has other bytes, a declared output was
  missing when the job succeeded, or its documents do not parse.

A verdict says what the store holds, never that it could not be read: a read that fails after
the store layer's retries (a reset, a 5xx, a timeout, a call past the ``[store] stall`` bound, a
download that moves nothing for as long) ends the command with that StoreError (exit 14),
naming the cell and the read, and writes no verdict, so `rgt sweep` trains nothing again for a
network blip. Only a store that answers, and answers that an object is missing, can make a cell
unverified.

Duplicates: a run in the store under the sweep's prefix (``<sweep>-``, shaped as a cell's run
name) that claims a cell of the roster but was never deployed by this sweep (two runs claiming
one cell), or matches no cell of the roster nor of another sweep this laptop knows. That
listing (retried as every read) comes before any cell is judged: a store that cannot list ends
the command as a failed read does, with nothing half-done. The verdicts are written to the
record; ``rgt sweep PLAN.toml`` then launches a fresh run of the identical config for each
failed or unverified cell (and continues each missing one).
Reconciled means every cell ok and no duplicate; else NotReconciled (exit 18).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import re
import shutil
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from controller.registry import RunRecord
from controller.results.documents import from_documents, store_get, store_listing
from controller.results.entries import Entry, stage_path
from controller.results.hashing import file_sha
from controller.results.loadcheck import check_format
from controller.results.sealed import cannot_read, has_trace, no_trace_what, wrong_store
from controller.results.transport import fetch_store
from controller.runstore import open_sweep_store, sweep_store_stall
from controller.sweep import record
from onbox.common import jsondoc
from onbox.common.errors import (
    IntegrityError,
    NotReconciled,
    PermanentStoreError,
    StoreError,
    UnsafeRefused,
)
from onbox.common.storeurl import RESTORE_STALL
from onbox.common.terminal import printable
from onbox.sealing import manifest as mf
from onbox.sealing.stall import RestoreStalled, took
from onbox.sealing.stores.base import Store, with_retries
from onbox.sealing.stores.local import LocalStore

VERDICTS = ("ok", "missing", "failed", "unverified")
_RERUN = re.compile(r"-r\d{1,3}\Z")


@dataclasses.dataclass(frozen=True)
class Finding:
    """One cell of the roster, as the store has it."""

    cell: str
    run: str
    box: str
    verdict: str  # one of VERDICTS
    reason: str

    @property
    def ok(self) -> bool:
        return self.verdict == "ok"


@dataclasses.dataclass
class Report:
    """The roster reconciled: a finding per cell, and the duplicate runs found in the store."""

    sweep: str
    findings: List[Finding]
    duplicates: List[Dict[str, str]]

    @property
    def ok(self) -> bool:
        return all(f.ok for f in self.findings) and not self.duplicates

    def of(self, verdict: str) -> List[Finding]:
        return [f for f in self.findings if f.verdict == verdict]

    def to_json(self) -> Dict[str, Any]:
        return {
            "sweep": self.sweep,
            "reconciled": self.ok,
            "cells": [dataclasses.asdict(f) for f in self.findings],
            **{v: [f.cell for f in self.of(v)] for v in VERDICTS if v != "ok"},
            "duplicates": self.duplicates,
            "total": len(self.findings),
            "ok": len(self.of("ok")),
        }

    def lines(self, plan_path: str) -> List[str]:
        """The report as the terminal shows it: a reason names what the store holds (a path
        its DONE.json lists, an output it says is missing), so each line is ``printable``."""
        out = [
            f"sweep {self.sweep}: {len(self.of('ok'))}/{len(self.findings)} cells reconciled"
            + ("" if self.duplicates else "")
        ]
        for f in self.findings:
            if not f.ok:
                line = f"  {f.verdict.upper()}: {f.cell} (run {f.run} on {f.box}): {f.reason}"
                out.append(printable(line))
        for d in self.duplicates:
            out.append(printable(f"  DUPLICATE: {d['run']}: {d['why']}"))
        if not self.ok:
            out.append(
                f"  remedy: rgt sweep {plan_path} launches a fresh run of the identical config "
                "for each failed or unverified cell and continues each missing one; a duplicate "
                "is for you to look at (rgt never deletes from the store)"
            )
        return out


def _failed_in_store(store: Store, run: str) -> bool:
    raw = store_get(store, mf.state_key(run, "state.json"))
    try:
        doc = jsondoc.loads(raw) if raw is not None else None
    except ValueError:
        return False
    return isinstance(doc, dict) and doc.get("state") == "FAILED"


def check_run(
    store: Store,
    run: str,
    seen_failed: bool,
    tmp: str,
    stall: float = RESTORE_STALL,
    where: Optional[str] = None,
) -> Tuple[str, str]:
    """(verdict, reason) of one run (module docstring), judged by its DONE.json as first read
    (one removed or rewritten meanwhile is not read again); files fetched under ``tmp``, each
    download that moves nothing for ``stall`` seconds ended (RestoreStalled); ``where`` names
    the store in a reason (its URL and endpoint; default its URL). A store that cannot be
    read raises its StoreError: that is no verdict (``reconcile``)."""
    done = store_get(store, mf.done_key(run))
    if done is None:
        if seen_failed or _failed_in_store(store, run):
            return "failed", "the run FAILED: no DONE.json (rgt logs or the store's logs say why)"
        if not has_trace(store, run):  # not on its way to DONE.json here: say what it may be
            wrong = wrong_store(isinstance(store, LocalStore))
            return "missing", (
                f"{no_trace_what(where or store.url, run)}: its agent has not started yet, or "
                f"its box writes to another store than this one ({wrong})"
            )
        return "missing", "no DONE.json in the store: never ran, still running, or its box died"

    def get(key: str) -> Optional[bytes]:
        # DONE.json is read once: the cell is judged by the one seen. Read again, it could be
        # gone (from_documents: nothing sealed, for a cell just seen sealed) or other.
        return done if key == mf.done_key(run) else store_get(store, key)

    try:
        ident, entries = from_documents(run, get, functools.partial(store_listing, store, run))
    except IntegrityError as err:  # said as pull says it: which store, why, what to do
        # No pair around what to do: a document's own remedy may hold one, and the gate's
        # line (what (remedy)) holds the reason inside the CLI's.
        what, look = cannot_read(f"the store {where or store.url}", err)
        return "unverified", f"{what}; what to do: {look}"
    if ident.missing_outputs:
        missing = ", ".join(ident.missing_outputs)
        return "unverified", f"declared output(s) {missing} missing when the job succeeded"
    for i, e in enumerate(entries):
        bad = _check_file(store, e, os.path.join(tmp, str(i)), stall)
        if bad is not None:
            return "unverified", bad
    return "ok", f"DONE.json and {len(entries)} files verified (sha256, loaded where a format)"


def _check_file(store: Store, e: Entry, stage: str, stall: float) -> Optional[str]:
    """Why the file ``e`` in the store is not as sealed (None when it is): fetched into
    ``stage`` as a pull fetches it (transport.fetch_store: the stall watch, the size checked
    before the bytes), hashed, opened as its format, removed."""
    assert e.key is not None
    info = with_retries(lambda: store.stat(e.key or ""))
    if info is None:  # the store answered, and has no such object: it is not as sealed
        return f"{e.path} is missing from the store ({e.key})"
    if info.size != e.size:  # not fetched: it could fill this disk
        return f"{e.path} is {info.size} bytes in the store, sealed as {e.size} bytes"
    os.makedirs(stage, 0o700)
    try:
        fetch_store(store, [e], stage, lambda _e, sha256=None: None, stall)
    except IntegrityError as err:  # its size changed since the stat: other bytes
        return err.what
    except RestoreStalled:  # said here as a reconcile's: the pull's words tell to pull again
        raise RestoreStalled(
            f"{store.url} sent nothing for {took(stall)} while {e.key} was downloaded: it "
            "stopped answering mid-file",
            "check the store and the way to it: the network, a stopped server, a hung mount",
        ) from None
    except PermanentStoreError:
        if with_retries(lambda: store.stat(e.key or "")) is None:  # removed since the stat
            return f"{e.path} is missing from the store ({e.key})"
        raise
    dest = stage_path(stage, e)
    try:
        size, sha = file_sha(dest)
        if (size, sha) != (e.size, e.sha256):
            return (
                f"{e.path} is {size} bytes sha256 {sha[:12]} in the store, sealed as "
                f"{e.size} bytes sha256 {e.sha256[:12]}"
            )
        check_format(dest, e.path)
    except IntegrityError as err:
        return err.what
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return None


def _unread(err: StoreError, lead: str, plan: str) -> StoreError:
    """``err`` (its class, so its exit code) after ``lead`` (the sweep and what could not be
    read), saying that no verdict was written, and to run the command again."""
    out = copy.copy(err)  # its class and exit code; the store's own error left as it was
    out.what = (
        f"{lead}: {err.what.rstrip('.')}; no verdict was written (the record keeps the last "
        "ones) and nothing is re-run"
    )
    # No parentheses of its own: the CLI's line puts the whole remedy in a pair.
    out.remedy = (err.remedy + "; " if err.remedy else "") + (
        f"then run it again: rgt reconcile {plan} checks every cell anew"
    )
    out.args = (out.what,)
    return out


def _duplicates(store: Store, doc: Dict[str, Any], home: Optional[str]) -> List[Dict[str, str]]:
    sweep = doc["sweep"]
    shape = re.compile(re.escape(sweep) + r"-[a-z0-9-]+-[0-9a-f]{8}(-r\d{1,3})?\Z")
    try:  # read whole in the retried call: a listing's errors come as it is iterated
        keys = with_retries(lambda: [i.key for i in store.list(sweep + "-")])
    except StoreError as e:
        lead = (
            f"sweep {sweep}: the store could not be listed under {store.url}/{sweep}- (the runs "
            "under the sweep's prefix, looked through for duplicates)"
        )
        raise _unread(e, lead, doc.get("plan") or "PLAN.toml") from None
    names = {k.split("/", 1)[0] for k in keys}
    others = {
        n for d in record.all_records(home) if d.get("sweep") != sweep for n in d["cells"]
    }  # fmt: skip
    out = []
    for name in sorted(n for n in names if shape.match(n)):
        base = _RERUN.sub("", name)
        cell = doc["cells"].get(base)
        if cell is not None:
            if name not in cell["runs"] and name != cell["run"]:
                why = f"claims cell {base}, but this sweep never deployed it (another laptop?)"
                out.append({"run": name, "cell": base, "why": why})
        elif base not in others:
            why = "under the sweep's prefix, but no cell of its roster (an older grid?)"
            out.append({"run": name, "cell": "", "why": why})
    return out


def reconcile(
    doc: Dict[str, Any],
    *,
    cells: Optional[Sequence[str]] = None,
    home: Optional[str] = None,
    duplicates: bool = True,
    say: Optional[Callable[[str], None]] = None,
) -> Report:
    """The roster of the sweep record ``doc`` (or only ``cells`` of it) against its store."""
    store = open_sweep_store(doc["store"], doc.get("store_endpoint_url"), doc.get("store_stall"))
    stall = sweep_store_stall(doc.get("store_stall"))
    endpoint = doc.get("store_endpoint_url")
    where = f"{doc['store']} at {endpoint}" if endpoint else str(doc["store"])
    names = sorted(
        cells if cells is not None else doc["cells"], key=lambda n: doc["cells"][n]["index"]
    )
    # Listed first: a listing that fails then leaves no cell judged and its verdict lost.
    dups = _duplicates(store, doc, home) if duplicates else []
    findings = []
    tmp = tempfile.mkdtemp(prefix="rgt-reconcile-")
    try:
        for name in names:
            c = doc["cells"][name]
            try:
                verdict, reason = check_run(
                    store, c["run"], c["state"] == "failed", os.path.join(tmp, name), stall, where
                )
            except StoreError as e:
                # The store could not be read (after its own retries: a reset, a 5xx, a
                # timeout, a hang): nothing known of the cell, so no verdict; an "unverified"
                # one would have `rgt sweep` train it again as a fresh run.
                lead = (
                    f"sweep {doc['sweep']}: cell {name} (run {c['run']}): the store could not "
                    "be read"
                )
                raise _unread(e, lead, doc.get("plan") or "PLAN.toml") from None
            findings.append(Finding(name, c["run"], c["box"], verdict, reason))
            if say is not None:
                say(f"  {name}: {verdict}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Report(doc["sweep"], findings, dups)


def remember(report: Report, home: Optional[str] = None) -> None:
    """The verdicts into the sweep record, for ``rgt sweep``'s remedy."""
    with record.update(report.sweep, home) as doc:
        for f in report.findings:
            c = doc["cells"].get(f.cell)
            if c is not None and c["run"] == f.run:
                c["verdict"] = {"verdict": f.verdict, "reason": f.reason, "at": time.time()}


def raise_unless_ok(report: Report, plan_path: str) -> None:
    if not report.ok:
        bad = [f for f in report.findings if not f.ok]
        raise NotReconciled(
            f"sweep {report.sweep}: {len(bad)} of {len(report.findings)} cells not reconciled, "
            f"{len(report.duplicates)} duplicate run(s)",
            f"rgt sweep {plan_path} re-runs them; then rgt reconcile {plan_path} again",
        )


def gate(rec: RunRecord, home: Optional[str] = None) -> None:
    """``rgt down``'s gate: UnsafeRefused while a cell of a sweep that ran on ``rec``'s box is
    not reconciled (checked against the store now, not by an earlier reconcile's word)."""
    for doc in record.all_records(home):
        ran = [
            n for n, c in doc["cells"].items()
            if c["runs"] and record.cell_target(c) == rec.target
        ]  # fmt: skip
        if not ran:
            continue
        report = reconcile(doc, cells=ran, home=home, duplicates=False)
        bad = [f for f in report.findings if not f.ok]
        if bad:
            # a reason holds the store's words: shown as one line, driving nothing. No pair
            # around it: a reason's own parentheses would nest, as would the remedy's inside
            # the CLI's line (what (remedy)).
            shown = printable("; ".join(f"{f.cell} is {f.verdict}: {f.reason}" for f in bad[:3]))
            more = f"; and {len(bad) - 3} more" if len(bad) > 3 else ""
            raise UnsafeRefused(
                f"run {rec.name}: {rec.target.label} ran cells of sweep {doc['sweep']} that are "
                f"not reconciled: {shown}{more}",
                f"rgt reconcile {doc.get('plan') or 'PLAN.toml'}, then rgt sweep it to re-run "
                "them; down only once every cell that ran there is sealed and verified",
            )
