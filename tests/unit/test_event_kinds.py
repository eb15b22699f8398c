"""docs/events.md names every event kind the code writes, once, and no kind the code no longer
writes; for each kind, the classes the code writes it with are the ones the doc gives.

The kinds are read from the source with ``ast``: the first argument of each call to an emitter
(``EMITTERS``: ``Journal.event`` and the wrappers around it, by the name they are called
through), as a string constant or a module-level string constant (interval.py's ``KIND``). A
wrapper that forwards a kind it is given (``FORWARDERS``) is followed through its callers, which
call it by a name in ``EMITTERS``. Anything the scan cannot read (a kind that is no constant
outside a forwarder, a call that looks like an event under a name not listed) fails the test
with its place: a new way of writing events must be taught here, not missed.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import re
from typing import Dict, Iterator, List, Optional, Set, Tuple

from tests.conftest import ROOT

DOC = os.path.join(ROOT, "docs", "events.md")
PACKAGES = ("onbox", "controller")  # controller/ writes no event today; it is checked all the same

# Callee (as written) -> what it is. Each writes one event whose kind is its first argument.
EMITTERS = {
    "event": "an injected Journal.event (a parameter), or onbox/cli.py's restore printer",
    "self.event": "an injected Journal.event kept as an attribute, or SealService.event",
    "journal.event": "FileJournal.event (onbox/agent/mailbox.py, onbox/agent/healthuse.py)",
    "self.journal.event": "FileJournal.event (loop.py, supervisor.py, shim.py, sealservice.py)",
    "self._event": "the journal the notifier writes to (onbox/health/notify.py)",
    "self._say": "the notifier's guarded wrapper of it (onbox/health/notify.py)",
}
# (module, function) that pass on a kind they were given: their callers are what is scanned.
FORWARDERS = {
    ("onbox/agent/sealservice.py", "event"),
    ("onbox/health/notify.py", "_say"),
}
# Callees whose name looks like an emitter's but that write no event.
NOT_EVENTS = {
    "_emit": "the CLIs' printer of one line (onbox/cli.py, controller/cli.py)",
    "self.events.emit": "botocore's hook system (onbox/sealing/stores/s3/lean.py)",
}
LOOKS_LIKE = re.compile(r"event|emit|say", re.IGNORECASE)
KIND_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
CLASSES = ("transient", "permanent", "integrity", "usage", "null")
# The class of a call that gives it as an expression (a variable): the doc's cell is not held to
# the code's constants for such a kind, only to those its other calls give.
UNKNOWN = ""


@dataclasses.dataclass(frozen=True)
class Site:
    where: str  # path:line
    kind: str
    klass: str  # one of CLASSES, or UNKNOWN when the call does not say it as a constant


@dataclasses.dataclass
class Scan:
    sites: List[Site] = dataclasses.field(default_factory=list)
    unreadable: List[str] = dataclasses.field(default_factory=list)
    forwarders_seen: Set[Tuple[str, str]] = dataclasses.field(default_factory=set)

    def kinds(self) -> Dict[str, List[Site]]:
        out: Dict[str, List[Site]] = {}
        for s in self.sites:
            out.setdefault(s.kind, []).append(s)
        return out


def _modules() -> Iterator[Tuple[str, ast.Module]]:
    for pkg in PACKAGES:
        for here, dirs, files in os.walk(os.path.join(ROOT, pkg)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for f in sorted(files):
                if f.endswith(".py"):
                    path = os.path.join(here, f)
                    with open(path, encoding="utf-8") as fh:
                        tree = ast.parse(fh.read(), path)
                    yield os.path.relpath(path, ROOT).replace(os.sep, "/"), tree


def _constants(tree: ast.Module) -> Dict[str, str]:
    """The module-level ``NAME = "text"`` of a module."""
    out: Dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            out.update({t.id: value.value for t in targets if isinstance(t, ast.Name)})
    return out


def _klass(call: ast.Call) -> str:
    """The class the call gives its event: a constant's, "null" when it gives none, UNKNOWN
    when it is an expression or may come in a ``**`` spread."""
    given = {k.arg: k.value for k in call.keywords}
    if "klass" in given:
        v = given["klass"]
        if isinstance(v, ast.Constant) and (v.value is None or isinstance(v.value, str)):
            return "null" if v.value is None else str(v.value)
        return UNKNOWN
    return UNKNOWN if None in given else "null"


class _Visitor(ast.NodeVisitor):
    def __init__(self, path: str, consts: Dict[str, str], scan: Scan) -> None:
        self.path, self.consts, self.scan = path, consts, scan
        self.functions: List[str] = []

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self.functions.append(node.name)
        self.generic_visit(node)
        self.functions.pop()

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self.functions.append(node.name)
        self.generic_visit(node)
        self.functions.pop()

    def visit_Call(self, node: ast.Call) -> None:
        self.generic_visit(node)
        callee = ast.unparse(node.func)
        first = node.args[0] if node.args else None
        kind: Optional[str] = None
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            kind = first.value
        elif isinstance(first, ast.Name):
            kind = self.consts.get(first.id)
        where = f"{self.path}:{node.lineno}"
        if callee in EMITTERS:
            inside = (self.path, self.functions[-1] if self.functions else "")
            if kind is not None:
                self.scan.sites.append(Site(where, kind, _klass(node)))
            elif inside in FORWARDERS:
                self.scan.forwarders_seen.add(inside)
            else:
                shown = ast.unparse(first) if first is not None else "no argument"
                self.scan.unreadable.append(
                    f"{where}: {callee}({shown}, ...): its kind is no string constant"
                )
            return
        tail = callee.rsplit(".", 1)[-1]
        if isinstance(first, ast.Constant) and LOOKS_LIKE.search(tail) and callee not in NOT_EVENTS:
            self.scan.unreadable.append(
                f"{where}: {callee}({first.value!r}, ...) looks like an event, but {callee} is "
                "neither in EMITTERS nor in NOT_EVENTS"
            )


def scan() -> Scan:
    out = Scan()
    for path, tree in _modules():
        _Visitor(path, _constants(tree), out).visit(tree)
    return out


def documented() -> Dict[str, List[Tuple[int, str]]]:
    """Each kind in docs/events.md's tables of kinds -> [(line, its class cell)]."""
    out: Dict[str, List[Tuple[int, str]]] = {}
    in_kinds = False
    with open(DOC, encoding="utf-8") as f:
        lines = f.read().splitlines()
    for n, line in enumerate(lines, 1):
        if not line.startswith("|"):
            in_kinds = False
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == "kind":
            in_kinds = True
            assert len(cells) == 5, f"docs/events.md:{n}: a table of kinds has 5 columns"
            continue
        if not in_kinds or set(line) <= set("|- "):
            continue
        m = re.fullmatch(r"`([^`]+)`", cells[0])
        assert m and len(cells) == 5, (
            f"docs/events.md:{n}: a row of a table of kinds is `kind` then 4 cells "
            f"(no '|' inside a cell): {line[:80]}"
        )
        out.setdefault(m.group(1), []).append((n, cells[1]))
    return out


