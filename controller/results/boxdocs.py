"""The documents of a file:// store on the box (LATEST, MANIFEST, DONE, quarantine records),
read over ssh, several per round trip; what the box prints is parsed as untrusted input."""

from __future__ import annotations

import re
from typing import Dict, List, Optional, Tuple

from controller.remote import Remote
from controller.results.entries import MAX_SIZE_DIGITS, box_join
from controller.shell import script
from onbox.common.errors import HostError
from onbox.sealing import manifest as mf
from onbox.sealing.quarantine import quarantine_reason

# The most bytes one round trip of documents may bring: a MANIFEST lists every file of a
# checkpoint (~150 bytes each), so this is some 800,000 files; a box sending more is refused.
MAX_DOCS = 128 << 20


class BoxDocs:
    """Documents of a file:// store on the box, read over ssh, several per round trip.

    ``prefetch(..., run=RUN)`` also reads, in the same round trip, the MANIFEST of the step that
    RUN's LATEST.json names as the box reads it (the step found with sed in rgt's own format of
    that document): the caller parses LATEST itself and asks for its MANIFEST by key, which is
    then served from what was read, or read in a round trip of its own when the two differ."""

    # controller/shell/storedocs.sh: rgt_docs LATEST CHECKPOINTS FILE..., rgt_listing RUN.
    _SCRIPT = script("storedocs.sh") + 'rgt_docs "$@"\n'
    _LISTING = script("storedocs.sh") + 'rgt_listing "$@"\n'
    _LOGDOCS = script("storedocs.sh") + 'rgt_logdocs "$@"\n'

    def __init__(self, remote: Remote, root: str) -> None:
        self.remote = remote
        self.root = root
        self.cache: Dict[str, Optional[bytes]] = {}

    def prefetch(self, keys: List[str], run: Optional[str] = None) -> None:
        along = ("", "")
        if run is not None:
            along = (
                box_join(self.root, mf.latest_key(run)),
                box_join(self.root, run, "checkpoints"),
            )
        for _ in range(3):  # a document replaced between its size and its bytes: read again
            r = self.remote.sh(
                self._SCRIPT, *along, *[box_join(self.root, k) for k in keys], limit=MAX_DOCS
            )
            if r.rc != 0:
                raise HostError(
                    f"cannot read the store's documents under {self.root} on "
                    f"{self.remote.target.label}: {r.err.strip()[-300:]}"
                )
            got = _split_docs(r.stdout, len(keys))
            if got is not None:
                docs, step, manifest = got
                self.cache.update(zip(keys, docs))
                if run is not None and step is not None:
                    self.cache[mf.manifest_key(run, step)] = manifest
                return
        raise HostError(f"the store's documents under {self.root} keep changing while read")

    def get(self, key: str) -> Optional[bytes]:
        if key not in self.cache:
            self.prefetch([key])
        return self.cache[key]

    def log_docs(self, run: str) -> Dict[int, bytes]:
        """The run's log documents (``RUN/logs/e<epoch>.json``) as the box sees the store, by
        epoch; names that are not rgt's are left out (controller/results/documents.py checks
        the bytes)."""
        r = self.remote.sh(self._LOGDOCS, box_join(self.root, run), limit=MAX_DOCS)
        if r.rc != 0:
            raise HostError(
                f"cannot list the job's logs in the store under {self.root} on "
                f"{self.remote.target.label}: {r.err.strip()[-300:]}"
            )
        out: Dict[int, bytes] = {}
        pos, data = 0, r.stdout
        while pos < len(data):
            end = data.find(b"\n", pos)
            head = data[pos:end].split(b" ", 1) if end >= 0 else []
            if len(head) != 2 or head[0] != b"L":
                raise HostError("the store's list of log documents on the box is malformed")
            got = _one_doc(data, end + 1)
            if got is None:
                raise HostError("the store's list of log documents on the box was cut short")
            doc, pos = got
            name = head[1].decode("ascii", "replace")
            epoch = mf.logs_doc_epoch(run, f"{mf.logs_prefix(run)}{name}")
            if epoch is not None and doc is not None:
                out[epoch] = doc
        return out

    def listing(self, run: str) -> Tuple[List[int], Dict[int, str]]:
        """The run's sealed steps and quarantined steps (with reasons), as the box sees the
        store. Names that are not steps rgt writes are left out."""
        r = self.remote.sh(self._LISTING, box_join(self.root, run), limit=MAX_DOCS)
        if r.rc != 0:
            raise HostError(
                f"cannot list the store under {self.root} on {self.remote.target.label}: "
                f"{r.err.strip()[-300:]}"
            )
        return _split_listing(r.stdout)


