"""Lines of a growing output file, read incrementally: the job's log, for the step a progress
pattern captures (the resume check, the stall probe) or a metric (the training probe).

Each ``scan`` reads at most ``budget`` bytes from where the last one stopped, so a reader never
holds its caller up and never reads a whole log twice. Standard library only.
"""

from __future__ import annotations

import re
from typing import List, Optional, Union

MAX_LINE = 8192  # longer lines are matched on their last MAX_LINE bytes
_EOL = re.compile(rb"[\r\n]")  # tqdm-style progress ends its lines with \r


def step_group(rx: re.Pattern[str]) -> Union[int, str]:
    """Which group of a compiled progress pattern holds the step."""
    return "step" if "step" in rx.groupindex else 1


class LineReader:
    """Whole lines appended to a file since the last call (``lines``)."""

    def __init__(self) -> None:
        self.offset = 0
        self._carry = b""

    def lines(self, path: str, budget: int, final: bool = False) -> List[str]:
        """The whole lines read now (at most ``budget`` bytes). Only whole lines count (``step
        1`` may still become ``step 12``), unless ``final``: the writer is gone."""
        try:
            with open(path, "rb") as f:
                f.seek(self.offset)
                data = f.read(budget)
        except OSError:
            return []
        self.offset += len(data)
        lines = _EOL.split(self._carry + data)
        tail = lines.pop()
        if final and len(data) < budget:
            lines.append(tail)
            tail = b""
        self._carry = tail[-MAX_LINE:]
        return [raw[-MAX_LINE:].decode("utf-8", "replace") for raw in lines]


class LogScanner:
    """The first step a progress pattern captures in a growing output file, read incrementally:
    ``scan`` reads at most ``budget`` bytes from where the last call stopped."""

    def __init__(self, rx: re.Pattern[str]) -> None:
        self.rx = rx
        self.group: Union[int, str] = step_group(rx)
        self._reader = LineReader()

    @property
    def offset(self) -> int:
        return self._reader.offset

    def scan(self, path: str, budget: int, final: bool = False) -> Optional[int]:
        """The first step in the lines read now (the rest of them are consumed)."""
        for line in self._reader.lines(path, budget, final):
            step = self.match(line)
            if step is not None:
                return step
        return None

    def last(self, path: str, budget: int, final: bool = False) -> Optional[int]:
        """The last step in the lines read now: where the job is (the stall probe)."""
        found = None
        for line in self._reader.lines(path, budget, final):
            step = self.match(line)
            if step is not None:
                found = step
        return found

    def match(self, line: str) -> Optional[int]:
        m = self.rx.search(line)
        if m is None:
            return None
        try:
            return int(m.group(self.group))
        except (TypeError, ValueError, IndexError):  # an optional group that did not match
            return None
