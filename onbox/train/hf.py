"""Hugging Face Transformers ``Trainer`` under rgt: save when the agent asks, stop on preemption,
resume from the checkpoint the agent restored.

    import os
    from transformers import Trainer, TrainingArguments
    from onbox.train.hf import RgtCallback, resume_checkpoint

    args = TrainingArguments(output_dir=os.environ.get("RGT_CKPT_DIR", "out"), save_steps=500, ...)
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[RgtCallback()])
    trainer.train(resume_from_checkpoint=resume_checkpoint(args.output_dir))

**output_dir must be RGT_CKPT_DIR**: the Trainer writes ``checkpoint-<step>/`` there and the
agent seals each one once it holds ``trainer_state.json``, which the Trainer writes last (after
the weights, optimizer, scheduler and RNG states). The callback warns when they differ.

``RgtCallback`` holds a :class:`onbox.train.Checkpointer` with no objects of its own: it only
uses its listening (the agent's SIGUSR2 or ``$RGT_RUN_DIR/checkpoint.request``, SIGTERM, the
``interval``) and progress reports. At each optimizer step's end it sets
``control.should_save`` when the agent asked or the interval passed, so the Trainer's own
``_save_checkpoint`` writes ``checkpoint-<step>`` (weights, optimizer, scheduler, RNG and trainer
state: everything its exact resume needs); the request file is removed once that checkpoint is
written. After SIGTERM (a preemption) it saves at the end of the step that is running, then
ends the process with status 143 (``exit_on_preempt=True``, the default), so the agent restarts
it rather than taking it for a success; with ``exit_on_preempt=False`` it stops training
instead (``control.should_training_stop``) and the script must check ``callback.preempted``
and exit non-zero itself. Every logged loss (``logging_steps``) is reported to the agent.

``resume_checkpoint`` is the directory to pass to ``trainer.train(resume_from_checkpoint=...)``:
``RGT_RESUME_FROM`` when it is a complete Trainer checkpoint, else the newest complete
``checkpoint-<N>`` in ``output_dir`` (one the last attempt wrote and died before sealing), else
None (a fresh start). Unlike ``transformers.trainer_utils.get_last_checkpoint`` it skips a
``checkpoint-<N>`` cut off by a kill while it was written (the Trainer does not write it
atomically), so a restart never fails on a torn directory.

Exactness: the Trainer restores the model, optimizer, scheduler, the RNGs and the data order
(``accelerator_config.use_seedable_sampler``, on by default, plus skipping the batches already
trained in the epoch), so a run killed and resumed ends with the same weights as one that was
not, given ``seed`` (or ``full_determinism=True``) and ``dataloader_num_workers=0`` or a
deterministic dataset. ``save_only_model=True`` checkpoints cannot resume exactly (no
optimizer or RNG state): the callback warns.

Distributed (torchrun): every rank holds its own callback; the decision to save (and to stop on
preemption) is agreed across ranks with one all-reduce per step, so all ranks save together.
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any, Dict, List, Optional, Tuple, Union

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as _e:  # pragma: no cover - exercised where transformers is missing
    raise ImportError(
        "onbox.train.hf needs Hugging Face Transformers: "
        "pip install 'remote-gpu-trainer[transformers]' (or pip install transformers in the "
        "job's Python)"
    ) from _e

from onbox.common import jobenv
from onbox.common.errors import CheckpointError
from onbox.train import PREEMPT_EXIT, Checkpointer, SaveToken, ckptdir

__all__ = ["RgtCallback", "resume_checkpoint", "complete_checkpoints", "is_complete"]

TRAINER_STATE = "trainer_state.json"  # written last by Trainer._save_checkpoint: the marker
_CHECKPOINT = re.compile(r"checkpoint-(\d+)\Z")
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def is_complete(path: str) -> bool:
    """Whether ``path`` is a whole Trainer checkpoint: its ``trainer_state.json`` (written last)
    parses, and it holds the model's weights."""
    try:
        with open(os.path.join(path, TRAINER_STATE)) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return False
    if not isinstance(doc, dict) or "global_step" not in doc:
        return False
    try:
        names = set(os.listdir(path))
    except OSError:
        return False
    # A PEFT adapter or a sharded/FSDP model saves under other names: any weights will do.
    return bool(names & set(_WEIGHTS)) or any(
        n.endswith((".safetensors", ".bin")) or n.startswith("pytorch_model_fsdp") for n in names
    )


def _found(output_dir: str) -> List[Tuple[int, str]]:
    """(step, path) of every ``checkpoint-<N>`` directory in ``output_dir``, newest first."""
    try:
        names = os.listdir(output_dir)
    except OSError:
        return []
    found = []
    for n in names:
        m = _CHECKPOINT.match(n)
        path = os.path.join(output_dir, n)
        if m and os.path.isdir(path):
            found.append((int(m.group(1)), path))
    return sorted(found, reverse=True)


def complete_checkpoints(output_dir: str) -> List[str]:
    """Every complete ``checkpoint-<N>`` in ``output_dir``, newest (highest N) first."""
    return [p for _, p in _found(output_dir) if is_complete(p)]


def _verify(path: str) -> Dict[str, Any]:
    """Nothing, when ``path`` is a complete Trainer checkpoint; else CheckpointError."""
    if not is_complete(path):
        raise CheckpointError(
            f"{path} is not a complete Trainer checkpoint (no readable {TRAINER_STATE} next "
            "to the weights: cut off while written)",
            "use an older checkpoint",
        )
    return {}


