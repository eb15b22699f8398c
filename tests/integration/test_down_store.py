"""`rgt down` of a finished run whose store is S3 (a real SeaweedFS), deployed by `rgt deploy`.

The store outlives the box and holds the run's sealed checkpoints, as many as its rotation
(``[checkpoint] keep``) leaves. What down's plan calls lost, what it says the store keeps, and
the second `rgt down N` (the run taken down already) are held against that store.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator, List, Tuple

import pytest

from controller.cli import main as rgt_main
from controller.registry import Registry
from controller.remote import open_remote
from controller.results.down import down, plan_down
from onbox.common.errors import NotFound, UnsafeRefused
from tests.conftest import Cli, _kill_run_processes
from tests.seaweed import SeaweedServer

RUN = "sealed"
# A job that saves a checkpoint at steps 3, 6 and 9, a second apart so that each is sealed,
# then ends (SUCCEEDED). With keep = 2 the store's rotation prunes step 3.
JOB = """\
import os, time
d = os.environ["RGT_CKPT_DIR"]
os.makedirs(d, exist_ok=True)
for step in (3, 6, 9):
    with open(os.path.join(d, f"step_{step}.pt.tmp"), "wb") as f:
        f.write(os.urandom(4096))
    os.replace(os.path.join(d, f"step_{step}.pt.tmp"), os.path.join(d, f"step_{step}.pt"))
    print("saved", step, flush=True)
    time.sleep(2)
"""


@pytest.fixture
def finished(
    tmp_path: Path,
    s3_server: SeaweedServer,
    monkeypatch: pytest.MonkeyPatch,
    controller_env: Any,
    capsys: pytest.CaptureFixture[str],
) -> Iterator[Tuple[Cli, str]]:
    """A run deployed on this machine with an S3 store, finished, pulled: (box cli, store URL)."""
    box = str(tmp_path / "box")
    monkeypatch.setenv("RGT_BOX_HOME", box)
    for var, value in s3_server.env({}).items():
        monkeypatch.setenv(var, value)
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "job.py").write_text(JOB)
    url = f"s3://{s3_server.bucket()}/rgt"
    (proj / "job.toml").write_text(
        f'command = ["{sys.executable}", "job.py"]\n[checkpoint]\nkeep = 2\n'
        f'[store]\nurl = "{url}"\nendpoint_url = "{s3_server.endpoint}"\n'
    )
    cli = Cli(box, dict(os.environ, RGT_HOME=box))
    try:
        code, _, err = _rgt(
            capsys, "deploy", "local", "--name", RUN, "--python", sys.executable,
            "--project", str(proj), "--secret-env", "AWS_ACCESS_KEY_ID",
            "--secret-env", "AWS_SECRET_ACCESS_KEY", str(proj / "job.toml"),
        )  # fmt: skip
        assert code in (0, 11) or "SUCCEEDED" in err, err
        cli.wait_over(RUN, "SUCCEEDED")
        code, _, err = _rgt(capsys, "pull", RUN, "--to", str(tmp_path / "dest"))
        assert code == 0, err
        yield cli, url
    finally:
        _kill_run_processes(box)


def _rgt(capsys: pytest.CaptureFixture[str], *argv: str) -> Tuple[int, str, str]:
    capsys.readouterr()
    code = rgt_main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _section(text: str, head: str, end: str) -> str:
    return text.split(head)[1].split(end)[0]


def test_down_of_a_finished_run_keeps_in_its_store_what_the_store_sealed(
    finished: Tuple[Cli, str],
) -> None:
    """Before: the plan listed step_6.pt as lost although it is sealed in the S3 store (only
    step_3.pt, pruned by the store's rotation, is on the box alone); it said the store keeps
    "every sealed checkpoint (rgt never deletes it)" although keep = 2 pruned step 3; and it
    said it would stop the agent and the job of a run that had ended (SUCCEEDED)."""
    _, url = finished
    rec = Registry().get(RUN)
    text = "\n".join(plan_down(rec, open_remote(rec.target)).lines())
    lost = _section(text, "will be lost", "\nkept:")
    kept = _section(text, "\nkept:", "\nbilling:")
    assert "checkpoint step_3.pt" in lost, text
    assert "step_6" not in lost and "step_9" not in lost, text
    assert f"checkpoint step_6.pt (4.0 KiB): not in the receipt, sealed in the store {url} " \
        "(step 6)" in kept, text  # fmt: skip
    assert f"the store {url}: the sealed checkpoints of steps 6 and 9 (its rotation kept the " \
        "newest 2" in kept, text  # fmt: skip
    assert "every sealed checkpoint" not in text and "never deletes" not in text, text
    will = text.split("down will:")[1]
    assert "stop the agent" not in will and "now SUCCEEDED" not in will, text
    assert f"check that no process of the run is left (rgt-agent stop {RUN})" in will, text


def test_down_again_forgets_the_run_only_once_confirmed_and_says_how_to_reach_its_store(
    finished: Tuple[Cli, str],
    tmp_path: Path,
    s3_server: SeaweedServer,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Before: the second `rgt down N` (the record kept for the store) forgot the run with no
    confirmation, stdin not a terminal and no --yes, exit 0, and its last line promised that
    the store keeps every sealed checkpoint. Now it asks as the first down does, and its last
    line gives the command that fetches the newest sealed checkpoint from the store."""
    _, url = finished
    code, out, err = _rgt(capsys, "down", RUN, "--yes")
    assert code == 0, err
    assert "checked that no process of the run is left" not in out  # done lines are not shown
    assert Registry().get(RUN).down_at is not None

    code, out, err = _rgt(capsys, "down", RUN)  # no terminal, no --yes: refused
    assert code == 7 and "needs the run's name typed on a terminal" in err, out + err
    assert f"the store {url}: the sealed checkpoints of steps 6 and 9" in out, out
    assert Registry().get(RUN).down_at is not None  # not forgotten
    shown: List[str] = []
    with pytest.raises(UnsafeRefused, match="does not match"):
        down(Registry().get(RUN), yes=False, interactive=True, ask=lambda p: "x", show=shown.append)
    assert Registry().get(RUN).down_at is not None

    code, out, err = _rgt(capsys, "down", RUN, "--yes")
    assert code == 0, err
    with pytest.raises(NotFound):
        Registry().get(RUN)
    last = out.strip().splitlines()[-1]
    assert "every sealed checkpoint" not in out, out
    hint = last.split("`")[1]  # the restore command, as the user copies it
    assert f"rgt-agent restore --store {url} --name {RUN} --to DIR" in hint, last
    dest = tmp_path / "restored"
    env = {k: v for k, v in s3_server.env().items() if k != "AWS_ENDPOINT_URL"}
    env["RGT_HOME"] = str(tmp_path / "laptop-agent-home")  # no run of that name here
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]  # rgt-agent
    p = subprocess.run(
        ["sh", "-c", hint.replace("DIR", shlex.quote(str(dest)))],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    pulled = tmp_path / "dest" / "checkpoints" / "step_9.pt"
    assert (dest / "step_9.pt").read_bytes() == pulled.read_bytes()
