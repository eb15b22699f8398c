"""A tiny, deterministic PyTorch CPU training that resumes exactly: the rgt demo job.

A 2-layer MLP regresses a fixed synthetic dataset (made from a seeded generator). Each step
draws a random minibatch (torch RNG) and a random input-noise level (Python ``random``), so an
exact resume has to restore both generators along with the model and the Adam state.

    python examples/train_tiny.py [--steps 300] [--ckpt-every 20] [--sleep 0.05]

Under ``rgt-agent`` it reads the job environment: ``RGT_CKPT_DIR`` (where checkpoints go),
``RGT_RESUME_FROM`` (a restored checkpoint to load first) and ``RGT_ATTEMPT`` (printed on each
line). Run by hand, it checkpoints to ``./ckpt``. Checkpoints are ``step_<N>.pt``, written
atomically (temp file, fsync, rename, fsync of the directory); the newest 3 are kept. At the
end it prints the sha256 of the final weights: an uninterrupted run and a run killed with
SIGKILL and resumed print the same one.

Standalone on purpose: it imports nothing from rgt.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import re
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

SEED = 1234
N_SAMPLES = 65536
N_IN = 32
HIDDEN = 96
BATCH = 16384
LR = 3e-3
KEEP = 3
FORMAT = 1
_CKPT_RE = re.compile(r"step_(\d+)\.pt\Z")
_TMP_RE = re.compile(r"\.step_\d+\.pt\.tmp\.\d+\Z")


def make_data() -> Tuple[torch.Tensor, torch.Tensor]:
    """The fixed dataset: the same tensors on every run, whatever the global RNG did."""
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(N_SAMPLES, N_IN, generator=g)
    w = torch.randn(N_IN, 1, generator=g) / N_IN**0.5
    y = torch.sin(2.0 * (x @ w)) + 0.1 * torch.randn(N_SAMPLES, 1, generator=g)
    return x, y


def make_model() -> nn.Sequential:
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(N_IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))


# ---- checkpoints
def ckpt_step(name: str) -> Optional[int]:
    m = _CKPT_RE.match(name)
    return int(m.group(1)) if m else None


def list_ckpts(ckpt_dir: str) -> List[Tuple[int, str]]:
    """(step, path) of every checkpoint in ``ckpt_dir``, newest first."""
    try:
        names = os.listdir(ckpt_dir)
    except FileNotFoundError:
        return []
    found = [(s, os.path.join(ckpt_dir, n)) for n in names if (s := ckpt_step(n)) is not None]
    return sorted(found, reverse=True)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def py_rng_state() -> Dict[str, Any]:
    """Python's ``random`` state as a tensor and plain values (loadable with weights_only)."""
    version, internal, gauss_next = random.getstate()
    return {
        "version": version,
        "internal": torch.tensor(internal, dtype=torch.int64),
        "gauss_next": gauss_next,
    }


def set_py_rng_state(d: Dict[str, Any]) -> None:
    internal = tuple(int(v) for v in d["internal"].tolist())
    random.setstate((int(d["version"]), internal, d["gauss_next"]))


def save_ckpt(
    ckpt_dir: str, step: int, model: nn.Module, opt: torch.optim.Optimizer, loss: float
) -> str:
    """Write ``step_<step>.pt`` atomically, then keep only the newest ``KEEP``."""
    state = {
        "format": FORMAT,
        "step": step,
        "loss": loss,
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "py_rng": py_rng_state(),
    }
    final = os.path.join(ckpt_dir, f"step_{step}.pt")
    tmp = os.path.join(ckpt_dir, f".step_{step}.pt.tmp.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(ckpt_dir)
    for _, old in list_ckpts(ckpt_dir)[KEEP:]:
        try:
            os.unlink(old)
        except FileNotFoundError:
            pass
    return final


def remove_stale_temps(ckpt_dir: str) -> None:
    """Temp files of a writer that was killed mid-save (never complete, never loaded)."""
    for n in os.listdir(ckpt_dir):
        if _TMP_RE.match(n) and not n.endswith(f".{os.getpid()}"):
            try:
                os.unlink(os.path.join(ckpt_dir, n))
            except FileNotFoundError:
                pass


def load_ckpt(path: str, model: nn.Module, opt: torch.optim.Optimizer) -> Tuple[int, float]:
    """Restore everything from ``path``; return its step and loss. Raises if unreadable."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{path} is not a train_tiny checkpoint (format {FORMAT})")
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    torch.set_rng_state(state["torch_rng"])
    set_py_rng_state(state["py_rng"])
    return int(state["step"]), float(state["loss"])


def resume(ckpt_dir: str, model: nn.Module, opt: torch.optim.Optimizer) -> Tuple[int, float]:
    """Load RGT_RESUME_FROM if set, else the newest loadable checkpoint: (step, loss)."""
    explicit = os.environ.get("RGT_RESUME_FROM", "")
    if explicit:
        step, loss = load_ckpt(explicit, model, opt)  # asked for by name: bad is an error
        print(f"resumed from {os.path.basename(explicit)} at step {step}", flush=True)
        return step, loss
    for _, path in list_ckpts(ckpt_dir):
        try:
            step, loss = load_ckpt(path, model, opt)
        except Exception as e:  # a damaged file: fall back to the one before it
            print(
                f"warning: cannot load {path}: {e}; trying an older checkpoint",
                file=sys.stderr,
                flush=True,
            )
            continue
        print(f"resumed from {os.path.basename(path)} at step {step}", flush=True)
        return step, loss
    return 0, float("nan")


def weights_sha256(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode() + b"\0")
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


# ---- training
def train_step(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> float:
    idx = torch.randint(0, x.shape[0], (BATCH,))
    sigma = random.uniform(0.0, 0.05)
    xb = x[idx] + sigma * torch.randn(BATCH, x.shape[1])
    opt.zero_grad(set_to_none=True)
    loss = nn.functional.mse_loss(model(xb), y[idx])
    loss.backward()  # type: ignore[no-untyped-call]
    opt.step()
    return float(loss.item())


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--steps", type=int, default=300, help="total steps (default 300)")
    p.add_argument(
        "--ckpt-every",
        type=int,
        default=20,
        metavar="K",
        help="checkpoint every K steps (default 20)",
    )
    p.add_argument(
        "--sleep",
        type=float,
        default=0.05,
        metavar="S",
        help="extra seconds per step, to make the demo watchable (default 0.05)",
    )
    args = p.parse_args(argv)
    if args.steps < 0 or args.ckpt_every < 1 or args.sleep < 0:
        p.error("--steps >= 0, --ckpt-every >= 1 and --sleep >= 0, please")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    random.seed(SEED)
    ckpt_dir = os.path.abspath(os.environ.get("RGT_CKPT_DIR") or "ckpt")
    os.makedirs(ckpt_dir, exist_ok=True)
    remove_stale_temps(ckpt_dir)
    attempt = os.environ.get("RGT_ATTEMPT") or "-"

    x, y = make_data()
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    step, loss = resume(ckpt_dir, model, opt)
    while step < args.steps:
        loss = train_step(model, opt, x, y)
        step += 1
        print(f"step {step} loss {loss:.6f} attempt {attempt}", flush=True)
        if step % args.ckpt_every == 0 or step == args.steps:
            save_ckpt(ckpt_dir, step, model, opt, loss)
        if args.sleep:
            time.sleep(args.sleep)
    print(f"done: step {step} loss {loss:.6f} weights sha256 {weights_sha256(model)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
