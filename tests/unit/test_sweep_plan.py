"""PLAN.toml (controller/sweep/plan.py): cells' names (case and punctuation collisions, the
mapping injective, every name a valid run name), each cell's own outputs and environment, the
checks that refuse a plan before anything is deployed, and the assignment by cost."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, List

import pytest

from controller.sweep.plan import (
    Cell,
    assign,
    canonical,
    cell_name,
    check_injective,
    check_store_here,
    expand,
    load_plan,
)
from controller.sweep.run import sweep
from onbox.common.errors import UsageError
from onbox.common.rundir import is_name

BASE = """\
name = "lr-sweep"
command = ["python", "train.py", "--lr", "{lr}", "--seed", "{seed}", "--out", "{out}"]
targets = ["gpu1", "root@10.0.0.2:22"]
outputs = ["out"]
[grid]
lr = [1e-3, 3e-4]
seed = [0, 1, 2]
"""


def _plan(tmp_path: Path, text: str) -> str:
    (tmp_path / "store").mkdir(exist_ok=True)
    path = tmp_path / "PLAN.toml"
    path.write_text(f'store = "file://{tmp_path}/store"\n' + text)
    return str(path)


def _refused(tmp_path: Path, text: str) -> UsageError:
    with pytest.raises(UsageError) as e:
        load_plan(_plan(tmp_path, text))
    return e.value


def test_a_plan_expands_into_its_cells_each_with_its_own_paths(tmp_path: Path) -> None:
    plan = load_plan(_plan(tmp_path, BASE))
    assert [c.params for c in plan.cells] == [
        {"lr": lr, "seed": s} for lr in (1e-3, 3e-4) for s in (0, 1, 2)
    ]
    assert [c.index for c in plan.cells] == list(range(6))
    names = [c.name for c in plan.cells]
    assert len(set(names)) == 6 and all(n.startswith("lr-sweep-") and is_name(n) for n in names)
    first = plan.cells[0]
    out = f"out/{first.name}"
    assert first.command == ["python", "train.py", "--lr", "0.001", "--seed", "0", "--out", out]
    assert first.outputs == [out]
    assert first.env == {"RGT_CELL": first.name, "RGT_SWEEP": "lr-sweep", "RGT_CELL_OUT": out}
    assert len({c.outputs[0] for c in plan.cells}) == 6
    assert plan.targets == ["gpu1", "root@10.0.0.2:22"] and plan.slurm is None
    assert plan.project == str(tmp_path)


@pytest.mark.parametrize(
    "a, b",
    [("a.b", "a-b"), ("A", "a"), ("x y", "x-y"), ("Ü", "u"), ("a_b", "a-b"), ("", "-")],
)
def test_params_that_differ_only_in_case_or_punctuation_get_distinct_names(a: str, b: str) -> None:
    na, nb = cell_name("s", {"k": a}), cell_name("s", {"k": b})
    assert na != nb
    assert na.casefold() != nb.casefold()  # distinct on a case-insensitive file system too
    assert is_name(na) and is_name(nb)
    cells = expand("s", {"k": [a, b]}, ["run", "{k}", "{out}"], ["out/{cell}"])
    paths = [c.outputs[0].casefold() for c in cells]
    assert len(set(paths)) == 2


def test_types_are_part_of_a_cells_identity() -> None:
    names = {cell_name("s", {"k": v}) for v in (1, 1.0, "1", True)}
    assert len(names) == 4
    assert canonical({"b": 1, "a": 2}) == canonical({"a": 2, "b": 1})


def test_long_params_keep_names_within_the_run_name_limit() -> None:
    name = cell_name("a" * 32, {"k" * 40: "v" * 200, "other": "x" * 80})
    assert is_name(name) and len(name) + len("-r999") <= 63


def test_the_mapping_is_checked_injective() -> None:
    def cell(i: int, name: str, out: str) -> Cell:
        return Cell(i, name, {"i": i}, ["x"], {}, [out])

    with pytest.raises(UsageError) as e:
        check_injective([cell(0, "s-a-1", "out/A"), cell(1, "s-a-1", "out/b")])
    assert e.value.field == "grid"
    with pytest.raises(UsageError) as e:
        check_injective([cell(0, "s-a-1", "out/A"), cell(1, "s-b-2", "out/a")])
    assert e.value.field == "outputs"  # one path on a case-insensitive file system


@pytest.mark.parametrize(
    "change, field",
    [
        ("colour = 1\n", "colour"),
        ("[grid]\n", "grid"),  # replaced below by an empty grid
        ("DUP", "grid"),
        ("NOKEY", "command"),
        ("BOTH", "targets"),
        ("NEITHER", "targets"),
        ("TWICE", "targets"),
        ("BADNAME", "name"),
        ("UNUSED", "grid.seed"),
        ("SHARED", "command"),
        ("RESERVED", "grid.cell"),
        ("NOSTORE", "store"),
        ("BADCOST", "cost.lr"),
        ("ABSOUT", "outputs"),
    ],
)
def test_bad_plans_are_refused_naming_the_field(tmp_path: Path, change: str, field: str) -> None:
    text = BASE
    if change == "[grid]\n":
        text = text.split("[grid]")[0] + "[grid]\n"
    elif change == "DUP":
        text = text.replace("lr = [1e-3, 3e-4]", "lr = [1e-3, 0.001]")
    elif change == "NOKEY":
        text = text.replace('"{seed}"', '"{sede}"')
    elif change == "BOTH":
        text = 'slurm = "login"\n' + text
    elif change == "NEITHER":
        text = text.replace('targets = ["gpu1", "root@10.0.0.2:22"]\n', "")
    elif change == "TWICE":
        text = text.replace('"root@10.0.0.2:22"', '"gpu1"')
    elif change == "BADNAME":
        text = text.replace('name = "lr-sweep"', 'name = "LR_Sweep"')
    elif change == "UNUSED":
        text = text.replace(', "--seed", "{seed}"', "")
    elif change == "SHARED":
        text = text.replace(', "--out", "{out}"', "")
    elif change == "RESERVED":
        text = text + "cell = [1, 2]\n"
    elif change == "NOSTORE":
        path = tmp_path / "PLAN.toml"
        path.write_text(BASE)
        with pytest.raises(UsageError) as e:
            load_plan(str(path))
        assert e.value.field == field
        return
    elif change == "BADCOST":
        text = text + '[cost]\nlr = { "0.5" = 2 }\n'
    elif change == "ABSOUT":
        text = text.replace('outputs = ["out"]', 'outputs = ["/abs/out"]')
    else:
        text = change + text
    assert _refused(tmp_path, text).field == field


def test_a_job_file_with_shared_outputs_or_checkpoint_dir_is_refused(tmp_path: Path) -> None:
    (tmp_path / "job.toml").write_text('outputs = ["out"]\n')
    assert _refused(tmp_path, 'job = "job.toml"\n' + BASE).field == "job"
    (tmp_path / "job.toml").write_text('[checkpoint]\ndir = "/data/ckpt"\n')
    assert _refused(tmp_path, 'job = "job.toml"\n' + BASE).field == "job"
    (tmp_path / "job.toml").write_text('[env]\nFOO = "1"\n')
    plan = load_plan(_plan(tmp_path, 'job = "job.toml"\n' + BASE))
    assert plan.job_file == os.path.join(str(tmp_path), "job.toml")


def test_a_file_store_this_laptop_cannot_read_is_refused_before_a_sweep(tmp_path: Path) -> None:
    path = tmp_path / "PLAN.toml"
    path.write_text('store = "file:///nonexistent/rgt-store"\n' + BASE)
    plan = load_plan(str(path))  # fine for rgt emit, which reads no store
    with pytest.raises(UsageError) as e:
        check_store_here(plan)
    assert e.value.field == "store"
    with pytest.raises(UsageError) as e:
        sweep(plan, home=str(tmp_path / "ctl"))
    assert e.value.field == "store"
    assert not (tmp_path / "ctl").exists()  # refused before any record was made


def _cells(costs: List[float]) -> List[Cell]:
    return [Cell(i, f"s-{i}", {"i": i}, ["x"], {}, [], c) for i, c in enumerate(costs)]


def test_assignment_splits_by_cost_not_count() -> None:
    # One long cell and four short ones: by count it would be 3 + 2; by cost the long cell
    # gets a box of its own and the queues finish together.
    queues = assign(_cells([8, 2, 2, 2, 2]), ["a", "b"])
    load: Dict[str, float] = {t: sum(c.cost for c in q) for t, q in queues.items()}
    assert load == {"a": 8.0, "b": 8.0}
    assert [c.index for c in queues["a"]] == [0]
    assert [c.index for c in queues["b"]] == [1, 2, 3, 4]  # each queue in roster order


def test_equal_costs_split_evenly_and_every_cell_is_assigned_once() -> None:
    queues = assign(_cells([1] * 7), ["a", "b", "c"])
    got = sorted(c.index for q in queues.values() for c in q)
    assert got == list(range(7))
    assert sorted(len(q) for q in queues.values()) == [2, 2, 3]


def test_cost_factors_multiply_per_value(tmp_path: Path) -> None:
    text = BASE + '[cost]\nlr = { "0.001" = 3 }\nseed = { "2" = 2 }\n'
    plan = load_plan(_plan(tmp_path, text))
    cost: Dict[Any, float] = {(c.params["lr"], c.params["seed"]): c.cost for c in plan.cells}
    assert cost[(1e-3, 2)] == 6.0 and cost[(1e-3, 0)] == 3.0 and cost[(3e-4, 0)] == 1.0
    queues = assign(plan.cells, plan.targets)
    loads = sorted(sum(c.cost for c in q) for q in queues.values())
    assert loads == [8.0, 8.0]  # 3+3+6+1+1+2 = 16: 6+1+1 and 3+3+2


SLURM = BASE.replace('targets = ["gpu1", "root@10.0.0.2:22"]', 'slurm = "login1"')


def test_a_slurm_sweep_needs_its_walltime_and_its_sbatch_table_is_checked(
    tmp_path: Path,
) -> None:
    """With slurm =, [sbatch] time is required (rgt plans the warning against it); each key
    is known and typed; [sbatch] without slurm is refused; the ask is what deploy checks."""
    from controller.slurm.array import plan_ask

    assert _refused(tmp_path, SLURM).field == "sbatch.time"
    good = SLURM + '[sbatch]\ntime = "10"\npartition = "gpu"\ncpus = 2\nextra = ["--qos=low"]\n'
    plan = load_plan(_plan(tmp_path, good))
    assert plan.sbatch["time"] == "10" and plan.slurm == "login1"
    ask = plan_ask(plan)
    assert ask.walltime == 600 and ask.partition == "gpu" and ask.sbatch == ("--qos=low",)
    assert all(c.outputs == [f"out/{c.name}"] for c in plan.cells)  # each task its own path
    assert _refused(tmp_path, SLURM + '[sbatch]\ntime = "10"\nqos = "x"\n').field == "sbatch.qos"
    assert _refused(tmp_path, SLURM + "[sbatch]\ntime = 10\n").field == "sbatch.time"
    assert _refused(tmp_path, BASE + '[sbatch]\ntime = "10"\n').field == "sbatch"
    bad = load_plan(_plan(tmp_path, SLURM + '[sbatch]\ntime = "10"\nextra = ["--output=/x"]\n'))
    with pytest.raises(UsageError, match="--sbatch"):
        plan_ask(bad)  # what rgt sets itself is refused, as deploy's --sbatch is


def test_an_s3_sweep_reads_its_store_at_the_endpoint_its_job_file_gives_the_cells(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each cell's box keeps the base job file's endpoint_url for the sweep's s3:// store
    (``--store`` replaces only the URL): the sweep and its record read the store there too."""
    from controller.sweep import record

    monkeypatch.setenv("RGT_CONTROLLER_HOME", str(tmp_path / "ctl"))
    ep = "http://127.0.0.1:9000"
    job = f'[store]\nurl = "s3://elsewhere/x"\nendpoint_url = "{ep}"\n'
    (tmp_path / "job.toml").write_text(job)
    path = tmp_path / "PLAN.toml"
    path.write_text('store = "s3://sweeps/rgt"\njob = "job.toml"\n' + BASE)
    plan = load_plan(str(path))
    assert plan.store_endpoint == ep
    doc = record.begin(plan)
    assert doc["store"] == "s3://sweeps/rgt" and doc["store_endpoint_url"] == ep
    (tmp_path / "job.toml").write_text('[store]\nurl = "s3://elsewhere/x"\n')
    with pytest.raises(UsageError) as e:  # another endpoint: another store, as another URL is
        record.begin(load_plan(str(path)))
    assert f"s3://sweeps/rgt at {ep} -> s3://sweeps/rgt" in e.value.what
