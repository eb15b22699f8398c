"""`rgt down` of a deployed run whose checkpoint dir is inside its release (its workdir).

A deployed job's ``[checkpoint] dir = "ckpt"`` is relative to its workdir, the release. Down
removes the release when no other run uses it, and the checkpoint dir with it; the plan said
that dir was kept ("not removed"), and listed the checkpoints a pull holds as lost (it looked
for them under ``outputs/``, where a pull puts them under ``checkpoints/``). A real agent run
with a file store, a real pull, the plan and a real down, on this machine.
"""

from __future__ import annotations

import os
import sys
from typing import Any, List

import pytest

from controller.registry import Registry, RunRecord
from controller.remote import open_remote
from controller.results.down import down, plan_down
from controller.results.pull import pull
from controller.target import Target
from tests.conftest import Cli, agent_exe
from tests.integration.test_down import RELEASE, RUN, _after

_JOB = """
import os
ckpt = os.environ["RGT_CKPT_DIR"]
os.makedirs(ckpt, exist_ok=True)
with open(os.path.join(ckpt, "step_1.pt"), "wb") as f:
    f.write(b"weights of step 1")
"""


def _never(prompt: str) -> str:
    raise AssertionError(f"asked {prompt!r}")


def _section(text: str, head: str, end: str) -> str:
    return text.split(head)[1].split(end)[0]


@pytest.mark.parametrize("shared", [False, True])
def test_down_says_a_checkpoint_dir_in_the_release_goes_with_it(
    cli: Cli, tmp_path: Any, laptop: str, shared: bool
) -> None:
    """The checkpoint pulled is not lost; the one written after the pull is; the plan says the
    checkpoint dir goes with the release, and down removes it. ``shared``: another deploy uses
    the release, so it stays, with the checkpoint dir, and the plan says so."""
    release = os.path.join(cli.home, "releases", RELEASE)
    os.makedirs(release)
    with open(os.path.join(release, "train.py"), "w") as f:
        f.write(_JOB)
    marker = os.path.join(release, ".rgt-release")  # written last, as a push does
    with open(marker, "w") as f:
        f.write("{}")
    for name in [RUN, "other"] if shared else [RUN]:
        os.makedirs(os.path.join(cli.home, "deploys", name))
        link = os.path.join(cli.home, "deploys", name, "current")
        os.symlink(f"../../releases/{RELEASE}", link)
    _after(marker)
    ckpt = os.path.join(release, "ckpt")
    (tmp_path / "store").mkdir()
    store = "file://" + str(tmp_path / "store")
    cli("run", "--name", RUN, "--store", store, "--ckpt-dir", ckpt, "--", sys.executable,
        "train.py", check=True, cwd=release)  # fmt: skip
    rec = RunRecord(RUN, Target("local"), profile="local", store=store, box_home=cli.home,
                    agent=agent_exe(), release=RELEASE, workdir=release)  # fmt: skip
    receipt = pull(rec, str(tmp_path / "dest"), "store")
    assert "checkpoints/step_1.pt" in {f.path for f in receipt.files}
    # Written after the pull, and not sealed: the store does not hold it either.
    with open(os.path.join(ckpt, "step_2.pt"), "wb") as g:
        g.write(b"weights of step 2")

    text = "\n".join(plan_down(rec, open_remote(rec.target)).lines())
    lost = _section(text, "will be lost", "\nkept:")
    kept = _section(text, "\nkept:", "\nbilling:")
    assert "step_1.pt" not in lost, text  # pulled
    assert "outside the run dir" not in text, text
    will = text.split("\ndown will:\n")[1]
    assert (
        f"remove {release} unless another run uses it, and with it the checkpoint dir ckpt/ "
        "inside it\n" in will
    ), text
    if shared:
        assert "step_2.pt" not in lost, text
        assert f"the checkpoint dir {ckpt} on the box (in the release {RELEASE}, which " in kept
    else:
        assert "checkpoint step_2.pt (17 B)" in lost, text
        assert [x for x in lost.splitlines() if "step_" in x] == ["  checkpoint step_2.pt (17 B)"]
        assert f"the checkpoint dir {ckpt} (in the release {RELEASE}: removed with it" in lost

    Registry().put(rec)
    shown: List[str] = []
    down(rec, yes=True, interactive=False, ask=_never, show=shown.append)
    assert os.path.exists(os.path.join(ckpt, "step_2.pt")) is shared
    assert os.path.exists(release) is shared


