"""PyTorch Lightning under rgt: checkpoints the agent can seal, saved when it asks and before a
preemption ends the run, and the path to resume from.

    import os
    import lightning.pytorch as pl
    from torchdata.stateful_dataloader import StatefulDataLoader
    from onbox.train.lightning import RgtCheckpoint, resume_path

    loader = StatefulDataLoader(dataset, batch_size=32, shuffle=True)   # mid-epoch resume
    trainer = pl.Trainer(max_steps=10_000, callbacks=[RgtCheckpoint(every_n_steps=500)])
    trainer.fit(model, loader, ckpt_path=resume_path())

``RgtCheckpoint`` saves through the trainer's own machinery (``trainer.save_checkpoint``: model,
optimizers, LR schedulers, loops, callbacks, data loader state) into ``RGT_CKPT_DIR`` (else
``./checkpoints``) as ``step_<global_step>.ckpt``: written under a hidden temporary name,
fsynced and renamed, so the agent's sealer never sees half a file. A strategy that saves a
directory (FSDP sharded, DeepSpeed) gets ``step_<N>/`` with rgt's ``.rgt-complete`` marker,
renamed into place the same way. It saves at the end of a training batch (never in the middle
of gradient accumulation) when the agent asks (SIGUSR2 or ``$RGT_RUN_DIR/checkpoint.request``,
through :class:`onbox.train.Checkpointer`), every ``every_n_steps`` optimizer steps, every
``interval`` seconds, and after SIGTERM; then, on a preemption, it ends the process with status
143 (``exit_on_preempt=False``: it sets ``trainer.should_stop`` instead, and the script must
check ``callback.preempted`` and exit non-zero itself). Lightning's own reaction
to SIGTERM (stop and exit with status 0, which looks like success) is turned into status 143 as
well. The decision is agreed across ranks, so all ranks save together. It keeps the newest
``keep`` of its own checkpoints (and always the one just saved), and reports the step and the
logged ``loss`` to the agent.

Lightning does not checkpoint the random number generators; this callback adds them (Python,
NumPy, torch, CUDA) to every checkpoint and restores them when the run resumes, after the
resumed data loader has made its iterator (which draws a seed from the torch RNG).

``resume_path()`` is the ``ckpt_path`` for ``trainer.fit``: RGT_RESUME_FROM when set, else the
newest ``step_<N>`` checkpoint in the directory that verifies (a directory's files against
rgt's marker, a file's zip structure; a damaged one is skipped for the one before it, as
onbox.train.accelerate does), else None (a fresh start).

**Mid-epoch resume needs a stateful data loader.** Use torchdata's ``StatefulDataLoader``
(``pip install torchdata``) instead of ``torch.utils.data.DataLoader``: Lightning saves its
``state_dict()`` (the sampler's position and generator) in the checkpoint and restores it, so the
resumed epoch continues with the next batch of the same order. Do not give it a ``generator=``
(seed the run with ``seed_everything`` instead): torchdata does not record that generator's
draws for the worker seeds, and the next epoch's order changes. With a plain ``DataLoader``,
Lightning warns ("your dataloader is not resumable") and finishes the interrupted epoch with
batches of a fresh shuffle: the run goes on and the step count is right, but it sees other
batches than an uninterrupted run would, so it does not end with the same weights. A dataset
that draws random numbers in the main process (``num_workers=0``) from the global RNG is exact
up to the draws of one prefetched batch; use workers or per-sample seeds.

A save that comes due on an epoch's last batch is taken after the next batch: Lightning 2.x
counts the epoch twice when it resumes from a checkpoint taken after an epoch's last batch
(a ``max_epochs`` run would end an epoch early), and a checkpoint taken in
``on_train_epoch_end`` resumes the ``StatefulDataLoader`` in the wrong order. A SIGTERM on that
very batch ends the run without a new checkpoint (Lightning stops at once); the previous one
is resumed.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
from typing import Any, Dict, List, Optional, Tuple, Union

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
except ImportError as _e:  # pragma: no cover - exercised where lightning is missing
    raise ImportError(
        "onbox.train.lightning needs PyTorch Lightning: "
        "pip install 'remote-gpu-trainer[lightning]' (or pip install lightning torchdata in "
        "the job's Python)"
    ) from _e

from onbox.common import jobenv
from onbox.common.durable import fsync_dir, fsync_file
from onbox.common.errors import CheckpointError
from onbox.common.wholefile import looks_whole
from onbox.train import PREEMPT_EXIT, Checkpointer, ckptdir, snapshot
from onbox.train.accelerate import publish_dir

__all__ = ["RgtCheckpoint", "resume_path", "complete_checkpoints"]

FORMAT = "lightning"
SUFFIX = ".ckpt"
_FILE = re.compile(r"step_(\d+)\.ckpt\Z")
_TMP = re.compile(r"\.step_\d+\.rgt-tmp\.lightning\Z")
_STATE_KEY = "rgt"
REPORT_EVERY = 5.0  # seconds between loss reports (each reads the loss off the device)


def complete_checkpoints(dirpath: str) -> List[Tuple[int, str]]:
    """(step, path) of this callback's checkpoints in ``dirpath``, newest first: every
    ``step_<N>.ckpt`` (complete by construction: renamed into place whole) and every
    ``step_<N>/`` directory with rgt's marker."""
    out = list(ckptdir.complete(dirpath))
    try:
        names = os.listdir(dirpath)
    except OSError:
        return sorted(out, reverse=True)
    for n in names:
        m = _FILE.match(n)
        if m and os.path.isfile(os.path.join(dirpath, n)):
            out.append((int(m.group(1)), os.path.join(dirpath, n)))
    return sorted(out, reverse=True)