def _is_step(raw: bytes) -> bool:
    return 0 < len(raw) <= 18 and raw.isdigit() and raw == str(int(raw)).encode()


def _is_size(raw: bytes) -> bool:
    """Whether ``raw`` is a size as the box prints one: digits, few enough for int()."""
    return raw.isdigit() and len(raw) <= MAX_SIZE_DIGITS


def _split_listing(out: bytes) -> Tuple[List[int], Dict[int, str]]:
    """What BoxDocs._LISTING printed: (sealed steps, {quarantined step: reason})."""
    sealed: List[int] = []
    bad: Dict[int, str] = {}
    pos = 0
    while pos < len(out):
        end = out.find(b"\n", pos)
        if end < 0:
            raise HostError("the store's listing on the box was cut short")
        head = out[pos:end].split(b" ", 1)
        pos = end + 1
        if len(head) != 2 or head[0] not in (b"S", b"Q"):
            raise HostError(f"the store's listing on the box has a line rgt never writes: {head!r}")
        if head[0] == b"S":
            if _is_step(head[1]):
                sealed.append(int(head[1]))
            continue
        end = out.find(b"\n", pos)
        doc = out[pos:end].split() if end >= 0 else []
        if doc == [b"N"]:
            pos = end + 1
            continue
        if len(doc) != 2 or doc[0] != b"F" or not _is_size(doc[1]):
            raise HostError("the store's listing on the box was cut short")
        size = int(doc[1])
        data = out[end + 1 : end + 1 + size]
        pos = end + 1 + size
        if _is_step(head[1]):
            bad[int(head[1])] = quarantine_reason(data)
    return sorted(sealed), bad


def _one_doc(out: bytes, pos: int) -> Optional[Tuple[Optional[bytes], int]]:
    """The document rgt_doc printed at ``pos`` of ``out`` (None when there was none) and the
    position after it; None when the output does not add up."""
    end = out.find(b"\n", pos)
    if end < 0:
        return None
    head = out[pos:end].split()
    if head == [b"N"]:
        return None, end + 1
    if len(head) != 2 or head[0] != b"F" or not _is_size(head[1]):
        return None
    size = int(head[1])
    if end + 1 + size > len(out):
        return None
    return out[end + 1 : end + 1 + size], end + 1 + size


_STEP_LINE = re.compile(rb"S ([0-9]+)\n")


def _split_docs(
    out: bytes, n: int
) -> Optional[Tuple[List[Optional[bytes]], Optional[int], Optional[bytes]]]:
    """The ``n`` documents BoxDocs._SCRIPT printed, and the step and MANIFEST it read along
    (None, None when it read none); None when the output does not add up."""

    def one(pos: int) -> Optional[Tuple[Optional[bytes], int]]:
        return _one_doc(out, pos)

    docs: List[Optional[bytes]] = []
    pos = 0
    for _ in range(n):
        got = one(pos)
        if got is None:
            return None
        docs.append(got[0])
        pos = got[1]
    if pos == len(out):
        return docs, None, None
    m = _STEP_LINE.match(out, pos)
    got = one(m.end()) if m else None
    if m is None or got is None or got[1] != len(out):
        return None
    step = m.group(1)
    if len(step) > 18 or step != str(int(step)).encode():  # not a step rgt writes: unused
        return docs, None, None
    return docs, int(step), got[0]
