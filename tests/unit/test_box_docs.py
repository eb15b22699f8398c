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


def test_log_documents_are_read_by_epoch_and_names_rgt_never_writes_are_left_out() -> None:
    """rgt_logdocs prints each RUN/logs/e*.json: only a name logs_doc_key makes is an epoch's
    (e01.json, e1.json.json or a name with a space in it is no document of rgt's)."""
    out = (
        b"L e1.json\nF 2\n{}L e01.json\nF 2\n[]L e7.json\nN\nL e 2.json\nF 1\nxL e12.json\nF 3\n[1]"
    )
    assert BoxDocs(_Box(out), "/store").log_docs("r") == {1: b"{}", 12: b"[1]"}


@pytest.mark.parametrize(
    "out",
    [
        b"L e1.json\nF 9\n{}",
        b"L e1.json\n",
        b"X e1.json\nN\n",
        b"L e1.json",
        b"L e1.json\nF " + HUGE,
    ],
)
def test_log_documents_that_do_not_add_up_are_a_host_error(out: bytes) -> None:
    with pytest.raises(HostError, match="log documents on the box"):
        BoxDocs(_Box(out), "/store").log_docs("r")
