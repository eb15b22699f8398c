"""The suite leaves no ssh control directory behind (tests/conftest.py ``no_control_dir_left``).

A controller home in a test's directory is too long for a socket path, so rgt records a private
directory under /tmp for it (controller/controldir.py ``control_dir``). A test that leaves its
master open (ControlPersist), as a failed command or an `rgt` process that ends without closing
does, left that directory and its master behind: about 25 an hour of testing. This runs a pytest
session of its own, with the suite's conftest as its plugin and a test that does just that
against the real sshd, and checks afterwards that the directory and its master are gone.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT, drop_control_dir
from tests.sshd import SshServer, ssh_naming

INNER = """
from controller.remote import SshRemote
from controller.target import Target


def test_a_master_left_open(tmp_path):
    home = tmp_path / ("h" * 60)  # too long for HOME/cm: the directory is under /tmp
    target = Target("ssh", host="127.0.0.1", port={port}, user={user!r}, identity={key!r})
    remote = SshRemote(target, home=str(home))
    assert remote.control_dir.startswith("/tmp/rgt-cm-")
    got = remote.run(["true"], timeout=60)
    assert got.rc == 0, got.err
    # Never closed: its master stays (ControlPersist), as after a failed command.
    with open({record!r}, "w") as f:
        f.write(str(home))
"""


def test_a_test_home_whose_master_was_left_open_leaves_nothing_in_tmp(
    sshd: SshServer, tmp_path: Path
) -> None:
    inner = tmp_path / "inner"
    inner.mkdir()
    record = tmp_path / "home"
    (inner / "test_inner.py").write_text(
        INNER.format(port=sshd.port, user=sshd.user, key=sshd.client_key, record=str(record))
    )
    env = dict(os.environ, RGT_SSH_CONFIG="/dev/null")
    env["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, [env.get("PYTHONPATH")])])
    env.pop("RGT_CONTROLLER_HOME", None)
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
            "--rootdir", str(inner), "--basetemp", str(tmp_path / "basetemp"),
            str(inner / "test_inner.py")]  # fmt: skip
    p = subprocess.run(argv, env=env, cwd=str(inner), stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    home = record.read_text() if record.exists() else ""
    try:
        assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
        d = Path(home, "cm-dir").read_text().strip()
        assert d.startswith(f"/tmp/rgt-cm-{os.getuid()}-"), d
        assert not os.path.lexists(d), f"{d} left behind: {os.listdir(d)}"
        assert ssh_naming(d) == []  # its master stopped
    finally:
        if home:
            drop_control_dir(home)
