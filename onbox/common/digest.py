"""The digests of a checkpoint's bytes: sha256, the MANIFEST's contract, always; BLAKE3 beside
it where the optional ``blake3`` module is installed.

Why two. A restore is on the critical path of every preemption (the job waits for it), a seal
is not (it runs beside training). Verifying a restored GiB with sha256 costs ~0.55 s of one
core (~1.8 GB/s with the CPU's SHA extensions), BLAKE3 ~0.2 s (~4.7 GB/s, one thread, the
same CPU): on a box whose cores are shared, or whose link is faster than one core's sha256,
the hash is what a restore waits for (bench/README.md, bench_restore). So the sealer computes
both in the one pass it already makes over the bytes, the MANIFEST carries both, and a
restore checks the cheaper one it can (``verify_algo``). BLAKE3 is a cryptographic hash of the
same strength for this purpose (256-bit output, collision resistance 128 bits, as sha256), so a
file checked by it is as verified as one checked by sha256.

sha256 stays in every MANIFEST entry, and everything else that checks a file (``rgt pull`` on
the laptop, the completion receipt, the training API's own markers) keeps using it: a MANIFEST
without ``blake3`` (sealed before it, or by an agent without the module) and an agent without
the module (a platform with no wheel of it: musl) restore exactly as before.

Standard library only, apart from the optional module: the training API imports
onbox.sealing.manifest, which imports nothing from here.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Callable, Dict, Optional, Protocol, Tuple, Union

SHA256 = "sha256"
BLAKE3 = "blake3"
_HEX = re.compile(r"[0-9a-f]{64}\Z")
Bytes = Union[bytes, bytearray, memoryview]


class Hasher(Protocol):
    """What hashlib's and blake3's hash objects share."""

    def update(self, data: Bytes, /) -> Any: ...

    def hexdigest(self) -> str: ...


_blake3: Optional[Callable[[], Hasher]]
try:  # a compiled wheel (manylinux x86_64 and aarch64): absent elsewhere, and then not used
    from blake3 import blake3 as _blake3
except ImportError:  # pragma: no cover - depends on the install
    _blake3 = None


def has_blake3() -> bool:
    """Whether this Python can compute BLAKE3."""
    return _blake3 is not None


def hasher(algo: str) -> Hasher:
    """A new hash object of ``algo`` (SHA256 or BLAKE3; BLAKE3 only where ``has_blake3``)."""
    if algo == SHA256:
        return hashlib.sha256()
    if algo == BLAKE3 and _blake3 is not None:
        return _blake3()
    raise ValueError(f"no hash {algo!r} here")


def is_hex(value: object) -> bool:
    """Whether ``value`` is a 256-bit digest as the MANIFEST spells it (64 lowercase hex)."""
    return isinstance(value, str) and bool(_HEX.match(value))


def verify_algo(entry: Dict[str, Any]) -> str:
    """The digest a restore checks ``entry`` (a MANIFEST file entry) by: BLAKE3 when the entry
    carries one and this Python can compute it, else sha256."""
    return BLAKE3 if has_blake3() and is_hex(entry.get(BLAKE3)) else SHA256


class Digests:
    """sha256 and, where available, BLAKE3 of the same bytes, fed once. ``hexdigest`` is the
    sha256 (a drop-in for hashlib's object where the caller wants only that); ``fields`` is
    what a MANIFEST entry carries."""

    def __init__(self, data: Bytes = b"") -> None:
        self._sha = hashlib.sha256()
        self._b3 = _blake3() if _blake3 is not None else None
        if data:
            self.update(data)

    def update(self, data: Bytes) -> None:
        self._sha.update(data)
        if self._b3 is not None:
            self._b3.update(data)

    def hexdigest(self) -> str:
        return self._sha.hexdigest()

    def fields(self) -> Dict[str, str]:
        """{"sha256": hex} and, where computed, {"blake3": hex}."""
        out = {SHA256: self._sha.hexdigest()}
        if self._b3 is not None:
            out[BLAKE3] = self._b3.hexdigest()
        return out


def of_data(data: Bytes) -> Dict[str, str]:
    """``Digests(data).fields()``."""
    return Digests(data).fields()


def of_file(path: str) -> Tuple[Dict[str, str], int]:
    """(the digests' fields, size) of a file, read once in chunks of up to 1 MiB into one
    buffer sized to the file (a checkpoint of 10,000 small files is hashed 10,000 times, and a
    fresh 1 MiB buffer per read is an allocation the kernel maps and unmaps each time)."""
    d = Digests()
    n = 0
    with open(path, "rb", buffering=0) as f:
        size = f.seek(0, 2)
        f.seek(0)
        view = memoryview(bytearray(max(4096, min(1 << 20, size + 1))))
        while True:
            k = f.readinto(view)
            if not k:
                return d.fields(), n
            d.update(view[:k])
            n += k


def extra(fields: Optional[Dict[str, str]]) -> Dict[str, str]:
    """The fields of ``fields`` beyond sha256 (what an entry carries beside it)."""
    return {k: v for k, v in (fields or {}).items() if k != SHA256}
