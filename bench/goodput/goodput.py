"""Goodput under preemption: the same job and the same preemption trace, four setups side by side.

    nice -n 10 .venv/bin/python bench/goodput/goodput.py [--mtbp 2,10] [--grace 0,5] [--seed 1]
        [--k 10] [--trace FILE ...] [--setups nohup,cron,fixed,auto] [--keep DIR] [--json F]
        [--no-readme] [--next-when-gone]

For each point (a trace: mean time between preemptions, seed; and a grace), the four setups of
bench/goodput/gp_setups.py and a preemption-free run of the same job start together, each on its
own boxes, and the trace preempts all of them at the same instants: SIGTERM, the grace, SIGKILL
of every process of the box by PID, and after the provisioning delay a fresh box (empty
directories, a new start). At the end of the budget everything is killed and each setup's
output is replayed (gp_account.py): the steps that counted, as a fraction of what the
preemption-free run trained in the same wall-clock time, and the badput by cause.

Time compression: every duration of the trace (uptimes, provisioning delay, budget) and of the
setups' checkpoint periods is divided by ``--k``; the real costs (process start, torch's import,
the agent, sealing, restoring, the grace) are not, which is pessimistic for every setup alike.
``--next-when-gone`` (with ``--no-readme``: a test's shortcut, its points compare with no other)
brings the next box up the provisioning delay after the old box's last process is gone, not after
the whole grace, and counts as down time what each setup's boxes were actually down.
Results accumulate in bench/goodput/results.json (one entry per point and setup, replaced
when run again) and the table between the ``goodput`` markers of bench/goodput/README.md is
written from all of them.
"""

from __future__ import annotations

import argparse
import datetime
import fcntl
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Tuple

import gp_account
import gp_setups
import gp_trace
from gp_report import write_readme

HERE = os.path.dirname(os.path.abspath(__file__))
STOP = threading.Event()  # set when the harness is stopped: no thread starts another box
RESULTS = os.path.join(HERE, "results.json")
BUDGET_MIN = {2.0: 20.0, 10.0: 60.0, 60.0: 240.0}  # trace minutes of wall clock per mean


def _setups(args: argparse.Namespace, grace: float, root: str) -> List[gp_setups.Setup]:
    k, steps, st = args.k, args.steps, args.step_time
    own, cron = args.own_min * 60 / k, args.cron_min * 60 / k
    out: List[gp_setups.Setup] = [gp_setups.Reference(os.path.join(root, "ref"), steps, st, 0.0)]
    for name in args.setups.split(","):
        durable = os.path.join(root, name, "durable")
        if name == "nohup":
            out.append(gp_setups.Nohup(durable, steps, st, own))
        elif name == "cron":
            out.append(gp_setups.Cron(durable, steps, st, own, cron))
        elif name == "fixed":
            for m in args.fixed_min:
                d = os.path.join(root, f"fixed{m:g}", "durable")
                out.append(gp_setups.Rgt(d, steps, st, m * 60 / k, grace, args.floor))
        elif name == "auto":
            out.append(gp_setups.Rgt(durable, steps, st, 0.0, grace, args.floor))
        else:
            raise SystemExit(f"unknown setup {name!r}")
    return out


def _output(setup: gp_setups.Setup, box: gp_setups.Box) -> str:
    text = ""
    for path in setup.outputs(box):
        try:
            with open(path, errors="replace") as f:
                text += f.read()
        except OSError:
            pass
    return text