def _listing(kinds: Dict[str, List[Site]], names: Set[str]) -> str:
    return "\n".join(
        f"  {k}  (written at {', '.join(s.where for s in kinds[k])})" for k in sorted(names)
    )


def test_the_scan_reads_every_event_call() -> None:
    s = scan()
    assert s.unreadable == [], "event calls the scan cannot read:\n" + "\n".join(s.unreadable)
    assert s.forwarders_seen == FORWARDERS, "a FORWARDERS entry forwards nothing any more"
    bad = sorted({x.kind for x in s.sites if not KIND_NAME.match(x.kind)})
    assert bad == [], f"event kinds that are no snake_case name: {bad}"
    # Each way of writing an event is found: a constant, a module constant, a forwarder's caller.
    assert {"state", "checkpoint_interval", "epoch", "notify_failed", "sealed"} <= set(s.kinds())


def test_every_kind_the_code_writes_is_in_the_doc() -> None:
    kinds = scan().kinds()
    missing = set(kinds) - set(documented())
    assert not missing, (
        f"{len(missing)} event kind(s) the code writes are not in docs/events.md (add a row to "
        "the table of the part that writes each):\n" + _listing(kinds, missing)
    )


def test_the_doc_names_no_kind_the_code_does_not_write() -> None:
    doc = documented()
    stale = sorted(set(doc) - set(scan().kinds()))
    assert not stale, "docs/events.md names kinds no code writes any more: " + ", ".join(
        f"{k} (line {doc[k][0][0]})" for k in stale
    )


def test_each_kind_is_in_the_doc_once() -> None:
    twice = {k: [n for n, _ in rows] for k, rows in documented().items() if len(rows) > 1}
    assert twice == {}, f"kinds with more than one row in docs/events.md (lines): {twice}"


def test_the_doc_gives_each_kind_the_classes_the_code_writes_it_with() -> None:
    """Every class a call gives as a constant (or "null": none) is in the kind's class cell;
    where every call does, the cell names no other."""
    doc = documented()
    wrong = []
    for kind, sites in sorted(scan().kinds().items()):
        if kind not in doc:
            continue  # test_every_kind_the_code_writes_is_in_the_doc says so
        line, cell = doc[kind][0]
        said = set(re.findall(r"\b(" + "|".join(CLASSES) + r")\b", cell))
        code = {s.klass for s in sites if s.klass != UNKNOWN}
        all_known = all(s.klass != UNKNOWN for s in sites)
        if not code <= said or (all_known and said != code):
            wrong.append(
                f"  {kind} (line {line}): the doc says {sorted(said)}, the code {sorted(code)}"
            )
    assert wrong == [], "docs/events.md's class column differs from the code:\n" + "\n".join(wrong)
