"""The stall probe's budget, learned per attempt from the step counter: a real progress.json (or
the job's real output.log) in a temporary run dir, and time from the Context the test builds
(no sleeping). The stack dump on a stalled job is in tests/integration; here, the job's
sitecustomize in real Python processes.

A test whose GPU reading is made up (there is no GPU here) says "fake" in its name.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any, Dict, List, Optional, Tuple

import pytest

from onbox.agent.runner import ensure_job_lib
from onbox.common import jobenv, progress
from onbox.common.rundir import RunDir
from onbox.health.config import StallConfig
from onbox.health.stall import StallProbe, StepTime
from onbox.health.verdict import Context, Reading, Verdict, unavailable, unknown
from onbox.train import phase

Events = List[Tuple[str, str, Dict[str, Any]]]


def _never(tag: Optional[str], current: Optional[str]) -> Optional[str]:
    return None  # no process of this test's made-up attempt exists: the dump finds none


class Rig:
    """A probe over a real run dir; ``at(t)`` is one tick at monotonic time ``t``."""

    def __init__(self, tmp: Any, pattern: Optional[str] = None, **cfg: Any) -> None:
        base: Dict[str, Any] = dict(floor=3.0, factor=5.0, warmup=3, startup=60.0)
        base.update(cfg)
        self.rd = RunDir("t", home=str(tmp))
        os.makedirs(self.rd.attempt_dir(1), exist_ok=True)
        os.makedirs(self.rd.attempt_dir(2), exist_ok=True)
        self.events: Events = []
        self.probe = StallProbe(
            StallConfig(**base),
            self.rd,
            pattern,
            _never,
            lambda kind, reason, **kw: self.events.append((kind, reason, kw)),
            environ={"RGT_PYSPY": "off", "PATH": ""},
        )
        self.attempt, self.started = 1, 0.0
        self.gpu: Optional[Reading] = None

    def step(self, n: int, phase: Optional[str] = None, attempt: Optional[int] = None) -> None:
        progress.write(self.rd.path, n, attempt or self.attempt, phase=phase)

    def at(self, t: float, state: str = "RUNNING", pid: Optional[int] = 4242) -> Reading:
        ctx = Context(
            now=t,
            wall=1_700_000_000.0 + t,
            state=state,
            attempt=self.attempt,
            attempt_started=self.started,
            job_pid=pid,
            tag=f"t:{self.attempt}:x",
            sealing=None,
        )
        if self.gpu is not None:
            ctx.readings["gpu"] = self.gpu
        return self.probe.check(ctx)

    def steps(self, first: int, last: int, every: float, t0: float) -> float:
        """Steps first..last, one every ``every`` seconds from ``t0``; returns the last time."""
        t = t0
        for n in range(first, last + 1):
            self.step(n)
            r = self.at(t)
            assert r.verdict.level == "ok", r.verdict
            t += every
        return t - every


def _restarts(r: Reading) -> List[str]:
    return [a.reason for a in r.actions if a.kind == "restart"]


def test_no_step_at_all_is_a_stall_only_after_the_startup_budget(tmp_path: Any) -> None:
    rig = Rig(tmp_path, startup=60.0)
    rig.at(0.0)  # the probe sees the attempt at its start
    assert rig.at(59.0).verdict.level == "ok"
    r = rig.at(61.0)
    assert (r.verdict.level, r.verdict.code) == ("alert", "stalled")
    assert "no step yet" in r.verdict.reason and "until the first step" in r.verdict.reason
    assert _restarts(r) and r.actions[0].klass == "transient"


def test_budget_is_factor_times_the_longest_interval_after_the_warm_up(tmp_path: Any) -> None:
    rig = Rig(tmp_path, floor=3.0, factor=5.0, warmup=3)
    t = rig.steps(0, 3, every=1.0, t0=0.0)  # first step, then the 3 warm-up changes
    t = rig.steps(4, 8, every=2.0, t0=t + 2.0)  # learned: 2 s, so 10 s
    r = rig.at(t + 9.5)
    assert r.verdict.level == "ok" and r.sample["budget"] == pytest.approx(10.0)
    assert r.sample["step"] == 8 and r.sample["since_step"] == pytest.approx(9.5)
    r = rig.at(t + 10.5)
    assert r.verdict.code == "stalled" and _restarts(r)
    assert "5 x longest interval 2.0 s" in r.verdict.reason
    assert "last step 8" in r.verdict.reason and "no step for 10.5 s" in r.verdict.reason


def test_the_floor_holds_for_fast_steps(tmp_path: Any) -> None:
    rig = Rig(tmp_path, floor=3.0, warmup=2)
    t = rig.steps(0, 20, every=0.1, t0=0.0)
    assert rig.at(t + 2.9).verdict.level == "ok"
    r = rig.at(t + 3.1)
    assert r.verdict.code == "stalled" and "the floor" in r.verdict.reason
    assert r.sample["steps_per_s"] == pytest.approx(10.0)


def test_warm_up_intervals_teach_nothing(tmp_path: Any) -> None:
    """Slow first steps (compilation) are under the startup budget; what is learned after them
    is the steady interval, so a later hang is caught at the floor, not at 5 x 30 s."""
    rig = Rig(tmp_path, floor=3.0, warmup=3, startup=60.0)
    t = rig.steps(0, 2, every=30.0, t0=0.0)
    assert rig.at(t + 50.0).verdict.level == "ok"  # still the warm-up: the startup budget
    t = rig.steps(3, 10, every=0.5, t0=t + 55.0)  # the last warm-up change, then steady
    r = rig.at(t + 4.0)
    assert r.verdict.code == "stalled", r.verdict  # 4 s > floor 3 s (not 150 s)


def test_a_steady_job_slower_than_the_floor_is_not_stalled_when_the_warm_up_ends(
    tmp_path: Any,
) -> None:
    """One step every 10 s from the start (over the 3 s floor, far under the 60 s startup):
    alive and never slower than before. Right after the warm-up nothing was learned yet, so the
    floor alone is no budget for it: a real agent restarted such a job at every attempt."""
    rig = Rig(tmp_path, floor=3.0, factor=5.0, warmup=3, startup=60.0)
    for t in range(91):  # a tick a second, as the watcher does
        if t % 10 == 0:
            rig.step(t // 10)
        r = rig.at(float(t))
        assert r.verdict.level == "ok", (t, r.verdict)
    assert r.sample["budget"] == pytest.approx(50.0)  # then learned: 5 x 10 s
    # A hang after it is caught at the learned budget.
    assert rig.at(90.0 + 51).verdict.code == "stalled"


def _learned(intervals: List[float], run: int = 3, factor: float = 5.0) -> float:
    st = StepTime(run, factor)
    for x in intervals:
        st.add(x)
    return st.longest


@pytest.mark.parametrize(
    "intervals,longest",
    [
        ([2.0, 2.0, 2.0], 2.0),  # steady from the warm-up on
        ([60.0, 45.0], 60.0),  # no speed found yet: the longest of all stands
        ([60.0, 45.0, 1.0, 1.0], 60.0),
        ([60.0, 45.0, 1.0, 1.0, 1.0], 1.0),  # three alike: the slow lead was a one-off
        ([60.0, 2.0, 50.0, 1.0, 1.5, 1.0], 1.5),  # a quick step amid compiles is no speed
        ([30.0, 30.0, 30.0, 100.0, 0.5, 0.5, 0.5], 0.5),  # a slow first epoch, then fast
        ([30.0, 30.0, 30.0, 8.0, 8.0, 8.0], 30.0),  # not 5 x faster: nothing forgotten
        ([1.0, 1.0, 1.0, 60.0, 1.0, 1.0, 1.0], 60.0),  # at speed, then an eval: kept
        ([30.0, 30.0, 30.0, 200.0, 0.5, 0.5, 0.5], 200.0),  # slow at speed: kept, then too
        ([30.0] * 3 + [0.5] * 3 + [60.0] + [0.1] * 3, 60.0),  # the eval after the speed-up
        ([1.0, 20.0] * 10, 20.0),  # never alike three in a row: the longest of all
    ],
)
def test_the_learned_interval_forgets_only_what_came_before_a_faster_steady_speed(
    intervals: List[float], longest: float
) -> None:
    assert _learned(intervals) == longest


def test_with_a_run_of_one_the_first_interval_is_the_speed() -> None:
    """``warmup = 1`` (or 0): one interval is a run; a slower step after it is kept."""
    assert _learned([60.0, 1.0, 1.0], run=1) == 1.0
    assert _learned([1.0, 60.0, 1.0], run=0) == 60.0


def test_slow_steps_past_the_warm_up_set_no_budget_once_the_job_is_fast(tmp_path: Any) -> None:
    """Slowness spread over more steps than the warm-up counts: six 30 s steps (three in the
    warm-up), then a step every 0.5 s, then a hang. The slow ones are never a stall, and the
    hang is caught at the floor, not at 5 x 30 s."""
    rig = Rig(tmp_path, floor=3.0, factor=5.0, warmup=3, startup=60.0)
    t = rig.steps(0, 6, every=30.0, t0=0.0)
    r = rig.at(t + 29.0)
    assert r.verdict.level == "ok" and r.sample["budget"] == pytest.approx(150.0)
    t = rig.steps(7, 8, every=0.5, t0=t + 30.0)  # fast, not yet three in a row
    assert rig.at(t + 100.0).sample["budget"] == pytest.approx(150.0)
    t = rig.steps(9, 12, every=0.5, t0=t + 0.5)
    assert rig.at(t).sample["budget"] == pytest.approx(3.0)  # the floor, over 5 x 0.5 s
    r = rig.at(t + 4.0)
    assert r.verdict.code == "stalled" and "the floor" in r.verdict.reason, r.verdict
    assert r.sample["step"] == 12


def test_a_periodic_slow_step_after_the_speed_up_is_never_a_stall(tmp_path: Any) -> None:
    """Slow first steps past the warm-up, then fast, then a save every 20 steps that the job
    does not report as a phase (40 s, GPU idle). The first save comes under the fast steps'
    budget (the floor here is 60 s) and is learned: every later one is under the budget,
    however many fast steps come between."""
    rig = Rig(tmp_path, floor=60.0, factor=5.0, warmup=3, startup=120.0)
    t = rig.steps(0, 6, every=30.0, t0=0.0)
    n = 7
    for save in range(4):
        t = rig.steps(n, n + 19, every=0.5, t0=t + 0.5)
        if save == 0:
            assert rig.at(t).sample["budget"] == pytest.approx(60.0)  # the floor: fast
        for k in range(1, 40):  # the save: no step for 40 s
            assert rig.at(t + k).verdict.level == "ok", (save, k)
        n, t = n + 20, t + 39.5
    assert rig.at(t + 0.5).sample["budget"] == pytest.approx(200.0)  # 5 x the 40 s save


def test_an_earlier_attempts_report_is_no_step(tmp_path: Any) -> None:
    rig = Rig(tmp_path, startup=60.0)
    rig.attempt, rig.started = 2, 100.0
    rig.step(500, attempt=1)  # what attempt 1 left behind
    r = rig.at(101.0)
    assert r.sample["step"] is None and "until the first step" in r.verdict.reason
    rig.step(500)  # attempt 2 resumed at 500
    assert rig.at(102.0).sample["step"] == 500


def test_checkpoint_phase_has_its_own_budget_and_teaches_nothing(tmp_path: Any) -> None:
    rig = Rig(tmp_path, floor=3.0, warmup=1, checkpoint=100.0)
    t = rig.steps(0, 5, every=0.5, t0=0.0)
    rig.step(5, phase="checkpoint")
    r = rig.at(t + 50.0)
    assert r.verdict.level == "ok" and "while in checkpoint" in r.verdict.reason
    assert r.sample["budget"] >= 100.0
    rig.step(6)  # the save ended; the 50 s interval around it is not learned
    t = rig.steps(6, 8, every=0.5, t0=t + 50.5)
    assert rig.at(t + 4.0).verdict.code == "stalled"


def test_the_log_pattern_counts_steps_and_other_output_is_not_liveness(tmp_path: Any) -> None:
    rig = Rig(tmp_path, pattern=r"step (\d+)", floor=3.0, warmup=1)
    log = rig.rd.output_log(1)
    with open(log, "a") as f:
        for n in range(5):
            f.write(f"step {n} loss 0.5\n")
            f.flush()
            assert rig.at(float(n)).verdict.level == "ok"
        for k in range(14):  # a telemetry thread keeps printing; no step (budget 5 x 1 s)
            f.write(f"heartbeat {k}: gpu 0%\n")
            f.flush()
            r = rig.at(4.0 + 0.5 * (k + 1))
    assert r.sample["step"] == 4 and r.verdict.code == "stalled"


def test_a_stall_fires_once_per_attempt_and_a_new_attempt_learns_afresh(tmp_path: Any) -> None:
    rig = Rig(tmp_path, floor=3.0, warmup=1, startup=60.0)
    t = rig.steps(0, 4, every=0.5, t0=0.0)
    first = rig.at(t + 5.0)
    assert _restarts(first)
    again = rig.at(t + 6.0)
    assert again.verdict.code == "stalled" and not again.actions
    assert [e[0] for e in rig.events] == ["stall"]
    kind, reason, kw = rig.events[0]
    assert kw["stacks"] == rig.rd.stacks(1) and os.path.exists(kw["stacks"])
    assert "stacks of 0 of 0" in reason  # this test's attempt has no processes
    assert rig.at(t + 7.0, state="BACKOFF", pid=None).verdict.level == "ok"
    rig.attempt, rig.started = 2, t + 8.0
    rig.step(2)
    r = rig.at(t + 9.0)
    assert r.verdict.level == "ok" and "warm-up" in r.verdict.reason


def test_alert_only_asks_for_nothing_and_off_is_unavailable(tmp_path: Any) -> None:
    rig = Rig(tmp_path, action="alert", startup=5.0)
    rig.at(0.0)
    r = rig.at(6.0)
    assert r.verdict.code == "stalled" and r.actions == []
    off = Rig(tmp_path / "off", action="off")
    assert off.at(0.0).verdict.level == "unavailable"


def test_not_running_is_never_a_stall(tmp_path: Any) -> None:
    rig = Rig(tmp_path, startup=5.0)
    for t in (0.0, 100.0, 1000.0):
        r = rig.at(t, state="BACKOFF", pid=None)
        assert r.verdict.level == "ok" and not r.actions


def _gpu(level: str, idle: Optional[bool]) -> Reading:
    v = Verdict("gpu", level, level, "made up") if level in ("ok", "warn") else None
    if level == "unknown":
        v = unknown("gpu", "nvidia-smi timed out")
    if level == "unavailable":
        v = unavailable("gpu", "no GPU")
    assert v is not None
    return Reading(v, {"idle": idle})


@pytest.mark.parametrize(
    "level,idle,stall",
    [
        ("ok", True, True),  # idle GPU and no step: a stall
        ("ok", False, False),  # a busy GPU: a long step, not a stall
        ("unknown", None, False),  # unreadable counts as busy
        ("unavailable", None, True),  # no GPU: the step counter alone
        ("ok", None, False),  # a GPU whose utilisation is unreadable: busy
    ],
)
def test_fake_gpu_reading_decides_with_the_counter(
    tmp_path: Any, level: str, idle: Optional[bool], stall: bool
) -> None:
    rig = Rig(tmp_path, floor=3.0, warmup=1)
    t = rig.steps(0, 4, every=0.5, t0=0.0)
    rig.gpu = _gpu(level, idle)
    r = rig.at(t + 5.0)
    if stall:
        assert r.verdict.code == "stalled" and _restarts(r)
    else:
        assert (r.verdict.level, r.verdict.code) == ("warn", "slow_gpu_busy")
        assert not r.actions and "not a stall" in r.verdict.reason


# ---- the job's sitecustomize (real Python processes, each bounded by a timeout)
def _python(lib: str, extra_path: str, stacks: str, code: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=f"{lib}{os.pathsep}{extra_path}", RGT_STACKS_FILE=stacks)
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30
    )


def test_the_stack_hook_answers_its_signal_and_chains_to_the_next_sitecustomize(
    tmp_path: Any,
) -> None:
    lib = ensure_job_lib(str(tmp_path / "home"))
    user = tmp_path / "user"
    user.mkdir()
    (user / "sitecustomize.py").write_text("print('the user sitecustomize ran')\n")
    stacks = str(tmp_path / "stacks.txt")
    code = (
        "import os, time\n"
        "def stuck_here():\n"
        f"    os.kill(os.getpid(), {jobenv.STACKS_SIGNAL}); time.sleep(0.3)\n"
        "stuck_here(); print('alive')\n"
    )
    p = _python(lib, str(user), stacks, code)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == ["the user sitecustomize ran", "alive"]
    with open(stacks) as f:
        text = f.read()
    assert "stuck_here" in text and "most recent call first" in text


def test_the_job_starts_even_when_the_stack_hook_cannot_open_its_file(tmp_path: Any) -> None:
    lib = ensure_job_lib(str(tmp_path / "home"))
    p = _python(lib, "", "/nonexistent/dir/stacks.txt", "print('started')")
    assert (p.returncode, p.stdout, p.stderr) == (0, "started\n", "")


def test_the_training_apis_phase_block_reports_the_phase_and_clears_it(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``with onbox.train.phase("eval")``: progress.json says the phase at once (keeping the step
    and metrics the job last reported), and no longer once the block ends, even by an error."""
    run_dir = str(tmp_path)
    monkeypatch.setenv(jobenv.RUN_DIR, run_dir)
    monkeypatch.setenv(jobenv.ATTEMPT, "2")
    progress.write(run_dir, 7, 2, {"loss": 0.5})
    with pytest.raises(RuntimeError), phase("eval"):
        doc = progress.read(run_dir)
        assert doc is not None
        assert (doc["step"], doc.get("phase"), doc["metrics"]) == (7, "eval", {"loss": 0.5})
        raise RuntimeError("the evaluation failed")
    doc = progress.read(run_dir)
    assert doc is not None and doc["step"] == 7 and "phase" not in doc
    with pytest.raises(ValueError), phase("lunch"):
        pass
    monkeypatch.delenv(jobenv.RUN_DIR)
    os.unlink(progress.path_in(run_dir))
    with phase("checkpoint"):  # outside the agent: nothing written, nothing raised
        pass
    assert progress.read(run_dir) is None


