"""The goodput table in bench/goodput/README.md, between its markers, from results.json.

One row per point (mean time between preemptions, grace, seed), one column per setup: the
goodput as a fraction of the preemption-free run, then the issue's targets judged on that row
(rgt >= 0.9 at a 10-min mean with 5 s grace; rgt above both hand-made setups; auto at least
the best fixed interval), then a table of badput by cause, in % of the budget.
"""

from __future__ import annotations

import os
import re
from typing import Any, Dict, List

BEGIN, END = "<!-- goodput:begin -->", "<!-- goodput:end -->"


def _rgt(rows: Dict[str, Dict[str, Any]]) -> Dict[str, float]:
    return {k: v["goodput"] for k, v in rows.items() if k.startswith("rgt") and "goodput" in v}


def _targets(p: Dict[str, Any], rows: Dict[str, Dict[str, Any]]) -> str:
    rgt = _rgt(rows)
    if not rgt:
        return "-"
    homemade = [rows[k]["goodput"] for k in ("nohup", "cron+rsync") if "goodput" in rows.get(k, {})]
    out = []
    if homemade:
        ok = min(rgt.values()) > max(homemade)
        out.append(f"rgt > hand-made: {'pass' if ok else 'FAIL'}")
    fixed = [v for k, v in rgt.items() if k.startswith("rgt fixed")]
    if "rgt auto" in rgt and fixed:
        out.append(f"auto >= best fixed: {'pass' if rgt['rgt auto'] >= max(fixed) else 'FAIL'}")
    if p["mtbp_min"] == 10 and p["grace_s"] == 5:
        ok = max(rgt.values()) >= 0.9
        out.append(f"rgt >= 0.9: {'pass' if ok else 'FAIL'}")
    return "; ".join(out) or "-"


def _named(p: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """The point's rows by setup name, a fixed interval named in trace minutes (the setups
    name it in real seconds, which differ with k: 1 min is "6s" at k = 10, "30s" at k = 2)."""
    out: Dict[str, Dict[str, Any]] = {}
    for r in p["rows"]:
        name = r["setup"]
        m = re.fullmatch(r"rgt fixed ([0-9.]+)s", name)
        if m:
            name = f"rgt fixed {float(m.group(1)) * float(p.get('k', 10)) / 60:g} min"
        out[name] = r
    return out


def table(points: List[Dict[str, Any]]) -> str:
    names: List[str] = []
    for p in points:
        for n in _named(p):
            if n not in names:
                names.append(n)
    head = ["MTBP (min)", "grace (s)", "k", "seed", "preemptions", "load", *names, "targets"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * (len(head) - 1) + "---|"]
    detail = [
        "| MTBP, grace, k | setup | " + " | ".join(_CAUSES) + " |",
        "|---|---|" + "---:|" * 6,
    ]
    for p in points:
        rows = _named(p)
        cells = []
        for n in names:
            r = rows.get(n)
            cells.append("-" if r is None else ("error" if "error" in r else f"{r['goodput']:.3f}"))
        lines.append(
            f"| {p['mtbp_min']:g} | {p['grace_s']:g} | {p.get('k', 10):g} | {p['seed']} | "
            f"{p['preemptions']} | {p.get('load5', '?')} | "
            + " | ".join(cells)
            + f" | {_targets(p, rows)} |"
        )
        for n in names:
            r = rows.get(n)
            if r is None or "badput_s" not in r:
                continue
            pct = [f"{100 * r['badput_s'][c] / p['budget_s']:.1f}" for c in _CAUSES]
            detail.append(
                f"| {p['mtbp_min']:g} min, {p['grace_s']:g} s, k = {p.get('k', 10):g} | {n} | "
                + " | ".join(pct)
                + " |"
            )
    errors = [
        f"- {p['mtbp_min']:g} min, {p['grace_s']:g} s, {r['setup']}: {r['error']}"
        for p in points
        for r in p["rows"]
        if "error" in r
    ]
    first = points[0] if points else {}
    meta = (
        "Compression k: per point (the k column); "
        f"job step {first.get('step_time', '?')} s; "
        f"hand-made checkpoint every {first.get('own_min', '?'):g} min, rsync loop every "
        f"{first.get('cron_min', '?'):g} min; provisioning delay {first.get('delay_min', '?'):g} "
        f"min; stall floor {first.get('floor_s', '?'):g} s (trace minutes unless marked s). "
        f"Measured {', '.join(sorted({p['measured'] for p in points}))}; load: the machine's "
        "5-minute load average at the end of the point (2 cores; other work included)."
    )
    out = [
        meta,
        "",
        "Goodput, as a fraction of the preemption-free run of the same length:",
        "",
        *lines,
        "",
        "Badput by cause, % of the budget:",
        "",
        *detail,
    ]
    if errors:
        out += ["", "Errors:", "", *errors]
    return "\n".join(out)


_CAUSES = ("down", "restart", "restore", "lost work", "checkpoints", "other")


def write_readme(points: List[Dict[str, Any]], path: str) -> None:
    with open(path) as f:
        text = f.read()
    block = f"{BEGIN}\n{table(points)}\n{END}"
    if BEGIN in text and END in text:
        text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
