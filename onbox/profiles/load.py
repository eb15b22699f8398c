"""Finding and reading profiles: the shipped ones (package data, onbox/profiles/data, which is
the repository's profiles/), then the user's.

A user's directory (``$RGT_PROFILES_DIR``, or the one each side passes: ``$RGT_HOME/profiles``
on the box, ``$RGT_CONTROLLER_HOME/profiles`` on the laptop) may hold ``NAME.toml`` files: a name
the package ships is overridden field by field (tables merge, lists and values replace), and the
result is checked whole; a new name is a new profile and must be complete. Every error names the
file that set the field (the user's when it set it) and exits 2.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from onbox.common import jobenv
from onbox.common.duration import parse_duration
from onbox.common.errors import UsageError
from onbox.profiles.schema import (
    ARRAYS,
    ON_DONE,
    TABLES,
    TOP,
    Boot,
    Box,
    Checker,
    Danger,
    Durable,
    JobEnv,
    Meter,
    OnDone,
    Preemption,
    Profile,
    ProfileError,
    Reach,
    Stamp,
    Storage,
)

SHIPPED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def _toml(path: str) -> Dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib  # novermin
    else:  # pragma: no cover - the box's older Pythons
        import tomli as tomllib
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise ProfileError(path, "(file)", f"cannot be read: {e.strerror}") from None
    except ValueError as e:  # TOMLDecodeError
        raise ProfileError(path, "(file)", f"is not TOML: {e}", "fix the syntax") from None


def user_dirs(default: Optional[str], environ: Optional[Mapping[str, str]] = None) -> List[str]:
    """The user's profile directories: ``$RGT_PROFILES_DIR`` when set, else ``default``."""
    env = os.environ if environ is None else environ
    d = env.get(jobenv.PROFILES_DIR) or default
    return [d] if d else []


def _files(dirs: Sequence[str]) -> Dict[str, str]:
    out: Dict[str, str] = {}
    for d in dirs:
        try:
            names = sorted(os.listdir(d))
        except FileNotFoundError:
            continue
        except OSError as e:
            raise UsageError(jobenv.PROFILES_DIR, f"{d} cannot be listed: {e.strerror}") from None
        for f in names:
            if f.endswith(".toml") and not f.startswith("."):
                out.setdefault(f[: -len(".toml")], os.path.join(d, f))
    return out


def names(dirs: Sequence[str] = ()) -> List[str]:
    """Every profile's name, shipped and the user's."""
    return sorted(set(_files([SHIPPED_DIR])) | set(_files(dirs)))


def load(name: str, dirs: Sequence[str] = (), field: str = "--profile") -> Profile:
    """The profile ``name``, merged with the user's file of that name, checked."""
    shipped = _files([SHIPPED_DIR]).get(name)
    mine = _files(dirs).get(name)
    if shipped is None and mine is None:
        raise UsageError(
            field, f"{name!r} is not a profile", f"known: {', '.join(names(dirs))} (rgt profiles)"
        )
    if shipped is None:
        assert mine is not None
        return _build(_toml(mine), name, mine, None, {})
    base = _toml(shipped)
    if mine is None:
        return _build(base, name, shipped, None, {})
    over = _toml(mine)
    return _build(_merge(base, over), name, shipped, mine, over)


def load_all(dirs: Sequence[str] = ()) -> List[Profile]:
    """Every profile, checked (the first bad one raises)."""
    return [load(n, dirs) for n in names(dirs)]


def _merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> Dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        b = out.get(k)
        out[k] = _merge(b, v) if isinstance(b, dict) and isinstance(v, dict) else v
    return out


def _set_by(over: Mapping[str, Any], path: str) -> bool:
    """Whether the user's document sets the field at dotted ``path`` (or a table above it)."""
    cur: Any = over
    for part in path.split("."):
        if not isinstance(cur, dict) or part.split("[")[0] not in cur:
            return False
        cur = cur[part.split("[")[0]]
    return True


def _build(
    doc: Dict[str, Any], name: str, file: str, override: Optional[str], over: Mapping[str, Any]
) -> Profile:
    try:
        return _checked(doc, name, file, override)
    except ProfileError as e:
        if override is not None and e.file == file and _set_by(over, e.path):
            raise ProfileError(override, e.path, e.problem, e.remedy) from None
        raise


