"""How long a checkpoint blocks the training loop: rgt's async save next to synchronous
``torch.save`` + fsync and ``torch.distributed.checkpoint.async_save``, in the same run.

    .venv/bin/python bench/bench_stall.py [--sizes-mib 64,1024] [--repeats 3]
                                          [--loop-repeats 5] [--loop-threads 1]
                                          [--save-threads 1]
                                          [--no-dcp-process] [--no-loop]
                                          [--no-drop-caches] [--no-readme]

The state of S bytes is built the same way for every arm: 8 ``Linear(d, d)`` layers (with bias)
and the ``torch.optim.AdamW`` moments of one step (``exp_avg``, ``exp_avg_sq``), float32, with
d chosen so that the parameters and both moments add up to S (the exact byte count is reported).
Every arm saves that state to a temporary directory on the same disk; nothing is mocked.

1. Blocked time per checkpoint, for each ``--sizes-mib`` (default 64 and 1024 MiB):

   - **sync** (what users run without a library): ``torch.save({"model": model.state_dict(),
     "optimizer": opt.state_dict(), "step": n}, path)``, fsync of the file, fsync of its
     directory. The loop is blocked for all of it; the time is split into torch.save and fsync.
   - **rgt**: ``onbox.train.Checkpointer(dir, async_save=True, model=..., optimizer=...)``;
     blocked = the call of ``save(step)`` (state_dict() calls, the copy into the memfd staging
     buffer, the request to the writer process); end to end = until ``wait()`` returns (the
     writer's torch.save, fsync, sha256, marker, rename, directory fsync).
   - **DCP**: ``get_state_dict(model, opt)`` + ``torch.distributed.checkpoint.async_save(...,
     checkpoint_id=dir)`` in a single-process gloo group (world size 1 on 127.0.0.1); blocked
     = until the call returns its future, end to end = until ``future.result()`` returns. With
     the default executor (a thread in the training process) and, unless ``--no-dcp-process``,
     with ``async_checkpointer_type=PROCESS`` (a daemon process DCP spawns on the first call).
     DCP's FileSystemWriter fsyncs its files (``sync_files=True`` by default). An arm that cannot
     run on this torch is reported as "not run" with the reason.

   Each arm saves once untimed first and that first save is reported on its own (rgt: the
   writer process's first request imports torch, and the staging buffer's pages are faulted
   in once; DCP: lazy imports, the planner, for the process executor the spawn); then
   ``--repeats`` timed saves each, the arms taking turns (the order rotates every repeat), and
   the medians are reported. Before every timed save the benchmark runs ``sync`` and, as root,
   drops the page cache (as bench_seal.py does), so no save pays for another's writeback. What
   is written is deleted after each save, untimed (rgt runs with ``keep`` large enough that it
   prunes nothing, so deleting is not in its end-to-end time either).

2. Training throughput with a persist in flight, at the largest size: a CPU training loop (a
   512-2048-512 GELU MLP, batch 32, MSE loss, AdamW: about 10 ms a step on one core here) runs
   while nothing is written (idle), while rgt's writer writes the state (the window runs from
   ``save()`` returning until the write is done, polled every step with
   ``should_checkpoint()``, as a training loop calls it; idle windows call it too), and while
   DCP's async save of the same state is in flight (until ``future.done()``). The loop trains
   its own small model, not the S-byte state, so that a window holds hundreds of steps and the
   figure isolates what the persist takes from the loop (CPU, memory bandwidth, the GIL) from
   the loop's own cost. The loop runs on one torch thread (``torch.set_num_threads(1)``), like
   a GPU job's host side: one busy Python thread, and cores to spare, which a GPU box has and
   which the writer (nice 10) and DCP's threads use. ``--loop-threads 1,2`` adds a loop on
   every core of this 2-core machine (reported, not judged): then no core is left for the
   writer, and on this shared machine every step's parallel regions also wait for threads
   that other tenants' processes hold, so its idle rate swings several-fold from window to
   window (1.3 to 11 steps/s in one run, against 16 to 22 on one thread in the same run).
   Each repeat runs an idle window, then each arm's in-flight window followed by
   another idle window (the order of the arms rotates); an in-flight window's slowdown is
   1 - its steps/s / the mean of the idle windows just before and after it, and the median of
   ``--loop-repeats`` such slowdowns is reported, so that load from other processes that
   drifts over minutes cancels. An idle window lasts as long as rgt's median write at that
   size. Beside steps/s: the loop thread's own CPU time per step (which rises when the persist
   competes for memory bandwidth or caches, not when the loop merely loses its core) and the
   CPU the rest of the machine used during the window.

The saves run with ``torch.set_num_threads(1)`` (``--save-threads``): the staging copies of rgt
and DCP run on torch's intra-op threads, one parallel region per tensor, and on this shared
2-core machine a region waits whenever another process holds the other core (in one run, a
64 MiB state staged in about 8 ms on one thread and in 150-170 ms on two, under the same load).
rgt's save with torch's default thread count is measured beside it, on the same Checkpointer,
and reported.

For scale, in the same run: a bare copy of the state into a preallocated, already-touched
buffer (the floor for any design that copies the state out before writing it), the writer's
own time and CPU per write, and the CPU other processes used while the saves ran.

A markdown report goes to stdout and, between the ``bench_stall`` markers, into
bench/README.md; the CUDA figures (bench/bench_stall_cuda.py, between their own markers inside
that section) are kept as they are. Targets (from the issue): rgt's blocked time at 1 GiB at
most 1/5 of sync torch.save + fsync's; steps/s while rgt persists at most 5% below idle. They
are marked pass/FAIL; the exit code does not depend on them (a benchmark on a shared machine is
a report, not a test).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import math
import os
import platform
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import time
from concurrent.futures import Future
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from benchlib import can_drop_caches, commit_of, fs_type, machine, verdict

from onbox.train import Checkpointer

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
README = os.path.join(HERE, "README.md")
BEGIN = "<!-- bench_stall:begin -->"
END = "<!-- bench_stall:end -->"
CUDA_BEGIN = "<!-- bench_stall_cuda:begin -->"
CUDA_END = "<!-- bench_stall_cuda:end -->"
CUDA_PLACEHOLDER = (
    "CUDA: not measured yet (no CUDA GPU on the machine that ran this benchmark); run "
    "`.venv/bin/python bench/bench_stall_cuda.py` on a GPU box to fill in this part.\n"
)
MiB = 1 << 20
CLK_TCK = os.sysconf("SC_CLK_TCK")

# Targets (from the issue).
BLOCKED_RATIO_MAX = 1 / 5  # rgt's blocked time / sync torch.save + fsync, at 1 GiB
JUDGED_SIZE = 1024 * MiB
SLOWDOWN_MAX = 5.0  # % fewer steps/s while rgt persists than idle

LAYERS = 8  # Linear(d, d) layers of the checkpointed state
LOOP_WIDTH, LOOP_HIDDEN, LOOP_BATCH = 512, 2048, 32  # the training loop's MLP
MIN_WINDOW = 2.0  # seconds: the shortest idle window


def say(msg: str) -> None:
    """Progress goes to stderr, so stdout carries only the report."""
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def med(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else math.nan


# ---------------------------------------------------------------- the state and the loop


@dataclasses.dataclass
class State:
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    width: int
    nbytes: int  # every tensor of the model's and the optimizer's state dicts


def make_state(size: int, device: str = "cpu") -> State:
    """``LAYERS`` Linear(d, d) layers and AdamW's moments after one step: 3 floats per
    parameter, d such that they add up to ``size``."""
    d = max(8, int(math.sqrt(size / (12 * LAYERS))))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(d, d) for _ in range(LAYERS)]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return State(model, opt, d, tree_bytes([model.state_dict(), opt.state_dict()]))


def tree_bytes(tree: Any) -> int:
    if isinstance(tree, torch.Tensor):
        return int(tree.numel() * tree.element_size())
    if isinstance(tree, dict):
        return sum(tree_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(tree_bytes(v) for v in tree)
    return 0


def tensors_of(tree: Any) -> List[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in tensors_of(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in tensors_of(v)]
    return []


def deadline(seconds: float) -> Callable[[], bool]:
    end = time.monotonic() + seconds
    return lambda: time.monotonic() >= end


class Loop:
    """The training loop of measurement 2: a small MLP trained on one fixed batch."""

    def __init__(self) -> None:
        torch.manual_seed(1)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(LOOP_WIDTH, LOOP_HIDDEN),
            torch.nn.GELU(),
            torch.nn.Linear(LOOP_HIDDEN, LOOP_WIDTH),
        )
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.x = torch.randn(LOOP_BATCH, LOOP_WIDTH)
        self.y = torch.randn(LOOP_BATCH, LOOP_WIDTH)

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(self.model(self.x), self.y)
        torch.autograd.backward(loss)
        self.opt.step()

    def run(self, until: Callable[[], bool]) -> Tuple[int, float]:
        """Steps until ``until()`` (asked after every step); (steps, seconds)."""
        n, t0 = 0, time.monotonic()
        while True:
            self.step()
            n += 1
            if until():
                return n, time.monotonic() - t0


# ---------------------------------------------------------------- the machine


class Box:
    """This run's temporary directory and how to quiet the disk between timed runs."""

    def __init__(self, tmp: str, drop_caches: bool) -> None:
        self.tmp = tmp
        self.drop = drop_caches and can_drop_caches()

    def dir(self, *parts: str) -> str:
        p = os.path.join(self.tmp, *parts)
        os.makedirs(p, exist_ok=True)
        return p

    def settle(self) -> None:
        """Flush what earlier runs left dirty, so it is not written during the next timed run;
        drop the page cache when this process may (as bench_seal.py does)."""
        os.sync()
        if self.drop:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")


