"""The framework callbacks (onbox/train/hf.py, train_lightning.py, train_accelerate.py) with the
real frameworks on the CPU, under the real agent.

Exactness: each example (examples/train_{hf,lightning,accelerate}.py) runs once uninterrupted
(a plain process) and once under ``rgt-agent`` with its job SIGKILLed mid-run after a checkpoint
exists; the resumed run must end with bitwise the same weights, optimizer state and RNG state
(the three sha256s the example prints last). Then the agent's ways of asking: the Transformers
callback saves when the agent's request file appears (and removes it), and saves then exits 143
when the job is stopped with SIGTERM.

The frameworks are optional extras: without one its tests skip, except under CI=true.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import sys
from typing import Any, Dict, List, Optional, Tuple

import pytest

from onbox.agent import procfs
from tests.beside import Beside
from tests.conftest import ROOT, Cli, require
from tests.polling import wait

EXAMPLES = os.path.join(ROOT, "examples")
_HASHES = re.compile(
    r"weights sha256 ([0-9a-f]{64}) optimizer sha256 ([0-9a-f]{64}) rng sha256 ([0-9a-f]{64})"
)


def _need(*modules: str) -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    require(
        not missing,
        f"{', '.join(missing)} (pip install -e '.[train,frameworks]')",
    )


def _hashes(output: str) -> Tuple[str, ...]:
    found = _HASHES.findall(output)
    assert found, output[-3000:]
    return tuple(found[-1])


def _plain_env() -> Dict[str, str]:
    """This environment without rgt's job variables (a run by hand)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RGT_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    return env


def _plain_run(example: str, args: List[str], out: str) -> Beside:
    """The uninterrupted run, started; its hashes are read from ``output`` once it is done."""
    argv = [sys.executable, example, *args, "--out", out]
    return Beside(argv, os.path.dirname(out), _plain_env())


def _steps(ckpt: str, pattern: str, marker: Optional[str] = None) -> List[int]:
    """Steps of the complete checkpoints in ``ckpt`` whose names match ``pattern``."""
    out = []
    try:
        names = os.listdir(ckpt)
    except FileNotFoundError:
        return []
    for n in names:
        m = re.fullmatch(pattern, n)
        if m and (marker is None or os.path.isfile(os.path.join(ckpt, n, marker))):
            out.append(int(m.group(1)))
    return sorted(out)


def _job(run_dir: str, attempt: int) -> procfs.Identity:
    """The job of ``attempt`` as the agent recorded it (the pid `status` shows)."""
    with open(os.path.join(run_dir, "attempts", f"{attempt:04d}", "job.json")) as f:
        rec = json.load(f)
    return procfs.Identity(int(rec["pid"]), int(rec["start_ticks"]))


def _killed_twice_resumes_exactly(
    cli: Cli,
    tmp_path: object,
    name: str,
    example: str,
    args: List[str],
    pattern: str,
    marker: Optional[str],
) -> str:
    """The reference hashes from a plain run; then the agent's run, its job SIGKILLed once a
    checkpoint exists and again once the resumed attempt wrote a newer one; the same hashes at
    the end. Returns the agent run's log."""
    # The uninterrupted run beside the agent's rather than before it (the kills come at
    # checkpoints, not at times, and --sleep paces the agent's job: its share of the CPU
    # changes no step), as in test_exact_plain.py.
    with _plain_run(example, args, os.path.join(str(tmp_path), "plain-ckpt")) as plain:
        logs = _agent_run(cli, name, example, args, pattern, marker)
        expected = _hashes(plain.output(timeout=240))
    assert _hashes(logs) == expected, logs[-3000:]
    return logs


