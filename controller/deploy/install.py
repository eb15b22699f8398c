"""Installing the agent (``rgt-agent``) on the box, in its own environment, from rgt's own wheel.

Box layout (under RGT_HOME on the box)::

    agent/<version>-<key>/          one install; <key> hashes the wheel, the Python and the extras
        .rgt-agent.json             written last: the install is complete (argv, method, Python)
        venv/                       method "venv": a virtual environment of the box's Python
        lib/, bin/rgt-agent         method "target": ``pip install --target`` and a launcher
        install.log
    agent/<version>-<key>-<n>/      the same install made again beside one whose --version
                                    failed while a live run's agent or shim ran from it (n = 2,
                                    3, ...); the complete one with the highest n is the one used
    agent/<version>-<key>.lock      held (flock) while an install runs
    wheels/rgt-<sha12>/<wheel>      rgt's wheel as pushed
    wheels/*.whl                    dependencies pushed for --offline

The agent runs on the box's Python (``--python`` when the right one is not first on a
non-interactive PATH; 3.9 or newer), never touching the image's own packages: into a venv when the
``venv`` module works; else, on images without it (Debian's python3 without python3-venv), with
``pip install --target`` into a private directory and a small launcher that puts that directory
first on ``sys.path``. The venv has no pip of its own when the box Python's pip can install into
it (pip 22.3 or newer: ``--python``), which saves bootstrapping one (most of an install's time);
its ``bin/pip`` is a two-line script running that pip into the venv, so ``<install>/venv/bin/pip
install ...`` adds a package to it as in any venv. With an
older pip, the venv gets its own, as ``python -m venv`` makes it. The agent always runs with
``python -I`` (isolated: neither the working directory, which is the release of the user's code,
nor PYTHONPATH can shadow its imports), and with no extra environment, so the job it starts sees
the box's own PYTHONPATH and nothing of rgt's dependencies.

rgt itself is always the wheel built from this controller (controller/deploy/wheel.py); its
dependencies come from the box's package index (the box's own pip configuration, mirrors
included) or, with ``offline``, from wheels this machine downloads for the box's Python and
platform and pushes. An existing complete install is reused, so a second deploy installs nothing.

Finding the install takes one look at the box (controller/deploy/probe.py: the Python, and the
marker of the newest complete install of this wheel for it); `rgt deploy` runs that look inside
its audit's round trip and hands it to ``install_agent``. A found install is reused once its
agent answers ``--version`` with this version; one that does not is installed again: in place,
unless a process still runs from it (a live run's agent or shim, which would lose its files), and
then next to it, as ``<key>-<n>``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import posixpath
import re
import sys
import tempfile
import urllib.parse
from typing import Dict, List, Optional, Sequence, Tuple

from controller import children, shell
from controller.deploy import wheel as wheelmod
from controller.deploy.probe import BoxPython, Probed, extras_key, probe
from controller.deploy.wheel import AgentWheel, agent_wheel
from controller.remote import Remote, Result
from onbox.common import jobenv, jsondoc
from onbox.common.errors import HostError, UsageError

MARKER = ".rgt-agent.json"
INSTALL_TIMEOUT = 1800.0  # pip on a slow mirror
_WHEEL_NAME = re.compile(r"[A-Za-z0-9_.+!-]+\.whl\Z")


@dataclasses.dataclass(frozen=True)
class AgentInstall:
    """An agent installed on the box. ``argv`` runs ``rgt-agent`` there (append its arguments) with
    ``env`` added to the environment; they are what RunRecord.agent / agent_env keep.
    ``method`` is "venv" or "target"; ``installed`` is False when a complete install was reused."""

    argv: List[str]
    env: Dict[str, str]
    python: str
    python_version: str
    method: str
    path: str
    installed: bool


def install_key(wheel: AgentWheel, python: str, extras: Sequence[str] = ()) -> str:
    """The name of the install's directory under ``agent/``: the version, then a hash of the
    wheel, the Python's path and the extras (controller/shell/python_probe.py, the box's probe,
    computes it alike)."""
    src = "\0".join([wheel.sha256, python, extras_key(extras)])
    return f"{wheel.version}-{hashlib.sha256(os.fsencode(src)).hexdigest()[:12]}"


# The box's side, as scripts of their own (their arguments are described in each file).
_PUT = shell.script("put.sh")  # stdin into a file, atomically
_INSTALL = shell.script("install.sh")  # the install itself: a venv, else pip --target
MAX_NEXT = 20  # installs tried next to one that agents still run from

# The agent's entry point for a --target install (run as `python -I <this file>`): the private
# directory goes first on sys.path, so the image's packages never shadow the agent's.
_LAUNCHER = """\
# rgt-agent, installed with pip --target (this Python has no working venv module)
import sys

