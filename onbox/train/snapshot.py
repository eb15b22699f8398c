"""Taking a training state apart into a structure and tensor bytes, and putting it back.

A snapshot of the training state is made in two parts so that the loop is blocked only for a
memory copy: the *structure* (dicts, lists, numbers, strings, with each tensor replaced by a
``TensorRef``) and the tensors' bytes, copied into one shared-memory buffer (``Staging``, a
memfd: not a file in /dev/shm, so a 64 MiB /dev/shm does not limit it). A writer process maps
the same buffer and serialises from it while training goes on (onbox/train/writer.py).

Also here: the random number generators a resume must restore (Python, NumPy, torch CPU and
CUDA), in a form ``torch.load(weights_only=True)`` accepts.

Standard library at import; torch (and NumPy, when present) are imported when first used.
"""

from __future__ import annotations

import mmap
import os
import random
from typing import Any, Dict, List, Optional, Tuple

ALIGN = 64  # every tensor starts on a cache line: any dtype's view is aligned


class TensorRef:
    """Where a tensor of the structure lives in the staging buffer."""

    __slots__ = ("index", "offset", "nbytes", "dtype", "shape")

    def __init__(self, index: int, offset: int, nbytes: int, dtype: str, shape: Tuple[int, ...]):
        self.index = index
        self.offset = offset
        self.nbytes = nbytes
        self.dtype = dtype  # "float32", "bfloat16", ...: torch.<dtype>
        self.shape = shape

    def __reduce__(self) -> Tuple[Any, ...]:
        return (TensorRef, (self.index, self.offset, self.nbytes, self.dtype, self.shape))


def _torch() -> Any:
    import torch

    return torch


# ---------------------------------------------------------------- the structure


def flatten(tree: Any) -> Tuple[Any, List[Any]]:
    """(structure with TensorRefs, tensors in order). Offsets are filled in by ``Staging``."""
    torch = _torch()
    tensors: List[Any] = []

    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            if x.is_sparse or x.is_quantized or x.is_nested:
                raise TypeError(f"cannot checkpoint a {x.layout} tensor; convert it to dense")
            tensors.append(x)
            ref = TensorRef(len(tensors) - 1, 0, x.numel() * x.element_size(), "", tuple(x.shape))
            ref.dtype = str(x.dtype).replace("torch.", "")
            return ref
        if isinstance(x, dict):  # OrderedDicts (state_dict()) become dicts: loads take either
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, tuple):
            return tuple(walk(v) for v in x)
        return x

    return walk(tree), tensors


def unflatten(structure: Any, tensor_of: Any) -> Any:
    """The tree back, each TensorRef replaced by ``tensor_of(ref)``."""

    def walk(x: Any) -> Any:
        if isinstance(x, TensorRef):
            return tensor_of(x)
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, tuple):
            return tuple(walk(v) for v in x)
        return x

    return walk(structure)


def refs(structure: Any) -> List[TensorRef]:
    """Every TensorRef in the structure, in order."""
    out: List[TensorRef] = []

    def walk(x: Any) -> None:
        if isinstance(x, TensorRef):
            out.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(structure)
    return sorted(out, key=lambda r: r.index)


# ---------------------------------------------------------------- the staging buffer


