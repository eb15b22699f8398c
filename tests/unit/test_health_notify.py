"""The notifier's choices and limits (onbox/health/notify.py): which events become messages,
deduplication, the hourly rate limit and the per-kind throttle, redaction of sink URLs, the
bounded queue, a stuck sink, Apprise missing. Sends go to a real HTTP server on 127.0.0.1
(tests/httpsink.py) through real Apprise; the limits are driven by a settable clock.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, Dict, Iterator, List

import pytest

from onbox.health.config import NotifyConfig
from onbox.health.notify import Chooser, Limits, Message, Notifier, safe_url, wanted
from tests.httpsink import HttpSink, closed_port
from tests.polling import wait


class Events:
    """What the notifier wrote to the journal."""

    def __init__(self) -> None:
        self.got: List[Dict[str, Any]] = []

    def __call__(self, kind: str, reason: str, **data: Any) -> None:
        self.got.append({"kind": kind, "reason": reason, **data})

    def kinds(self) -> List[str]:
        return [e["kind"] for e in self.got]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def sink() -> Iterator[HttpSink]:
    s = HttpSink("ok")
    yield s
    s.close()


def _health(probe: str, level: str, reason: str = "r") -> Dict[str, Any]:
    return {"kind": "health", "probe": probe, "level": level, "reason": reason, "remedy": "fix"}


def _state(state: str, reason: str = "why", attempt: int = 1) -> Dict[str, Any]:
    return {"kind": "state", "state": state, "reason": reason, "remedy": "", "attempt": attempt}


# ---- redaction
@pytest.mark.parametrize(
    "url, shown",
    [
        ("ntfy://127.0.0.1:8080/topic", "ntfy://127.0.0.1:8080/…"),
        ("json://user:hunter2pass@hooks.example.com/path?x=1", "json://hooks.example.com/…"),
        ("tgram://123456789:AAbbCCddEEff/12345", "tgram://…/…"),
        ("discord://80123456789/s3cr3tt0k3n", "discord://…/…"),
        ("mailtos://me:pw@smtp.example.com?to=a@b.c", "mailtos://smtp.example.com/…"),
        ("gotify://[::1]:8008/TOKEN", "gotify://[::1]:8008/…"),
        ("no url at all", "…"),
    ],
)
def test_safe_url_keeps_scheme_and_host_only(url: str, shown: str) -> None:
    assert safe_url(url) == shown


# ---- what is news
def test_chooser_sends_concerns_at_or_above_min_level_and_their_recovery() -> None:
    c = Chooser("r1", "warn")
    assert c.message(_health("disk", "unknown")) is None
    assert c.message(_health("memory", "ok")) is None  # never raised: not news
    m = c.message(_health("disk", "warn", "inodes 95% used"))
    assert m is not None and m.title == "rgt r1: disk warn" and m.kind == "warning"
    assert "inodes 95% used" in m.body and "remedy: fix" in m.body
    a = c.message(_health("disk", "alert"))
    assert a is not None and a.kind == "failure"
    back = c.message(_health("disk", "ok", "inodes 40% used"))
    assert back is not None and back.title == "rgt r1: disk ok again" and back.kind == "success"
    assert c.message(_health("disk", "ok")) is None  # once


def test_chooser_min_level_alert_leaves_warnings_out() -> None:
    c = Chooser("r1", "alert")
    assert c.message(_health("gpu", "warn")) is None
    assert c.message(_health("gpu", "ok")) is None
    assert c.message(_health("gpu", "alert")) is not None


def test_terminal_states_and_restarts_are_news_other_states_not() -> None:
    c = Chooser("r1", "alert")
    for state, kind in [("SUCCEEDED", "success"), ("FAILED", "failure"), ("STOPPED", "info")]:
        m = c.message(_state(state))
        assert m is not None and m.title == f"rgt r1: {state}" and m.kind == kind and m.urgent
    b = c.message(_state("BACKOFF", "attempt 2 crashed", attempt=2))
    assert b is not None and b.title == "rgt r1: restarting after attempt 2" and not b.urgent
    assert not wanted(_state("RUNNING")) and not wanted(_state("STOPPING"))
    assert wanted({"kind": "stall"}) and not wanted({"kind": "seal"})


def test_an_agent_that_leaves_its_run_unended_is_news_never_rate_limited() -> None:
    """The agent's ``agent_left`` (a success whose results the store did not take, the run left
    RUNNING): no terminal state is written, so this is what a person hears, with the reason
    and the start that completes it. Before: not wanted, so nothing was sent."""
    ev = {
        "kind": "agent_left",
        "reason": "run r1: the agent exits, leaving the run RUNNING: its results are not sealed",
        "remedy": "`rgt-agent start --name r1` once the store answers",
        "class": "transient",
    }
    assert wanted(ev)
    m = Chooser("r1", "alert").message(ev)
    assert m is not None and m.title == "rgt r1: the agent left the run unended"
    assert m.kind == "failure" and m.urgent
    assert "results are not sealed" in m.body and "rgt-agent start --name r1" in m.body


# ---- limits
def test_dedup_throttle_and_rate_limit() -> None:
    clock = Clock()
    lim = Limits(NotifyConfig(rate_per_hour=3, dedup=60.0), clock)
    a = Message("t", "same", "info")
    assert lim.admit("stall", a) == "send"
    clock.t += 30
    assert lim.admit("stall", a) == "deduped"
    clock.t += 31
    assert lim.admit("stall", a) == "send"  # past the dedup window
    assert lim.admit("seal_error", Message("t", "e1", "warning")) == "send"
    assert lim.admit("seal_error", Message("t", "e2", "warning")) == "throttled"  # 1 an hour
    assert lim.admit("stall", Message("t", "other", "info")) == "limited"  # 3 this hour
    assert lim.admit("state", Message("t", "FAILED", "failure", urgent=True)) == "send"
    clock.t += 3600
    assert lim.admit("stall", Message("t", "later", "info")) == "send"
    assert lim.counts == {"deduped": 1, "throttled": 1, "limited": 1}


def test_listen_never_blocks_a_full_queue_drops_the_oldest() -> None:
    ev = Events()
    n = Notifier(NotifyConfig(urls=("json://127.0.0.1:9/x",)), "r1", ev, queue_max=2)
    for i in range(5):  # the sender is not started: nothing is taken off the queue
        n.listen(_health(f"p{i}", "alert"))
    n.listen({"kind": "notify_failed", "reason": "own events are not news"})
    n.listen(_state("RUNNING"))
    assert n.counts["dropped"] == 3 and n.counts["queued"] == 5
    assert [e["probe"] for e in n.backlog()] == ["p3", "p4"]


# ---- sending, through Apprise to a real local server
def test_sends_deduplicates_and_limits_with_one_limited_event(sink: HttpSink) -> None:
    ev = Events()
    url = f"json://127.0.0.1:{sink.port}/hook"
    n = Notifier(NotifyConfig(urls=(url,), rate_per_hour=2, dedup=3600.0, timeout=5.0), "r1", ev)
    n.start()
    n.listen(_health("disk", "alert", "inodes 99%"))
    n.listen(_health("disk", "ok", "x"))
    n.listen(_health("disk", "alert", "inodes 99%"))  # the first again: deduplicated
    n.listen(_health("gpu", "alert", "hot"))  # the third message this hour: held back
    n.listen(_health("mem", "alert", "full"))
    n.listen(_state("FAILED", "budget spent"))  # terminal: always sent
    n.finish("FAILED")
    titles = [r.json()["title"] for r in sink.seen("/hook")]
    assert titles == ["rgt r1: disk alert", "rgt r1: disk ok again", "rgt r1: FAILED"]
    assert ev.kinds().count("notify_limited") == 1
    assert n.limits.counts["deduped"] == 1 and n.limits.counts["limited"] == 2
    summary = [e for e in ev.got if e["kind"] == "notify_summary"]
    assert summary and "limited 2" in summary[0]["reason"]


def test_no_sink_url_in_events_or_logs(sink: HttpSink, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    ev = Events()
    secret = "hunter2hunter2"
    urls = (
        f"json://rgt:{secret}@127.0.0.1:{closed_port()}/{secret}",  # down: a failure event
        f"gotify://127.0.0.1:{sink.port}/{secret}",
        f"notaservice://{secret}/x",  # not a URL Apprise knows
    )
    n = Notifier(NotifyConfig(urls=urls, timeout=5.0), "r1", ev)
    n.start()
    n.listen(_state("FAILED", "exit 1"))
    n.finish("FAILED")
    assert len(sink.seen("/message")) == 1
    assert "notify_failed" in ev.kinds() and "notify_bad_url" in ev.kinds()
    assert secret not in repr(ev.got) and secret not in caplog.text
    failed = [e for e in ev.got if e["kind"] == "notify_failed"]
    assert failed[0]["sink"] == "json://127.0.0.1:" + urls[0].split(":")[-1].split("/")[0] + "/…"


def test_a_stuck_sink_costs_one_worker_and_is_skipped_after() -> None:
    slow = HttpSink("hang")
    try:
        ev = Events()
        url = f"json://127.0.0.1:{slow.port}/hook"
        n = Notifier(NotifyConfig(urls=(url,), timeout=0.5), "r1", ev)
        n.start()
        for i in range(3):
            n.listen(_health(f"p{i}", "alert"))
        wait(lambda: n.counts["stuck"] == 3, timeout=20, what="three sends given up")
        assert len(slow.seen("/hook")) == 1  # one stuck worker; the next two were skipped
        assert ev.kinds().count("notify_failed") == 1
        assert "no answer within 0.5s" in ev.got[0]["reason"]
        t0 = time.monotonic()
        n.finish("STOPPED", drain=1.0)
        assert time.monotonic() - t0 < 5, "finish must return within its drain bound"
    finally:
        slow.close()


def test_deadman_pings_start_heartbeat_and_the_end(sink: HttpSink) -> None:
    ev = Events()
    for state, path in [("FAILED", "/hc/fail"), ("STOPPED", "/hc"), ("PREEMPTED", "/hc/fail")]:
        del sink.requests[:]
        cfg = NotifyConfig(deadman=f"{sink.url}/hc", heartbeat=0.2, timeout=5.0)
        n = Notifier(cfg, "r1", ev)
        n.start()
        wait(lambda: len(sink.seen("/hc")) >= 2, timeout=20, what="two heartbeats")
        n.finish(state)
        paths = [r.path for r in sink.seen()]
        assert paths[0] == "/hc/start" and paths[-1] == path, paths
        assert all(r.method == "POST" for r in sink.seen())
        assert sink.seen()[-1].body.decode() == f"rgt r1: {state}"
    assert ev.got == []


def test_apprise_missing_is_one_event_and_no_crash(
    sink: HttpSink, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "apprise", None)  # `import apprise` raises ImportError
    ev = Events()
    cfg = NotifyConfig(urls=(f"json://127.0.0.1:{sink.port}/hook",), deadman=f"{sink.url}/hc")
    n = Notifier(cfg, "r1", ev)
    n.start()
    n.listen(_health("disk", "alert"))
    n.listen(_health("gpu", "alert"))
    n.finish("SUCCEEDED")
    assert ev.kinds() == ["notify_unavailable"]
    # a failure the install must fix (as inotify_unavailable without watchdog), not news
    assert ev.got[0].get("klass") == "usage", ev.got
    assert [r.path for r in sink.seen()] == ["/hc/start", "/hc"]  # the switch still pings
