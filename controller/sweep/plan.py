"""PLAN.toml: a sweep's grid expanded into cells with unique, collision-free names.

(Placeholder: the shapes other modules build on; the sweep's owner fills in the parsing and
the checks.)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional


@dataclasses.dataclass(frozen=True)
class Cell:
    """One cell of a sweep: its index in the roster (0-based, stable: the Slurm array index),
    its run name (unique, never shared with another cell even when the parameters differ only
    in case or punctuation), its parameters, and the command and environment they give."""

    index: int
    name: str
    params: Dict[str, Any]
    command: List[str]
    env: Dict[str, str]


@dataclasses.dataclass(frozen=True)
class Plan:
    """A checked PLAN.toml: the sweep's name, where it runs, and its cells."""

    path: str
    name: str
    cells: List[Cell]
    targets: List[str]  # SSH targets (TARGET strings, controller/target.py); [] with slurm
    slurm: Optional[str]  # the login node's TARGET when the cells are one Slurm job array
    store: Optional[str]  # the store root every cell's run lives under
    job_file: Optional[str]  # the base job file (absolute), or None
    project: str  # the project directory pushed to each box
    outputs: List[str]
    profile: Optional[str]


def load_plan(path: str) -> Plan:
    """Parse and check PLAN.toml (UsageError naming the field on bad input)."""
    raise NotImplementedError
