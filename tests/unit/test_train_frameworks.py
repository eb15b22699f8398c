"""The framework-neutral parts of the framework callbacks, without the frameworks: publishing a
directory as a complete rgt checkpoint (onbox/train/accelerate.py), the save/load cycle of
``AcceleratorCheckpointer`` against a fake ``Accelerator`` (the object the user hands in: the
seam), the ImportError a missing framework gives, and the arguments refused when a checkpointer
is made."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Dict, List

import pytest

from onbox.common.errors import CheckpointError
from onbox.train import Checkpointer, ckptdir
from onbox.train.accelerate import (
    AcceleratorCheckpointer,
    complete_checkpoints,
    publish_dir,
    verify_dir,
)
from tests.conftest import ROOT


def _write(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def test_publish_dir_marks_every_file_then_renames(tmp_path: Any) -> None:
    root = str(tmp_path)
    tmp = os.path.join(root, ".step_7.rgt-tmp.test")
    _write(os.path.join(tmp, "model.safetensors"), b"w" * 1000)
    _write(os.path.join(tmp, "sub", "optimizer.bin"), b"o" * 10)
    final = publish_dir(tmp, os.path.join(root, "step_7"), 7, "test")
    assert not os.path.exists(tmp) and os.path.isdir(final)
    with open(os.path.join(final, ckptdir.MARKER)) as f:
        marker = json.load(f)
    assert marker["step"] == 7 and marker["format"] == "test"
    assert sorted(marker["files"]) == ["model.safetensors", "sub/optimizer.bin"]
    assert marker["files"]["model.safetensors"]["size"] == 1000
    assert verify_dir(final)["step"] == 7
    assert ckptdir.complete(root) == [(7, final)]  # what the sealer and the plain API see
    assert complete_checkpoints(root, fmt="test") == [(7, final)]
    assert complete_checkpoints(root) == []  # not an accelerate checkpoint

    # The same step published again replaces it whole.
    _write(os.path.join(tmp, "model.safetensors"), b"v" * 5)
    publish_dir(tmp, final, 7, "test")
    assert verify_dir(final)["files"]["model.safetensors"]["size"] == 5
    assert not os.path.exists(os.path.join(final, "sub"))
    assert [n for n in os.listdir(root) if n.startswith(".")] == []


def test_verify_dir_names_the_altered_file(tmp_path: Any) -> None:
    tmp = os.path.join(str(tmp_path), ".step_3.rgt-tmp.test")
    _write(os.path.join(tmp, "a.bin"), b"abc")
    final = publish_dir(tmp, os.path.join(str(tmp_path), "step_3"), 3, "test")
    _write(os.path.join(final, "a.bin"), b"abd")
    with pytest.raises(CheckpointError, match="a.bin"):
        verify_dir(final)
    os.unlink(os.path.join(final, "a.bin"))
    with pytest.raises(CheckpointError, match="missing"):
        verify_dir(final)
    os.unlink(os.path.join(final, ckptdir.MARKER))
    with pytest.raises(CheckpointError, match="not a complete"):
        verify_dir(final)


class FakeProjectConfiguration:
    automatic_checkpoint_naming = False


class FakeAccelerator:
    """What AcceleratorCheckpointer uses of an Accelerator: one process; save_state writes a
    file holding the current value, load_state reads it back."""

    def __init__(self) -> None:
        self.value = b"0"
        self.is_main_process = True
        self.num_processes = 1
        self.device = "cpu"
        self.project_configuration = FakeProjectConfiguration()
        self.loaded: List[str] = []

    def wait_for_everyone(self) -> None:
        pass

    def save_state(self, output_dir: str, safe_serialization: bool = True) -> None:
        _write(os.path.join(output_dir, "model.safetensors"), self.value)
        _write(os.path.join(output_dir, "random_states_0.pkl"), b"rng")

    def load_state(self, input_dir: str) -> None:
        with open(os.path.join(input_dir, "model.safetensors"), "rb") as f:
            self.value = f.read()
        self.loaded.append(os.path.basename(input_dir))


@pytest.fixture
def job_env(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Dict[str, str]:
    """The environment the agent gives a job with trigger = "file" (no RGT_RUN: no handler
    for SIGTERM is installed in the test process)."""
    run_dir = str(tmp_path / "run")
    ckpt = os.path.join(run_dir, "ckpt")
    os.makedirs(ckpt)
    for k in ("RGT_RUN", "RGT_RESUME_FROM", "RGT_ATTEMPT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("RGT_RUN_DIR", run_dir)
    monkeypatch.setenv("RGT_CKPT_DIR", ckpt)
    monkeypatch.setenv("RGT_CKPT_TRIGGER", "file")
    return {"run_dir": run_dir, "ckpt": ckpt}


def test_fake_accelerator_checkpointer_saves_on_request_and_resumes(
    job_env: Dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    acc = FakeAccelerator()
    ck = AcceleratorCheckpointer(acc, keep=2)
    assert ck.load() == 0 and acc.loaded == []
    assert not ck.should_checkpoint(1)
    request = os.path.join(job_env["run_dir"], "checkpoint.request")
    _write(request, b'{"reason": "interval"}')
    assert ck.should_checkpoint(2)
    for step in (2, 4, 6):
        acc.value = str(step).encode()
        ck.save(step)
    assert not os.path.exists(request)  # answered by the save
    assert [s for s, _ in complete_checkpoints(job_env["ckpt"])] == [6, 4]  # keep=2
    with open(os.path.join(job_env["run_dir"], "progress.json")) as f:
        assert json.load(f)["step"] == 6

    acc2 = FakeAccelerator()
    assert AcceleratorCheckpointer(acc2).load() == 6 and acc2.value == b"6"
    # A damaged newest checkpoint is skipped for the one before it...
    _write(os.path.join(job_env["ckpt"], "step_6", "model.safetensors"), b"x")
    acc3 = FakeAccelerator()
    assert AcceleratorCheckpointer(acc3).load() == 4 and acc3.loaded == ["step_4"]
    # ...but one named by RGT_RESUME_FROM must verify.
    monkeypatch.setenv("RGT_RESUME_FROM", os.path.join(job_env["ckpt"], "step_6"))
    with pytest.raises(CheckpointError, match="model.safetensors"):
        AcceleratorCheckpointer(FakeAccelerator()).load()


def test_latest_names_the_checkpoint_load_uses(
    job_env: Dict[str, str], tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """latest() took the newest name: a link out of the dir, or a cut-off newest, that load
    skips. It now applies load's rule (sizes, not sha256) and names what load then loads."""
    ckpt = job_env["ckpt"]
    ck = AcceleratorCheckpointer(FakeAccelerator(), keep=5)
    for step in (2, 4, 6):
        ck.save(step)
    other = AcceleratorCheckpointer(FakeAccelerator(), str(tmp_path / "elsewhere"))
    os.symlink(other.save(9), os.path.join(ckpt, "step_9"))  # out of the dir: never sealed
    _write(os.path.join(ckpt, "step_6", "model.safetensors"), b"cut")  # another size
    acc = FakeAccelerator()
    fresh = AcceleratorCheckpointer(acc)
    assert fresh.latest() == os.path.join(ckpt, "step_4")
    assert fresh.load() == 4 and acc.loaded == ["step_4"]
    monkeypatch.setenv("RGT_RESUME_FROM", os.path.join(ckpt, "step_2", "model.safetensors"))
    assert fresh.latest() == os.path.join(ckpt, "step_2")
    assert fresh.load() == 2 and acc.loaded[-1] == "step_2"


