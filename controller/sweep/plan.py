"""PLAN.toml: a sweep's grid expanded into cells with unique, collision-free names.

    name = "lr-sweep"                       # every cell's run name starts with it
    job = "job.toml"                        # optional base job file, relative to the plan
    project = "."                           # optional: the code pushed (default: the plan's dir)
    command = ["python", "train.py", "--lr", "{lr}", "--seed", "{seed}", "--out", "{out}"]
    targets = ["root@10.0.0.2:22", "gpu2"]  # SSH boxes, each one sequential queue; or:
    slurm = "login-node"                    # one Slurm job array (controller/slurm/array.py)
    store = "s3://bucket/sweeps"            # store root; each cell is its own run under it
    outputs = ["out"]                       # each cell's results: out/<cell name>
    profile = "generic-ssh"                 # optional; python = "...", offline = true,
                                            # secret_env = ["VAR"] as for rgt deploy
    [sbatch]                                # with slurm: time = "2:00:00" (required),
                                            # partition, gpus, cpus, mem, extra = ["--qos=x"],
                                            # seal_time (as rgt deploy --profile slurm's flags)
    [grid]                                  # the cartesian product; str/int/float/bool values
    lr = [1e-3, 3e-4]
    seed = [0, 1, 2]
    [cost]                                  # optional: a factor per grid value; a cell's cost
    lr = { "0.001" = 2 }                    # is the product (default 1), for the assignment

Placeholders in ``command``: ``{KEY}`` for each grid key (the value as text: ``true``/``false``
for booleans), ``{cell}`` (the cell's run name) and ``{out}`` (its first output path);
``{{``/``}}`` are literal braces. Each output without ``{cell}`` in it becomes
``OUTPUT/{cell}``: the job runs in the release directory, which every cell on a box shares,
so a cell's declared outputs must be a path of its own (the agent seals outputs relative to
that workdir, onbox/agent/completion.py). The job also gets ``RGT_CELL`` (its name),
``RGT_SWEEP`` and, with outputs, ``RGT_CELL_OUT`` in its environment. Everything else a cell
writes is already its own: its run directory, checkpoint dir and store prefix (the run name).

A cell's name is ``<sweep>-<slug>-<h>``: the slug is its parameters made file-name safe
(lowercase letters, digits, '-'; bounded), ``h`` 8 hex digits of the sha256 of their canonical
JSON, so cells whose parameters differ only in case or punctuation ("a.b"/"a-b", "A"/"a") still
get distinct names and paths, on a case-insensitive file system too (the names are compared
casefolded; the mapping is checked injective).

``load_plan`` refuses (UsageError naming the field) before anything is deployed: unknown keys,
an empty grid, duplicate cells, a placeholder with no grid key, a grid key the command never
uses (its cells would run the same thing), targets and slurm both or neither, a target given
twice (two queues on one box), a bad name, store, output or job file (a job file's own
``outputs`` or ``checkpoint.dir`` would be shared by every cell).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import os
import re
import string
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from onbox.agent.spec import check_outputs, store_override
from onbox.common.errors import UsageError
from onbox.common.rundir import check_name
from onbox.common.storeurl import parse_store_url, restore_stall

MAX_CELLS = 10000
MAX_SWEEP_NAME = 32
HASH_LEN = 8
RERUN_RESERVE = 5  # "-r" and up to three digits: a cell's fresh re-run (controller/sweep/run.py)
MAX_SLUG = 24
RESERVED = ("cell", "out")
_KEYS = {
    "name", "job", "project", "command", "targets", "slurm", "store", "outputs", "profile",
    "python", "offline", "secret_env", "grid", "cost", "sbatch",
}  # fmt: skip
# PLAN.toml's [sbatch] (with slurm =): the job array's walltime and resources, as rgt deploy
# --profile slurm's flags (controller/slurm/submit.py checks the values), and their types here.
SBATCH_KEYS: Dict[str, type] = {"time": str, "partition": str, "gpus": str, "cpus": int,
                                 "mem": str, "extra": list, "seal_time": str}  # fmt: skip
_NON_SLUG = re.compile(r"[^a-z0-9]+")


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
    outputs: List[str] = dataclasses.field(default_factory=list)  # relative to the workdir
    cost: float = 1.0  # relative cost, for the assignment to targets


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
    python: Optional[str] = None  # the boxes' Python, when python3 is not it
    offline: bool = False  # bring the agent's dependencies from here
    secret_env: List[str] = dataclasses.field(default_factory=list)
    sbatch: Dict[str, Any] = dataclasses.field(default_factory=dict)  # [sbatch], with slurm
    # The base job file's [store] endpoint_url, which each cell's box keeps for the s3:// store
    # (onbox/agent/spec.py store_override): the laptop reads the store there too.
    store_endpoint: Optional[str] = None
    # The base job file's [store] stall (None: not set, the default): the bound on each of the
    # laptop's reads of the store (controller/runstore.py open_sweep_store).
    store_stall: Optional[float] = None


def _read_toml(path: str) -> Dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib  # novermin
    else:  # pragma: no cover - older laptops
        import tomli as tomllib
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise UsageError("PLAN.toml", f"cannot read {path}: {e.strerror}") from None
    except ValueError as e:
        raise UsageError("PLAN.toml", f"{path} is not TOML: {e}") from None


def text(value: Any) -> str:
    """A grid value as it is put into the command (and named in ``[cost]``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def canonical(params: Dict[str, Any]) -> str:
    """The canonical JSON of a cell's parameters: its identity (1, 1.0, "1" and true differ)."""
    return json.dumps(params, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def cell_name(sweep: str, params: Dict[str, Any]) -> str:
    """``<sweep>-<slug>-<h>`` (module docstring), within the run-name length."""
    h = hashlib.sha256(canonical(params).encode()).hexdigest()[:HASH_LEN]
    room = 63 - len(sweep) - 2 - HASH_LEN - RERUN_RESERVE
    raw = "-".join(f"{k}-{text(v)}" for k, v in params.items()).lower()
    slug = _NON_SLUG.sub("-", raw).strip("-")[: min(MAX_SLUG, room)].strip("-") or "cell"
    return f"{sweep}-{slug}-{h}"


def _check_name(doc: Dict[str, Any]) -> str:
    name = doc.get("name")
    if not isinstance(name, str):
        raise UsageError("name", "is missing: the sweep's name", 'e.g. name = "lr-sweep"')
    check_name(name, "name")
    if len(name) > MAX_SWEEP_NAME or not re.fullmatch(r"[a-z0-9][a-z0-9-]*[a-z0-9]|[a-z0-9]", name):
        raise UsageError(
            "name",
            f"{name!r} is not a sweep name",
            f"lowercase letters, digits and '-', at most {MAX_SWEEP_NAME} characters, not "
            "ending in '-' (every cell's run name starts with it)",
        )
    return name


def _check_grid(doc: Dict[str, Any]) -> Dict[str, List[Any]]:
    grid = doc.get("grid")
    if not isinstance(grid, dict) or not grid:
        raise UsageError("grid", "is empty: a sweep needs at least one key", "[grid] lr = [1e-3]")
    out: Dict[str, List[Any]] = {}
    for key, values in grid.items():
        field = f"grid.{key}"
        if not key.isidentifier() or key in RESERVED:
            raise UsageError(field, f"{key!r} cannot be a grid key", "a plain identifier, not "
                             f"{' or '.join(RESERVED)} (placeholders of their own)")  # fmt: skip
        if not isinstance(values, list) or not values:
            raise UsageError(field, "must be a non-empty list of values", f"{key} = [1, 2]")
        for v in values:
            ok = isinstance(v, (str, int, bool)) or (isinstance(v, float) and math.isfinite(v))
            if not ok:
                raise UsageError(field, f"{v!r} is not a string, integer, finite float or bool")
        out[key] = values
    return out


def _fields(template: str, field: str) -> List[str]:
    """The placeholder names in ``template`` (UsageError for a malformed one)."""
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError as e:
        raise UsageError(field, f"{template!r}: {e}", "write a literal brace as {{ or }}") from None
    names = []
    for _, name, spec, conv in parts:
        if name is None:
            continue
        if not name.isidentifier() or spec or conv:
            raise UsageError(field, f"{template!r}: {{{name}}} is not a placeholder",
                             "plain {KEY} only: a grid key, {cell} or {out}")  # fmt: skip
        names.append(name)
    return names


def _expand(template: str, values: Dict[str, str]) -> str:
    out = []
    for literal, name, _, _ in string.Formatter().parse(template):
        out.append(literal)
        if name is not None:
            out.append(values[name])
    return "".join(out)


def _check_command(doc: Dict[str, Any], grid: Dict[str, List[Any]], has_outputs: bool) -> List[str]:
    command = doc.get("command")
    if not isinstance(command, list) or not command or not all(isinstance(a, str) for a in command):
        raise UsageError(
            "command",
            "must be a non-empty list of strings (the argv template)",
            'e.g. command = ["python", "train.py", "--lr", "{lr}"]',
        )
    used = set()
    for arg in command:
        for name in _fields(arg, "command"):
            if name not in grid and name not in RESERVED:
                raise UsageError(
                    "command", f"placeholder {{{name}}} names no grid key",
                    f"grid keys: {', '.join(grid)}; or {{cell}}, {{out}}",
                )  # fmt: skip
            used.add(name)
    for key in grid:
        if key not in used and len(grid[key]) > 1:
            raise UsageError(
                f"grid.{key}",
                f"the command never uses {{{key}}}: its cells would all run the same thing",
                f"pass it, e.g. --{key} {{{key}}}",
            )
    if has_outputs and not used & set(RESERVED):
        raise UsageError(
            "command",
            "uses neither {out} nor {cell}: every cell on a box would write the same outputs",
            "make the job write its results to {out} (a path of the cell's own)",
        )
    return command


def _check_outputs(doc: Dict[str, Any]) -> List[str]:
    outputs = doc.get("outputs", [])
    check_outputs(outputs)
    for o in outputs:
        for name in _fields(o, "outputs"):
            if name != "cell":
                raise UsageError("outputs", f"{o!r}: only {{cell}} may be used in an output")
    return [o if "{cell}" in o else o.rstrip("/") + "/{cell}" for o in outputs]


def _check_costs(doc: Dict[str, Any], grid: Dict[str, List[Any]]) -> Dict[str, Dict[str, float]]:
    cost = doc.get("cost", {})
    if not isinstance(cost, dict):
        raise UsageError("cost", "must be a table", '[cost] epochs = { "50" = 5 }')
    out: Dict[str, Dict[str, float]] = {}
    for key, table in cost.items():
        field = f"cost.{key}"
        if key not in grid:
            raise UsageError(field, f"{key!r} is not a grid key", f"grid keys: {', '.join(grid)}")
        if not isinstance(table, dict):
            raise UsageError(field, "must map a value to its factor", f'{key} = {{ "50" = 5 }}')
        known = {text(v) for v in grid[key]}
        for value, factor in table.items():
            if value not in known:
                raise UsageError(field, f"{value!r} is not one of grid.{key}'s values")
            ok = isinstance(factor, (int, float)) and not isinstance(factor, bool)
            if not ok or not (0 < factor < math.inf):
                raise UsageError(field, f"{value}: {factor!r} is not a positive number")
        out[key] = {v: float(f) for v, f in table.items()}
    return out


def _where(doc: Dict[str, Any]) -> Tuple[List[str], Optional[str]]:
    """(targets, slurm): exactly one of them."""
    from controller.target import parse_target

    targets, slurm = doc.get("targets"), doc.get("slurm")
    if (targets is None) == (slurm is None):
        raise UsageError(
            "targets",
            "give either targets (SSH boxes) or slurm (a login node), "
            + ("not both" if targets is not None else "one of them"),
            'e.g. targets = ["gpu1", "root@10.0.0.2:22"]',
        )
    if slurm is not None:
        if not isinstance(slurm, str):
            raise UsageError("slurm", "must be the login node's TARGET, a string")
        parse_target(slurm)
        return [], slurm
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise UsageError("targets", "must be a non-empty list of TARGET strings")
    seen: Dict[Any, str] = {}
    for t in targets:
        parsed = parse_target(t)
        key = (parsed.kind, parsed.host, parsed.user, parsed.port)
        if key in seen:
            raise UsageError(
                "targets",
                f"{t!r} is the same box as {seen[key]!r}: one queue per box, never two jobs "
                "at once on one instance",
                "list each box once",
            )
        seen[key] = t
    return list(targets), None


def _check_store(doc: Dict[str, Any]) -> str:
    store = doc.get("store")
    if not isinstance(store, str):
        raise UsageError(
            "store", "is missing: every cell is sealed under it", 'store = "s3://bucket/sweeps"'
        )
    parse_store_url(store, "store")
    return store


def check_store_here(plan: Plan) -> None:
    """Refuse a ``file://`` store that is no directory on this laptop: rgt sweep and reconcile
    read every cell's documents from the store here (rgt emit need not)."""
    url = parse_store_url(plan.store or "", "store")
    if url.scheme == "file" and not os.path.isdir(url.path):
        raise UsageError(
            "store",
            f"{plan.store}: {url.path} is not a directory on this laptop",
            "rgt sweep and rgt reconcile read every cell from the store here: use a store "
            "this laptop reads (s3://, hf://, or a file:// mount it shares)",
        )


def _check_job(doc: Dict[str, Any], base: str, project: str) -> Optional[str]:
    job = doc.get("job")
    if job is None:
        return None
    if not isinstance(job, str):
        raise UsageError("job", "must be the path of a job file, relative to the plan")
    path = os.path.abspath(os.path.join(base, job))
    if os.path.relpath(path, project).startswith(".."):
        raise UsageError("job", f"{path} is not inside the project {project}")
    data = _read_toml(path)
    if "outputs" in data:
        raise UsageError("job", f"{job} declares outputs: every cell would share them",
                         "declare them in PLAN.toml's outputs (one path per cell)")  # fmt: skip
    ckpt = data.get("checkpoint")
    if isinstance(ckpt, dict) and "dir" in ckpt:
        raise UsageError("job", f"{job} sets checkpoint.dir: every cell on a box would share it",
                         "leave it out: each cell's run gets its own")  # fmt: skip
    return path


def _options(doc: Dict[str, Any]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for key in ("profile", "python"):
        if doc.get(key) is not None and not isinstance(doc[key], str):
            raise UsageError(key, "must be a string")
        out[key] = doc.get(key)
    if not isinstance(doc.get("offline", False), bool):
        raise UsageError("offline", "must be true or false")
    out["offline"] = doc.get("offline", False)
    secrets = doc.get("secret_env", [])
    if not isinstance(secrets, list) or not all(isinstance(s, str) for s in secrets):
        raise UsageError("secret_env", "must be a list of variable names")
    out["secret_env"] = list(secrets)
    out["sbatch"] = _sbatch(doc)
    return out


def _sbatch(doc: Dict[str, Any]) -> Dict[str, Any]:
    """[sbatch]: only with slurm, and then with a walltime (the warning is planned against
    it); each value of its type (their content is checked as deploy's Slurm flags are)."""
    table = doc.get("sbatch")
    if doc.get("slurm") is None:
        if table is not None:
            raise UsageError("sbatch", "is for a Slurm job array", 'add slurm = "LOGIN_NODE"')
        return {}
    if not isinstance(table, dict) or "time" not in table:
        raise UsageError(
            "sbatch.time",
            "a Slurm sweep needs its walltime: rgt plans the warning before it",
            'add [sbatch] time = "2:00:00" (sbatch --time format)',
        )
    for key, value in table.items():
        want = SBATCH_KEYS.get(key)
        if want is None:
            raise UsageError(f"sbatch.{key}", "is not a known key", ", ".join(SBATCH_KEYS))
        if key == "seal_time" and isinstance(value, (int, float)) and not isinstance(value, bool):
            continue  # seconds
        if not isinstance(value, want) or isinstance(value, bool):
            raise UsageError(f"sbatch.{key}", f"must be a {want.__name__}")
        if isinstance(value, list) and not all(isinstance(v, str) for v in value):
            raise UsageError("sbatch.extra", 'must be a list of "--option=value" strings')
    return {k: (str(v) if k == "seal_time" else v) for k, v in table.items()}


def expand(
    sweep: str,
    grid: Dict[str, List[Any]],
    command: Sequence[str],
    outputs: Sequence[str],
    costs: Optional[Dict[str, Dict[str, float]]] = None,
) -> List[Cell]:
    """The cells of ``grid`` (its cartesian product, in the grid's order), each with its name,
    command, outputs, environment and cost; UsageError for duplicate cells or names."""
    costs = costs or {}
    total = math.prod(len(v) for v in grid.values())
    if total > MAX_CELLS:
        raise UsageError("grid", f"{total} cells: more than {MAX_CELLS}", "split the sweep")
    cells: List[Cell] = []
    seen: Dict[str, Dict[str, Any]] = {}
    for i, combo in enumerate(itertools.product(*grid.values())):
        params = dict(zip(grid, combo))
        key = canonical(params)
        if key in seen:
            raise UsageError("grid", f"duplicate cell {key}: a value is listed twice",
                             "list each value of a key once")  # fmt: skip
        seen[key] = params
        name = cell_name(sweep, params)
        outs = [_expand(o, {"cell": name}) for o in outputs]
        values = {k: text(v) for k, v in params.items()}
        values.update(cell=name, out=outs[0] if outs else "")
        env = {"RGT_CELL": name, "RGT_SWEEP": sweep}
        if outs:
            env["RGT_CELL_OUT"] = outs[0]
        cost = math.prod(costs.get(k, {}).get(text(v), 1.0) for k, v in params.items())
        argv = [_expand(a, values) for a in command]
        cells.append(Cell(i, check_name(name), params, argv, env, outs, cost))
    check_injective(cells)
    return cells


def check_injective(cells: Sequence[Cell]) -> None:
    """Refuse two cells whose names, or output paths, are one on a case-insensitive file
    system (names casefolded): interleaved output cannot be untangled afterwards."""
    names: Dict[str, Cell] = {}
    paths: Dict[str, Cell] = {}
    for c in cells:
        other = names.setdefault(c.name.casefold(), c)
        if other is not c:
            raise UsageError("grid", f"cells {other.params} and {c.params} get one name {c.name}")
        for o in c.outputs:
            other = paths.setdefault(o.casefold(), c)
            if other is not c:
                raise UsageError("outputs", f"cells {other.name} and {c.name} share output {o}")


def load_plan(path: str) -> Plan:
    """Parse and check PLAN.toml (UsageError naming the field on bad input)."""
    path = os.path.abspath(path)
    doc = _read_toml(path)
    unknown = sorted(set(doc) - _KEYS)
    if unknown:
        raise UsageError(unknown[0], "is not a PLAN.toml key", f"known: {', '.join(sorted(_KEYS))}")
    base = os.path.dirname(path)
    name = _check_name(doc)
    grid = _check_grid(doc)
    outputs = _check_outputs(doc)
    command = _check_command(doc, grid, bool(outputs))
    costs = _check_costs(doc, grid)
    targets, slurm = _where(doc)
    store = _check_store(doc)
    project = doc.get("project", ".")
    if not isinstance(project, str) or not os.path.isdir(os.path.join(base, project)):
        raise UsageError("project", f"{project!r} is not a directory (relative to the plan)")
    project = os.path.abspath(os.path.join(base, project))
    job = _check_job(doc, base, project)
    table = _read_toml(job).get("store") if job else None
    endpoint = table.get("endpoint_url") if isinstance(table, dict) else None
    endpoint = store_override(store, endpoint, "job's store.endpoint_url").endpoint_url
    given = isinstance(table, dict) and table.get("stall") is not None
    stall = restore_stall(table, "job's store") if given else None
    cells = expand(name, grid, command, outputs, costs)
    plan = Plan(path, name, cells, targets, slurm, store, job, project, outputs, **_options(doc))
    return dataclasses.replace(plan, store_endpoint=endpoint, store_stall=stall)


def assign(cells: Sequence[Cell], targets: Sequence[str]) -> Dict[str, List[Cell]]:
    """Each target's queue: by cost, not count (the costliest cell first to the least loaded
    box, ties to the earlier target), so that the queues finish together; each queue in roster
    order."""
    load = {t: 0.0 for t in targets}
    queues: Dict[str, List[Cell]] = {t: [] for t in targets}
    for c in sorted(cells, key=lambda c: (-c.cost, c.index)):
        box = min(targets, key=lambda t: (load[t], targets.index(t)))
        load[box] += c.cost
        queues[box].append(c)
    for q in queues.values():
        q.sort(key=lambda c: c.index)
    return queues
