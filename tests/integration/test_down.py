"""`rgt down` against a real agent run, on this machine (`local`) and over a real sshd.

What a user relies on: down never takes a run away unless a verified pull holds its newest
sealed state; it says what will be lost and what keeps billing; it asks for the run's name
typed (``--yes`` only from a script); it stops the job and removes exactly the run's files on
the box (never the store, never what another run uses); and running it again is safe.

Each run is a real agent with a file store; its job (tests/fixtures/ckpt_writer.py on_signal)
writes a checkpoint each time it gets SIGUSR2, which the agent seals. The box layout of a deploy
(releases/, deploys/NAME/current, secrets/NAME) is laid out as `rgt deploy` leaves it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, Iterator, List, Optional

import pytest

from controller.registry import Registry, RunRecord
from controller.remote import SshRemote, open_remote
from controller.results.down import down, plan_down
from controller.results.pull import pull
from controller.results.receipt import state_receipt_path
from controller.target import Target
from onbox.common.errors import HostError, NotFound, UnsafeRefused
from onbox.profiles.load import load as load_profile
from tests.conftest import Cli, agent_exe, fixture
from tests.polling import wait
from tests.sshd import SshServer

RUN = "r1"
RELEASE = "a1b2c3d4e5f6"


class Box:
    """A deployed run on this machine: release, deploy link, secrets, a live agent."""

    def __init__(self, cli: Cli, tmp_path: Any, store: Optional[str] = None) -> None:
        """``store``: the run's store URL (default: a file:// store at ``store_root``)."""
        self.cli = cli
        self.home = cli.home
        self.store_root = str(tmp_path / "store")
        os.mkdir(self.store_root)
        self.store = store or "file://" + self.store_root
        self.release = os.path.join(self.home, "releases", RELEASE)
        self.other_release = os.path.join(self.home, "releases", "ffff0000")
        for rel, name in ((self.release, RUN), (self.other_release, "other")):
            os.makedirs(rel)
            with open(os.path.join(rel, ".rgt-release"), "w") as f:
                f.write("{}")
            d = os.path.join(self.home, "deploys", name)
            os.makedirs(d)
            os.symlink(f"../../releases/{os.path.basename(rel)}", os.path.join(d, "current"))
        p = subprocess.run(
            [*agent_exe(), "secrets", RUN],
            input=b'{"RGT_TEST_TOKEN": "s3cr3t"}',
            env=cli.env,
            capture_output=True,
            timeout=60,
        )
        assert p.returncode == 0, p.stderr
        # The job in a job file only for its start grace: 1 s, not 5, is how long the agent
        # keeps a live job STARTING, and each box waits for RUNNING (intact() asserts it).
        job = os.path.join(str(tmp_path), "box-job.toml")
        with open(job, "w") as f:
            f.write(
                f"command = {json.dumps([*fixture('ckpt_writer.py'), 'on_signal', '0.25'])}\n"
                f"workdir = {json.dumps(self.release)}\n"
                '[restart]\nstart_grace = "1s"\n'
            )
        cli("start", job, "--name", RUN, "--store", self.store, check=True, cwd=self.release)
        cli.wait_for(RUN, lambda s: s["state"] == "RUNNING" and bool(s.get("pid")), what="job")
        wait(lambda: "ready" in cli.log_text(RUN), 60, "the job to be ready")

    @property
    def run_dir(self) -> str:
        return os.path.join(self.home, "runs", RUN)

    def latest(self) -> Optional[int]:
        try:
            with open(os.path.join(self.store_root, RUN, "LATEST.json")) as f:
                step: int = json.load(f)["step"]
                return step
        except FileNotFoundError:
            return None

    def checkpoint(self, step: int) -> None:
        """Ask the job for its next checkpoint and wait until the agent has sealed it."""
        os.kill(self.cli.status(RUN)["pid"], signal.SIGUSR2)
        wait(lambda: self.latest() == step, 60, f"step {step} sealed")

    def record(self, target: Optional[Target] = None) -> RunRecord:
        rec = RunRecord(
            RUN,
            target or Target("local"),
            profile="local" if target is None else "generic-ssh",
            store=self.store,
            box_home=self.home,
            agent=agent_exe(),
            release=RELEASE,
            workdir=self.release,
        )
        Registry().put(rec)
        return rec

    def intact(self) -> None:
        """The run is as it was: live, every file of it on the box."""
        assert self.cli.status(RUN)["state"] == "RUNNING"
        for path in (
            self.run_dir,
            self.release,
            os.path.join(self.home, "secrets", RUN),
            os.path.join(self.home, "deploys", RUN, "current"),
        ):
            assert os.path.exists(path), path


