"""`rgt report` of a real run, rendered in headless Chromium and read back from the screenshot.

What a user relies on: the report of a run is one HTML file that opens with no network, whose
plots show what the run recorded (step rate and loss of a real PyTorch CPU job through the
training API) and whose timeline puts the preemption and the restart where they happened on
the shared time axis; and nothing the box wrote can run in the page (a reason holding
``<script>`` is shown as text).

The run: a real agent with a file store and ``[health] interval = 1``; its job
(tests/fixtures/report_job.py) crashes once at step 20 (a restart), is preempted by SIGTERM to
the agent (PREEMPTED), started again with ``rgt-agent start``, and succeeds. The report is
made by the real ``rgt`` against the run's box as a local target (`rgt-agent report-data` run
there). The screenshot is read with Pillow: the plot frames are found by their colour, each
plot with samples must hold pixels of its line colour, and the markers' x positions are
checked against the x their event times give on the axis the page states.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from typing import Any, Dict, List, Tuple

import pytest

from controller.registry import Registry, RunRecord
from controller.report.data import event_time
from controller.report.plots import FRAME, LINE, MARKERS
from controller.target import Target
from tests.conftest import Cli, agent_exe, fixture, require

RUN = "r1"
Box = Tuple[int, int, int, int]  # left, top, right, bottom (the frame's pixels)


def _rgt() -> List[str]:
    script = os.path.join(os.path.dirname(sys.executable), "rgt")
    return [script] if os.path.exists(script) else [sys.executable, "-m", "controller.cli"]


def _rgb(colour: str) -> Tuple[int, int, int]:
    return (int(colour[1:3], 16), int(colour[3:5], 16), int(colour[5:7], 16))


def _report(tmp_path: Any, env: Dict[str, str], home: str, store: str = "") -> str:
    """`rgt report RUN` against the box ``home`` as a local target; the page's text."""
    Registry().put(
        RunRecord(
            RUN, Target("local"), profile="local", store=store, box_home=home, agent=agent_exe()
        )
    )
    out = str(tmp_path / "report.html")
    p = subprocess.run(
        [*_rgt(), "report", RUN, "--out", out], env=env, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == out
    with open(out, encoding="utf-8") as f:
        return f.read()


def _screenshot(html_path: str, png: str, height: int) -> None:
    """Headless Chromium, bounded: killed by its process group's id if it overstays."""
    exe = shutil.which("chromium")
    proc = subprocess.Popen(
        [
            exe or "chromium",
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--force-device-scale-factor=1",
            f"--screenshot={png}",
            f"--window-size=1040,{height}",
            f"file://{html_path}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert os.path.exists(png), "chromium wrote no screenshot"


def _frames(img: Any) -> List[Box]:
    """The plot frames, top to bottom: pairs of long horizontal runs of the frame colour."""
    px, (w, h) = img.load(), img.size
    frame = _rgb(FRAME)
    edges = []
    for y in range(h):
        xs = [x for x in range(w) if px[x, y] == frame]
        if len(xs) > 600:
            edges.append((y, xs[0], xs[-1]))
    boxes = []
    while len(edges) >= 2:
        (top, left, right), rest = edges[0], edges[1:]
        # The bottom edge: the next long run below a gap (an edge may be one or two rows).
        below = [e for e in rest if e[0] > top + 5]
        if not below:
            break
        bottom = below[0][0]
        boxes.append((left, top, right, bottom))
        edges = [e for e in rest if e[0] > bottom + 1]
    return boxes


def _near(c: Tuple[int, ...], colour: str, tol: int = 30) -> bool:
    return all(abs(a - b) <= tol for a, b in zip(c[:3], _rgb(colour)))


def _columns(img: Any, box: Box, colour: str) -> List[int]:
    """x of the columns inside ``box`` that hold a pixel of ``colour``."""
    px = img.load()
    left, top, right, bottom = box
    return [
        x
        for x in range(left + 2, right - 1)
        if any(px[x, y] == _rgb(colour) for y in range(top + 2, bottom - 1))
    ]


def _count(img: Any, box: Box, colour: str) -> int:
    px = img.load()
    left, top, right, bottom = box
    return sum(
        1
        for x in range(left + 2, right - 1)
        for y in range(top + 2, bottom - 1)
        if _near(px[x, y], colour)
    )


def _svgs(page: str) -> List[Dict[str, str]]:
    return [
        dict(re.findall(r'data-([a-z0-9]+)="([^"]*)"', tag))
        for tag in re.findall(r"<svg [^>]*>", page)
    ]


@pytest.fixture
def chromium_and_pillow() -> Any:
    require(shutil.which("chromium") is not None, "chromium (apt-get install chromium)")
    try:
        from PIL import Image
    except ImportError:
        require(False, "Pillow (pip install -e '.[dev]')")
    return Image


def test_report_shows_the_plots_and_the_preemption_and_restart_at_their_times(
    cli: Cli, tmp_path: Any, controller_env: Dict[str, str], chromium_and_pillow: Any
) -> None:
    store = f"file://{tmp_path / 'store'}"
    os.makedirs(tmp_path / "store")
    job = tmp_path / "job.toml"
    job.write_text(
        f'name = "{RUN}"\ncommand = {json.dumps([*fixture("report_job.py"), "20", "150"])}\n'
        f'store = "{store}"\n[health]\ninterval = 1\n'
    )
    cli("start", str(job), check=True)
    # The crash at step 20 and the restart; then steps of attempt 2 before the preemption.
    st = cli.wait_for(
        RUN,
        lambda s: s["attempt"] == 2 and (s.get("progress") or {}).get("step", 0) >= 40,
        timeout=90,
        what="attempt 2 past step 40",
    )
    os.kill(st["agent"]["pid"], signal.SIGTERM)
    cli.wait_over(RUN, "PREEMPTED", timeout=60)
    cli("start", str(job), check=True)
    cli.wait_state(RUN, "SUCCEEDED", timeout=120)

    # The probes' verdicts in `rgt-agent status`, and in `rgt status` from the box.
    lines = cli("status", RUN, check=True).stdout.splitlines()
    [summary] = [ln for ln in lines if ln.startswith("  health: ")]
    probes = cli.status(RUN)["health"]["probes"]
    assert f"({len(probes)} probes" in summary, summary
    page = _report(tmp_path, {**os.environ, **controller_env}, cli.home, store)
    p = subprocess.run(
        [*_rgt(), "status", RUN],
        env={**os.environ, **controller_env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0 and "  health: " in p.stdout and "probes" in p.stdout, p.stderr
    assert "<script" not in page and "http://" not in page.replace(
        'xmlns="http://www.w3.org/2000/svg"', ""
    )
    svgs = _svgs(page)
    assert [s["plot"] for s in svgs] == [
        "step_rate",
        "loss",
        "gpu_util",
        "gpu_mem",
        "disk",
        "memory",
        "timeline",
    ]
    points = {s["plot"]: int(s["points"]) for s in svgs}
    assert points["step_rate"] > 5 and points["loss"] > 5  # the job reported them every step
    t0, t1 = float(svgs[0]["t0"]), float(svgs[0]["t1"])
    assert all((float(s["t0"]), float(s["t1"])) == (t0, t1) for s in svgs)  # one axis

    html_path = str(tmp_path / "report.html")
    png = str(tmp_path / "report.png")
    _screenshot(html_path, png, 1800)
    img = chromium_and_pillow.open(png).convert("RGB")
    boxes = _frames(img)
    assert len(boxes) == len(svgs), boxes
    for s, box in zip(svgs, boxes[:-1]):
        drawn = _count(img, box, LINE)
        if int(s["points"]):
            assert drawn > 20, f"plot {s['plot']} has samples but no line drawn"
        else:
            assert drawn == 0, f"plot {s['plot']} has no samples but shows a line"

    # The markers: where their events' times fall on the axis, a few px either way.
    left, _, right, _ = timeline = boxes[-1]

    def x_of(t: float) -> float:
        return left + (t - t0) / (t1 - t0) * (right - left)

    events = cli.events(RUN)
    preempt = [event_time(e) for e in events if e["kind"] == "preempt"]
    restart = [event_time(e) for e in events if e["kind"] == "state" and e["state"] == "BACKOFF"]
    assert len(preempt) == 1 and len(restart) == 1
    # The events table puts that one event, and no other, in the restart lane.
    lanes = re.findall(r'<td style="color:[^"]*">([a-z]+)</td><td>([a-z_]+)</td>', page)
    assert [k for lane, k in lanes if lane == "restart"] == ["state"], lanes
    for kind, times in (("preemption", preempt), ("restart", restart)):
        cols = _columns(img, timeline, MARKERS[kind])
        expect = [x_of(t) for t in times if t is not None]
        assert cols, f"no {kind} marker drawn"
        assert all(any(abs(c - x) <= 3 for x in expect) for c in cols), (kind, cols, expect)
        assert all(any(abs(c - x) <= 3 for c in cols) for x in expect), (kind, cols, expect)
    # The preemption comes after the restart, and the page says why each happened.
    assert restart[0] is not None and preempt[0] is not None and restart[0] < preempt[0]
    assert "SIGTERM to the agent: treating it as a preemption" in page
    assert "exited with code 3" in page


HOSTILE = '<script>alert("x")</script><img src=x onerror=alert(1)>'


def test_report_escapes_what_the_box_wrote(
    cli: Cli, tmp_path: Any, controller_env: Dict[str, str]
) -> None:
    """A run's files on the box hold markup (an event reason, a probe's verdict, a sample's
    name, a state): the page shows it as text, and nothing in it can run."""
    run = os.path.join(cli.home, "runs", RUN)
    os.makedirs(os.path.join(run, "health"))
    state = {
        "name": RUN,
        "state": HOSTILE,
        "attempt": 1,
        "health": {"probes": {HOSTILE: {"level": "alert", "code": "x", "reason": HOSTILE}}},
    }
    with open(os.path.join(run, "state.json"), "w") as f:
        json.dump(state, f)
    with open(os.path.join(run, "spec.json"), "w") as f:
        json.dump({"name": RUN}, f)
    with open(os.path.join(run, "events.jsonl"), "w") as f:
        for i in range(3):
            ev = {"time": f"2026-01-01T00:00:0{i}Z", "kind": HOSTILE, "reason": HOSTILE}
            f.write(json.dumps(ev) + "\n")
        f.write("not json\n")
    with open(os.path.join(run, "health", "samples.jsonl"), "w") as f:
        for i in range(3):
            row = {"t": 1767225600 + i, "attempt": 1, "state": HOSTILE, "stall.step": i}
            row[f"disk.{HOSTILE}.bytes_used"] = 0.5
            f.write(json.dumps(row) + "\n")

    page = _report(tmp_path, {**os.environ, **controller_env}, cli.home)
    assert "<script" not in page and "<img" not in page and "onerror=alert(1)>" not in page
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in page  # shown, as text
    assert page.count("&lt;script&gt;") >= 5  # the state, the probe, its reason, the events
