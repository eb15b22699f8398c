"""The shape of a platform profile (profiles/*.toml) and its check: what each field is, which are
required, which values are allowed. A bad field raises ``ProfileError`` (a UsageError, exit 2)
naming the file, the field and a fix, before anything uses the profile.

The fields, by table (README, "Platform profiles", shows one profile whole):

- top: ``name`` (the file's stem), ``title``, ``kind``, ``checked`` ("YYYY-MM": the month the
  facts were last checked against the platform's docs), ``hands_on`` (whether anyone ever ran
  rgt's use of them there), ``sources``, ``conveniences``;
- ``[reach]``: ssh flavours, default user, whether ports and IPs change on restart, and what
  identifies the platform (host name globs, marker files on the box, variables of the box's
  init process);
- ``[box]``: the work dir, the Python the platform puts its stack in, a note on CUDA;
- ``[[storage]]``: each tier with its path, whether it survives a stop and a destroy, its size and
  inode cap, whether it is locked to a region, whether it bills while stopped;
- ``[durable]``: where checkpoints must go to outlive the box ("" when that is off the box);
- ``[meter]``: the meter-stop verb, whether it is reversible, the API that performs it, what keeps
  billing, what is irreversible, the console steps where no API exists, and the reversible
  actions the agent may run on its own after a verified DONE (``[[meter.on_done]]``);
- ``[preemption]``: spot, the grace budget, how a notice is seen;
- ``[env]``: the job's environment (a proxy hook to source, variables, a pip index);
- ``[boot]``: whether the platform restarts the box's container on power-on, and the hook that
  brings the agent back;
- ``[[danger]]``: the clocks that destroy data or money (a stopped box released after N days).

Every table may carry its own ``checked`` and ``hands_on``; without them it has the profile's.
"""

from __future__ import annotations

import dataclasses
import posixpath
import re
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from onbox.common.duration import parse_duration
from onbox.common.errors import UsageError

KINDS = (
    "ssh-rental",
    "bare-ssh",
    "cloud-api",
    "cloud-vm",
    "slurm",
    "kubernetes",
    "notebook",
    "workstation",
)
SSH_FLAVOURS = ("direct", "proxied", "none")
METER_APIS = ("none", "runpod", "vastai", "lambda", "paperspace")
NOTICES = ("none", "signal", "aws", "gcp", "azure")
BOOT_HOOKS = ("none", "profile.d", "onstart", "cron")
_MONTH = re.compile(r"20[0-9]{2}-(0[1-9]|1[0-2])\Z")


class ProfileError(UsageError):
    """A profile file that does not fit the schema: which file, which field, what to do."""

    def __init__(self, file: str, field: str, problem: str, remedy: Optional[str] = None) -> None:
        super().__init__(f"{file}: {field}", problem, remedy)
        self.file = file
        self.path = field


@dataclasses.dataclass(frozen=True)
class Stamp:
    """When a table's facts were last checked ("YYYY-MM") and whether anyone tried them."""

    checked: str
    hands_on: bool


@dataclasses.dataclass(frozen=True)
class Reach:
    """How the box is reached and how rgt recognises the platform."""

    ssh: Tuple[str, ...]
    default_user: str
    port_changes_on_restart: bool
    ip_changes_on_restart: bool
    host_patterns: Tuple[str, ...]
    markers: Tuple[str, ...]
    env_markers: Tuple[str, ...]
    note: str
    stamp: Stamp


@dataclasses.dataclass(frozen=True)
class Box:
    """Where work goes on the box and which Python the platform's stack is in."""

    workdir: str
    python: str
    python_note: str
    cuda: str
    stamp: Stamp


@dataclasses.dataclass(frozen=True)
class Storage:
    """One storage tier: what survives which verb, and its caps."""

    name: str
    path: str
    survives_stop: bool
    survives_destroy: bool
    size: str
    inode_cap: Optional[int]  # None: none documented
    region_locked: bool
    bills_stopped: Optional[bool]
    note: str
    stamp: Stamp


@dataclasses.dataclass(frozen=True)
class Durable:
    """The default durable location for checkpoints; ``path`` "" when it is off the box."""

    path: str
    note: str
    stamp: Stamp


@dataclasses.dataclass(frozen=True)
class OnDone:
    """A reversible action the agent may run by itself once DONE.json is verified."""

    name: str
    command: Tuple[str, ...]
    note: str


@dataclasses.dataclass(frozen=True)
class Meter:
    """Stopping the meter: the verb, how (API or console), and what it leaves billing."""

    verb: str
    reversible: bool
    api: str
    keeps_billing: Tuple[str, ...]
    irreversible: Tuple[str, ...]
    console_steps: Tuple[str, ...]
    on_done: Tuple[OnDone, ...]
    stamp: Stamp


