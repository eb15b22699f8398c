"""The audit of `rgt deploy` (controller/deploy/audit.py) over a real sshd on loopback and on
``local``.

Its one script also reads, changing nothing, what the next steps of a deploy would otherwise ask
the box for: the Python as the agent's install sees it and the marker of this controller's
install for it (controller/deploy/install.py), and whether the release is complete
(controller/deploy/release.py).
The box is this machine, so what the audit reports is checked against files made directly.
Covered:

- on an empty box: the Python found byte for byte through a hostile path (quotes, ``$()``, a
  newline-free but non-UTF-8 name), no install, no release, and nothing created on the box;
- the install found under its key (the probe's key is install_key's, for that hostile path), the
  newest complete ``<key>-N`` preferred, incomplete ones and other Pythons' ignored; the release
  found complete, with the deploy's current link on it or not;
- a Python that prints a banner and warnings first is read all the same;
- a missing, a non-executable and an old Python are problems with the install's own message;
  an option-like ``--python`` is refused before any command;
- push_release and switch_current given what the audit saw run no command at all (the box they
  are given cannot be reached).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, Optional

import pytest

from controller.deploy import install
from controller.deploy.audit import Audit, audit
from controller.deploy.project import project_files, release_id
from controller.deploy.release import BoxRelease, push_release, switch_current
from controller.deploy.wheel import agent_wheel
from controller.remote import LocalRemote, Remote, SshRemote
from controller.target import Target
from onbox.common.errors import UsageError
from tests.sshd import SshServer, free_port

HOSTILE_HOME = "box home 'q' \"dq\" $(touch pwned); `x` -n"
HOSTILE_PY_DIR = os.fsdecode(b"py dir 'q' $(touch pwned) `x` \xff")
RID = "0123456789abcdef"


class Box:
    """A box to audit: a Remote and its RGT_HOME (on this machine, so made directly)."""

    def __init__(self, remote: Remote, home: str) -> None:
        self.remote = remote
        self.home = home

    def audit(self, python: Optional[str], **kw: Any) -> Audit:
        return audit(self.remote, python=python, box_home=self.home, **kw)


@pytest.fixture(params=["ssh", "local"])
def box(
    request: pytest.FixtureRequest, tmp_path: Path, controller_env: Dict[str, str]
) -> Iterator[Box]:
    home = str(tmp_path / HOSTILE_HOME)
    if request.param == "local":
        yield Box(LocalRemote(), home)
        return
    sshd: SshServer = request.getfixturevalue("sshd")
    remote = SshRemote(
        Target("ssh", host="127.0.0.1", port=sshd.port, user=sshd.user, identity=sshd.client_key)
    )
    try:
        yield Box(remote, home)
    finally:
        remote.close()


def _hostile_python(tmp_path: Path) -> str:
    """This Python, reached through a link whose path a shell would get wrong."""
    d = tmp_path / HOSTILE_PY_DIR
    d.mkdir()
    link = d / "python 3"
    link.symlink_to(os.path.realpath(sys.executable))
    return str(link)


def _marker(home: str, name: str, method: str = "venv") -> str:
    d = os.path.join(home, "agent", name)
    os.makedirs(d, exist_ok=True)
    text = json.dumps({"method": method, "note": name}) + "\n"
    with open(os.path.join(d, install.MARKER), "w") as f:
        f.write(text)
    return text


def _nothing_pwned(*dirs: str) -> None:
    for d in dirs:
        assert not os.path.exists(os.path.join(d, "pwned")), d


def test_an_empty_box_python_found_byte_for_byte_nothing_else(
    box: Box, tmp_path: Path, sshd: SshServer
) -> None:
    py = _hostile_python(tmp_path)
    wheel = agent_wheel()
    rep = box.audit(py, wheel=wheel, extras=["s3"], release_id=RID, deploy="run-1")
    assert rep.probed is not None, rep.findings
    assert rep.probed.python.path == py  # the non-UTF-8 byte too
    assert rep.probed.python.version == tuple(sys.version_info[:3])
    assert (rep.python, rep.python_version) == (py, rep.probed.python.version_text)
    assert (rep.probed.install, rep.probed.marker) == (None, None)
    assert rep.release == BoxRelease(RID, complete=False, current=False)
    assert not [f for f in rep.problems if "python" in f.what.lower()], rep.problems
    assert not os.path.exists(box.home)  # the audit changes nothing
    _nothing_pwned(str(tmp_path), os.getcwd(), os.path.expanduser("~"), sshd.home)


def test_the_install_and_the_release_are_found(box: Box, tmp_path: Path, sshd: SshServer) -> None:
    py = _hostile_python(tmp_path)
    wheel = agent_wheel()
    key = install.install_key(wheel, py, ["s3"])
    # Installs that are not the one asked for: another Python's, other extras', and an
    # incomplete one with a higher number.
    _marker(box.home, install.install_key(wheel, os.path.realpath(sys.executable), ["s3"]))
    _marker(box.home, install.install_key(wheel, py, []))
    os.makedirs(os.path.join(box.home, "agent", f"{key}-7"))
    rep = box.audit(py, wheel=wheel, extras=["s3"])
    assert rep.probed is not None and rep.probed.install is None
    assert rep.release is None  # not asked about

    text = _marker(box.home, key)
    rep = box.audit(py, wheel=wheel, extras=["s3"])
    assert rep.probed is not None and (rep.probed.install, rep.probed.marker) == (key, text)
    found = install.found_install(rep.probed, box.home, wheel, ["s3"])
    assert found is not None and not found.installed and found.method == "venv"
    assert found.path == os.path.join(box.home, "agent", key)
    assert found.argv == [os.path.join(found.path, "venv/bin/python"), "-I", "-m", "onbox.cli"]
    assert install.found_install(rep.probed, box.home, wheel, []) is None  # other extras

    text = _marker(box.home, f"{key}-2", method="target")  # made next to a busy one
    rep = box.audit(py, wheel=wheel, extras=["s3"])
    assert rep.probed is not None and (rep.probed.install, rep.probed.marker) == (f"{key}-2", text)
    found = install.found_install(rep.probed, box.home, wheel, ["s3"])
    assert found is not None and found.method == "target"
    assert found.argv == [py, "-I", os.path.join(box.home, "agent", f"{key}-2", "bin/rgt-agent")]

    rel = os.path.join(box.home, "releases", RID)
    os.makedirs(rel)
    assert box.audit(py, release_id=RID).release == BoxRelease(RID, False, False)  # no marker
    Path(rel, ".rgt-release").write_text("{}\n")
    assert box.audit(py, release_id=RID, deploy="run-1").release == BoxRelease(RID, True, False)
    os.makedirs(os.path.join(box.home, "deploys", "run-1"))
    os.symlink(f"../../releases/{RID}", os.path.join(box.home, "deploys", "run-1", "current"))
    assert box.audit(py, release_id=RID, deploy="run-1").release == BoxRelease(RID, True, True)
    assert box.audit(py, release_id=RID, deploy="run-2").release == BoxRelease(RID, True, False)
    assert box.audit(py, release_id=RID).release == BoxRelease(RID, True, False)
    _nothing_pwned(str(tmp_path), os.getcwd(), os.path.expanduser("~"), sshd.home)


def _wrapper(path: Path, body: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def test_a_python_that_talks_before_its_answer_is_still_read(box: Box, tmp_path: Path) -> None:
    """Images whose Python prints a banner or warnings at every start (a sitecustomize)."""
    real = os.path.realpath(sys.executable)
    noisy = _wrapper(
        tmp_path / "noisy bin" / "python3",
        "echo '@ conda: welcome {'\n"
        "echo 'DeprecationWarning: this Python is noisy' >&2\n"
        f'exec {real} "$@"\n',
    )
    wheel = agent_wheel()
    key = install.install_key(wheel, noisy)
    text = _marker(box.home, key)
    rep = box.audit(noisy, wheel=wheel)
    assert rep.probed is not None, rep.findings
    assert rep.probed.python.path == noisy
    assert (rep.probed.install, rep.probed.marker) == (key, text)


def test_a_python_that_will_not_do_is_a_problem_in_the_install_s_words(
    box: Box, tmp_path: Path
) -> None:
    real = os.path.realpath(sys.executable)
    old = _wrapper(
        tmp_path / "python3.8",
        'if [ "$1" = -c ]; then\n'
        f'  code=$2; shift 2; exec {real} -c \'import sys; sys.version_info = (3, 8, 18, "f", 0);'
        ' exec(sys.argv.pop(1))\' "$code" "$@"\n'
        "fi\n"
        f'exec {real} "$@"\n',
    )
    not_exec = tmp_path / "not executable"
    not_exec.write_text("")
    cases = {
        "/nonexistent/python3": "is not an executable file",
        "no-such-python3": "not on PATH",
        str(not_exec): "is not an executable file",
        old: "is Python 3.8.18; rgt's agent needs 3.9 or newer",
    }
    for python, why in cases.items():
        rep = box.audit(python, wheel=agent_wheel(), release_id=RID)
        assert rep.probed is None and rep.python == ""
        (problem,) = [f for f in rep.problems if why in f.what]
        assert "--python" in problem.what, problem
        if python != old:
            assert repr(python) in problem.what, problem
    assert not os.path.exists(box.home)
    for python in ["-c", "--version", "a\nb"]:
        with pytest.raises(UsageError) as e:
            box.audit(python)
        assert e.value.field == "--python"


def test_what_the_audit_saw_spares_the_push_and_the_switch_their_commands(
    tmp_path: Path, controller_env: Dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A box that cannot be reached: any command on it would raise."""
    monkeypatch.setenv("RGT_SSH_CONNECT_TIMEOUT", "2")
    gone = SshRemote(Target("ssh", host="127.0.0.1", port=free_port(), user="nobody"))
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "train.py").write_text("print('hi')\n")
    files = project_files(str(proj))
    rid = release_id(str(proj), files)
    home = str(tmp_path / "box")
    res = push_release(
        gone, str(proj), home, name="run-1", files=files, seen=BoxRelease(rid, True, True)
    )
    assert (res.id, res.method, res.transferred_files) == (rid, "existing", 0)
    assert res.path == os.path.join(home, "releases", rid)
    switch_current(gone, home, "run-1", rid)  # the audit saw the link there already
    with pytest.raises(UsageError):
        push_release(gone, str(proj), home, seen=BoxRelease(rid, True, True))  # files not given
    with pytest.raises(UsageError):
        push_release(gone, str(proj), home, files=files, seen=BoxRelease("../x", True, True))
