"""The health wing's core: the job file's [health] and [notify] settings, the watcher (events on
each verdict change and only then, a probe that raises does not stop the others, actions reach the
loop), and the bounded time series (rotation, coarse + fine merge, torn lines)."""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any, Dict, List

import pytest

from onbox.agent.journal import MemoryJournal
from onbox.agent.spec import JobSpec
from onbox.common.errors import UsageError
from onbox.health import config, series
from onbox.health.config import HealthConfig
from onbox.health.verdict import Action, Context, Reading, Verdict, ok
from onbox.health.watcher import HealthWatcher
from tests.conftest import ROOT

if sys.version_info >= (3, 11):
    import tomllib
else:  # the on-box tests run under 3.9 too
    import tomli as tomllib


def _ctx(**kw: Any) -> Context:
    base: Dict[str, Any] = dict(
        now=100.0, wall=1_700_000_000.0, state="RUNNING", attempt=1, attempt_started=90.0,
        job_pid=4242, tag="run:1:abc", sealing=None,
    )  # fmt: skip
    base.update(kw)
    return Context(**base)


# ---- settings
def test_defaults_round_trip_through_spec_json() -> None:
    cfg = config.parse({}, {})
    assert cfg == HealthConfig()
    spec = JobSpec("r", ("true",), "/", "/tmp", health=cfg)
    again = JobSpec.from_json(json.loads(json.dumps(spec.to_json())))
    assert again.health == cfg


def test_settings_are_read_and_checked() -> None:
    cfg = config.parse(
        {
            "health": {
                "interval": "2s",
                "disk": {"warn_at": 0.85, "scratch": "2G", "paths": ["data"]},
                "stall": {"floor": "30s", "action": "alert", "warmup": 2},
                "training": {"nan": "alert", "loss_pattern": r"loss=(\S+)"},
            },
            "notify": {"urls": ["ntfy://127.0.0.1/t"], "deadman": "https://hc-ping.com/x"},
        },
        {},
    )
    assert cfg.interval == 2.0
    assert cfg.disk.warn_at == 0.85 and cfg.disk.scratch == 2 << 30 and cfg.disk.paths == ("data",)
    assert cfg.stall.floor == 30.0 and cfg.stall.action == "alert" and cfg.stall.warmup == 2
    assert cfg.training.nan == "alert"
    assert cfg.notify.urls == ("ntfy://127.0.0.1/t",)
    assert cfg.notify.deadman == "https://hc-ping.com/x"


def test_notify_urls_and_deadman_come_from_the_environment_when_the_file_has_none() -> None:
    env = {"RGT_NOTIFY_URLS": "json://a/x  ntfy://b/y", "RGT_DEADMAN_URL": "http://127.0.0.1:9/p"}
    cfg = config.parse({}, env)
    assert cfg.notify.urls == ("json://a/x", "ntfy://b/y")
    assert cfg.notify.deadman == "http://127.0.0.1:9/p"
    # the job file wins over the environment
    cfg = config.parse({"notify": {"urls": ["json://c/z"]}}, env)
    assert cfg.notify.urls == ("json://c/z",)


@pytest.mark.parametrize(
    "data, field",
    [
        ({"health": {"bogus": 1}}, "health.bogus"),
        ({"health": {"disk": {"warn_at": 1.5}}}, "health.disk.warn_at"),
        ({"health": {"disk": {"scratch": "lots"}}}, "health.disk.scratch"),
        ({"health": {"stall": {"floor": "soon"}}}, "health.stall.floor"),
        ({"health": {"stall": {"action": "panic"}}}, "health.stall.action"),
        ({"health": {"training": {"loss_pattern": "("}}}, "health.training.loss_pattern"),
        ({"health": {"disk": {"prune_at": 0.95, "warn_at": 0.9}}}, "health.disk"),
        ({"notify": {"deadman": "ftp://x"}}, "notify.deadman"),
        ({"notify": {"urls": [3]}}, "notify.urls"),
        ({"notify": {"color": "red"}}, "notify.color"),
        ({"health": "yes"}, "health"),
    ],
)
def test_a_bad_setting_names_its_field(data: Dict[str, Any], field: str) -> None:
    with pytest.raises(UsageError) as e:
        config.parse(data, {})
    assert e.value.what.startswith(field) or field in e.value.line()
    assert e.value.exit_code == 2


# ---- the watcher
class Scripted:
    """A probe that says what the test tells it to (the watcher's seam)."""

    def __init__(self, name: str, script: List[Any]) -> None:
        self.name = name
        self.script = script
        self.seen: List[Dict[str, Reading]] = []
        self.closed = False

    def check(self, ctx: Context) -> Reading:
        self.seen.append(dict(ctx.readings))
        item = self.script.pop(0)
        if isinstance(item, Exception):
            raise item
        assert isinstance(item, Reading)
        return item

    def close(self) -> None:
        self.closed = True


def _warn(probe: str, reason: str, code: str = "high") -> Verdict:
    return Verdict(probe, "warn", code, reason, remedy="do something", klass="transient")