@pytest.fixture
def box(cli: Cli, tmp_path: Any, laptop: str) -> Iterator[Box]:
    b = Box(cli, tmp_path)
    b.checkpoint(1)
    yield b


def _never(prompt: str) -> str:
    raise AssertionError(f"down asked {prompt!r} before it should have")


def test_down_is_refused_until_a_verified_pull_covers_the_newest_sealed_state(
    box: Box, tmp_path: Any
) -> None:
    rec = box.record()
    shown: List[str] = []

    # No receipt at all: refused before anything is shown or asked.
    with pytest.raises(UnsafeRefused, match="no verification receipt") as info:
        down(rec, yes=False, interactive=True, ask=_never, show=shown.append)
    assert info.value.exit_code == 7 and not shown
    box.intact()

    receipt = pull(rec, str(tmp_path / "dest"), "store")
    assert receipt.sealed.step == 1

    # A wrong name typed: refused, nothing done.
    with pytest.raises(UnsafeRefused, match="does not match"):
        down(rec, yes=False, interactive=True, ask=lambda p: "r2", show=shown.append)
    assert any("will be lost" in line for line in shown)
    box.intact()

    # --yes on a terminal is refused; no terminal and no --yes is refused too.
    with pytest.raises(UnsafeRefused, match="--yes works only when stdin is not a terminal"):
        down(rec, yes=True, interactive=True, ask=_never)
    with pytest.raises(UnsafeRefused, match="typed on a terminal"):
        down(rec, yes=False, interactive=False, ask=_never, show=lambda line: None)
    box.intact()

    # A newer checkpoint sealed after the pull: the receipt no longer covers the newest state,
    # and --yes does not stand in for it.
    box.checkpoint(2)
    with pytest.raises(UnsafeRefused, match="newest sealed step is 2, the receipt has step 1"):
        down(rec, yes=True, interactive=False, ask=_never, show=lambda line: None)
    box.intact()
    assert Registry().get(RUN) == rec