def proc_cpu(pid: Optional[int]) -> float:
    """utime + stime of a process, all its threads (s); 0 for no process."""
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            raw = f.read()
    except OSError:
        return 0.0
    fields = raw[raw.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- the arms


@dataclasses.dataclass
class Sample:
    blocked: float  # seconds the loop could not run
    e2e: float  # seconds until the checkpoint is on disk
    parts: Dict[str, float] = dataclasses.field(default_factory=dict)


class Arm:
    """One way of saving the state. ``save`` returns once the checkpoint is on disk;
    ``start`` returns once the loop may go on, with a poll that says when the write is done."""

    name = ""
    label = ""
    not_run: Optional[str] = None  # why this arm did not run

    def start(self, step: int) -> Tuple[float, Callable[[], bool]]:
        raise NotImplementedError

    def finish(self) -> Dict[str, float]:
        """After the write is done: details for the report (untimed)."""
        return {}

    def save(self, step: int) -> Sample:
        t0 = time.monotonic()
        blocked, done = self.start(step)
        while not done():
            time.sleep(0.0005)
        e2e = time.monotonic() - t0
        return Sample(blocked, e2e, self.finish())

    def clean(self) -> None:
        """Delete what the saves wrote (untimed)."""

    def close(self) -> None:
        pass


class SyncArm(Arm):
    name, label = "sync", "torch.save + fsync (sync)"

    def __init__(self, state: State, out: str) -> None:
        self.state, self.out = state, out

    def save(self, step: int) -> Sample:
        path = os.path.join(self.out, f"step_{step}.pt")
        t0 = time.monotonic()
        torch.save(
            {
                "model": self.state.model.state_dict(),
                "optimizer": self.state.opt.state_dict(),
                "step": step,
            },
            path,
        )
        t1 = time.monotonic()
        fsync_path(path)
        fsync_path(self.out)
        t2 = time.monotonic()
        return Sample(t2 - t0, t2 - t0, {"torch.save": t1 - t0, "fsync": t2 - t1})

    def start(self, step: int) -> Tuple[float, Callable[[], bool]]:
        s = self.save(step)
        return s.blocked, lambda: True

    def clean(self) -> None:
        for n in os.listdir(self.out):
            os.unlink(os.path.join(self.out, n))


class RgtArm(Arm):
    name, label = "rgt", "rgt async save"

    def __init__(self, state: State, out: str, pin: bool = True) -> None:
        self.out = out
        t0 = time.monotonic()
        self.ck = Checkpointer(
            out,
            async_save=True,
            pin=pin,
            keep=1 << 30,  # prune nothing: deleting is not what is measured
            handle_signals=False,
            model=state.model,
            optimizer=state.opt,
        )
        self.construct = time.monotonic() - t0
        self._cpu0 = 0.0

    def writer_pid(self) -> Optional[int]:
        w = self.ck._writer
        return w.proc.pid if w is not None and w.proc is not None else None

    def start(self, step: int) -> Tuple[float, Callable[[], bool]]:
        self._cpu0 = proc_cpu(self.writer_pid())
        t0 = time.monotonic()
        self.ck.save(step)
        blocked = time.monotonic() - t0

        def done() -> bool:
            # What a training loop calls every step; it collects a finished write.
            self.ck.should_checkpoint()
            return self.ck._writer is None or self.ck._writer.inflight is None

        return blocked, done

    def finish(self) -> Dict[str, float]:
        return {
            "staging": self.ck.cost or 0.0,
            "writer": self.ck.write_seconds or 0.0,
            "writer cpu": proc_cpu(self.writer_pid()) - self._cpu0,
        }

    def save(self, step: int) -> Sample:
        # wait() is how a user waits for the write; it blocks on the writer's answer.
        self._cpu0 = proc_cpu(self.writer_pid())
        t0 = time.monotonic()
        self.ck.save(step)
        t1 = time.monotonic()
        self.ck.wait()
        t2 = time.monotonic()
        return Sample(t1 - t0, t2 - t0, self.finish())

    def clean(self) -> None:
        for n in os.listdir(self.out):
            shutil.rmtree(os.path.join(self.out, n), ignore_errors=True)

    def close(self) -> None:
        self.ck.close()


class DcpArm(Arm):
    def __init__(self, state: State, out: str, process: bool, not_run: Optional[str]) -> None:
        self.state, self.out, self.process = state, out, process
        self.name = "dcp-process" if process else "dcp"
        self.label = (
            "DCP async_save (process executor)" if process else "DCP async_save (default: thread)"
        )
        self.not_run = not_run
        self.future: Optional[Future[Any]] = None

    def start(self, step: int) -> Tuple[float, Callable[[], bool]]:
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from torch.distributed.checkpoint.state_dict_saver import (
            AsyncCheckpointerType,
            async_save,
        )

        kind = AsyncCheckpointerType.PROCESS if self.process else AsyncCheckpointerType.THREAD
        t0 = time.monotonic()
        msd, osd = get_state_dict(self.state.model, self.state.opt)
        ret = async_save(
            {"model": msd, "optimizer": osd},
            checkpoint_id=os.path.join(self.out, f"step_{step}"),
            async_checkpointer_type=kind,
        )
        blocked = time.monotonic() - t0
        fut: Future[Any] = ret if isinstance(ret, Future) else ret.upload_completion
        self.future = fut
        return blocked, fut.done

    def finish(self) -> Dict[str, float]:
        if self.future is not None:
            self.future.result()  # raises the save's error
        return {}

    def save(self, step: int) -> Sample:
        t0 = time.monotonic()
        blocked, _ = self.start(step)
        assert self.future is not None
        self.future.result()  # how a user waits for it
        return Sample(blocked, time.monotonic() - t0)

    def clean(self) -> None:
        for n in os.listdir(self.out):
            shutil.rmtree(os.path.join(self.out, n), ignore_errors=True)


class Threads(Arm):
    """Another arm's saves with a different number of torch threads (the staging copies run on
    torch's intra-op threads); shares that arm's objects (its Checkpointer, its buffer)."""

    def __init__(self, inner: Arm, threads: int, label: str) -> None:
        self.inner, self.threads = inner, threads
        self.name, self.label = f"{inner.name}-threads", label

    @contextlib.contextmanager
    def _threads(self) -> Iterator[None]:
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def start(self, step: int) -> Tuple[float, Callable[[], bool]]:
        with self._threads():
            return self.inner.start(step)

    def save(self, step: int) -> Sample:
        with self._threads():
            return self.inner.save(step)

    def finish(self) -> Dict[str, float]:
        return self.inner.finish()

    def clean(self) -> None:
        self.inner.clean()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_dcp() -> Optional[str]:
    """A single-process gloo group for DCP; None when it runs, else why not."""
    try:
        import torch.distributed as dist
        import torch.distributed.checkpoint  # noqa: F401
    except Exception as e:
        return f"torch.distributed.checkpoint cannot be imported: {type(e).__name__}: {e}"
    if not dist.is_available() or not dist.is_gloo_available():
        return "this torch has no torch.distributed with gloo"
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    try:
        dist.init_process_group("gloo", rank=0, world_size=1)
    except Exception as e:
        return f"init_process_group(gloo, world_size=1) failed: {type(e).__name__}: {e}"
    return None


def stop_dcp() -> None:
    """Stop DCP's checkpoint daemon process (if the process executor started one) and the
    process group."""
    with contextlib.suppress(Exception):
        import torch.distributed.checkpoint._async_process_executor as ape

        proc = ape._CHECKPOINT_PROCESS
        ape._CHECKPOINT_PROCESS = None
        if proc is not None:
            proc.__del__()  # asks it to end, joins it, SIGTERM after 5 s
    with contextlib.suppress(Exception):
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


# ---------------------------------------------------------------- measurement 1: blocked time


@dataclasses.dataclass
class SizeResult:
    size: int  # asked
    state: State
    first: Dict[str, Sample]  # arm -> its first (untimed) save
    samples: Dict[str, List[Sample]]  # arm -> timed saves
    not_run: Dict[str, str]  # arm -> why
    labels: Dict[str, str]
    construct: float  # Checkpointer(...) with async_save (starts the writer process)
    copy_floor: List[float]  # a bare copy of the state into a touched buffer
    others: float  # CPU other processes used during the saves, % of all cores


def copy_floor(state: State, repeats: int) -> List[float]:
    ts = tensors_of([state.model.state_dict(), state.opt.state_dict()])
    buf = torch.empty(sum(t.numel() * t.element_size() for t in ts), dtype=torch.uint8)
    buf.fill_(1)  # every page touched before the clock starts
    out = []
    for _ in range(repeats):
        t0 = time.monotonic()
        off = 0
        for t in ts:
            n = t.numel() * t.element_size()
            buf[off : off + n].view(t.dtype).view(t.shape).copy_(t)
            off += n
        out.append(time.monotonic() - t0)
    return out


def run_arms(
    box: Box,
    arms: Dict[str, Arm],
    repeats: int,
    tag: str,
    before: Callable[[], None] = lambda: None,
) -> Tuple[Dict[str, Sample], Dict[str, List[Sample]], Dict[str, str]]:
    """Each arm's first save (untimed warm-up, reported apart), then ``repeats`` timed saves per
    arm, the arms taking turns with the order rotating. ``before`` runs before every save.
    (first saves, timed saves, why an arm did not run)."""
    first: Dict[str, Sample] = {}
    not_run: Dict[str, str] = {}
    step = 0
    for name, arm in arms.items():
        if arm.not_run is not None:
            not_run[name] = arm.not_run
            continue
        step += 1
        box.settle()
        before()
        try:
            first[name] = arm.save(step)
            arm.clean()
        except Exception as e:
            not_run[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            say(f"{tag} {name}: not run: {not_run[name]}")
            continue
        s = first[name]
        say(f"{tag} first save {name}: blocked {s.blocked:.3f} s, end to end {s.e2e:.2f} s")
    names = [n for n in arms if n not in not_run]
    samples: Dict[str, List[Sample]] = {n: [] for n in names}
    for rep in range(repeats):
        k = rep % len(names)
        for name in names[k:] + names[:k]:
            step += 1
            box.settle()
            before()
            s = arms[name].save(step)
            arms[name].clean()
            samples[name].append(s)
            say(f"{tag} #{rep + 1} {name}: blocked {s.blocked:.3f} s, end to end {s.e2e:.2f} s")
    return first, samples, not_run


def measure_size(
    box: Box,
    size: int,
    repeats: int,
    dcp_why: Optional[str],
    dcp_process: bool,
    default_threads: int,
) -> Tuple[SizeResult, Dict[str, Arm]]:
    tag = f"{size // MiB}MiB"
    say(f"{tag}: building the state")
    state = make_state(size)
    say(f"{tag}: {LAYERS} x Linear({state.width}, {state.width}) + AdamW: {state.nbytes} bytes")
    rgt = RgtArm(state, box.dir(tag, "rgt"))
    arms: Dict[str, Arm] = {"sync": SyncArm(state, box.dir(tag, "sync")), "rgt": rgt}
    if default_threads != torch.get_num_threads():
        arms["rgt-threads"] = Threads(
            rgt, default_threads, f"rgt async save, {default_threads} torch threads (the default)"
        )
    arms["dcp"] = DcpArm(state, box.dir(tag, "dcp"), False, dcp_why)
    if dcp_process:
        arms["dcp-process"] = DcpArm(state, box.dir(tag, "dcp-process"), True, dcp_why)
    busy0, t0 = machine_busy()
    own0 = tree_cpu()
    first, samples, not_run = run_arms(box, arms, repeats, tag)
    busy1, t1 = machine_busy()
    others = (busy1 - busy0 - (tree_cpu() - own0)) / ((t1 - t0) * (os.cpu_count() or 1)) * 100
    floor = copy_floor(state, max(3, repeats))
    labels = {n: a.label for n, a in arms.items()}
    res = SizeResult(
        size, state, first, samples, not_run, labels, rgt.construct, floor, max(0.0, others)
    )
    return res, {n: a for n, a in arms.items() if n not in not_run}


# ---------------------------------------------------------------- measurement 2: throughput


@dataclasses.dataclass
class Window:
    steps: int
    seconds: float
    cpu: float  # the loop thread's own CPU time (s)
    others: float  # CPU the rest of the machine used meanwhile, in % of all cores
    write: float = 0.0  # the persist's own time, save() to done, when one was in flight
    slowdown: float = math.nan  # % fewer steps/s than the mean of the idle windows around it

    @property
    def rate(self) -> float:
        return self.steps / self.seconds


@dataclasses.dataclass
class LoopResult:
    threads: int
    idle_seconds: float
    windows: Dict[str, List[Window]]  # "idle", and an arm's name


def machine_busy() -> Tuple[float, float]:
    """(busy CPU seconds of the whole machine, wall seconds) from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / CLK_TCK, time.monotonic()


def tree_cpu() -> float:
    """CPU seconds of this process (all threads) and its live descendants (rgt's writer,
    DCP's daemon process)."""
    parent: Dict[int, int] = {}
    cpu: Dict[int, float] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                raw = f.read()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2 :].split()
        parent[int(d)] = int(fields[1])
        cpu[int(d)] = (int(fields[11]) + int(fields[12])) / CLK_TCK
    mine, total = {os.getpid()}, 0.0
    changed = True
    while changed:
        changed = False
        for pid, pp in parent.items():
            if pp in mine and pid not in mine:
                mine.add(pid)
                changed = True
    for pid in mine:
        total += cpu.get(pid, 0.0)
    return total


def measure_loop(
    box: Box, arms: Dict[str, Arm], threads: int, repeats: int, idle_seconds: float
) -> LoopResult:
    """Every repeat: an idle window, then each arm's in-flight window followed by another idle
    window (the order of the arms rotates), so that each in-flight window is compared with the
    idle windows just before and after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    loop = Loop()
    ncpu = os.cpu_count() or 1
    try:
        loop.run(deadline(1.0))  # warm: allocator, caches, clocks
        names = [n for n in ("rgt", "dcp", "dcp-process") if n in arms]
        out: Dict[str, List[Window]] = {n: [] for n in ["idle", *names]}
        step = 10_000 * threads
        rgt = arms.get("rgt")

        def idle_until(seconds: float) -> Callable[[], bool]:
            """The idle window's check: the same should_checkpoint() as the rgt window's."""
            over = deadline(seconds)

            def until() -> bool:
                if isinstance(rgt, RgtArm):
                    rgt.ck.should_checkpoint()
                return over()

            return until

        def window(name: str) -> Window:
            nonlocal step
            box.settle()
            busy0, t0 = machine_busy()
            own0, c0 = tree_cpu(), time.thread_time()
            write = 0.0
            if name == "idle":
                n, secs = loop.run(idle_until(idle_seconds))
            else:
                step += 1
                arm = arms[name]
                w0 = time.monotonic()
                _, done = arm.start(step)
                n, secs = loop.run(done)
                write = time.monotonic() - w0
            cpu = time.thread_time() - c0
            busy1, t1 = machine_busy()
            others = max(0.0, (busy1 - busy0) - (tree_cpu() - own0)) / ((t1 - t0) * ncpu) * 100
            if name != "idle":
                arms[name].finish()
                arms[name].clean()
            w = Window(n, secs, cpu, others, write)
            out[name].append(w)
            return w

        for rep in range(repeats):
            k = rep % len(names) if names else 0
            prev = window("idle")
            for name in names[k:] + names[:k]:
                w = window(name)
                nxt = window("idle")
                w.slowdown = (1 - w.rate / ((prev.rate + nxt.rate) / 2)) * 100
                say(
                    f"loop {threads} thread(s) #{rep + 1} {name}: {w.rate:.1f} steps/s "
                    f"({w.steps} in {w.seconds:.2f} s; idle around it {prev.rate:.1f}, "
                    f"{nxt.rate:.1f}): {w.slowdown:+.1f}%; others used {w.others:.0f}% of the "
                    "CPU"
                )
                prev = nxt
        return LoopResult(threads, idle_seconds, out)
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------- the report


def size_label(size: int) -> str:
    return f"{size / MiB / 1024:g} GiB" if size >= 1024 * MiB else f"{size / MiB:g} MiB"


def ms(x: float) -> str:
    return f"{x * 1e3:.0f}" if x >= 0.1 else f"{x * 1e3:.1f}"


def render(sizes: List[SizeResult], loops: List[LoopResult], loop_size: int, meta: str) -> str:
    rows: List[Tuple[str, ...]] = []
    for r in sizes:
        if "rgt" not in r.samples or "sync" not in r.samples:
            continue
        a = med([s.blocked for s in r.samples["rgt"]])
        b = med([s.blocked for s in r.samples["sync"]])
        judged = r.size == JUDGED_SIZE
        rows.append(
            (
                f"loop blocked per checkpoint, {size_label(r.size)} state (ms)",
                ms(a),
                f"{ms(b)} (torch.save + fsync)",
                f"{a / b:.3f}x",
                f"≤ {BLOCKED_RATIO_MAX:.2f}x" if judged else "none set (judged at 1 GiB)",
                verdict(a <= BLOCKED_RATIO_MAX * b) if judged else "reported",
            )
        )
    for lr in loops:
        if "rgt" not in lr.windows:
            continue
        idle = med([w.rate for w in lr.windows["idle"]])
        busy = med([w.rate for w in lr.windows["rgt"]])
        slow = med([w.slowdown for w in lr.windows["rgt"]])
        judged = lr.threads == 1
        rows.append(
            (
                f"training steps/s while rgt persists the {size_label(loop_size)} state, loop on "
                f"{lr.threads} thread{'s' if lr.threads > 1 else ''}"
                + (" (all cores)" if lr.threads == os.cpu_count() and lr.threads > 1 else ""),
                f"{busy:.1f}",
                f"{idle:.1f} (idle)",
                # Judged on the paired figure (each busy window against the idle windows
                # around it); the ratio of the plain medians is shown so noise is visible.
                f"{slow:+.1f}% slower (paired; plain medians: {100 * (1 - busy / idle):+.1f}%)",
                f"≤ {SLOWDOWN_MAX:.0f}% slower",
                verdict(slow <= SLOWDOWN_MAX)
                if judged
                else "not judged: would " + ("pass" if slow <= SLOWDOWN_MAX else "fail"),
            )
        )
    table = (
        "| metric | rgt | reference | ratio / slowdown | target | verdict |\n"
        "|---|---:|---:|---:|---|---|\n" + "".join(f"| {' | '.join(r)} |\n" for r in rows)
    )

    # Every arm, every size.
    arms_t = [
        "| state | how | blocked, median (ms) | blocked / sync | end to end, median (s) | "
        "first save: blocked (ms) / end to end (s) |\n",
        "|---|---|---:|---:|---:|---:|\n",
    ]
    for r in sizes:
        sync_b = med([s.blocked for s in r.samples.get("sync", [])])
        for name, label in r.labels.items():
            if name in r.not_run:
                arms_t.append(
                    f"| {size_label(r.size)} | {label} | not run: {r.not_run[name]} | | | |\n"
                )
                continue
            ss, f = r.samples[name], r.first[name]
            b = med([s.blocked for s in ss])
            arms_t.append(
                f"| {size_label(r.size)} | {label} | {ms(b)} | {b / sync_b:.3f}x | "
                f"{med([s.e2e for s in ss]):.2f} | {ms(f.blocked)} / {f.e2e:.2f} |\n"
            )

    # Where the time goes.
    parts = []
    for r in sizes:
        lab = size_label(r.size)
        gb = r.state.nbytes / 1e9
        if "sync" in r.samples:
            ss = r.samples["sync"]
            parts.append(
                f"- {lab}, sync: torch.save {med([s.parts['torch.save'] for s in ss]):.3f} s "
                f"(to the page cache, {gb / med([s.parts['torch.save'] for s in ss]):.2f} GB/s), "
                f"fsync {med([s.parts['fsync'] for s in ss]):.3f} s;\n"
            )
        if "rgt" in r.samples:
            ss = r.samples["rgt"]
            stg = med([s.parts["staging"] for s in ss])
            parts.append(
                f"- {lab}, rgt: `Checkpointer.cost` (state_dict, staging copy, request) "
                f"{stg:.3f} s ({gb / stg:.2f} GB/s); the writer's own write "
                f"{med([s.parts['writer'] for s in ss]):.2f} s using "
                f"{med([s.parts['writer cpu'] for s in ss]):.2f} s of CPU (torch.save into a "
                f"sha256 as it writes, fsync, marker); `Checkpointer(async_save=True)` itself "
                f"(starts the "
                f"writer) {r.construct * 1e3:.0f} ms; first save blocked "
                f"{ms(r.first['rgt'].blocked)} ms (staging buffer faulted in), end to end "
                f"{r.first['rgt'].e2e:.2f} s (the writer imports torch);\n"
            )
        if "rgt-threads" in r.samples:
            ss = r.samples["rgt-threads"]
            parts.append(
                f"- {lab}, rgt with torch's default threads: `Checkpointer.cost` "
                f"{med([s.parts['staging'] for s in ss]):.3f} s (every tensor's copy is a "
                "parallel region; a worker thread whose core another process holds delays each);\n"
            )
        parts.append(
            f"- {lab}: other processes (and kernel threads) used {r.others:.0f}% of the "
            "machine's CPU while these saves ran;\n"
        )
        fl = med(r.copy_floor)
        parts.append(
            f"- {lab}: a bare copy of the state ({r.state.nbytes / MiB:.1f} MiB in "
            f"{len(tensors_of([r.state.model.state_dict(), r.state.opt.state_dict()]))} tensors) "
            f"into a preallocated, already-touched buffer: {ms(fl)} ms ({gb / fl:.2f} GB/s), the "
            "floor for any design that copies the state before writing it;\n"
        )

    loops_t = []
    if loops:
        arm_names = [n for n in ("rgt", "dcp", "dcp-process") if n in loops[0].windows]
        labels = {
            "idle": "idle",
            "rgt": "rgt",
            "dcp": "DCP (thread)",
            "dcp-process": "DCP (process)",
        }
        loops_t.append(
            "| training loop | in flight | steps/s | slowdown | loop's CPU per step (ms) | "
            "write, save() to done (s) | other processes' CPU (% of all cores) |\n"
        )
        loops_t.append("|---|---|---:|---:|---:|---:|---:|\n")
        for lr in loops:
            for n in ["idle", *arm_names]:
                ws = lr.windows[n]
                slow_s = f"{med([w.slowdown for w in ws]):+.1f}%" if n != "idle" else ""
                write = f"{med([w.write for w in ws]):.2f}" if n != "idle" else ""
                loops_t.append(
                    f"| {lr.threads} thread{'s' if lr.threads > 1 else ''} | {labels[n]} | "
                    f"{med([w.rate for w in ws]):.1f} | {slow_s} | "
                    f"{med([w.cpu / w.steps for w in ws]) * 1e3:.2f} | {write} | "
                    f"{med([w.others for w in ws]):.0f} |\n"
                )

    every = []
    for r in sizes:
        for name, ss in r.samples.items():
            every.append(
                f"- {size_label(r.size)} {name}: blocked "
                + ", ".join(ms(s.blocked) for s in ss)
                + " ms; end to end "
                + ", ".join(f"{s.e2e:.2f}" for s in ss)
                + " s"
            )
    for lr in loops:
        for name, ws in lr.windows.items():
            every.append(
                f"- loop, {lr.threads} thread(s), {name}: "
                + ", ".join(
                    f"{w.rate:.1f}" + ("" if name == "idle" else f" ({w.slowdown:+.1f}%)")
                    for w in ws
                )
                + " steps/s"
            )

    out = meta + "\n" + table + "\nEvery way of saving, side by side:\n\n" + "".join(arms_t)
    if loops_t:
        out += (
            f"\nThe training loop while a persist of the {size_label(loop_size)} state is in "
            f"flight (medians over windows; an idle window lasts {loops[0].idle_seconds:.1f} s; "
            "the slowdown of each in-flight window is against the mean of the idle windows just "
            "before and after it; the loop's CPU per step is its thread's own CPU time, which a "
            "core lost to another process does not raise; other processes' CPU includes kernel "
            "threads, such as the writeback of these writes):\n\n" + "".join(loops_t)
        )
    out += "\nWhere the time goes (medians), and for scale:\n\n" + "".join(parts)
    out += "\nEvery timed run, in order:\n\n" + "\n".join(every) + "\n"
    return out


# ---------------------------------------------------------------- the README


def update_readme(path: str, body: str) -> None:
    """Replace what lies between the markers, keeping the CUDA block inside them as it is;
    append the section if the markers are missing."""
    with open(path) as f:
        text = f.read()
    cuda = f"{CUDA_BEGIN}\n{CUDA_PLACEHOLDER}{CUDA_END}"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        inner, tail = rest.split(END, 1)
        if CUDA_BEGIN in inner and CUDA_END in inner:
            cuda = CUDA_BEGIN + inner.split(CUDA_BEGIN, 1)[1].split(CUDA_END, 1)[0] + CUDA_END
    else:
        head, tail = text.rstrip("\n") + "\n\n", "\n"
    text = head + f"{BEGIN}\n{body}\n{cuda}\n{END}" + tail
    with open(path, "w") as f:
        f.write(text)


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument(
        "--sizes-mib", default="64,1024", help="state sizes, comma-separated (default 64,1024)"
    )
    ap.add_argument("--repeats", type=int, default=3, help="timed saves per arm and size (3)")
    ap.add_argument(
        "--loop-repeats", type=int, default=5, help="windows per arm of measurement 2 (5)"
    )
    ap.add_argument(
        "--save-threads",
        type=int,
        default=1,
        help="torch threads while saving (default 1; the default count is measured beside it)",
    )
    ap.add_argument(
        "--loop-threads",
        default="1",
        help="torch threads of the training loop, comma-separated (default 1; e.g. 1,2)",
    )
    ap.add_argument("--no-loop", action="store_true", help="skip measurement 2")
    ap.add_argument("--no-dcp-process", action="store_true", help="skip DCP's process executor arm")
    ap.add_argument("--no-drop-caches", action="store_true", help="keep the page cache warm")
    ap.add_argument("--workdir", default=None, help="where the temporary directory goes")
    ap.add_argument("--readme", default=README, help="README to update (default bench/README.md)")
    ap.add_argument("--no-readme", action="store_true", help="only print the report")
    args = ap.parse_args(argv)
    try:
        sizes = [int(x) * MiB for x in args.sizes_mib.split(",") if x.strip()]
        loop_threads = [int(x) for x in args.loop_threads.split(",") if x.strip()]
    except ValueError:
        ap.error("--sizes-mib, --loop-threads: comma-separated whole numbers")
    if not sizes or min(sizes) < 1 or args.repeats < 1 or args.loop_repeats < 1:
        ap.error("need sizes >= 1 MiB and repeats >= 1")
    if not loop_threads or min(loop_threads) < 1 or args.save_threads < 1:
        ap.error("need threads >= 1")

    signal.signal(signal.SIGTERM, _terminate)
    default_threads = torch.get_num_threads()
    torch.set_num_threads(args.save_threads)
    onbox = commit_of("onbox")
    started = datetime.datetime.now(datetime.timezone.utc)
    results: List[SizeResult] = []
    loops: List[LoopResult] = []
    with contextlib.ExitStack() as stack:
        tmp = tempfile.mkdtemp(prefix="bench-stall-", dir=args.workdir)
        stack.callback(shutil.rmtree, tmp, ignore_errors=True)  # runs last: LIFO
        box = Box(tmp, not args.no_drop_caches)
        say(f"page cache {'dropped' if box.drop else 'warm (cannot drop it)'} before timed runs")
        dcp_why = start_dcp()
        stack.callback(stop_dcp)
        if dcp_why:
            say(f"DCP: not run: {dcp_why}")
        last_arms: Dict[str, Arm] = {}
        for i, size in enumerate(sizes):
            res, arms = measure_size(
                box, size, args.repeats, dcp_why, not args.no_dcp_process, default_threads
            )
            results.append(res)
            if i == len(sizes) - 1:
                last_arms = arms
                for a in arms.values():
                    stack.callback(a.close)
            else:
                for a in arms.values():
                    a.close()
        big = results[-1]
        if not args.no_loop and "rgt" in last_arms:
            idle_s = max(MIN_WINDOW, med([s.e2e for s in big.samples["rgt"]]))
            in_flight = {n: a for n, a in last_arms.items() if n in ("rgt", "dcp", "dcp-process")}
            for threads in loop_threads:
                loops.append(measure_loop(box, in_flight, threads, args.loop_repeats, idle_s))
        versions = f"Python {platform.python_version()}, torch {torch.__version__}"
        meta = (
            f"Measured {started.strftime('%Y-%m-%d %H:%M UTC')}; machine: {machine()}; "
            f"{versions}; CPU only (tensors in host memory); checkpoints written to a temporary "
            f"directory on {fs_type(tmp)}, one disk; `sync`"
            + (" and a page-cache drop" if box.drop else " (the page cache is not dropped)")
            + f" before every timed save and window; medians of {args.repeats} timed saves per "
            f"arm (after one untimed first save each) and of {args.loop_repeats} windows per arm "
            f"of the loop; torch threads for the saves: {args.save_threads} (torch's default "
            f"here: {default_threads}); "
            f"onbox at {onbox}.\n"
        )
        body = render(results, loops, big.size, meta)
    print(body)
    if not args.no_readme:
        update_readme(args.readme, body)
        say(f"wrote {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