def test_an_event_on_each_change_of_level_or_code_and_only_then(tmp_path: Any) -> None:
    j = MemoryJournal()
    disk = Scripted(
        "disk",
        [
            Reading(ok("disk", "10% used")),
            Reading(ok("disk", "11% used")),  # same verdict, new numbers: no event
            Reading(_warn("disk", "91% used")),
            Reading(_warn("disk", "92% used")),  # same (level, code): no event
            Reading(ok("disk", "50% used")),  # recovered: an event
        ],
    )
    w = HealthWatcher(HealthConfig(), [disk], _ctx, j.event, series=series.Series(str(tmp_path)))
    for _ in range(5):
        w.tick()
    health = [e for e in j.events if e["kind"] == "health"]
    assert [(e["level"], e.get("was")) for e in health] == [("warn", "ok"), ("ok", "warn")]
    assert health[0]["class"] == "transient" and health[0]["remedy"] == "do something"
    assert health[1]["class"] is None  # a recovery is not a failure
    assert w.to_doc()["probes"]["disk"]["reason"] == "50% used"
    rows = series.read(str(tmp_path))
    assert len(rows) == 5 and all(r["attempt"] == 1 and r["state"] == "RUNNING" for r in rows)


def test_a_probe_that_raises_is_unknown_and_the_others_still_run() -> None:
    j = MemoryJournal()
    bad = Scripted("gpu", [RuntimeError("driver gone")])
    after = Scripted("stall", [Reading(ok("stall", "stepping"), sample={"step": 7})])
    w = HealthWatcher(HealthConfig(), [bad, after], _ctx, j.event)
    verdicts = w.tick()
    assert verdicts[0].level == "unknown" and verdicts[0].code == "probe_bug"
    assert "driver gone" in verdicts[0].reason
    assert verdicts[1].level == "ok"
    # the later probe saw the earlier one's reading (the stall probe asks the GPU's)
    assert after.seen[0]["gpu"].verdict.code == "probe_bug"
    w.stop()
    assert bad.closed and after.closed


def test_actions_reach_the_loop_with_a_save_when_verdicts_changed() -> None:
    woken: List[int] = []
    act = Action("restart", "stalled", remedy="see the stacks")
    p = Scripted("stall", [Reading(_warn("stall", "no step", "stalled"), actions=[act])])
    w = HealthWatcher(
        HealthConfig(), [p], _ctx, MemoryJournal().event, wake=lambda: woken.append(1)
    )
    w.tick()
    got = w.take_actions()
    assert [a.kind for a in got] == ["restart", "save"] and got[0] is act
    assert woken == [1]
    assert w.take_actions() == []  # taken once


def test_a_nan_sample_is_written_as_a_string_not_invalid_json(tmp_path: Any) -> None:
    p = Scripted("training", [Reading(ok("training", "x"), sample={"loss": float("nan")})])
    w = HealthWatcher(HealthConfig(), [p], _ctx, MemoryJournal().event)
    w.series = series.Series(str(tmp_path))
    w.tick()
    (row,) = series.read(str(tmp_path))
    assert row["training.loss"] == "nan"


# ---- the time series
def test_the_series_is_bounded_and_rotates(tmp_path: Any) -> None:
    s = series.Series(str(tmp_path), max_bytes=2000)
    for i in range(400):
        s.append({"t": float(i), "attempt": 1, "state": "RUNNING", "x": i})
    for name in ("samples", "coarse"):
        files = series.files(str(tmp_path), name)
        assert 1 <= len(files) <= series.KEEP
        assert all(os.path.getsize(f) <= 2000 for f in files)
    rows = series.read(str(tmp_path))
    ts = [r["t"] for r in rows]
    assert ts == sorted(ts) and ts[-1] == 399.0
    # the coarse series reaches further back than the fine one, one row in COARSE_EVERY
    fine_start = min(r["t"] for p in series.files(str(tmp_path), "samples") for r in series.rows(p))
    assert ts[0] < fine_start
    assert all(int(t) % series.COARSE_EVERY == 0 for t in ts if t < fine_start)


def test_a_torn_last_line_is_skipped(tmp_path: Any) -> None:
    s = series.Series(str(tmp_path))
    s.append({"t": 1.0, "attempt": 1, "state": "RUNNING"})
    with open(os.path.join(str(tmp_path), "samples.jsonl"), "a") as f:
        f.write('{"t": 2.0, "attem')
    assert [r["t"] for r in series.read(str(tmp_path))] == [1.0]


def test_the_readme_job_file_example_of_health_and_notify_parses_to_the_defaults() -> None:
    """README's "Job file" block: its [health] tables say the defaults, and are valid."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    block = next(b for b in re.findall(r"```toml\n(.*?)```", text, re.S) if "[health]" in b)
    data = tomllib.loads(block)
    cfg = config.parse({k: data[k] for k in ("health", "notify")}, {})
    defaults = HealthConfig()
    for part in ("disk", "memory", "gpu", "stall"):
        assert getattr(cfg, part) == getattr(defaults, part), part
    assert cfg.interval == defaults.interval and cfg.enabled
    assert cfg.training.nan == defaults.training.nan
    assert cfg.notify.rate_per_hour == defaults.notify.rate_per_hour


def test_a_first_verdict_of_ok_or_unavailable_is_no_event() -> None:
    """No GPU on this box is said in status, not journaled at every agent start; a probe that
    cannot read its signal (unknown) is an event from the first tick."""
    j = MemoryJournal()
    gpu = Scripted("gpu", [Reading(Verdict("gpu", "unavailable", "no_gpu", "no GPU seen"))])
    stall = Scripted("stall", [Reading(Verdict("stall", "unknown", "unknown", "cannot read"))])
    w = HealthWatcher(HealthConfig(), [gpu, stall], _ctx, j.event)
    w.tick()
    assert [e["probe"] for e in j.events if e["kind"] == "health"] == ["stall"]
    assert w.to_doc()["probes"]["gpu"]["code"] == "no_gpu"