@pytest.mark.parametrize("marked", [True, False])
def test_down_of_a_checkpoint_dir_that_is_the_release_lists_only_what_the_job_wrote(
    cli: Cli, tmp_path: Any, laptop: str, marked: bool
) -> None:
    """``--ckpt-dir .``: the job checkpoints into its workdir, the release itself. The pushed
    files there (on the laptop; a hidden one is sealed by no seal) and the release's marker are
    not lost, nor what the pull holds; what was written there after the push and no pull holds
    is, checkpoint or not. ``marked``: the release still has its marker; without it, what was
    pushed cannot be told from what was written, and every file there no pull holds is listed."""
    release = os.path.join(cli.home, "releases", RELEASE)
    os.makedirs(os.path.join(release, "conf"))
    with open(os.path.join(release, "train.py"), "w") as f:
        f.write(_JOB)
    with open(os.path.join(release, "conf", ".base.yaml"), "w") as f:
        f.write("lr: 0.1\n")
    marker = os.path.join(release, ".rgt-release")  # written last, as a push does
    with open(marker, "w") as f:
        f.write("{}")
    os.makedirs(os.path.join(cli.home, "deploys", RUN))
    os.symlink(f"../../releases/{RELEASE}", os.path.join(cli.home, "deploys", RUN, "current"))
    _after(marker)
    (tmp_path / "store").mkdir()
    store = "file://" + str(tmp_path / "store")
    cli("run", "--name", RUN, "--store", store, "--ckpt-dir", ".", "--", sys.executable,
        "train.py", check=True, cwd=release)  # fmt: skip
    rec = RunRecord(RUN, Target("local"), profile="local", store=store, box_home=cli.home,
                    agent=agent_exe(), release=RELEASE, workdir=release)  # fmt: skip
    receipt = pull(rec, str(tmp_path / "dest"), "store")
    assert "checkpoints/step_1.pt" in {f.path for f in receipt.files}
    with open(os.path.join(release, "step_2.pt"), "wb") as g:
        g.write(b"weights of step 2")
    with open(os.path.join(release, "notes.txt"), "w") as g:
        g.write("what the job noted")

    if not marked:
        os.unlink(marker)

    text = "\n".join(plan_down(rec, open_remote(rec.target)).lines())
    lost = _section(text, "will be lost", "\nkept:")
    assert "train.py" not in lost and "step_1.pt" not in lost, text  # pulled
    # Not a checkpoint (no checkpoint format, a hidden name): said as the file it is. Before,
    # each was "checkpoint notes.txt (18 B)". Without the marker, a pushed file cannot be told
    # from one the job wrote, and the line does not say who wrote it.
    written = "the job wrote" if marked else ""
    assert ("file conf/.base.yaml in the checkpoint dir (8 B)" in lost) is not marked, text
    assert ".rgt-release" not in lost, text
    assert "  checkpoint step_2.pt (17 B)\n" in lost, text
    assert (
        f"  file notes.txt {written + ' ' if written else ''}in the checkpoint dir (18 B)\n" in lost
    )
    assert "checkpoint notes.txt" not in lost and "checkpoint conf/" not in lost, text
    will = text.split("\ndown will:\n")[1]
    assert (
        f"remove {release} unless another run uses it, and with it the checkpoint dir, which "
        "is the release itself\n" in will
    ), text
