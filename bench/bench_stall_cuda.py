"""bench_stall.py's blocked time per checkpoint, with the state on a CUDA GPU.

    .venv/bin/python bench/bench_stall_cuda.py [--sizes-mib 64,1024] [--repeats 3]
                                               [--no-drop-caches] [--no-readme]

The same state as bench_stall.py (8 ``Linear(d, d)`` layers and AdamW's moments, float32, S
bytes in all), built on ``cuda:0``. The same arms, saving it to a temporary directory on local
disk: synchronous ``torch.save`` (which copies each GPU tensor to host memory as it
serialises) + fsync of the file and its directory; rgt's async save with ``pin=True`` (the
staging buffer is registered page-locked, device-to-host copies are non-blocking, one
synchronize at the end) and with ``pin=False`` (pageable staging: every copy is synchronous);
and ``torch.distributed.checkpoint.async_save`` (default thread executor) in a single-process
gloo group, reported "not run" with the reason if it cannot run. Blocked = until the call
returns (the loop may go on); end to end = until the checkpoint is on disk. Each arm saves once
untimed first (reported apart), then ``--repeats`` timed saves, the arms taking turns; medians.
``torch.cuda.synchronize()`` runs before every save, so none pays for queued GPU work.

Prints a markdown table with the date, the GPU and the versions, and puts it between the
``bench_stall_cuda`` markers inside bench_stall's section of bench/README.md unless
``--no-readme``. Exits with status 2 and a message when no CUDA GPU is present; otherwise 0,
whatever the figures (a report, not a test).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import shutil
import sys
import tempfile
from typing import Dict, List, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # bench/ is not a package: its sibling is imported from here
    sys.path.insert(0, HERE)

import bench_stall as bs  # noqa: E402
import benchlib  # noqa: E402


def render(rows: List[str], meta: str) -> str:
    return (
        meta + "\n| state | how | blocked, median (ms) | blocked / sync | end to end, median (s) | "
        "first save: blocked (ms) / end to end (s) | target (rgt pinned, 1 GiB) |\n"
        "|---|---|---:|---:|---:|---:|---|\n" + "".join(rows)
    )


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--sizes-mib", default="64,1024", help="state sizes (default 64,1024)")
    ap.add_argument("--repeats", type=int, default=3, help="timed saves per arm and size (3)")
    ap.add_argument("--no-drop-caches", action="store_true", help="keep the page cache warm")
    ap.add_argument("--workdir", default=None, help="where the temporary directory goes")
    ap.add_argument("--readme", default=bs.README, help="README to update")
    ap.add_argument("--no-readme", action="store_true", help="only print the table")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "bench_stall_cuda: no CUDA GPU here (torch.cuda.is_available() is False, torch "
            f"{torch.__version__}); run it on a machine with one. Nothing measured.",
            file=sys.stderr,
        )
        return 2
    sizes = [int(x) * bs.MiB for x in args.sizes_mib.split(",") if x.strip()]
    started = datetime.datetime.now(datetime.timezone.utc)
    rows: List[str] = []
    with contextlib.ExitStack() as stack:
        tmp = tempfile.mkdtemp(prefix="bench-stall-cuda-", dir=args.workdir)
        stack.callback(shutil.rmtree, tmp, ignore_errors=True)
        box = bs.Box(tmp, not args.no_drop_caches)
        dcp_why = bs.start_dcp()
        stack.callback(bs.stop_dcp)
        for size in sizes:
            tag = f"{size // bs.MiB}MiB-cuda"
            state = bs.make_state(size, "cuda")
            pinned = bs.RgtArm(state, box.dir(tag, "rgt-pin"), pin=True)
            pinned.label = "rgt async save, pin=True"
            pageable = bs.RgtArm(state, box.dir(tag, "rgt-nopin"), pin=False)
            pageable.label = "rgt async save, pin=False (pageable)"
            arms: Dict[str, bs.Arm] = {
                "sync": bs.SyncArm(state, box.dir(tag, "sync")),
                "rgt-pin": pinned,
                "rgt-nopin": pageable,
                "dcp": bs.DcpArm(state, box.dir(tag, "dcp"), False, dcp_why),
            }
            try:
                first, samples, not_run = bs.run_arms(
                    box, arms, args.repeats, tag, torch.cuda.synchronize
                )
                staging = pinned.ck._staging
                locked = staging is not None and staging.pinned
                pinned.label += " (page-locked)" if locked else " (registering failed: pageable)"
            finally:
                pinned.close()
                pageable.close()
            sync_b = bs.med([s.blocked for s in samples.get("sync", [])])
            lab = bs.size_label(size)
            for name, arm in arms.items():
                if name in not_run:
                    rows.append(f"| {lab} | {arm.label} | not run: {not_run[name]} | | | | |\n")
                    continue
                b = bs.med([s.blocked for s in samples[name]])
                target = ""
                if name == "rgt-pin" and size == bs.JUDGED_SIZE:
                    target = f"≤ {bs.BLOCKED_RATIO_MAX:.2f}x: " + benchlib.verdict(
                        b <= bs.BLOCKED_RATIO_MAX * sync_b
                    )
                f = first[name]
                rows.append(
                    f"| {lab} | {arm.label} | {bs.ms(b)} | {b / sync_b:.3f}x | "
                    f"{bs.med([s.e2e for s in samples[name]]):.2f} | {bs.ms(f.blocked)} / "
                    f"{f.e2e:.2f} | {target} |\n"
                )
            del state
            torch.cuda.empty_cache()
        gpu = torch.cuda.get_device_name(0)
        meta = (
            f"CUDA, measured {started.strftime('%Y-%m-%d %H:%M UTC')} with bench_stall_cuda.py; "
            f"GPU: {gpu}; machine: {benchlib.machine()}; Python {platform.python_version()}, torch "
            f"{torch.__version__}, CUDA {torch.version.cuda}; checkpoints on "
            f"{benchlib.fs_type(tmp)}; `sync`"
            + (" and a page-cache drop" if box.drop else "")
            + f" before every save; medians of {args.repeats} timed saves per arm; "
            f"onbox at {benchlib.commit_of('onbox')}.\n"
        )
    body = render(rows, meta)
    print(body)
    if not args.no_readme:
        update_readme(args.readme, body)
        print(f"[bench] wrote {args.readme}", file=sys.stderr)
    return 0


def update_readme(path: str, body: str) -> None:
    """Replace the CUDA block inside bench_stall's section (made if missing)."""
    with open(path) as f:
        text = f.read()
    block = f"{bs.CUDA_BEGIN}\n{body}{bs.CUDA_END}"
    if bs.CUDA_BEGIN in text and bs.CUDA_END in text:
        head, rest = text.split(bs.CUDA_BEGIN, 1)
        text = head + block + rest.split(bs.CUDA_END, 1)[1]
    elif bs.END in text:
        head, rest = text.split(bs.END, 1)
        text = head + block + "\n" + bs.END + rest
    else:
        text = text.rstrip("\n") + f"\n\n{bs.BEGIN}\n{block}\n{bs.END}\n"
    with open(path, "w") as f:
        f.write(text)


if __name__ == "__main__":
    sys.exit(main())
