"""`rgt down` of a run whose checkpoint dir is a symlink, judged where the files are.

A user on a box with a small system disk (AutoDL) moves the run's checkpoint dir to the data
disk and links it back (``runs/N/ckpt -> /root/autodl-tmp/ckpt``). Down removes the run dir
without following a link in it, so those checkpoints stay; but the plan said nothing of them,
not even where the meter-stop deletes that disk. The other way round, a checkpoint dir named
outside the run dir that links into it goes with the run dir, and the plan said "not removed".
A real agent run without a store, a real pull, the plan and a real down, on this machine.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
from typing import Any, List

import pytest

from controller.registry import Registry
from controller.remote import open_remote
from controller.results.down import down, plan_down
from controller.results.pull import pull
from tests.conftest import Cli
from tests.integration.test_down import _pod_profile
from tests.integration.test_pull import RUN, _rec

# A checkpoint, and a torn write's leftover that no pull takes (the sealer skips it too).
_JOB = """
import os
ckpt = os.environ["RGT_CKPT_DIR"]
os.makedirs(ckpt, exist_ok=True)
with open(os.path.join(ckpt, "step_3.pt"), "wb") as f:
    f.write(b"weights of step 3")
with open(os.path.join(ckpt, ".step_4.pt.tmp"), "wb") as f:
    f.write(b"torn")
"""


def _never(prompt: str) -> str:
    raise AssertionError(f"asked {prompt!r}")


def _section(text: str, head: str, end: str) -> str:
    return text.split(head)[1].split(end)[0]


@pytest.mark.parametrize("way", ["out", "in"])
def test_down_judges_a_linked_checkpoint_dir_where_its_files_are(
    cli: Cli, tmp_path: Any, laptop: str, monkeypatch: pytest.MonkeyPatch, way: str
) -> None:
    """``out``: the run's checkpoint dir is moved to a data disk and linked back. The plan
    names where the checkpoints are, kept (down removes the link, not them), or lost where the
    provider deletes that disk at the meter-stop (a RunPod pod's volume); down leaves them.
    ``in``: the checkpoint dir named by --ckpt-dir is moved into the run dir and linked back.
    The plan lists the checkpoint no pull holds as lost, not the dir as "not removed"; down
    removes it with the run dir."""
    work, data = tmp_path / "work", tmp_path / "data"
    work.mkdir()
    data.mkdir()
    (work / "job.py").write_text(_JOB)
    run_dir = os.path.join(cli.home, "runs", RUN)
    named = os.path.join(run_dir, "ckpt") if way == "out" else str(tmp_path / "ck")
    flags = [] if way == "out" else ["--ckpt-dir", named]
    cli("run", "--name", RUN, *flags, "--", sys.executable, "job.py", check=True, cwd=str(work))
    real = str(data / "ckpt") if way == "out" else os.path.join(run_dir, "ck")
    shutil.move(named, real)  # the user's move, after the run
    os.symlink(real, named)
    rec = _rec(None, cli.home)
    receipt = pull(rec, str(tmp_path / "dest"), "box")
    assert "checkpoints/step_3.pt" in {f.path for f in receipt.files}

    text = "\n".join(plan_down(rec, open_remote(rec.target)).lines())
    lost = _section(text, "will be lost", "\nkept:")
    kept = _section(text, "\nkept:", "\nbilling:")
    assert "step_3.pt" not in lost, text  # pulled
    if way == "in":
        assert "file .step_4.pt.tmp the job wrote in the checkpoint dir (4 B)" in lost, text
        assert "not removed" not in text, text
    else:
        assert f"the checkpoint dir {named} -> {real} on the box (outside the run dir: not " in (
            kept
        ), text
        profiles = tmp_path / "profiles"
        profiles.mkdir()
        monkeypatch.setenv("RGT_PROFILES_DIR", str(profiles))
        _pod_profile(str(profiles), str(data), network_volume=False)
        pod = dataclasses.replace(rec, profile="pod")
        pod_text = "\n".join(plan_down(pod, open_remote(pod.target)).lines())
        line = f"the checkpoint dir {named} -> {real} (outside the run dir, not removed): "
        assert line + "the provider deletes it at the meter-stop" in _section(
            pod_text, "will be lost", "\nkept:"
        ), pod_text

    Registry().put(rec)
    shown: List[str] = []
    down(rec, yes=True, interactive=False, ask=_never, show=shown.append)
    assert not os.path.lexists(run_dir)
    left = sorted(os.listdir(real)) if os.path.isdir(real) else []
    assert left == ([".step_4.pt.tmp", "step_3.pt"] if way == "out" else []), left
