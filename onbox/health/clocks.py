"""The danger clocks probe: the platform's fixed limits on a run's life (Colab's 12 h VM, a
Kaggle session's 9 h, a Slurm allocation's wall time), from the run's profile. It owns the
rule: the run's age (since this incarnation began) at ``WARN_AT`` of a clock warns, naming the
clock, what happens then and what to do; at the clock itself, an alert.

Only clocks that tick while the box runs are the run's: a profile also lists clocks that start
when the box stops (a stopped instance released after 15 days), when it is idle (a notebook
disconnected after 90 idle minutes: a training run is not idle) or in arrears. The profile
schema does not say which kind a clock is, so ``runs_with_box`` tells them apart by their
words; a schema field would be better (see the report of issue 14).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from onbox.health.verdict import Context, Reading, Verdict, ok, unavailable, unknown

WARN_AT = 0.8  # of a clock's length

Clock = Tuple[str, float, str, str]  # name, seconds, what happens, remedy
# Words of a clock that does not start with the run: it starts when the box stops or idles.
_NOT_RUN_AGE = ("idle", "a stopped", "after it stopped", "after shutdown", "arrears", "released")


def runs_with_box(clock: Clock) -> bool:
    """Whether ``clock`` counts the box's running time (a VM lifetime, a session cap)."""
    name, _, what, _ = clock
    words = f"{name} {what}".lower()
    return not any(w in words for w in _NOT_RUN_AGE)


def _span(seconds: float) -> str:
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class ClocksProbe:
    """The run's age against each of the profile's danger clocks."""

    name = "clocks"

    def __init__(self, danger: Sequence[Clock]) -> None:
        mine = (c for c in danger if c[1] > 0 and runs_with_box(c))
        self.danger: List[Clock] = sorted(mine, key=lambda c: c[1])

    def check(self, ctx: Context) -> Reading:
        if not self.danger:
            why = "the run's profile has no clock that runs with the box"
            return Reading(unavailable(self.name, why))
        if ctx.run_started is None:
            return Reading(unknown(self.name, "the run's start time is not known"))
        age = max(0.0, ctx.wall - ctx.run_started)
        sample = {"age_s": round(age, 1)}
        worst: Optional[Verdict] = None
        for name, seconds, what, remedy in self.danger:
            if age >= seconds:
                level, when = "alert", f"ran out {_span(age - seconds)} ago"
            elif age >= WARN_AT * seconds:
                level, when = "warn", f"runs out in {_span(seconds - age)}"
            else:
                continue
            v = Verdict(
                self.name,
                level,
                f"clock_{name}" if level == "warn" else f"clock_{name}_out",
                f"{name} ({_span(seconds)}) {when}: {what}",
                remedy,
                "transient",
                {"clock": name, "seconds": seconds, "age_s": round(age, 1)},
            )
            if worst is None or (level == "alert" and worst.level != "alert"):
                worst = v
        if worst is not None:
            return Reading(worst, sample)
        first = self.danger[0]
        return Reading(
            ok(self.name, f"run age {_span(age)}; {first[0]} runs out in {_span(first[1] - age)}"),
            sample,
        )

    def close(self) -> None:
        pass
