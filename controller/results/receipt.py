"""The verification receipt: what a pull put on the laptop, and how each file was checked.

``rgt pull`` writes it last, only after every file matched its manifest and was put in place:
``DEST/.rgt-receipt.json``, and a copy in the laptop's state,
``$RGT_CONTROLLER_HOME/receipts/<run>.json``, which ``rgt down`` reads. No receipt means no
verified pull: a pull that fails or is cut off writes none (and removes DEST's old one, and the
laptop's copy when it is of that DEST, before it puts the first new file in place), so a receipt
always describes files that are all there.

Format (JSON, ``schema`` 1)::

    {
      "schema": 1,
      "kind": "rgt-pull-receipt",
      "run": "demo",
      "source": "store" | "box",          where the bytes came from
      "target": "local" | "user@host:22",
      "store": "file:///mnt/durable/rgt" | null,
      "dest": "/abs/path/of/DEST",
      "sealed": {                          the sealed state the files are (see SealedId)
        "step": 120, "epoch": 3,
        "manifest": "demo/checkpoints/120/MANIFEST.json",
        "manifest_sha256": "<hex of the MANIFEST's bytes>",
        "done": true, "done_sha256": "<hex of DONE.json's bytes>",
        "ended_sha256": null               (the hex of ENDED.json's bytes: a run that ended
                                           FAILED or STOPPED, its job's logs, no DONE.json)
        "logs_sha256": null                (a sha256 over the log documents of the run's
                                           epochs, logs/e<epoch>.json: each box's job logs)
        "listing_sha256": null             (runs without a store: the box's files, hashed)
      },
      "files": [                           every file, its path relative to DEST
        {"path": "checkpoints/step_120.pt", "kind": "checkpoint", "size": 123,
         "sha256": "<hex>", "source": "demo/checkpoints/120/step_120.pt",
         "verified": "sha256 + torch.load(weights_only=True)", "redacted": false}
      ],
      "fetched_bytes": 123,                bytes this pull moved (not those an earlier,
                                           interrupted pull of the same state had fetched)
      "not_covered": [],                   files under DEST's checkpoints/, outputs/, logs/
                                           this pull did not bring (an older pull's, one put
                                           there by hand): in DEST, not covered, not verified
      "created": 1700000000.0, "created_at": "2023-11-14T22:13:20.000Z",
      "rgt_version": "0.1.0"
    }

A run with nothing sealed (no LATEST.json, no DONE.json, no ENDED.json, no log document
``logs/e<epoch>.json``: its job failed or was stopped before its first checkpoint, and its agent
has not sealed its logs) gets a receipt too:
``step`` and the other fields null, ``done`` false, no files. It says that the pull found
nothing sealed; ``rgt down`` takes it only while the store still has no sealed checkpoint nor
DONE.json (the job's logs its agent seals as the run ends, ENDED.json, are in the store: down's
plan says so), and lists the run's other files on the box as lost.

``verified`` says how far each file was checked: ``sha256`` (against the manifest), plus
``safetensors header`` or ``torch.load(weights_only=True)`` where the file was opened as its
framework would, or a note why it was not opened (no torch on this laptop). ``redacted`` is true
for a job's log whose box copy holds a secret: what was pulled is a copy with each secret masked
(the store's, or the one the agent wrote next to the log, which ``source`` then names); a
receipt written before this field existed reads as false.

Read back, every field of ``sealed`` and of each file must have the type above (an integer is
not a bool, a size not negative): ``rgt down`` decides from them whether the box may go, so a
receipt that does not is damaged (IntegrityError, exit 6), never read as a verified pull.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Dict, List, Optional, Tuple

from controller.remote import controller_home
from onbox.agent.journal import iso
from onbox.common import jsondoc
from onbox.common.durable import write_json
from onbox.common.errors import IntegrityError
from onbox.common.rundir import check_name

SCHEMA = 1
KIND = "rgt-pull-receipt"
RECEIPT_NAME = ".rgt-receipt.json"


@dataclasses.dataclass(frozen=True)
class SealedId:
    """Which sealed state of a run: enough to tell whether a newer one exists.

    With a store: LATEST's step and epoch, the MANIFEST it names (key and the sha256 of its
    bytes) and DONE.json (whether it exists, the sha256 of its bytes). Without a store:
    ``listing_sha256`` over the box's files (path, size, sha256). ``note``, for people: why
    the step is not the one LATEST names (that one is quarantined)."""

    step: Optional[int] = None
    epoch: Optional[int] = None
    manifest: Optional[str] = None
    manifest_sha256: Optional[str] = None
    done: bool = False
    done_sha256: Optional[str] = None
    listing_sha256: Optional[str] = None
    note: Optional[str] = None
    # ENDED.json (a run that ended FAILED or STOPPED: its job's logs; read only while there is
    # no DONE.json), the sha256 of its bytes; None without one. Said, not compared by
    # ``differs_from`` (the logs it lists are in the store: down's plan says so).
    ended_sha256: Optional[str] = None
    # The log documents of the run's epochs (logs/e<epoch>.json: each box's job logs, a
    # preempted one's too), a sha256 over them; None without one. Said, not compared, as
    # ENDED.json is.
    logs_sha256: Optional[str] = None
    # Declared outputs DONE.json says were missing when the job succeeded (never sealed).
    missing_outputs: Tuple[str, ...] = ()
    # Files DONE.json says the job left but could not be sealed ("PATH: why"; not pulled).
    left_out: Tuple[str, ...] = ()
    # The checkpoint dir's links the MANIFEST records (name, target under checkpoints/), or a
    # box without a store holds (boxlinks.py: a name may lie below the top, its target then
    # relative to its own directory), made in DEST by the pull (onbox/sealing/dirlinks.py).
    # Said in the receipt, not read back:
    # the MANIFEST's sha256 already tells one sealed state from another.
    links: Tuple[Tuple[str, str], ...] = dataclasses.field(default=(), compare=False)

    def __post_init__(self) -> None:
        # A receipt read back from JSON holds a list: the same state, so equal to this one.
        object.__setattr__(self, "missing_outputs", tuple(self.missing_outputs))
        object.__setattr__(self, "left_out", tuple(self.left_out))

    @property
    def nothing(self) -> bool:
        """Nothing sealed: a store with no LATEST.json, no DONE.json and no ENDED.json (a job
        that failed or was stopped before its first checkpoint, its agent not yet done with
        it). A receipt of it holds no file."""
        return (
            self.listing_sha256 is None
            and self.step is None
            and not self.done
            and self.ended_sha256 is None
            and self.logs_sha256 is None
        )

    def describe(self) -> str:
        if self.listing_sha256 is not None:
            return f"the box's files (no store), listing {self.listing_sha256[:12]}"
        if self.nothing:
            return "nothing sealed"
        what = f"sealed step {self.step}" if self.step is not None else "no sealed checkpoint"
        if self.done:
            return what + ", run done (outputs and logs)"
        if self.ended_sha256 is not None:
            return what + ", run ended (its job's logs)"
        return what + (", the job's logs of a box" if self.logs_sha256 is not None else "")

    def pulled(self) -> str:
        """What a pull of this state brought, as ``rgt pull``'s line names it."""
        if self.listing_sha256 is not None:
            return "the box's files (no store)"
        if self.nothing:
            return "nothing (nothing was sealed)"
        if self.step is None and self.done:  # DONE.json, no LATEST: no checkpoint sealed
            return "results only (DONE.json; no checkpoint was sealed)"
        if self.step is None:  # ENDED.json alone: the job failed or was stopped before one
            doc = "ENDED.json" if self.ended_sha256 else "a preempted box's logs/e<epoch>.json"
            return f"the job's logs only ({doc}; no checkpoint was sealed)"
        logs = self.ended_sha256 or self.logs_sha256
        return f"step {self.step}" + (" and the job's logs" if logs else "")

    def differs_from(self, newer: SealedId) -> Optional[str]:
        """Why ``newer`` is not the state this one names, or None when it is."""
        if self.listing_sha256 is not None or newer.listing_sha256 is not None:
            if self.listing_sha256 != newer.listing_sha256:
                return "the box's files changed since the pull"
            return None
        # ENDED.json (the job's logs of a run that FAILED or was stopped) is not compared: the
        # logs are in the store, and down's plan says where each log is (kept there, pulled,
        # or lost with the store). A down that stopped the run (which sealed them) goes on.
        if self.step is None and not self.done and (newer.step is not None or newer.done):
            what = f"step {newer.step}" if newer.step is not None else "the run's end (DONE.json)"
            logs = self.ended_sha256 or self.logs_sha256
            had = "has no sealed checkpoint" if logs else "says nothing was sealed"
            return f"{what} was sealed after the pull, whose receipt {had}"
        if newer.step != self.step:
            return f"the newest sealed step is {newer.step}, the receipt has step {self.step}"
        if newer.manifest_sha256 != self.manifest_sha256:
            return f"the MANIFEST of step {newer.step} changed since the pull"
        if newer.done and not self.done:
            return "the run finished (DONE.json) after the pull: its outputs and logs are newer"
        if newer.done_sha256 != self.done_sha256:
            return "DONE.json changed since the pull"
        return None


