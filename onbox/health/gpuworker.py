"""The GPU reader, a subprocess of the agent (``python -S -m onbox.health.gpuworker``): NVML or
nvidia-smi can hang on a sick driver, so they are only ever called here, where the GPU probe
(onbox/health/gpu.py) can kill the whole process when an answer is late.

It is long-lived: each line ``read`` on stdin is answered with one JSON line on stdout; end of
stdin (the agent went away) ends it. The backend is chosen once, at start: NVML through
nvidia-ml-py (``import pynvml``) when it imports and ``nvmlInit`` works; else ``nvidia-smi``
when it is on PATH and lists a GPU; else none (``{"backend": "none", "why": ...}``).

An answer: ``{"ok": true, "backend": ..., "devices": [...], "xids": [...]}``; per device its
index, name, util (%), mem_used / mem_total (MiB), temp (C), power (W), sm_clock / sm_clock_max
(MHz), throttle (decoded reason names), ecc_uncorrected (volatile count), recovery_action (the
NVML field, where the driver has it), lost (NVML says the GPU is lost or needs a reset) and
processes ([{"pid", "used"}], MiB). Anything a device does not support is null. ``xids``: the
critical Xid events a thread of this process saw (NVML event subscription) since the last
answer. ``{"ok": false, "error": ...}`` when the backend failed this time.
"""

from __future__ import annotations

import importlib
import json
import shutil
import subprocess
import sys
import threading
from typing import Any, Callable, Dict, List, Optional