def _agent_run(
    cli: Cli, name: str, example: str, args: List[str], pattern: str, marker: Optional[str]
) -> str:
    """The agent's run of ``example``, its job SIGKILLed in attempts 1 and 2 once each wrote a
    newer checkpoint; resumed and SUCCEEDED. Its log."""
    cli(
        "start",
        "--name",
        name,
        "--",
        sys.executable,
        example,
        *args,
        "--sleep",
        "0.1",
        check=True,
    )
    run_dir = os.path.join(cli.home, "runs", name)
    ckpt = os.path.join(run_dir, "ckpt")
    seen = 0
    for attempt in (1, 2):

        def newer(after: int = seen) -> bool:
            return any(s > after for s in _steps(ckpt, pattern, marker))

        wait(newer, 150, f"a checkpoint in attempt {attempt}")
        seen = max(_steps(ckpt, pattern, marker))
        # Read directly, not through `rgt-agent status`: a loaded machine can take seconds to
        # answer, and the job may be done by then.
        job = _job(run_dir, attempt)
        if not procfs.is_alive(job):
            break  # it finished first: the kills so far are enough
        os.kill(job.pid, signal.SIGKILL)

        def restarted(s: Dict[str, Any], killed: int = attempt) -> bool:
            return bool(s["attempt"] > killed or s["state"] in ("SUCCEEDED", "FAILED"))

        cli.wait_for(name, restarted, timeout=60, what=f"the restart after kill {attempt}")
    st = cli.wait_state(name, "SUCCEEDED", "FAILED", timeout=240)
    logs = cli("logs", name, check=True).stdout
    assert st["state"] == "SUCCEEDED", logs[-3000:]
    assert st["attempt"] >= 2, st
    assert re.search(r"^resumed from \S+", logs, re.M), logs[-3000:]
    return logs


def test_exact_hf_trainer(cli: Cli, tmp_path: object) -> None:
    _need("torch", "transformers", "accelerate")
    # 16 steps per epoch, a save every 8: resumes land mid-epoch and at an epoch's end.
    _killed_twice_resumes_exactly(
        cli,
        tmp_path,
        "hf",
        os.path.join(EXAMPLES, "train_hf.py"),
        ["--steps", "60", "--save-steps", "8"],
        r"checkpoint-(\d+)",
        "trainer_state.json",
    )


def test_exact_lightning(cli: Cli, tmp_path: object) -> None:
    _need("torch", "lightning", "torchdata")
    # 32 steps per epoch, a save every 16: the one due on step 32 (an epoch's last batch) is
    # taken after step 33.
    _killed_twice_resumes_exactly(
        cli,
        tmp_path,
        "lightning",
        os.path.join(EXAMPLES, "train_lightning.py"),
        ["--steps", "120", "--save-steps", "16"],
        r"step_(\d+)\.ckpt",
        None,
    )


def test_exact_accelerate(cli: Cli, tmp_path: object) -> None:
    _need("torch", "accelerate", "torchdata")
    # 32 steps per epoch, a save every 16: step_32 resumes from a finished epoch's loader.
    _killed_twice_resumes_exactly(
        cli,
        tmp_path,
        "accelerate",
        os.path.join(EXAMPLES, "train_accelerate.py"),
        ["--steps", "120", "--save-steps", "16"],
        r"step_(\d+)",
        ".rgt-complete",
    )


def _progress_step(run_dir: str) -> int:
    try:
        with open(os.path.join(run_dir, "progress.json")) as f:
            return int(json.load(f)["step"])
    except (OSError, ValueError, KeyError):
        return 0


