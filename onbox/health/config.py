"""The health settings of a run: the job file's ``[health]`` and ``[notify]`` tables, checked
before anything starts (a bad value is a ``UsageError`` naming its field), stored in spec.json.

Every setting has a default a user would pick; the README's "Job file" lists them. Notification
URLs may also come from ``$RGT_NOTIFY_URLS`` (space separated) and the dead-man's switch from
``$RGT_DEADMAN_URL``: the box's environment keeps tokens out of a job file under git.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Mapping, Optional, Tuple

from onbox.common.duration import parse_duration
from onbox.common.errors import UsageError
from onbox.common.size import parse_size

POLICIES = ("alert", "stop", "off")
STALL_ACTIONS = ("restart", "alert", "off")
NOTIFY_URLS_VAR = "RGT_NOTIFY_URLS"
DEADMAN_VAR = "RGT_DEADMAN_URL"


@dataclasses.dataclass(frozen=True)
class DiskConfig:
    """Watermarks of used bytes or inodes (fractions) on every watched path: prune local copies
    already verified in the store, then warn, then hold new local checkpoints back."""

    prune_at: float = 0.80
    warn_at: float = 0.90
    hold_at: float = 0.95
    scratch: int = 1 << 30  # bytes the job needs besides its checkpoints (the budget)
    paths: Tuple[str, ...] = ()  # watched besides the run's own (workdir, checkpoints, cache)


@dataclasses.dataclass(frozen=True)
class MemoryConfig:
    warn_at: float = 0.90  # of the cgroup's limit


@dataclasses.dataclass(frozen=True)
class GpuConfig:
    enabled: bool = True
    idle_util: float = 5.0  # percent: at or under it the GPU counts as idle (a stall needs it)
    temp_warn: float = 83.0  # degrees C
    release_wait: float = 120.0  # seconds a restart waits for the last attempt's GPU memory
    timeout: float = 10.0  # seconds one NVML / nvidia-smi reading may take


@dataclasses.dataclass(frozen=True)
class StallConfig:
    """The stall budget: ``factor`` x the longest step interval seen after ``warmup`` steps
    (forgetting slow first steps once ``warmup`` alike ones run ``factor`` x faster: see
    onbox/health/stall.py), at least ``floor``; ``startup`` until the first step,
    ``checkpoint`` and ``eval`` while the job says it is in that phase."""

    action: str = "restart"
    floor: float = 120.0
    factor: float = 5.0
    warmup: int = 5
    startup: float = 900.0
    checkpoint: float = 1800.0
    eval: float = 1800.0


@dataclasses.dataclass(frozen=True)
class TrainingConfig:
    """Training signals: from progress.json's metrics, or ``loss_pattern`` in the job's log."""

    metric: str = "loss"
    loss_pattern: Optional[str] = None  # a regex whose group 1 (or ``loss``) is the loss
    nan: str = "stop"
    spike: str = "alert"
    spike_factor: float = 10.0  # loss above this x the median of the recent window
    throughput: str = "alert"
    drop_factor: float = 0.5  # step rate under this x its median since the job found its speed


@dataclasses.dataclass(frozen=True)
class SealingConfig:
    max_age: Optional[float] = None  # newest sealed checkpoint older than this: warn
    skew_warn: float = 120.0  # seconds between the box's clock and the store's


@dataclasses.dataclass(frozen=True)
class NotifyConfig:
    """Where events go from the box: Apprise URLs, and a healthchecks-style dead-man's switch."""

    urls: Tuple[str, ...] = ()
    min_level: str = "warn"  # warn | alert; terminal states are always sent
    rate_per_hour: int = 20
    dedup: float = 3600.0  # the same message again within this is not sent
    timeout: float = 10.0  # seconds one send may take
    deadman: Optional[str] = None
    heartbeat: float = 300.0


@dataclasses.dataclass(frozen=True)
class HealthConfig:
    enabled: bool = True
    interval: float = 10.0  # seconds between probe ticks
    disk: DiskConfig = dataclasses.field(default_factory=DiskConfig)
    memory: MemoryConfig = dataclasses.field(default_factory=MemoryConfig)
    gpu: GpuConfig = dataclasses.field(default_factory=GpuConfig)
    stall: StallConfig = dataclasses.field(default_factory=StallConfig)
    training: TrainingConfig = dataclasses.field(default_factory=TrainingConfig)
    sealing: SealingConfig = dataclasses.field(default_factory=SealingConfig)
    notify: NotifyConfig = dataclasses.field(default_factory=NotifyConfig)

    def to_json(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: Optional[Mapping[str, Any]]) -> HealthConfig:
        """From spec.json (already checked when the run was set up); {} or None: defaults."""
        if not d:
            return cls()
        parts = {}
        for f in dataclasses.fields(cls):
            v = d.get(f.name)
            if v is None:
                continue
            sub = _SUBTABLES.get(f.name)
            parts[f.name] = sub(**_tuples(sub, v)) if sub is not None else v
        return cls(**parts)


_SUBTABLES: Dict[str, Any] = {
    "disk": DiskConfig,
    "memory": MemoryConfig,
    "gpu": GpuConfig,
    "stall": StallConfig,
    "training": TrainingConfig,
    "sealing": SealingConfig,
    "notify": NotifyConfig,
}


def _tuples(cls: Any, v: Mapping[str, Any]) -> Dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: tuple(x) if isinstance(x, list) else x for k, x in v.items() if k in names}


