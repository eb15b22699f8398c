"""The sbatch script of controller/slurm/batch.py: what sbatch and bash read in it, the checks
made before anything is submitted (values, the lead against --time, Lightning's signal), and who
requeues. A real Slurm runs it in tests/integration/test_slurm_requeue.py."""

from __future__ import annotations

import re
import shutil
import subprocess
from typing import Any, Dict, List

import pytest

from controller.slurm.batch import batch_script, check_lead, requeue_side, time_seconds
from onbox.agent.slurm import check_trigger
from onbox.common.errors import UsageError

HOSTILE = ["python", "train.py", "--tag", "a b'c\"d$(touch /tmp/pwned)`id`;|&\n#x", "*", "~"]
BASE: Dict[str, Any] = dict(
    name="run-1",
    agent_argv=["/opt/rgt agent/bin/rgt-agent"],
    release_dir="/home/u/.rgt/releases/abc",
    output_dir="/home/u/.rgt/runs/run-1",
    time_limit="1:00:00",
    lead=300,
)


def _script(**kw: Any) -> str:
    return batch_script(**{**BASE, **kw})


def _sbatch_lines(text: str) -> List[str]:
    return [line[len("#SBATCH ") :] for line in text.splitlines() if line.startswith("#SBATCH ")]


def _words(tmp_path: Any, line: str) -> List[str]:
    """The words real bash makes of ``line`` (an exec line without its ``exec``)."""
    assert line.lstrip().startswith("exec ")
    probe = tmp_path / "words.sh"
    probe.write_text("set -- " + line.lstrip()[len("exec ") :] + '\nprintf "%s\\0" "$@"\n')
    out = subprocess.run(["bash", str(probe)], capture_output=True, timeout=30, check=True)
    return out.stdout.decode().split("\0")[:-1]


def _bash_n(tmp_path: Any, text: str) -> None:
    path = tmp_path / "job.sh"
    path.write_text(text)
    r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_one_run_execs_the_agent_as_the_batch_shell_with_every_word_intact(tmp_path: Any) -> None:
    text = _script(
        command=HOSTILE,
        store="s3://bucket/pre fix",
        env={"RGT_HOME": "/home/u/.rgt", "WEIRD": "x'y\nz $HOME"},
        agent_args=["--grace", "45"],
        partition="gpu",
        gpus="a100:2",
        cpus_per_task=8,
        mem="64G",
        extra=["--account=proj-1", "--exclusive"],
    )
    _bash_n(tmp_path, text)
    assert text.startswith("#!/bin/bash\n")
    assert _sbatch_lines(text) == [
        "--job-name=run-1",
        "--time=1:00:00",
        "--signal=B:USR2@300",
        "--requeue",
        "--open-mode=append",
        "--output=/home/u/.rgt/runs/run-1/slurm-%j.out",
        "--partition=gpu",
        "--gpus=a100:2",
        "--cpus-per-task=8",
        "--mem=64G",
        "--account=proj-1",
        "--exclusive",
    ]
    lines = text.splitlines()
    # The exec is the script's last command (an argument may hold a newline: quoted, it spans
    # lines): nothing comes after it, the agent IS the batch job.
    tail = text[text.index("\nexec ") + 1 :]
    assert text.count("\nexec ") == 1
    assert _words(tmp_path, tail) == [
        "/opt/rgt agent/bin/rgt-agent",
        "run",
        "--name",
        "run-1",
        "--profile",
        "slurm",
        "--store",
        "s3://bucket/pre fix",
        "--grace",
        "45",
        "--",
        *HOSTILE,
    ]
    # the agent's env and its lead, exported before the exec, as bash reads them
    probe = tmp_path / "env.sh"
    exports = text[text.index("\nexport ") + 1 : text.index("\ncd -- ")]
    probe.write_text(exports + '\nprintf "%s\\0" "$WEIRD" "$RGT_SLURM_LEAD"\n')
    out = subprocess.run(["bash", str(probe)], capture_output=True, timeout=30, check=True)
    assert out.stdout.decode().split("\0")[:2] == ["x'y\nz $HOME", "300"]
    assert "trap '' USR2" in lines  # a warning before the agent's handler must not end it
    assert text.index("trap '' USR2\n") < text.index("\nexec ")
    assert "cd -- /home/u/.rgt/releases/abc || exit 1" in lines


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_a_job_array_has_one_exec_per_cell_and_its_own_output_per_task(tmp_path: Any) -> None:
    cells = [
        (0, "sw-a-1", ["python", "t.py", "--lr", "0.1"], {"RGT_CELL": "sw-a-1"}, []),
        (1, "sw-b-2", ["python", "t.py", "--lr", "it's"], {"RGT_CELL": "sw-b-2"}, []),
        (3, "sw-c-3", ["python", "t.py"], {}, ["out/sw-c-3", "logs/sw c 3"]),
    ]
    text = _script(name="sw", cells=cells, array_limit=2, job_file="job.toml")
    _bash_n(tmp_path, text)
    sb = _sbatch_lines(text)
    assert "--array=0,1,3%2" in sb and "--output=/home/u/.rgt/runs/run-1/slurm-%A_%a.out" in sb
    assert 'case "$SLURM_ARRAY_TASK_ID" in' in text
    execs = [line for line in text.splitlines() if line.lstrip().startswith("exec ")]
    assert [_words(tmp_path, e)[3] for e in execs] == ["sw-a-1", "sw-b-2", "sw-c-3"]
    assert _words(tmp_path, execs[1])[-6:] == ["job.toml", "--", "python", "t.py", "--lr", "it's"]
    # Each cell's outputs are its own, passed to its own agent (never another cell's).
    words = _words(tmp_path, execs[2])
    assert words[words.index("run") :][:2] == ["run", "--name"]
    outs = [words[i + 1] for i, w in enumerate(words) if w == "--output"]
    assert outs == ["out/sw-c-3", "logs/sw c 3"]
    assert "--output" not in _words(tmp_path, execs[0])
    branch = re.findall(r"^  (\d+)\)$", text, re.M)
    assert branch == ["0", "1", "3"]
    with pytest.raises(UsageError, match="same array index"):
        _script(name="sw", cells=[cells[0], (0, "sw-x", ["x"], {}, [])])
    with pytest.raises(UsageError, match="own argv"):
        _script(name="sw", cells=cells, command=["python"])


