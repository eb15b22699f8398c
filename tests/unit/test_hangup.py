"""controller/hangup.py: which signals end rgt as a Ctrl-C, and when a hang-up is only noted.
Each check runs in a Python process of its own (the handlers are the process's), bounded; its
own signals are sent to itself by its PID."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict

ROOT = str(Path(__file__).resolve().parents[2])

SCRIPT = r"""
import json, os, signal, sys, time
from controller import hangup

def asked(sig):
    try:
        os.kill(os.getpid(), sig)
        time.sleep(1)  # (a handler runs at once: os.kill to itself, in this thread)
        return "noted"
    except KeyboardInterrupt:
        return "raised"

if sys.argv[1] == "nohup":
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
out = {}
with hangup.handled() as got:
    out["hup"] = asked(signal.SIGHUP)
    if sys.argv[1] != "nohup":
        out["hup again"] = asked(signal.SIGHUP)
        out["term"] = asked(signal.SIGTERM)
out["got"] = list(got)
out["code"] = hangup.ended(got, 0)
out["after"] = [int(signal.getsignal(s)) for s in (signal.SIGHUP, signal.SIGTERM)]
print(json.dumps(out))
"""


def _run(mode: str) -> Dict[str, Any]:
    p = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 0, p.stderr
    out: Dict[str, Any] = json.loads(p.stdout)
    return out


def test_a_hangup_is_a_first_ask_only_and_a_sigterm_always_asks() -> None:
    out = _run("terminal")
    assert (out["hup"], out["hup again"], out["term"]) == ("raised", "noted", "raised"), out
    assert out["code"] == 129, out  # the first signal's
    assert out["after"] == [signal.SIG_DFL, signal.SIG_DFL], out  # put back


def test_a_hangup_ignored_at_start_stays_ignored() -> None:
    out = _run("nohup")
    assert out["hup"] == "noted" and out["got"] == [] and out["code"] == 0, out
    assert out["after"][0] == signal.SIG_IGN, out


HELD = r"""
import json, os, signal, time
from controller import hangup

def ask(sig=signal.SIGTERM):
    os.kill(os.getpid(), sig)
    time.sleep(0.1)  # (a handler runs at once: os.kill to itself, in this thread)

out = {}
with hangup.handled() as got:
    try:
        with hangup.held():
            ask()
            out["held"] = "noted"
    except KeyboardInterrupt:
        out["at its end"] = "raised"
    try:
        with hangup.held():
            try:
                with hangup.raised_once():
                    ask(signal.SIGINT)
                    out["once"] = "noted"
            except KeyboardInterrupt:
                out["once"] = "raised"
                ask()  # the unwinding's finally clauses: held
                ask(signal.SIGINT)
                out["unwinding"] = "noted"
                raise
    except KeyboardInterrupt:
        out["left"] = "the first ask only"
    try:
        with hangup.held(), hangup.raised_once():
            with hangup.held():  # (the start of a process, within the walk)
                ask()
                out["inner held"] = "noted"
            out["after it"] = "not reached"
    except KeyboardInterrupt:
        out["inner held"] += ", raised at its end"
    out["got"] = list(got)
print(json.dumps(out))
"""


def test_held_asks_wait_for_its_end_and_raised_once_raises_the_first_only() -> None:
    """What `rgt smoke` relies on (controller/smoke/walk.py): a held ask raises at the end of
    ``held``, not within; within ``raised_once`` the first ask raises and the later ones, sent
    while it unwinds, do not; an ask held within it raises at the end of that ``held``."""
    p = subprocess.run(
        [sys.executable, "-c", HELD], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out.pop("got") == [15, 2, 15, 2, 15], out
    assert out == {
        "held": "noted",
        "at its end": "raised",
        "once": "raised",
        "unwinding": "noted",
        "left": "the first ask only",
        "inner held": "noted, raised at its end",
    }
