"""The seal time a scheduler's warning and a pod's grace are derived from, as the laptop finds
it: ``--seal-time S`` when the user measured it (``rgt smoke``, an earlier run), else the run's
own events mirrored in its store (``RUN/state/events.jsonl``: a run that sealed before, e.g. the
previous allocation of the same job; for a sweep, each cell's run, the longest seal of them),
else nothing measured (onbox/common/sealtime.py then uses the caller's assumption and says so).

Everything read from the store is untrusted: an events file larger than MAX_EVENTS_BYTES is read
from its end, torn and foreign lines are skipped, and a number that is not a finite seconds
value counts as no measurement.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Union

from onbox.common import jsondoc
from onbox.common.duration import parse_duration
from onbox.common.errors import StoreError, UsageError
from onbox.common.sealtime import SealTime, measure
from onbox.common.storeurl import StoreURL
from onbox.sealing import manifest as mf

MAX_EVENTS_BYTES = 8 << 20


def _lines(raw: Optional[bytes]) -> List[Dict[str, Any]]:
    if not raw:
        return []
    if len(raw) > MAX_EVENTS_BYTES:
        raw = raw[-MAX_EVENTS_BYTES:]
        raw = raw[raw.find(b"\n") + 1 :]  # the first line is torn
    return jsondoc.objects(raw.splitlines())


def from_store(store_url: Union[str, StoreURL, None], run: str) -> SealTime:
    """The seal time measured from ``run``'s mirrored events in ``store_url`` (a StoreURL
    carries its endpoint; not measured when there is no store, no such run, or the store
    cannot be read: said in ``source``)."""
    return longest(store_url, [run])


def longest(store_url: Union[str, StoreURL, None], runs: Sequence[str]) -> SealTime:
    """The longest seal measured over ``runs`` in ``store_url`` (a sweep's cells: one pod grace,
    one Slurm warning covers every cell, so the slowest one's seal is what it must fit), its
    ``source`` naming that run and how many of the cells were measured; not measured when none
    of them was, or when the store cannot be read."""
    what = f"run {runs[0]}" if len(runs) == 1 else f"the sweep's {len(runs)} cells"
    if not store_url:
        return SealTime(None, 0, f"not measured: {what} has no store to read its seals from")
    from onbox.sealing.stores import open_store

    found: List[SealTime] = []
    try:
        store = open_store(store_url)
        for run in runs:
            raw = store.get_bytes(mf.state_key(run, "events.jsonl"))
            none = f"not measured: the store {store_url} holds no run {run} yet"
            found.append(
                measure(_lines(raw), f"run {run}") if raw is not None else SealTime(None, 0, none)
            )
    except StoreError as e:
        return SealTime(None, 0, f"not measured: the store {store_url} cannot be read ({e.what})")
    except UsageError as e:  # e.g. s3:// on a laptop without boto3: the output needs no read
        return SealTime(
            None, 0, f"not measured: this laptop cannot open the store {store_url} ({e.what})"
        )
    measured = [st for st in found if st.seconds is not None]
    if not measured:
        if len(runs) == 1:
            return found[0]
        return SealTime(None, 0, f"not measured: none of {what} has a seal in {store_url} yet")
    best = max(measured, key=lambda st: st.seconds or 0.0)
    if len(runs) == 1:
        return best
    return dataclasses.replace(
        best,
        source=f"{best.source} (the slowest of the sweep's {len(runs)} cells, "
        f"{len(measured)} of them measured)",
    )


def given(value: str) -> SealTime:
    """``--seal-time S`` (seconds or a duration: 45, 90s, 2m), checked."""
    seconds = parse_duration(value, "--seal-time")  # refuses 0, negatives, NaN, words
    return SealTime(float(seconds), 1, f"given: --seal-time {value}")


def seal_time(
    seal_time_flag: Optional[str], store_url: Union[str, StoreURL, None], run: str
) -> SealTime:
    """The flag when given, else the store's measurement."""
    if seal_time_flag is not None:
        return given(seal_time_flag)
    return from_store(store_url, run)


def seal_time_over(
    seal_time_flag: Optional[str], store_url: Union[str, StoreURL, None], runs: Sequence[str]
) -> SealTime:
    """The flag when given, else the longest seal measured over ``runs`` (``longest``)."""
    if seal_time_flag is not None:
        return given(seal_time_flag)
    return longest(store_url, runs)