# ---- the job file
def _fraction(v: Any, field: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
        raise UsageError(field, f"{v!r} is not a fraction in (0, 1]", "e.g. 0.9 for 90% used")
    return float(v)


def _positive(v: Any, field: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise UsageError(field, f"{v!r} is not a number > 0", "e.g. 5")
    return float(v)


def _choice(v: Any, field: str, allowed: Tuple[str, ...]) -> str:
    if v not in allowed:
        raise UsageError(field, f"{v!r} is not one of {', '.join(allowed)}", f"e.g. {allowed[0]!r}")
    return str(v)


def _count(v: Any, field: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise UsageError(field, f"{v!r} is not a count >= 0", "e.g. 5")
    return v


def _bool(v: Any, field: str) -> bool:
    if not isinstance(v, bool):
        raise UsageError(field, f"{v!r} is not true or false", "e.g. true")
    return v


def _strings(v: Any, field: str) -> Tuple[str, ...]:
    if isinstance(v, str):
        v = v.split()
    if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
        raise UsageError(field, f"{v!r} is not a list of strings", 'e.g. ["ntfy://host/topic"]')
    return tuple(v)


def _url(v: Any, field: str) -> str:
    if not isinstance(v, str) or not v.startswith(("http://", "https://")):
        raise UsageError(field, "is not an http(s) URL", 'e.g. "https://hc-ping.com/UUID"')
    return v


# field -> how to check it; the same table names the keys each sub-table allows
_CHECKS: Dict[str, Dict[str, Any]] = {
    "disk": {
        "prune_at": _fraction,
        "warn_at": _fraction,
        "hold_at": _fraction,
        "scratch": parse_size,
        "paths": _strings,
    },
    "memory": {"warn_at": _fraction},
    "gpu": {
        "enabled": _bool,
        "idle_util": _positive,
        "temp_warn": _positive,
        "release_wait": lambda v, f: parse_duration(v, f, allow_zero=True),
        "timeout": parse_duration,
    },
    "stall": {
        "action": lambda v, f: _choice(v, f, STALL_ACTIONS),
        "floor": parse_duration,
        "factor": _positive,
        "warmup": _count,
        "startup": parse_duration,
        "checkpoint": parse_duration,
        "eval": parse_duration,
    },
    "training": {
        "metric": lambda v, f: _strings([v], f)[0],
        "loss_pattern": lambda v, f: _regex(v, f),
        "nan": lambda v, f: _choice(v, f, POLICIES),
        "spike": lambda v, f: _choice(v, f, POLICIES),
        "spike_factor": _positive,
        "throughput": lambda v, f: _choice(v, f, POLICIES),
        "drop_factor": _fraction,
    },
    "sealing": {"max_age": parse_duration, "skew_warn": parse_duration},
    "notify": {
        "urls": _strings,
        "min_level": lambda v, f: _choice(v, f, ("warn", "alert")),
        "rate_per_hour": lambda v, f: int(_positive(v, f)),
        "dedup": lambda v, f: parse_duration(v, f, allow_zero=True),
        "timeout": parse_duration,
        "deadman": _url,
        "heartbeat": parse_duration,
    },
}


def _regex(v: Any, field: str) -> str:
    import re

    if not isinstance(v, str):
        raise UsageError(field, f"{v!r} is not a regular expression", r"e.g. 'loss[=: ]+(\S+)'")
    try:
        re.compile(v)
    except re.error as e:
        raise UsageError(
            field, f"{v!r} is not a regular expression: {e}", "fix the pattern"
        ) from None
    return v


def _table(data: Mapping[str, Any], key: str, where: str) -> Dict[str, Any]:
    v = data.get(key, {})
    if not isinstance(v, dict):
        raise UsageError(where, "must be a table", f"[{where}] ...")
    return v


def parse(data: Mapping[str, Any], environ: Mapping[str, str]) -> HealthConfig:
    """The job file's ``[health]`` and ``[notify]`` tables (``data`` is the whole file)."""
    health = _table(data, "health", "health")
    top = {"enabled", "interval", *(k for k in _CHECKS if k != "notify")}
    for k in health:
        if k not in top:
            raise UsageError(
                f"health.{k}", "is not a health setting", f"one of {', '.join(sorted(top))}"
            )
    kw: Dict[str, Any] = {}
    if "enabled" in health:
        kw["enabled"] = _bool(health["enabled"], "health.enabled")
    if "interval" in health:
        kw["interval"] = parse_duration(health["interval"], "health.interval")
    tables = {k: _table(health, k, f"health.{k}") for k in _CHECKS if k != "notify"}
    tables["notify"] = _table(data, "notify", "notify")
    for name, table in tables.items():
        prefix = "notify" if name == "notify" else f"health.{name}"
        checks = _CHECKS[name]
        got: Dict[str, Any] = {}
        for k, v in table.items():
            if k not in checks:
                raise UsageError(
                    f"{prefix}.{k}", "is not a setting here", f"one of {', '.join(sorted(checks))}"
                )
            got[k] = checks[k](v, f"{prefix}.{k}")
        if name == "notify":
            if "urls" not in got and environ.get(NOTIFY_URLS_VAR, "").strip():
                got["urls"] = _strings(environ[NOTIFY_URLS_VAR], NOTIFY_URLS_VAR)
            if "deadman" not in got and environ.get(DEADMAN_VAR, "").strip():
                got["deadman"] = _url(environ[DEADMAN_VAR].strip(), DEADMAN_VAR)
        kw[name] = _SUBTABLES[name](**got)
    cfg = HealthConfig(**kw)
    d = cfg.disk
    if not d.prune_at <= d.warn_at <= d.hold_at:
        raise UsageError(
            "health.disk",
            f"watermarks must rise: prune_at {d.prune_at} <= warn_at {d.warn_at} "
            f"<= hold_at {d.hold_at}",
            "e.g. prune_at = 0.8, warn_at = 0.9, hold_at = 0.95",
        )
    return cfg
