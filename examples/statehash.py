"""The sha256 of training state, for the examples to print at their end.

An uninterrupted run and one killed and resumed print the same three hashes (weights, optimizer
state, RNG states) exactly when the resume was exact: tests/integration/test_exact_frameworks.py
compares them. The examples import this module from their own directory (Python puts a script's
directory first on ``sys.path``), run by hand or by the agent from a pushed release, which holds
the whole project. It is the examples' check, not part of the training API (``onbox.train``
needs nothing beyond the standard library and torch; this needs NumPy too).
"""

from __future__ import annotations

import hashlib
import random
from typing import Any, Dict

import numpy as np
import torch


def _feed(h: Any, obj: Any) -> None:
    """Hash nested state (dicts in key order, tensors and arrays by their bytes)."""
    if isinstance(obj, dict):
        for k in sorted(obj, key=str):
            h.update(f"<{k}>".encode())
            _feed(h, obj[k])
    elif isinstance(obj, (list, tuple)):
        h.update(b"[")
        for v in obj:
            _feed(h, v)
        h.update(b"]")
    elif isinstance(obj, torch.Tensor):
        h.update(str(obj.dtype).encode() + str(tuple(obj.shape)).encode())
        h.update(obj.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, np.ndarray):
        h.update(obj.tobytes())
    else:
        h.update(repr(obj).encode())


def sha256_of(obj: Any) -> str:
    """The sha256 of ``obj``: a state dict, or any nesting of dicts, lists, tensors and arrays."""
    h = hashlib.sha256()
    _feed(h, obj)
    return h.hexdigest()


def rng_state() -> Dict[str, Any]:
    """The states of Python's, NumPy's and torch's global generators."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
