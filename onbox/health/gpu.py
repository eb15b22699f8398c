"""The GPU probe: what NVML (or nvidia-smi) says of the box's GPUs each tick, who holds their
memory, and whether the next attempt may start (``may_start``, the supervisor's start gate).

Readings come from a long-lived subprocess (onbox/health/gpuworker.py), one JSON line per
request, each bounded by ``cfg.timeout``: a worker that does not answer is killed by PID and a
new one started next tick; meanwhile the verdict is ``unknown`` (busy, never idle). No GPU
(no NVML, no nvidia-smi) is ``unavailable``/``no_gpu`` once, then asked again every
``NO_GPU_RECHECK`` seconds.

Verdicts: ``alert`` for an Xid, a lost GPU, a recovery action asking for a reset or a reboot,
uncorrected ECC errors; ``warn`` for GPU memory held by a process outside the run, or a hot GPU
(``temp_warn``) whose clocks a thermal or power reason holds back; ``ok`` with util and memory.
Samples (memory in MiB, power in W): util, mem_used, mem_total, temp, power of GPU 0, the same
``gpuN.``-prefixed for N > 0, and ``idle`` (util <= ``idle_util`` on every GPU; None when
unknown), which the stall probe reads.

Memory holders are told apart by their environment tag (``owner``, onbox/agent/healthuse.py):
the current attempt's are fine; an earlier attempt's (stale) are killed by PID after the tag is
read again, with a ``gpu_reaped`` event; anyone else's are reported, never killed. Inside a
container NVML reports host PIDs: a PID not in our /proc, or one whose process holds no
/dev/nvidia* file where the box has them, is an unknown holder (host PID?), reported only.

Test seam: ``$RGT_GPU_WORKER_PATH`` (os.pathsep separated) goes first on the worker's
``sys.path``: the tests put a fake ``pynvml`` there (tests/fakes/pynvml.py).
"""

from __future__ import annotations

import dataclasses
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import psutil

import onbox
from onbox.common import jobenv
from onbox.health.config import GpuConfig
from onbox.health.verdict import Context, Reading, Verdict, ok, unavailable, unknown

PATH_VAR = "RGT_GPU_WORKER_PATH"
NO_GPU_RECHECK = 600.0  # seconds between asking again on a box that showed no GPU
GATE_SLACK_MIB = 512  # used memory above the baseline that still lets a restart go
NVIDIA_DEVICE = "/dev/nvidiactl"
RESET_ACTIONS = {1: "a GPU reset", 2: "a node reboot", 4: "a drain and reset", 6: "a bus reset"}
RESET_ACTIONS[7] = "a system reboot"
HARDWARE_XIDS = {48: "double-bit ECC error", 79: "fell off the bus", 64: "ECC page retirement"}
HARDWARE_XIDS.update({63: "ECC page retirement", 74: "NVLink error", 92: "high single-bit ECC"})
HARDWARE_XIDS.update({94: "contained ECC error", 95: "uncontained ECC error", 119: "GSP timeout"})
HARDWARE_XIDS[120] = "GSP error"
HOT_REASONS = (
    "sw_thermal_slowdown",
    "hw_thermal_slowdown",
    "hw_slowdown",
    "sw_power_cap",
    "hw_power_brake_slowdown",
)
REMEDY_RERENT = "stop the run and re-rent another box: this GPU is failing"


def worker_argv(timeout: float) -> List[str]:
    """How the worker starts: this Python, without site (as rgt's own processes do), its
    imports through the PYTHONPATH that ``worker_environ`` sets."""
    return [sys.executable, "-S", "-m", "onbox.health.gpuworker", "--timeout", str(timeout)]


def worker_environ(extra: Sequence[str] = ()) -> Dict[str, str]:
    """The agent's environment, with its own ``sys.path`` as PYTHONPATH (after the test seam's
    entries) and no attempt tag (the worker is not the job's)."""
    env = {k: v for k, v in os.environ.items() if k != jobenv.ATTEMPT_TAG}
    seam = [p for p in os.environ.get(PATH_VAR, "").split(os.pathsep) if p]
    path = [*extra, *seam, onbox.import_root(), *(p for p in sys.path if p)]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(path))
    return env


