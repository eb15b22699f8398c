"""The agent's checkpoint asks (onbox/agent/sealservice.py): once a stop or a preemption has
begun, the checkpoint timer asks the job nothing more, so the preemption's ask is the last the
job reads and the one the interval's history pairs with the final seal.

The timer runs in the sealing thread and the stop's hook in the supervisor's: here the timer is
driven from a thread of its own, every millisecond, while the preemption begins."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Dict, List

from onbox.agent.sealservice import SealService
from tests.sealsvc import seal_service


def _service(tmp_path: Path) -> SealService:
    return seal_service(tmp_path, ckpt_interval=0.0)  # due at every tick


def _asks(svc: SealService) -> List[str]:
    with open(svc.rd.events) as f:
        events: List[Dict[str, Any]] = [json.loads(line) for line in f if line.strip()]
    return [e["why"] for e in events if e["kind"] == "checkpoint_asked"]


def test_no_timer_ask_follows_a_preemptions_ask(tmp_path: Path) -> None:
    svc = _service(tmp_path)
    stop = threading.Event()

    def timer() -> None:
        while not stop.is_set():
            svc._ask_on_timer()
            time.sleep(0.001)

    t = threading.Thread(target=timer, daemon=True)
    t.start()
    time.sleep(0.2)  # the timer has asked, many times
    svc.on_stop_requested("preempt", time.monotonic() + 30)
    time.sleep(0.2)  # and goes on ticking
    stop.set()
    t.join(10)
    asks = _asks(svc)
    assert asks[-1] == "preemption" and asks.count("preemption") == 1, asks[-5:]
    assert asks.count("timer") > 1
    with open(svc.rd.checkpoint_request) as f:
        assert json.load(f)["why"] == "preemption"  # what the job reads


def test_a_plain_stop_ends_the_timer_asks_too(tmp_path: Path) -> None:
    svc = _service(tmp_path)
    svc._ask_on_timer()
    svc.on_stop_requested("stop", time.monotonic() + 30)
    svc._ask_on_timer()
    assert _asks(svc) == ["timer"]
