"""PLACEHOLDER: the stall probe is being written; this stub says so in its verdict."""

from __future__ import annotations

from typing import Any

from onbox.health.verdict import Context, Reading, unavailable


class StallProbe:
    name = "stall"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def check(self, ctx: Context) -> Reading:
        return Reading(unavailable(self.name, "not built yet"))

    def close(self) -> None:
        pass