def _verify(path: str) -> Dict[str, Any]:
    """Check the checkpoint at ``path`` before a resume: a directory's every file against rgt's
    marker (ckptdir.verify), a file's zip structure (torch.save's format must end with its
    central directory: a cut-off file does not). Its marker (``{}`` for a file); raises
    CheckpointError naming what is wrong."""
    if os.path.isdir(path):
        return ckptdir.verify(path, fmt=None)
    if not looks_whole(path):
        raise CheckpointError(
            f"{path} is not a whole checkpoint file (cut off or damaged: it does not end with "
            "the zip directory torch.save writes last)",
            "use an older checkpoint",
        )
    return {}


def resume_path(dirpath: Optional[str] = None) -> Optional[str]:
    """The ``ckpt_path`` for ``trainer.fit``: RGT_RESUME_FROM when set, else the newest
    checkpoint in ``dirpath`` (default RGT_CKPT_DIR, else ./checkpoints) that ``_verify`` passes
    (a damaged newer one is skipped with a line on stderr; a ``step_N.ckpt`` symlink counts
    only when it leads to a file in the directory: ckptdir.newest_verified), else None."""
    explicit = os.environ.get(jobenv.RESUME_FROM) or ""
    if explicit:
        return os.path.abspath(explicit)
    where = dirpath or os.environ.get(jobenv.CKPT_DIR) or "checkpoints"
    found = ckptdir.newest_verified(complete_checkpoints(where), _verify)
    return found[1] if found else None


