"""A FIFO, a socket or a symlink where the job leaves its results never stops the run's end.

The completion seal reads every file of a declared output directory and of the checkpoint
dir. Opening a FIFO that has no writer waits forever: a job that left one in ``out/`` (a
named pipe of a data loader, say) kept its run from ever reaching SUCCEEDED, and DONE.json
was never written. Each such entry is left out with an event naming it and what it is; the
plain files beside it are sealed as usual; a symlink inside a directory output is not
followed (as in a pod and in the checkpoint dir).

A real agent, a real job that leaves a real FIFO and a real Unix socket, a real file://
store; the wait for SUCCEEDED is the bound (a hang fails it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from typing import Any, Dict

import pytest

from controller.cli import main as rgt_main
from controller.registry import Registry, RunRecord
from controller.target import Target
from tests.conftest import Cli, agent_exe

JOB = r"""
import os, socket
ck = os.environ["RGT_CKPT_DIR"]
os.makedirs("out", exist_ok=True)
with open("out/table.csv", "w") as f:
    f.write("a,b\n")
os.mkfifo("out/pipe")
s = socket.socket(socket.AF_UNIX)
s.bind("out/sock")  # the socket file stays once the job is gone
s.close()
os.symlink("table.csv", "out/link")
os.makedirs(os.path.join(ck, "eval"), exist_ok=True)
with open(os.path.join(ck, "result.txt"), "w") as f:
    f.write("accuracy 0.93\n")
