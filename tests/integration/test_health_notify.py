"""Notifications from a real agent (onbox/health/notify.py) to real local sinks: an HTTP server
on 127.0.0.1 (tests/httpsink.py) that Apprise's json://, ntfy://, gotify:// and mmost:// talk
to, an SMTP server (aiosmtpd, tests/mailsink.py) for mailto://, and the dead-man's switch
(healthchecks-style paths) on the same HTTP server. Each sink is checked for the fields its
service documents. Then sinks that hang or are down: the agent's loop and its health ticks go
on at their pace, and `rgt-agent stop` returns without waiting out the send timeout (measured,
printed, bounded generously).
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import sys
import time
from typing import Any, Dict, Iterator, List, Optional

import pytest

from onbox.agent.journal import read_events
from onbox.health.notify import DRAIN
from tests.conftest import Cli, fixture, require
from tests.httpsink import HttpSink, closed_port
from tests.mailsink import MailSink
from tests.polling import wait

require(importlib.util.find_spec("apprise") is not None, "apprise (the notify extra)")


@pytest.fixture
def sink() -> Iterator[HttpSink]:
    s = HttpSink("ok")
    yield s
    s.close()


@pytest.fixture
def mail() -> Iterator[MailSink]:
    require(importlib.util.find_spec("aiosmtpd") is not None, "aiosmtpd (a dev dependency)")
    m = MailSink()
    yield m
    m.close()


def _job(cli: Cli, name: str, command: List[str], notify: Dict[str, Any], extra: str = "") -> str:
    path = os.path.join(cli.home, f"{name}.toml")
    lines = [f"command = {json.dumps(command)}", extra, "[notify]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in notify.items()]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def _quick(seconds: float) -> List[str]:
    return [
        sys.executable,
        "-c",
        f"import time; print('step 1', flush=True); time.sleep({seconds})",
    ]


def test_a_run_notifies_each_service_in_its_documented_payload(
    cli: Cli, sink: HttpSink, mail: MailSink
) -> None:
    hc = "/hc/5f0ab5c4-1b7e-4bb0-8f0e-0cf0ad0d1e1e"
    urls = [
        f"json://127.0.0.1:{sink.port}/path",
        f"ntfy://127.0.0.1:{sink.port}/rgt-topic",
        f"gotify://127.0.0.1:{sink.port}/AppTokenGotify1",
        f"mmost://127.0.0.1:{sink.port}/HookTokenMattermost1",
        f"mailto://127.0.0.1:{mail.port}?smtp=127.0.0.1&mode=insecure"
        "&from=rgt@example.com&to=ops@example.com",
    ]
    notify = {"urls": urls, "deadman": sink.url + hc, "heartbeat": 0.3, "timeout": "5s"}
    cli("start", _job(cli, "n1", _quick(4), notify), "--name", "n1", check=True)
    cli.wait_state("n1", "SUCCEEDED")
    title = "rgt n1: SUCCEEDED"
    wait(
        lambda: (
            [r for r in sink.seen(hc) if r.body == title.encode()]
            and sink.seen("/message")
            and mail.received()
        ),
        30,
        "all sinks, and the switch's last ping",
    )

    # Apprise's JSON: version, title, message, type
    (j,) = [r.json() for r in sink.seen("/path")]
    assert j["version"] == "1.0" and j["title"] == title and j["type"] == "success"
    assert "attempt 1" in j["message"]
    # ntfy's JSON publish (POST to the root URL): topic, title, message
    ntfy = [r for r in sink.seen("/") if r.method == "POST"]
    assert [r.json()["topic"] for r in ntfy] == ["rgt-topic"]
    assert ntfy[0].json()["title"] == title and "attempt 1" in ntfy[0].json()["message"]
    # Gotify: POST /message with the app token, JSON title, message, priority
    (g,) = sink.seen("/message")
    assert g.headers["X-Gotify-Key"] == "AppTokenGotify1"
    assert g.json()["title"] == title and isinstance(g.json()["priority"], int)
    # Mattermost incoming webhook: POST /hooks/TOKEN, JSON text
    (mm,) = sink.seen("/hooks/HookTokenMattermost1")
    assert title in mm.json()["text"] and "attempt 1" in mm.json()["text"]
    # e-mail: Subject is the title, the body the reason
    (m,) = mail.received()
    assert m["Subject"] == title and m["To"] == "ops@example.com"
    body = m.get_body(preferencelist=("plain",))
    assert body is not None and "attempt 1" in body.get_content()
    # the dead-man's switch: /start, heartbeats, success (the base URL) with the state
    pings = [r for r in sink.seen() if r.path.startswith(hc)]
    assert pings[0].path == hc + "/start" and pings[-1].path == hc
    assert pings[-1].body.decode() == title
    beats = [r for r in pings if r.path == hc and r.body == b"rgt n1: alive"]
    assert len(beats) >= 2, "heartbeats while the 4 s job ran (every 0.3 s)"
    # no token in the run's files
    events = json.dumps(cli.events("n1"))
    for token in ("AppTokenGotify1", "HookTokenMattermost1", "5f0ab5c4"):
        assert token not in events


def test_a_failed_run_pings_fail_and_says_why(cli: Cli, sink: HttpSink) -> None:
    notify = {"urls": [f"json://127.0.0.1:{sink.port}/path"], "deadman": sink.url + "/hc"}
    extra = "[restart]\nmax_error_restarts = 0"
    job = _job(cli, "n2", fixture("fail_with.py") + ["code"], notify, extra)
    cli("start", job, "--name", "n2", check=True)
    cli.wait_state("n2", "FAILED")
    wait(lambda: sink.seen("/hc/fail"), 30, "the /fail ping")
    (j,) = [r.json() for r in sink.seen("/path")]
    assert j["title"] == "rgt n2: FAILED" and j["type"] == "failure"
    assert "3" in j["message"]  # the exit code the job ended with
    assert [r.path for r in sink.seen() if r.path.startswith("/hc")] == ["/hc/start", "/hc/fail"]


def _run_and_stop(cli: Cli, name: str, notify: Optional[Dict[str, Any]]) -> Dict[str, float]:
    """A hanging job with health ticks every 0.5 s, 4 s of running, then `stop`: the largest gap
    between ticks, how long the loop took from the stop to STOPPED, how long `stop` took."""
    extra = "[health]\ninterval = 0.5"
    if notify is None:
        path = os.path.join(cli.home, f"{name}.toml")
        with open(path, "w") as f:
            f.write(f"command = {json.dumps(fixture('hang.py'))}\n{extra}\n")
    else:
        path = _job(cli, name, fixture("hang.py"), notify, extra)
    cli("start", path, "--name", name, check=True)
    cli.wait_state(name, "RUNNING", timeout=30)
    time.sleep(4)
    t0 = time.monotonic()
    cli("stop", name, check=True, timeout=120)
    stop_s = time.monotonic() - t0
    run = os.path.join(cli.home, "runs", name)
    rows = []
    with open(os.path.join(run, "health", "samples.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    ts = [r["t"] for r in rows]
    events = read_events(os.path.join(run, "events.jsonl"))

    def at(pred: Any) -> float:
        e = next(e for e in events if pred(e))
        return datetime.datetime.fromisoformat(e["time"].replace("Z", "+00:00")).timestamp()

    loop_s = at(lambda e: e["kind"] == "state" and e["state"] == "STOPPED") - at(
        lambda e: e["kind"] == "stop"
    )
    return {
        "ticks": len(ts),
        "max_gap_s": round(max(b - a for a, b in zip(ts, ts[1:])), 3),
        "stop_to_stopped_s": round(loop_s, 3),
        "stop_cmd_s": round(stop_s, 3),
    }


def test_a_sink_that_hangs_or_is_down_does_not_delay_the_agent(cli: Cli) -> None:
    slow = HttpSink("hang")
    try:
        timeout = 30.0  # a send may hang this long: none of it may show in the loop
        down = f"127.0.0.1:{closed_port()}"
        measured = {
            "no sinks": _run_and_stop(cli, "nbase", None),
            "hanging sinks": _run_and_stop(
                cli,
                "nslow",
                {
                    "urls": [f"json://127.0.0.1:{slow.port}/hook"],
                    "deadman": slow.url + "/hc",
                    "heartbeat": 0.3,
                    "timeout": timeout,
                },
            ),
            "sinks down": _run_and_stop(
                cli,
                "ndown",
                {
                    "urls": [f"json://{down}/hook"],
                    "deadman": f"http://{down}/hc",
                    "heartbeat": 0.3,
                    "timeout": timeout,
                },
            ),
        }
        print("\nnotify sinks vs the agent's loop (health interval 0.5 s):")
        for what, m in measured.items():
            print(f"  {what:14} {m}")
        assert slow.seen("/hc/start"), "the hanging sink was asked (and never answered)"
        down_events = cli.events("ndown")
        assert any(e["kind"] == "notify_failed" for e in down_events)
        assert not any("/hc" in json.dumps(e) for e in down_events), "no URL path in events"
        for what, m in measured.items():
            assert m["ticks"] >= 5, (what, m)
            assert m["max_gap_s"] < 0.5 + 2.0, (what, m)
            assert m["stop_to_stopped_s"] < 5.0, (what, m)
            assert m["stop_cmd_s"] < DRAIN + 10.0 < timeout, (what, m)
    finally:
        slow.close()
