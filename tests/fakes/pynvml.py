"""A FAKE ``pynvml`` (nvidia-ml-py): just the NVML calls onbox/health/gpuworker.py makes, driven
by the JSON file that ``$RGT_FAKE_NVML`` names (read only here, on every call, so a test changes
the "GPU" by rewriting the file). rgt never reads that variable: a test puts tests/fakes first on
the GPU worker's path (``$RGT_GPU_WORKER_PATH``, onbox/health/gpu.py) and this module is imported
instead of the real one.

The file: ``{"init_error": null | CODE, "hang": false, "devices": [DEVICE...], "xids":
[{"device": 0, "xid": 79}...]}``; a DEVICE ``{"name", "util", "mem_used", "mem_total" (MiB),
"temp", "power" (W), "sm_clock", "sm_clock_max", "throttle" (the NVML reason bit mask), "ecc",
"recovery_action", "lost", "processes": [{"pid", "used" (MiB)}]}`` (every key optional).
``hang: true`` makes every device call sleep until it is false again (a hung driver); each Xid
in ``xids`` is delivered once, in order, by ``nvmlEventSetWait``.
"""

from __future__ import annotations

import json
import os
import time
import types
from typing import Any, Dict, List

NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_GPU_IS_LOST = 15
MIB = 1 << 20
HANDLE_BASE = 1000  # device i's handle is HANDLE_BASE + i (an int, as a pointer's address)

_xids_delivered = 0


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"fake NVML error {value}")
        self.value = value


def _state() -> Dict[str, Any]:
    path = os.environ.get("RGT_FAKE_NVML")
    if not path:
        raise NVMLError(NVML_ERROR_LIBRARY_NOT_FOUND)
    with open(path) as f:
        doc: Dict[str, Any] = json.load(f)
    return doc


def _device(handle: int) -> Dict[str, Any]:
    while _state().get("hang"):
        time.sleep(0.05)
    devices: List[Dict[str, Any]] = _state().get("devices", [])
    d = devices[handle - HANDLE_BASE]
    if d.get("lost"):
        raise NVMLError(NVML_ERROR_GPU_IS_LOST)
    return d


def _field(handle: int, key: str) -> Any:
    v = _device(handle).get(key)
    if v is None:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return v


def nvmlInit() -> None:
    code = _state().get("init_error")
    if code is not None:
        raise NVMLError(int(code))


def nvmlDeviceGetCount() -> int:
    while _state().get("hang"):
        time.sleep(0.05)
    return len(_state().get("devices", []))


def nvmlDeviceGetHandleByIndex(i: int) -> int:
    return HANDLE_BASE + i


def nvmlDeviceGetName(h: int) -> bytes:
    return str(_device(h).get("name", "Fake GPU")).encode()


def nvmlDeviceGetUtilizationRates(h: int) -> Any:
    return types.SimpleNamespace(gpu=_field(h, "util"), memory=0)


def nvmlDeviceGetMemoryInfo(h: int) -> Any:
    d = _device(h)
    return types.SimpleNamespace(
        used=int(d.get("mem_used", 0)) * MIB, total=int(d.get("mem_total", 81920)) * MIB
    )


def nvmlDeviceGetTemperature(h: int, sensor: int) -> Any:
    return _field(h, "temp")


def nvmlDeviceGetPowerUsage(h: int) -> int:
    return int(float(_field(h, "power")) * 1000)  # NVML says milliwatts


def nvmlDeviceGetClockInfo(h: int, clock: int) -> Any:
    return _field(h, "sm_clock")


def nvmlDeviceGetMaxClockInfo(h: int, clock: int) -> Any:
    return _field(h, "sm_clock_max")


def nvmlDeviceGetCurrentClocksThrottleReasons(h: int) -> int:
    return int(_device(h).get("throttle", 0))


def nvmlDeviceGetTotalEccErrors(h: int, error_type: int, counter: int) -> Any:
    return _field(h, "ecc")


def nvmlDeviceGetFieldValues(h: int, fields: List[int]) -> List[Any]:
    v = _device(h).get("recovery_action")
    ret = NVML_ERROR_NOT_SUPPORTED if v is None else 0
    value = types.SimpleNamespace(uiVal=v or 0)
    return [types.SimpleNamespace(fieldId=f, nvmlReturn=ret, value=value) for f in fields]


def nvmlDeviceGetComputeRunningProcesses(h: int) -> List[Any]:
    return [
        types.SimpleNamespace(pid=int(p["pid"]), usedGpuMemory=int(p.get("used", 0)) * MIB)
        for p in _device(h).get("processes", [])
    ]


def nvmlEventSetCreate() -> str:
    return "fake-event-set"


def nvmlDeviceRegisterEvents(h: int, event_types: int, event_set: str) -> None:
    _device(h)


def nvmlEventSetWait(event_set: str, timeout_ms: int) -> Any:
    global _xids_delivered
    xids = _state().get("xids", [])
    if _xids_delivered < len(xids):
        x = xids[_xids_delivered]
        _xids_delivered += 1
        return types.SimpleNamespace(
            device=HANDLE_BASE + int(x.get("device", 0)), eventType=0x8, eventData=int(x["xid"])
        )
    time.sleep(timeout_ms / 1000.0)
    raise NVMLError(NVML_ERROR_TIMEOUT)
