"""What ``rgt profiles`` shows: the table of every platform profile, one profile's facts in full,
their JSON, and the README's table of supported platforms (generated from the profiles, so the
README cannot drift from them).

The laptop's own profiles live in ``$RGT_CONTROLLER_HOME/profiles`` (``$RGT_PROFILES_DIR``
overrides it); the box's in ``$RGT_HOME/profiles`` (onbox.profiles.load).

    python -m controller.profiles --readme     rewrites README.md's table in place
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import sys
import unicodedata
from typing import Any, Dict, List, Optional, Sequence

from controller.remote import controller_home
from onbox.common.rundir import profiles_dir
from onbox.profiles import load_all as load_every
from onbox.profiles import user_dirs as dirs_of
from onbox.profiles.load import load as load_one
from onbox.profiles.schema import Danger, Profile, Stamp, Storage

README_BEGIN = "<!-- platforms:begin -->"
README_END = "<!-- platforms:end -->"
STALE_MONTHS = 6  # a fact checked longer ago than this is flagged (as the fact base's own check)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def user_dirs(home: Optional[str] = None) -> List[str]:
    """The laptop's user profile directories: $RGT_PROFILES_DIR, else the controller home's
    (``home``, default $RGT_CONTROLLER_HOME) profiles/."""
    return dirs_of(profiles_dir(home or controller_home()))


def load_all() -> List[Profile]:
    """Every profile the laptop knows, shipped and the user's, checked."""
    return load_every(user_dirs())


def load(name: str) -> Profile:
    """One profile, merged with the user's override of it, checked."""
    return load_one(name, user_dirs(), field="PROFILE")


# ---- small renderings of one value


def seconds(s: Optional[float]) -> str:
    """A duration as the profiles write it: 0s, 30s, 90m, 24h, 15d."""
    if s is None:
        return "-"
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= 2 * n and s % n == 0:
            return f"{int(s // n)}{unit}"
    return f"{s:g}s"


def grace(s: float) -> str:
    """A grace window in seconds, as the fact base gives them (120s, 30s, 0s)."""
    return f"{s:g}s"


def months_old(stamp: Stamp, today: datetime.date) -> int:
    """How many whole months ago ``stamp.checked`` ("YYYY-MM") was, as of ``today``."""
    year, month = (int(x) for x in stamp.checked.split("-"))
    return (today.year - year) * 12 + today.month - month


def flags(stamp: Stamp, today: datetime.date) -> List[str]:
    """Why a fact deserves a second look: never tried hands-on, or checked too long ago."""
    out = [] if stamp.hands_on else ["not tested hands-on"]
    age = months_old(stamp, today)
    if age > STALE_MONTHS:
        out.append(f"checked {age} months ago")
    return out


def width(text: str) -> int:
    """Terminal columns of ``text``: CJK (wide) characters take two."""
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def _yes(b: Optional[bool]) -> str:
    return "?" if b is None else ("yes" if b else "no")


# ---- the table and one profile


def row(p: Profile) -> Dict[str, Any]:
    """The summary of one profile, as ``rgt profiles --json`` gives it."""
    return {
        "name": p.name,
        "title": p.title,
        "kind": p.kind,
        "meter_verb": p.meter.verb,
        "reversible": p.meter.reversible,
        "grace_s": p.preemption.grace,
        "durable_path": p.durable.path,
        "checked": p.stamp.checked,
        "hands_on": p.stamp.hands_on,
        "file": p.file,
        "override": p.override,
    }