def resume_checkpoint(output_dir: Optional[str] = None) -> Optional[str]:
    """The checkpoint to pass as ``trainer.train(resume_from_checkpoint=...)``: RGT_RESUME_FROM
    when it is a complete Trainer checkpoint, else the newest complete ``checkpoint-<N>`` in
    ``output_dir`` (default RGT_CKPT_DIR), else None. An incomplete newer one is skipped with a
    line on stderr; a ``checkpoint-<N>`` symlink counts only when it leads to a checkpoint in
    ``output_dir`` (ckptdir.newest_verified)."""
    explicit = os.environ.get(jobenv.RESUME_FROM) or ""
    if explicit:
        path = explicit if os.path.isdir(explicit) else os.path.dirname(explicit)
        if is_complete(path):
            return os.path.abspath(path)
        print(
            f"rgt: RGT_RESUME_FROM={explicit} is not a complete Trainer checkpoint "
            f"(no readable {TRAINER_STATE} next to the weights); looking for checkpoint-N",
            file=sys.stderr,
            flush=True,
        )
    where = output_dir or os.environ.get(jobenv.CKPT_DIR) or ""
    if not where:
        return None
    # The rule every adapter resumes by: a cut-off one is skipped, said on stderr; a link
    # counts through its target in the dir, one out of it is skipped (never sealed).
    found = ckptdir.newest_verified(_found(where), _verify)
    return os.path.abspath(found[1]) if found else None


class RgtCallback(TrainerCallback):
    """Save on the agent's request and on preemption; report progress. See the module docstring.

    ``interval``: also save every that many seconds (or ``"auto"``: Daly from the measured
    save time), on top of the Trainer's own ``save_steps``. ``checkpointer``: an existing
    ``Checkpointer`` to listen through instead of a new one (one process should hold one).
    """

    def __init__(
        self,
        *,
        interval: Union[float, str, None] = None,
        exit_on_preempt: bool = True,
        handle_signals: bool = True,
        checkpointer: Optional[Checkpointer] = None,
    ) -> None:
        self.ckpt = checkpointer or Checkpointer(
            interval=interval, exit_on_preempt=exit_on_preempt, handle_signals=handle_signals
        )
        self._token: Optional[SaveToken] = None  # what the save in progress answers

    @property
    def preempted(self) -> bool:
        """True once a preemption was seen (here or, in a distributed run, on any rank)."""
        return self.ckpt.preempted

    # ---- Trainer events
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        ckpt_dir = os.environ.get(jobenv.CKPT_DIR)
        if ckpt_dir and state.is_world_process_zero:
            out = os.path.realpath(args.output_dir or "")
            if out != os.path.realpath(ckpt_dir):
                print(
                    f"rgt: TrainingArguments.output_dir is {args.output_dir}, not RGT_CKPT_DIR "
                    f"({ckpt_dir}): the agent will not seal the Trainer's checkpoints; "
                    f"use output_dir=os.environ['RGT_CKPT_DIR']",
                    file=sys.stderr,
                    flush=True,
                )
        if getattr(args, "save_only_model", False) and state.is_world_process_zero:
            print(
                "rgt: save_only_model=True: checkpoints hold no optimizer, scheduler or RNG "
                "state, so a restart cannot resume exactly",
                file=sys.stderr,
                flush=True,
            )
        if state.is_world_process_zero:
            self.ckpt.report(int(state.global_step))

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        step = int(state.global_step)
        want = self.ckpt.should_checkpoint(step if state.is_world_process_zero else None)
        want, stop = _any_rank([want, self.ckpt.preempted], args)
        if stop:
            self.ckpt.mark_preempted()  # every rank saves, then every rank ends
            control.should_save = True
            control.should_training_stop = True
        elif want:
            control.should_save = True
        if control.should_save:
            self._token = self.ckpt.begin_save()

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        # Trainer._save_checkpoint has returned: checkpoint-<step> is whole on disk.
        token, self._token = self._token or self.ckpt.begin_save(), None
        if self.preempted:
            _barrier(args)  # every rank has written its part before any rank ends
            if self.ckpt.exit_on_preempt:
                print(
                    f"rgt: preempted: checkpoint-{state.global_step} saved, exiting "
                    f"({PREEMPT_EXIT}) for the agent to resume",
                    file=sys.stderr,
                    flush=True,
                )
        # Answers the request, reports the step, measures "auto"; on preemption (with
        # exit_on_preempt) raises SystemExit(143).
        self.ckpt.saved(int(state.global_step), token)

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: Optional[Dict[str, Any]] = None,
        **kw: Any,
    ) -> None:
        if not state.is_world_process_zero or not logs:
            return
        metrics = {k: v for k, v in logs.items() if k in ("loss", "learning_rate", "grad_norm")}
        if metrics:
            self.ckpt.report(int(state.global_step), **metrics)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if state.is_world_process_zero:
            self.ckpt.report(int(state.global_step))


def _any_rank(flags: List[bool], args: TrainingArguments) -> List[bool]:
    """``flags`` OR-ed over every rank (one all-reduce; none when not distributed)."""
    import torch

    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return flags
    t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32, device=args.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(v) for v in t.tolist()]


def _barrier(args: TrainingArguments) -> None:
    import torch

    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
