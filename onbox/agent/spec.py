"""What a run is asked to do: ``JobSpec`` and ``RestartPolicy``, from a job file and CLI flags.

A job file (TOML) carries the same settings as the flags; flags win. Every value is checked here,
before anything starts, and a bad one raises ``UsageError`` naming its field. The schema is in
the README ("Job file").
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import signal
import sys
from typing import Any, Dict, List, Mapping, Optional, Set, Tuple

from onbox.common.duration import parse_duration
from onbox.common.errors import UsageError
from onbox.common.progress import compile_progress_pattern
from onbox.common.rundir import check_name, is_name
from onbox.common.storeurl import (
    RESTORE_STALL,
    StoreURL,
    parse_store_setting,
    parse_store_url,
    restore_stall,
    with_endpoint,
)
from onbox.health import config as health_config
from onbox.health.config import HealthConfig

TRIGGERS = ("none", "file", "signal:USR2", "signal:USR1", "signal:INT", "signal:HUP")


def parse_signal(value: Any, field: str) -> int:
    """A signal number from ``"TERM"``, ``"SIGINT"`` or ``15``."""
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return int(signal.Signals(value))
        except ValueError:
            pass
    elif isinstance(value, str):
        name = value.upper()
        name = name if name.startswith("SIG") else "SIG" + name
        sig = getattr(signal.Signals, name, None)
        if sig is not None:
            return int(sig)
    raise UsageError(field, f"{value!r} is not a signal", "e.g. TERM, INT, USR2")


@dataclasses.dataclass(frozen=True)
class RestartPolicy:
    """When to restart an attempt that ended, and how long to wait first.

    Preemption-like ends (a signal from outside, SIGKILL that was not the OOM killer) and code
    errors have separate budgets. An exit within ``start_grace`` of the start is a crash loop:
    the backoff doubles from ``backoff_initial`` up to ``backoff_max``. The first restart after
    a healthy run (one that lived past the start grace) waits for nothing.
    """

    max_error_restarts: int = 5
    max_preempt_restarts: int = 100
    start_grace: float = 5.0
    backoff_initial: float = 1.0
    backoff_max: float = 300.0
    success_codes: Tuple[int, ...] = (0,)
    # With a store: this many error restarts in a row in which LATEST did not advance end the
    # run as a crash loop (0: off). Each one resumed from the same checkpoint and got nowhere.
    max_stuck_restarts: int = 3

    def backoff(self, consecutive_quick_failures: int) -> float:
        """Delay before the next start; 0 when the last attempt was healthy."""
        if consecutive_quick_failures <= 0:
            return 0.0
        return float(
            min(self.backoff_max, self.backoff_initial * 2 ** (consecutive_quick_failures - 1))
        )


def preempt_kill_delay(grace: float) -> float:
    """How long the job gets after SIGTERM when the agent has ``grace`` seconds in all.

    The agent must be gone before the budget ends: keep a margin for SIGKILL, the wait for
    the processes to vanish, and the final records.
    """
    return max(0.0, grace - min(2.0, 0.2 * grace))


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """Everything the agent needs to run a job; stored as spec.json in the run directory."""

    name: str
    command: Tuple[str, ...]
    workdir: str
    ckpt_dir: str
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    store: Optional[StoreURL] = None  # spec.json holds its URL (and endpoint_url when set)
    restore_stall: float = RESTORE_STALL  # [store] stall: a restore moving no byte this long ends
    grace: float = 30.0
    stop_signal: int = int(signal.SIGTERM)
    trigger: str = "none"
    restart: RestartPolicy = dataclasses.field(default_factory=RestartPolicy)
    keep: int = 3  # sealed checkpoints kept in the store (the newest verified one always)
    ckpt_interval: Optional[float] = None  # ask the job to checkpoint this often (trigger)
    ckpt_auto: bool = False  # interval "auto": chosen from the run's history (agent/interval.py)
    scan_interval: float = 5.0  # look for new complete checkpoints at least this often
    outputs: Tuple[str, ...] = ()  # paths (relative to workdir) sealed when the job succeeds
    # A regex whose group (one, or the one named ``step``) is the job's step in its output,
    # for scripts that report progress in their log rather than through onbox.train.
    progress_pattern: Optional[str] = None
    # From a platform profile (onbox/agent/profileuse.py); spec.json files from before lack them.
    profile: Optional[str] = None
    proxy_hook: str = ""  # a file the job's environment sources first (onbox/agent/proxyhook.py)
    notice: str = "none"  # how the platform warns of a preemption ("none", "signal", "aws", ...)
    on_done: Optional[str] = None  # the profile's [[meter.on_done]] action run after DONE
    on_done_command: Tuple[str, ...] = ()
    deadline: Optional[float] = None  # the meter cap: epoch seconds, when the run is stopped
    # The job file's [health] and [notify] (onbox/health/config.py); defaults when absent.
    health: HealthConfig = dataclasses.field(default_factory=HealthConfig)

    def to_json(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        d["command"] = list(self.command)
        d["env"] = dict(self.env)
        d["restart"]["success_codes"] = list(self.restart.success_codes)
        d["outputs"] = list(self.outputs)
        d["on_done_command"] = list(self.on_done_command)
        d["store"] = self.store.url if self.store else None
        d["health"] = self.health.to_json()
        if self.store and self.store.endpoint_url:
            d["store_endpoint_url"] = self.store.endpoint_url
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> JobSpec:
        r = dict(d["restart"])
        r["success_codes"] = tuple(r["success_codes"])
        r.setdefault("max_stuck_restarts", 0)  # spec.json from before the rule: as it ran then
        return cls(
            name=d["name"],
            command=tuple(d["command"]),
            workdir=d["workdir"],
            ckpt_dir=d["ckpt_dir"],
            env=dict(d.get("env") or {}),
            store=_stored_store(d),
            restore_stall=float(d.get("restore_stall", RESTORE_STALL)),
            grace=float(d["grace"]),
            stop_signal=int(d["stop_signal"]),
            trigger=d.get("trigger", "none"),
            restart=RestartPolicy(**r),
            keep=int(d.get("keep", 3)),
            ckpt_interval=d.get("ckpt_interval"),
            ckpt_auto=bool(d.get("ckpt_auto", False)),
            scan_interval=float(d.get("scan_interval", 5.0)),
            outputs=tuple(d.get("outputs") or ()),
            # spec.json files written before this field existed lack it
            progress_pattern=d.get("progress_pattern"),
            profile=d.get("profile"),
            proxy_hook=str(d.get("proxy_hook") or ""),
            notice=str(d.get("notice") or "none"),
            on_done=d.get("on_done"),
            on_done_command=tuple(d.get("on_done_command") or ()),
            deadline=None if d.get("deadline") is None else float(d["deadline"]),
            health=HealthConfig.from_json(d.get("health")),
        )


def _stored_store(d: Mapping[str, Any]) -> Optional[StoreURL]:
    """The store of a spec.json, whose URL was checked when the run was set up."""
    if not d.get("store"):
        return None
    store = parse_store_url(d["store"])
    return with_endpoint(store, d.get("store_endpoint_url"), "store_endpoint_url")


_TOP_KEYS = {
    "name",
    "command",
    "workdir",
    "env",
    "grace",
    "stop_signal",
    "checkpoint",
    "store",
    "restart",
    "outputs",
    "progress",
    "profile",
    "on_done",
    "meter",
    "health",
    "notify",
}
_CKPT_KEYS = {"dir", "trigger", "keep", "interval", "scan"}
_PROGRESS_KEYS = {"pattern"}
_RESTART_KEYS = {f.name for f in dataclasses.fields(RestartPolicy)}


def _load_toml(path: str) -> Dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib  # novermin
    else:  # pragma: no cover - exercised on the box's older Pythons
        import tomli as tomllib
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise UsageError("JOB.toml", f"{path} does not exist") from None
    except (OSError, ValueError) as e:  # TOMLDecodeError is a ValueError
        raise UsageError("JOB.toml", f"{path} cannot be read: {e}") from None


def _unknown(keys: Any, allowed: Set[str], where: str) -> None:
    extra = sorted(set(keys) - allowed)
    if extra:
        raise UsageError(
            f"{where}{extra[0]}", "unknown setting", f"valid: {', '.join(sorted(allowed))}"
        )


@dataclasses.dataclass
class Overrides:
    """Values given on the command line; ``None`` means not given."""

    name: Optional[str] = None
    command: Optional[List[str]] = None
    ckpt_dir: Optional[str] = None
    store: Optional[str] = None
    grace: Optional[str] = None
    outputs: Optional[List[str]] = None  # --output, repeatable: added to the job file's
    profile: Optional[str] = None  # --profile NAME: a platform profile (onbox/profiles)
    on_done: Optional[str] = None  # --on-done NAME: one of the profile's [[meter.on_done]]
    deadline: Optional[str] = None  # --deadline DURATION: the meter cap, from the first start
    max_cost: Optional[str] = None  # --max-cost AMOUNT, with --price PER_HOUR
    price: Optional[str] = None


def check_outputs(outputs: Any, field: str = "outputs") -> Tuple[str, ...]:
    """Declared outputs: paths relative to the workdir, never absolute, never climbing out
    with '..' (pull puts each under DEST/outputs/). Duplicates are dropped, order kept."""
    if field == "outputs":
        what, example = "must be a list of paths", 'e.g. outputs = ["out/", "metrics.json"]'
    else:
        what, example = "must be a path", "e.g. --output out/ --output metrics.json"
    if not isinstance(outputs, (list, tuple)) or not all(
        isinstance(o, str) and o and not o.startswith("/") and ".." not in o.split("/")
        for o in outputs
    ):
        raise UsageError(field, f"{what} relative to the workdir", example)
    return tuple(dict.fromkeys(outputs))


def _command_shape(command: Any) -> None:
    """A command is a non-empty argv list of strings (what the laptop can check too)."""
    if not isinstance(command, (list, tuple)) or not all(isinstance(a, str) for a in command):
        raise UsageError(
            "command", "must be a list of strings", 'e.g. command = ["python", "train.py"]'
        )
    if not command or not command[0].strip():
        raise UsageError("command", "is empty", "give the job after --, e.g. -- python train.py")


def _check_command(command: Any, workdir: str, env: Mapping[str, str]) -> Tuple[str, ...]:
    _command_shape(command)
    exe = command[0]
    if "/" in exe:
        path = exe if os.path.isabs(exe) else os.path.join(workdir, exe)
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            raise UsageError("command", f"{exe!r} is not an executable file (from {workdir})")
    elif shutil.which(exe, path=env.get("PATH", os.defpath)) is None:
        raise UsageError("command", f"{exe!r} is not found on PATH", "give its full path")
    return tuple(command)


def default_name(command: List[str]) -> str:
    """A run name from the command: ``python train.py`` -> ``train``."""
    words = [a for a in command if not a.startswith("-")]
    pick = next((a for a in words[1:] if "." in os.path.basename(a)), words[0] if words else "")
    stem = os.path.splitext(os.path.basename(pick))[0].lower()
    stem = re.sub(r"[^a-z0-9._-]+", "-", stem).strip("-._")[:63]
    return stem if is_name(stem) else "job"


def _table(data: Mapping[str, Any], key: str, allowed: Set[str], example: str) -> Dict[str, Any]:
    """The job file's ``[key]`` table (empty when absent), its keys checked."""
    table = data.get(key, {})
    if not isinstance(table, dict):
        raise UsageError(key, "must be a table", example)
    _unknown(table, allowed, f"{key}.")
    return table


