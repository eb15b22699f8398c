"""Installing the agent on the box (controller/deploy/wheel.py, controller/deploy/install.py) over
a real sshd.

The box is this machine over loopback ssh; its ``python3`` is the image's Python, which must come
out of every install unchanged. Covered:

- rgt's wheel: reproducible bytes, only ``onbox``, the dependencies of pyproject.toml, a valid
  RECORD, the ``rgt-agent`` entry point;
- a venv install from that wheel with dependencies from the box's index, run through the returned
  argv/env (``--version``, ``list``), not shadowed by modules in the working directory; reused
  by a second install without installing anything; filled by the box Python's own pip (no pip
  bootstrapped into the venv), or, where that pip is older than ``--python`` (a fake), by a pip
  of the venv's own;
- a box whose Python cannot make a venv (a ``--python`` wrapper that fails ``-m venv``): pip
  ``--target`` and a launcher; reused when complete, redone when its marker is missing (an install
  cut off); one that has no pip either, an old Python, a missing one: refused
  with what to do;
- ``offline``: dependencies downloaded here for the box's Python and platform, pushed, installed
  with ``--no-index``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import stat
import sys
import time
import zipfile
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import pytest

from controller.deploy import wheel as wheelmod
from controller.deploy.install import AgentInstall, install_agent, manylinux_platforms
from controller.deploy.probe import probe_python
from controller.remote import LocalRemote, SshRemote
from controller.target import Target
from onbox.common.errors import HostError, UsageError
from tests.conftest import ROOT, _kill_run_processes, require
from tests.sshd import SshServer

HOME_NAME = "box home 'q' $(touch pwned) -x"


@pytest.fixture(scope="module")
def remote(sshd: SshServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshRemote]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RGT_CONTROLLER_HOME", str(tmp_path_factory.mktemp("controller")))
        mp.setenv("RGT_SSH_CONFIG", "/dev/null")
        r = SshRemote(
            Target(
                "ssh", host="127.0.0.1", port=sshd.port, user=sshd.user, identity=sshd.client_key
            )
        )
        try:
            yield r
        finally:
            r.close()


def _box_python(remote: SshRemote) -> str:
    """The image's python3 on the box's non-interactive PATH."""
    return probe_python(remote).path


def _site_snapshot(remote: SshRemote, python: str) -> Dict[str, List[Tuple[str, int]]]:
    """Every entry (name, mtime) of the image Python's site directories, user site included."""
    code = (
        "import json, os, site\n"
        "out = {}\n"
        "for d in site.getsitepackages() + [site.getusersitepackages()]:\n"
        "    if os.path.isdir(d):\n"
        "        out[d] = sorted((n, os.stat(os.path.join(d, n)).st_mtime_ns)"
        " for n in os.listdir(d))\n"
        "print(json.dumps(out))\n"
    )
    r = remote.run([python, "-c", code])
    assert r.rc == 0, r.err
    snap: Dict[str, List[Tuple[str, int]]] = {
        k: [(n, m) for n, m in v] for k, v in json.loads(r.stdout).items()
    }
    return snap


def _fake_python(path: Path, body: str) -> str:
    """A fake Python: a shell script at ``path`` that answers some calls itself (``body``) and
    hands the rest to the real one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def _pip_version(remote: SshRemote, python: str) -> Tuple[int, ...]:
    """The version of ``python``'s pip (``pip X.Y.Z from ...``); () without one."""
    r = remote.run([python, "-m", "pip", "--version"])
    words = r.text.split()
    if r.rc != 0 or len(words) < 2:
        return ()
    return tuple(int(p) for p in words[1].split(".")[:2] if p.isdigit())


def _agent(remote: SshRemote, inst: AgentInstall, *args: str, home: str = "") -> str:
    env = {**inst.env, **({"RGT_HOME": home} if home else {})}
    r = remote.run([*inst.argv, *args], env=env, timeout=120)
    assert r.rc == 0, f"{inst.argv} {args} -> {r.rc}: {r.err}"
    return r.text


class Installed:
    def __init__(self, home: str, inst: AgentInstall, seconds: float, before: object) -> None:
        self.home, self.inst, self.seconds, self.before = home, inst, seconds, before


