"""A tiny PyTorch Lightning run that resumes exactly under rgt, mid-epoch included.

An MLP with dropout regresses a fixed synthetic dataset on the CPU, with AdamW, a one-cycle
schedule stepped every batch, and a shuffled torchdata ``StatefulDataLoader`` (Lightning saves
and restores its position, so a resumed epoch continues with the next batch); each step also
draws a random input-noise level from Python's ``random``. ``onbox.train.lightning.RgtCheckpoint``
saves ``step_<N>.ckpt`` (every ``--save-steps``, when the agent asks, and before ending on a
preemption) and adds the RNG states Lightning leaves out; ``resume_path`` picks the checkpoint.

    python examples/train_lightning.py [--steps 120] [--save-steps 25] [--sleep 0]

Run by hand, it checkpoints to ``./ckpt-lightning``. The last line carries the sha256 of the
final weights, optimizer state and RNG state: an uninterrupted run and one killed and resumed
print the same three.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
import warnings
from typing import Any, List, Optional, Tuple

import lightning.pytorch as pl
import torch
from statehash import rng_state, sha256_of  # examples/statehash.py, beside this script
from torch import nn
from torchdata.stateful_dataloader import (
    StatefulDataLoader,
)

from onbox.train.lightning import RgtCheckpoint, resume_path

SEED = 1234
N_SAMPLES = 2048
N_IN = 16
BATCH = 64  # 32 steps per epoch


def make_data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(N_SAMPLES, N_IN, generator=g)
    w = torch.randn(N_IN, 1, generator=g) / N_IN**0.5
    y = torch.sin(2.0 * (x @ w)) + 0.1 * torch.randn(N_SAMPLES, 1, generator=g)
    return torch.utils.data.TensorDataset(x, y)


class Regressor(pl.LightningModule):
    def __init__(self, total_steps: int, sleep: float) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(N_IN, 128), nn.GELU(), nn.Dropout(0.1), nn.Linear(128, 1)
        )
        self.total_steps = total_steps
        self.sleep = sleep
        self.attempt = os.environ.get("RGT_ATTEMPT") or "-"

    def training_step(self, batch: Tuple[torch.Tensor, torch.Tensor], idx: int) -> torch.Tensor:
        x, y = batch
        sigma = random.uniform(0.0, 0.05)
        loss = nn.functional.mse_loss(self.net(x + sigma * torch.randn_like(x)), y)
        step = self.global_step + 1
        print(
            f"step {step} epoch {self.current_epoch} loss {loss.item():.6f} attempt {self.attempt}",
            flush=True,
        )
        if self.sleep:
            time.sleep(self.sleep)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=self.total_steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--steps", type=int, default=120, help="optimizer steps (default 120)")
    p.add_argument("--save-steps", type=int, default=25, help="checkpoint every K steps")
    p.add_argument("--sleep", type=float, default=0.0, help="extra seconds per step")
    p.add_argument("--out", help="checkpoint dir (default: RGT_CKPT_DIR, else ./ckpt-lightning)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.save_steps < 1 or args.sleep < 0:
        p.error("--steps >= 1, --save-steps >= 1 and --sleep >= 0, please")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # the same reduction order on every run
    # Lightning's advice to add workers to a tiny in-memory dataset is noise here.
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    out = os.path.abspath(args.out or os.environ.get("RGT_CKPT_DIR") or "ckpt-lightning")
    pl.seed_everything(SEED, verbose=False)
    model = Regressor(args.steps, args.sleep)
    loader = StatefulDataLoader(make_data(), batch_size=BATCH, shuffle=True, drop_last=True)
    trainer = pl.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=1,
        deterministic=True,
        logger=False,
        enable_checkpointing=False,  # RgtCheckpoint saves
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[RgtCheckpoint(out, every_n_steps=args.save_steps)],
    )
    ckpt_path = resume_path(out)
    if ckpt_path:
        print(f"resumed from {os.path.basename(ckpt_path)}", flush=True)
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    opt = trainer.optimizers[0]
    print(
        f"done: step {trainer.global_step} "
        f"weights sha256 {sha256_of(model.state_dict())} "
        f"optimizer sha256 {sha256_of(opt.state_dict())} "
        f"rng sha256 {sha256_of(rng_state())}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