sys.path.insert(0, {lib})
from onbox.cli import main

sys.exit(main())
"""


def _put(remote: Remote, box_dir: str, name: str, data: bytes) -> None:
    r = remote.sh(_PUT, box_dir, name, input=data, timeout=600)
    if r.rc != 0:
        raise HostError(f"{remote.target.label}: cannot write {box_dir}/{name}: {r.err.strip()}")


def manylinux_platforms(py: BoxPython) -> List[str]:
    """pip ``--platform`` tags of wheels that run on the box (glibc or musl Linux)."""
    arch = py.machine or "x86_64"
    libc, ver = py.libc
    out: List[str] = []
    m = re.match(r"(\d+)\.(\d+)", ver)
    if libc == "glibc" and m and m.group(1) == "2":
        minor = int(m.group(2))
        out += [f"manylinux_2_{k}_{arch}" for k in range(minor, 4, -1)]
        legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
        out += [f"{tag}_{arch}" for k, tag in sorted(legacy.items(), reverse=True) if minor >= k]
    else:
        out += [f"musllinux_1_{k}_{arch}" for k in (2, 1)]
    return [*out, f"linux_{arch}"]


def download_wheels(py: BoxPython, extras: Sequence[str], dest: str) -> List[str]:
    """Wheels of the agent's dependencies for the box's Python and platform, downloaded here with
    this machine's pip (its index) into ``dest``; returns their paths."""
    reqs = wheelmod.requirements_for(py.version, extras)
    xy = f"{py.version[0]}{py.version[1]}"
    argv = [
        sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--dest", dest,
        "--disable-pip-version-check", "--no-input",
        "--python-version", f"{py.version[0]}.{py.version[1]}",
    ]  # fmt: skip
    if py.implementation == "cpython":
        argv += ["--implementation", "cp", "--abi", f"cp{xy}{py.abiflags}"]
    for plat in manylinux_platforms(py):
        argv += ["--platform", plat]
    p = children.run(argv + reqs, timeout=1800)
    if p.returncode != 0:
        raise HostError(
            "cannot download the agent's dependencies for --offline "
            f"(Python {py.version_text}, {py.machine}): "
            + p.stderr.decode("utf-8", "replace").strip()[-2000:],
            "check this machine's pip and its index, or deploy without --offline",
        )
    return sorted(os.path.join(dest, f) for f in os.listdir(dest) if f.endswith(".whl"))


def _push_wheels(remote: Remote, paths: Sequence[str], box_dir: str) -> None:
    r = remote.run(["ls", "-1", box_dir], timeout=120)
    have = set(r.text.splitlines()) if r.rc == 0 else set()
    for path in paths:
        name = os.path.basename(path)
        if name in have or not _WHEEL_NAME.match(name):
            continue
        with open(path, "rb") as f:
            _put(remote, box_dir, name, f.read())


def _direct_reference(path: str, extras: Sequence[str]) -> str:
    """``remote-gpu-trainer[extras] @ file:///...``: pip installs exactly this file, never a
    same-named project from an index; the URL encoding carries any byte of the path."""
    url = "file://" + urllib.parse.quote(os.fsencode(path))
    extra = f"[{','.join(sorted(set(extras)))}]" if extras else ""
    return f"{wheelmod.DIST_NAME}{extra} @ {url}"


def _argv(method: str, dir_: str, py: BoxPython) -> List[str]:
    """How an install of ``method`` in ``dir_`` runs ``rgt-agent``."""
    if method == "venv":
        return [posixpath.join(dir_, "venv", "bin", "python"), "-I", "-m", "onbox.cli"]
    return [py.path, "-I", posixpath.join(dir_, "bin", "rgt-agent")]