def _env_table(data: Mapping[str, Any]) -> Dict[str, str]:
    env = data.get("env", {})
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        raise UsageError("env", "must be a table of string values", 'e.g. [env] FOO = "1"')
    return env


def _checkpoint_settings(ckpt: Mapping[str, Any], ckpt_dir: str) -> Dict[str, Any]:
    """The JobSpec fields of the ``[checkpoint]`` table, ``ckpt_dir`` already resolved."""
    trigger = ckpt.get("trigger", "none")
    if trigger not in TRIGGERS:
        raise UsageError(
            "checkpoint.trigger",
            f"{trigger!r} is not a trigger",
            f"use one of {', '.join(TRIGGERS)}",
        )
    keep = ckpt.get("keep", 3)
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise UsageError("checkpoint.keep", f"{keep!r} is not a count >= 1")
    interval = ckpt.get("interval")
    auto = interval == "auto"
    ckpt_interval = (
        None if interval is None or auto else parse_duration(interval, "checkpoint.interval")
    )
    if (ckpt_interval is not None or auto) and trigger == "none":
        raise UsageError(
            "checkpoint.interval",
            "needs a trigger to ask the job with",
            'set checkpoint.trigger = "signal:USR2" or "file"',
        )
    return dict(
        ckpt_dir=ckpt_dir,
        trigger=trigger,
        keep=keep,
        ckpt_interval=ckpt_interval,
        ckpt_auto=auto,
        scan_interval=parse_duration(ckpt.get("scan", 5), "checkpoint.scan"),
    )


