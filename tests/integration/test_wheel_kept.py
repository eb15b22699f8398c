"""The agent's wheel kept between deploys (controller/deploy/wheelcache.py).

- End to end over the test sshd, `rgt` run from a copy of its own source: the first deploy keeps
  its wheel in the controller's home (mode 0600). A package file is then changed to the same
  size, with its modification time put back (a change no size or time shows); the next deploy
  installs an agent built from the changed file: checked on the box, in the new install's files,
  and the run's recorded agent is that install.
- A kept entry that is damaged (one byte changed) or readable by others is not used: the wheel
  is built again, byte for byte ``agent_wheel``'s, and the entry replaced (0600 again).
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import sys
from pathlib import Path

from controller.deploy.wheel import agent_wheel
from controller.deploy.wheelcache import FILE, kept_agent_wheel
from controller.registry import Registry
from tests.conftest import ROOT, _kill_run_processes
from tests.laptop import laptop_env, run_rgt, ssh_target
from tests.sshd import SshServer

OLD = b"the on-box command line."
NEW = b"the on-box command LINE."


def _installed_cli(box: str) -> dict[str, bytes]:
    """Each agent install on the box: its directory, and its onbox/cli.py."""
    out = {}
    for path in glob.glob(os.path.join(box, "agent", "*", "**", "onbox", "cli.py"), recursive=True):
        rel = os.path.relpath(path, os.path.join(box, "agent"))
        with open(path, "rb") as f:
            out[os.path.join(box, "agent", rel.split(os.sep)[0])] = f.read()
    return out


def test_a_package_file_changed_after_a_kept_build_deploys_the_new_agent(
    tmp_path: Path, laptop: str, sshd: SshServer
) -> None:
    src = tmp_path / "src"
    for pkg in ("controller", "onbox"):
        shutil.copytree(
            os.path.join(ROOT, pkg), src / pkg, ignore=shutil.ignore_patterns("__pycache__")
        )
    project = tmp_path / "proj"
    project.mkdir()
    (project / "job.py").write_text("print('started', flush=True)\n")
    box = str(tmp_path / "box")
    env = laptop_env(laptop, box, PYTHONPATH=str(src))

    def deploy(name: str) -> None:
        argv = ["deploy", ssh_target(sshd), "--name", name, "--python", sys.executable]
        p = run_rgt([*argv, "--", "python3", "job.py"], env, str(project))
        assert p.returncode == 0, p.stderr

    try:
        deploy("r1")
        kept = os.path.join(laptop, FILE)
        assert os.stat(kept).st_mode & 0o777 == 0o600
        before = _installed_cli(box)
        assert len(before) == 1 and OLD in next(iter(before.values()))

        cli = src / "onbox" / "cli.py"
        st = os.stat(cli)
        data = cli.read_bytes()
        assert data.count(OLD) == 1
        cli.write_bytes(data.replace(OLD, NEW))
        os.utime(cli, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert os.stat(cli).st_size == st.st_size

        deploy("r2")
        after = _installed_cli(box)
        new = [d for d in after if d not in before]
        assert len(new) == 1, after.keys()
        assert NEW in after[new[0]] and OLD not in after[new[0]]
        agent = Registry(laptop).get("r2").agent
        assert any(a.startswith(new[0] + os.sep) for a in agent), agent
    finally:
        _kill_run_processes(box)


def test_a_damaged_or_open_kept_wheel_is_built_again(tmp_path: Path) -> None:
    home = str(tmp_path / "ctl")
    fresh = agent_wheel()
    assert kept_agent_wheel(home).data == fresh.data
    path = os.path.join(home, FILE)
    with open(path, "r+b") as f:
        f.seek(-100, os.SEEK_END)
        byte = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    damaged = Path(path).read_bytes()
    got = kept_agent_wheel(home)
    assert got.data == fresh.data and got.sha256 == fresh.sha256
    assert Path(path).read_bytes() != damaged  # replaced by a sound entry
    assert Path(path).read_bytes().endswith(fresh.data)

    os.chmod(path, 0o644)  # an entry others could read (or was not written by rgt)
    inode = os.stat(path).st_ino
    assert kept_agent_wheel(home).sha256 == hashlib.sha256(fresh.data).hexdigest()
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert os.stat(path).st_ino != inode  # written again
