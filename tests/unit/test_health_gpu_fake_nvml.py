"""The GPU probe with its real worker subprocess and a FAKE NVML at the seam (tests/fakes/
pynvml.py, driven by a JSON file): this machine has no GPU, so the fake stands in for the driver
and everything else is real (the worker process, its timeout and kill, the stale and foreign
GPU memory holders, which are real sleeping processes).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

import psutil
import pytest

from onbox.agent.healthuse import tag_owner
from onbox.common import jobenv
from onbox.health.config import GpuConfig
from onbox.health.gpu import PATH_VAR, GpuProbe
from onbox.health.verdict import Context, Reading
from tests.conftest import ROOT
from tests.polling import wait

FAKES = os.path.join(ROOT, "tests", "fakes")
CURRENT = "run:2:cur"


class FakeNvml:
    """The fake driver's state file: ``set`` rewrites it whole (atomically)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def set(self, **doc: Any) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, self.path)


def device(**kw: Any) -> Dict[str, Any]:
    d = {
        "name": "Fake H100",
        "util": 97,
        "mem_used": 1000,
        "mem_total": 81559,
        "temp": 60,
        "power": 310.5,
        "sm_clock": 1980,
        "sm_clock_max": 1980,
        "throttle": 0,
        "ecc": 0,
        "processes": [],
    }
    d.update(kw)
    return d


@pytest.fixture
def nvml(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    fake = FakeNvml(str(tmp_path / "nvml.json"))
    fake.set(devices=[device()])
    monkeypatch.setenv("RGT_FAKE_NVML", fake.path)
    monkeypatch.setenv(PATH_VAR, FAKES)
    return fake


Events = List[Tuple[str, str, Dict[str, Any]]]


@pytest.fixture
def events() -> Events:
    return []


@pytest.fixture
def make_probe(events: Events) -> Iterator[Any]:
    made: List[GpuProbe] = []

    def make(**cfg: Any) -> GpuProbe:
        def event(kind: str, reason: str, **kw: Any) -> None:
            events.append((kind, reason, kw))

        p = GpuProbe(GpuConfig(**{"timeout": 5.0, **cfg}), tag_owner("run"), event)
        made.append(p)
        return p

    yield make
    for p in made:
        pid = p.worker_pid
        p.close()
        if pid is not None:
            assert not psutil.pid_exists(pid), "close() left the GPU worker running"


@pytest.fixture
def sleepers() -> Iterator[Any]:
    """Real processes that sleep (bounded: 120 s), each with the environment tag asked for;
    killed by PID at the end."""
    started: List[subprocess.Popen[bytes]] = []

    def start(tag: Optional[str]) -> subprocess.Popen[bytes]:
        env = {k: v for k, v in os.environ.items() if k != jobenv.ATTEMPT_TAG}
        if tag is not None:
            env[jobenv.ATTEMPT_TAG] = tag
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env=env)
        started.append(p)
        return p

    yield start
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait()


def ctx(attempt: int = 2) -> Context:
    return Context(
        now=time.monotonic(),
        wall=time.time(),
        state="RUNNING",
        attempt=attempt,
        attempt_started=time.monotonic(),
        job_pid=None,
        tag=CURRENT,
        sealing=None,
    )


def check_until(probe: GpuProbe, level: str, timeout: float = 20) -> Reading:
    got: List[Reading] = []

    def reached() -> bool:
        got.append(probe.check(ctx()))
        return got[-1].verdict.level == level

    try:
        wait(reached, timeout, f"the gpu verdict {level}")
    except AssertionError:
        raise AssertionError(f"never {level}; last: {got[-1].verdict if got else None}") from None
    return got[-1]


def test_fake_nvml_readings_are_decoded_into_samples_and_an_ok_verdict(
    nvml: FakeNvml, make_probe: Any
) -> None:
    nvml.set(devices=[device(), device(util=3, mem_used=20000, temp=41, power=80.0)])
    r = make_probe().check(ctx())
    v = r.verdict
    assert (v.level, v.code) == ("ok", "ok"), v
    assert "util 97%" in v.reason and "1000/81559 MiB" in v.reason, v.reason
    assert r.sample["util"] == 97 and r.sample["mem_used"] == 1000
    assert r.sample["mem_total"] == 81559 and r.sample["temp"] == 60
    assert r.sample["power"] == 310.5
    assert r.sample["gpu1.util"] == 3 and r.sample["gpu1.mem_used"] == 20000
    assert r.sample["idle"] is False  # GPU 0 is busy


