"""JSON from another machine or a file it may have written: what the box sends the laptop
(status, events, spec, receipts, listings), what the store holds (state, LATEST, MANIFEST, the
events copy a fresh box reads its history from, epochs, quarantine records), what a provider's
API answers.

Python's ``json`` raises ``RecursionError``, not ``ValueError``, on a document nested deeper
than its parser's recursion limit (``[`` a hundred thousand times is 100 kB). Every reader of
such a document already treats ``ValueError`` as "malformed"; ``loads`` makes too-deep nesting
one more malformed document, so a hostile or damaged one is refused with the reader's own error
and exit code, never a traceback.
"""

from __future__ import annotations

import json

TYPE_CHECKING = False
if TYPE_CHECKING:  # the shim imports this (through journal.py): typing would cost it ~2 MiB
    from typing import Any, Dict, Iterable, List, Union


class TooDeep(ValueError):
    """A JSON document nested past the parser's depth: malformed, like any other."""


def loads(data: Union[str, bytes, bytearray]) -> Any:
    """``json.loads(data)``, raising ``ValueError`` (``TooDeep``) where nesting is too deep for
    the parser; a ``UnicodeDecodeError`` of bytes is a ``ValueError`` already."""
    try:
        return json.loads(data)
    except RecursionError:
        raise TooDeep("JSON nested too deep to parse") from None


def objects(lines: Iterable[Union[str, bytes]]) -> List[Dict[str, Any]]:
    """The lines of a JSON-lines file (events) that are JSON objects, in order: a line being
    written, damaged or not an object is left out, as every reader of events does."""
    out = []
    for line in lines:
        try:
            doc = loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict):
            out.append(doc)
    return out
