"""A throughput drop, seen by a real agent: a job that starts slow (a compile, a first epoch
filling a cache), runs at its speed, then slows to a tenth of it (a throttle) and recovers.

What a user relies on: the slow start is not reported, and it does not hide the later drop: a
``throughput_drop`` warning judged against the speed, not the slow start; the run goes on.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Dict, List

from tests.conftest import Cli, fixture

PHASES = fixture("throughput_phases.py")
SLOW, FAST = 2.0, 20.0  # steps/s


def _drops(events: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    return [e for e in events if e["kind"] == "health" and e.get("code") == "throughput_drop"]


def test_a_drop_after_a_slow_start_is_reported_against_the_speed(cli: Cli) -> None:
    # At 1 s a tick: 10 ticks slow (more than the 8 at speed), then the throttle at the slow
    # start's own rate, which the attempt's median of all rates took for normal.
    phases = [f"10:{SLOW:g}", f"8:{FAST:g}", f"6:{SLOW:g}", f"3:{FAST:g}"]
    path = os.path.join(cli.home, "tput.toml")
    with open(path, "w") as f:
        f.write(f"command = {json.dumps(PHASES + phases)}\n[health]\ninterval = 1\n")
    cli("start", path, "--name", "tput", check=True)
    st = cli.wait_over("tput", "SUCCEEDED", "FAILED", timeout=120)
    events = cli.events("tput")
    print(json.dumps(events))  # shown when the test fails
    assert st["state"] == "SUCCEEDED", st

    warns = [e for e in _drops(events) if e["level"] == "warn"]
    assert warns, "the drop was not reported"
    m = re.fullmatch(
        r"training: (\S+) steps/s, under 0.5x the attempt's median (\S+) steps/s",
        warns[0]["reason"],
    )
    assert m, warns[0]["reason"]
    # judged against the speed, never the slow start (a drop there would name its median)
    assert float(m.group(2)) > FAST / 2 and float(m.group(1)) < FAST / 4, warns[0]["reason"]
    assert all(float(re.findall(r"median (\S+)", w["reason"])[0]) > FAST / 2 for w in warns)
