"""A verification receipt read back (controller/results/receipt.py ``Receipt.from_json``): the
laptop's own file, but one a crash, a disk or a hand can damage; whatever it holds, reading it
gives the receipt or the one "not a valid verification receipt" error (exit 6) that `rgt down`
prints as one line, never another exception."""

from __future__ import annotations

from typing import Any, Dict

import pytest

from controller.results.receipt import FileRecord, Receipt, SealedId
from onbox.common.errors import IntegrityError


def _doc() -> Dict[str, Any]:
    files = [FileRecord("checkpoints/a.bin", "checkpoint", 1, "0" * 64, "r/a.bin", "sha256")]
    receipt = Receipt("r", "store", "local", "file:///s", "/d", SealedId(step=5), files)
    return receipt.to_json()


def test_a_receipt_reads_back_as_written() -> None:
    doc = _doc()
    assert Receipt.from_json(doc).to_json() == doc


@pytest.mark.parametrize("sealed", [[], ["step", 5], "step 5", 5, None])
def test_a_receipt_whose_sealed_state_is_no_object_is_damaged(sealed: Any) -> None:
    """A list or a string has no .items(): the AttributeError escaped the parser's except,
    and `rgt down` ended in a traceback."""
    doc = _doc()
    doc["sealed"] = sealed
    with pytest.raises(IntegrityError, match="r.json is not a valid verification receipt"):
        Receipt.from_json(doc, "r.json")


@pytest.mark.parametrize(
    "field, value",
    [
        ("step", "5"),  # compared with the newest step 5 as "differs", yet printed alike
        ("step", 5.0),  # equal to 5: a damaged receipt read as the verified pull of step 5
        ("step", True),  # equal to 1
        ("epoch", "3"),
        ("manifest", 7),
        ("manifest_sha256", ["0" * 64]),
        ("done", "false"),  # truthy: a string is no answer to "did the run finish?"
        ("done", 1),
        ("done_sha256", 5),
        ("listing_sha256", {"x": 1}),
        ("note", 5),
        ("missing_outputs", "out.txt"),  # read as ("o", "u", "t", ...)
        ("missing_outputs", [5]),
    ],
)
def test_a_receipt_whose_sealed_fields_have_other_types_is_damaged(field: str, value: Any) -> None:
    """`rgt down` decides from the sealed state whether the box may go: a field of another type
    is a damaged receipt (exit 6), never one that compares equal to the newest state."""
    doc = _doc()
    doc["sealed"][field] = value
    with pytest.raises(IntegrityError, match=f"not a valid verification receipt.*{field}"):
        Receipt.from_json(doc, "r.json")


@pytest.mark.parametrize(
    "field, value",
    [("path", ["a"]), ("size", "1"), ("size", 1.5), ("size", True), ("size", -1), ("sha256", 0)],
)
def test_a_receipt_whose_files_have_other_types_is_damaged(field: str, value: Any) -> None:
    doc = _doc()
    doc["files"][0][field] = value
    with pytest.raises(IntegrityError, match=f"not a valid verification receipt.*{field}"):
        Receipt.from_json(doc, "r.json")


def test_a_receipt_of_a_run_without_a_store_reads_back_with_nulls_and_no_outputs() -> None:
    doc = _doc()
    doc["sealed"] = {"listing_sha256": "a" * 64, "done": False, "missing_outputs": []}
    assert Receipt.from_json(doc).sealed == SealedId(listing_sha256="a" * 64)
    doc["sealed"] = {"step": 3, "epoch": None, "note": None, "done": True, "done_sha256": "b" * 64}
    assert Receipt.from_json(doc).sealed == SealedId(step=3, done=True, done_sha256="b" * 64)


def test_a_receipt_of_nothing_sealed_covers_only_a_store_that_still_has_nothing_sealed() -> None:
    """A pull of a run with nothing sealed records that; a seal after it (a checkpoint, or the
    run's end with DONE.json alone) is newer, so `rgt down` refuses again."""
    doc = Receipt("r", "store", "local", "file:///s", "/d", SealedId(), []).to_json()
    nothing = Receipt.from_json(doc).sealed
    assert nothing.nothing and nothing.differs_from(SealedId()) is None
    why = nothing.differs_from(SealedId(step=1, manifest="r/checkpoints/1/MANIFEST.json"))
    assert why is not None and "step 1" in why and "nothing was sealed" in why
    assert nothing.differs_from(SealedId(done=True, done_sha256="b" * 64)) is not None
    assert not SealedId(done=True).nothing and not SealedId(listing_sha256="a" * 64).nothing