MIB = 1 << 20
# NVML's ABI numbers (nvml.h): typed here, so that an older nvidia-ml-py lacking a name (the
# recovery-action field came in driver 550) still reads the rest.
ERROR_NOT_SUPPORTED = 3
ERROR_TIMEOUT = 10
LOST = (15, 16)  # NVML_ERROR_GPU_IS_LOST, NVML_ERROR_RESET_REQUIRED
TEMPERATURE_GPU = 0
CLOCK_SM = 1
MEMORY_ERROR_TYPE_UNCORRECTED = 1
VOLATILE_ECC = 0
FI_DEV_GET_GPU_RECOVERY_ACTION = 230
EVENT_XID_CRITICAL = 0x8
XID_WAIT_MS = 500
THROTTLE_CALL = "nvmlDeviceGetCurrentClocksThrottleReasons"
THROTTLE_NAMES = (
    (0x1, "gpu_idle"),
    (0x2, "applications_clocks_setting"),
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal_slowdown"),
    (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
)
SMI_GPU_FIELDS = (
    "index,uuid,name,utilization.gpu,memory.used,memory.total,temperature.gpu,power.draw,"
    "clocks.sm,clocks.max.sm,{reasons},ecc.errors.uncorrected.volatile.total"
)
# The throttle reasons' field was renamed in newer drivers; older ones know only the first.
SMI_REASONS = ("clocks_throttle_reasons.active", "clocks_event_reasons.active")


def throttle_names(mask: Optional[int]) -> Optional[List[str]]:
    if mask is None:
        return None
    return [name for bit, name in THROTTLE_NAMES if mask & bit]


class Nvml:
    """Readings through nvidia-ml-py, and the Xid thread."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml
        self.xids: List[Dict[str, int]] = []
        self.lock = threading.Lock()

    def _get(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, None where the device does not have it; a lost GPU is raised."""
        try:
            return fn(*args)
        except self.nvml.NVMLError as e:
            if getattr(e, "value", None) in LOST:
                raise
            return None

    def start_xids(self) -> None:
        nvml = self.nvml
        try:
            events = nvml.nvmlEventSetCreate()
        except nvml.NVMLError:
            return
        index = {}
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            try:
                nvml.nvmlDeviceRegisterEvents(h, EVENT_XID_CRITICAL, events)
                index[_key(h)] = i
            except nvml.NVMLError:  # not supported on this device: its Xids go unseen
                pass
        if index:
            threading.Thread(target=self._wait_xids, args=(events, index), daemon=True).start()

    def _wait_xids(self, events: Any, index: Dict[Any, int]) -> None:
        nvml = self.nvml
        while True:
            try:
                data = nvml.nvmlEventSetWait(events, XID_WAIT_MS)
            except nvml.NVMLError as e:
                if getattr(e, "value", None) != ERROR_TIMEOUT:
                    return  # the event set broke: readings go on, Xids go unseen
                continue
            with self.lock:
                dev = index.get(_key(data.device), -1)
                self.xids.append({"device": dev, "xid": int(data.eventData)})

    def take_xids(self) -> List[Dict[str, int]]:
        with self.lock:
            out, self.xids = self.xids, []
        return out

    def read(self) -> List[Dict[str, Any]]:
        nvml = self.nvml
        return [self._device(i, nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(_count(nvml))]

    def _device(self, i: int, h: Any) -> Dict[str, Any]:
        nvml, get = self.nvml, self._get
        d: Dict[str, Any] = {"index": i, "lost": False}
        try:
            name = get(nvml.nvmlDeviceGetName, h)
            d["name"] = name.decode() if isinstance(name, bytes) else name
            util = get(nvml.nvmlDeviceGetUtilizationRates, h)
            d["util"] = None if util is None else util.gpu
            mem = get(nvml.nvmlDeviceGetMemoryInfo, h)
            d["mem_used"] = None if mem is None else mem.used // MIB
            d["mem_total"] = None if mem is None else mem.total // MIB
            d["temp"] = get(nvml.nvmlDeviceGetTemperature, h, TEMPERATURE_GPU)
            mw = get(nvml.nvmlDeviceGetPowerUsage, h)
            d["power"] = None if mw is None else round(mw / 1000.0, 1)
            d["sm_clock"] = get(nvml.nvmlDeviceGetClockInfo, h, CLOCK_SM)
            d["sm_clock_max"] = get(nvml.nvmlDeviceGetMaxClockInfo, h, CLOCK_SM)
            d["throttle"] = throttle_names(self._throttle(h))
            d["ecc_uncorrected"] = get(
                nvml.nvmlDeviceGetTotalEccErrors, h, MEMORY_ERROR_TYPE_UNCORRECTED, VOLATILE_ECC
            )
            d["recovery_action"] = self._recovery(h)
            procs = get(nvml.nvmlDeviceGetComputeRunningProcesses, h) or []
            d["processes"] = [
                {"pid": p.pid, "used": None if p.usedGpuMemory is None else p.usedGpuMemory // MIB}
                for p in procs
            ]
        except nvml.NVMLError as e:  # LOST: this device is gone; the others are still read
            d.update(lost=True, error=str(e))
        return d

    def _throttle(self, h: Any) -> Optional[int]:
        # The call was renamed ("event reasons") in newer drivers; an older driver lacks it.
        for name in ("nvmlDeviceGetCurrentClocksEventReasons", THROTTLE_CALL):
            fn = getattr(self.nvml, name, None)
            mask = None if fn is None else self._get(fn, h)
            if mask is not None:
                return int(mask)
        return None

    def _recovery(self, h: Any) -> Optional[int]:
        fn = getattr(self.nvml, "nvmlDeviceGetFieldValues", None)
        values = None if fn is None else self._get(fn, h, [FI_DEV_GET_GPU_RECOVERY_ACTION])
        if not values or values[0].nvmlReturn != 0:
            return None
        return int(values[0].value.uiVal)


def _count(nvml: Any) -> int:
    return int(nvml.nvmlDeviceGetCount())


def _key(handle: Any) -> Any:
    """A device handle as a dict key (a ctypes pointer's address; the fake's own value)."""
    try:
        import ctypes

        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return handle


# ---- nvidia-smi
def _smi_value(v: str) -> Any:
    v = v.strip()
    if not v or v.startswith("[") or v in ("N/A", "Not Supported"):
        return None
    try:
        return float(v) if "." in v else int(v, 0)
    except ValueError:
        return v


def _smi(smi: str, query: str, timeout: float) -> List[List[Any]]:
    p = subprocess.run(
        [smi, query, "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if p.returncode != 0:
        raise RuntimeError(f"nvidia-smi exited {p.returncode}: {(p.stderr or p.stdout).strip()}")
    return [[_smi_value(x) for x in line.split(",")] for line in p.stdout.splitlines() if line]


def _smi_gpus(smi: str, timeout: float) -> List[List[Any]]:
    for reasons in SMI_REASONS:
        try:
            return _smi(smi, "--query-gpu=" + SMI_GPU_FIELDS.format(reasons=reasons), timeout)
        except RuntimeError as e:
            err = e
    raise err


def smi_read(smi: str, timeout: float) -> List[Dict[str, Any]]:
    devices, by_uuid = [], {}
    for row in _smi_gpus(smi, timeout):
        idx, uuid, name, util, used, total, temp, power, clk, clk_max, mask, ecc = row[:12]
        d = {
            "index": idx,
            "name": name,
            "util": util,
            "mem_used": used,
            "mem_total": total,
            "temp": temp,
            "power": power,
            "sm_clock": clk,
            "sm_clock_max": clk_max,
            "throttle": throttle_names(mask if isinstance(mask, int) else None),
            "ecc_uncorrected": ecc,
            "recovery_action": None,
            "lost": False,
            "processes": [],
        }
        devices.append(d)
        by_uuid[uuid] = d
    for uuid, pid, used in _smi(smi, "--query-compute-apps=gpu_uuid,pid,used_memory", timeout):
        if uuid in by_uuid and isinstance(pid, int):
            by_uuid[uuid]["processes"].append({"pid": pid, "used": used})
    return devices


# ---- the process
class Worker:
    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.nvml: Optional[Nvml] = None
        self.smi: Optional[str] = None
        self.why = ""
        try:
            mod = importlib.import_module("pynvml")
            mod.nvmlInit()
            self.nvml = Nvml(mod)
            self.nvml.start_xids()
            return
        except Exception as e:  # no library, no driver: both mean "not through NVML"
            self.why = f"NVML: {type(e).__name__}: {e}"
        smi = shutil.which("nvidia-smi")
        if smi is None:
            self.why += "; no nvidia-smi on PATH"
            return
        try:
            if smi_read(smi, timeout):
                self.smi = smi
            else:
                self.why += "; nvidia-smi lists no GPU"
        except (OSError, RuntimeError, ValueError, subprocess.TimeoutExpired) as e:
            self.why += f"; nvidia-smi: {e}"

    def answer(self) -> Dict[str, Any]:
        try:
            if self.nvml is not None:
                devices = self.nvml.read()
                return {"ok": True, "backend": "nvml", "devices": devices, "xids": self.xids()}
            if self.smi is not None:
                devices = smi_read(self.smi, self.timeout)
                return {"ok": True, "backend": "nvidia-smi", "devices": devices, "xids": []}
        except Exception as e:  # a reading that failed this time: the probe says unknown
            return {"ok": False, "error": f"{type(e).__name__}: {e}"}
        return {"ok": True, "backend": "none", "why": self.why, "devices": [], "xids": []}

    def xids(self) -> List[Dict[str, int]]:
        return self.nvml.take_xids() if self.nvml is not None else []


def main(argv: List[str]) -> int:
    timeout = float(argv[argv.index("--timeout") + 1]) if "--timeout" in argv else 10.0
    worker = Worker(timeout)
    for line in sys.stdin:
        if line.strip() != "read":
            continue
        sys.stdout.write(json.dumps(worker.answer()) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
