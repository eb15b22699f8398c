"""Slurm's reports as rgt reads them (controller/slurm/queue.py) and the Slurm flags of `rgt
deploy` (controller/slurm/submit.py): real scontrol lines, and hostile ones, since everything
Slurm prints is untrusted on the laptop; the time formats; the checks that refuse a bad flag
before anything on the cluster changes."""

from __future__ import annotations

import pytest

from controller.registry import RunRecord
from controller.slurm import queue, submit
from controller.target import Target
from onbox.common.errors import UsageError
from onbox.common.sealtime import SealTime

# A line of `scontrol show job -o` from Slurm 22.05 (tests/slurm.py's cluster), with a work
# directory that holds spaces.
LINE = (
    "JobId=7 JobName=rgt-demo UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901759 "
    "Nice=0 Account=(null) QOS=(null) JobState=RUNNING Reason=None Dependency=(null) Requeue=1 "
    "Restarts=2 BatchFlag=1 Reboot=0 ExitCode=0:0 RunTime=00:00:41 TimeLimit=00:01:00 "
    "TimeMin=N/A NodeList=vm BatchHost=vm NumNodes=1 NumCPUs=1 Command=/tmp/a b/s.sh "
    "WorkDir=/tmp/a b StdErr=/tmp/a b/out-7 StdIn=/dev/null StdOut=/tmp/a b/out-7 Power= "
)


def test_a_real_line_parses_with_paths_that_hold_spaces() -> None:
    [job] = queue.parse_jobs(LINE)
    assert (job.job, job.state, job.reason, job.restarts, job.node) == (
        "7",
        "RUNNING",
        "None",
        2,
        "vm",
    )
    assert (job.time_limit, job.run_time, job.time_left) == (60, 41, 19)
    assert job.stdout == "/tmp/a b/out-7"
    assert job.live
    line = queue.describe(job, "7")
    assert "RUNNING" in line and "restarts 2" in line and "0:00:19 of 0:01:00" in line


def test_array_tasks_are_told_apart() -> None:
    text = "\n".join(
        f"JobId={10 + i} ArrayJobId=10 ArrayTaskId={i} JobState={s} Restarts=0 "
        "TimeLimit=UNLIMITED RunTime=00:00:01 NodeList=(null)"
        for i, s in enumerate(["COMPLETED", "RUNNING", "PENDING"])
    )
    jobs = queue.parse_jobs(text)
    assert [(j.array_job, j.array_task, j.state, j.live) for j in jobs] == [
        ("10", "0", "COMPLETED", False),
        ("10", "1", "RUNNING", True),
        ("10", "2", "PENDING", True),
    ]
    assert jobs[2].node == "" and jobs[2].time_limit is None and jobs[2].time_left is None
    assert queue.job_ref({"kind": "slurm", "job": "10", "array_task": 2}) == "10_2"
    assert queue.job_ref({"kind": "slurm", "job": "10"}) == "10"
    assert queue.job_ref({"kind": "slurm", "job": "10; rm -rf ~"}) is None
    assert queue.job_ref({"kind": "slurm", "job": "10", "array_task": "1-3"}) is None


@pytest.mark.parametrize(
    "line",
    [
        "JobId=5 JobState=running\x1b[2J Restarts=-1 TimeLimit=99:99:99 RunTime=abc",
        "JobId=5 JobState=" + "R" * 5000 + " Restarts=1e9 TimeLimit=UNLIMITED",
        "JobId=5 JobState=$(reboot) Reason=\x00\x07bell NodeList=" + "n" * 100000,
    ],
)
def test_hostile_values_read_as_unknown_never_as_a_guess(line: str) -> None:
    [job] = queue.parse_jobs(line)
    assert job.state == "UNKNOWN" and job.live  # unreadable counts live: no second job
    assert job.restarts is None and job.time_limit is None and job.run_time is None
    for value in (job.reason, job.node):
        assert len(value) <= queue.MAX_VALUE and value.isprintable()


def test_lines_without_a_job_id_are_skipped() -> None:
    assert queue.parse_jobs("slurm_load_jobs error: Invalid job id specified\n") == []
    assert queue.parse_jobs("JobId=../../x JobState=RUNNING\n=\n\x00") == []


def test_squeue_live_ids() -> None:
    text = "12 RUNNING\n13_2 PENDING\n14 COMPLETED\ngarbage\n15 weird-state\n16;x RUNNING\n"
    assert queue.parse_live(text) == ["12", "13_2", "15"]


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("00:01:00", 60),
        ("1-02:03:04", 93784),
        ("05:06", 306),
        ("2-03", 183600),
        ("UNLIMITED", None),
        ("N/A", None),
        ("00:61:00", None),
        ("", None),
        (None, None),
    ],
)
def test_report_clock(text: str, seconds: object) -> None:
    assert queue.parse_clock(text) == seconds