def _install(method: str, dir_: str, py: BoxPython, installed: bool) -> AgentInstall:
    return AgentInstall(
        _argv(method, dir_, py), {}, py.path, py.version_text, method, dir_, installed
    )


def _method(marker: Optional[str]) -> Optional[str]:
    """The method a marker's text names, or None when it names none."""
    try:
        method = jsondoc.loads(marker or "").get("method")
    except (ValueError, AttributeError):
        return None
    return method if method in ("venv", "target") else None


def _suffix(name: str, key: str) -> Optional[int]:
    """1 for the install directory ``key``, N for ``key-N`` (N >= 2), None for any other name."""
    if name == key:
        return 1
    tail = name[len(key) + 1 :]
    if name.startswith(key + "-") and tail.isdigit() and tail.isascii() and int(tail) >= 2:
        return int(tail)
    return None


def found_install(
    probed: Probed, box_home: str, wheel: AgentWheel, extras: Sequence[str] = ()
) -> Optional[AgentInstall]:
    """The complete install of ``wheel`` that ``probed`` (a look for it) found for its Python, or
    None. Found is not proven: its ``--version`` (``answers_version``) says whether it runs."""
    key = install_key(wheel, probed.python.path, extras)
    if probed.install is None or _suffix(probed.install, key) is None:
        return None
    method = _method(probed.marker)
    if method is None:
        return None
    return _install(method, posixpath.join(box_home, "agent", probed.install), probed.python, False)


def answers_version(rc: int, output: str, ver: str) -> bool:
    """Whether an installed agent's ``--version`` (its exit status and output) says that it runs
    and is version ``ver``."""
    return rc == 0 and ver in output


def install_agent(
    remote: Remote,
    box_home: str,
    python: Optional[str] = None,
    offline: bool = False,
    extras: Sequence[str] = (),
    *,
    timeout: float = INSTALL_TIMEOUT,
    wheel: Optional[AgentWheel] = None,
    probed: Optional[Probed] = None,
    broken: bool = False,
) -> AgentInstall:
    """Make sure rgt's agent, as this controller's own version, is installed on the box under
    ``box_home/agent/``, and return how to run it. Reuses a complete install (after checking that
    it runs); installs otherwise, into a venv or, without the venv module, with pip --target.

    ``wheel`` and ``probed``: this controller's wheel and a look at the box for it (``probe``;
    the audit's), when the caller has them; else they are made here (one round trip). ``broken``:
    the caller ran the install ``probed`` found and its ``--version`` failed: it is not run again,
    but replaced; in place, or next to it (``<key>-N``) while an agent or shim runs from it."""
    _check_request(box_home, extras)
    wheel = wheel or agent_wheel()
    if probed is None:
        probed = probe(remote, python, box_home, wheel, extras)
    py = probed.python
    existing = found_install(probed, box_home, wheel, extras)
    if existing is not None and not broken and _runs(remote, existing.argv, wheel.version):
        return existing
    requirement, links = _push_agent_wheels(remote, box_home, wheel, py, extras, offline)
    key = install_key(wheel, py.path, extras)
    dir_ = existing.path if existing is not None else posixpath.join(box_home, "agent", key)
    discard = existing is not None
    for _ in range(MAX_NEXT):
        r = _run_install(remote, py, dir_, requirement, links, wheel, extras, discard, timeout)
        if r.rc != 23:
            break
        # An agent or shim runs from dir_: leave it whole, install in the next directory.
        n = _suffix(posixpath.basename(dir_), key) or 1
        dir_, discard = posixpath.join(box_home, "agent", f"{key}-{n + 1}"), False
    else:
        raise HostError(
            f"{remote.target.label}: the agent needs installing again, but processes run from "
            f"{MAX_NEXT} of its install directories up to {dir_}",
            "stop the runs on the box (rgt stop), then deploy again",
        )
    how = r.text.strip()
    installed = how != "reused"
    _check_installed(remote, r, py, dir_, offline)
    if how == "reused":  # another deploy finished the same install while we waited for the lock
        how = _read_marker(remote, dir_) or "venv"
    install = _install(how, dir_, py, installed)
    if not _runs(remote, install.argv, wheel.version):
        raise HostError(
            f"{remote.target.label}: the agent installed in {dir_} does not run",
            f"see {dir_}/install.log on the box",
        )
    return install


