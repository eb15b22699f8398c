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