class RgtCheckpoint(Callback):
    """Save on the agent's request, every ``every_n_steps`` and on preemption; restore the RNGs
    on resume; report progress. See the module docstring."""

    def __init__(
        self,
        dirpath: Optional[str] = None,
        *,
        every_n_steps: Optional[int] = None,
        interval: Union[float, str, None] = None,
        keep: int = 3,
        exit_on_preempt: bool = True,
        handle_signals: bool = True,
        checkpointer: Optional[Checkpointer] = None,
    ) -> None:
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, not {every_n_steps!r}")
        ckptdir.check_keep(keep)  # here: a checkpointer given has a keep of its own, unused
        self.ckpt = checkpointer or Checkpointer(
            dirpath,
            keep=keep,
            interval=interval,
            exit_on_preempt=exit_on_preempt,
            handle_signals=handle_signals,
        )
        self.dirpath = self.ckpt.dir
        self.every_n_steps = every_n_steps
        self.keep = keep
        self.last_saved: Optional[int] = None  # global_step of the newest save (or the resume)
        self._rng: Optional[Dict[str, Any]] = None  # restored before the first resumed batch
        self._reported_at = 0.0
        self._deferred = False  # a save came due on an epoch's last batch: save after the next

    @property
    def preempted(self) -> bool:
        """True once a preemption was seen (here or, in a distributed run, on any rank)."""
        return self.ckpt.preempted

    # ---- saving
    def save(self, trainer: pl.Trainer) -> str:
        """Checkpoint now (call on every rank); the final path."""
        step = int(trainer.global_step)
        name = ckptdir.name_for(step)
        final = os.path.join(self.dirpath, name + SUFFIX)
        # The same temporary name on every rank: a sharded strategy writes one directory.
        tmp = os.path.join(self.dirpath, f".{name}.rgt-tmp.lightning")
        token = self.ckpt.begin_save()  # the request this save answers, and its start
        if trainer.is_global_zero:
            os.makedirs(self.dirpath, exist_ok=True)
            ckptdir.clean_stale(self.dirpath)  # directories of killed saves
            for n in os.listdir(self.dirpath):  # and files
                if _TMP.match(n):
                    _remove(os.path.join(self.dirpath, n))
        trainer.strategy.barrier("rgt-save-begin")
        try:
            trainer.save_checkpoint(tmp, weights_only=False)  # collective: every rank calls it
            if trainer.is_global_zero:
                if os.path.isdir(tmp):
                    final = os.path.join(self.dirpath, name)
                    publish_dir(tmp, final, step, FORMAT)
                else:
                    fsync_file(tmp)
                    os.replace(tmp, final)
                    fsync_dir(self.dirpath)
                ckptdir.prune(
                    self.dirpath, self.keep, protect=final, found=complete_checkpoints(self.dirpath)
                )
        except BaseException:
            if trainer.is_global_zero:
                _remove(tmp)
            raise
        trainer.strategy.barrier("rgt-save-end")
        self.last_saved = step
        if self.preempted:
            if self.ckpt.exit_on_preempt:
                print(
                    f"rgt: preempted: {os.path.basename(final)} saved, exiting "
                    f"({PREEMPT_EXIT}) for the agent to resume",
                    file=sys.stderr,
                    flush=True,
                )
            else:
                trainer.should_stop = True
        self.ckpt.saved(step, token)  # answers the request, reports; preempted: SystemExit(143)
        return final

    # ---- Lightning hooks
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        step = int(trainer.global_step)
        loop = trainer.fit_loop.epoch_loop
        accumulating = bool(getattr(loop, "_should_accumulate", lambda: False)())
        want = self.ckpt.should_checkpoint(step if trainer.is_global_zero else None)
        if self.every_n_steps and step % self.every_n_steps == 0:
            want = True
        strategy = trainer.strategy
        want = bool(strategy.reduce_boolean_decision(want, all=False))
        preempted = bool(strategy.reduce_boolean_decision(self.ckpt.preempted, all=False))
        if preempted:
            self.ckpt.mark_preempted()  # every rank saves, then every rank ends
        if trainer.is_global_zero and time.monotonic() - self._reported_at >= REPORT_EVERY:
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            if loss is not None:
                self._reported_at = time.monotonic()
                self.ckpt.report(step, loss=loss)
        if accumulating or step == self.last_saved:
            return
        if not (want or preempted or self._deferred):
            return
        if loop.batch_progress.is_last_batch:
            # Not resumable exactly (see the module docstring): save after the next batch.
            self._deferred = True
            if preempted and trainer.received_sigterm:
                # Lightning ends this very batch; the previous checkpoint stands.
                print(
                    "rgt: preempted on an epoch's last batch, where Lightning cannot resume "
                    "from; not saving (the previous checkpoint is resumed)",
                    file=sys.stderr,
                    flush=True,
                )
            return
        self._deferred = False
        self.save(trainer)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            self.ckpt.report(int(trainer.global_step))

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._rng is not None:
            snapshot.set_rng_state(self._rng)
            self._rng = None

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: Dict[str, Any]
    ) -> None:
        checkpoint[_STATE_KEY] = {"rng": snapshot.rng_state(), "step": int(trainer.global_step)}

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: Dict[str, Any]
    ) -> None:
        state = checkpoint.get(_STATE_KEY) or {}
        self.last_saved = int(state.get("step", trainer.global_step) or 0) or None
        # Put back just before the first batch: the resumed loader has made its iterator
        # by then (which draws a seed from the torch RNG) and fetched its first batch.
        self._rng = state.get("rng")

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        if isinstance(exception, SIGTERMException) and exception.code in (None, 0):
            # Lightning ends on SIGTERM with status 0, which the agent would take for success.
            exception.code = PREEMPT_EXIT


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