def test_hf_callback_answers_the_request_file_and_saves_on_stop(cli: Cli, tmp_path: object) -> None:
    """trigger = "file": the agent's request file makes the Trainer save checkpoint-N (outside
    its save_steps) and is removed once that is written; `rgt-agent stop` (SIGTERM) makes it
    save the step it is at and end with status 143."""
    _need("torch", "transformers", "accelerate")
    job = os.path.join(str(tmp_path), "job.toml")
    command = [
        sys.executable,
        os.path.join(EXAMPLES, "train_hf.py"),
        "--steps",
        "2000",
        "--save-steps",
        "100000",
        "--sleep",
        "0.05",
    ]
    with open(job, "w") as f:
        f.write(
            'name = "hfreq"\n'
            f"command = {json.dumps(command)}\n"
            f"workdir = {json.dumps(str(tmp_path))}\n"
            "grace = 60\n"
            '[checkpoint]\ntrigger = "file"\n'
        )
    cli("start", job, check=True)
    run_dir = os.path.join(cli.home, "runs", "hfreq")
    ckpt = os.path.join(run_dir, "ckpt")
    request = os.path.join(run_dir, "checkpoint.request")
    wait(lambda: _progress_step(run_dir) >= 3, 120, "the job to report step 3")
    assert _steps(ckpt, r"checkpoint-(\d+)") == []

    with open(request, "w") as f:
        f.write('{"reason": "test"}\n')
    wait(lambda: bool(_steps(ckpt, r"checkpoint-(\d+)", "trainer_state.json")), 60, "a save")
    wait(lambda: not os.path.exists(request), 30, "the request file to be removed")
    first = _steps(ckpt, r"checkpoint-(\d+)", "trainer_state.json")
    assert len(first) == 1 and first[0] >= 3, first

    wait(lambda: _progress_step(run_dir) >= first[0] + 3, 60, "more steps")
    # RUNNING once the attempt is past its start grace (5 s): on an idle machine the steps
    # above can take less.
    st = cli.wait_state("hfreq", "RUNNING", timeout=60)
    assert st["attempt"] == 1, st
    assert cli.status("hfreq")["state"] == "RUNNING"  # the CLI's own answer says so too
    cli("stop", "hfreq", check=True, timeout=120)
    st = cli.wait_state("hfreq", "STOPPED", timeout=90)
    logs = cli("logs", "hfreq", check=True).stdout
    assert "rgt: preempted: checkpoint-" in logs, logs[-3000:]
    steps = _steps(ckpt, r"checkpoint-(\d+)", "trainer_state.json")
    assert len(steps) == 2 and steps[-1] > first[0], steps
    with open(os.path.join(ckpt, f"checkpoint-{steps[-1]}", "trainer_state.json")) as f:
        assert json.load(f)["global_step"] == steps[-1]
    assert (st.get("last_exit") or {}).get("code") == 143, st


def _touch(path: str, data: str = "x") -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(data)


