"""The training API's checkpoints under the faults a box meets: a preemption while a background
write is in flight, rotation next to a damaged checkpoint, a SIGKILL in the middle of rotation
or of replacing a checkpoint of the same step. Real processes, real signals, real files.

What a user relies on: the checkpoint a preemption ends with holds the newest state; rotation
never deletes the checkpoint it has just written; a directory under a final name is whole
(every file its marker names is there) whenever the process is killed; a kill never takes away
the only copy of a step.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap
from typing import Any, List

import pytest

from onbox.train import Checkpointer, ckptdir
from tests.conftest import ROOT, require

_MISSING = [m for m in ("torch", "numpy") if importlib.util.find_spec(m) is None]
if not _MISSING:
    import torch


@pytest.fixture(autouse=True)
def _needs_torch() -> None:
    require(not _MISSING, f"{', '.join(_MISSING)} (pip install -e '.[train]' torch==2.13.0)")


def _run(script: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    code = f"import sys; sys.path.insert(0, {ROOT!r})\n" + textwrap.dedent(script)
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=180,
        env=dict(os.environ, **env),
    )


def test_a_preemption_during_a_background_write_ends_with_the_newest_state(tmp_path: Any) -> None:
    """SIGTERM arrives while step 1's write is in flight; the loop goes on to step 2, where
    should_checkpoint says yes and save(2) is called: the process exits 143 with step 2 on
    disk, whole, holding step 2's weights (it exited once step 1's write landed, and step 2,
    the state the loop reached, was never written)."""
    d = str(tmp_path / "ck")
    p = _run(
        """
        import os, signal, torch
        from onbox.train import Checkpointer
        m = torch.nn.Linear(1, 1)
        m.big = torch.nn.Parameter(torch.zeros(16 << 20))  # 64 MiB: the write takes a while
        ck = Checkpointer(sys.argv[1], async_save=True, model=m)
        ck.save(1)  # in flight
        os.kill(os.getpid(), signal.SIGTERM)  # the preemption, while it is
        step = 1
        while step < 50:
            step += 1
            with torch.no_grad():
                m.big.fill_(step)
            if ck.should_checkpoint(step):
                print("saving", step, flush=True)
                ck.save(step)
        print("not ended", flush=True)
        """,
        d,
        RGT_RUN="t",
    )
    assert p.returncode == 143, p.stdout + p.stderr[-2000:]
    assert p.stdout.split() == ["saving", "2"], p.stdout
    ckptdir.verify(os.path.join(d, "step_2"))
    m = torch.nn.Linear(1, 1)
    m.big = torch.nn.Parameter(torch.zeros(16 << 20))
    assert Checkpointer(d, handle_signals=False, model=m).load() == 2
    assert bool((m.big == 2).all())


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_rotation_never_deletes_the_checkpoint_it_has_just_written(
    tmp_path: Any, mode: str
) -> None:
    """The newest local checkpoint (step 300) is damaged: load skips it for step 100, as the
    README says. With keep=1, the save at step 110 that follows must survive its own rotation
    (it was deleted at once: step 300 is the higher step, so it alone was kept, and the run had
    no loadable checkpoint left)."""
    d = str(tmp_path / "ck")
    model = torch.nn.Linear(4, 4)
    first = Checkpointer(d, keep=5, handle_signals=False, model=model)
    first.save(100)
    first.save(300)
    target = os.path.join(d, "step_300", ckptdir.STATE)
    with open(target, "r+b") as f:
        f.seek(os.path.getsize(target) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x01]))
    ck = Checkpointer(d, keep=1, async_save=mode == "async", handle_signals=False, model=model)
    assert ck.load() == 100
    ck.save(110)
    ck.close()
    ckptdir.verify(os.path.join(d, "step_110"))
    assert Checkpointer(d, handle_signals=False, model=model).load() == 110


def test_a_checkpoint_linked_in_from_outside_the_dir_is_not_resumed(tmp_path: Any) -> None:
    """``step_5`` in the checkpoint dir is a symlink to a directory elsewhere: the sealer never
    follows it, so the store never holds step 5, yet load resumed from it. Now it is skipped,
    said on stderr, for the newest one in the dir."""
    d, elsewhere = str(tmp_path / "ck"), str(tmp_path / "elsewhere")
    model = torch.nn.Linear(4, 4)
    Checkpointer(d, handle_signals=False, model=model).save(1)
    Checkpointer(elsewhere, handle_signals=False, model=model).save(5)
    os.symlink(os.path.join(elsewhere, "step_5"), os.path.join(d, "step_5"))
    p = _run(
        "from onbox.train import Checkpointer\n"
        "import torch\n"
        "ck = Checkpointer(sys.argv[1], handle_signals=False, model=torch.nn.Linear(4, 4))\n"
        "print('loaded', ck.load())\n",
        d,
    )
    assert p.returncode == 0, p.stdout + p.stderr[-2000:]
    assert p.stdout.split() == ["loaded", "1"], p.stdout + p.stderr[-2000:]
    assert "skipping checkpoint step 5:" in p.stderr and "outside" in p.stderr, p.stderr


def test_rotation_counts_a_link_as_its_target_and_never_leaves_one_dangling(
    tmp_path: Any,
) -> None:
    """A user's ``step_N`` links in the checkpoint dir: ``step_9`` to ``step_1`` (resume loads
    step 1 through it), ``step_0`` to ``step_3``, ``best`` to ``step_2``, ``step_8`` to a
    checkpoint elsewhere. Rotation counted each step_N link as a checkpoint of its own: with
    keep=2 it deleted step_3, step_2 and step_1, leaving step_9 and best dangling and one real
    checkpoint, and unlinked step_0 though step_3 was kept. Now a link counts as its target
    (its newest name ranks it), a checkpoint another link in the dir names is not deleted, and
    one outside the dir is neither counted nor touched."""
    d, elsewhere = str(tmp_path / "ck"), str(tmp_path / "elsewhere")
    model = torch.nn.Linear(4, 4)
    Checkpointer(elsewhere, handle_signals=False, model=model).save(8)
    ck = Checkpointer(d, keep=9, handle_signals=False, model=model)
    for step in (1, 2, 3):
        ck.save(step)
    os.symlink("step_1", os.path.join(d, "step_9"))
    os.symlink("step_3", os.path.join(d, "step_0"))
    os.symlink("step_2", os.path.join(d, "best"))
    os.symlink(os.path.join(elsewhere, "step_8"), os.path.join(d, "step_8"))
    ck.keep = 2
    ck.save(4)
    ck.close()
    # kept: step_9 (= step_1, the newest name), step_4; step_3 and its step_0 link are the
    # third checkpoint: rotated away together; step_2 stays while best names it.
    assert sorted(os.listdir(d)) == ["best", "step_1", "step_2", "step_4", "step_8", "step_9"]
    for name in ("step_9", "best", "step_1", "step_2", "step_4", "step_8"):
        assert os.path.exists(os.path.join(d, name)), name  # no link left dangling
    assert os.readlink(os.path.join(d, "step_9")) == "step_1"
    ckptdir.verify(os.path.join(elsewhere, "step_8"))
    p = _run(
        "from onbox.train import Checkpointer\n"
        "import torch\n"
        "ck = Checkpointer(sys.argv[1], handle_signals=False, model=torch.nn.Linear(4, 4))\n"
        "print('loaded', ck.load())\n",
        d,
    )
    assert p.stdout.split() == ["loaded", "1"], p.stdout + p.stderr[-2000:]


def _whole_under_final_names(d: str, fmt: Any = ckptdir.FORMAT) -> None:
    """Every checkpoint under a final name verifies (as ``fmt``), and the agent's sealer, which
    takes a marked directory as complete and seals the files it finds, sees all of them."""
    from onbox.sealing.discovery import dir_candidate

    for name in os.listdir(d):
        if name.startswith("."):
            continue
        path = os.path.join(d, name)
        marker = ckptdir.verify(path, fmt)
        cand = dir_candidate(d, name, path)
        assert cand is not None
        assert sorted(cand.files) == sorted(
            f"{name}/{f}" for f in [*marker["files"], ckptdir.MARKER]
        )


def test_a_sigkill_in_the_middle_of_rotation_leaves_no_partial_checkpoint(tmp_path: Any) -> None:
    """The process is SIGKILLed right after rotation deleted the first file of step 1 (a
    preemption's grace ran out): what is left under a final name is whole. step_1 stayed
    with its marker and without its state, which load skipped but the sealer would seal
    as a complete checkpoint of step 1 holding nothing."""
    d = str(tmp_path / "ck")
    p = _run(
        """
        import os, signal, torch
        from onbox.train import Checkpointer
        ck = Checkpointer(sys.argv[1], keep=1, handle_signals=False, model=torch.nn.Linear(4, 4))
        ck.save(1)
        real = os.unlink
        def unlink(*a, **k):  # rotation's first file deleted, then the end
            real(*a, **k)
            os.kill(os.getpid(), signal.SIGKILL)
        os.unlink = unlink
        ck.save(2)
        print("not killed")
        """,
        d,
    )
    assert p.returncode == -9, p.stdout + p.stderr[-2000:]
    _whole_under_final_names(d)
    assert [s for s, _ in ckptdir.complete(d)] == [2]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_sigkill_while_a_step_is_saved_again_never_loses_that_step(
    tmp_path: Any, mode: str
) -> None:
    """Step 5 is saved again (a resumed run saving at the step it resumed from); the process
    is SIGKILLed between moving the old step_5 aside and putting the new one in place. The
    next run finds step 5 (both copies sat under hidden names: load started from 0, and an
    async Checkpointer's start deleted them both), and no hidden leftovers stay behind."""
    d = str(tmp_path / "ck")
    p = _run(
        """
        import os, signal, torch
        from onbox.train import Checkpointer
        ck = Checkpointer(sys.argv[1], handle_signals=False, model=torch.nn.Linear(4, 4))
        ck.save(5)
        real = os.rename
        def rename(src, dst, *a, **k):  # the old step_5 moved aside: the end
            real(src, dst, *a, **k)
            if ".rgt-old." in str(dst):
                os.kill(os.getpid(), signal.SIGKILL)
        os.rename = rename
        ck.save(5)
        print("not killed")
        """,
        d,
    )
    assert p.returncode == -9, p.stdout + p.stderr[-2000:]
    assert "step_5" not in os.listdir(d)  # the moment the test is about
    ck = Checkpointer(
        d, async_save=mode == "async", handle_signals=False, model=torch.nn.Linear(4, 4)
    )
    assert ck.load() == 5
    ck.close()
    assert os.listdir(d) == ["step_5"]
    _whole_under_final_names(d)


def test_a_half_deleted_replaced_copy_never_comes_back_under_its_name(tmp_path: Any) -> None:
    """Step 5 is saved again and the process is SIGKILLed once the first file (not the
    marker) of the copy it replaced was deleted. Before anything tidies up, rotation removes
    step_5 (step 6 is newer, keep=1: what the writer of a live process does). The next start
    must not put that half-deleted copy back under step_5: it was taken as a replacement
    killed before its new copy got there, and came back marked, its state gone."""
    d = str(tmp_path / "ck")
    script = _script(
        """
        import os, signal, torch
        from onbox.train import Checkpointer
        ck = Checkpointer(sys.argv[1], handle_signals=False, model=torch.nn.Linear(4, 4))
        ck.save(5)
        """,
        _KILL_IN_ROTATION,
        """
        ck.save(5)
        print("not killed")
        """,
    )
    p = _run(script, d)
    assert p.returncode == -9, p.stdout + p.stderr[-2000:]
    state = {"format": ckptdir.FORMAT, "step": 6, "objects": {}, "rng": {}, "extra": {}}
    six, _ = ckptdir.write(d, 6, state)
    ckptdir.prune(d, 1, protect=six)
    ck = Checkpointer(d, handle_signals=False, model=torch.nn.Linear(4, 4))  # the next start
    _whole_under_final_names(d)
    assert os.listdir(d) == ["step_6"]
    ck.close()


# ---- the framework adapters (onbox/train/accelerate.py, lightning.py) rotate their own kinds


def _script(*parts: str) -> str:
    return "".join(textwrap.dedent(p) for p in parts)


def _need(*modules: str) -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    require(not missing, f"{', '.join(missing)} (pip install -e '.[train,frameworks]')")


_ACCELERATE = """
    import os, signal, torch
    from accelerate import Accelerator
    from onbox.train.accelerate import AcceleratorCheckpointer
    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 4)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    d = sys.argv[1]
    def checkpointer(keep):
        return AcceleratorCheckpointer(acc, d, keep=keep, handle_signals=False)
"""

_LIGHTNING = """
    import os, signal, torch
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.plugins.io import TorchCheckpointIO
    from onbox.train.lightning import RgtCheckpoint, resume_path
    d = sys.argv[1]

    class DirIO(TorchCheckpointIO):  # the layout of a sharded strategy: a directory of files
        def save_checkpoint(self, checkpoint, path, storage_options=None):
            os.makedirs(path)
            torch.save(checkpoint.pop("state_dict"), os.path.join(path, "model.pt"))
            torch.save(checkpoint, os.path.join(path, "rest.pt"))

    def fit(steps, keep, plugins=()):
        trainer = pl.Trainer(
            max_steps=steps, accelerator="cpu", devices=1, logger=False, plugins=list(plugins),
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            callbacks=[RgtCheckpoint(d, every_n_steps=1, keep=keep, handle_signals=False)],
        )
        trainer.fit(BoringModel(), ckpt_path=resume_path(d))
"""

# Rotation's first file deleted (not the marker: the directory must stay marked), then the end.
_KILL_IN_ROTATION = """
    real = os.unlink
    def unlink(name, *a, **k):
        real(name, *a, **k)
        if os.path.basename(name) != ".rgt-complete":
            os.kill(os.getpid(), signal.SIGKILL)
    os.unlink = unlink
"""


def test_accelerate_rotation_never_deletes_the_checkpoint_it_has_just_written(
    tmp_path: Any,
) -> None:
    """As for Checkpointer: the damaged step 300 is skipped for step 100, and with keep=1 the
    save at step 110 must survive its own rotation (it was deleted at once, and step 100
    with it: the run had no loadable checkpoint left)."""
    _need("accelerate")
    d = str(tmp_path / "ck")
    p = _run(
        _script(
            _ACCELERATE,
            """
        first = checkpointer(5)
        first.save(100)
        first.save(300)
        with open(os.path.join(d, "step_300", "model.safetensors"), "r+b") as f:
            f.write(b"X")
        ck = checkpointer(1)
        print("loaded", ck.load(), flush=True)
        ck.save(110)
        print("then", checkpointer(1).load(), flush=True)
        """,
        ),
        d,
    )
    assert p.returncode == 0, p.stdout + p.stderr[-2000:]
    assert p.stdout.split() == ["loaded", "100", "then", "110"], p.stdout + p.stderr[-2000:]
    ckptdir.verify(os.path.join(d, "step_110"), fmt="accelerate")


def test_accelerate_a_sigkill_in_the_middle_of_rotation_leaves_no_partial_checkpoint(
    tmp_path: Any,
) -> None:
    """SIGKILL right after rotation deleted the first file of step 1: step_1 stayed marked
    with a file gone, which the sealer would seal as a complete checkpoint of step 1."""
    _need("accelerate")
    d = str(tmp_path / "ck")
    p = _run(
        _script(
            _ACCELERATE,
            "ck = checkpointer(1)\nck.save(1)\n",
            _KILL_IN_ROTATION,
            "ck.save(2)\nprint('not killed')\n",
        ),
        d,
    )
    assert p.returncode == -9, p.stdout + p.stderr[-2000:]
    _whole_under_final_names(d, fmt="accelerate")
    assert [s for s, _ in ckptdir.complete(d)] == [2]


def test_lightning_rotation_never_deletes_the_checkpoint_it_has_just_written(
    tmp_path: Any,
) -> None:
    """A run left step_1..3.ckpt; step 3 is damaged, and the agent resumes the next run from
    step 1 (RGT_RESUME_FROM). With keep=1, its save at step 2 must survive its own rotation
    (it was deleted at once: step 3 is the higher step, so it alone was kept)."""
    _need("lightning")
    d = str(tmp_path / "ck")
    first = _run(_script(_LIGHTNING, "fit(3, keep=5)\n"), d)
    assert first.returncode == 0, first.stdout + first.stderr[-2000:]
    assert sorted(os.listdir(d)) == ["step_1.ckpt", "step_2.ckpt", "step_3.ckpt"]
    os.truncate(os.path.join(d, "step_3.ckpt"), 100)
    p = _run(
        _script(_LIGHTNING, "fit(2, keep=1)\n"), d, RGT_RESUME_FROM=os.path.join(d, "step_1.ckpt")
    )
    assert p.returncode == 0, p.stdout + p.stderr[-2000:]
    assert "step_2.ckpt" in os.listdir(d)
    state = torch.load(os.path.join(d, "step_2.ckpt"), map_location="cpu", weights_only=False)
    assert state["global_step"] == 2


def test_lightning_resumes_from_the_newest_checkpoint_that_verifies(tmp_path: Any) -> None:
    """A run left step_1..3.ckpt and step 3 was cut off (a disk fault, a copy gone wrong):
    resume_path named it all the same, and the resumed fit crashed on it. Now step 3 is
    skipped, said on stderr, and the run resumes from step 2 (as Accelerate's does)."""
    _need("lightning")
    d = str(tmp_path / "ck")
    first = _run(_script(_LIGHTNING, "fit(3, keep=5)\n"), d)
    assert first.returncode == 0, first.stdout + first.stderr[-2000:]
    os.truncate(os.path.join(d, "step_3.ckpt"), 4096)
    p = _run(_script(_LIGHTNING, "print('from', resume_path(d), flush=True)\nfit(4, keep=5)\n"), d)
    assert p.returncode == 0, p.stdout + p.stderr[-2000:]
    assert f"from {os.path.join(d, 'step_2.ckpt')}" in p.stdout, p.stdout
    assert "rgt: skipping checkpoint step 3:" in p.stderr, p.stderr[-2000:]
    for step in (3, 4):  # written again from step 2's state
        state = torch.load(
            os.path.join(d, f"step_{step}.ckpt"), map_location="cpu", weights_only=False
        )
        assert state["global_step"] == step


def test_lightning_a_sigkill_in_the_middle_of_rotation_leaves_no_partial_checkpoint(
    tmp_path: Any,
) -> None:
    """The same with a strategy that saves a directory (step_N/ with rgt's marker): SIGKILL
    right after rotation deleted the first file of step_1/."""
    _need("lightning")
    d = str(tmp_path / "ck")
    p = _run(_script(_LIGHTNING, _KILL_IN_ROTATION, "fit(2, keep=1, plugins=[DirIO()])\n"), d)
    assert p.returncode == -9, p.stdout + p.stderr[-2000:]
    _whole_under_final_names(d, fmt="lightning")
    assert [s for s, _ in ckptdir.complete(d)] == [2]


def test_lightning_refuses_a_bad_keep_also_next_to_a_checkpointer(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Here, not among the unit tests: the on-box Python 3.9 stage has no Lightning."""
    for k in ("RGT_RUN", "RGT_RESUME_FROM", "RGT_ATTEMPT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("RGT_CKPT_DIR", str(tmp_path / "ckpt"))
    require(
        importlib.util.find_spec("lightning") is not None,
        "lightning (pip install -e '.[frameworks]')",
    )
    from onbox.train.lightning import RgtCheckpoint

    bad: List[Any] = [None, 0, -1, 1.5, "3", True]
    for keep in bad:
        with pytest.raises(ValueError, match=r"keep must be a whole number"):
            RgtCheckpoint(keep=keep, handle_signals=False)
        with pytest.raises(ValueError, match=r"keep must be a whole number"):
            RgtCheckpoint(keep=keep, checkpointer=Checkpointer(handle_signals=False))


_LINKED = """
    import os, shutil
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel
    from onbox.train.lightning import RgtCheckpoint, resume_path
    d, steps = sys.argv[1], int(sys.argv[2])

    class Start(Callback):
        def on_train_start(self, trainer, pl_module):
            print("start", trainer.global_step, flush=True)

    mc = ModelCheckpoint(dirpath=d, every_n_train_steps=2, save_top_k=-1, save_last="link")
    trainer = pl.Trainer(
        max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[RgtCheckpoint(d, every_n_steps=3, handle_signals=False), mc, Start()],
    )
    path = resume_path(d)
    print("from", path, flush=True)
    trainer.fit(BoringModel(), ckpt_path=path)
"""


def test_lightning_resumes_through_a_link_in_the_checkpoint_dir_never_one_out_of_it(
    tmp_path: Any,
) -> None:
    """Lightning's ModelCheckpoint(save_last="link") makes last.ckpt a symlink to its newest
    file, and a user may link step_N.ckpt to a checkpoint. The sealer follows no link
    (last.ckpt is left out, its target sealed under its own name); resume_path took a link out
    of the checkpoint dir, which the store never holds, as the newest checkpoint. A link to one
    in the dir (here through a checkpoint dir that is itself a link) is resumed."""
    _need("lightning")
    from onbox.sealing import discovery

    real = tmp_path / "ck"
    real.mkdir()
    d = str(tmp_path / "ck-link")
    os.symlink(real, d)
    first = _run(_script(_LINKED), d, "4")
    assert first.returncode == 0, first.stdout + first.stderr[-2000:]
    assert os.readlink(os.path.join(d, "last.ckpt")) == "epoch=0-step=4.ckpt"
    _, files, links = discovery.listing(d)
    assert [n for n, _ in links] == ["last.ckpt"]  # left out, never followed
    assert {"epoch=0-step=4.ckpt", "step_3.ckpt"} <= {n for n, _ in files}
    os.symlink("epoch=0-step=4.ckpt", os.path.join(d, "step_4.ckpt"))  # in the dir
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(os.path.join(d, "step_3.ckpt"), elsewhere / "step_9.ckpt")
    os.symlink(elsewhere / "step_9.ckpt", os.path.join(d, "step_9.ckpt"))  # out of it
    p = _run(_script(_LINKED), d, "6")
    assert p.returncode == 0, p.stdout + p.stderr[-2000:]
    assert f"from {os.path.join(d, 'step_4.ckpt')}\nstart 4\n" in p.stdout, p.stdout
    assert "rgt: skipping checkpoint step 9:" in p.stderr and "outside" in p.stderr, p.stderr
    state = torch.load(os.path.join(d, "step_6.ckpt"), map_location="cpu", weights_only=False)
    assert state["global_step"] == 6