def test_fake_nvml_idle_only_when_every_gpu_is_idle_and_unknown_util_is_not_idle(
    nvml: FakeNvml, make_probe: Any
) -> None:
    nvml.set(devices=[device(util=2), device(util=0)])
    probe = make_probe()
    assert probe.check(ctx()).sample["idle"] is True
    nvml.set(devices=[device(util=2), device(util=None)])  # not supported: unknown, not idle
    assert probe.check(ctx()).sample["idle"] is None


def test_fake_nvml_xid_79_is_an_alert_with_the_re_rent_remedy(
    nvml: FakeNvml, make_probe: Any
) -> None:
    probe = make_probe()
    assert probe.check(ctx()).verdict.level == "ok"
    nvml.set(devices=[device()], xids=[{"device": 0, "xid": 79}])
    v = check_until(probe, "alert").verdict
    assert v.code == "xid" and "Xid 79 on GPU 0" in v.reason and "fell off the bus" in v.reason
    assert "re-rent" in v.remedy and v.klass == "permanent"
    # The Xid was reported once by the worker; the verdict keeps it for the attempt ...
    assert probe.check(ctx()).verdict.code == "xid"
    # ... and a new attempt starts clean.
    assert probe.check(ctx(attempt=3)).verdict.level == "ok"


def test_fake_nvml_uncorrected_ecc_and_a_reset_recovery_action_are_alerts(
    nvml: FakeNvml, make_probe: Any
) -> None:
    nvml.set(devices=[device(ecc=2)])
    probe = make_probe()
    v = probe.check(ctx()).verdict
    assert (v.level, v.code) == ("alert", "ecc_uncorrected") and "2 uncorrected" in v.reason
    nvml.set(devices=[device(recovery_action=1)])
    v = probe.check(ctx()).verdict
    assert (v.level, v.code) == ("alert", "recovery_action") and "GPU reset" in v.reason


def test_fake_nvml_hot_and_thermally_throttled_is_a_warning_hot_alone_is_not(
    nvml: FakeNvml, make_probe: Any
) -> None:
    nvml.set(devices=[device(temp=90, throttle=0)])
    probe = make_probe(temp_warn=85.0)
    assert probe.check(ctx()).verdict.level == "ok"
    nvml.set(devices=[device(temp=90, throttle=0x20 | 0x1, sm_clock=1200)])
    v = probe.check(ctx()).verdict
    assert (v.level, v.code) == ("warn", "hot_throttled"), v
    assert "sw_thermal_slowdown" in v.reason and "1200/1980 MHz" in v.reason


def test_fake_nvml_a_hung_worker_is_unknown_within_the_timeout_and_killed(
    nvml: FakeNvml, make_probe: Any
) -> None:
    nvml.set(devices=[device()], hang=True)
    probe = make_probe(timeout=2.0)
    pid = probe.worker_pid
    assert pid is not None
    t0 = time.monotonic()
    r = probe.check(ctx())
    assert time.monotonic() - t0 < 10, "check() must give up after the timeout"
    assert (r.verdict.level, r.verdict.code) == ("unknown", "gpu_timeout"), r.verdict
    assert r.sample["idle"] is None  # busy, never idle
    assert r.verdict.data["killed_pid"] == pid
    assert not psutil.pid_exists(pid)
    # The driver recovers: the next tick starts a new worker, which answers.
    nvml.set(devices=[device()])
    assert probe.check(ctx()).verdict.level == "ok"
    assert probe.worker_pid not in (None, pid)


