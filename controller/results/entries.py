"""What a pull takes: the files of a sealed state (Entry, Sealed), the check of every name the
box or a store supplies before it becomes a name on the laptop (``checked``), and where each
file is staged under DEST/.rgt-part/ (controller/results/pull.py's docstring says why)."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from typing import List, Optional

from controller.results.receipt import SealedId
from onbox.common.safepath import UnsafePath, conflicts, open_dir, safe_join, safe_rel
from onbox.sealing.stores.base import Store

STAGE = ".rgt-part"
# rgt's own files in the staging directory: no staged file may take one of their names.
LOCK, FILES_FROM, COPY = ".lock", ".rgt-files-from", ".rgt-copy-"
KINDS = {"checkpoints": "checkpoint", "outputs": "output", "logs": "log"}
SHA256_HEX = re.compile(r"[0-9a-f]{64}\Z")
# The most digits a file size the box prints may have (2**64 has 20): past 4300, int() raises
# ValueError (Python's limit on int-from-str), which a reader of the box's output must never
# meet; a size this long is a malformed line of its own.
MAX_SIZE_DIGITS = 20


@dataclasses.dataclass(frozen=True)
class Entry:
    """One file of the sealed state."""

    path: str  # final path, relative to DEST
    kind: str  # checkpoint | output | log
    size: int
    sha256: str
    key: Optional[str]  # store key, when the bytes come from the store
    src: Optional[str] = None  # path on the box relative to Sealed.box_root, when from the box
    origin: str = ""  # where the bytes are, for people: the store key or the path on the box
    redacted: bool = False  # a job's log with each secret masked (the box's own holds one)

    @property
    def stage(self) -> str:
        """Its temporary name under DEST/.rgt-part/ (unique per source file)."""
        return self.src if self.src is not None else (self.key or self.path)


@dataclasses.dataclass
class Sealed:
    """The newest sealed state of a run, and where its bytes are."""

    ident: SealedId
    entries: List[Entry]
    source: str  # "store" | "box"
    box_root: Optional[str] = None  # the box directory Entry.src is relative to
    store: Optional[Store] = None  # for the entries without ``src``: the store's bytes


def checked(sealed: Sealed, what: str) -> Sealed:
    """``sealed`` when every final name (``Entry.path``) and staging name (``Entry.stage``)
    is a plain relative path (onbox.common.safepath.safe_rel) that cannot collide with rgt's own
    files, a final one is a file under checkpoints/, outputs/ or logs/, and no name is a directory
    on the way to another; else UnsafePath (exit 6) naming the path."""
    for e in sealed.entries:
        safe_rel(e.path, f"{what}: the file")
        safe_rel(e.stage, f"{what}: the staging name of {e.path!r}")
        # A file under its kind's directory, never one in place of that directory (a file
        # named DEST/logs would stand where every later pull's logs go).
        if e.path.split("/", 1)[0] not in KINDS or "/" not in e.path:
            raise UnsafePath(
                f"{what}: {e.path!r} is not a file under checkpoints/, outputs/, logs/", e.path
            )
        first = e.stage.split("/", 1)[0]
        if first in (LOCK, FILES_FROM) or first.startswith(COPY):
            raise UnsafePath(f"{what}: the staging name {e.stage!r} is one of rgt's own", e.stage)
    for kind, names in (
        ("file", [e.path for e in sealed.entries]),
        ("source", [e.stage for e in sealed.entries]),
    ):
        both = conflicts(names)
        if both is not None:
            raise UnsafePath(
                f"{what}: the {kind} {both[0]!r} is listed, and so is {both[1]!r} under it", both[1]
            )
    return sealed


def box_join(*parts: str) -> str:
    """A path on the box, from parts that may end in "/"."""
    return "/".join(p.rstrip("/") for p in parts)


def sha_hex(data: bytes) -> str:
    """The sha256 of ``data``, in hex."""
    return hashlib.sha256(data).hexdigest()


def stage_path(stage_dir: str, e: Entry) -> str:
    """The path of ``e``'s staging name under ``stage_dir``."""
    return safe_join(stage_dir, e.stage, "staging name")


def stage_dirs(stage_dir: str, e: Entry) -> None:
    """The directories of ``e``'s staging name, made (0700) where missing, none a symlink."""
    os.close(open_dir(stage_dir, e.stage.split("/")[:-1], create=True, mode=0o700))