def _checked(doc: Dict[str, Any], name: str, file: str, override: Optional[str]) -> Profile:
    c = Checker(file)
    c.table(doc, TOP, "", extra=[*TABLES, *ARRAYS])
    if doc["name"] != name:
        raise c.fail("name", f"{doc['name']!r} is not the file's name {name!r}", f'name = "{name}"')
    top = Stamp(doc["checked"], doc["hands_on"])
    t: Dict[str, Dict[str, Any]] = {}
    for key, fields in TABLES.items():
        sub = doc.get(key)
        if sub is None:
            raise c.fail(key, "missing", f"add a [{key}] table")
        extra = ["checked", "hands_on"] + (["on_done"] if key == "meter" else [])
        c.table(sub, fields, key, extra=extra)
        for k in ("checked", "hands_on"):
            if k in sub:
                c.value(sub[k], "month" if k == "checked" else "bool", f"{key}.{k}")
        t[key] = sub
    arrays: Dict[str, List[Dict[str, Any]]] = {}
    for key, fields in ARRAYS.items():
        items = doc.get(key, [])
        if not isinstance(items, list):
            raise c.fail(key, "must be an array of tables", f"write [[{key}]] for each")
        for i, item in enumerate(items):
            c.table(item, fields, f"{key}[{i}]", extra=["checked", "hands_on"])
        arrays[key] = items
    if not arrays["storage"]:
        raise c.fail("storage", "missing", "add at least one [[storage]] tier")
    on_done = t["meter"].get("on_done", [])
    if not isinstance(on_done, list):
        raise c.fail("meter.on_done", "must be an array of tables", "write [[meter.on_done]]")
    for i, item in enumerate(on_done):
        where = f"meter.on_done[{i}]"
        c.table(item, ON_DONE, where)
        if not item["reversible"]:
            raise c.fail(
                f"{where}.reversible",
                "an irreversible action is never run automatically",
                "remove it: irreversible verbs stay in meter.irreversible, for a person to do",
            )
    m = t["meter"]
    if m["api"] == "none" and m["verb"] not in ("none", "n/a") and not m.get("console_steps"):
        raise c.fail(
            "meter.console_steps", "missing", 'with api = "none", list the console\'s exact steps'
        )
    return _profile(doc, t, arrays, on_done, top, file, override)


def _stamp(d: Mapping[str, Any], top: Stamp) -> Stamp:
    return Stamp(d.get("checked", top.checked), d.get("hands_on", top.hands_on))


def _strs(d: Mapping[str, Any], key: str) -> Tuple[str, ...]:
    return tuple(d.get(key, ()))


def _profile(
    doc: Mapping[str, Any],
    t: Mapping[str, Mapping[str, Any]],
    arrays: Mapping[str, List[Dict[str, Any]]],
    on_done: List[Dict[str, Any]],
    top: Stamp,
    file: str,
    override: Optional[str],
) -> Profile:
    r, b, du, m, p, e, bo = (t[k] for k in TABLES)
    return Profile(
        name=doc["name"],
        title=doc["title"],
        kind=doc["kind"],
        stamp=top,
        sources=_strs(doc, "sources"),
        conveniences=_strs(doc, "conveniences"),
        reach=Reach(
            tuple(r["ssh"]),
            r["default_user"],
            r["port_changes_on_restart"],
            r["ip_changes_on_restart"],
            _strs(r, "host_patterns"),
            _strs(r, "markers"),
            _strs(r, "env_markers"),
            r.get("note", ""),
            _stamp(r, top),
        ),
        box=Box(
            b["workdir"],
            b.get("python", ""),
            b.get("python_note", ""),
            b.get("cuda", ""),
            _stamp(b, top),
        ),  # fmt: skip
        storage=tuple(_storage(x, top) for x in arrays["storage"]),
        durable=Durable(du["path"], du["note"], _stamp(du, top)),
        meter=_meter(m, on_done, top),
        preemption=Preemption(
            p["spot"],
            parse_duration(p["grace"], "preemption.grace", allow_zero=True),
            p["notice"],
            parse_duration(p["notice_lead"], "preemption.notice_lead", allow_zero=True)
            if "notice_lead" in p
            else None,
            p.get("note", ""),
            _stamp(p, top),
        ),
        env=JobEnv(
            e.get("proxy_hook", ""),
            dict(e.get("vars", {})),
            e.get("pip_index", ""),
            e.get("note", ""),
            _stamp(e, top),
        ),  # fmt: skip
        boot=Boot(bo["restarts_container"], bo["hook"], bo.get("path", ""), _stamp(bo, top)),
        danger=tuple(_danger(d, top) for d in arrays["danger"]),
        file=file,
        override=override,
    )


def _storage(s: Mapping[str, Any], top: Stamp) -> Storage:
    return Storage(
        s["name"],
        s["path"],
        s["survives_stop"],
        s["survives_destroy"],
        s.get("size", ""),
        s.get("inode_cap"),
        s.get("region_locked", False),
        s.get("bills_stopped"),
        s.get("note", ""),
        _stamp(s, top),
    )


def _meter(m: Mapping[str, Any], on_done: List[Dict[str, Any]], top: Stamp) -> Meter:
    return Meter(
        m["verb"],
        m["reversible"],
        m["api"],
        _strs(m, "keeps_billing"),
        _strs(m, "irreversible"),
        _strs(m, "console_steps"),
        tuple(OnDone(a["name"], tuple(a["command"]), a.get("note", "")) for a in on_done),
        _stamp(m, top),
    )


def _danger(d: Mapping[str, Any], top: Stamp) -> Danger:
    after = parse_duration(d["after"], "danger.after", allow_zero=True) if "after" in d else None
    return Danger(d["name"], after, d["what"], d["remedy"], _stamp(d, top))
