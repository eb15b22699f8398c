"""A tiny Hugging Face Transformers ``Trainer`` run that resumes exactly under rgt.

A 2-layer GPT-2 built from a config (no download) learns a fixed synthetic token dataset on the
CPU, with dropout, a warmup + linear decay schedule and a shuffled loader over several epochs, so
an exact resume needs the weights, AdamW's moments, the scheduler, the RNGs and the data order.

    python examples/train_hf.py [--steps 60] [--save-steps 20] [--sleep 0]

Under ``rgt-agent`` the Trainer's ``output_dir`` is ``RGT_CKPT_DIR``: its ``checkpoint-<N>/``
directories are sealed by the agent as they appear, and ``onbox.train.hf.RgtCallback`` saves
one when the agent asks (``checkpoint.trigger``) and before ending on a preemption.
``resume_checkpoint`` picks the checkpoint to resume from. Run by hand, it writes to
``./ckpt-hf``. The last line carries the sha256 of the final weights, optimizer state and RNG
state: an uninterrupted run and one killed and resumed print the same three.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Dict, List, Optional

import torch
from statehash import rng_state, sha256_of  # examples/statehash.py, beside this script
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    PrinterCallback,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
    set_seed,
)
from transformers.utils import logging as hf_logging

from onbox.train.hf import RgtCallback, resume_checkpoint

SEED = 1234
VOCAB = 128
SEQ = 32
N_SAMPLES = 256
BATCH = 16  # 16 optimizer steps per epoch


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Fixed sequences (noisy arithmetic progressions mod VOCAB): the same on every run."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(SEED)
        start = torch.randint(0, VOCAB, (N_SAMPLES, 1), generator=g)
        stride = torch.randint(1, 8, (N_SAMPLES, 1), generator=g)
        seq = (start + stride * torch.arange(SEQ)) % VOCAB
        noise = torch.rand(N_SAMPLES, SEQ, generator=g) < 0.1
        self.ids = torch.where(noise, torch.randint(0, VOCAB, (N_SAMPLES, SEQ), generator=g), seq)

    def __len__(self) -> int:
        return N_SAMPLES

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Show(TrainerCallback):
    """One line per logged step (and an optional pause, to make the demo watchable)."""

    def __init__(self, sleep: float) -> None:
        self.sleep = sleep
        self.attempt = os.environ.get("RGT_ATTEMPT") or "-"

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: Optional[Dict[str, Any]] = None,
        **kw: Any,
    ) -> None:
        if logs and "loss" in logs:
            print(f"step {state.global_step} loss {logs['loss']:.6f} attempt {self.attempt}")

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if self.sleep:
            time.sleep(self.sleep)


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--steps", type=int, default=60, help="optimizer steps (default 60)")
    p.add_argument("--save-steps", type=int, default=20, help="the Trainer's save_steps")
    p.add_argument("--sleep", type=float, default=0.0, help="extra seconds per step")
    p.add_argument("--out", help="output_dir (default: RGT_CKPT_DIR, else ./ckpt-hf)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.save_steps < 1 or args.sleep < 0:
        p.error("--steps >= 1, --save-steps >= 1 and --sleep >= 0, please")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # the same reduction order on every run
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call, unused-ignore]
    out = os.path.abspath(args.out or os.environ.get("RGT_CKPT_DIR") or "ckpt-hf")
    set_seed(SEED)
    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=VOCAB,
            n_positions=SEQ,
            n_embd=64,
            n_layer=2,
            n_head=2,
            bos_token_id=0,
            eos_token_id=0,
        )
    )
    targs = TrainingArguments(
        output_dir=out,
        max_steps=args.steps,
        per_device_train_batch_size=BATCH,
        learning_rate=3e-3,
        warmup_steps=5,
        lr_scheduler_type="linear",
        weight_decay=0.01,
        save_strategy="steps",
        save_steps=args.save_steps,
        save_total_limit=3,
        logging_steps=1,
        seed=SEED,
        full_determinism=True,
        dataloader_num_workers=0,
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model,
        args=targs,
        train_dataset=Tokens(),
        callbacks=[RgtCallback(), Show(args.sleep)],
    )
    trainer.remove_callback(PrinterCallback)  # Show prints one line per step instead
    resume = resume_checkpoint(out)
    if resume:
        print(f"resumed from {os.path.basename(resume)}", flush=True)
    trainer.train(resume_from_checkpoint=resume)
    assert trainer.optimizer is not None
    print(
        f"done: step {trainer.state.global_step} "
        f"weights sha256 {sha256_of(model.state_dict())} "
        f"optimizer sha256 {sha256_of(trainer.optimizer.state_dict())} "
        f"rng sha256 {sha256_of(rng_state())}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