def test_fake_nvml_a_stale_holder_of_an_earlier_attempt_is_killed_a_foreign_one_reported(
    nvml: FakeNvml, make_probe: Any, sleepers: Any, events: Events
) -> None:
    stale = sleepers("run:1:abc")
    foreign = sleepers(None)
    current = sleepers(CURRENT)
    other_run = sleepers("otherrun:1:xyz")
    procs = [
        {"pid": stale.pid, "used": 4000},
        {"pid": foreign.pid, "used": 700},
        {"pid": current.pid, "used": 9000},
        {"pid": other_run.pid, "used": 300},
    ]
    nvml.set(devices=[device(mem_used=14000, processes=procs)])
    v = make_probe().check(ctx()).verdict
    assert stale.wait(timeout=10) == -9  # killed, by SIGKILL
    reaped = [e for e in events if e[0] == "gpu_reaped"]
    assert len(reaped) == 1 and reaped[0][2]["pid"] == stale.pid, events
    assert "run:1:abc" in reaped[0][1] and "4000 MiB" in reaped[0][1]
    assert (v.level, v.code) == ("warn", "foreign_gpu_memory"), v
    assert f"GPU memory held by pid {foreign.pid} (not this run): 700 MiB" in v.reason
    assert f"pid {other_run.pid} (not this run)" in v.reason
    assert str(current.pid) not in v.reason
    for p in (foreign, current, other_run):
        assert p.poll() is None, "only the earlier attempt's process may be killed"


def test_fake_nvml_a_pid_not_on_this_box_is_an_unknown_holder_never_killed(
    nvml: FakeNvml, make_probe: Any
) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # its pid names no process now: as a host PID seen from a container
    nvml.set(devices=[device(processes=[{"pid": gone.pid, "used": 512}])])
    v = make_probe().check(ctx()).verdict
    assert v.level == "ok", v
    assert f"unknown holder pid {gone.pid} (host PID?): 512 MiB" in v.reason


def test_fake_nvml_may_start_waits_for_memory_to_be_released_bounded(
    nvml: FakeNvml, make_probe: Any, events: Events
) -> None:
    probe = make_probe(release_wait=3.0)
    probe.check(ctx())  # the baseline: 1000 MiB used before the run
    nvml.set(devices=[device(mem_used=9000)])  # the last attempt's memory, not released yet
    assert probe.may_start() is False  # no reading since the ask yet
    probe.check(ctx())
    assert probe.may_start() is False
    nvml.set(devices=[device(mem_used=1200)])  # released (within the slack)
    probe.check(ctx())
    assert probe.may_start() is True
    assert not [e for e in events if e[0] == "gpu_gate"]
    # Bounded: memory that is never released lets the restart go after release_wait.
    nvml.set(devices=[device(mem_used=9000)])
    assert probe.may_start() is False
    probe.check(ctx())
    wait(probe.may_start, 15, "the gate to open after release_wait")
    gate = [e for e in events if e[0] == "gpu_gate"]
    assert len(gate) == 1 and "9000 MiB" in gate[0][1] and "1000 MiB before" in gate[0][1]


def test_fake_nvml_may_start_holds_while_an_earlier_attempt_holds_memory(
    nvml: FakeNvml, make_probe: Any, sleepers: Any
) -> None:
    stale = sleepers("run:1:abc")
    probe = make_probe(release_wait=60.0)
    probe.check(ctx())
    nvml.set(devices=[device(processes=[{"pid": stale.pid, "used": 100}])])
    assert probe.may_start() is False
    probe.check(ctx())  # the stale holder is killed on this tick
    stale.wait(timeout=10)
    nvml.set(devices=[device()])  # and its memory goes with it
    probe.check(ctx())
    assert probe.may_start() is True


def test_no_gpu_on_this_machine_is_unavailable_and_never_holds_a_restart(
    make_probe: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    if shutil.which("nvidia-smi") or os.path.exists("/dev/nvidiactl"):
        pytest.skip("this machine has a GPU: the no-GPU path cannot be seen here")
    monkeypatch.delenv(PATH_VAR, raising=False)  # the real pynvml (or none), not the fake
    probe = make_probe()
    r = probe.check(ctx())
    assert (r.verdict.level, r.verdict.code) == ("unavailable", "no_gpu"), r.verdict
    assert "nvidia-smi" in r.verdict.reason
    assert r.sample == {"idle": None}
    assert probe.worker_pid is None  # no worker kept for a box without a GPU
    assert probe.may_start() is True
    assert probe.check(ctx()).verdict.code == "no_gpu"  # from memory, not asked again
    assert probe.worker_pid is None