@pytest.fixture(scope="module")
def venv_install(remote: SshRemote, tmp_path_factory: pytest.TempPathFactory) -> Installed:
    home = str(tmp_path_factory.mktemp("venv-box") / HOME_NAME)
    before = _site_snapshot(remote, _box_python(remote))
    t0 = time.monotonic()
    inst = install_agent(remote, home)
    return Installed(home, inst, time.monotonic() - t0, before)


# --- the wheel -----------------------------------------------------------------------------------


def _pyproject() -> Dict[str, object]:
    if sys.version_info >= (3, 11):
        import tomllib  # novermin
    else:  # Python < 3.11
        import tomli as tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project: Dict[str, object] = tomllib.load(f)["project"]
    return project


def _norm(req: str) -> str:
    return req.replace("'", '"').replace(" ", "")


def test_the_wheel_is_reproducible_and_holds_only_onbox_and_its_profiles(tmp_path: Path) -> None:
    a = wheelmod.build_wheel(str(tmp_path / "a"))
    b = wheelmod.build_wheel(str(tmp_path / "b"))
    assert os.path.basename(a) == f"remote_gpu_trainer-{wheelmod.version()}-py3-none-any.whl"
    assert Path(a).read_bytes() == Path(b).read_bytes()
    onbox_dir = os.path.join(ROOT, "onbox")
    expected = sorted(
        os.path.relpath(os.path.join(d, f), ROOT)
        for d, _, files in os.walk(onbox_dir)
        if "__pycache__" not in d
        for f in files
        if f.endswith(".py")
    )
    # ... and the platform profiles, package data the agent reads (onbox/profiles/data is a
    # link to profiles/, which os.walk does not follow).
    profiles = sorted(f for f in os.listdir(os.path.join(ROOT, "profiles")) if f.endswith(".toml"))
    assert profiles, "no profiles/*.toml"
    expected = sorted(expected + [f"onbox/profiles/data/{f}" for f in profiles])
    with zipfile.ZipFile(a) as zf:
        names = zf.namelist()
        code = sorted(n for n in names if ".dist-info/" not in n)
        assert code == expected and "onbox/sealing/stores/s3/core.py" in code
        assert not any(n.startswith("controller/") for n in names)
        info = f"remote_gpu_trainer-{wheelmod.version()}.dist-info"
        assert names[-1] == f"{info}/RECORD"
        record = zf.read(f"{info}/RECORD").decode().splitlines()
        for line in record[:-1]:
            name, digest, size = line.rsplit(",", 2)
            data = zf.read(name)
            assert int(size) == len(data)
            assert digest == wheelmod._record_hash(data)
        assert record[-1] == f"{info}/RECORD,,"
        assert zf.read(f"{info}/entry_points.txt").decode() == (
            "[console_scripts]\nrgt-agent = onbox.cli:main\n"
        )
        for zi in zf.infolist():
            assert zi.date_time == (1980, 1, 1, 0, 0, 0)
            assert stat.S_IMODE(zi.external_attr >> 16) == 0o644
        meta = zf.read(f"{info}/METADATA").decode()
    assert f"Name: remote-gpu-trainer\nVersion: {wheelmod.version()}\n" in meta
    requires = [ln.split(": ", 1)[1] for ln in meta.splitlines() if ln.startswith("Requires-Dist")]
    project = _pyproject()
    deps = project["dependencies"]
    extras = project["optional-dependencies"]
    assert isinstance(deps, list) and isinstance(extras, dict)
    want = [_norm(d) for d in deps if not str(d).startswith(wheelmod.LAPTOP_ONLY)]
    for extra in ("hf", "s3"):
        want += [_norm(f'{d}; extra == "{extra}"') for d in extras[extra]]
    assert [_norm(r) for r in requires] == want
    assert f"Requires-Python: {project['requires-python']}" in meta


def test_requirements_for_a_box_python_follow_the_markers() -> None:
    assert "tomli>=1.1" in wheelmod.requirements_for((3, 9, 18))
    assert "tomli>=1.1" not in wheelmod.requirements_for((3, 11, 2))
    assert wheelmod.requirements_for((3, 12, 0), ["s3", "hf"])[-2:] == [
        "huggingface_hub>=0.24",
        "boto3>=1.35",
    ]