@dataclasses.dataclass(frozen=True)
class FileRecord:
    """One pulled file."""

    path: str  # relative to dest
    kind: str  # checkpoint | output | log
    size: int
    sha256: str
    source: str  # the store key, or the path on the box
    verified: str
    redacted: bool = False  # a job's log pulled with each secret masked (the box's holds one)


@dataclasses.dataclass
class Receipt:
    """A verified pull (see the module docstring for the JSON)."""

    run: str
    source: str
    target: str
    store: Optional[str]
    dest: str
    sealed: SealedId
    files: List[FileRecord]
    fetched_bytes: int = 0
    created: float = dataclasses.field(default_factory=time.time)
    rgt_version: str = ""
    # Files in DEST's layout this pull did not bring (destination.not_covered): not covered.
    not_covered: List[str] = dataclasses.field(default_factory=list)

    def to_json(self) -> Dict[str, Any]:
        return {
            "schema": SCHEMA,
            "kind": KIND,
            "run": self.run,
            "source": self.source,
            "target": self.target,
            "store": self.store,
            "dest": self.dest,
            "sealed": dataclasses.asdict(self.sealed),
            "files": [dataclasses.asdict(f) for f in self.files],
            "fetched_bytes": self.fetched_bytes,
            "created": self.created,
            "created_at": iso(self.created),
            "rgt_version": self.rgt_version,
            "not_covered": list(self.not_covered),
        }

    @classmethod
    def from_json(cls, d: Any, what: str = "receipt") -> Receipt:
        """A receipt from its JSON; anything malformed is an IntegrityError."""
        try:
            if not isinstance(d, dict) or d.get("kind") != KIND:
                raise ValueError("not an rgt pull receipt")
            if not isinstance(d.get("schema"), int) or d["schema"] > SCHEMA:
                raise ValueError(f"schema {d.get('schema')!r} is not one this rgt reads")
            sealed = _sealed_from_json(d["sealed"])
            files = [_file_from_json(f) for f in d["files"]]
            return cls(
                run=check_name(str(d["run"]), "run"),
                source=str(d["source"]),
                target=str(d["target"]),
                store=d.get("store"),
                dest=str(d["dest"]),
                sealed=sealed,
                files=files,
                fetched_bytes=int(d.get("fetched_bytes") or 0),
                created=float(d["created"]),
                rgt_version=str(d.get("rgt_version") or ""),
                not_covered=_strings(d.get("not_covered"), "not_covered"),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise IntegrityError(
                f"{what} is not a valid verification receipt ({e})", "pull again"
            ) from None

    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def missing_in_dest(self) -> List[str]:
        """Files of the receipt no longer in ``dest`` with their size (cheap: no re-hash)."""
        out = []
        for f in self.files:
            try:
                if os.path.getsize(os.path.join(self.dest, *f.path.split("/"))) != f.size:
                    out.append(f.path)
            except OSError:
                out.append(f.path)
        return out


# The type of each field of SealedId as a receipt holds it, and whether null is allowed: `rgt
# down` decides from these whether the box may go, so a field of another type (5.0 or true for
# step 5, "false" for done) is a damaged receipt, never one that compares equal to the newest
# state. bool is no int here (True == 1).
_SEALED_TYPES: Dict[str, Tuple[type, bool, str]] = {
    "step": (int, True, "an integer"),
    "epoch": (int, True, "an integer"),
    "manifest": (str, True, "a string"),
    "manifest_sha256": (str, True, "a string"),
    "done": (bool, False, "true or false"),
    "done_sha256": (str, True, "a string"),
    "listing_sha256": (str, True, "a string"),
    "note": (str, True, "a string"),
    "ended_sha256": (str, True, "a string"),
    "logs_sha256": (str, True, "a string"),
    "missing_outputs": (list, False, "a list of strings"),
    "left_out": (list, False, "a list of strings"),
}


def _strings(value: Any, name: str) -> List[str]:
    """A list of strings of a receipt (absent in one written before it existed: empty)."""
    if value is None:
        return []
    if not _typed(value, list, False):
        raise ValueError(f"its {name} is {value!r}, not a list of strings")
    return list(value)


def _typed(value: Any, kind: type, nullable: bool) -> bool:
    if value is None:
        return nullable
    if kind is not bool and isinstance(value, bool):
        return False
    if kind is list:  # a list once read back from JSON; to_json's own dict holds a tuple
        return isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)
    return isinstance(value, kind)