@pytest.mark.parametrize("over", ["local", "ssh"])
def test_down_after_a_verified_pull_stops_the_run_and_removes_only_its_box_files(
    box: Box, tmp_path: Any, over: str, request: pytest.FixtureRequest, laptop: str
) -> None:
    target = None
    if over == "ssh":
        sshd: SshServer = request.getfixturevalue("sshd")
        target = Target(
            "ssh", host="127.0.0.1", user=sshd.user, port=sshd.port, identity=sshd.client_key
        )
        request.addfinalizer(SshRemote(target).close)
    rec = box.record(target)
    receipt = pull(rec, str(tmp_path / "dest"), "auto")
    # Something the job wrote that was never sealed (not a checkpoint format): lost by down.
    with open(os.path.join(box.run_dir, "ckpt", "notes.txt"), "w") as f:
        f.write("unsealed")

    shown: List[str] = []
    asked: List[str] = []

    def ask(prompt: str) -> str:
        asked.append(prompt)
        return RUN

    plan = down(rec, yes=False, interactive=True, ask=ask, show=shown.append)
    text = "\n".join(shown)
    assert len(asked) == 1 and RUN in asked[0]
    assert "file notes.txt the job wrote in the checkpoint dir" in text  # box only: lost
    # A live run's log is not sealed yet: lost where the store goes with the box, else the
    # stop seals it there (ENDED.json).
    lost = text.split("will be lost")[1].split("kept:")[0]
    assert ("job log of attempt 1" in lost) == (over == "ssh"), text
    if over == "local":
        assert "job log of attempt 1: the stop seals it into the store" in text, text
    assert "step_1.pt" not in text.split("will be lost")[1].split("kept:")[0]  # it was pulled
    assert ".staged" not in text  # no deploy left secrets staged: nothing of them to name
    if over == "local":
        assert "nothing keeps billing" in text
    else:
        assert "keeps billing until you stop it in your provider's console" in text
    assert plan.done[0] == "stopped the agent and the job"

    # The run is gone from the box; the store, the pulled files and the other run stay.
    for gone in (
        box.run_dir,
        box.release,
        os.path.join(box.home, "secrets", RUN),
        os.path.join(box.home, "deploys", RUN),
    ):
        assert not os.path.lexists(gone), gone
    assert os.path.exists(os.path.join(box.other_release, ".rgt-release"))
    assert os.path.islink(os.path.join(box.home, "deploys", "other", "current"))
    assert box.latest() == 1
    assert os.path.exists(os.path.join(receipt.dest, "checkpoints", "step_1.pt"))
    assert os.path.exists(state_receipt_path(RUN))
    if over == "local":  # the store is on this machine: the record stays for it, taken down
        assert Registry().get(RUN).down_at is not None
        last = "kept the run's record for its store, marked taken down"
    else:  # generic-ssh: the store is on the box's disk, which goes with the machine
        with pytest.raises(NotFound):
            Registry().get(RUN)
        last = "forgot the run on this laptop"
    assert plan.done[-1] == last
    assert json.loads(box.cli("list", "--json").stdout) == []  # no run left on the box

    # Running it again (the laptop kept the record as it was) is safe: nothing is left to do.
    again = down(rec, yes=True, interactive=False, ask=_never, show=shown.append)
    assert again.state is None and again.done == ["removed the run's files on the box", last]


def test_down_finishes_after_a_down_that_stopped_halfway(box: Box, tmp_path: Any) -> None:
    rec = box.record()
    pull(rec, str(tmp_path / "dest"), "store")
    # A down that died after the stop and the first removals: the agent is stopped, the
    # secrets and the deploy link are gone, the run dir and the release are still there.
    box.cli("stop", RUN, "--grace", "5", check=True)
    os.unlink(os.path.join(box.home, "secrets", RUN))
    os.unlink(os.path.join(box.home, "deploys", RUN, "current"))

    plan = down(rec, yes=True, interactive=False, ask=_never, show=lambda line: None)
    assert plan.state == "STOPPED"
    assert not os.path.exists(box.run_dir) and not os.path.exists(box.release)
    assert os.path.exists(box.other_release)


# An `rm` first on the down's PATH: the removal of a release directory (`rm -rf DIR`, DIR
# holding .rgt-release) is cut off halfway, as when the link drops: every file but the marker
# removed (it comes later in the directory's order), then the down's shell and this rm are
# SIGKILLed. Every other rm is the real one.
CUT_RM = """#!/bin/sh
for last; do :; done
if [ "$1" = "-rf" ] && [ -f "$last/.rgt-release" ]; then
  find "$last" -type f ! -name .rgt-release -exec /bin/rm -f {} +
  kill -KILL "$PPID" "$$"
fi
exec /bin/rm "$@"
"""