# --- venv ----------------------------------------------------------------------------------------


def test_install_into_a_venv_and_run_it(
    remote: SshRemote, venv_install: Installed, sshd: SshServer
) -> None:
    inst = venv_install.inst
    py = probe_python(remote)
    assert (inst.method, inst.installed, inst.env) == ("venv", True, {})
    assert inst.path.startswith(os.path.join(venv_install.home, "agent", wheelmod.version() + "-"))
    assert inst.argv == [os.path.join(inst.path, "venv/bin/python"), "-I", "-m", "onbox.cli"]
    assert (inst.python, inst.python_version) == (py.path, py.version_text)
    assert _agent(remote, inst, "--version") == f"rgt-agent, version {wheelmod.version()}\n"
    assert _agent(remote, inst, "list", home=venv_install.home) is not None
    # The box Python's pip (22.3 or newer: --python) filled the venv, which has no pip of its
    # own (bootstrapping one took most of an install's time), only a `pip` script running the
    # box's pip into it, so that the remedies' "pip install X into the agent's venv" works.
    require(_pip_version(remote, py.path) >= (22, 3), f"pip 22.3 or newer for {py.path}")
    venv_bin = os.path.join(inst.path, "venv", "bin")
    assert {"pip", "pip3"} & set(os.listdir(venv_bin)) == {"pip"}, os.listdir(venv_bin)
    assert remote.run([inst.argv[0], "-I", "-c", "import pip"]).rc != 0
    # The installed package is the pushed wheel, whole, and pip is content with it.
    r = remote.run([os.path.join(venv_bin, "pip"), "check"])
    assert r.rc == 0, r.text + r.err
    r = remote.run([os.path.join(venv_bin, "pip"), "show", "remote-gpu-trainer"])
    assert r.rc == 0 and f"Version: {wheelmod.version()}" in r.text, r.text + r.err
    site = remote.run(
        [inst.argv[0], "-c", "import onbox.sealing.stores.local, click, watchdog; print(1)"]
    )
    assert site.rc == 0, site.err
    wheels = os.listdir(os.path.join(venv_install.home, "wheels"))
    assert len(wheels) == 1 and wheels[0].startswith("rgt-")
    # nothing of the image changed; nothing ran a shell on the hostile home
    assert _site_snapshot(remote, py.path) == venv_install.before
    for home in (os.path.expanduser("~"), sshd.home):
        assert not os.path.exists(os.path.join(home, "pwned"))


def test_the_agent_ignores_modules_in_its_working_directory(
    remote: SshRemote, venv_install: Installed, tmp_path: Path
) -> None:
    """The agent starts jobs from the release directory: the user's click.py or onbox/ there
    must not replace the agent's own."""
    work = tmp_path / "release"
    (work / "onbox").mkdir(parents=True)
    (work / "onbox" / "__init__.py").write_text("raise SystemExit('shadowed onbox')\n")
    (work / "click.py").write_text("raise SystemExit('shadowed click')\n")
    inst = venv_install.inst
    r = remote.sh('cd "$1" && shift && exec "$@"', str(work), *inst.argv, "--version")
    assert r.rc == 0 and "version" in r.text, r.err


def test_a_second_install_installs_nothing(remote: SshRemote, venv_install: Installed) -> None:
    first = venv_install.inst
    agent_dir = os.path.join(venv_install.home, "agent")
    entries = sorted(os.listdir(agent_dir))
    marker = os.path.join(first.path, ".rgt-agent.json")
    stamp = os.stat(marker).st_mtime_ns
    t0 = time.monotonic()
    again = install_agent(remote, venv_install.home)
    took = time.monotonic() - t0
    assert again == AgentInstall(
        first.argv, first.env, first.python, first.python_version, "venv", first.path, False
    )
    assert sorted(os.listdir(agent_dir)) == entries and os.stat(marker).st_mtime_ns == stamp
    assert took < venv_install.seconds / 2, (took, venv_install.seconds)