def _ticks(rig: Rig, reports: List[Tuple[float, int]], until: float, every: float = 10.0) -> float:
    """The watcher's ticks, one every ``every`` seconds (the default interval) from 0 to
    ``until``; before each, the job writes every step it reported since the last (several a
    tick for a fast job: the probe sees the last). Each tick must be ok. Returns the time of the
    tick that saw the last step."""
    todo, seen, t = list(reports), 0.0, 0.0
    while t <= until:
        changed = False
        while todo and todo[0][0] <= t:
            rig.step(todo.pop(0)[1])
            changed = True
        r = rig.at(t)
        assert r.verdict.level == "ok", (t, r.verdict)
        seen = t if changed else seen
        t += every
    return seen


def _first_stall(rig: Rig, t0: float, every: float = 10.0) -> Reading:
    """Ticks on from ``t0`` (the job reports nothing more) until the stall; bounded."""
    for k in range(1, 1000):
        r = rig.at(t0 + k * every)
        if r.verdict.code == "stalled":
            return r
    raise AssertionError("the hang was never judged a stall")


def test_a_fast_job_logging_many_steps_a_tick_warms_up_and_a_later_hang_is_caught_at_the_floor(
    tmp_path: Any,
) -> None:
    """The defaults (floor 120 s, factor 5, warm-up 5, startup 900 s, a tick every 10 s) and a
    job reporting a step every 2 s: five steps land in each tick, which counts one change. The
    warm-up lasts five ticks with steps, nothing is judged a stall, and what is learned is the
    interval the probe can see (a tick), so a hang is caught once the floor has passed."""
    rig = Rig(tmp_path, floor=120.0, factor=5.0, warmup=5, startup=900.0)
    reports = [(1.0 + 2.0 * n, n) for n in range(150)]  # steps 0..149, up to t=299
    last = _ticks(rig, reports, until=300.0)
    assert last == 300.0
    r = rig.at(last + 120.0)
    assert r.verdict.level == "ok" and r.sample["budget"] == pytest.approx(120.0)
    r = _first_stall(rig, last + 120.0)
    assert r.sample["step"] == 149 and "the floor" in r.verdict.reason, r.verdict
    assert r.sample["since_step"] == pytest.approx(130.0)


def test_slow_first_steps_compiling_are_no_stall_and_teach_nothing(tmp_path: Any) -> None:
    """A job that reports its first step at once (a resume's step 0), then compiles: ~700 s to
    step 1, ~700 s more to step 2 (a recompile), a quick step 3, ~650 s to step 4 (the eval
    graph), then a step every 2 s (several a tick). Each slow step is under the startup budget
    and within the warm-up: no false stall. A hang after the warm-up is caught at the floor,
    not at 5 x the compile's 700 s."""
    rig = Rig(tmp_path, floor=120.0, factor=5.0, warmup=5, startup=900.0)
    reports = [(3.0, 0), (703.0, 1), (1405.0, 2), (1452.0, 3), (2108.0, 4)]
    reports += [(2110.0 + 2.0 * n, 5 + n) for n in range(100)]  # up to t=2308, step 104
    last = _ticks(rig, reports, until=2310.0)
    assert last == 2310.0
    r = _first_stall(rig, last)
    assert r.sample["step"] == 104 and "the floor" in r.verdict.reason, r.verdict
    assert r.sample["since_step"] == pytest.approx(130.0) and _restarts(r)