def _sealed_from_json(d: Any) -> SealedId:
    """The sealed state of a receipt; ValueError naming the first field of another type.
    Fields this rgt does not know are left out (a newer rgt's)."""
    # A damaged "sealed" that is a list or a string has no .items(): the AttributeError
    # would pass from_json's except and end `rgt down` in a traceback.
    if not isinstance(d, dict):
        raise ValueError("its sealed state is not an object")
    for name, (kind, nullable, what) in _SEALED_TYPES.items():
        if name in d and not _typed(d[name], kind, nullable):
            raise ValueError(f"its sealed {name} is {d[name]!r}, not {what}")
    return SealedId(**{k: v for k, v in d.items() if k in _SEALED_TYPES})


def _file_from_json(f: Any) -> FileRecord:
    """One file of a receipt; ValueError naming the first field of another type (its size
    decides whether the file is still in DEST as pulled)."""
    if not isinstance(f, dict):
        raise ValueError("a file of it is not an object")
    for name in ("path", "kind", "sha256", "source", "verified"):
        if not isinstance(f[name], str):
            raise ValueError(f"a file's {name} is {f[name]!r}, not a string")
    size = f["size"]
    if not _typed(size, int, False) or size < 0:
        raise ValueError(f"a file's size is {size!r}, not a size in bytes")
    return FileRecord(
        path=f["path"],
        kind=f["kind"],
        size=size,
        sha256=f["sha256"],
        source=f["source"],
        verified=f["verified"],
        redacted=f.get("redacted") is True,
    )


