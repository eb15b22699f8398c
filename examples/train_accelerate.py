"""A tiny Hugging Face Accelerate run that resumes exactly under rgt.

An MLP with dropout regresses a fixed synthetic dataset on the CPU, with AdamW, a one-cycle
schedule and a shuffled ``StatefulDataLoader`` over several epochs; each step also draws a
random input-noise level from Python's ``random``. ``onbox.train.accelerate`` saves
``accelerator.save_state`` as sealed ``step_<N>`` checkpoints (every ``--save-steps``, when the
agent asks, and before ending on a preemption) and loads the newest one at start.

    python examples/train_accelerate.py [--steps 120] [--save-steps 25] [--sleep 0]

Run by hand, it checkpoints to ``./ckpt-accelerate``. The last line carries the sha256 of the
final weights, optimizer state and RNG state: an uninterrupted run and one killed and resumed
print the same three.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from typing import List, Optional

import torch
from accelerate import Accelerator
from accelerate.utils import (
    DataLoaderConfiguration,
    set_seed,
)
from statehash import rng_state, sha256_of  # examples/statehash.py, beside this script
from torch import nn
from torchdata.stateful_dataloader import (
    StatefulDataLoader,
)

from onbox.train.accelerate import AcceleratorCheckpointer

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


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--steps", type=int, default=120, help="optimizer steps (default 120)")
    p.add_argument("--save-steps", type=int, default=25, help="checkpoint every K steps")
    p.add_argument("--sleep", type=float, default=0.0, help="extra seconds per step")
    p.add_argument("--out", help="checkpoint dir (default: RGT_CKPT_DIR, else ./ckpt-accelerate)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.save_steps < 1 or args.sleep < 0:
        p.error("--steps >= 1, --save-steps >= 1 and --sleep >= 0, please")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # the same reduction order on every run
    torch.use_deterministic_algorithms(True)
    out = os.path.abspath(args.out or os.environ.get("RGT_CKPT_DIR") or "ckpt-accelerate")
    attempt = os.environ.get("RGT_ATTEMPT") or "-"
    acc = Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True)
    )
    set_seed(SEED)
    model = nn.Sequential(nn.Linear(N_IN, 128), nn.GELU(), nn.Dropout(0.1), nn.Linear(128, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=args.steps)
    loader = StatefulDataLoader(make_data(), batch_size=BATCH, shuffle=True, drop_last=True)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)

    ckpt = AcceleratorCheckpointer(acc, out)
    step = ckpt.load()
    if step:
        print(f"resumed from step_{step} at step {step}", flush=True)
    per_epoch = len(loader)
    while step < args.steps:
        for x, y in loader:  # a resumed loader starts where the checkpoint left it
            sigma = random.uniform(0.0, 0.05)
            loss = nn.functional.mse_loss(model(x + sigma * torch.randn_like(x)), y)
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            print(
                f"step {step} epoch {(step - 1) // per_epoch} loss {loss.item():.6f} "
                f"attempt {attempt}",
                flush=True,
            )
            if step % 10 == 0:
                ckpt.report(step, loss=loss.item())
            if ckpt.should_checkpoint(step) or step % args.save_steps == 0:
                ckpt.save(step)
            if args.sleep:
                time.sleep(args.sleep)
            if step >= args.steps:
                break
    ckpt.close()
    print(
        f"done: step {step} "
        f"weights sha256 {sha256_of(acc.unwrap_model(model).state_dict())} "
        f"optimizer sha256 {sha256_of(opt.state_dict())} "
        f"rng sha256 {sha256_of(rng_state())}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