@pytest.mark.parametrize(
    ("flag", "seconds"),
    [
        ("1", 60),
        ("90", 5400),
        ("10:30", 630),
        ("4:00:00", 14400),
        ("1-0", 86400),
        ("1-2:30", 95400),
        ("1-02:03:04", 93784),
    ],
)
def test_walltime_flag(flag: str, seconds: int) -> None:
    assert queue.parse_walltime(flag) == seconds


@pytest.mark.parametrize("flag", ["0", "UNLIMITED", "-1", "1h", "1:61", "", "1:2:3:4", "x"])
def test_bad_walltime_is_refused_naming_the_flag(flag: str) -> None:
    with pytest.raises(UsageError, match="--time"):
        queue.parse_walltime(flag)


def test_job_id_of_sbatch_parsable() -> None:
    assert submit.parse_job_id("42\n") == "42"
    assert submit.parse_job_id("warning: x\n42;cluster1\n") == "42"
    assert submit.parse_job_id("Submitted batch job 42") is None
    assert submit.parse_job_id("") is None


def test_slurm_flags_off_a_slurm_profile_are_refused() -> None:
    with pytest.raises(UsageError, match="--time"):
        submit.check_ask(kind="ssh", time="10")
    with pytest.raises(UsageError, match="--sbatch"):
        submit.check_ask(kind=None, time=None, sbatch=["--qos=low"])
    assert submit.check_ask(kind="ssh", time=None) is None


def test_a_slurm_deploy_needs_a_walltime() -> None:
    with pytest.raises(UsageError, match="--time.*required"):
        submit.check_ask(kind="slurm", time=None, partition="gpu")


@pytest.mark.parametrize(
    ("field", "kw"),
    [
        ("--partition", {"partition": "gpu;reboot"}),
        ("--gpus", {"gpus": "2 --wrap=x"}),
        ("--mem", {"mem": "lots"}),
        ("--cpus", {"cpus": 0}),
        ("--seal-time", {"seal_time": "-3"}),
        ("--sbatch", {"sbatch": ["--qos=low\n#SBATCH --wrap=x"]}),
        ("--sbatch", {"sbatch": ["qos=low"]}),
        ("--sbatch", {"sbatch": ["--signal=B:USR2@1"]}),
        ("--sbatch", {"sbatch": ["--output=/tmp/x"]}),
        ("--sbatch", {"sbatch": ["--job-name=other"]}),
        ("--sbatch", {"sbatch": ["--array=0-3"]}),
    ],
)
def test_bad_slurm_flags_are_refused(field: str, kw: dict) -> None:  # type: ignore[type-arg]
    with pytest.raises(UsageError, match=field):
        submit.check_ask(kind="slurm", time="10", **kw)


def test_a_good_ask_becomes_the_batch_script() -> None:
    ask = submit.check_ask(
        kind="slurm",
        time="1-0",
        partition="gpu",
        gpus="a100:2",
        cpus=8,
        mem="32G",
        sbatch=["--qos=low", "--exclusive"],
        seal_time="12",
        run="demo",
        command=["python", "train.py"],
    )
    assert ask is not None and ask.walltime == 86400 and ask.lead == 84
    rec = RunRecord(
        name="demo",
        target=Target("local"),
        agent=["/home/u/.rgt/agent/venv/bin/rgt-agent"],
        box_home="/home/u/.rgt",
        workdir="/home/u/.rgt/releases/abc",
    )
    text = ask.script(rec, "/home/u/.rgt/runs/demo", ["--store", "s3://b/p"], None)
    for line in (
        "#SBATCH --time=1-0",
        "#SBATCH --signal=B:USR2@84",
        "#SBATCH --partition=gpu",
        "#SBATCH --gpus=a100:2",
        "#SBATCH --cpus-per-task=8",
        "#SBATCH --mem=32G",
        "#SBATCH --qos=low",
        "#SBATCH --exclusive",
        "#SBATCH --output=/home/u/.rgt/runs/demo/slurm-%j.out",
    ):
        assert line in text.splitlines()
    assert "--store s3://b/p" in text and "-- python train.py" in text


def test_a_lead_that_leaves_no_time_to_train_is_refused_before_anything_changes() -> None:
    # Not measured: 2 x the assumed 30 s + 60 s = 120 s, not shorter than one minute.
    with pytest.raises(UsageError, match="--time"):
        submit.check_ask(kind="slurm", time="1", run="demo", command=["python", "t.py"])
    ask = submit.check_ask(kind="slurm", time="3", run="demo", command=["python", "t.py"])
    assert ask is not None and ask.lead == 120 and "NOT MEASURED" in ask.lead_line


def test_the_lead_says_where_it_came_from() -> None:
    none = SealTime(None, 0, "not measured: run x has sealed nothing yet")
    lead = none.lead(assumed=30, slack=submit.SLACK)
    line = submit.lead_line(none, lead, 30)
    assert lead == 120 and "NOT MEASURED: assumed 30 s" in line and "rgt smoke" in line
    measured = SealTime(12.0, 3, "measured: ...")
    lead = measured.lead(assumed=30, slack=submit.SLACK)
    line = submit.lead_line(measured, lead, 30)
    assert lead == 84 and "2 x the measured 12 s seal + 60 s slack" in line