class WorkerClient:
    """One worker process: a request is a line out, its answer a line back, or None when late."""

    def __init__(self, argv: List[str], env: Dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            close_fds=True,
        )
        self.pid = self.proc.pid
        self.pending = False
        self.buf = b""
        self.exited: Optional[str] = None

    def send(self) -> None:
        if self.pending:
            return
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(b"read\n")
            self.proc.stdin.flush()
            self.pending = True
        except OSError as e:  # it died: the answer never comes, receive says why
            self.exited = f"worker gone ({e})"

    def receive(self, timeout: float) -> Optional[Dict[str, Any]]:
        """The answer to the request sent, None when none came within ``timeout`` seconds."""
        import json

        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf and self.exited is None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                self.exited = f"worker exited (code {self.proc.poll()})"
            self.buf += chunk
        if b"\n" not in self.buf:
            return None
        line, self.buf = self.buf.split(b"\n", 1)
        self.pending = False
        try:
            doc: Dict[str, Any] = json.loads(line)
        except ValueError:
            return {"ok": False, "error": f"the worker said {line[:200]!r}"}
        return doc

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._close_pipes()

    def close(self) -> None:
        """End of stdin ends the worker; one that does not go within a second is killed."""
        self._close_pipes()
        try:
            self.proc.wait(1.0)
        except subprocess.TimeoutExpired:
            self.kill()

    def _close_pipes(self) -> None:
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass


@dataclasses.dataclass
class Holder:
    """A process holding GPU memory, and whose it is."""

    pid: int
    gpu: int
    mib: int
    who: str  # current | earlier | foreign | unknown
    tag: Optional[str] = None


@dataclasses.dataclass
class Snapshot:
    """What ``may_start`` reads of the last good reading (taken at ``at``, monotonic)."""

    at: float
    used: int  # MiB on every GPU
    earlier: List[int]  # pids of earlier attempts still holding memory