def test_a_down_cut_off_while_removing_a_release_leaves_it_whole_or_gone_fake_rm(
    box: Box, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A release removed in place and cut off halfway kept its marker with its files gone: the
    next deploy of the same code found it complete and ran in it. It is renamed aside first:
    releases/<id> is whole or absent, and a second down finishes."""
    with open(os.path.join(box.release, "train.py"), "w") as f:
        f.write("print('the job')\n")
    rec = box.record()
    pull(rec, str(tmp_path / "dest"), "store")
    shim = tmp_path / "cut-rm"
    shim.mkdir()
    (shim / "rm").write_text(CUT_RM)
    (shim / "rm").chmod(0o755)
    with monkeypatch.context() as m:
        m.setenv("PATH", f"{shim}:{os.environ['PATH']}")
        with pytest.raises(HostError):
            down(rec, yes=True, interactive=False, ask=_never, show=lambda line: None)
    torn = os.path.exists(box.release) and not os.path.exists(os.path.join(box.release, "train.py"))
    assert not torn, os.listdir(box.release)
    assert not os.path.exists(box.release)
    down(rec, yes=True, interactive=False, ask=_never, show=lambda line: None)
    assert not os.path.exists(box.run_dir) and not os.path.exists(box.release)
    assert os.path.exists(os.path.join(box.other_release, ".rgt-release"))


# A job that leaves a declared output and, beside it, a file nothing declares.
WORKDIR_JOB = """
import os
os.makedirs("results", exist_ok=True)
with open("results/eval.csv", "w") as f:
    f.write("acc,0.93\\n")
os.makedirs("scratch", exist_ok=True)
with open("scratch/best-notes.txt", "w") as f:
    f.write("the best run so far\\n")
print("finished", flush=True)
"""


def _after(path: str) -> None:
    """Return once a file written now gets a later change time than ``path`` has (file times
    move in clock ticks: a file written in the same tick would look as old)."""
    probe = path + ".probe"
    deadline = time.monotonic() + 10
    try:
        while True:
            with open(probe, "w"):
                pass
            if os.stat(probe).st_ctime_ns > os.stat(path).st_mtime_ns:
                return
            assert time.monotonic() < deadline, "the file clock did not move"
            time.sleep(0.01)
    finally:
        os.unlink(probe)


def test_down_shows_as_lost_what_the_job_wrote_in_its_workdir_that_no_pull_holds(
    cli: Cli, tmp_path: Any, laptop: str
) -> None:
    """The job runs in its release; down removes the release. What the job wrote there and
    the receipt does not hold (an undeclared file) must be among what "will be lost", not
    removed unsaid; the pushed code and the pulled outputs are not."""
    release = os.path.join(cli.home, "releases", RELEASE)
    os.makedirs(release)
    with open(os.path.join(release, "train.py"), "w") as f:
        f.write(WORKDIR_JOB)
    marker = os.path.join(release, ".rgt-release")  # written last, as a push does
    with open(marker, "w") as f:
        f.write("{}")
    deploys = os.path.join(cli.home, "deploys", RUN)
    os.makedirs(deploys)
    os.symlink(f"../../releases/{RELEASE}", os.path.join(deploys, "current"))
    _after(marker)
    (tmp_path / "store").mkdir()
    store = "file://" + str(tmp_path / "store")
    cli("start", "--name", RUN, "--store", store, "--output", "results/", "--",
        sys.executable, "train.py", check=True, cwd=release)  # fmt: skip
    cli.wait_over(RUN, "SUCCEEDED")
    rec = RunRecord(RUN, Target("local"), profile="local", store=store, box_home=cli.home,
                    agent=agent_exe(), release=RELEASE, workdir=release)  # fmt: skip
    Registry().put(rec)
    receipt = pull(rec, str(tmp_path / "dest"), "store")
    assert "outputs/results/eval.csv" in {f.path for f in receipt.files}

    shown: List[str] = []
    with pytest.raises(UnsafeRefused, match="does not match"):
        down(rec, yes=False, interactive=True, ask=lambda p: "not-it", show=shown.append)
    lost = "\n".join(shown).split("will be lost")[1].split("\nkept:")[0]
    assert "scratch/best-notes.txt" in lost, lost
    assert "eval.csv" not in lost and "train.py" not in lost, lost
    assert os.path.exists(os.path.join(release, "scratch", "best-notes.txt"))


def _pod_profile(d: str, where: str, network_volume: bool) -> None:
    """A user profile ``pod``: RunPod's shipped facts with its /workspace at ``where`` (this
    machine's store), with or without the Network Volume that may sit there."""
    with open(os.path.join(os.path.dirname(load_profile("runpod").file), "runpod.toml")) as f:
        text = f.read().replace('name = "runpod"', 'name = "pod"', 1)
    text = text.replace('"/workspace"', json.dumps(where))
    if not network_volume:
        head, _, rest = text.partition('[[storage]]\nname = "network-volume"')
        text = head + rest[rest.index("\n[") + 1 :]
    with open(os.path.join(d, "pod.toml"), "w") as f:
        f.write(text)


@pytest.mark.parametrize("network_volume", [True, False])
def test_down_on_a_pod_says_its_store_on_the_volume_disk_is_lost_with_the_pod(
    box: Box, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, network_volume: bool
) -> None:
    """A file:// store on a RunPod pod's /workspace: down leaves the store alone, but the
    terminate deletes the volume disk, so every sealed checkpoint in it goes too (only a
    Network Volume there survives). The plan the user confirms says so, under what is lost."""
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    monkeypatch.setenv("RGT_PROFILES_DIR", str(profiles))
    _pod_profile(str(profiles), os.path.dirname(box.store_root), network_volume)
    rec = dataclasses.replace(box.record(), profile="pod")
    Registry().put(rec)
    pull(rec, str(tmp_path / "dest"), "auto")

    text = "\n".join(plan_down(rec, open_remote(rec.target)).lines())
    lost = text.split("will be lost")[1].split("kept:")[0]
    kept = text.split("kept:")[1].split("billing:")[0]
    assert f"the store file://{box.store_root}" in lost, text
    assert "the provider deletes it at the meter-stop (terminate)" in lost
    if network_volume:
        assert "if it is on the volume (" in lost and "not the network-volume" in lost
    assert "the store" not in kept  # no longer promised as kept
    box.intact()  # only a plan: nothing was done


def test_down_of_a_live_run_says_the_stops_checkpoint_goes_to_the_store_only(
    box: Box, tmp_path: Any, sshd: SshServer, request: pytest.FixtureRequest
) -> None:
    """Down stops a live run first, and the stop may seal a newer checkpoint (what the job saves
    as it is stopped) into the store: the receipt covers what was pulled (step 1), not that one.
    Before: the plan said only that the run will be stopped. Now it says where that checkpoint
    goes (the store, not the pulled copy), that down forgets the run (so `rgt pull` cannot fetch
    it afterwards), and the steps that bring it here: stop, pull, then down."""
    target = Target(
        "ssh", host="127.0.0.1", user=sshd.user, port=sshd.port, identity=sshd.client_key
    )
    request.addfinalizer(SshRemote(target).close)
    rec = box.record(target)
    dest = str(tmp_path / "dest")
    pull(rec, dest, "store")
    text = "\n".join(plan_down(rec, open_remote(rec.target)).lines())
    live = text.split("the run is RUNNING:")[1].split("down will:")[0]
    assert f"the store file://{box.store_root}" in live, text
    assert f"not into {dest}" in live and "step 1" in live, text
    assert f"rgt stop {RUN}, then rgt pull {RUN} --from store, then rgt down {RUN}" in live, text
    box.intact()  # only a plan: nothing was done


def _nas_profile(d: str, where: str) -> None:
    """A user profile ``nas``: any ssh box (generic-ssh), with a network mount at ``where`` (this
    machine's store) that outlives the machine."""
    with open(
        os.path.join(os.path.dirname(load_profile("generic-ssh").file), "generic-ssh.toml")
    ) as f:
        text = f.read().replace('name = "generic-ssh"', 'name = "nas"', 1)
    mount = (
        f'[[storage]]\nname = "nas"\npath = {json.dumps(where)}\nsurvives_stop = true\n'
        'survives_destroy = true\nnote = "a network mount"\n\n[durable]'
    )
    with open(os.path.join(d, "nas.toml"), "w") as f:
        f.write(text.replace("[durable]", mount, 1))


def _rgt(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """`rgt ARGV` in this process: its exit code, stdout and stderr."""
    from controller.cli import main as rgt_main

    capsys.readouterr()
    code = rgt_main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_a_run_taken_down_keeps_its_record_for_a_store_that_outlives_the_box(
    box: Box,
    tmp_path: Any,
    sshd: SshServer,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The store is on a mount that outlives the box: after `rgt down N` the run's newest sealed
    state is still there (the stop of a live run may seal one newer than the pull). Before, down
    forgot the run, so neither `rgt pull N` nor `rgt status N` could find the store by name. Now
    the record stays, marked taken down: pull and status read the store, the commands that need
    the box say it was taken down (exit 8), and `rgt down N` again forgets the run."""
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    monkeypatch.setenv("RGT_PROFILES_DIR", str(profiles))
    _nas_profile(str(profiles), os.path.dirname(box.store_root))
    target = Target(
        "ssh", host="127.0.0.1", user=sshd.user, port=sshd.port, identity=sshd.client_key
    )
    request.addfinalizer(SshRemote(target).close)
    rec = dataclasses.replace(box.record(target), profile="nas")
    Registry().put(rec)
    pull(rec, str(tmp_path / "dest"), "store")

    shown: List[str] = []
    down(rec, yes=True, interactive=False, ask=_never, show=shown.append)
    text = "\n".join(shown)
    live = text.split("the run is RUNNING:")[1].split("down will:")[0]
    assert f"`rgt pull {RUN}` fetches it afterwards" in live, text
    assert "cannot fetch it" not in text
    assert "keep the run's record on this laptop, marked taken down, for its store" in text
    # The store is read on the box (a mount there): what it holds, as its rotation left it.
    assert f"the store {rec.store}: the sealed checkpoints of step 1 (its rotation kept the " \
        "newest 3" in text, text  # fmt: skip
    assert not os.path.exists(box.run_dir)
    kept = Registry().get(RUN)
    assert kept.down_at is not None and kept.store == rec.store

    # `rgt pull N` (auto) fetches from the store and verifies; --from box is refused.
    after = tmp_path / "after"
    code, out, err = _rgt(capsys, "pull", RUN, "--to", str(after))
    assert code == 0, err
    assert "and verified" in out
    assert (after / "checkpoints" / "step_1.pt").exists()
    with open(after / ".rgt-receipt.json") as f:
        assert json.load(f)["source"] == "store"
    code, out, err = _rgt(capsys, "pull", RUN, "--from", "box", "--to", str(tmp_path / "b"))
    assert code == 8 and "was taken down at" in err and f"rgt pull {RUN}" in err, err

    # `rgt status N` and `rgt watch N` answer from the store, saying the run was taken down.
    code, out, err = _rgt(capsys, "status", RUN)
    assert code == 0, err
    first = out.splitlines()[0]
    assert f"{RUN}: taken down at" in first and "read from the store" in first, out
    assert "does not answer" not in out
    code, out, err = _rgt(capsys, "watch", RUN, "--once")
    assert code == 0 and f"{RUN}: taken down at" in out, out + err
    code, out, err = _rgt(capsys, "report", RUN, "--out", str(tmp_path / "r.html"))
    assert code == 0, err
    assert "taken down at" in (tmp_path / "r.html").read_text()

    # `rgt runs` lists it as taken down.
    code, out, err = _rgt(capsys, "runs")
    line = next(x for x in out.splitlines() if x.startswith(RUN + " "))
    assert "taken down at" in line, out

    # The commands that need the box say it was taken down, and do nothing.
    for argv in (["logs", RUN], ["stop", RUN]):
        code, out, err = _rgt(capsys, *argv)
        assert code == 8 and f"run {RUN} was taken down at" in err, (argv, err)

    # `rgt down N` again forgets it, confirmed as the first down is: nothing on a box, no meter.
    code, out, err = _rgt(capsys, "down", RUN)
    assert code == 7 and "typed on a terminal" in err, out + err
    assert Registry().get(RUN).down_at is not None
    code, out, err = _rgt(capsys, "down", RUN, "--yes")
    assert code == 0, err
    assert "nothing is done on a box nor to the meter" in out, out
    assert "on a machine that mounts it" in out.splitlines()[-1], out  # a file:// store
    assert "rgt has no API" not in out  # no meter-stop step this time
    with pytest.raises(NotFound):
        Registry().get(RUN)