def table(profiles: Sequence[Profile], today: Optional[datetime.date] = None) -> str:
    """The ``rgt profiles`` table: one line per profile, columns aligned; a month older than
    STALE_MONTHS is marked "(old)"."""
    today = today or datetime.date.today()
    head = ["NAME", "TITLE", "KIND", "METER STOP", "REVERSIBLE", "GRACE", "DURABLE", "CHECKED"]
    head.append("HANDS-ON")
    lines = [head]
    for p in profiles:
        lines.append(
            [
                p.name + (" *" if p.override else ""),
                p.title,
                p.kind,
                p.meter.verb,
                _yes(p.meter.reversible),
                grace(p.preemption.grace),
                p.durable.path or "(off the box)",
                p.stamp.checked + (" (old)" if months_old(p.stamp, today) > STALE_MONTHS else ""),
                _yes(p.stamp.hands_on),
            ]
        )
    widths = [max(width(r[i]) for r in lines) for i in range(len(head))]
    out = ["  ".join(c + " " * (w - width(c)) for c, w in zip(r, widths)).rstrip() for r in lines]
    if any(p.override for p in profiles):
        out.append("* overridden by a file of yours (rgt profiles show NAME says which)")
    return "\n".join(out)


def to_json(p: Profile) -> Dict[str, Any]:
    """Every fact of one profile, as ``rgt profiles show P --json`` gives it."""
    doc = dataclasses.asdict(p)
    doc["env"]["vars"] = dict(p.env.vars)
    return doc


def _storage_lines(tiers: Sequence[Storage]) -> List[str]:
    out = ["storage (survives stop / destroy):"]
    for s in tiers:
        extra = [s.size] if s.size else []
        if s.inode_cap is not None:
            extra.append(f"inode cap {s.inode_cap}")
        if s.region_locked:
            extra.append("region-locked")
        if s.bills_stopped is not None:
            extra.append("bills while stopped" if s.bills_stopped else "free while stopped")
        where = s.path or "(mount chosen at create)"
        out.append(
            f"  {s.name:<16} {where:<28} stop {_yes(s.survives_stop):<3} "
            f"destroy {_yes(s.survives_destroy):<3} {'; '.join(extra)}".rstrip()
        )
        if s.note:
            out.append(f"  {'':<16} {s.note}")
    return out


def _danger_lines(dangers: Sequence[Danger]) -> List[str]:
    out = ["danger clocks:" if dangers else "danger clocks: none known"]
    for d in dangers:
        after = f" after {seconds(d.after)}" if d.after is not None else ""
        out += [f"  {d.name}{after}: {d.what}", f"    what to do: {d.remedy}"]
    return out


def _items(title: str, items: Sequence[str]) -> List[str]:
    return [f"{title}:", *[f"  - {x}" for x in items]] if items else []


def describe(p: Profile, today: Optional[datetime.date] = None) -> str:
    """Every fact of one profile, for a person: reach, storage, billing, clocks, env, origin."""
    today = today or datetime.date.today()
    m, pr, e = p.meter, p.preemption, p.env
    out = [f"{p.name}: {p.title} ({p.kind})", f"loaded from {p.file}"]
    if p.override:
        out.append(f"overridden by {p.override}")
    stale = flags(p.stamp, today)
    out.append(f"checked {p.stamp.checked}" + (f" ({'; '.join(stale)})" if stale else ""))
    ssh = ", ".join(p.reach.ssh)
    out += ["", f"reach: ssh {ssh}, user {p.reach.default_user or '(yours)'}"]
    out.append(
        f"  port changes on restart: {_yes(p.reach.port_changes_on_restart)}; "
        f"IP changes on restart: {_yes(p.reach.ip_changes_on_restart)}"
    )
    if p.reach.note:
        out.append(f"  {p.reach.note}")
    out.append(f"workdir: {p.box.workdir}" + (f"; python {p.box.python}" if p.box.python else ""))
    if p.box.python_note:
        out.append(f"  {p.box.python_note}")
    out += [""] + _storage_lines(p.storage)
    out.append(f"durable: {p.durable.path or '(off the box: give --store)'}")
    out.append(f"  {p.durable.note}")
    api = "no API: by hand" if m.api == "none" else f"API {m.api}"
    out += ["", f"meter stop: {m.verb} (reversible: {_yes(m.reversible)}; {api})"]
    out += _items("keeps billing", m.keeps_billing) + _items("irreversible", m.irreversible)
    out += _items("steps", m.console_steps)
    out += _items(
        "after a verified DONE the agent may",
        [f"{a.name}: {' '.join(a.command)}" for a in m.on_done],
    )
    lead = f", notice {seconds(pr.notice_lead)} ahead" if pr.notice_lead is not None else ""
    out += [
        "",
        f"preemption: spot {_yes(pr.spot)}, grace {grace(pr.grace)}, notice {pr.notice}{lead}",
    ]
    if pr.note:
        out.append(f"  {pr.note}")
    out += [""] + _danger_lines(p.danger)
    env = [f"proxy hook: {e.proxy_hook}"] if e.proxy_hook else []
    env += [f"{k}={v}" for k, v in sorted(p.job_vars().items())]
    out += [""] + _items("job env", env + ([e.note] if e.note else []))
    out.append(f"boot: hook {p.boot.hook}" + (f" ({p.boot.path})" if p.boot.path else ""))
    out.append(
        f"  the platform restarts the container on power-on: {_yes(p.boot.restarts_container)}"
    )
    out += _items("conveniences", p.conveniences) + _items("sources", p.sources)
    old = [
        f"{what} ({'; '.join(f)})"
        for what, s in p.facts()
        if (f := flags(s, today)) and s != p.stamp
    ]
    out += _items("facts stamped apart from the profile", old)
    return "\n".join(out)


