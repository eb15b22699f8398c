"""A bounded training job for the chaos suite: writes checkpoints the test can tell apart.

    job.py --steps 10,20,30 [--kind dir|file|inplace] [--mib 1] [--tag A] [--gate DIR]
           [--every 0.2] [--then exit|idle] [--limit 120] [--print-env NAME]
           [--at STEP:MIB:NFILES ...]

Each step S is written, oldest first, after the file ``GATE/S`` exists (when ``--gate``): the
test decides when a checkpoint appears. Steps at or below the one the job resumed from
(RGT_RESUME_FROM, else the newest local one) are skipped, as a real script does. Kinds:

- ``dir``: ``step_S/`` with ``a.bin`` (64 KiB), ``b.bin`` (MIB MiB), NFILES more of 1 KiB
  (``c0.bin``...; 0 unless ``--at`` says) and ``.rgt-complete``, built under a hidden name and
  renamed whole (the training API's way);
- ``file``: ``step_S.pt`` (MIB MiB), written to a temporary name and renamed;
- ``inplace``: ``ckpt.pt`` (MIB MiB) rewritten in place (``torch.save(state, "ckpt.pt")``),
  its step in its first line.

Bytes depend on the tag, the step and the file, so two boxes' step 30 differ and no file
dedupes against another. Prints ``wrote REL sha256 HEX`` per file. After the last step it
exits 0 (``--then exit``) or idles; it never outlives ``--limit`` seconds (then exits 0).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import time

KIB = 1 << 10
MIB = 1 << 20


def content(tag: str, step: int, name: str, size: int) -> bytes:
    head = f"{tag} step {step} {name}\n".encode()
    unit = hashlib.sha256(head).digest()
    body = unit * (max(0, size - len(head)) // len(unit) + 1)
    return (head + body)[:size]


def say(rel: str, data: bytes) -> None:
    print(f"wrote {rel} sha256 {hashlib.sha256(data).hexdigest()}", flush=True)


def write_new(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def resumed_step(ckpt: str, kind: str) -> int:
    src = os.environ.get("RGT_RESUME_FROM", "")
    if kind == "inplace":
        path = src or os.path.join(ckpt, "ckpt.pt")
        try:
            with open(path, "rb") as f:
                head = re.search(rb"step (\d+)", f.readline())
            return int(head.group(1)) if head else -1
        except OSError:
            return -1
    names = [os.path.basename(src)] if src else os.listdir(ckpt)
    found = [int(m.group(1)) for n in names if (m := re.fullmatch(r"step_(\d+)(?:\.pt)?", n))]
    return max(found, default=-1)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", required=True)
    ap.add_argument("--kind", default="dir", choices=("dir", "file", "inplace"))
    ap.add_argument("--mib", type=float, default=1.0)
    ap.add_argument("--tag", default="job")
    ap.add_argument("--gate")
    ap.add_argument("--every", type=float, default=0.2)
    ap.add_argument("--then", default="exit", choices=("exit", "idle"))
    ap.add_argument("--limit", type=float, default=120.0)
    ap.add_argument("--print-env")
    ap.add_argument("--at", action="append", default=[], help="STEP:MIB:NFILES for one step")
    a = ap.parse_args()
    override = {}
    for spec in a.at:
        step_s, mib_s, n_s = spec.split(":")
        override[int(step_s)] = (int(float(mib_s) * MIB), int(n_s))
    end = time.monotonic() + a.limit
    ckpt = os.environ["RGT_CKPT_DIR"]
    os.makedirs(ckpt, exist_ok=True)
    size = int(a.mib * MIB)
    start = resumed_step(ckpt, a.kind)
    print(f"attempt {os.environ.get('RGT_ATTEMPT')} resumed at {start}", flush=True)
    if a.print_env:  # a canary secret the agent must never let into the store unredacted
        print(f"{a.print_env}={os.environ.get(a.print_env, '')}", flush=True)
    for step in (int(s) for s in a.steps.split(",")):
        if step <= start:
            continue
        if a.gate:
            while not os.path.exists(os.path.join(a.gate, str(step))):
                if time.monotonic() > end:
                    return 0
                time.sleep(0.02)
        elif a.every:
            time.sleep(a.every)
        step_size, extra = override.get(step, (size, 0))
        if a.kind == "dir":
            tmp = os.path.join(ckpt, f".step_{step}.tmp")
            os.makedirs(tmp, exist_ok=True)
            files = [("a.bin", 64 * KIB), ("b.bin", step_size)]
            files += [(f"c{i}.bin", KIB) for i in range(extra)]
            for name, n in files:
                data = content(a.tag, step, name, n)
                write_new(os.path.join(tmp, name), data)
                say(f"step_{step}/{name}", data)
            marker = json.dumps({"step": step}).encode()
            write_new(os.path.join(tmp, ".rgt-complete"), marker)
            os.replace(tmp, os.path.join(ckpt, f"step_{step}"))
        elif a.kind == "file":
            data = content(a.tag, step, "pt", step_size)
            path = os.path.join(ckpt, f"step_{step}.pt")
            write_new(path + ".tmp", data)
            os.replace(path + ".tmp", path)
            say(f"step_{step}.pt", data)
        else:
            data = content(a.tag, step, "pt", step_size)
            with open(os.path.join(ckpt, "ckpt.pt"), "wb") as f:  # in place, like torch.save
                for i in range(0, len(data), 256 * KIB):
                    f.write(data[i : i + 256 * KIB])
            say("ckpt.pt", data)
    if a.then == "idle":
        while time.monotonic() < end:
            time.sleep(0.2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