@dataclasses.dataclass(frozen=True)
class Preemption:
    """Spot capacity, the grace budget between the stop signal and SIGKILL, the notice."""

    spot: bool
    grace: float
    notice: str
    notice_lead: Optional[float]  # how long before the stop the notice comes, when it does
    note: str
    stamp: Stamp


@dataclasses.dataclass(frozen=True)
class JobEnv:
    """What the job's environment gets from the platform, before its Python starts."""

    proxy_hook: str
    vars: Mapping[str, str]
    pip_index: str
    note: str
    stamp: Stamp


@dataclasses.dataclass(frozen=True)
class Boot:
    """Whether the platform restarts the container on power-on, and the agent's way back."""

    restarts_container: bool
    hook: str
    path: str
    stamp: Stamp


@dataclasses.dataclass(frozen=True)
class Danger:
    """A clock that destroys data or money; ``after`` in seconds when it has a fixed length."""

    name: str
    after: Optional[float]
    what: str
    remedy: str
    stamp: Stamp


@dataclasses.dataclass(frozen=True)
class Profile:
    """One platform, validated. ``file`` is where it was read from (and ``override`` the user's
    file merged over it, if any)."""

    name: str
    title: str
    kind: str
    stamp: Stamp
    sources: Tuple[str, ...]
    conveniences: Tuple[str, ...]
    reach: Reach
    box: Box
    storage: Tuple[Storage, ...]
    durable: Durable
    meter: Meter
    preemption: Preemption
    env: JobEnv
    boot: Boot
    danger: Tuple[Danger, ...]
    file: str
    override: Optional[str] = None

    def default_store(self) -> Optional[str]:
        """The store URL checkpoints go to when the user names none: under the durable path."""
        return f"file://{self.durable.path.rstrip('/')}/rgt" if self.durable.path else None

    def tiers_at(self, path: str) -> Tuple[Storage, ...]:
        """The storage tiers the absolute box path ``path`` lies on: those at the longest tier
        path that holds it. Two tiers may share a path (RunPod's /workspace is the pod's volume
        disk or a Network Volume): either may be the one. Empty when no tier holds it."""
        path = posixpath.normpath(path)
        best: Tuple[Storage, ...] = ()
        depth = -1
        for t in self.storage:
            if not t.path.startswith("/"):
                continue  # not a path on the box
            root = posixpath.normpath(t.path)
            if path == root or path.startswith(root.rstrip("/") + "/"):
                if len(root) > depth:
                    best, depth = (t,), len(root)
                elif len(root) == depth:
                    best += (t,)
        return best

    def job_vars(self) -> Dict[str, str]:
        """The variables the job gets from the profile (the proxy hook's come on the box)."""
        out = dict(self.env.vars)
        if self.env.pip_index:
            out.setdefault("PIP_INDEX_URL", self.env.pip_index)
        return out

    def on_done(self, name: str) -> Optional[OnDone]:
        return next((a for a in self.meter.on_done if a.name == name), None)

    def facts(self) -> List[Tuple[str, Stamp]]:
        """(what, stamp) of each table of facts, for the stale-fact warnings."""
        out = [
            ("reach", self.reach.stamp),
            ("box", self.box.stamp),
            ("durable", self.durable.stamp),
            ("meter", self.meter.stamp),
            ("preemption", self.preemption.stamp),
            ("env", self.env.stamp),
            ("boot", self.boot.stamp),
        ]
        out += [(f"storage {s.name}", s.stamp) for s in self.storage]
        out += [(f"danger {d.name}", d.stamp) for d in self.danger]
        return out


# ---- the check