def store_override(flag: str, endpoint_url: Optional[str], field: str) -> StoreURL:
    """``--store URL`` in place of the job file's or the last run's store: its ``endpoint_url``
    stays when the new store is S3 too (the flag names a bucket, the endpoint is where that
    bucket lives)."""
    store = parse_store_url(flag, "--store")
    return with_endpoint(store, endpoint_url, field) if store.scheme == "s3" else store


def _store_setting(data: Mapping[str, Any], flags: Overrides) -> Optional[StoreURL]:
    """The store, parsed once: ``--store`` wins over the job file's ``store`` (whose URL is then
    not looked at; only its ``endpoint_url``)."""
    in_file = data.get("store")
    if flags.store is None:
        return None if in_file is None else parse_store_setting(in_file, "store")
    endpoint = in_file.get("endpoint_url") if isinstance(in_file, dict) else None
    return store_override(flags.store, endpoint, "store.endpoint_url")


def check_settings(data: Mapping[str, Any], flag_command: bool = False) -> None:
    """A job file's settings checked as ``build_spec`` checks them, less what only the box can
    tell (the command on its PATH, the workdir, the profile and its durable path): `rgt deploy`
    runs this on the laptop, so that a wrong key or value is refused before the box is touched.
    ``flag_command``: a command came after ``--``, so the file's is not used (nor checked)."""
    _unknown(data, _TOP_KEYS, "")
    _env_table(data)
    if not flag_command and "command" in data:
        _command_shape(data["command"])
    _checkpoint_settings(_table(data, "checkpoint", _CKPT_KEYS, '[checkpoint] dir = "ckpt"'), "")
    check_outputs(data.get("outputs", []))
    parse_duration(data.get("grace", 30), "grace", allow_zero=True)
    parse_signal(data.get("stop_signal", "TERM"), "stop_signal")
    _restart_policy(_table(data, "restart", _RESTART_KEYS, "[restart] max_error_restarts = 5"))
    prog = _table(data, "progress", _PROGRESS_KEYS, "[progress] pattern = 'step (\\d+)'")
    if prog.get("pattern") is not None:
        compile_progress_pattern(prog["pattern"])
    health_config.parse(data, {})  # {}: the box's own notify variables are its business


