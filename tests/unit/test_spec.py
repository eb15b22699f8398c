"""Job settings: a job file and flags merge into one checked JobSpec, and every bad value is
refused with the name of its field before anything starts."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest

from onbox.agent.spec import (
    JobSpec,
    Overrides,
    RestartPolicy,
    build_spec,
    default_name,
    parse_signal,
)
from onbox.common.duration import parse_duration
from onbox.common.errors import UsageError
from onbox.common.logscan import step_group
from onbox.common.progress import compile_progress_pattern
from onbox.common.rundir import check_name
from onbox.common.storeurl import RESTORE_STALL


def _build(tmp_path: Any, toml: str = "", **flags: Any) -> Any:
    job = None
    if toml:
        job = str(tmp_path / "job.toml")
        with open(job, "w") as f:
            f.write(toml)
    return build_spec(
        job,
        Overrides(**flags),
        cwd=str(tmp_path),
        environ=os.environ,
        default_name="job",
        run_dir_of=lambda n: f"/home/x/.rgt/runs/{n}",
    )


@pytest.mark.parametrize(
    "name",
    [
        "",
        "a/b",
        "..",
        "a..b",
        "-rf",
        "A",
        "x y",
        "a;rm",
        "$(reboot)",
        "a`b`",
        "x" * 64,
        "a\nb",
        "   ",
    ],
)
def test_bad_names_are_refused_with_the_pattern(name: str) -> None:
    with pytest.raises(UsageError) as e:
        check_name(name, "--name")
    assert e.value.field == "--name"
    assert "[a-z0-9]" in e.value.line()


@pytest.mark.parametrize(
    "value,seconds",
    [
        (30, 30.0),
        ("30", 30.0),
        ("30s", 30.0),
        ("5m", 300.0),
        ("1.5h", 5400.0),
        ("250ms", 0.25),
        (" 2d ", 172800.0),
    ],
)
def test_durations(value: Any, seconds: float) -> None:
    assert parse_duration(value, "grace") == seconds


@pytest.mark.parametrize(
    "value",
    [-5, "-5", "abc", "5 parsecs", "nan", "inf", float("nan"), float("inf"), "1e12", True, "", 0],
)
def test_bad_durations_name_the_field(value: Any) -> None:
    with pytest.raises(UsageError) as e:
        parse_duration(value, "--grace")
    assert e.value.field == "--grace"


def test_zero_is_allowed_where_asked() -> None:
    assert parse_duration("0", "--grace", allow_zero=True) == 0.0


def test_signals() -> None:
    assert parse_signal("TERM", "s") == signal.SIGTERM
    assert parse_signal("SIGUSR2", "s") == signal.SIGUSR2
    assert parse_signal(2, "s") == signal.SIGINT
    with pytest.raises(UsageError):
        parse_signal("SIGNOPE", "stop_signal")


def test_job_file_and_flags_merge_and_flags_win(tmp_path: Any) -> None:
    spec = _build(
        tmp_path,
        """
