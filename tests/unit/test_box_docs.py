"""What the box prints when the laptop reads a file:// store there (controller/results/boxdocs.py):
untrusted input, so output that does not add up is a HostError (exit 9), never a traceback."""

from __future__ import annotations

from typing import Any, List

import pytest

from controller.remote import Remote, Result
from controller.results.boxdocs import BoxDocs
from controller.target import Target
from onbox.common.errors import HostError

# 5000 digits pass isdigit(); int() of them raised ValueError (Python's limit is 4300).
HUGE = b"9" * 5000


class _Box(Remote):
    """A box whose every script prints ``out``."""

    def __init__(self, out: bytes) -> None:
        self.target = Target("local")
        self.out = out
        self.calls: List[Any] = []

    def sh(self, script: str, *args: str, **kw: Any) -> Result:
        self.calls.append(args)
        return Result(0, self.out, b"")


def test_documents_are_read_as_the_box_prints_them() -> None:
    docs = BoxDocs(_Box(b"F 2\n{}N\n"), "/store")
    docs.prefetch(["a", "b"])
    assert (docs.get("a"), docs.get("b")) == (b"{}", None)
    assert BoxDocs(_Box(b"S 5\nQ 5\nF 2\n{}"), "/store").listing("r") == (
        [5],
        {5: "flagged in quarantine/ (the record gives no reason)"},
    )


@pytest.mark.parametrize("size", [HUGE, b"1" * 21])
def test_a_document_size_of_too_many_digits_is_a_host_error(size: bytes) -> None:
    box = _Box(b"F " + size + b"\n")
    with pytest.raises(HostError, match="keep changing while read"):
        BoxDocs(box, "/store").prefetch(["a"])
    assert len(box.calls) == 3  # read again, as a document replaced while read is


@pytest.mark.parametrize("size", [HUGE, b"1" * 21])
def test_a_quarantine_record_size_of_too_many_digits_is_a_host_error(size: bytes) -> None:
    with pytest.raises(HostError, match="cut short"):
        BoxDocs(_Box(b"Q 5\nF " + size + b"\n"), "/store").listing("r")