def naming_file(e: UsageError, path: Optional[str], flag_command: bool = False) -> UsageError:
    """``e`` naming the job file ``path`` when it is about one of the file's settings: not a
    flag's (``--grace``; ``command`` when ``flag_command``: it came after ``--``), not the
    file's own reading (``JOB.toml``, which names it), not a profile file's."""
    field = e.field
    if path is None or type(e) is not UsageError or field.startswith("-") or field == "JOB.toml":
        return e
    return e if field == "command" and flag_command else e.in_file(path)


def build_spec(
    job_file: Optional[str],
    flags: Overrides,
    *,
    cwd: str,
    environ: Mapping[str, str],
    default_name: str,
    run_dir_of: Any,
) -> JobSpec:
    """Merge a job file and flags into a checked ``JobSpec``; flags win. A job file's bad
    setting names the file and the setting (``naming_file``).

    ``run_dir_of(name)`` gives the run directory, for the default checkpoint dir.
    """
    try:
        return _build_spec(job_file, flags, cwd, environ, default_name, run_dir_of)
    except UsageError as e:
        raise naming_file(e, job_file, bool(flags.command)) from None


def _build_spec(
    job_file: Optional[str],
    flags: Overrides,
    cwd: str,
    environ: Mapping[str, str],
    default_name: str,
    run_dir_of: Any,
) -> JobSpec:
    data: Dict[str, Any] = _load_toml(job_file) if job_file else {}
    _unknown(data, _TOP_KEYS, "")
    base = os.path.dirname(os.path.abspath(job_file)) if job_file else cwd

    # A name given empty is refused, not replaced by the default: `--name ""` from a script
    # whose variable was unset would otherwise start a run under a name nobody chose.
    if flags.name is not None:
        name = check_name(flags.name, "--name")
    else:
        name = check_name(data.get("name", default_name), "name")
    workdir = os.path.abspath(os.path.join(base, str(data.get("workdir", "."))))
    if not os.path.isdir(workdir):
        raise UsageError("workdir", f"{workdir} is not a directory")
    env = _env_table(data)  # the command is checked against the PATH the job will get
    command = _check_command(flags.command or data.get("command"), workdir, {**environ, **env})

    ckpt = _table(data, "checkpoint", _CKPT_KEYS, '[checkpoint] dir = "ckpt"')
    ckpt_dir = flags.ckpt_dir or ckpt.get("dir")
    ckpt_dir = (
        os.path.abspath(os.path.join(cwd if flags.ckpt_dir else workdir, ckpt_dir))
        if ckpt_dir
        else os.path.join(run_dir_of(name), "ckpt")
    )
    checkpoint = _checkpoint_settings(ckpt, ckpt_dir)
    # --output adds to the job file's outputs (both are sealed), it does not replace them.
    merged = check_outputs(data.get("outputs", [])) + check_outputs(flags.outputs or [], "--output")
    store = _store_setting(data, flags)

    # 0 is a real budget: some platforms give no warning at all (SIGKILL at once).
    grace = parse_duration(
        flags.grace if flags.grace is not None else data.get("grace", 30),
        "--grace" if flags.grace is not None else "grace",
        allow_zero=True,
    )
    stop_signal = parse_signal(data.get("stop_signal", "TERM"), "stop_signal")
    r = _table(data, "restart", _RESTART_KEYS, "[restart] max_error_restarts = 5")
    restart = _restart_policy(r)
    prog = _table(data, "progress", _PROGRESS_KEYS, "[progress] pattern = 'step (\\d+)'")
    pattern = prog.get("pattern")
    if pattern is not None:
        compile_progress_pattern(pattern)
    spec = JobSpec(
        name=name,
        command=command,
        workdir=workdir,
        env=env,
        store=store,
        restore_stall=restore_stall(data.get("store")),
        grace=grace,
        stop_signal=stop_signal,
        restart=restart,
        outputs=tuple(dict.fromkeys(merged)),
        progress_pattern=pattern,
        health=health_config.parse(data, environ),
        **checkpoint,
    )
    from onbox.agent.profileuse import apply_profile  # it imports this module

    return apply_profile(spec, data, flags, environ)


def _restart_policy(r: Mapping[str, Any]) -> RestartPolicy:
    d = RestartPolicy()
    kw: Dict[str, Any] = {}
    for key in ("max_error_restarts", "max_preempt_restarts", "max_stuck_restarts"):
        v = r.get(key, getattr(d, key))
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise UsageError(f"restart.{key}", f"{v!r} is not a count >= 0")
        kw[key] = v
    for key in ("start_grace", "backoff_initial", "backoff_max"):
        kw[key] = parse_duration(r.get(key, getattr(d, key)), f"restart.{key}")
    codes = r.get("success_codes", list(d.success_codes))
    if not isinstance(codes, list) or not all(
        isinstance(c, int) and not isinstance(c, bool) and 0 <= c <= 255 for c in codes
    ):
        raise UsageError("restart.success_codes", f"{codes!r} is not a list of exit codes 0-255")
    kw["success_codes"] = tuple(codes)
    return RestartPolicy(**kw)
