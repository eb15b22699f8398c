"""Opening a pulled file of a known format as its framework would, after its sha256 matched:
safetensors (the header and every tensor's offsets), torch files (``torch.load(weights_only=
True)``, torch imported only then)."""

from __future__ import annotations

import os
import pickle
import warnings
import zipfile
from typing import List, Optional

from onbox.common import jsondoc
from onbox.common.errors import IntegrityError

TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
# ---- opening checkpoints as their frameworks would

_ST_DTYPES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}  # fmt: skip
_ST_MAX_HEADER = 100_000_000  # the safetensors library's own limit
# torch.save's format before the zip one: a protocol-2 pickle of a 10-byte magic number first.
_TORCH_LEGACY = b"\x80\x02\x8a\x0a"


def check_safetensors(path: str, name: str) -> None:
    """Parse a safetensors file as the library does: the 8-byte header length, the JSON
    header, and every tensor's offsets inside the data, contiguous, sized by dtype and shape."""

    def bad(why: str) -> IntegrityError:
        return IntegrityError(
            f"{name}: not a valid safetensors file ({why})",
            "its sha256 matches the manifest: the job wrote it like this",
        )

    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise bad("shorter than its 8-byte header length")
        n = int.from_bytes(head, "little")
        if n > _ST_MAX_HEADER or 8 + n > size:
            raise bad(f"header length {n} does not fit in {size} bytes")
        raw = f.read(n)
    try:
        header = jsondoc.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise bad("the header is not JSON") from None
    if not isinstance(header, dict):
        raise bad("the header is not a JSON object")
    data_len = size - 8 - n
    spans = []
    for key, t in header.items():
        if key == "__metadata__":
            if not isinstance(t, dict) or not all(isinstance(v, str) for v in t.values()):
                raise bad("__metadata__ is not a map of strings")
            continue
        try:
            dtype, shape, (b, e) = t["dtype"], t["shape"], t["data_offsets"]
            # bool is an int to Python, not to the library; a dtype that is no string (a
            # list) would not even be hashable below.
            if not isinstance(dtype, str) or not isinstance(shape, list):
                raise ValueError
            if not all(type(x) is int and x >= 0 for x in [*shape, b, e]):
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise bad(f"tensor {key!r} has no valid dtype, shape and data_offsets") from None
        if not b <= e <= data_len:
            raise bad(f"tensor {key!r} spans bytes {b}..{e} of {data_len}")
        width = _ST_DTYPES.get(dtype)
        need = None if width is None else _bytes_needed(shape, width, e - b)
        if width is not None and need != e - b:
            # A header of thousands of dims, or of dims of thousands of digits, stays one
            # readable line.
            short = len(shape) <= 8 and all(d < 2**64 for d in shape)
            dims = str(shape) if short else f"[{len(shape)} dims]"
            needs = "more than 2**64" if need is None else str(need)
            raise bad(f"tensor {key!r}: {dtype}{dims} needs {needs} bytes, has {e - b}")
        spans.append((b, e, key))
    pos = 0
    for b, e, key in sorted(spans):
        if b != pos:
            raise bad(f"tensor {key!r} starts at {b}, the previous one ends at {pos}")
        pos = e
    if pos != data_len:
        raise bad(f"the tensors end at byte {pos} of {data_len}")


def _bytes_needed(shape: List[int], width: int, span: int) -> Optional[int]:
    """The bytes ``shape`` elements of ``width`` bytes need; None when that is more than
    ``span`` and 2**64 both. The product stops there: tens of thousands of huge dims would
    otherwise grow a bigint whose every multiplication costs more (minutes for one header),
    and its digits would pass the limit of int-to-str in the error message."""
    if 0 in shape:
        return 0
    limit = max(span, 2**64)
    need = width
    for d in shape:
        need *= d
        if need > limit:
            return None
    return need


def check_torch(path: str, name: str) -> str:
    """Open a torch file with ``torch.load(weights_only=True)``; how it was verified."""
    with open(path, "rb") as f:
        magic = f.read(4)
    is_zip = magic == b"PK\x03\x04"
    if is_zip:
        try:
            with zipfile.ZipFile(path) as z:
                is_torch = any(n == "data.pkl" or n.endswith("/data.pkl") for n in z.namelist())
        except Exception:
            # Python's zipfile refuses what torch's own reader may not (a "version needed to
            # extract" it does not know raises NotImplementedError; a mutated header others):
            # the zip magic is there, so torch.load below decides, and says what is wrong.
            is_torch = True
        if not is_torch:
            return "sha256 (a zip file, not a torch checkpoint: not opened)"
    elif magic != _TORCH_LEGACY:
        return "sha256 (not a torch file: not opened)"
    try:
        import torch
    except ImportError:
        return "sha256 only (torch is not installed here: not opened)"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            obj = torch.load(path, weights_only=True, map_location="cpu", mmap=is_zip)
        del obj
    except pickle.UnpicklingError as e:
        if "weights only" in str(e).lower() or "weights_only" in str(e):
            return "sha256 + torch.load(weights_only=True) refused a non-tensor object"
        raise _torch_error(name, e) from None
    except Exception as e:  # torch raises RuntimeError, EOFError, ValueError, ...
        raise _torch_error(name, e) from None
    return "sha256 + torch.load(weights_only=True)"


def _torch_error(name: str, e: BaseException) -> IntegrityError:
    first = (str(e).strip().splitlines() or [""])[0][:300]
    return IntegrityError(
        f"{name}: torch.load cannot open it ({type(e).__name__}: {first})",
        "its sha256 matches the manifest: the job wrote a damaged checkpoint",
    )


def check_format(path: str, name: str) -> str:
    """Open ``path`` (a file named ``name``) as its framework would; how it was verified."""
    low = name.lower()
    if low.endswith(".safetensors"):
        check_safetensors(path, name)
        return "sha256 + safetensors header"
    if low.endswith(TORCH_SUFFIXES):
        return check_torch(path, name)
    return "sha256"