def _check_request(box_home: str, extras: Sequence[str]) -> None:
    """UsageError for a box home that is not an absolute path, or an extra the wheel lacks."""
    if not posixpath.isabs(box_home) or "\0" in box_home:
        raise UsageError(jobenv.HOME, f"{box_home!r} is not an absolute path on the box")
    unknown = sorted(set(extras) - set(wheelmod.EXTRAS))
    if unknown:
        raise UsageError(
            "extras", f"unknown {', '.join(unknown)}", f"use {', '.join(sorted(wheelmod.EXTRAS))}"
        )


def _push_agent_wheels(
    remote: Remote,
    box_home: str,
    wheel: AgentWheel,
    py: BoxPython,
    extras: Sequence[str],
    offline: bool,
) -> Tuple[str, str]:
    """Push rgt's wheel (and, ``offline``, its dependencies' for the box's Python) to the box:
    the requirement pip installs, and the find-links directory ("" without ``offline``)."""
    wheel_dir = posixpath.join(box_home, "wheels", f"rgt-{wheel.sha256[:12]}")
    filename = wheelmod.wheel_filename(wheel.version)
    _put(remote, wheel_dir, filename, wheel.data)
    links = ""
    if offline:
        links = posixpath.join(box_home, "wheels")
        with tempfile.TemporaryDirectory(prefix="rgt-wheels-") as tmp:
            _push_wheels(remote, download_wheels(py, extras, tmp), links)
    return _direct_reference(posixpath.join(wheel_dir, filename), extras), links


def _check_installed(remote: Remote, r: Result, py: BoxPython, dir_: str, offline: bool) -> None:
    """HostError, saying what to do, when the install script's run ``r`` did not install."""
    if r.rc == 21:
        raise HostError(
            f"{remote.target.label}: {py.path} (Python {py.version_text}) has neither a working "
            "venv module nor pip, so rgt's agent cannot be installed without changing the image",
            "install python3-venv (Debian/Ubuntu: apt-get install python3-venv) or python3-pip, "
            "or pass --python with another Python",
        )
    if r.rc == 20:
        where = "the wheels pushed for --offline" if offline else "the box's package index"
        raise HostError(
            f"{remote.target.label}: pip could not install the agent's dependencies from {where}:"
            f" {r.err.strip()[-2000:]}",
            "deploy with --offline to bring them from this machine"
            if not offline
            else "check that this machine's pip can download wheels for the box's platform",
        )
    if r.rc != 0 or r.text.strip() not in ("reused", "venv", "target"):
        raise HostError(
            f"{remote.target.label}: installing the agent in {dir_} failed (exit {r.rc}): "
            f"{(r.err or r.text).strip()[-2000:]}"
        )


def _run_install(
    remote: Remote,
    py: BoxPython,
    dir_: str,
    requirement: str,
    links: str,
    wheel: AgentWheel,
    extras: Sequence[str],
    discard: bool,
    timeout: float,
) -> Result:
    """One run of the install script for ``dir_``."""

    def marker(method: str) -> str:
        return json.dumps(
            {
                "argv": _argv(method, dir_, py),
                "env": {},
                "method": method,
                "python": py.path,
                "python_version": py.version_text,
                "version": wheel.version,
                "wheel_sha256": wheel.sha256,
                "extras": sorted(set(extras)),
            }
        )

    return remote.sh(
        _INSTALL,
        py.path,
        dir_,
        requirement,
        links,
        marker("venv"),
        marker("target"),
        _LAUNCHER.format(lib=ascii(posixpath.join(dir_, "lib"))),
        "1" if discard else "0",
        timeout=timeout,
    )


def _read_marker(remote: Remote, dir_: str) -> Optional[str]:
    """The method of the complete install in ``dir_``, or None."""
    r = remote.run(["cat", posixpath.join(dir_, MARKER)], timeout=60)
    return _method(r.text) if r.rc == 0 else None


def _runs(remote: Remote, argv: List[str], ver: str) -> bool:
    """Whether the installed agent answers ``--version`` with ``ver``."""
    r = remote.run([*argv, "--version"], timeout=120)
    return answers_version(r.rc, r.text, ver)