@pytest.mark.parametrize(
    "field,kw",
    [
        ("--partition", {"partition": "gpu #x"}),
        ("--partition", {"partition": 'a"b'}),
        ("--mem", {"mem": "64G\n#SBATCH --wrap=id"}),
        ("--gpus", {"gpus": "a100\\2"}),
        ("--time", {"time_limit": "1:00:00 --wrap=id"}),
        ("output dir", {"output_dir": "/home/u/my runs"}),
        ("output dir", {"output_dir": "/home/u/%j"}),
        ("output dir", {"output_dir": "relative/dir"}),
        ("release dir", {"release_dir": "/home/u/rel\nid"}),
        ("--sbatch", {"extra": ["--account=a b"]}),
        ("--sbatch", {"extra": ["--signal=B:USR1@90"]}),
        ("--sbatch", {"extra": ["--no-requeue"]}),
        ("--sbatch", {"extra": ["-A proj"]}),
        ("env", {"env": {"BAD-NAME": "x"}}),
        ("--name", {"name": "Run 1"}),
        ("--cpus-per-task", {"cpus_per_task": 0}),
    ],
)
def test_values_an_sbatch_line_cannot_hold_are_refused_naming_the_field(
    field: str, kw: Dict[str, Any]
) -> None:
    with pytest.raises(UsageError) as e:
        _script(command=["python", "t.py"], **kw)
    assert e.value.field == field


@pytest.mark.parametrize(
    "value,seconds",
    [
        ("1", 60),
        ("30", 1800),
        ("5:30", 330),
        ("1:00:00", 3600),
        ("2-0", 172800),
        ("1-2:30", 95400),
        ("1-00:00:01", 86401),
    ],
)
def test_slurm_time_formats(value: str, seconds: int) -> None:
    assert time_seconds(value) == seconds


@pytest.mark.parametrize("value", ["", "0", "UNLIMITED", "infinite", "1h", "-1", "1:2:3:4"])
def test_a_time_limit_rgt_cannot_warn_before_is_refused(value: str) -> None:
    with pytest.raises(UsageError) as e:
        time_seconds(value)
    assert e.value.field == "--time"


def test_a_lead_as_long_as_the_time_limit_is_refused_naming_time() -> None:
    assert check_lead(59, "1") == 59
    for lead, limit in ((60, "1"), (3600, "1:00:00"), (4000, "60")):
        with pytest.raises(UsageError) as e:
            check_lead(lead, limit)
        assert e.value.field == "--time" and str(lead) in e.value.what
    for bad in (0, -5, 70000, 2.5):
        with pytest.raises(UsageError):
            check_lead(bad, "2-0")  # type: ignore[arg-type]
    with pytest.raises(UsageError) as e:
        _script(command=["python"], time_limit="5", lead=300)
    assert e.value.field == "--time"


def test_lightnings_requeue_signal_is_refused_as_the_jobs_trigger() -> None:
    with pytest.raises(UsageError) as e:
        check_trigger("signal:USR1")
    assert "Lightning" in e.value.what and "NCCL" in e.value.what
    for ok in ("signal:USR2", "file", "none"):
        check_trigger(ok)


def test_requeue_side_names_rgt_and_says_why_lightning_stays_idle(tmp_path: Any) -> None:
    (tmp_path / "plain.py").write_text("import torch\nprint('lightning is a word')\n")
    (tmp_path / "pl.py").write_text("import os\nfrom lightning.pytorch import Trainer\n")
    (tmp_path / "old.py").write_text("import pytorch_lightning as pl\n")
    plain = requeue_side(["python", "plain.py"], str(tmp_path))
    assert plain.startswith("rgt requeues") and "Lightning" not in plain
    for script in ("pl.py", "old.py"):
        said = requeue_side(["python", "-u", script], str(tmp_path))
        assert said.startswith("rgt requeues") and script in said
        assert "SIGUSR1" in said and "never triggers" in said
    assert "Lightning" in requeue_side(["lightning", "run", "model"], str(tmp_path))
    assert "Lightning" not in requeue_side(["python", "missing.py"], str(tmp_path))