def test_a_fake_python_whose_pip_lacks_python_gets_a_venv_with_its_own_pip(
    remote: SshRemote, tmp_path: Path
) -> None:
    """A box Python whose pip is older than ``--python`` (22.3): the venv bootstraps its own pip
    and installs with it, as ``python -m venv`` does."""
    py = _box_python(remote)
    fake = _fake_python(
        tmp_path / "python3",
        'if [ "$1 $2 $3" = "-m pip --python" ]; then\n'
        '  echo "no such option: --python (fake pip 22.0)" >&2; exit 2\n'
        "fi\n"
        f'exec {py} "$@"\n',
    )
    home = str(tmp_path / HOME_NAME)
    inst = install_agent(remote, home, python=fake)
    assert (inst.method, inst.installed, inst.python) == ("venv", True, fake)
    assert inst.argv == [os.path.join(inst.path, "venv/bin/python"), "-I", "-m", "onbox.cli"]
    assert "fake pip 22.0" in Path(inst.path, "install.log").read_text()
    r = remote.run([inst.argv[0], "-m", "pip", "check"])
    assert r.rc == 0, r.text + r.err
    assert _agent(remote, inst, "--version") == f"rgt-agent, version {wheelmod.version()}\n"


def test_a_fake_python_without_pip_gets_a_venv_with_its_own_pip(
    remote: SshRemote, tmp_path: Path
) -> None:
    """A box Python with no pip beside it (Debian's python3 without python3-pip): the venv
    bootstraps its own pip, as ``python -m venv`` does, and the install goes through."""
    py = _box_python(remote)
    fake = _fake_python(
        tmp_path / "python3",
        'if [ "$1 $2" = "-m pip" ]; then\n'
        '  echo "$0: No module named pip" >&2; exit 1\n'
        "fi\n"
        f'exec {py} "$@"\n',
    )
    inst = install_agent(remote, str(tmp_path / HOME_NAME), python=fake)
    assert (inst.method, inst.installed) == ("venv", True)
    assert "No module named pip" in Path(inst.path, "install.log").read_text()
    r = remote.run([inst.argv[0], "-m", "pip", "check"])
    assert r.rc == 0, r.text + r.err
    assert _agent(remote, inst, "--version") == f"rgt-agent, version {wheelmod.version()}\n"


# --- an install whose agent no longer answers -----------------------------------------------------


def _break_version(inst: AgentInstall) -> Path:
    """Make the install's ``--version`` name another version, and nothing else: click reads it
    from the package's metadata, which nothing else of the agent uses."""
    (meta,) = Path(inst.path).glob(
        "venv/lib/python*/site-packages/remote_gpu_trainer-*.dist-info/METADATA"
    )
    text = meta.read_text()
    meta.write_text(text.replace(f"Version: {wheelmod.version()}\n", "Version: 0.0.0+broken\n"))
    return meta


def _status(remote: SshRemote, inst: AgentInstall, home: str, name: str) -> Dict[str, Any]:
    doc: Dict[str, Any] = json.loads(_agent(remote, inst, "status", name, "--json", home=home))
    return doc