def _timeline(
    setup: gp_setups.Setup,
    sched: List[Tuple[float, float]],
    t0: float,
    grace: float,
    root: str,
    boxes: List[Tuple[float, float, float, str]],
    until_done: bool = False,
    when_gone: bool = False,
) -> None:
    """One setup through the trace: a box per uptime, preempted at its end (``until_done``:
    the last box ends early once its job printed its final hashes; ``when_gone``: the rest of
    a grace the old box did not use is not waited, every later instant comes that much
    earlier)."""
    slug = setup.name.replace(" ", "-").replace("+", "-")
    for i, (up, end) in enumerate(sched):
        if STOP.wait(max(0.0, t0 + up - time.monotonic())):
            return  # the harness was stopped: no new box
        box = gp_setups.Box(os.path.join(root, slug, f"box{i}"), f"{os.getpid()}-{slug}-{i}")
        box.up_at = time.time()
        try:
            setup.start(box)
        except Exception as e:  # the box is lost like any other; the report says why
            print(f"{setup.name} box {i}: start failed: {e}", file=sys.stderr)
        last = i == len(sched) - 1
        while time.monotonic() < t0 + end and not STOP.is_set():
            if last and until_done and "rng sha256" in _output(setup, box):
                break
            time.sleep(min(0.2, max(0.0, t0 + end - time.monotonic())))
        preempted = time.time()  # the box's work ends here; the grace counts as down time
        box.preempt(grace if not last else 0.0)
        boxes.append((box.up_at, preempted, box.restore_s, _output(setup, box)))
        if when_gone and not last:
            t0 -= max(0.0, t0 + end + grace - time.monotonic())


def run_point(
    args: argparse.Namespace, trace: gp_trace.Trace, grace: float, root: str
) -> Dict[str, Any]:
    """Every setup through one trace at one grace, at the same time; the point's results."""
    sched = trace.schedule(args.k, grace)
    budget = trace.budget_min * 60 / args.k
    setups = _setups(args, grace, root)
    records: Dict[str, List[Tuple[float, float, float, str]]] = {s.name: [] for s in setups}
    t0 = time.monotonic() + 1.0
    threads = []
    for s in setups:
        sch = [(0.0, budget)] if isinstance(s, gp_setups.Reference) else sched
        th = threading.Thread(
            target=_timeline,
            args=(s, sch, t0, grace, root, records[s.name], args.until_done, args.next_when_gone),
            daemon=True,  # a stopped harness does not wait for them (main sweeps their boxes)
        )
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    load = os.getloadavg()[1]  # the machine's 5-minute load at the end: others' work included
    down = sum(b_up - a_end for (_, a_end), (b_up, _) in zip(sched, sched[1:]))
    ref = gp_account.account("ref", records[setups[0].name], 0.0, args.step_time)
    rows: List[Dict[str, Any]] = []
    for s in setups[1:]:
        if args.next_when_gone:  # each setup's boxes were down as long as they were
            recs = records[s.name]
            down = sum(b[0] - a[1] for a, b in zip(recs, recs[1:]))
        try:
            r = gp_account.account(s.name, records[s.name], down, args.step_time)
        except gp_account.Redone as e:
            rows.append({"setup": s.name, "error": f"a counted step was redone: {e}"})
            continue
        rows.append(
            {
                "setup": s.name,
                "goodput": round(r.goodput(ref.counted), 4),
                "counted": r.counted,
                "trained": r.trained,
                "boxes": r.boxes,
                "badput_s": {k: round(v, 2) for k, v in r.causes(budget, ref.counted).items()},
            }
        )
    return {
        "mtbp_min": trace.mtbp_min,
        "seed": trace.seed,
        "grace_s": grace,
        "k": args.k,
        "budget_min": trace.budget_min,
        "delay_min": trace.delay_min,
        "preemptions": len(sched) - 1,
        "budget_s": budget,
        "ref_steps": ref.counted,
        "step_time": args.step_time,
        "own_min": args.own_min,
        "cron_min": args.cron_min,
        "floor_s": args.floor,
        "load5": round(load, 1),
        "measured": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "rows": rows,
    }


def _traces(args: argparse.Namespace) -> List[gp_trace.Trace]:
    if args.trace:
        return [gp_trace.load(p) for p in args.trace]
    out = []
    for m in (float(x) for x in args.mtbp.split(",")):
        budget = args.budget_min or BUDGET_MIN.get(m, 6 * m)
        trace = gp_trace.make(m, args.seed, budget, args.delay_min)
        path = os.path.join(HERE, "traces", f"mtbp{m:g}-seed{args.seed}.json")
        if not args.no_readme:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            gp_trace.save(trace, path)
        out.append(trace)
    return out


