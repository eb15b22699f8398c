"""Hugging Face Accelerate under rgt: ``Accelerator.save_state``/``load_state`` into sealed,
verified ``step_<N>`` directories, saved when the agent asks.

    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration
    from onbox.train.accelerate import AcceleratorCheckpointer

    acc = Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    ckpt = AcceleratorCheckpointer(acc, interval=600)
    step = ckpt.load()                       # 0 when starting fresh
    while step < total:
        ...one optimizer step...
        step += 1
        if ckpt.should_checkpoint(step):     # asked by the agent, interval, or preemption
            ckpt.save(step)

``save(step)`` has every process write ``accelerator.save_state`` into a hidden temporary
directory under ``RGT_CKPT_DIR`` (the model, optimizer, schedulers, GradScaler, every RNG, the
state of each prepared ``StatefulDataLoader`` and whatever was ``register_for_checkpointing``-ed);
the main process then hashes every file into rgt's ``.rgt-complete`` marker (the format of
onbox/train/ckptdir.py, with ``"format": "accelerate"``), fsyncs, and renames it to ``step_<N>``:
the
agent's sealer never sees a half-written checkpoint. ``load()`` takes RGT_RESUME_FROM, else the
newest complete ``step_<N>`` in ``RGT_CKPT_DIR``, checks every file against the marker's sha256
(a checkpoint named by RGT_RESUME_FROM must verify; among scanned ones a damaged one is skipped
for the one before it), then calls ``accelerator.load_state``; it returns the step.

``should_checkpoint`` and the preemption handling are those of :class:`onbox.train.Checkpointer`
(SIGUSR2 or the request file, ``interval``, SIGTERM): after a preemption, ``save`` ends the
process with status 143 once the checkpoint is in place, unless ``exit_on_preempt=False``. In a
multi-process run the decision is agreed across processes (any one asked), so all save together.

Exactness needs the data order restored too: a ``StatefulDataLoader``
(``DataLoaderConfiguration(use_stateful_dataloader=True)``, torchdata installed), whose position
``save_state`` records, or ``accelerator.skip_first_batches`` with a seedable sampler. Do not use
``ProjectConfiguration(automatic_checkpoint_naming=True)``: it ignores the directory given.
``accelerate`` itself is not imported here: the functions take the ``Accelerator`` you made.

``publish_dir`` (mark an existing directory complete and rename it into place) is the generic
step, also used by onbox.train.lightning for sharded checkpoints; ``resync_rng_on_first_iter``
fits any loop that restores the RNGs before its data loader makes an iterator.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import sys
import time
from typing import Any, Dict, List, Optional, Tuple, Union

from onbox.common import jobenv
from onbox.common.durable import fsync_dir, fsync_file, sha256_file
from onbox.common.errors import CheckpointError, CheckpointWriteFailed
from onbox.train import Checkpointer, ckptdir
from onbox.train.snapshot import resync_rng_on_first_iter

__all__ = [
    "AcceleratorCheckpointer",
    "FORMAT",
    "complete_checkpoints",
    "publish_dir",
    "resync_rng_on_first_iter",
    "verify_dir",
]

FORMAT = "accelerate"


def publish_dir(tmp: str, final: str, step: int, fmt: str) -> str:
    """Make the directory ``tmp`` (written, not yet visible) the complete checkpoint ``final``:
    fsync and hash every file into rgt's marker (written last), then rename ``tmp`` to ``final``
    (replacing one saved at the same step before) and fsync the parent. ``tmp`` must sit in the
    same directory as ``final`` under a name the sealer skips (a leading dot)."""
    files: Dict[str, Dict[str, Any]] = {}
    for dirpath, dirnames, filenames in os.walk(tmp):
        dirnames.sort()
        for fn in sorted(filenames):
            path = os.path.join(dirpath, fn)
            rel = os.path.relpath(path, tmp).replace(os.sep, "/")
            if rel == ckptdir.MARKER:
                continue
            fsync_file(path)
            sha, size = sha256_file(path)
            files[rel] = {"size": size, "sha256": sha}
        fsync_dir(dirpath)
    marker = {"step": int(step), "format": fmt, "files": files, "created": time.time()}
    ckptdir.put_in_place(tmp, final, marker)
    return final


def verify_dir(path: str) -> Dict[str, Any]:
    """The marker of the checkpoint directory ``path`` after checking the size and sha256 of
    every file it lists (any format: the caller judges it); raises CheckpointError naming the
    first that is missing or altered."""
    return ckptdir.verify(path, fmt=None)


def complete_checkpoints(ckpt_dir: str, fmt: Optional[str] = FORMAT) -> List[Tuple[int, str]]:
    """(step, path) of every ``step_<N>`` directory with rgt's marker of format ``fmt`` (any
    format when None) in ``ckpt_dir``, newest first. Only the marker is read, not the files."""
    out = []
    for step, path in ckptdir.complete(ckpt_dir):
        if fmt is not None:
            try:
                with open(os.path.join(path, ckptdir.MARKER)) as f:
                    if json.load(f).get("format") != fmt:
                        continue
            except (OSError, ValueError, AttributeError):
                continue
        out.append((step, path))
    return out


class AcceleratorCheckpointer:
    """Saves and restores an ``Accelerator``'s whole state as rgt checkpoints; see the module
    docstring. ``dir`` defaults to RGT_CKPT_DIR (else ./checkpoints); the newest ``keep`` (1 or
    more) of its own checkpoints are kept, and always the one just saved; ``interval``,
    ``exit_on_preempt`` and ``handle_signals`` are Checkpointer's."""

    def __init__(
        self,
        accelerator: Any,
        dir: Optional[str] = None,
        *,
        keep: int = 3,
        interval: Union[float, str, None] = None,
        exit_on_preempt: bool = True,
        handle_signals: bool = True,
        safe_serialization: bool = True,
    ) -> None:
        project = getattr(accelerator, "project_configuration", None)
        if getattr(project, "automatic_checkpoint_naming", False):
            raise ValueError(
                "ProjectConfiguration(automatic_checkpoint_naming=True) makes save_state ignore "
                "the directory rgt gives it; turn it off"
            )
        self.accelerator = accelerator
        self.ckpt = Checkpointer(
            dir,
            keep=keep,
            interval=interval,
            exit_on_preempt=exit_on_preempt,
            handle_signals=handle_signals,
        )
        self.dir = self.ckpt.dir
        self.keep = keep  # checked by Checkpointer
        self.safe_serialization = safe_serialization
        self.step = 0  # the step of the last save or load

    @property
    def preempted(self) -> bool:
        """True once SIGTERM (or the agent's preemption request) arrived: save now, then end."""
        return self.ckpt.preempted

    def should_checkpoint(self, step: Optional[int] = None) -> bool:
        """True (on every process) when any process was asked, the interval passed, or a
        preemption came. Reports ``step`` to the agent from the main process."""
        acc = self.accelerator
        want = self.ckpt.should_checkpoint(step if acc.is_main_process else None)
        if acc.num_processes < 2:
            return want
        import torch

        t = torch.tensor([int(want), int(self.ckpt.preempted)], device=acc.device)
        want_any, preempted_any = (bool(v > 0) for v in acc.reduce(t, reduction="sum").tolist())
        if preempted_any:
            self.ckpt.mark_preempted()  # every process saves, then every process ends
        return want_any

    def report(self, step: int, **metrics: Any) -> None:
        """Tell the agent the step (and metrics such as ``loss``), from the main process."""
        if self.accelerator.is_main_process:
            self.ckpt.report(step, **metrics)

    def save(self, step: int) -> str:
        """``accelerator.save_state`` as the complete checkpoint ``step_<step>``; its path. After
        a preemption, ends the process (status 143) once it is in place."""
        acc = self.accelerator
        name = ckptdir.name_for(step)
        final = os.path.join(self.dir, name)
        # The same temporary name on every process: they all write into one directory.
        tmp = os.path.join(self.dir, f".{name}.rgt-tmp.accelerate")
        token = self.ckpt.begin_save()  # the request this save answers, and its start
        try:
            if acc.is_main_process:
                os.makedirs(self.dir, exist_ok=True)
                ckptdir.clean_stale(self.dir)
                shutil.rmtree(tmp, ignore_errors=True)
                os.makedirs(tmp)
            acc.wait_for_everyone()
            acc.save_state(tmp, safe_serialization=self.safe_serialization)
            acc.wait_for_everyone()
            if acc.is_main_process:
                publish_dir(tmp, final, step, FORMAT)
                found = complete_checkpoints(self.dir)  # its own format's only
                ckptdir.prune(self.dir, self.keep, protect=final, found=found)
        except OSError as e:
            if acc.is_main_process:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointWriteFailed(
                f"writing checkpoint step {step} to {self.dir} failed: {e.strerror or e}",
                "free space or inodes on the checkpoint disk; the previous one is intact",
            ) from None
        acc.wait_for_everyone()
        self.step = int(step)
        if self.preempted and self.ckpt.exit_on_preempt:
            print(
                f"rgt: preempted: {name} saved, exiting for the agent to resume",
                file=sys.stderr,
                flush=True,
            )
        self.ckpt.saved(step, token)  # answers the request, reports; preempted: SystemExit(143)
        return final

    def latest(self) -> Optional[str]:
        """The checkpoint ``load()`` would use, without loading it: RGT_RESUME_FROM's directory
        (a file in one names it), else the newest local one that load's scan accepts (the same
        link rule; its marker and its files' sizes checked, not their sha256: one altered
        without a change of size is skipped by load only). None when load would start at 0."""
        explicit = os.environ.get(jobenv.RESUME_FROM)
        if explicit:
            return os.path.dirname(explicit) if os.path.isfile(explicit) else explicit
        sized = functools.partial(ckptdir.verify, fmt=None, hashes=False)
        found = ckptdir.newest_verified(complete_checkpoints(self.dir), sized, say=False)
        return found[1] if found else None

    def load(self, path: Optional[str] = None) -> int:
        """``accelerator.load_state`` from ``path``, RGT_RESUME_FROM or the newest verified local
        checkpoint; the step to continue from (0 when there is none)."""
        explicit = path or os.environ.get(jobenv.RESUME_FROM) or None
        if explicit:
            if os.path.isfile(explicit):
                explicit = os.path.dirname(explicit)
            return self._load_from(explicit)
        found = ckptdir.newest_verified(complete_checkpoints(self.dir), verify_dir)
        if found is None:
            return 0
        _, cand, marker = found
        return self._load_from(cand, marker)

    def _load_from(self, path: str, marker: Optional[Dict[str, Any]] = None) -> int:
        if marker is None:
            marker = verify_dir(path)
        if marker.get("format") != FORMAT:
            raise CheckpointError(
                f"{path} is a checkpoint of format {marker.get('format')!r}, not {FORMAT!r}",
                "resume it with the API that wrote it (onbox.train.Checkpointer for format 1)",
            )
        self.accelerator.load_state(path)
        # load_state restored the RNGs; the loaders' first iterators must not move them.
        prepared = getattr(self.accelerator, "_dataloaders", None) or []
        resync_rng_on_first_iter([getattr(dl, "base_dataloader", dl) for dl in prepared])
        self.step = int(marker["step"])
        self.ckpt.step = self.step
        self.ckpt.last_save_at = time.monotonic()
        self.report(self.step)
        return self.step

    def close(self) -> None:
        self.ckpt.close()
