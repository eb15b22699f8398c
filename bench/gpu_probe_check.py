"""The GPU probe (onbox/health/gpu.py) against a real GPU and the real NVML: the one short check
for a machine with a CUDA GPU (the test suite sees the GPU only through a fake NVML).

    python3 bench/gpu_probe_check.py [--mib 1024] [--readme]

1. One raw reading of the GPU worker (onbox/health/gpuworker.py): backend, devices, clocks,
   throttle reasons, ECC, the recovery-action field, processes.
2. The probe's baseline reading, then a real PyTorch process allocating ``--mib`` MiB on cuda:0
   and sleeping, started with an attempt tag of run "gpucheck" (RGT_ATTEMPT_TAG): whether the
   probe sees it holding memory, and matches it by its tag as the current attempt (inside a
   container NVML may name host PIDs: then it is an "unknown holder").
3. The same holder read as a stale process of an earlier attempt: the probe kills it (the
   ``gpu_reaped`` event), and the start gate (``may_start``) opens once the memory is released
   (seconds measured).

Prints one JSON document; with ``--readme`` also writes its section of bench/README.md (between
the ``gpu_probe_check`` markers). Without a GPU it says so and exits with status 2; otherwise 0,
whatever it saw (a report, not a test). Bounded: about a minute, two at most.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (ROOT, HERE):  # onbox from this checkout; benchlib beside this script
    if p not in sys.path:
        sys.path.insert(0, p)

import benchlib  # noqa: E402

from onbox.health.config import GpuConfig  # noqa: E402
from onbox.health.gpu import GpuProbe, WorkerClient, worker_argv, worker_environ  # noqa: E402
from onbox.health.verdict import Context, Reading  # noqa: E402

RUN = "gpucheck"
HOLDER_TAG = f"{RUN}:1:holder"
README = os.path.join(HERE, "README.md")
BEGIN, END = "<!-- gpu_probe_check:begin -->", "<!-- gpu_probe_check:end -->"
HOLDER = (
    "import sys, time, torch\n"
    "x = torch.ones(int(sys.argv[1]) << 20, dtype=torch.uint8, device='cuda:0')\n"
    "torch.cuda.synchronize()\n"
    "print('ready', torch.cuda.get_device_name(0), flush=True)\n"
    "time.sleep(90)\n"
)


def owner(tag: Optional[str], current: Optional[str]) -> Optional[str]:
    """onbox/agent/healthuse.py's tag_owner, for run "gpucheck" (the health wing's caller)."""
    if not tag or not tag.startswith(RUN + ":"):
        return None
    return "current" if tag == current else "earlier"


def ctx(tag: str, attempt: int) -> Context:
    now = time.monotonic()
    return Context(now, time.time(), "RUNNING", attempt, now, None, tag, None)


def raw_reading(timeout: float) -> Optional[Dict[str, Any]]:
    w = WorkerClient(worker_argv(timeout), worker_environ())
    try:
        w.send()
        return w.receive(timeout + 20)  # the worker's start (NVML's init) is in this one
    finally:
        w.close()


def start_holder(mib: int) -> subprocess.Popen[str]:
    env = {**os.environ, "RGT_ATTEMPT_TAG": HOLDER_TAG}
    p = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(mib)], env=env, stdout=subprocess.PIPE, text=True
    )
    assert p.stdout is not None
    line = p.stdout.readline()  # torch's import and CUDA's start: bounded by the sleep's end
    if not line.startswith("ready"):
        p.kill()
        raise SystemExit(f"the PyTorch holder did not start (said {line!r}, code {p.wait()})")
    return p


def holder_of(reading: Reading, pid: int) -> Optional[Dict[str, Any]]:
    for h in reading.verdict.data.get("holders") or []:
        if h["pid"] == pid:
            return dict(h)
    return None


def check(mib: int) -> Dict[str, Any]:
    events: List[Dict[str, Any]] = []
    probe = GpuProbe(
        GpuConfig(timeout=15.0, release_wait=30.0),
        owner,
        lambda kind, reason, **kw: events.append({"kind": kind, "reason": reason, **kw}),
    )
    out: Dict[str, Any] = {}
    try:
        base = probe.check(ctx(HOLDER_TAG, 1))
        out["baseline"] = {"verdict": base.verdict.to_doc(), "sample": base.sample}
        holder = start_holder(mib)
        try:
            seen = probe.check(ctx(HOLDER_TAG, 1))
            h = holder_of(seen, holder.pid)
            out["holding"] = {"verdict": seen.verdict.to_doc(), "sample": seen.sample}
            out["holder"] = {"pid": holder.pid, "mib": mib, "seen": h is not None, "as": h}
            out["holder_matched_by_tag"] = h is not None and h["who"] == "current"
            # Attempt 2 starts: the holder is now a stale process of attempt 1.
            t0 = time.monotonic()
            probe.may_start()  # the first ask of this restart
            stale = probe.check(ctx(f"{RUN}:2:next", 2))
            out["as_stale"] = {"verdict": stale.verdict.to_doc()}
            try:
                code: Optional[int] = holder.wait(timeout=10)
            except subprocess.TimeoutExpired:
                code = None
            out["stale_holder_exit"] = code  # -9: the probe killed it
            if code is None:  # the probe did not see it (NVML lists no processes here)
                holder.kill()
                holder.wait()
                out["stale_holder_exit"] = "not killed by the probe; killed by this script"
            opened = None
            while time.monotonic() - t0 < 40:
                probe.check(ctx(f"{RUN}:2:next", 2))
                if probe.may_start():
                    opened = round(time.monotonic() - t0, 2)
                    break
                time.sleep(0.5)
            out["gate_opened_after_s"] = opened
        finally:
            if holder.poll() is None:
                holder.kill()
            holder.wait()
    finally:
        probe.close()
    out["events"] = events
    return out


def _verdict(v: Optional[Dict[str, Any]]) -> str:
    return "none" if not v else f"{v['level']} ({v['code']}): {v['reason']}"


def render(doc: Dict[str, Any]) -> str:
    raw = doc["raw"]
    dev = (raw.get("devices") or [{}])[0]
    h = doc.get("holder") or {}
    gate = doc.get("gate_opened_after_s")
    rows = [
        ("backend", raw.get("backend")),
        ("device 0", f"{dev.get('name')}, {dev.get('mem_used')}/{dev.get('mem_total')} MiB"),
        ("util, temp, power", f"{dev.get('util')}%, {dev.get('temp')} C, {dev.get('power')} W"),
        ("SM clock / max", f"{dev.get('sm_clock')}/{dev.get('sm_clock_max')} MHz"),
        ("throttle reasons", ", ".join(dev.get("throttle") or []) or "none"),
        ("ECC uncorrected (volatile)", dev.get("ecc_uncorrected")),
        ("recovery action field", dev.get("recovery_action")),
        ("probe verdict, holder running", _verdict((doc.get("holding") or {}).get("verdict"))),
        ("holder (PyTorch, tagged) seen", f"{h.get('seen')}: {h.get('as')}"),
        ("matched by its tag", doc.get("holder_matched_by_tag")),
        ("as stale: exit code", doc.get("stale_holder_exit")),
        ("gate opened after", "never (30 s)" if gate is None else f"{gate} s"),
        ("events", "; ".join(e["kind"] + ": " + e["reason"] for e in doc.get("events", []))),
    ]
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"{BEGIN}\n{when}, {benchlib.machine()}, commit {benchlib.commit_of('onbox')}\n\n"
        "| what | seen |\n|---|---|\n"
        + "".join(f"| {k} | {str(v).replace('|', '/')} |\n" for k, v in rows)
        + f"{END}"
    )


def update_readme(block: str) -> None:
    with open(README) as f:
        text = f.read()
    new = benchlib.replace_section(text, BEGIN, END, block)
    if new is None:
        title = "## gpu_probe_check.py: the GPU probe against a real GPU and NVML\n\n"
        new = text.rstrip("\n") + "\n\n" + title + block + "\n"
    with open(README, "w") as f:
        f.write(new)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--mib", type=int, default=1024, help="MiB the holder allocates (1024)")
    ap.add_argument("--readme", action="store_true", help="write the section of bench/README.md")
    args = ap.parse_args(argv)
    raw = raw_reading(15.0)
    if raw is None or not raw.get("ok") or raw.get("backend") == "none":
        why = "no answer" if raw is None else raw.get("why") or raw.get("error")
        print(f"gpu_probe_check: no GPU here ({why}); nothing to check", file=sys.stderr)
        return 2
    doc: Dict[str, Any] = {"raw": raw, **check(args.mib)}
    print(json.dumps(doc, indent=2, default=str))
    if args.readme:
        update_readme(render(doc))
        print(f"[gpu_probe_check] wrote {README}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