os.mkfifo(os.path.join(ck, "toppipe"))
os.mkfifo(os.path.join(ck, "eval", "pipe"))
print("finished", flush=True)
"""


def _done(root: str, run: str) -> Dict[str, Any]:
    with open(os.path.join(root, run, "DONE.json")) as f:
        doc: Dict[str, Any] = json.load(f)
    return doc


def test_a_fifo_a_socket_and_a_symlink_in_the_outputs_are_left_out_and_the_run_ends(
    cli: Cli, tmp_path: Any
) -> None:
    root = str(tmp_path / "durable")
    os.makedirs(root)
    work = tmp_path / "work"
    work.mkdir()
    (work / "job.py").write_text(JOB)
    (work / "job.toml").write_text(
        f'name = "odd"\ncommand = {json.dumps([sys.executable, "job.py"])}\n'
        f'outputs = ["out/"]\nstore = "file://{root}"\n'
    )
    ckpt = str(tmp_path / "ckpt")
    cli("start", "job.toml", "--ckpt-dir", ckpt, check=True, cwd=str(work))
    cli.wait_state("odd", "SUCCEEDED", timeout=60)

    done = _done(root, "odd")
    sealed = {(e.get("root"), e["path"]) for e in done["files"]}
    assert (None, "out/table.csv") in sealed and ("ckpt", "result.txt") in sealed, sealed
    for odd in ("out/pipe", "out/sock", "out/link"):
        assert (None, odd) not in sealed, sealed
    assert not [p for r, p in sealed if r == "ckpt" and "pipe" in p], sealed
    with open(os.path.join(root, "odd", "outputs", "out", "table.csv")) as f:
        assert f.read() == "a,b\n"

    events = cli.events("odd")
    refused = {e["path"]: e for e in events if e["kind"] == "output_refused"}
    assert set(refused) == {"out/pipe", "out/sock", "out/link"}, events
    assert "a FIFO" in refused["out/pipe"]["reason"], refused
    assert "a socket" in refused["out/sock"]["reason"], refused
    assert "symlink" in refused["out/link"]["reason"], refused
    assert all(e["class"] == "usage" for e in refused.values())
    left = {e["path"]: e for e in events if e["kind"] == "result_left_out"}
    assert set(left) == {"toppipe", "eval/pipe"}, events


def test_rgt_pull_says_which_results_were_left_out_at_completion(
    cli: Cli, tmp_path: Any, controller_env: Dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """A file the job left that the completion seal could not take (a FIFO, a socket, a
    symlink) is not in the pull: `rgt pull` must say so, file by file, as it says a missing
    declared output, rather than a bare "pulled and verified" while the file stays on the
    box (and goes with it)."""
    root = str(tmp_path / "durable")
    os.makedirs(root)
    work = tmp_path / "work"
    work.mkdir()
    (work / "job.py").write_text(JOB)
    (work / "job.toml").write_text(
        f'name = "odd2"\ncommand = {json.dumps([sys.executable, "job.py"])}\n'
        f'outputs = ["out/"]\nstore = "file://{root}"\n'
    )
    cli("start", "job.toml", "--ckpt-dir", str(tmp_path / "ckpt"), check=True, cwd=str(work))
    cli.wait_state("odd2", "SUCCEEDED", timeout=60)
    Registry().put(
        RunRecord("odd2", Target("local"), profile="local", store=f"file://{root}",
                  box_home=cli.home, agent=agent_exe())
    )  # fmt: skip
    capsys.readouterr()
    assert rgt_main(["pull", "odd2", "--to", str(tmp_path / "dest"), "--from", "store"]) == 0
    said = capsys.readouterr().out
    warned = [line for line in said.splitlines() if line.strip().startswith("warning:")]
    for name, what in (
        ("outputs/out/pipe", "FIFO"),
        ("outputs/out/sock", "socket"),
        ("outputs/out/link", "symlink"),
        ("checkpoints/toppipe", "FIFO"),
        ("checkpoints/eval/pipe", ""),
    ):
        assert [line for line in warned if name in line and what in line], (name, said)
    assert all("not sealed" in line for line in warned), said


LIGHTNING_JOB = r"""
import os
import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
ck = os.environ["RGT_CKPT_DIR"]
mc = ModelCheckpoint(dirpath=ck, every_n_train_steps=2, save_top_k=-1, save_last="link")
trainer = pl.Trainer(
    max_steps=4, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
    enable_model_summary=False, callbacks=[mc],
)
trainer.fit(BoringModel())
os.makedirs("elsewhere", exist_ok=True)
os.link(os.path.join(ck, "epoch=0-step=2.ckpt"), os.path.join("elsewhere", "kept.ckpt"))
os.symlink(os.path.abspath("elsewhere/kept.ckpt"), os.path.join(ck, "stray.ckpt"))
print("finished", os.readlink(os.path.join(ck, "last.ckpt")), flush=True)
"""


def test_lightnings_last_link_is_no_warning_at_pull_a_link_out_of_the_dir_still_is(
    cli: Cli, tmp_path: Any, controller_env: Dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """ModelCheckpoint(save_last="link") makes last.ckpt a symlink to its newest checkpoint in
    the checkpoint dir, which is sealed under its own name: nothing is lost, yet every pull
    warned that last.ckpt was not sealed (and the sealer wrote a usage event). Now such a
    link is said once at info level (``ckpt_link``), not in DONE.json's ``left_out``; a link
    out of the checkpoint dir (stray.ckpt), whose bytes are never sealed, still warns."""
    if importlib.util.find_spec("lightning") is None:
        pytest.skip("lightning (pip install -e '.[train,frameworks]')")
    root = str(tmp_path / "durable")
    os.makedirs(root)
    work = tmp_path / "work"
    work.mkdir()
    (work / "job.py").write_text(LIGHTNING_JOB)
    (work / "job.toml").write_text(
        f'name = "lnk"\ncommand = {json.dumps([sys.executable, "job.py"])}\n'
        f'store = "file://{root}"\n'
    )
    cli("start", "job.toml", "--ckpt-dir", str(tmp_path / "ckpt"), check=True, cwd=str(work))
    cli.wait_state("lnk", "SUCCEEDED", timeout=180)
    done = _done(root, "lnk")
    assert [x["path"] for x in done["left_out"]] == ["checkpoints/stray.ckpt"], done["left_out"]
    events = cli.events("lnk")
    said = [e for e in events if "last.ckpt" in json.dumps(e)]
    assert [(e["kind"], e["class"]) for e in said] == [("ckpt_link", None)], said
    # Said when first seen: while the job ran, last.ckpt may still have led to step 2.
    assert said[0]["target"] in ("epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"), said
    assert f"to {said[0]['target']!r} in it" in said[0]["reason"], said
    stray = [e for e in events if "stray.ckpt" in json.dumps(e)]
    assert {(e["kind"], e["class"]) for e in stray} >= {("result_left_out", "usage")}, stray
    Registry().put(
        RunRecord("lnk", Target("local"), profile="local", store=f"file://{root}",
                  box_home=cli.home, agent=agent_exe())
    )  # fmt: skip
    capsys.readouterr()
    dest = tmp_path / "dest"
    assert rgt_main(["pull", "lnk", "--to", str(dest), "--from", "store"]) == 0
    out = capsys.readouterr().out
    warned = [line for line in out.splitlines() if line.strip().startswith("warning:")]
    assert [line for line in warned if "stray.ckpt" in line], out
    assert not [line for line in warned if "last.ckpt" in line], out
    assert (dest / "checkpoints" / "epoch=0-step=4.ckpt").is_file(), out
