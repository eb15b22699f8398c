"""The agent's wheel kept between deploys (controller/deploy/wheelcache.py).

- End to end over the test sshd, `rgt` run from a copy of its own source: the first deploy keeps
  its wheel in the controller's home (mode 0600). A package file is then changed to the same
  size, with its modification time put back (a change no size or time shows); the next deploy
  installs an agent built from the changed file: checked on the box, in the new install's files,
  and the run's recorded agent is that install.
- A kept entry that is damaged (one byte changed) or readable by others is not used: the wheel
  is built again, byte for byte ``agent_wheel``'s, and the entry replaced (0600 again).
- On a cold cache, two deploys at once (a sweep's boxes, each in its thread; two rgt processes)
  build the wheel once: the other waits for it and takes the kept one. Builds are counted at the
  builder's seam (the real builder, counted).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import List, Tuple

from controller.deploy.wheel import AgentWheel, agent_wheel, wheel_bytes
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


def test_two_threads_on_a_cold_cache_build_the_wheel_once(tmp_path: Path) -> None:
    home = str(tmp_path / "ctl")
    builds: List[int] = []

    def counted(ver: str, contents: List[Tuple[str, bytes]]) -> bytes:
        builds.append(1)
        return wheel_bytes(ver, contents)

    together = threading.Barrier(2)
    got: List[AgentWheel] = []

    def deploy() -> None:
        together.wait(60)
        got.append(kept_agent_wheel(home, build=counted))

    threads = [threading.Thread(target=deploy) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(got) == 2 and got[0] == got[1] and got[0].data == agent_wheel().data
    assert len(builds) == 1, f"built {len(builds)} times"


# One rgt process's deploy: ready once imported, then kept_agent_wheel on "go" (so that both
# look at the cold cache at once), each build of its wheel a line in the builds file.
PROCESS = r"""
import hashlib, json, sys
from controller.deploy import wheel, wheelcache
home, builds = sys.argv[1:3]
def counted(ver, contents):
    with open(builds, "a") as f:
        f.write("built\n")
    return wheel.wheel_bytes(ver, contents)
print("ready", flush=True)
sys.stdin.readline()
print(json.dumps(wheelcache.kept_agent_wheel(home, build=counted).sha256), flush=True)
"""


def test_two_processes_on_a_cold_cache_build_the_wheel_once(tmp_path: Path) -> None:
    home, builds = str(tmp_path / "ctl"), tmp_path / "builds"
    env = dict(os.environ, PYTHONPATH=ROOT)
    procs = []
    try:
        for _ in range(2):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", PROCESS, home, str(builds)],
                    cwd=ROOT,
                    env=env,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )  # fmt: skip
            )
        for p in procs:
            assert p.stdout is not None and p.stdout.readline() == "ready\n"
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        shas = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
        assert [p.returncode for p in procs] == [0, 0]
        assert shas[0] == shas[1] == agent_wheel().sha256
        assert builds.read_text().count("built") == 1, builds.read_text()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
