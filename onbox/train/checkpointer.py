"""The training-side API: exact resume, cheap checkpoints, and listening to the agent.

    from onbox.train import Checkpointer

    ckpt = Checkpointer(model=model, optimizer=opt, scheduler=sched, loader=loader)
    step = ckpt.load()                      # 0 when starting fresh
    while step < total:
        train_one_step(...)
        step += 1
        if ckpt.should_checkpoint(step):    # asked by the agent, interval, or preemption
            ckpt.save(step, extra={"epoch": epoch})
    ckpt.close()

``Checkpointer`` takes the objects that make up the training state by name: anything with
``state_dict()``/``load_state_dict()`` (models, optimizers, LR schedulers, GradScaler, a
``StatefulDataLoader``, a sampler). ``save`` stores them with the random number generators
(Python, NumPy, torch CPU and CUDA), the step and the caller's extras (plain data and tensors)
as one checkpoint directory (onbox/train/ckptdir.py) that appears whole or not at all and carries
rgt's completeness marker, so the agent seals it. ``load`` restores all of it from
``RGT_RESUME_FROM`` (the checkpoint the agent restored) or else the newest complete local one,
verifying every file's sha256 and loading weights-only; it returns the step to continue from.

**Async save** (``async_save=True``): the loop is blocked only while the state is copied into
host memory (one memfd, reused; page-locked when CUDA is present and ``pin=True``); a writer
process (onbox/train/writer.py) serialises, fsyncs and renames it. At most one write is in flight:
``should_checkpoint`` says no while one runs, so requests that arrive meanwhile coalesce into
the next save (a preemption makes ``save`` wait instead). A failed write is raised as
CheckpointWriteFailed from the next call into the API, never dropped.

**When to checkpoint** (``should_checkpoint``): when the agent asks (``RGT_CKPT_TRIGGER``:
SIGUSR2 or ``$RGT_RUN_DIR/checkpoint.request``), when ``interval`` seconds passed since the last
save, or after SIGTERM (a preemption). ``interval="auto"`` picks the interval by Daly's
higher-order formula (onbox/common/daly.py, the one the agent's ``checkpoint.interval = "auto"``
uses), from the measured cost C of a checkpoint (the time the loop is blocked) and the
mean time between failures M (onbox/train/mtbf.py: ``RGT_MTBF`` seconds from the job's
environment, else observed from this incarnation's restarts, else 4 h), and prints what it
chose; a value no run could have (an unusable ``RGT_MTBF``, a damaged state.json) is passed
over, never raised out of ``save``. After SIGTERM, the save that follows ends the process
once the checkpoint is written (exit status 143), unless ``exit_on_preempt=False``; a second
SIGTERM ends it at once.

Progress: ``should_checkpoint(step)`` and ``save`` report the step to the agent
and the last save's cost (``$RGT_RUN_DIR/progress.json``, onbox/common/progress.py): the agent
checks that a resumed job does not start below its restore step; its auto interval uses the cost.

Runs in the box's own Python: standard library and torch only (NumPy, safetensors when used).
Outside rgt (no ``RGT_*`` variables) it works on ``./checkpoints`` and never signals anything.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
import time
from typing import Any, Dict, Optional, Tuple, Union

from onbox.common import daly, jobenv, progress
from onbox.common.errors import CheckpointError, CheckpointWriteFailed
from onbox.common.rundir import CHECKPOINT_HOLD, CHECKPOINT_REQUEST
from onbox.train import ckptdir, mtbf, snapshot
from onbox.train.writer import Writer

__all__ = ["Checkpointer", "CheckpointError", "CheckpointWriteFailed", "SaveToken"]

FIRST_AUTO_INTERVAL = 120.0  # before a checkpoint's cost has been measured
MIN_AUTO_INTERVAL = 10.0
PROGRESS_EVERY = 1.0  # seconds between progress reports (a rename each)
PREEMPT_EXIT = 128 + int(signal.SIGTERM)


class SaveToken:
    """What a save written by a framework answers, and when it began (``begin_save``)."""

    __slots__ = ("request", "started")

    def __init__(self, request: Optional[Any], started: float) -> None:
        self.request = request
        self.started = started


class Checkpointer:
    """Saves and restores one training state; see the module docstring."""

    def __init__(
        self,
        dir: Optional[str] = None,
        *,
        keep: int = 3,
        interval: Union[float, str, None] = None,
        async_save: bool = False,
        safetensors: bool = False,
        pin: bool = True,
        exit_on_preempt: bool = True,
        handle_signals: bool = True,
        **objects: Any,
    ) -> None:
        for name, obj in objects.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(f"{name}: {type(obj).__name__} has no state_dict/load_state_dict")
            if not name.isidentifier():
                raise ValueError(f"{name!r}: object names must be identifiers")
        if interval is not None and interval != "auto" and float(interval) <= 0:
            raise ValueError(f"interval must be positive seconds or 'auto', not {interval!r}")
        if safetensors:
            import safetensors as _  # noqa: F401  (fail here, not at the first save)
        self.dir = os.path.abspath(dir or os.environ.get(jobenv.CKPT_DIR) or "checkpoints")
        self.keep = ckptdir.check_keep(keep)
        self.interval = interval
        self.async_save = async_save
        self.safetensors = safetensors
        self.exit_on_preempt = exit_on_preempt
        self.objects = objects
        self.run_dir = os.environ.get(jobenv.RUN_DIR) or None
        self.attempt = int(os.environ.get(jobenv.ATTEMPT) or 0)
        self.trigger = os.environ.get(jobenv.CKPT_TRIGGER, "none")
        self.request_path = (
            os.path.join(self.run_dir, CHECKPOINT_REQUEST)
            if self.run_dir and self.trigger == "file"
            else None
        )
        self.extra: Dict[str, Any] = {}  # the extras of the checkpoint ``load`` restored
        self.step = 0  # the step of the last save or load
        self.last_save_at = time.monotonic()
        self.cost: Optional[float] = None  # seconds the loop was blocked by the last save
        self._last_save: Optional[Tuple[int, float]] = None  # (step, cost), for the agent
        self.write_seconds: Optional[float] = None  # the last background write, end to end
        self.chosen_interval: Optional[float] = None
        self._asked = threading.Event()
        self._preempted = threading.Event()
        self._request_sig: Optional[Any] = None  # the request file this save answers
        self._pending_error: Optional[BaseException] = None
        self._progress_at = 0.0
        self._reported = 0  # the last step reported, throttled or not
        self._held = False  # the disk probe's hold was seen (said once per hold)
        self._writer: Optional[Writer] = None
        self._staging: Optional[snapshot.Staging] = None
        self._pin = pin
        ckptdir.clean_stale(self.dir)  # before load: a killed replacement's step goes back
        if async_save:
            self._writer = Writer()
            self._writer.start()
            self._staging = snapshot.Staging(pin=pin)
        if handle_signals:
            self._install_signals()

    # ---- signals and requests
    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        if self.trigger.startswith("signal:"):
            signum = getattr(signal, "SIG" + self.trigger.split(":", 1)[1], None)
            if signum is not None:
                signal.signal(signum, lambda *_: self._asked.set())
        if os.environ.get(jobenv.RUN):
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self._preempted.set()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process

    @property
    def preempted(self) -> bool:
        """True once SIGTERM arrived or the agent asked for a checkpoint because of a
        preemption: save now, then end."""
        return self._preempted.is_set()

    def _request(self) -> Optional[Any]:
        if self.request_path is None:
            return None
        try:
            st = os.stat(self.request_path)
        except FileNotFoundError:
            return None
        try:
            with open(self.request_path) as f:
                if '"preemption"' in f.read():
                    self._preempted.set()
        except OSError:
            pass
        return (st.st_ino, st.st_mtime_ns)

    def _answer_request(self) -> None:
        """The agent's request file goes once the checkpoint that answers it is written (and
        only that request: a newer one stays for the next save)."""
        sig, self._request_sig = self._request_sig, None
        if sig is None or self.request_path is None:
            return
        try:
            st = os.stat(self.request_path)
            if (st.st_ino, st.st_mtime_ns) == sig:
                os.unlink(self.request_path)
        except FileNotFoundError:
            pass

    # ---- deciding
    def should_checkpoint(self, step: Optional[int] = None) -> bool:
        """True when a checkpoint is due: asked by the agent, interval elapsed, or preempted.
        Raises the error of a failed background write. Reports ``step`` to the agent."""
        self._collect()
        if step is not None:
            self.report(step)
        if self.preempted:
            return True
        if self._writer is not None and self._writer.inflight is not None:
            return False  # one write at a time: what is asked now is served by the next save
        if self._asked.is_set() or self._request() is not None:
            return True
        every = self.current_interval()
        return every is not None and time.monotonic() - self.last_save_at >= every

    def current_interval(self) -> Optional[float]:
        """Seconds between checkpoints now (None: only when asked)."""
        if self.interval is None:
            return None
        if self.interval != "auto":
            return float(self.interval)
        if self.cost is None:
            return FIRST_AUTO_INTERVAL
        return self.chosen_interval

    def _choose_interval(self) -> None:
        """Daly from the measured cost; printed when it changes noticeably."""
        if self.interval != "auto" or self.cost is None:
            return
        m, source = self._mtbf()
        c = max(self.cost, 1e-3)
        every = daly.choose(c, m, MIN_AUTO_INTERVAL)  # never raises, at most a day
        # Never faster than the writer can go (one write in flight) or than is sane.
        every = min(max(every, 1.5 * (self.write_seconds or 0.0)), daly.MAX_INTERVAL)
        old = self.chosen_interval
        self.chosen_interval = every
        if old is None or not 0.5 < every / old < 2:
            print(
                f"rgt: checkpoint interval {every:.0f} s (Daly: checkpoint cost {c:.2f} s, "
                f"mean time between failures {m / 3600:.1f} h, {source})",
                file=sys.stderr,
                flush=True,
            )

    def _mtbf(self) -> Tuple[float, str]:
        return mtbf.mtbf(self.run_dir)

    def report(self, step: int, **metrics: Any) -> None:
        """Tell the agent the job's step and metrics (at most once a second)."""
        self._reported = int(step)
        if self.run_dir is None:
            return
        now = time.monotonic()
        if now - self._progress_at < PROGRESS_EVERY:
            return
        self._progress_at = now
        try:
            progress.write(self.run_dir, step, self.attempt, metrics, save=self._last_save)
        except OSError:
            pass  # advisory: never fail training over it

    # ---- saves written by a framework (onbox/train/hf.py, train_lightning.py, ...)
    def mark_preempted(self) -> None:
        """Treat this process as preempted (e.g. another rank got the SIGTERM)."""
        self._preempted.set()

    def begin_save(self) -> SaveToken:
        """A framework is about to write a checkpoint itself: what that save answers (the
        agent's request as it is now, not one that arrives later) and when it began."""
        token = SaveToken(self._request(), time.monotonic())
        self._asked.clear()
        return token

    def saved(self, step: int, token: SaveToken, seconds: Optional[float] = None) -> None:
        """The framework's checkpoint for ``step`` is whole on disk: answer the request it was
        for, report the step, measure the cost for "auto"; after a preemption this ends the
        process (SystemExit 143) unless exit_on_preempt is False."""
        self._request_sig = token.request
        self.cost = self.write_seconds = (
            time.monotonic() - token.started if seconds is None else seconds
        )
        self._saved(step)

    # ---- saving
    def _tree(self, step: int, extra: Optional[Dict[str, Any]]) -> Any:
        import torch

        weights: Dict[str, Any] = {}
        objects: Dict[str, Any] = {}
        for name, obj in self.objects.items():
            sd = obj.state_dict()
            if self.safetensors and isinstance(obj, torch.nn.Module):
                weights[name] = sd
            else:
                objects[name] = sd
        state = {
            "format": ckptdir.FORMAT,
            "step": int(step),
            "objects": objects,
            "rng": snapshot.rng_state(),
            "extra": dict(extra or {}),
        }
        return state, weights

    def save(self, step: int, extra: Optional[Dict[str, Any]] = None) -> Optional[str]:
        """Checkpoint the registered objects at ``step``. Synchronous: the path once written.
        Async: None once the state is staged (the write goes on in the background). None,
        writing nothing, while the disk probe holds checkpoints back (not after a preemption)."""
        self._collect()
        if self._hold() and not self.preempted:
            return None
        if self._writer is not None and self._writer.inflight is not None:
            # The staging buffer is still being read. That write answers the request it was
            # made for, not one that came since, and never ends the process: after a
            # preemption, the state this save takes is the newest and must land too.
            self._finish(self._writer.wait())
        self._request_sig = self._request()
        self._asked.clear()
        t0 = time.monotonic()
        if not self.async_save:
            state, weights = self._tree(step, extra)
            try:
                path, _ = ckptdir.write(self.dir, step, state, weights or None)
            except OSError as e:
                raise CheckpointWriteFailed(
                    f"writing checkpoint step {step} to {self.dir} failed: {e.strerror or e}",
                    "free space or inodes on the checkpoint disk; the previous one is intact",
                ) from None
            ckptdir.prune(self.dir, self.keep, protect=path)  # whatever steps are above it
            self.cost = self.write_seconds = time.monotonic() - t0
            self._saved(step)
            return path
        if self._writer is None:  # closed earlier: a save after close starts again
            self._writer = Writer()
            self._staging = snapshot.Staging(pin=self._pin)
        assert self._staging is not None
        state, weights = self._tree(step, extra)
        staged = self._staging.stage({"state": state, "weights": weights})
        request = {
            "dir": self.dir,
            "step": int(step),
            "state": staged["state"],
            "weights": staged["weights"],
            "prune": [{"keep": self.keep, "protect": ckptdir.path_for(self.dir, step)}],
            "submitted": time.monotonic(),
        }
        self._writer.submit(request, self._staging.fd)
        self.cost = time.monotonic() - t0
        self.step = int(step)
        self.last_save_at = time.monotonic()
        if self.preempted:
            self._finish(self._writer.wait(), final=True)
        return None

    def _hold(self) -> bool:
        held = bool(self.run_dir) and os.path.exists(f"{self.run_dir}/{CHECKPOINT_HOLD}")
        if held and not self._held:  # said once per hold, not on every call
            print("rgt: disk too full: checkpoint skipped (rgt-agent status)", file=sys.stderr)
        self._held = held
        return held

    def _saved(self, step: int, final: bool = True) -> None:
        """A checkpoint of ``step`` is on disk; ``final``: it is the one a save asked for after
        a preemption would end with (not an earlier write that completed meanwhile)."""
        self.step = int(step)
        self.last_save_at = time.monotonic()
        self._last_save = (self.step, self.cost) if self.cost is not None else self._last_save
        self._answer_request()
        self._choose_interval()
        if self.run_dir is not None:
            try:
                progress.write(self.run_dir, step, self.attempt, save=self._last_save)
            except OSError:
                pass
        if final and self.preempted and self.exit_on_preempt:
            self.close()
            raise SystemExit(PREEMPT_EXIT)

    def _finish(self, reply: Optional[Dict[str, Any]], final: bool = False) -> None:
        if reply is None:
            return
        self.write_seconds = float(reply.get("seconds") or 0.0)
        self._saved(self.step, final)

    def _collect(self) -> None:
        """Take the result of a finished background write; raise its error once."""
        if self._pending_error is not None:
            err, self._pending_error = self._pending_error, None
            raise err
        if self._writer is not None:
            self._finish(self._writer.poll())

    def wait(self) -> None:
        """Block until the background write in flight (if any) is on disk; raise its error."""
        self._collect()
        if self._writer is not None:
            self._finish(self._writer.wait())

    def close(self) -> None:
        """Wait for the write in flight, then stop the writer and free the staging memory."""
        writer, self._writer = self._writer, None
        try:
            if writer is not None and writer.inflight is not None:
                reply = writer.wait()
                if reply is not None:
                    self.write_seconds = float(reply.get("seconds") or 0.0)
                    self._answer_request()
            last = max(self._reported, self.step)
            if self.run_dir is not None and last:
                try:  # the final step, which the once-a-second throttle may have held back
                    progress.write(self.run_dir, last, self.attempt, save=self._last_save)
                except OSError:
                    pass
        finally:
            if writer is not None:
                writer.close()
            if self._staging is not None:
                self._staging.close()
                self._staging = None

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- loading
    def latest(self) -> Optional[str]:
        """The checkpoint ``load()`` would use, without loading it: RGT_RESUME_FROM's directory
        (a file in one names it), else the newest local one that load's scan accepts (the same
        link rule; its marker and its files' sizes checked, not their sha256, which would read
        the whole checkpoint: one altered without a change of size is skipped by load only).
        None when load would start from step 0."""
        resume = os.environ.get(jobenv.RESUME_FROM)
        if resume:
            return ckptdir.named_dir(resume)
        sized = functools.partial(ckptdir.verify, hashes=False)
        found = ckptdir.newest_verified(ckptdir.complete(self.dir), sized, say=False)
        return found[1] if found else None

    def load(self, path: Optional[str] = None) -> int:
        """Restore the registered objects, the RNGs and ``self.extra``; the step to continue
        from (0 when there is nothing to resume). A checkpoint named by ``path`` or by
        RGT_RESUME_FROM must verify; among local ones found by scanning, one that does not is
        skipped with a warning and the next older one is used."""
        explicit = path or os.environ.get(jobenv.RESUME_FROM) or None
        if explicit:
            return self._load_from(self._checkpoint_dir(explicit))
        found = ckptdir.newest_verified(ckptdir.complete(self.dir))
        if found is None:
            return 0
        _, cand, marker = found
        return self._load_from(cand, marker)  # any other refusal is the caller's to fix

    @staticmethod
    def _checkpoint_dir(path: str) -> str:
        path = ckptdir.named_dir(path)
        if not os.path.isdir(path):
            raise CheckpointError(
                f"{path} does not exist or is not an rgt checkpoint directory",
                "check RGT_RESUME_FROM or the path given to load()",
            )
        return path

    def _load_from(self, path: str, marker: Optional[Dict[str, Any]] = None) -> int:
        state, weights = ckptdir.read(path, marker)
        saved = state.get("objects") or {}
        missing = [n for n in self.objects if n not in saved and n not in weights]
        if missing:
            raise CheckpointError(
                f"{path} holds no state for {', '.join(missing)} "
                f"(it has {', '.join(sorted([*saved, *weights])) or 'nothing'})",
                "register the same objects, under the same names, as the run that saved it",
            )
        for name, obj in self.objects.items():
            obj.load_state_dict(weights[name] if name in weights else saved[name])
        snapshot.set_rng_state(state.get("rng") or {})
        # A registered data loader draws its base seed from the global RNG when its first
        # iterator is made, after this restore: put the restored state back right after it.
        import torch

        loaders = [o for o in self.objects.values() if isinstance(o, torch.utils.data.DataLoader)]
        if loaders and state.get("rng"):
            snapshot.resync_rng_on_first_iter(loaders, state["rng"])
        self.extra = dict(state.get("extra") or {})
        self.step = int(state["step"])
        self.last_save_at = time.monotonic()
        self.report(self.step)
        return self.step