# field -> (type, required). Types: str, bool, int, month, duration, strs (a list of strings),
# vars (a table of strings), argv (a non-empty list of strings), or a tuple of allowed strings.
Fields = Dict[str, Tuple[Any, bool]]
_STAMP: Fields = {"checked": ("month", False), "hands_on": ("bool", False)}
TOP: Fields = {
    "name": ("str", True),
    "title": ("str", True),
    "kind": (KINDS, True),
    "checked": ("month", True),
    "hands_on": ("bool", True),
    "sources": ("strs", False),
    "conveniences": ("strs", False),
}
TABLES: Dict[str, Fields] = {
    "reach": {
        "ssh": ("strs", True),
        "default_user": ("str", True),
        "port_changes_on_restart": ("bool", True),
        "ip_changes_on_restart": ("bool", True),
        "host_patterns": ("strs", False),
        "markers": ("strs", False),
        "env_markers": ("strs", False),
        "note": ("str", False),
    },
    "box": {
        "workdir": ("str", True),
        "python": ("str", False),
        "python_note": ("str", False),
        "cuda": ("str", False),
    },
    "durable": {"path": ("str", True), "note": ("str", True)},
    "meter": {
        "verb": ("str", True),
        "reversible": ("bool", True),
        "api": (METER_APIS, True),
        "keeps_billing": ("strs", True),
        "irreversible": ("strs", False),
        "console_steps": ("strs", False),
    },
    "preemption": {
        "spot": ("bool", True),
        "grace": ("duration", True),
        "notice": (NOTICES, True),
        "notice_lead": ("duration", False),
        "note": ("str", False),
    },
    "env": {
        "proxy_hook": ("str", False),
        "vars": ("vars", False),
        "pip_index": ("str", False),
        "note": ("str", False),
    },
    "boot": {
        "restarts_container": ("bool", True),
        "hook": (BOOT_HOOKS, True),
        "path": ("str", False),
    },
}
ARRAYS: Dict[str, Fields] = {
    "storage": {
        "name": ("str", True),
        "path": ("str", True),
        "survives_stop": ("bool", True),
        "survives_destroy": ("bool", True),
        "size": ("str", False),
        "inode_cap": ("int", False),
        "region_locked": ("bool", False),
        "bills_stopped": ("bool", False),
        "note": ("str", False),
    },
    "danger": {
        "name": ("str", True),
        "after": ("duration", False),
        "what": ("str", True),
        "remedy": ("str", True),
    },
}
ON_DONE: Fields = {
    "name": ("str", True),
    "command": ("argv", True),
    "reversible": ("bool", True),
    "note": ("str", False),
}
_EXAMPLES = {
    "str": 'a string, e.g. "text"',
    "bool": "true or false",
    "int": "a whole number >= 0",
    "month": 'the month as "YYYY-MM", e.g. "2026-06"',
    "duration": 'seconds or a duration, e.g. 30, "5s", "15d"',
    "strs": 'a list of strings, e.g. ["a", "b"]',
    "vars": 'a table of strings, e.g. { HF_ENDPOINT = "https://hf-mirror.com" }',
    "argv": 'a non-empty list of strings, e.g. ["shutdown", "-h", "now"]',
}


class Checker:
    """Checks one profile document; every error names ``file`` and the field's dotted path."""

    def __init__(self, file: str) -> None:
        self.file = file

    def fail(self, field: str, problem: str, remedy: Optional[str] = None) -> ProfileError:
        return ProfileError(self.file, field, problem, remedy)

    def table(self, doc: Any, fields: Fields, where: str, extra: Sequence[str] = ()) -> None:
        if not isinstance(doc, dict):
            raise self.fail(where or "(file)", "must be a table", f"write [{where}] and its keys")
        allowed = set(fields) | set(extra)
        for key in sorted(doc):
            if key not in allowed:
                raise self.fail(
                    _join(where, key), "unknown field", f"allowed: {', '.join(sorted(allowed))}"
                )
        for key, (kind, required) in fields.items():
            if key not in doc:
                if required:
                    raise self.fail(_join(where, key), "missing", f"add it: {_hint(kind)}")
                continue
            self.value(doc[key], kind, _join(where, key))

    def value(self, v: Any, kind: Any, field: str) -> None:
        ok: bool
        if isinstance(kind, tuple):
            if v not in kind:
                raise self.fail(field, f"{v!r} is not allowed", f"one of: {', '.join(kind)}")
            return
        if kind == "duration":
            try:
                parse_duration(v, field, allow_zero=True)
            except UsageError as e:
                raise self.fail(field, e.problem, _hint(kind)) from None
            return
        if kind == "str":
            ok = isinstance(v, str)
        elif kind == "bool":
            ok = isinstance(v, bool)
        elif kind == "int":
            ok = isinstance(v, int) and not isinstance(v, bool) and v >= 0
        elif kind == "month":
            ok = isinstance(v, str) and bool(_MONTH.match(v))
        elif kind in ("strs", "argv"):
            ok = isinstance(v, list) and all(isinstance(x, str) for x in v)
            ok = ok and (kind == "strs" or (bool(v) and bool(v[0])))
        elif kind == "vars":
            ok = isinstance(v, dict) and all(isinstance(x, str) for x in v.values())
        else:  # pragma: no cover - a schema bug
            raise AssertionError(kind)
        if not ok:
            raise self.fail(field, f"{v!r} is not {_hint(kind)}", f"write {_hint(kind)}")


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _hint(kind: Any) -> str:
    if isinstance(kind, tuple):
        return "one of: " + ", ".join(kind)
    return _EXAMPLES[kind]
