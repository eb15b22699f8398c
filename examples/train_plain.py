"""A plain PyTorch loop on rgt's training API: exact resume and async checkpoints in five lines.

    python examples/train_plain.py [--steps 200] [--ckpt-every 25] [--sleep 0] [--sync]

The model is a small MLP with dropout, trained by AdamW under a warmup-then-cosine LR schedule
on a fixed synthetic dataset, reshuffled every epoch. Dropout draws from torch's global RNG,
the input noise from NumPy's, the label-smoothing jitter from Python's ``random``: an exact
resume must restore all three generators, the optimizer, the scheduler and the data position.
``onbox.train.Checkpointer`` does all of it:

    ckpt = Checkpointer(async_save=True, interval="auto", model=model, optimizer=opt,
                        scheduler=sched)
    step = ckpt.load()                       # RGT_RESUME_FROM, the newest local one, or 0
    ...
        if step % every == 0 or ckpt.should_checkpoint(step):
            ckpt.save(step, extra={"epoch": epoch})

Each step prints ``step N attempt A loss L``; the end prints the sha256 of the weights, of the
optimizer state and of the RNG states, so an uninterrupted run and one killed and resumed any
number of times can be compared. Under rgt-agent it checkpoints to ``RGT_CKPT_DIR``; by hand, to
``./checkpoints``.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import random
import time
from typing import Any, Tuple

import numpy as np
import torch
from torch import nn

from onbox.train import Checkpointer

SEED = 7
N_SAMPLES = 8192
N_IN = 64
BATCH = 256
WARMUP = 20


def make_data() -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(N_SAMPLES, N_IN, generator=g)
    w = torch.randn(N_IN, 1, generator=g) / N_IN**0.5
    return x, torch.tanh(3 * (x @ w))


def tensor_sha(obj: Any) -> str:
    """sha256 over every tensor and number in ``obj``, in a fixed order."""
    h = hashlib.sha256()

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            h.update(x.detach().cpu().contiguous().numpy().tobytes())
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                h.update(str(k).encode())
                walk(x[k])
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        else:
            h.update(repr(x).encode())

    walk(obj)
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--ckpt-every", type=int, default=25)
    ap.add_argument("--sleep", type=float, default=0.0, help="seconds per step (for tests)")
    ap.add_argument("--sync", action="store_true", help="synchronous saves")
    args = ap.parse_args()

    torch.manual_seed(SEED)
    random.seed(SEED)
    np.random.seed(SEED)
    torch.use_deterministic_algorithms(True)
    x, y = make_data()
    model = nn.Sequential(nn.Linear(N_IN, 128), nn.GELU(), nn.Dropout(0.1), nn.Linear(128, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)

    def lr_at(step: int) -> float:
        if step < WARMUP:
            return (step + 1) / WARMUP
        return 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / max(1, args.steps - WARMUP)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    ckpt = Checkpointer(
        async_save=not args.sync, interval="auto", model=model, optimizer=opt, scheduler=sched
    )
    step = ckpt.load()
    attempt = os.environ.get("RGT_ATTEMPT", "-")
    if step:
        print(f"resumed at step {step} (epoch {ckpt.extra.get('epoch')})", flush=True)
    per_epoch = N_SAMPLES // BATCH
    while step < args.steps:
        epoch, index = divmod(step, per_epoch)
        # The data order is a function of the epoch: the position is (epoch, index) = step.
        order = torch.randperm(N_SAMPLES, generator=torch.Generator().manual_seed(SEED + epoch))
        batch = order[index * BATCH : (index + 1) * BATCH]
        noise = torch.from_numpy(np.random.normal(0, 0.05, (BATCH, N_IN)).astype(np.float32))
        target = y[batch] * (1 - 0.05 * random.random())
        loss = nn.functional.mse_loss(model(x[batch] + noise), target)
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        sched.step()
        step += 1
        print(f"step {step} attempt {attempt} loss {loss.item():.6f}", flush=True)
        if args.sleep:
            time.sleep(args.sleep)
        if step % args.ckpt_every == 0 or ckpt.should_checkpoint(step):
            ckpt.save(step, extra={"epoch": epoch})
    ckpt.close()
    rng = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(legacy=False)["state"]["key"].tolist(),
    }
    print(f"weights sha256 {tensor_sha(model.state_dict())}")
    print(f"optimizer sha256 {tensor_sha(opt.state_dict())}")
    print(f"rng sha256 {tensor_sha(rng)}")


if __name__ == "__main__":
    main()