def test_hf_resume_checkpoint_takes_the_newest_whole_one(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    _need("transformers")
    from onbox.train.hf import resume_checkpoint

    out = os.path.join(str(tmp_path), "out")
    monkeypatch.delenv("RGT_RESUME_FROM", raising=False)
    monkeypatch.delenv("RGT_CKPT_DIR", raising=False)
    assert resume_checkpoint(out) is None  # no directory yet: a fresh start
    _touch(os.path.join(out, "checkpoint-10", "trainer_state.json"), '{"global_step": 10}')
    _touch(os.path.join(out, "checkpoint-10", "model.safetensors"))
    # Killed while writing: no trainer_state.json yet, or half of it.
    _touch(os.path.join(out, "checkpoint-20", "model.safetensors"))
    _touch(os.path.join(out, "checkpoint-30", "trainer_state.json"), '{"global_st')
    _touch(os.path.join(out, "checkpoint-30", "model.safetensors"))
    _touch(os.path.join(out, "checkpoint-40", "trainer_state.json"), '{"global_step": 40}')
    _touch(os.path.join(out, "runs", "checkpoint-50", "trainer_state.json"), "{}")
    assert resume_checkpoint(out) == os.path.join(out, "checkpoint-10")

    restored = os.path.join(str(tmp_path), "restored", "checkpoint-5")
    _touch(os.path.join(restored, "trainer_state.json"), '{"global_step": 5}')
    _touch(os.path.join(restored, "pytorch_model.bin"))
    monkeypatch.setenv("RGT_RESUME_FROM", restored)
    assert resume_checkpoint(out) == restored  # the agent's restored one wins
    monkeypatch.setenv("RGT_RESUME_FROM", os.path.join(str(tmp_path), "step_5.pt"))
    assert resume_checkpoint(out) == os.path.join(out, "checkpoint-10")  # not a Trainer's
    monkeypatch.delenv("RGT_RESUME_FROM")
    monkeypatch.setenv("RGT_CKPT_DIR", out)
    assert resume_checkpoint() == os.path.join(out, "checkpoint-10")


def test_hf_resume_checkpoint_follows_a_link_in_the_output_dir_never_one_out_of_it(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``checkpoint-40`` in the output dir is a symlink to a checkpoint elsewhere: the sealer
    never follows a link, so the store never holds it, yet resume_checkpoint resumed from it
    (its own scan had no link rule). It is skipped now, said on stderr, as the other adapters
    do (ckptdir.newest_verified); ``checkpoint-20``, a link to ``checkpoint-10`` beside it,
    is resumed through."""
    _need("transformers")
    from onbox.train.hf import resume_checkpoint

    out, elsewhere = os.path.join(str(tmp_path), "out"), os.path.join(str(tmp_path), "else")
    monkeypatch.delenv("RGT_RESUME_FROM", raising=False)
    for d, step in ((out, 10), (elsewhere, 40)):
        name = os.path.join(d, f"checkpoint-{step}")
        _touch(os.path.join(name, "trainer_state.json"), json.dumps({"global_step": step}))
        _touch(os.path.join(name, "model.safetensors"))
    os.symlink(os.path.join(elsewhere, "checkpoint-40"), os.path.join(out, "checkpoint-40"))
    os.symlink("checkpoint-10", os.path.join(out, "checkpoint-20"))
    assert resume_checkpoint(out) == os.path.join(out, "checkpoint-20")
    err = capsys.readouterr().err
    assert "skipping checkpoint step 40:" in err and "outside" in err, err
    os.unlink(os.path.join(out, "checkpoint-20"))
    _touch(os.path.join(out, "checkpoint-30", "trainer_state.json"), '{"global_st')  # cut off
    _touch(os.path.join(out, "checkpoint-30", "model.safetensors"))
    assert resume_checkpoint(out) == os.path.join(out, "checkpoint-10")


def test_lightning_resume_path_takes_the_newest_whole_one(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    _need("lightning")
    from onbox.train.lightning import resume_path

    d = os.path.join(str(tmp_path), "ckpt")
    monkeypatch.delenv("RGT_RESUME_FROM", raising=False)
    monkeypatch.delenv("RGT_CKPT_DIR", raising=False)
    assert resume_path(d) is None
    _touch(os.path.join(d, "step_10.ckpt"))
    _touch(os.path.join(d, ".step_30.rgt-tmp.lightning"))  # a save that was killed
    _touch(os.path.join(d, "step_40", "model.pt"))  # a sharded save without its marker
    _touch(os.path.join(d, "notes.txt"))
    assert resume_path(d) == os.path.join(d, "step_10.ckpt")
    _touch(os.path.join(d, "step_20", ".rgt-complete"), '{"step": 20, "files": {}}')
    assert resume_path(d) == os.path.join(d, "step_20")
    monkeypatch.setenv("RGT_RESUME_FROM", os.path.join(d, "step_10.ckpt"))
    assert resume_path(d) == os.path.join(d, "step_10.ckpt")


def test_lightning_resume_path_skips_a_damaged_newest_one(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file cut off before torch.save's zip directory, and a sharded directory whose marker
    lists a file that is short, are skipped for the newest one that verifies."""
    _need("lightning", "torch")
    import torch

    from onbox.train.lightning import resume_path

    d = os.path.join(str(tmp_path), "ckpt")
    monkeypatch.delenv("RGT_RESUME_FROM", raising=False)
    os.makedirs(d)
    torch.save({"global_step": 10}, os.path.join(d, "step_10.ckpt"))
    torch.save({"global_step": 30, "pad": torch.zeros(4096)}, os.path.join(d, "step_30.ckpt"))
    os.truncate(os.path.join(d, "step_30.ckpt"), 8192)
    marker = {"step": 20, "format": "lightning", "files": {"model.pt": {"size": 5, "sha256": "0"}}}
    _touch(os.path.join(d, "step_20", "model.pt"), "abc")
    _touch(os.path.join(d, "step_20", ".rgt-complete"), json.dumps(marker))
    assert resume_path(d) == os.path.join(d, "step_10.ckpt")
