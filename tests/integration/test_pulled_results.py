"""What `rgt pull N` brings back into the project (``./rgt-results/N`` by default) never goes
back to the box with the next `rgt deploy`: rgt's results directory ignores itself (a
``.gitignore`` holding ``*``, as a virtualenv or .pytest_cache does), which git honours and
which the release's own listing honours outside git too. Before, the pulled checkpoints,
receipts and logs were untracked-not-ignored files: pushed in the next release, which the pull
renamed (a new id).

Real processes: the `rgt` CLI (tests/laptop.py) against the session's loopback sshd, with a
`file://` store.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import _kill_run_processes
from tests.laptop import laptop_env, run_rgt, ssh_target
from tests.sshd import SshServer

# Writes one checkpoint and ends: the run SUCCEEDED with step 1 sealed, for the pull.
JOB = "import os\nopen(os.environ['RGT_CKPT_DIR'] + '/step_1.bin', 'wb').write(b'w' * 4096)\n"


def _release(err: str) -> str:
    ids: list[str] = re.findall(r"^rgt: release ([0-9a-f]{16}): ", err, re.M)
    assert len(ids) == 1, err
    return ids[0]


def _box_files(release: str) -> list[str]:
    out = []
    for here, _, files in os.walk(release):
        out += [os.path.relpath(os.path.join(here, f), release) for f in files]
    return sorted(out)


@pytest.mark.parametrize("git", [True, False], ids=["git", "no-git"])
def test_a_pull_into_the_default_place_is_not_pushed_by_the_next_deploy(
    sshd: SshServer, tmp_path: Path, git: bool
) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "job.py").write_text(JOB)
    if git:
        subprocess.run(["git", "init", "-q", str(project)], check=True, timeout=60)
    ctl, box = tmp_path / "ctl", tmp_path / "box"
    ctl.mkdir()
    store = tmp_path / "store"
    store.mkdir()
    env = laptop_env(str(ctl), str(box))
    name = f"pulled-{'git' if git else 'plain'}-{os.getpid()}"

    def deploy(run: str) -> subprocess.CompletedProcess[str]:
        argv = ["deploy", ssh_target(sshd), "--python", sys.executable, "--name", run]
        argv += ["--store", f"file://{store}", "--", sys.executable, "job.py"]
        return run_rgt(argv, env, str(project))

    try:
        p = deploy(name)
        assert p.returncode == 0, p.stderr
        first = _release(p.stderr)
        shipped = _box_files(str(box / "releases" / first))
        assert "job.py" in shipped, shipped

        p = run_rgt(["pull", name], env, str(project))
        assert p.returncode == 0, p.stderr
        pulled = project / "rgt-results" / name
        assert (pulled / ".rgt-receipt.json").is_file(), p.stdout
        assert (pulled / "checkpoints" / "step_1.bin").is_file(), sorted(os.listdir(pulled))
        if git:  # git ignores it: `git status` has nothing of it to show
            st = subprocess.run(
                ["git", "-C", str(project), "status", "--porcelain", "--untracked-files=all"],
                capture_output=True,
                text=True,
                check=True,
                timeout=60,
            )
            assert "rgt-results" not in st.stdout, st.stdout

        p = deploy(f"{name}-again")
        assert p.returncode == 0, p.stderr
        assert _release(p.stderr) == first, p.stderr  # the pull did not make new code of it
        assert "already on the box, nothing sent" in p.stderr, p.stderr
        assert sorted(os.listdir(box / "releases")) == [first]
        assert _box_files(str(box / "releases" / first)) == shipped
        # How: the results directory ignores itself, as a virtualenv's does.
        assert (project / "rgt-results" / ".gitignore").read_text().splitlines()[-1] == "*"
    finally:
        _kill_run_processes(str(box))


def test_a_gitignore_of_the_users_in_the_results_directory_is_kept(
    sshd: SshServer, tmp_path: Path
) -> None:
    """rgt writes its ``.gitignore`` only where there is none: the user's own stays as it is."""
    project = tmp_path / "project"
    (project / "rgt-results").mkdir(parents=True)
    (project / "job.py").write_text(JOB)
    mine = "# mine: keep the receipts\n*\n!*/.rgt-receipt.json\n"
    (project / "rgt-results" / ".gitignore").write_text(mine)
    ctl, box = tmp_path / "ctl", tmp_path / "box"
    ctl.mkdir()
    store = tmp_path / "store"
    store.mkdir()
    env = laptop_env(str(ctl), str(box))
    name = f"mine-{os.getpid()}"
    try:
        argv = ["deploy", ssh_target(sshd), "--python", sys.executable, "--name", name]
        argv += ["--store", f"file://{store}", "--", sys.executable, "job.py"]
        p = run_rgt(argv, env, str(project))
        assert p.returncode == 0, p.stderr
        p = run_rgt(["pull", name], env, str(project))
        assert p.returncode == 0, p.stderr
        assert (project / "rgt-results" / name / ".rgt-receipt.json").is_file()
        assert (project / "rgt-results" / ".gitignore").read_text() == mine
    finally:
        _kill_run_processes(str(box))
