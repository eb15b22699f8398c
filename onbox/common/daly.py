"""The checkpoint interval that loses the least work: Daly's higher-order formula.

For a checkpoint that costs ``d`` seconds (what a checkpoint takes from the job: the time its
loop is blocked saving) and a mean time of ``m`` seconds between the unplanned stops that lose
work (preemptions with no final checkpoint, crashes, OOM kills), Daly (2006, "A
higher order estimate of the optimum checkpoint interval for restart dumps") gives

    t = sqrt(2 d m) * (1 + sqrt(d / (2 m)) / 3 + d / (18 m)) - d     for d < 2 m
    t = m                                                            otherwise

which refines Young's sqrt(2 d m) where checkpoints are not cheap against failures. With no
failure seen yet (``m`` unknown) the interval keeps the checkpoint overhead at a target
fraction (``d / t = overhead``, 10 %), or, given the time survived so far, Daly's with that
time as ``m`` where it is longer (the interval grows while nothing fails); it never goes below
a floor (the agent's
hang-detection budget: asking more often than a hang can be told from a slow checkpoint buys
nothing), nor above a day (MAX_INTERVAL), whatever the records it was computed from say.

``m`` comes from ``mtbf``: the stops seen, of which some lost work and the rest were covered
(a preemption whose grace sealed a final checkpoint). A run that has seen only covered stops
has evidence that its stops come with a usable grace, so the share of stops that lose work is
estimated as Krichevsky-Trofimov's (lost + 1/2) / (stops + 1), not taken as all or none.

Pure arithmetic, standard library only: the agent (onbox/agent/interval.py) and its
tests use it.
"""

from __future__ import annotations

import math
from typing import Optional

OVERHEAD = 0.10  # the share of time checkpoints may take while no failure was ever seen
# The longest checkpoint cost believed (a save that holds the loop an hour): a longer d is a
# damaged record or measurement, and would stretch the interval past any use.
MAX_D = 3600.0
# The longest interval chosen, whatever was measured: the timer still asks for a checkpoint
# every day (an interval of years is one that never fires).
MAX_INTERVAL = 24 * 3600.0


def daly(d: float, m: float) -> float:
    """Daly's higher-order optimum interval (seconds of work between checkpoints) for a
    checkpoint cost ``d`` and a mean time between failures ``m``, both in seconds, both > 0."""
    if not (d > 0 and m > 0 and math.isfinite(d) and math.isfinite(m)):
        raise ValueError(f"daly needs finite d > 0 and m > 0, got d={d!r} m={m!r}")
    x = d / m / 2
    if x >= 1:
        return m
    # The formula over 2m, in x = d / 2m (< 1): under 4/9, so t stays below m, finite
    # wherever m is, with no intermediate (2 d m) that overflows for a huge m.
    r = math.sqrt(x)
    return 2 * (r * (1 + r / 3 + x / 9) - x) * m


def mtbf(up: float, lost: int, covered: int) -> Optional[float]:
    """The mean time between stops that lose work, from ``up`` seconds of running with
    ``lost`` stops that lost work and ``covered`` that did not (a final checkpoint sealed in
    the grace); None before any stop (``choose`` then grows the interval with the time
    survived). The stop rate is n / up (n = lost + covered) and the share that loses work
    (lost + 1/2) / (n + 1): one covered stop in an hour gives 4 hours, four stops that all
    lost work 0.28 h (about up / lost, as plain counting would)."""
    n = lost + covered
    if n <= 0 or up <= 0:
        return None
    return up * (n + 1) / (n * (lost + 0.5))


def overhead_target(d: float, overhead: float = OVERHEAD) -> float:
    """The interval at which checkpoints of cost ``d`` take ``overhead`` of the time."""
    if not (d > 0 and 0 < overhead < 1):
        raise ValueError(
            f"overhead_target needs d > 0 and 0 < overhead < 1, got {d!r}, {overhead!r}"
        )
    return d / overhead


def choose(d: Optional[float], m: Optional[float], floor: float, survived: float = 0.0) -> float:
    """The interval to use: Daly's with both measured; with only ``d`` (no failure seen yet)
    the overhead target, or Daly's with M = ``survived`` (seconds up without a failure) where
    that is longer; ``floor`` with nothing measured; never below ``floor``, never above
    MAX_INTERVAL (unless the floor is). A ``d`` over MAX_D counts as MAX_D, a NaN one as
    nothing measured, an ``m`` or ``survived`` that is no finite time > 0 as none: the inputs
    come from records a crash or a damaged store may have left, and a bad one must give an
    interval, not an exception."""
    if d is None or not d > 0:
        return floor
    d = min(d, MAX_D)
    if m is not None and m > 0 and math.isfinite(m):
        t = daly(d, m)
    else:
        t = overhead_target(d)
        if survived > 0 and math.isfinite(survived):
            t = max(t, daly(d, survived))
    return max(floor, min(t, MAX_INTERVAL))