def test_a_broken_install_a_live_agent_runs_from_is_left_whole(
    remote: SshRemote, tmp_path: Path
) -> None:
    """An install whose --version fails is installed again, but never removed from under a live
    run's agent: the new one goes next to it. Once nothing runs from one, it is redone in place."""
    home = str(tmp_path / HOME_NAME)
    first = install_agent(remote, home)
    try:
        _agent(remote, first, "start", "--name", "live", "--", "sleep", "600", home=home)
        deadline = time.monotonic() + 30
        # RUNNING, not only a pid: the state is read again after the second install, which
        # can now end before a STARTING run has got there.
        while not (
            (st := _status(remote, first, home, "live"))["agent"]["alive"]
            and st["pid"]
            and st["state"] == "RUNNING"
        ):
            assert time.monotonic() < deadline, st
            time.sleep(0.2)
        # What the install script goes by: the agent maps a file of its install.
        assert first.path in Path(f"/proc/{st['agent']['pid']}/maps").read_text()
        meta = _break_version(first)
        broken = meta.read_text()
        assert "0.0.0+broken" in _agent(remote, first, "--version")

        second = install_agent(remote, home)
        assert (second.installed, second.method) == (True, "venv")
        assert second.path == first.path + "-2"
        assert meta.read_text() == broken  # the live agent's install is left whole
        assert os.path.exists(os.path.join(first.path, ".rgt-agent.json"))
        assert _agent(remote, second, "--version") == f"rgt-agent, version {wheelmod.version()}\n"
        now = _status(remote, second, home, "live")
        assert now["agent"]["alive"] and now["state"] == "RUNNING", now
        assert (now["agent"]["pid"], now["pid"]) == (st["agent"]["pid"], st["pid"])
        assert install_agent(remote, home) == dataclasses.replace(second, installed=False)

        # Nothing runs from the newest one: broken too, it is installed again where it is.
        _agent(remote, second, "stop", "live", "--grace", "2", home=home)
        second_meta = _break_version(second)
        third = install_agent(remote, home)
        assert third == second
        assert "0.0.0+broken" not in second_meta.read_text()
        assert meta.read_text() == broken
        assert sorted(os.listdir(os.path.join(home, "agent"))) == sorted(
            os.path.basename(p) + s for p in (first.path, second.path) for s in ("", ".lock")
        )
    finally:
        _kill_run_processes(home)


# --- no venv module, no pip, old or missing Python -----------------------------------------------


def test_install_with_a_fake_python_without_the_venv_module(
    remote: SshRemote, tmp_path: Path
) -> None:
    py = _box_python(remote)
    r = remote.run([py, "-m", "pip", "--version"])
    require(r.rc == 0, f"pip for the box's {py} (Debian: python3-pip)")
    before = _site_snapshot(remote, py)
    fake = _fake_python(
        tmp_path / "bin dir" / "python3",
        'if [ "$1" = -m ] && [ "$2" = venv ]; then\n'
        '  echo "ensurepip is not available (fake Debian python3 without python3-venv)" >&2\n'
        "  exit 1\n"
        "fi\n"
        f'exec {py} "$@"\n',
    )
    home = str(tmp_path / HOME_NAME)
    inst = install_agent(remote, home, python=fake)
    assert (inst.method, inst.installed, inst.env, inst.python) == ("target", True, {}, fake)
    assert inst.argv == [fake, "-I", os.path.join(inst.path, "bin", "rgt-agent")]
    assert os.path.isdir(os.path.join(inst.path, "lib", "click"))
    assert not os.path.exists(os.path.join(inst.path, "venv"))
    assert _agent(remote, inst, "--version") == f"rgt-agent, version {wheelmod.version()}\n"
    assert _agent(remote, inst, "list", home=home) is not None
    assert _site_snapshot(remote, py) == before
    again = install_agent(remote, home, python=fake)
    assert (again.installed, again.argv) == (False, inst.argv)
    # An install cut off before its marker (here: the marker removed) is started over.
    os.unlink(os.path.join(inst.path, ".rgt-agent.json"))
    Path(inst.path, "junk-from-a-cut-off-install").write_text("x")
    redone = install_agent(remote, home, python=fake)
    assert redone == dataclasses.replace(inst)
    assert not os.path.exists(os.path.join(inst.path, "junk-from-a-cut-off-install"))
    assert _agent(remote, redone, "--version").startswith("rgt-agent, version")


def test_a_fake_python_with_no_venv_and_no_pip_is_refused_with_what_to_install(
    remote: SshRemote, tmp_path: Path
) -> None:
    py = _box_python(remote)
    fake = _fake_python(
        tmp_path / "python3",
        'case "$1 $2" in "-m venv"|"-m pip") echo "No module named $2" >&2; exit 1;; esac\n'
        f'exec {py} "$@"\n',
    )
    with pytest.raises(HostError) as e:
        install_agent(remote, str(tmp_path / "box"), python=fake)
    assert "neither a working venv module nor pip" in e.value.what
    assert e.value.remedy is not None and "python3-venv" in e.value.remedy
    assert "python3-pip" in e.value.remedy