class GpuProbe:
    name = "gpu"

    def __init__(
        self,
        cfg: GpuConfig,
        owner: Callable[[Optional[str], Optional[str]], Optional[str]],
        event: Callable[..., None],
        *,
        extra_path: Sequence[str] = (),
    ) -> None:
        self.cfg, self.owner, self.event = cfg, owner, event
        self.extra_path = list(extra_path)
        self.worker: Optional[WorkerClient] = None
        self.no_gpu: Optional[Verdict] = None  # set while the box showed no GPU
        self.recheck_at = 0.0
        self.baseline: Optional[int] = None  # MiB used before the first attempt (less ours)
        self.xids: List[Dict[str, int]] = []  # seen during ``xid_attempt``
        self.xid_attempt: Optional[int] = None
        self.reaped: Dict[int, float] = {}  # pid -> its create time, killed already
        self._lock = threading.Lock()
        self._snap: Optional[Snapshot] = None
        self._gate_since: Optional[float] = None
        if cfg.enabled:
            # The first request goes now, before the first attempt has a CUDA context: its
            # answer is the baseline the start gate measures released memory against.
            self._ensure_worker()

    @property
    def worker_pid(self) -> Optional[int]:
        return self.worker.pid if self.worker is not None else None

    def _ensure_worker(self) -> WorkerClient:
        if self.worker is None:
            argv = worker_argv(self.cfg.timeout)
            self.worker = WorkerClient(argv, worker_environ(self.extra_path))
        self.worker.send()
        return self.worker

    # ---- one tick
    def check(self, ctx: Context) -> Reading:
        if not self.cfg.enabled:
            return Reading(
                unavailable(self.name, "off ([health.gpu] enabled = false)"), {"idle": None}
            )
        if self.no_gpu is not None and ctx.now < self.recheck_at:
            return Reading(self.no_gpu, {"idle": None})
        w = self._ensure_worker()
        doc = w.receive(self.cfg.timeout)
        if doc is None:
            why = w.exited or f"no answer within {self.cfg.timeout:g} s"
            w.kill()
            self.worker = None
            v = Verdict(
                self.name,
                "unknown",
                "gpu_timeout",
                f"the GPU reading hung ({why}); worker pid {w.pid} killed, a new one next tick",
                remedy="a driver that hangs NVML calls is often a failing GPU: watch for Xids",
                data={"killed_pid": w.pid},
            )
            return Reading(v, {"idle": None})
        if not doc.get("ok"):
            return Reading(unknown(self.name, f"GPU not read: {doc.get('error')}"), {"idle": None})
        if doc.get("backend") == "none":
            w.close()
            self.worker = None
            self.no_gpu = Verdict(
                self.name, "unavailable", "no_gpu", f"no GPU seen ({doc.get('why', '')})"
            )
            self.recheck_at = ctx.now + NO_GPU_RECHECK
            return Reading(self.no_gpu, {"idle": None})
        self.no_gpu = None
        return self._judge(doc, ctx)

    def _judge(self, doc: Dict[str, Any], ctx: Context) -> Reading:
        devices: List[Dict[str, Any]] = doc.get("devices") or []
        if ctx.attempt != self.xid_attempt:  # an Xid stays on the verdict for its attempt
            self.xids, self.xid_attempt = [], ctx.attempt
        self.xids.extend(doc.get("xids") or [])
        holders = self._holders(devices, ctx)
        used = sum(int(d.get("mem_used") or 0) for d in devices)
        ours = sum(h.mib for h in holders if h.who in ("current", "earlier"))
        with self._lock:
            if self.baseline is None:
                self.baseline = max(0, used - ours)
            earlier = [h.pid for h in holders if h.who == "earlier" and psutil.pid_exists(h.pid)]
            self._snap = Snapshot(time.monotonic(), used, earlier)
        concerns = self._concerns(devices, holders)
        notes = [
            f"unknown holder pid {h.pid} (host PID?): {h.mib} MiB on GPU {h.gpu}"
            for h in holders
            if h.who == "unknown"
        ]
        data = {"backend": doc.get("backend"), "devices": len(devices)}
        if holders:
            data["holders"] = [dataclasses.asdict(h) for h in holders]
        if concerns:
            concerns.sort(key=lambda c: 0 if c[0] == "alert" else 1)
            level, code, _, remedy, klass = concerns[0]
            reason = "; ".join([c[2] for c in concerns] + notes)
            v = Verdict(self.name, level, code, reason, remedy=remedy, klass=klass, data=data)
        else:
            v = ok(self.name, "; ".join([_summary(devices)] + notes), **data)
        return Reading(v, self._sample(devices))

    def _concerns(
        self, devices: List[Dict[str, Any]], holders: List[Holder]
    ) -> List[Tuple[str, str, str, str, str]]:
        """(level, code, reason, remedy, klass) of everything wrong, in the order found."""
        out: List[Tuple[str, str, str, str, str]] = []
        for x in self.xids:
            what = HARDWARE_XIDS.get(x["xid"])
            where = f"Xid {x['xid']} on GPU {x['device']}"
            if what:
                out.append(("alert", "xid", f"{where} ({what})", REMEDY_RERENT, "permanent"))
            else:
                remedy = "look the Xid up in NVIDIA's Xid catalog; a restart may clear it"
                out.append(("alert", "xid", where, remedy, "transient"))
        for d in devices:
            i = d.get("index")
            if d.get("lost"):
                reason = f"GPU {i} is lost ({d.get('error', '')})"
                out.append(("alert", "gpu_lost", reason, REMEDY_RERENT, "permanent"))
                continue
            action = RESET_ACTIONS.get(d.get("recovery_action") or 0)
            if action:
                reason = f"GPU {i} asks for {action} (NVML recovery action)"
                out.append(("alert", "recovery_action", reason, REMEDY_RERENT, "permanent"))
            if d.get("ecc_uncorrected"):
                reason = f"GPU {i}: {d['ecc_uncorrected']} uncorrected ECC errors"
                out.append(("alert", "ecc_uncorrected", reason, REMEDY_RERENT, "permanent"))
            hot = [r for r in d.get("throttle") or [] if r in HOT_REASONS]
            temp = d.get("temp")
            if hot and temp is not None and temp >= self.cfg.temp_warn:
                reason = (
                    f"GPU {i} at {temp} C, clocks held back ({', '.join(hot)}): SM "
                    f"{d.get('sm_clock')}/{d.get('sm_clock_max')} MHz"
                )
                remedy = "the box runs hot: ask the provider or move; training goes on, slower"
                out.append(("warn", "hot_throttled", reason, remedy, "transient"))
        for h in holders:
            if h.who == "foreign":
                reason = f"GPU memory held by pid {h.pid} (not this run): {h.mib} MiB"
                remedy = "rgt never kills it: stop that process yourself if it is yours"
                out.append(("warn", "foreign_gpu_memory", reason, remedy, "transient"))
        return out

    def _sample(self, devices: List[Dict[str, Any]]) -> Dict[str, Any]:
        sample: Dict[str, Any] = {}
        for d in devices:
            prefix = "" if d.get("index") == 0 else f"gpu{d.get('index')}."
            for k in ("util", "mem_used", "mem_total", "temp", "power"):
                sample[prefix + k] = d.get(k)
        utils = [d.get("util") for d in devices]
        known = [float(u) for u in utils if u is not None]
        if not utils or len(known) < len(utils):
            sample["idle"] = None
        else:
            sample["idle"] = all(u <= self.cfg.idle_util for u in known)
        return sample

    # ---- who holds the memory
    def _holders(self, devices: List[Dict[str, Any]], ctx: Context) -> List[Holder]:
        out = []
        mine = {os.getpid(), self.worker_pid}
        for d in devices:
            for p in d.get("processes") or []:
                pid = int(p["pid"])
                if pid in mine:
                    continue
                h = Holder(pid, int(d.get("index") or 0), int(p.get("used") or 0), "unknown")
                h.who, h.tag = _whose(pid, ctx.tag, self.owner)
                if h.who == "earlier":
                    self._reap(h)
                out.append(h)
        return out

    def _reap(self, h: Holder) -> None:
        """Kill a stale holder of an earlier attempt, by PID, after reading its tag again."""
        try:
            proc = psutil.Process(h.pid)
            created = proc.create_time()
            if proc.environ().get(jobenv.ATTEMPT_TAG) != h.tag or not proc.is_running():
                return
            os.kill(h.pid, signal.SIGKILL)
        except (psutil.Error, ProcessLookupError, PermissionError):
            return  # gone already, or not ours to kill after all
        if self.reaped.get(h.pid) == created:
            return  # killed on an earlier tick; NVML still lists it until its memory goes
        self.reaped[h.pid] = created
        self.event(
            "gpu_reaped",
            f"killed pid {h.pid}, left by an earlier attempt ({h.tag}): "
            f"it held {h.mib} MiB on GPU {h.gpu}",
            klass="transient",
            remedy="",
            pid=h.pid,
            tag=h.tag,
            mib=h.mib,
        )

    # ---- the start gate
    def may_start(self) -> bool:
        """Whether the next attempt may start, from the last reading (never blocks): not while
        an earlier attempt's process holds GPU memory or the memory used is above the baseline
        by more than GATE_SLACK_MIB, and only on a reading taken since the first ask; after
        ``release_wait`` seconds of no, yes with an event saying the memory was still held."""
        if not self.cfg.enabled or self.no_gpu is not None or self.cfg.release_wait <= 0:
            return True
        now = time.monotonic()
        with self._lock:
            if self._gate_since is None:
                self._gate_since = now
            snap, base = self._snap, self.baseline
            if snap is None or snap.at < self._gate_since:
                held = "no GPU reading since the last attempt ended"
            elif snap.earlier:
                held = f"pids {snap.earlier} of an earlier attempt hold GPU memory"
            elif base is not None and snap.used > base + GATE_SLACK_MIB:
                held = f"{snap.used} MiB of GPU memory in use, {base} MiB before the run"
            else:
                self._gate_since = None
                return True
            if now - self._gate_since < self.cfg.release_wait:
                return False
            self._gate_since = None
        self.event(
            "gpu_gate",
            f"restarting with GPU memory still held after {self.cfg.release_wait:g} s: {held}",
            klass="transient",
            remedy="the next attempt may run out of GPU memory; see the gpu probe's verdict",
        )
        return True

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None


