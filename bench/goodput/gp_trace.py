"""Preemption traces for the goodput harness: made from a seed, saved, replayed.

A trace is in trace minutes, uncompressed (the harness divides every duration by its
compression factor K): ``uptimes_min[i]`` is how long box i runs before it is preempted,
counted from the moment it is up; after each preemption the next box is up ``delay_min``
later (the provisioning delay); the run lasts ``budget_min`` of wall clock in all. Uptimes are
drawn exponential with mean ``mtbp_min`` (memoryless, as spot reclaims are modelled) from
``random.Random(seed)``, so the same mean and seed give the same trace on any machine.

    {"mtbp_min": 10, "seed": 1, "budget_min": 60, "delay_min": 0.5, "uptimes_min": [...]}
"""

from __future__ import annotations

import dataclasses
import json
import random
from typing import Any, Dict, List, Tuple


@dataclasses.dataclass(frozen=True)
class Trace:
    mtbp_min: float
    seed: int
    budget_min: float
    delay_min: float
    uptimes_min: Tuple[float, ...]

    def schedule(self, k: float, grace: float = 0.0) -> List[Tuple[float, float]]:
        """(up, preempted) of each box in seconds from the start, compressed by ``k``; the
        last box ends at the budget (its end is no preemption). The next box is up ``grace``
        (real seconds, not compressed: the old box is gone only then) plus the provisioning
        delay after a preemption."""
        budget = self.budget_min * 60 / k
        out: List[Tuple[float, float]] = []
        up = 0.0
        for gap in self.uptimes_min:
            end = up + gap * 60 / k
            if end >= budget:
                break
            out.append((up, end))
            up = end + grace + self.delay_min * 60 / k
            if up >= budget:
                return out
        out.append((up, budget))
        return out

    def to_json(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        d["uptimes_min"] = [round(u, 4) for u in self.uptimes_min]
        return d


def make(mtbp_min: float, seed: int, budget_min: float, delay_min: float) -> Trace:
    """Exponential uptimes with mean ``mtbp_min`` until they cover ``budget_min``."""
    rng = random.Random(seed)
    ups: List[float] = []
    total = 0.0
    while total < budget_min:
        ups.append(rng.expovariate(1.0 / mtbp_min))
        total += ups[-1] + delay_min
    return Trace(mtbp_min, seed, budget_min, delay_min, tuple(ups))


def load(path: str) -> Trace:
    with open(path) as f:
        d = json.load(f)
    return Trace(
        float(d["mtbp_min"]),
        int(d["seed"]),
        float(d["budget_min"]),
        float(d["delay_min"]),
        tuple(float(u) for u in d["uptimes_min"]),
    )


def save(trace: Trace, path: str) -> None:
    with open(path, "w") as f:
        json.dump(trace.to_json(), f, indent=1)
        f.write("\n")
