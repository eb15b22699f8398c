"""controller/children.py with real processes: a child of rgt's is in a session of its own (a
terminal's Ctrl-C to rgt's group does not reach it), and ``stop_all`` kills it with its own
children, makes its waiter's ``wait`` raise KeyboardInterrupt, and lets no other thread start
one (the main thread still may). ``stop_all`` is for good in a process: the check runs in a
Python process of its own, bounded, and every process it reports is killed by its PID."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict

ROOT = str(Path(__file__).resolve().parents[2])

SCRIPT = r"""
import json, os, signal, subprocess, sys, threading, time
from controller import children

p = children.Child(["sh", "-c", "sleep 600 & echo $!; wait"], stdout=subprocess.PIPE)
grand = int(p.stdout.readline())
print(json.dumps({"pids": [p.pid, grand]}), flush=True)
own = os.getsid(p.pid) == p.pid and os.getpgid(grand) == p.pid
# The terminal's Ctrl-C to this process's group: this process ignores it, the child never sees it.
signal.signal(signal.SIGINT, signal.SIG_IGN)
os.killpg(os.getpgid(0), signal.SIGINT)
alive_after_sigint = p.poll() is None
got = {}

def waiter():
    try:
        got["wait"] = p.wait()
    except KeyboardInterrupt:
        got["wait"] = "KeyboardInterrupt"

def starter():
    try:
        children.Child(["true"]).wait()
        got["thread start"] = "started"
    except KeyboardInterrupt:
        got["thread start"] = "KeyboardInterrupt"

# Killed by its thread (an error, a timeout): its own children go with it.
k = children.Child(["sh", "-c", "sleep 600 & echo $!; wait"], stdout=subprocess.PIPE)
k_grand = int(k.stdout.readline())
print(json.dumps({"pids": [k.pid, k_grand]}), flush=True)
k.kill()
got["kill"] = k.wait()

t = threading.Thread(target=waiter)
t.start()
children.stop_all()
t.join(60)
t = threading.Thread(target=starter)
t.start()
t.join(60)
got["main start"] = children.Child(["true"]).wait()
def state(pid):
    for _ in range(200):  # its SIGKILL taking effect: reparented, a zombie until reaped
        try:
            with open(f"/proc/{pid}/stat") as f:
                s = f.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            s = "gone"
        if s in ("Z", "gone"):
            break
        time.sleep(0.05)
    return s
print(json.dumps({
    "own session and group": own,
    "alive after sigint": alive_after_sigint, "rc": p.returncode, "grand": state(grand),
    "k grand": state(k_grand), **got,
}), flush=True)
"""


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def test_a_child_is_out_of_the_terminals_reach_and_stop_all_kills_it_with_its_group(
    tmp_path: Path,
) -> None:
    pids = []
    env = dict(os.environ, PYTHONPATH=ROOT)
    # Its own session: its SIGINT to its group reaches neither pytest nor the rest of the suite.
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, env=env, cwd=str(tmp_path),
        start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=120)
        lines = out.decode().splitlines()
        pids = json.loads(lines[0])["pids"] + json.loads(lines[1])["pids"]
        seen: Dict[str, Any] = json.loads(lines[2])
    finally:
        _kill(proc.pid)
        proc.wait()
        for pid in pids:
            _kill(pid)
    assert proc.returncode == 0
    assert seen["own session and group"] and seen["alive after sigint"], seen
    assert seen["rc"] == -signal.SIGKILL and seen["wait"] == "KeyboardInterrupt", seen
    assert seen["grand"] in ("Z", "gone"), seen  # killed with its parent's group
    assert seen["kill"] == -signal.SIGKILL and seen["k grand"] in ("Z", "gone"), seen
    assert seen["thread start"] == "KeyboardInterrupt" and seen["main start"] == 0, seen