def _whose(
    pid: int, current: Optional[str], owner: Callable[[Optional[str], Optional[str]], Optional[str]]
) -> Tuple[str, Optional[str]]:
    """(current | earlier | foreign | unknown, its tag) of a process NVML names."""
    try:
        proc = psutil.Process(pid)
        if os.path.exists(NVIDIA_DEVICE) and not _holds_nvidia(pid):
            return "unknown", None  # a host PID that happens to name a process of ours
        tag = proc.environ().get(jobenv.ATTEMPT_TAG)
    except psutil.NoSuchProcess:
        return "unknown", None  # not in our /proc: a host PID seen from a container
    except psutil.Error:
        return "unknown", None  # not ours to read (another user's): reported, never killed
    return owner(tag, current) or "foreign", tag


def _holds_nvidia(pid: int) -> bool:
    """Whether ``pid`` has a /dev/nvidia* file open: every CUDA process does."""
    fds = f"/proc/{pid}/fd"
    try:
        for fd in os.listdir(fds):
            try:
                if os.readlink(os.path.join(fds, fd)).startswith("/dev/nvidia"):
                    return True
            except OSError:
                continue
    except OSError:
        return False
    return False


def _summary(devices: List[Dict[str, Any]]) -> str:
    parts = []
    for d in devices:
        name = f"GPU {d.get('index')}" if len(devices) > 1 else str(d.get("name") or "GPU")
        parts.append(
            f"{name}: util {d.get('util')}%, memory {d.get('mem_used')}/{d.get('mem_total')} MiB"
        )
    return "; ".join(parts) or "no GPU devices listed"
