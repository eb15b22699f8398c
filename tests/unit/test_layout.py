"""The house rules of the layout (README: Module map), read from the source itself.

The wings may import only downward: ``onbox.common`` nothing of onbox's wings; ``onbox.train``
(the job's own Python imports it) and ``onbox.sealing`` only ``onbox.common``; ``onbox.agent``
``onbox.common`` and ``onbox.sealing``; nothing in onbox imports ``controller``. A room stays
small enough to read (500 lines a module, 80 a function) and keeps its private names to itself.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
from typing import Dict, Iterator, List, Set, Tuple

import pytest

from tests.conftest import ROOT

MAX_MODULE_LINES = 500
# The framework callbacks of the training API and the framework each needs.
CALLBACKS = (("hf", "transformers"), ("lightning", "lightning"), ("accelerate", "accelerate"))
MAX_FUNCTION_LINES = 80

# wing -> the wings it may import (its own always allowed; "onbox" is the package root).
MAY_IMPORT: Dict[str, Set[str]] = {
    "onbox.common": {"onbox"},
    "onbox.train": {"onbox", "onbox.common"},
    "onbox.sealing": {"onbox", "onbox.common"},
    "onbox.profiles": {"onbox", "onbox.common"},
    "onbox.health": {"onbox", "onbox.common"},
    "onbox.agent": {"onbox", "onbox.common", "onbox.sealing", "onbox.profiles", "onbox.health"},
    "onbox.cli": {
        "onbox",
        "onbox.common",
        "onbox.sealing",
        "onbox.agent",
        "onbox.profiles",
        "onbox.health",
    },
}


def _modules(*roots: str) -> Iterator[Tuple[str, str]]:
    """(dotted module name, path) of every module under ``roots``."""
    for root in roots:
        for here, dirs, files in os.walk(os.path.join(ROOT, root)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for f in sorted(files):
                if f.endswith(".py"):
                    path = os.path.join(here, f)
                    rel = os.path.relpath(path, ROOT)[: -len(".py")].replace(os.sep, ".")
                    yield rel.removesuffix(".__init__"), path


def _parse(path: str) -> ast.Module:
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), path)


def _imports(path: str) -> List[str]:
    """Every module ``path`` imports (``from a import b`` counts as ``a`` and ``a.b``)."""
    tree = _parse(path)
    out: List[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append(node.module)
            out += [f"{node.module}.{a.name}" for a in node.names]
    return out


def _wing(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "onbox" and len(parts) > 1 else parts[0]


def test_onbox_never_imports_controller() -> None:
    """The box has no controller installed: an import of it from onbox breaks the agent there."""
    bad = [
        (m, i)
        for m, p in _modules("onbox")
        for i in _imports(p)
        if i == "controller" or i.startswith("controller.")
    ]
    assert bad == []


def test_each_wing_imports_only_the_wings_below_it() -> None:
    """The training API imports nothing of the agent or of sealing; sealing nothing of the
    agent; the ground floor nothing above it."""
    bad = []
    for module, path in _modules("onbox"):
        wing = _wing(module)
        allowed = MAY_IMPORT.get(wing)
        if allowed is None:
            continue  # the package root
        for imp in _imports(path):
            if not imp.startswith("onbox."):
                continue
            target = _wing(imp)
            if target != wing and target not in allowed and imp not in allowed:
                bad.append(f"{module} imports {imp}")
    assert sorted(set(bad)) == []


def test_the_training_api_loads_nothing_of_the_agent_in_the_jobs_python() -> None:
    """What the wall means at run time: a job that imports the training API and every
    framework callback's module gets no agent, sealing or controller module into its process."""
    code = (
        "import importlib, importlib.util, sys, onbox.train\n"
        # A callback needs its framework (the Python 3.9 venv of scripts/check has none).
        "for m, dep in (('hf', 'transformers'), ('lightning', 'lightning'),"
        " ('accelerate', 'accelerate')):\n"
        "    if importlib.util.find_spec(dep) is not None:\n"
        "        importlib.import_module('onbox.train.' + m)\n"
        "ours = [m for m in sys.modules if m.startswith(('onbox.', 'controller'))]\n"
        "print('\\n'.join(sorted(ours)))"
    )
    p = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr
    loaded = p.stdout.split()
    assert [m for m in loaded if not m.startswith(("onbox.train", "onbox.common"))] == []
    assert "onbox.train.checkpointer" in loaded
    for module, dep in (
        ("hf", "transformers"),
        ("lightning", "lightning"),
        ("accelerate", "accelerate"),
    ):
        if importlib.util.find_spec(dep) is not None:  # the same Python as the subprocess
            assert f"onbox.train.{module}" in loaded


@pytest.mark.parametrize("root", ["onbox", "controller"])
def test_no_module_is_over_500_lines_and_no_function_over_80(root: str) -> None:
    long_modules, long_functions = [], []
    for module, path in _modules(root):
        with open(path, encoding="utf-8") as f:
            src = f.read()
        n = src.count("\n")
        if n > MAX_MODULE_LINES:
            long_modules.append(f"{module}: {n} lines")
        for node in ast.walk(ast.parse(src, path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long_functions.append(f"{module}.{node.name}: {length} lines")
    assert (long_modules, long_functions) == ([], [])


def test_no_module_imports_a_private_name_of_another() -> None:
    """``from a import _x`` and ``a._x`` for a module ``a`` of rgt's own: a private name is
    the owning module's to change; what another needs it exports."""
    ours = {m for m, _ in _modules("onbox", "controller")}
    bad = []
    for module, path in _modules("onbox", "controller"):
        tree = _parse(path)
        aliases: Dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in ours and not node.level:
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        bad.append(f"{module}: from {node.module} import {a.name}")
                    if f"{node.module}.{a.name}" in ours:
                        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in ours and a.asname:
                        aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and aliases[node.value.id] != module
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                bad.append(f"{module}: {aliases[node.value.id]}.{node.attr}")
    assert sorted(set(bad)) == []


# The laptop's own files it may parse with json directly: the smoke's local box is this
# machine's, written by the same rgt a moment before.
LAPTOP_OWN_JSON = {"controller.smoke.localbox"}


def test_the_laptop_parses_json_only_through_the_loader_that_refuses_deep_nesting() -> None:
    """``json.loads``/``json.load`` raise RecursionError on a document nested past the
    parser's depth, which no reader's ``except ValueError`` catches: what the box, the store
    or a provider sends the laptop goes through onbox.common.jsondoc.loads."""
    bad = []
    for module, path in _modules("controller"):
        if module in LAPTOP_OWN_JSON:
            continue
        for node in ast.walk(_parse(path)):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "json"
                and node.func.attr in ("loads", "load")
            ):
                bad.append(f"{module}:{node.lineno}: json.{node.func.attr}")
    assert bad == []