# ---- the README's table


def _survival(p: Profile) -> str:
    def one(s: Storage) -> str:
        mark = ("S" if s.survives_stop else "-") + ("D" if s.survives_destroy else "-")
        return f"`{s.path or s.name}` {mark}"

    return "<br>".join(one(s) for s in p.storage)


def _clocks(p: Profile) -> str:
    return (
        "<br>".join(f"{d.name} {seconds(d.after)}" if d.after else d.name for d in p.danger) or "-"
    )


def readme_table(profiles: Sequence[Profile]) -> str:
    """The markdown table of supported platforms (README.md, between the marker lines)."""
    out = [
        "| platform | storage: survives Stop / Destroy | durable path | meter stop | grace | "
        "notice | danger clocks |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in profiles:
        name = f"`{p.name}`" + ("" if p.stamp.hands_on else " \\*")
        verb = p.meter.verb
        if verb not in ("none", "n/a"):
            verb += " (reversible)" if p.meter.reversible else " (irreversible)"
        lead = f" ({seconds(p.preemption.notice_lead)} ahead)" if p.preemption.notice_lead else ""
        cells = [
            name,
            _survival(p),
            f"`{p.durable.path}`" if p.durable.path else "none: give `--store`",
            verb,
            grace(p.preemption.grace),
            p.preemption.notice + lead,
            _clocks(p),
        ]
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    out.append("")
    out.append(
        "`S`/`D`: the tier survives a stop / a destroy (`-`: it does not). \\*: researched from "
        "the vendor's docs, never tested hands-on."
    )
    return "\n".join(out)


def splice(readme: str, body: str) -> str:
    """``readme`` with the text between the marker lines replaced by ``body``."""
    try:
        head, rest = readme.split(README_BEGIN + "\n", 1)
        _, tail = rest.split(README_END, 1)
    except ValueError:
        raise ValueError(f"README.md lacks the lines {README_BEGIN} and {README_END}") from None
    return f"{head}{README_BEGIN}\n{body}\n{README_END}{tail}"


def shipped() -> List[Profile]:
    """The shipped profiles only (no user directory): what the README documents."""
    return load_every(())


def write_readme(path: str = os.path.join(ROOT, "README.md")) -> bool:
    """Regenerate README.md's platform table; whether it changed."""
    with open(path, encoding="utf-8") as f:
        old = f.read()
    new = splice(old, readme_table(shipped()))
    if new != old:
        with open(path, "w", encoding="utf-8") as f:
            f.write(new)
    return new != old


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m controller.profiles --readme``: rewrite README.md's table."""
    args = sys.argv[1:] if argv is None else argv
    if args != ["--readme"]:
        print("usage: python -m controller.profiles --readme", file=sys.stderr)
        return 2
    changed = write_readme()
    print("README.md: platform table " + ("rewritten" if changed else "already current"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
