"""What a platform profile changes in a run's ``JobSpec``, and the meter cap and on-done choice.

``rgt-agent start/run --profile NAME`` (or the job file's ``profile = "NAME"``; the flag wins)
loads the profile from the shipped ones and the box's user dir ($RGT_HOME/profiles, or
$RGT_PROFILES_DIR). What the user gave always wins over what the profile says:

- grace: the profile's ``preemption.grace`` unless ``--grace`` or the job file's ``grace``;
- env: the profile's ``job_vars()`` under the job file's ``[env]``;
- store: the profile's ``default_store()`` when neither ``--store`` nor ``store`` names one;
- the proxy hook and the preemption notice come from the profile alone.

The meter cap (``--deadline``, ``--max-cost`` with ``--price``, or the job file's ``[meter]``) is
stored as an absolute time, so a restarted agent keeps it. ``--on-done NAME`` picks one of the
profile's reversible ``[[meter.on_done]]`` actions (onbox/agent/ondone.py runs it).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time
from typing import Any, Dict, Mapping, Optional

from onbox.agent.spec import JobSpec, Overrides
from onbox.common.duration import MAX_DURATION, parse_duration
from onbox.common.errors import HostError, UsageError
from onbox.common.rundir import profiles_dir, rgt_home
from onbox.common.storeurl import parse_store_url
from onbox.profiles import Profile, load, user_dirs

_METER_KEYS = {"deadline", "max_cost", "price_per_hour"}


def load_profile(name: str, environ: Mapping[str, str], field: str = "--profile") -> Profile:
    """The profile ``name`` from the shipped ones and this box's user dir; UsageError (exit 2)
    naming the known profiles when there is none by that name."""
    if not isinstance(name, str) or not name:
        raise UsageError(field, f"{name!r} is not a profile name", "e.g. --profile autodl")
    home = rgt_home(environ)
    return load(name, user_dirs(profiles_dir(home), environ), field)


def _amount(value: Any, field: str) -> float:
    try:
        x = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        x = math.nan
    if math.isnan(x) or math.isinf(x) or x <= 0:
        raise UsageError(field, f"{value!r} is not an amount > 0", "e.g. 20 or 1.85")
    return x


def meter_deadline(
    data: Mapping[str, Any], flags: Overrides, now: Optional[float] = None
) -> Optional[float]:
    """The meter cap as epoch seconds, or None: ``--deadline`` (else ``meter.deadline``) from
    now, and ``--max-cost``/``--price`` (else ``meter.max_cost``/``meter.price_per_hour``)
    as ``amount / price`` hours from now; when both are given, the earlier one."""
    meter = data.get("meter", {})
    if not isinstance(meter, dict):
        raise UsageError("meter", "must be a table", '[meter] deadline = "72h"')
    extra = sorted(set(meter) - _METER_KEYS)
    if extra:
        raise UsageError(
            f"meter.{extra[0]}", "unknown setting", f"valid: {', '.join(sorted(_METER_KEYS))}"
        )
    now = time.time() if now is None else now
    caps = []
    if flags.deadline is not None:
        caps.append(parse_duration(flags.deadline, "--deadline"))
    elif "deadline" in meter:
        caps.append(parse_duration(meter["deadline"], "meter.deadline"))
    cost = (
        (flags.max_cost, "--max-cost")
        if flags.max_cost is not None
        else (meter.get("max_cost"), "meter.max_cost")
    )
    price = (
        (flags.price, "--price")
        if flags.price is not None
        else (meter.get("price_per_hour"), "meter.price_per_hour")
    )
    if (cost[0] is None) != (price[0] is None):
        given, missing = (cost, price) if price[0] is None else (price, cost)
        other = {"--max-cost": "--price", "--price": "--max-cost"}.get(given[1], missing[1])
        raise UsageError(
            given[1],
            f"needs {other} too: a cost cap is the amount divided by the hourly price",
            "e.g. --max-cost 20 --price 1.85",
        )
    if cost[0] is not None:
        hours = _amount(cost[0], cost[1]) / _amount(price[0], price[1])
        caps.append(min(hours * 3600.0, MAX_DURATION))
    return now + min(caps) if caps else None


def _on_done(profile: Optional[Profile], name: Any, field: str) -> Dict[str, Any]:
    """The JobSpec fields of the on-done action ``name`` of ``profile``."""
    if name is None:
        return {}
    if profile is None:
        raise UsageError(field, "needs a platform profile", "add --profile NAME (e.g. autodl)")
    actions = profile.meter.on_done
    if not actions:
        raise UsageError(
            field,
            f"platform {profile.name!r} has no reversible automatic meter-stop the agent may run",
            f"stop the meter yourself ({profile.meter.verb}), or leave out {field}",
        )
    action = profile.on_done(name) if isinstance(name, str) else None
    if action is None:
        raise UsageError(
            field,
            f"{name!r} is not an on-done action of {profile.name!r}",
            f"use one of: {', '.join(a.name for a in actions)}",
        )
    return {"on_done": action.name, "on_done_command": tuple(action.command)}


def apply_profile(
    spec: JobSpec, data: Mapping[str, Any], flags: Overrides, environ: Mapping[str, str]
) -> JobSpec:
    """``spec`` (built from the job file ``data`` and ``flags``) with its profile's values
    where the user gave none, the meter cap and the on-done action."""
    named = flags.profile if flags.profile is not None else data.get("profile")
    field = "--profile" if flags.profile is not None else "profile"
    profile = None if named is None else load_profile(named, environ, field)
    changes: Dict[str, Any] = {"deadline": meter_deadline(data, flags)}
    od_field = "--on-done" if flags.on_done is not None else "on_done"
    changes.update(_on_done(profile, flags.on_done or data.get("on_done"), od_field))
    if profile is not None:
        changes.update(profile_fields(profile, spec.env))
        if flags.grace is None and "grace" not in data:
            changes["grace"] = profile.preemption.grace
        if spec.store is None and profile.durable.path:
            path = _check_durable(profile, environ)
            url = f"file://{path.rstrip('/')}/rgt"
            changes["store"] = parse_store_url(url, f"{profile.name}: durable.path")
    out = dataclasses.replace(spec, **changes)
    if out.on_done and out.store is None:
        raise UsageError(
            od_field,
            "needs a durable store: the meter stops only once DONE.json is verified there",
            f"give --store URL (profile {out.profile!r} has no durable path on the box)",
        )
    return out


def _check_durable(profile: Profile, environ: Mapping[str, str]) -> str:
    """The profile's durable path, its ``$VAR`` and ``~`` expanded from this box's environment
    (Slurm's is ``/scratch/$USER/proj``). It must be there before it is the default store: a
    file store makes its root, and one made on the container's disk because the volume is not
    mounted would die with the box while looking durable."""
    path = _expand(profile.durable.path, environ)
    if "$" in path or not os.path.isabs(path):
        raise HostError(
            f"the {profile.name} profile's durable path {profile.durable.path} names a "
            "variable this box does not set, so it cannot be the default store",
            "give --store URL",
        )
    if not os.path.isdir(path):
        raise HostError(
            f"the {profile.name} profile's durable path {path} is not a directory on this box, "
            "so it cannot be the default store",
            f"mount the durable volume there ({profile.durable.note}), or give --store URL",
        )
    return path


def _expand(path: str, environ: Mapping[str, str]) -> str:
    """``path`` with ``~`` and ``$VAR``/``${VAR}`` from ``environ`` (unset ones left as is)."""
    if path.startswith("~"):
        home = environ.get("HOME") or os.path.expanduser("~")
        path = home + path[1:]
    return re.sub(
        r"\$(\w+|\{\w+\})",
        lambda m: environ.get(m.group(1).strip("{}"), m.group(0)),
        path,
    )


def profile_fields(profile: Profile, user_env: Mapping[str, str]) -> Dict[str, Any]:
    """The fields a profile always sets: its name, the env (the user's values win over the
    profile's), the proxy hook and the preemption notice."""
    env = dict(profile.job_vars())
    env.update(user_env)
    return {
        "profile": profile.name,
        "env": env,
        "proxy_hook": profile.env.proxy_hook,
        "notice": profile.preemption.notice,
    }


def apply_again(spec: JobSpec, flags: Overrides, environ: Mapping[str, str]) -> JobSpec:
    """A run started again with no command: its last spec, with a new meter cap or on-done
    action when the flags give one. Its profile stays the one it was started with."""
    if flags.profile is not None and flags.profile != spec.profile:
        raise UsageError(
            "--profile",
            f"run {spec.name!r} was started with profile {spec.profile!r}",
            "start it again with its job file or command to change the profile",
        )
    changes: Dict[str, Any] = {}
    if flags.deadline is not None or flags.max_cost is not None or flags.price is not None:
        changes["deadline"] = meter_deadline({}, flags)
    if flags.on_done is not None:
        profile = None if spec.profile is None else load_profile(spec.profile, environ)
        changes.update(_on_done(profile, flags.on_done, "--on-done"))
        if spec.store is None:
            raise UsageError(
                "--on-done",
                f"run {spec.name!r} has no store: DONE.json could never be verified",
                "start it again with --store URL",
            )
    return dataclasses.replace(spec, **changes) if changes else spec