def test_a_fake_old_python_is_refused(remote: SshRemote, tmp_path: Path) -> None:
    py = _box_python(remote)
    # Python 3.8 as the probe sees it (sys.version_info is what it reads)
    fake = _fake_python(
        tmp_path / "python3.8",
        'if [ "$1" = -c ]; then\n'
        f'  exec {py} -c \'import sys; sys.version_info = (3, 8, 18, "final", 0); '
        'exec(sys.argv[1])\' "$2"\n'
        "fi\n"
        f'exec {py} "$@"\n',
    )
    with pytest.raises(HostError) as e:
        install_agent(remote, str(tmp_path / "box"), python=fake)
    assert "Python 3.8.18" in e.value.what and "3.9 or newer" in e.value.what
    assert not os.path.exists(tmp_path / "box")  # refused before anything was changed


def test_a_missing_python_is_refused(remote: SshRemote, tmp_path: Path) -> None:
    for python in ["/nonexistent/python3", "no-such-python3"]:
        with pytest.raises(HostError) as e:
            install_agent(remote, str(tmp_path / "box"), python=python)
        assert python in e.value.what and e.value.remedy and "--python" in e.value.remedy
    for python in ["-c", "a\nb"]:
        with pytest.raises(UsageError) as u:
            install_agent(remote, str(tmp_path / "box"), python=python)
        assert u.value.field == "--python"
    with pytest.raises(UsageError) as u:
        install_agent(remote, str(tmp_path / "box"), extras=["torch"])
    assert u.value.field == "extras"


def test_local_target_probe_and_refusals(tmp_path: Path) -> None:
    """``local`` finds this machine's python3 and refuses the same way (no ssh in between)."""
    local = LocalRemote()
    py = probe_python(local)
    assert os.path.isabs(py.path) and py.version[:2] >= (3, 9)
    with pytest.raises(HostError) as e:
        install_agent(local, str(tmp_path / "box"), python=str(tmp_path / "no python"))
    assert "no python" in e.value.what
    assert not os.path.exists(tmp_path / "box")


# --- offline -------------------------------------------------------------------------------------


def test_offline_install_from_pushed_wheels(remote: SshRemote, tmp_path: Path) -> None:
    home = str(tmp_path / HOME_NAME)
    inst = install_agent(remote, home, offline=True, extras=["s3"])
    assert (inst.method, inst.installed) == ("venv", True)
    pushed = sorted(os.listdir(os.path.join(home, "wheels")))
    for dep in ("click-", "setproctitle-", "watchdog-", "boto3-", "botocore-"):
        assert any(w.startswith(dep) for w in pushed), (dep, pushed)
    log = Path(inst.path, "install.log").read_text()
    assert os.path.join(home, "wheels") in log and "Looking in indexes" not in log
    assert _agent(remote, inst, "--version") == f"rgt-agent, version {wheelmod.version()}\n"
    r = remote.run([inst.argv[0], "-c", "import boto3, onbox.sealing.stores.s3"])
    assert r.rc == 0, r.err


def test_platform_tags_for_offline_downloads() -> None:
    from controller.deploy.probe import BoxPython

    glibc = BoxPython("/p", (3, 10, 1), "cpython", "", "aarch64", ("glibc", "2.31"))
    tags = manylinux_platforms(glibc)
    assert tags[0] == "manylinux_2_31_aarch64" and "manylinux_2_17_aarch64" in tags
    assert "manylinux2014_aarch64" in tags and "manylinux_2_32_aarch64" not in tags
    assert tags[-1] == "linux_aarch64"
    musl = BoxPython("/p", (3, 10, 1), "cpython", "", "x86_64", ("", ""))
    assert manylinux_platforms(musl)[0] == "musllinux_1_2_x86_64"


def test_changed_code_makes_a_new_wheel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Same version number (as in development), changed onbox: other bytes, so another sha256 and
    another install directory on the box."""
    data = wheelmod.wheel_bytes()
    assert wheelmod.wheel_bytes() == data
    files = wheelmod.package_files()
    rel, path = files[0]
    changed = tmp_path / "changed.py"
    changed.write_bytes(Path(path).read_bytes() + b"# changed\n")
    monkeypatch.setattr(wheelmod, "package_files", lambda: [(rel, str(changed)), *files[1:]])
    assert hashlib.sha256(wheelmod.wheel_bytes()).digest() != hashlib.sha256(data).digest()