class Staging:
    """One memfd-backed buffer, reused from snapshot to snapshot (grown when needed), that the
    writer process maps by file descriptor. With CUDA present and ``pin`` asked for, it is
    registered as page-locked memory so device-to-host copies run at full speed."""

    def __init__(self, pin: bool = False) -> None:
        self.fd = os.memfd_create("rgt-snapshot", getattr(os, "MFD_CLOEXEC", 1))
        self.size = 0
        self.mm: Optional[mmap.mmap] = None
        self.pin = pin
        self.pinned = False
        self._buf: Any = None  # a uint8 tensor over the whole mapping

    def _ensure(self, size: int) -> None:
        if size <= self.size and self.mm is not None:
            return
        self._unpin()
        if self.mm is not None:
            self._buf = None
            self.mm.close()
        size = max(size, ALIGN)
        os.ftruncate(self.fd, size)
        # Fault every page in at once (one call, not a fault per page during the first copy).
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        self.mm = mmap.mmap(self.fd, size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        self.size = size
        torch = _torch()
        self._buf = torch.frombuffer(self.mm, dtype=torch.uint8)
        if self.pin and torch.cuda.is_available():
            rc = torch.cuda.cudart().cudaHostRegister(self._buf.data_ptr(), size, 0)
            self.pinned = int(rc) == 0

    def _unpin(self) -> None:
        if self.pinned:
            _torch().cuda.cudart().cudaHostUnregister(self._buf.data_ptr())
            self.pinned = False

    def stage(self, tree: Any) -> Any:
        """Copy every tensor of ``tree`` into the buffer; the structure to send to the writer.
        This is the only part of an async save that blocks the training loop."""
        torch = _torch()
        structure, tensors = flatten(tree)
        all_refs = refs(structure)
        offset = 0
        for ref in all_refs:
            ref.offset = offset
            offset += -(-ref.nbytes // ALIGN) * ALIGN
        self._ensure(offset)
        cuda = False
        # One thread: a memory copy saturates a core's bandwidth alone, and on a box whose other
        # cores are busy each of torch's worker threads would wait for one (measured: 64 MiB in
        # 8 ms on one thread, 150-400 ms on two under load).
        threads = torch.get_num_threads()
        if threads > 1:
            torch.set_num_threads(1)
        try:
            for ref, t in zip(all_refs, tensors):
                if ref.nbytes == 0:
                    continue
                dst = self._buf[ref.offset : ref.offset + ref.nbytes].view(t.dtype).view(t.shape)
                nb = t.is_cuda and self.pinned
                cuda = cuda or t.is_cuda
                dst.copy_(t.detach(), non_blocking=nb)
            if cuda:
                torch.cuda.synchronize()
        finally:
            if threads > 1:
                torch.set_num_threads(threads)
        return structure

    def close(self) -> None:
        self._unpin()
        self._buf = None
        if self.mm is not None:
            self.mm.close()
            self.mm = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def tensors_from(mm: Any, structure: Any) -> Any:
    """The tree of a staged snapshot, each tensor a zero-copy view of ``mm`` with a storage of
    its own (``torch.save`` refuses one storage viewed as several dtypes)."""
    torch = _torch()

    def tensor_of(ref: TensorRef) -> Any:
        dtype = getattr(torch, ref.dtype)
        if ref.nbytes == 0:
            return torch.empty(ref.shape, dtype=dtype)
        count = ref.nbytes // torch.empty((), dtype=dtype).element_size()
        return torch.frombuffer(mm, dtype=dtype, count=count, offset=ref.offset).view(ref.shape)

    return unflatten(structure, tensor_of)


# ---------------------------------------------------------------- random number generators


def rng_state() -> Dict[str, Any]:
    """Every generator a resume must restore, as weights_only-loadable values."""
    torch = _torch()
    state: Dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    np = _numpy()
    if np is not None:
        s = np.random.get_state(legacy=False)
        state["numpy"] = {
            "bit_generator": s["bit_generator"],
            "key": torch.from_numpy(s["state"]["key"].astype("int64")),
            "pos": int(s["state"]["pos"]),
            "has_gauss": int(s["has_gauss"]),
            "gauss": float(s["gauss"]),
        }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    """Restore what ``rng_state`` captured (a generator missing on either side is left alone)."""
    torch = _torch()
    py = state.get("python")
    if py is not None:
        version, internal, gauss = py
        random.setstate((version, tuple(internal), gauss))
    if state.get("torch") is not None:
        torch.set_rng_state(state["torch"])
    np = _numpy()
    if np is not None and state.get("numpy") is not None:
        s = state["numpy"]
        np.random.set_state(
            {
                "bit_generator": s["bit_generator"],
                "state": {"key": s["key"].numpy().astype("uint32"), "pos": s["pos"]},
                "has_gauss": s["has_gauss"],
                "gauss": s["gauss"],
            }
        )
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def resync_rng_on_first_iter(loaders: List[Any], state: Optional[Dict[str, Any]] = None) -> None:
    """Restore the RNG state (``state``, default: the current one, which a resume has just
    loaded) once the first of the stateful ``loaders`` has made its first iterator.

    Making a DataLoader iterator draws its base seed from the global torch RNG (unless the
    loader has a ``generator``). The uninterrupted run drew it at the start of the epoch, before
    the checkpoint; the resumed run draws it again after the restore, which would shift every
    later random number (dropout, noise) by one draw. So the RNG state goes back right after
    that draw. A checkpoint taken at an epoch's end is the other case: torchdata's
    ``StatefulDataLoader`` then makes the restored (finished) iterator and a fresh one for the
    next epoch, two draws where the uninterrupted run made one, so the state goes back and one
    draw is made again. Only what the main process draws from the global RNG is kept exact: a
    dataset that draws from it while batches are fetched (``num_workers=0``) is off by the
    draws of one prefetched batch."""
    loaders = [x for x in loaders if hasattr(x, "load_state_dict") and hasattr(x, "state_dict")]
    if not loaders:
        return
    import torch

    saved = rng_state() if state is None else state
    swapped: List[Tuple[Any, type]] = []

    def restore_once(loader: Any, finished: bool) -> None:
        if not swapped:
            return
        set_rng_state(saved)
        if finished and getattr(loader, "generator", None) is None:
            torch.empty((), dtype=torch.int64).random_()  # the next epoch's base seed
        for obj, cls in swapped:
            try:
                obj.__class__ = cls
            except TypeError:
                pass
        swapped.clear()

    for loader in loaders:
        cls = type(loader)

        def __iter__(self: Any, _cls: Any = cls) -> Any:
            pending = getattr(self, "next_iter_state", None)
            finished = bool(isinstance(pending, dict) and pending.get("_iterator_finished"))
            it = _cls.__iter__(self)  # the base seed is drawn here
            restore_once(self, finished)
            return it

        try:
            loader.__class__ = type(cls.__name__, (cls,), {"__iter__": __iter__})
        except TypeError:  # a class that cannot be swapped: left alone (off by one draw)
            continue
        swapped.append((loader, cls))