name = "from-file"
command = ["python3", "-c", "pass"]
grace = "2m"
[env]
FOO = "1"
[checkpoint]
dir = "ck"
trigger = "signal:USR2"
[restart]
max_error_restarts = 2
start_grace = "10s"
""",
        name="from-flag",
        grace="45",
    )
    assert spec.name == "from-flag" and spec.grace == 45.0
    assert spec.command == ("python3", "-c", "pass")
    assert spec.env == {"FOO": "1"}
    assert spec.ckpt_dir == str(tmp_path / "ck")
    assert spec.trigger == "signal:USR2"
    assert spec.restart.max_error_restarts == 2 and spec.restart.start_grace == 10.0
    assert spec.restart.max_preempt_restarts == RestartPolicy().max_preempt_restarts


def test_defaults_and_round_trip(tmp_path: Any) -> None:
    spec = _build(tmp_path, command=["python3", "x.py"])
    assert spec.ckpt_dir == "/home/x/.rgt/runs/job/ckpt"
    assert spec.workdir == str(tmp_path)
    assert type(spec).from_json(spec.to_json()) == spec


@pytest.mark.parametrize(
    "toml,field",
    [
        ("command = []", "command"),
        ('command = "python train.py"', "command"),
        ('command = ["no-such-program-rgt"]', "command"),
        ('command = ["python3"]\nbogus = 1', "bogus"),
        ('command = ["python3"]\ngrace = -1', "grace"),
        ('command = ["python3"]\n[restart]\nstart_grace = "soon"', "restart.start_grace"),
        ('command = ["python3"]\n[restart]\nmax_error_restarts = -1', "restart.max_error_restarts"),
        ('command = ["python3"]\n[restart]\nretries = 3', "restart.retries"),
        ('command = ["python3"]\n[checkpoint]\ntrigger = "signal:KILL"', "checkpoint.trigger"),
        ('command = ["python3"]\nstore = "bucket"', "store"),
        ('command = ["python3"]\n[env]\nN = 1', "env"),
        ('command = ["python3"\n', "JOB.toml"),
    ],
)
def test_bad_job_files_name_the_field(tmp_path: Any, toml: str, field: str) -> None:
    with pytest.raises(UsageError) as e:
        _build(tmp_path, toml)
    assert e.value.field == field, e.value.line()


def test_default_name_from_the_command() -> None:
    assert default_name(["python", "-u", "scripts/Train_GPT.py", "--lr", "3"]) == "train_gpt"
    assert default_name(["torchrun", "--nproc", "8", "train.py"]) == "train"
    assert default_name(["./run"]) == "run"
    assert default_name([]) == "job"


@pytest.mark.parametrize(
    "pattern,line,step",
    [
        (r"step (\d+)", "step 12 loss 0.5", 12),
        (r"(?:epoch \d+ )?it=(?P<step>\d+)", "epoch 2 it=40", 40),
        (r"(?P<epoch>\d+)/(?P<step>\d+)", "3/900", 900),
    ],
)
def test_a_progress_pattern_is_kept_and_names_its_step(
    tmp_path: Any, pattern: str, line: str, step: int
) -> None:
    spec = _build(tmp_path, f"command = ['python3']\n[progress]\npattern = '{pattern}'\n")
    assert spec.progress_pattern == pattern
    rx = compile_progress_pattern(spec.progress_pattern)
    m = rx.search(line)
    assert m is not None and int(m.group(step_group(rx))) == step
    assert type(spec).from_json(spec.to_json()) == spec
    assert _build(tmp_path, command=["python3"]).progress_pattern is None


@pytest.mark.parametrize(
    "toml,field,says",
    [
        ("[progress]\npattern = 'step (\\d+'", "progress.pattern", "not a valid regular"),
        ("[progress]\npattern = 'step \\d+'", "progress.pattern", "has no group"),
        ("[progress]\npattern = '(\\d+)/(\\d+)'", "progress.pattern", "2 groups, none named step"),
        ("[progress]\npattern = 5", "progress.pattern", "not a regular expression"),
        ("[progress]\npattern = ''", "progress.pattern", "not a regular expression"),
        ("[progress]\nregex = 'step (\\d+)'", "progress.regex", "unknown setting"),
        ("progress = 'step (\\d+)'", "progress", "must be a table"),
    ],
)
def test_bad_progress_patterns_name_the_field(
    tmp_path: Any, toml: str, field: str, says: str
) -> None:
    with pytest.raises(UsageError) as e:
        _build(tmp_path, 'command = ["python3"]\n' + toml)
    assert e.value.field == field, e.value.line()
    assert says in e.value.line()


def test_a_spec_json_written_before_progress_patterns_still_loads(tmp_path: Any) -> None:
    doc = _build(tmp_path, command=["python3", "x.py"]).to_json()
    del doc["progress_pattern"]
    assert JobSpec.from_json(doc).progress_pattern is None


def test_output_flags_add_to_the_job_files_outputs_once_each(tmp_path: Any) -> None:
    spec = _build(
        tmp_path,
        'command = ["true"]\noutputs = ["out/", "metrics.json"]\n',
        outputs=["result.txt", "out/", "result.txt"],
    )
    assert spec.outputs == ("out/", "metrics.json", "result.txt")
    assert _build(tmp_path, outputs=["a.txt"], command=["true"]).outputs == ("a.txt",)
    assert JobSpec.from_json(spec.to_json()).outputs == spec.outputs


@pytest.mark.parametrize("bad", ["/abs/x", "../up", "a/../../b", ""])
def test_an_output_flag_outside_the_workdir_is_refused_naming_the_flag(
    tmp_path: Any, bad: str
) -> None:
    with pytest.raises(UsageError) as e:
        _build(tmp_path, 'command = ["true"]\n', outputs=[bad])
    assert e.value.line().startswith("rgt: --output: must be a path relative to the workdir")
    with pytest.raises(UsageError) as e:
        _build(tmp_path, f'command = ["true"]\noutputs = [{bad!r}]\n')
    assert "outputs: must be a list of paths relative to the workdir" in e.value.line()


def test_the_store_is_parsed_once_and_spec_json_keeps_its_url(tmp_path: Any) -> None:
    spec = _build(tmp_path, 'command = ["true"]\nstore = "s3://bucket/runs"\n')
    assert spec.store.scheme == "s3" and spec.store.bucket == "bucket"
    assert spec.store.prefix == "runs" and spec.store.endpoint_url is None
    doc = spec.to_json()
    assert doc["store"] == "s3://bucket/runs" and "store_endpoint_url" not in doc
    assert JobSpec.from_json(doc) == spec
    assert _build(tmp_path, command=["true"]).to_json()["store"] is None


def test_a_job_files_store_table_carries_its_endpoint_url(tmp_path: Any) -> None:
    toml = (
        'command = ["true"]\n[store]\nurl = "s3://bucket/runs"\n'
        'endpoint_url = "https://s3.example.com:9000"\n'
    )
    spec = _build(tmp_path, toml)
    assert spec.store.url == "s3://bucket/runs"
    assert spec.store.endpoint_url == "https://s3.example.com:9000"
    doc = spec.to_json()
    assert doc["store"] == "s3://bucket/runs"  # the same string on disk as before
    assert JobSpec.from_json(doc) == spec
    # --store names another bucket; the endpoint is where buckets live, so it stays
    moved = _build(tmp_path, toml, store="s3://other/p")
    assert moved.store.bucket == "other"
    assert moved.store.endpoint_url == "https://s3.example.com:9000"
    assert _build(tmp_path, toml, store="file:///mnt/d").store.endpoint_url is None


def test_a_job_files_store_table_carries_the_restores_stall_bound(tmp_path: Any) -> None:
    """``[store] stall``: how long a restore's download may move nothing (onbox/sealing/stall.py);
    kept in spec.json (a later start of the run restores with it), kept under ``--store``, and
    RESTORE_STALL where the job file does not say (a plain URL, or an old spec.json)."""
    toml = 'command = ["true"]\n[store]\nurl = "file:///mnt/d"\nstall = "90s"\n'
    spec = _build(tmp_path, toml)
    assert spec.restore_stall == 90.0
    doc = spec.to_json()
    assert JobSpec.from_json(doc) == spec
    assert _build(tmp_path, toml, store="s3://other/p").restore_stall == 90.0
    plain = _build(tmp_path, 'command = ["true"]\nstore = "file:///mnt/d"\n')
    assert plain.restore_stall == RESTORE_STALL == 300.0
    del doc["restore_stall"]
    assert JobSpec.from_json(doc).restore_stall == RESTORE_STALL


@pytest.mark.parametrize(
    "table,field,says",
    [
        ('url = "s3://bkt/p"\nstall = "soon"', "store.stall", "not a duration"),
        ('url = "s3://bkt/p"\nstall = 0', "store.stall", "greater than 0"),
        ('url = "s3://bkt/p"\nstall = -5', "store.stall", "finite duration"),
        ('url = "s3://bkt/p"\nendpoint_url = "s3.example.com"', "store.endpoint_url", "http"),
        ('url = "s3://bkt/p"\nendpoint_url = "ftp://h"', "store.endpoint_url", "http"),
        ('url = "s3://bkt/p"\nendpoint_url = "http://"', "store.endpoint_url", "http"),
        ('url = "s3://bkt/p"\nendpoint_url = "http://h:x"', "store.endpoint_url", "http"),
        ('url = "s3://bkt/p"\nendpoint_url = 9000', "store.endpoint_url", "http"),
        ('url = "file:///d"\nendpoint_url = "http://h"', "store.endpoint_url", "only to an s3"),
        ('endpoint_url = "http://h"', "store.url", "is missing"),
        ('url = "bucket"', "store.url", "not a store URL"),
        ('url = "s3://bkt/p"\nregion = "x"', "store.region", "unknown setting"),
    ],
)
def test_a_bad_store_table_is_refused_naming_the_field(
    tmp_path: Any, table: str, field: str, says: str
) -> None:
    with pytest.raises(UsageError) as e:
        _build(tmp_path, f'command = ["true"]\n[store]\n{table}\n')
    assert e.value.field == field and says in e.value.line(), e.value.line()


def test_a_bad_setting_of_the_job_file_names_the_file_and_a_bad_flag_does_not(
    tmp_path: Any,
) -> None:
    job = tmp_path / "job.toml"
    for toml, field in [
        ('command = ["true"]\n[checkpoint]\nintervall = "5m"\n', "checkpoint.intervall"),
        ('command = ["true"]\ngrace = "soon"\n', "grace"),
        ('command = ["true"]\nstore = "ftp://x"\n', "store"),
        ('command = ["true"]\nname = "A B"\n', "name"),
    ]:
        with pytest.raises(UsageError) as e:
            _build(tmp_path, toml)
        assert e.value.exit_code == 2 and e.value.field == field, e.value.line()
        assert e.value.what.startswith(f"{job}: {field}: "), e.value.line()
    with pytest.raises(UsageError) as e:
        _build(tmp_path, 'command = ["true"]\n', grace="soon")
    assert e.value.what.startswith("--grace: "), e.value.line()
    with pytest.raises(UsageError) as e:  # the file's own reading names it once
        _build(tmp_path, "command = [\n")
    assert e.value.what.startswith(f"JOB.toml: {job} cannot be read"), e.value.line()
