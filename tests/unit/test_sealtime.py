"""The seal time a scheduler's warning and a pod's grace come from (onbox/common/sealtime.py,
controller/sealbudget.py): measured from the run's own events, read from its store as untrusted
input, and never silently replaced by a constant."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List

import pytest

from controller import sealbudget
from onbox.agent.journal import iso
from onbox.common.errors import UsageError
from onbox.common.sealtime import SealTime, measure

T0 = 1_790_000_000.0


def _ev(kind: str, at: float, **data: Any) -> Dict[str, Any]:
    return {"time": iso(T0 + at), "kind": kind, **data}


def test_the_seal_time_is_from_the_ask_to_sealed_and_the_longest_recent_one_counts() -> None:
    events = [
        _ev("checkpoint_asked", 0),
        _ev("sealed", 4, seconds=1.0),  # the job took 3 s to write, rgt 1 s to seal
        _ev("checkpoint_asked", 100),
        _ev("sealed", 112.5, seconds=2.0),
        _ev("sealed", 150, seconds=0.5),  # the job's own checkpoint: not a measurement of an ask
    ]
    st = measure(events, "run r")
    assert st.seconds == pytest.approx(12.5)
    assert st.samples == 2 and not st.upload_only
    assert "12.5 s" in st.source and "run r" in st.source


def test_only_the_last_ten_seals_count() -> None:
    events: List[Dict[str, Any]] = [_ev("checkpoint_asked", 0), _ev("sealed", 60, seconds=1)]
    for i in range(10):
        at = 1000 + 100 * i
        events += [_ev("checkpoint_asked", at), _ev("sealed", at + 5, seconds=1)]
    assert measure(events).seconds == pytest.approx(5)


def test_a_job_never_asked_gives_the_upload_only_as_a_lower_bound() -> None:
    st = measure([_ev("sealed", 10, seconds=3.25), _ev("sealed", 20, seconds=1.0)])
    assert st.seconds == pytest.approx(3.25) and st.upload_only
    assert "not included" in st.source


def test_torn_and_hostile_events_are_skipped_not_trusted() -> None:
    events: List[Any] = [
        "not a dict",
        {"kind": "checkpoint_asked", "time": "yesterday"},
        _ev("sealed", 5, seconds=float("nan")),
        _ev("sealed", 6, seconds=-4),
        _ev("sealed", 7, seconds=True),
    ]
    st = measure(events)
    assert st.seconds is None and st.samples == 0
    assert st.source.startswith("not measured")


def test_the_lead_is_twice_the_seal_plus_slack_and_an_assumption_when_not_measured() -> None:
    assert SealTime(12.5, 2, "measured").lead(assumed=30, slack=60) == 85
    assert SealTime(None, 0, "not measured").lead(assumed=30, slack=60) == 120
    assert SealTime(1.0, 1, "measured").lead(assumed=30, floor=30) == 30


def test_the_store_mirror_is_read_for_the_run_and_a_missing_one_says_so(tmp_path: Any) -> None:
    root = tmp_path / "store"
    state = root / "r1" / "state"
    os.makedirs(state)
    lines = [json.dumps(_ev("checkpoint_asked", 0)), "{torn", json.dumps(_ev("sealed", 7))]
    (state / "events.jsonl").write_text("\n".join(lines) + "\n")
    url = f"file://{root}"
    st = sealbudget.seal_time(None, url, "r1")
    assert st.seconds == pytest.approx(7) and "run r1" in st.source
    other = sealbudget.seal_time(None, url, "r2")
    assert other.seconds is None and "holds no run r2" in other.source
    none = sealbudget.seal_time(None, None, "r1")
    assert none.seconds is None and "no store" in none.source


def test_the_flag_wins_and_a_bad_one_is_a_usage_error() -> None:
    st = sealbudget.seal_time("90s", "file:///nonexistent", "r1")
    assert st.seconds == 90 and "--seal-time 90s" in st.source
    for bad in ("0", "-5", "soon", "nan"):
        with pytest.raises(UsageError) as e:
            sealbudget.seal_time(bad, None, "r1")
        assert e.value.field == "--seal-time"


def test_a_store_this_laptop_cannot_open_is_not_measured_not_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`rgt emit` on a laptop without boto3 for an s3:// store: the manifest needs no read of
    the store, so the seal time is "not measured" (saying why), never a failed command."""
    import sys

    monkeypatch.setitem(sys.modules, "onbox.sealing.stores.s3", None)  # as if boto3 were absent
    st = sealbudget.from_store("s3://bucket/prefix", "r1")
    assert st.seconds is None and "cannot open the store s3://bucket/prefix" in st.source
