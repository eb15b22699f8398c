"""The goodput harness's training job: a real PyTorch CPU loop paced to a known step time.

    python bench/goodput/gp_job.py --steps N --step-time S [--ckpt-every-s P] [--keep 2]

A small MLP trained by AdamW on a fixed synthetic dataset with dropout and input noise (torch's,
NumPy's and Python's generators all drawn from), checkpointed through rgt's training API
(``onbox.train.Checkpointer``; synchronous saves: the asynchronous writer is a second torch
import at every start, and the model is small), so that resume is exact. Each step computes,
then sleeps out the rest of ``--step-time``: the step time is known, and the CPU the harness's
four setups share is mostly idle. A checkpoint's blocking time adds to the step it follows.

It checkpoints when the agent asks (under rgt-agent: its trigger, SIGTERM) and, with
``--ckpt-every-s P``, every P seconds of its own (what a script run by hand does). It never
checkpoints on its own SIGTERM outside rgt (a script's default: SIGTERM ends it).

Output, one line each, flushed: ``resumed at step N``, ``step N attempt A at T`` (T: wall
clock), ``saved step N blocked X`` (seconds the loop waited for the save), and at the end the
``weights/optimizer/rng sha256`` lines of examples/statehash.py, for the exactness check.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import numpy as np
import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
import statehash  # noqa: E402

from onbox.train import Checkpointer  # noqa: E402

SEED = 11
N_SAMPLES = 2048
N_IN = 32
BATCH = 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--step-time", type=float, required=True, help="seconds per step")
    ap.add_argument("--ckpt-every-s", type=float, default=0.0, help="own checkpoint period")
    ap.add_argument("--keep", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    random.seed(SEED)
    np.random.seed(SEED)
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(N_SAMPLES, N_IN, generator=g)
    y = torch.tanh(x @ torch.randn(N_IN, 1, generator=g))
    model = nn.Sequential(nn.Linear(N_IN, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ckpt = Checkpointer(keep=args.keep, model=model, optimizer=opt)
    step = ckpt.load()
    attempt = os.environ.get("RGT_ATTEMPT", "-")
    if step:
        print(f"resumed at step {step}", flush=True)
    own_at = time.monotonic()
    per_epoch = N_SAMPLES // BATCH
    while step < args.steps:
        t0 = time.monotonic()
        epoch, index = divmod(step, per_epoch)
        order = torch.randperm(N_SAMPLES, generator=torch.Generator().manual_seed(SEED + epoch))
        batch = order[index * BATCH : (index + 1) * BATCH]
        noise = torch.from_numpy(np.random.normal(0, 0.05, (BATCH, N_IN)).astype(np.float32))
        loss = nn.functional.mse_loss(model(x[batch] + noise), y[batch] * random.uniform(0.9, 1))
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        step += 1
        print(f"step {step} attempt {attempt} at {time.time():.3f}", flush=True)
        own = args.ckpt_every_s > 0 and time.monotonic() - own_at >= args.ckpt_every_s
        if own or ckpt.should_checkpoint(step):
            t1 = time.monotonic()
            ckpt.save(step)
            own_at = time.monotonic()
            print(f"saved step {step} blocked {own_at - t1:.4f}", flush=True)
        time.sleep(max(0.0, args.step_time - (time.monotonic() - t0)))
    ckpt.close()
    print(f"weights sha256 {statehash.sha256_of(model.state_dict())}")
    print(f"optimizer sha256 {statehash.sha256_of(opt.state_dict())}")
    print(f"rng sha256 {statehash.sha256_of(statehash.rng_state())}", flush=True)


if __name__ == "__main__":
    main()