def receipt_path(dest: str) -> str:
    """The receipt inside a pull's destination."""
    return os.path.join(dest, RECEIPT_NAME)


def state_receipt_path(run: str, home: Optional[str] = None) -> str:
    """The laptop's copy, the one ``rgt down`` reads."""
    return os.path.join(home or controller_home(), "receipts", f"{check_name(run)}.json")


def write_receipt(receipt: Receipt, home: Optional[str] = None) -> None:
    """Write the receipt into its dest and into the laptop's state, each atomically."""
    doc = receipt.to_json()
    write_json(receipt_path(receipt.dest), doc)
    path = state_receipt_path(receipt.run, home)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    write_json(path, doc)


def remove_receipts(run: str, dest: str, home: Optional[str] = None) -> None:
    """Before a pull changes anything under a final name in ``dest``: no receipt may describe
    a mix. DEST's own goes, and the laptop's copy when it is DEST's pull (or is damaged). The
    laptop's copy of a pull into another directory stays: that directory still holds what it
    vouches for (``compare`` checks that it does), so a pull into a new --to that fails does
    not leave `rgt down` without the older verified pull; one that succeeds replaces it."""
    paths = [receipt_path(dest)]
    state = state_receipt_path(run, home)
    try:
        older = load_receipt(state)
    except IntegrityError:
        older = None
    if older is None or _same_dir(older.dest, dest):
        paths.append(state)
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _same_dir(a: str, b: str) -> bool:
    """Whether the paths ``a`` and ``b`` name one directory (by name, or by device and inode:
    a symlink or a bind mount of it)."""
    if os.path.abspath(a) == os.path.abspath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one is gone: no directory both name
        return False


def load_receipt(path: str) -> Optional[Receipt]:
    """The receipt at ``path``, or None when there is none."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    try:
        doc = jsondoc.loads(data)
    except ValueError:
        raise IntegrityError(f"{path} is not valid JSON", "pull again") from None
    return Receipt.from_json(doc, path)


def load_state_receipt(run: str, home: Optional[str] = None) -> Optional[Receipt]:
    """The laptop's receipt of ``run``'s newest verified pull, or None."""
    return load_receipt(state_receipt_path(run, home))


@dataclasses.dataclass(frozen=True)
class Coverage:
    """Whether a receipt covers the newest sealed state; ``reason`` says why not. True-ish when
    it does."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


def compare(receipt: Receipt, newest: SealedId, *, check_dest: bool = True) -> Coverage:
    """Does ``receipt`` cover ``newest``, and are its files still in its dest?"""
    why = receipt.sealed.differs_from(newest)
    if why is not None:
        return Coverage(False, why)
    if check_dest:
        try:
            here = load_receipt(receipt_path(receipt.dest))
        except IntegrityError:
            here = None
        if here is None or here.run != receipt.run or here.sealed != receipt.sealed:
            # Another pull into DEST since (of another run, or one cut midway) replaced files
            # this receipt vouches for: sizes alone would not show it.
            return Coverage(
                False, f"{receipt.dest} no longer holds this pull's receipt: pulled into again?"
            )
        gone = receipt.missing_in_dest()
        if gone:
            more = f" and {len(gone) - 3} more" if len(gone) > 3 else ""
            return Coverage(
                False,
                f"pulled files are no longer in {receipt.dest} as pulled: "
                f"{', '.join(gone[:3])}{more}",
            )
    return Coverage(True)