def test_fake_accelerator_checkpointer_exits_143_after_a_preemption_save(
    job_env: Dict[str, str],
) -> None:
    acc = FakeAccelerator()
    ck = AcceleratorCheckpointer(acc)
    _write(os.path.join(job_env["run_dir"], "checkpoint.request"), b'{"reason": "preemption"}')
    assert ck.should_checkpoint(9) and ck.preempted
    with pytest.raises(SystemExit) as e:
        ck.save(9)
    assert e.value.code == 143
    assert [s for s, _ in complete_checkpoints(job_env["ckpt"])] == [9]


def test_fake_accelerator_checkpointer_refuses_automatic_naming() -> None:
    acc = FakeAccelerator()
    acc.project_configuration.automatic_checkpoint_naming = True
    with pytest.raises(ValueError, match="automatic_checkpoint_naming"):
        AcceleratorCheckpointer(acc)


@pytest.mark.parametrize(
    "module, blocked, extra",
    [
        ("onbox.train.hf", "transformers", "transformers"),
        ("onbox.train.lightning", "lightning", "lightning"),
    ],
)
def test_a_missing_framework_names_the_extra(module: str, blocked: str, extra: str) -> None:
    code = f"import sys; sys.modules[{blocked!r}] = None\nimport {module}"
    p = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert p.returncode != 0
    assert f"pip install 'remote-gpu-trainer[{extra}]'" in p.stderr, p.stderr[-2000:]


BAD_KEEPS: List[Any] = [None, 0, -1, 1.5, "3", True]


@pytest.mark.parametrize("keep", BAD_KEEPS)
def test_a_bad_keep_is_refused_when_the_checkpointer_is_made(job_env: Any, keep: Any) -> None:
    """At once, not after the first save was written (rotation then raised a TypeError, in
    async mode a failed background write; 0 or less silently kept one)."""
    with pytest.raises(ValueError, match=r"keep must be a whole number of checkpoints, 1 or more"):
        Checkpointer(keep=keep, handle_signals=False)
    with pytest.raises(ValueError, match=r"keep must be a whole number of checkpoints, 1 or more"):
        AcceleratorCheckpointer(FakeAccelerator(), keep=keep, handle_signals=False)