def _store(points: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Merge ``points`` into results.json (same trace, grace and k: replaced)."""
    try:
        with open(RESULTS) as f:
            old = json.load(f)
    except (OSError, ValueError):
        old = []
    key = ("mtbp_min", "seed", "grace_s", "k")
    new = {tuple(p[k] for k in key) for p in points}
    merged = [p for p in old if tuple(p[k] for k in key) not in new] + points
    merged.sort(key=lambda p: tuple(p[k] for k in key))
    tmp = RESULTS + ".tmp"
    with open(tmp, "w") as f:
        json.dump(merged, f, indent=1)
        f.write("\n")
    os.replace(tmp, RESULTS)
    return merged


def compile_rgt() -> None:
    """Compile rgt's modules, as pip does when it installs the wheel. Run from a checkout
    with PYTHONDONTWRITEBYTECODE (or a fresh clone), every agent, shim and CLI of every
    restart compiled its modules again: ~0.15 s of CPU per start that no installed rgt pays,
    counted against rgt's restarts."""
    import compileall

    import onbox

    compileall.compile_dir(os.path.dirname(os.path.abspath(onbox.__file__)), quiet=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mtbp", default="2,10", help="means between preemptions, trace minutes")
    ap.add_argument("--grace", default="0,5", help="seconds between SIGTERM and SIGKILL")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--trace", action="append", help="replay this trace file (repeatable)")
    ap.add_argument("--budget-min", type=float, default=0.0, help="0: per mean (BUDGET_MIN)")
    ap.add_argument("--delay-min", type=float, default=0.1, help="provisioning delay")
    ap.add_argument("--k", type=float, default=10.0, help="time compression factor")
    ap.add_argument("--step-time", type=float, default=0.1, help="the job's seconds per step")
    ap.add_argument("--own-min", type=float, default=5.0, help="hand-made checkpoint period")
    ap.add_argument("--cron-min", type=float, default=1.0, help="the rsync loop's period")
    ap.add_argument(
        "--fixed-min",
        type=lambda s: [float(x) for x in s.split(",")],
        default=[1.0, 5.0],
        help="rgt's fixed intervals (trace minutes)",
    )
    ap.add_argument("--floor", type=float, default=5.0, help="the job's health.stall.floor (s)")
    ap.add_argument("--setups", default="nohup,cron,fixed,auto")
    ap.add_argument("--steps", type=int, default=10**7, help="the job's total steps")
    ap.add_argument("--until-done", action="store_true", help="end once every job finished")
    ap.add_argument("--keep", help="keep the boxes' directories here")
    ap.add_argument("--json", help="also write this point's results here")
    ap.add_argument("--no-readme", action="store_true", help="touch neither results nor README")
    ap.add_argument(
        "--next-when-gone",
        action="store_true",
        help="the next box once the old one is gone, not after the whole grace (--no-readme)",
    )
    args = ap.parse_args()
    if args.next_when_gone and not args.no_readme:
        ap.error("--next-when-gone makes points that compare with no other: add --no-readme")
    # SIGTERM ends the harness as Ctrl-C does: through the finally below, which kills by PID
    # every process its boxes left, so a stopped benchmark leaves no job training.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    compile_rgt()
    root = args.keep or tempfile.mkdtemp(prefix="rgt-goodput-")
    points = []
    started = time.monotonic()
    try:
        for trace in _traces(args):
            for grace in (float(g) for g in args.grace.split(",")):
                sub = os.path.join(root, f"mtbp{trace.mtbp_min:g}-s{trace.seed}-g{grace:g}")
                point = run_point(args, trace, grace, sub)
                print(json.dumps(point), flush=True)
                points.append(point)
    finally:
        STOP.set()
        gp_setups.sweep(root, f"{os.getpid()}-")
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(points, f, indent=1)
    if not args.no_readme:
        # Locked: points run side by side (separate processes) finish in any order.
        with open(RESULTS + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            write_readme(_store(points), os.path.join(HERE, "README.md"))
    print(f"took {time.monotonic() - started:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
