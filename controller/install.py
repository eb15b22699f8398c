"""Installing the agent (``rgt-agent``) on the box, in its own environment, from rgt's own wheel.

Box layout (under RGT_HOME on the box)::

    agent/<version>-<key>/          one install; <key> hashes the wheel, the Python and the extras
        .rgt-agent.json             written last: the install is complete (argv, method, Python)
        venv/                       method "venv": a virtual environment of the box's Python
        lib/, bin/rgt-agent         method "target": ``pip install --target`` and a launcher
        install.log
    agent/<version>-<key>.lock      held (flock) while an install runs
    wheels/rgt-<sha12>/<wheel>      rgt's wheel as pushed
    wheels/*.whl                    dependencies pushed for --offline

The agent runs on the box's Python (``--python`` when the right one is not first on a
non-interactive PATH; 3.9 or newer), never touching the image's own packages: into a venv when the
``venv`` module works; else, on images without it (Debian's python3 without python3-venv), with
``pip install --target`` into a private directory and a small launcher that puts that directory
first on ``sys.path``. The agent always runs with ``python -I`` (isolated: neither the working
directory, which is the release of the user's code, nor PYTHONPATH can shadow its imports), and
with no extra environment, so the job it starts sees the box's own PYTHONPATH and nothing of
rgt's dependencies.

rgt itself is always the wheel built from this controller (controller/wheel.py); its
dependencies come from the box's package index (the box's own pip configuration, mirrors
included) or, with ``offline``, from wheels this machine downloads for the box's Python and
platform and pushes. An existing complete install is reused, so a second deploy installs nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import posixpath
import re
import subprocess
import sys
import tempfile
import urllib.parse
from typing import Any, Dict, List, Optional, Sequence, Tuple

from controller import wheel as wheelmod
from controller.remote import Remote
from onbox.errors import HostError, UsageError

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


@dataclasses.dataclass(frozen=True)
class BoxPython:
    """The box's Python, as probed."""

    path: str  # as the agent will run it: absolute, the user's --python spelling kept
    version: Tuple[int, int, int]
    implementation: str
    abiflags: str
    machine: str
    libc: Tuple[str, str]

    @property
    def version_text(self) -> str:
        return ".".join(str(v) for v in self.version)


# Runs under any Python from 2.7 on, so that an old one is reported instead of crashing.
_PROBE_PY = """\
import json, platform, sys
print(json.dumps({
    "version": list(sys.version_info[:3]),
    "implementation": getattr(getattr(sys, "implementation", None), "name", "cpython"),
    "abiflags": getattr(sys, "abiflags", ""),
    "machine": platform.machine(),
    "libc": list(platform.libc_ver()),
}))
"""

# $1 python (a name on PATH or a path), $2 the probe. Prints the absolute path, NUL, the probe's
# JSON.
_PROBE = r"""
py="$1"
case "$py" in
  /*) [ -x "$py" ] || { echo "$py is not an executable file" >&2; exit 127; } ;;
  */*) py="$(pwd)/$py"; [ -x "$py" ] || { echo "$py is not an executable file" >&2; exit 127; } ;;
  *) found=$(command -v "$py" 2>/dev/null) || { echo "no $py on PATH ($PATH)" >&2; exit 127; }
     py="$found" ;;
esac
printf '%s\0' "$py"
exec "$py" -c "$2"
"""

# $1 dir, $2 file name: stdin into dir/name, atomically; nothing when it is already there.
_PUT = r"""
set -eu
[ -f "$1/$2" ] && { cat >/dev/null; exit 0; }
mkdir -p "$1"
cat > "$1/.$2.part.$$"
mv -f "$1/.$2.part.$$" "$1/$2"
"""

# $1 python, $2 install dir, $3 requirement, $4 find-links dir for --offline ("" otherwise),
# $5 marker for a venv install, $6 marker for a --target install, $7 the launcher, $8 "1" to
# discard an existing install. Prints "reused", "venv" or "target"; exit 20 when pip failed,
# 21 when the box has neither a working venv module nor pip.
_INSTALL = r"""
set -u
py="$1"; dir="$2"; req="$3"; links="$4"; mark_venv="$5"; mark_target="$6"; launcher="$7"
mkdir -p "${dir%/*}"
exec 9>>"$dir.lock"
if command -v flock >/dev/null 2>&1; then flock 9; fi   # one install at a time; none: go on
[ "$8" = 1 ] && rm -f -- "$dir/.rgt-agent.json"
if [ -f "$dir/.rgt-agent.json" ]; then echo reused; exit 0; fi
rm -rf -- "$dir"
mkdir -p "$dir" || exit 22
log="$dir/install.log"
# The box's pip configuration (its index, its mirrors) applies; what would send the install
# elsewhere (user site) or refuse it does not.
export PIP_USER=0 PIP_REQUIRE_VIRTUALENV=0 PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1
if [ -n "$links" ]; then set -- --no-index --find-links "$links"; else set --; fi
mark() {
  printf '%s\n' "$1" > "$dir/.rgt-agent.json.part" &&
    mv -f "$dir/.rgt-agent.json.part" "$dir/.rgt-agent.json"
}
vpy="$dir/venv/bin/python"
if "$py" -m venv "$dir/venv" >"$log" 2>&1 && "$vpy" -m pip --version >>"$log" 2>&1; then
  if ! "$vpy" -m pip install --no-warn-script-location "$@" "$req" >>"$log" 2>&1; then
    tail -n 40 "$log" >&2; exit 20
  fi
  mark "$mark_venv" || exit 22
  echo venv; exit 0
fi
echo "--- no working venv module: pip install --target" >>"$log"
rm -rf -- "$dir/venv"
if ! "$py" -m pip --version >>"$log" 2>&1; then tail -n 20 "$log" >&2; exit 21; fi
if ! "$py" -m pip install --target "$dir/lib" --no-warn-script-location "$@" "$req" \
    >>"$log" 2>&1; then
  tail -n 40 "$log" >&2; exit 20
fi
mkdir -p "$dir/bin" && printf '%s' "$launcher" > "$dir/bin/rgt-agent" || exit 22
mark "$mark_target" || exit 22
echo target
"""

# The agent's entry point for a --target install (run as `python -I <this file>`): the private
# directory goes first on sys.path, so the image's packages never shadow the agent's.
_LAUNCHER = """\
# rgt-agent, installed with pip --target (this Python has no working venv module)
import sys

sys.path.insert(0, {lib})
from onbox.cli import main

sys.exit(main())
"""


def probe_python(remote: Remote, python: Optional[str] = None) -> BoxPython:
    """The box's Python: ``python`` (a path or a name on PATH), else ``python3`` on the box's
    non-interactive PATH. HostError when it is missing, does not run, or is older than 3.9."""
    asked = python or "python3"
    if not asked or asked.startswith("-") or any(c in asked for c in "\0\n"):
        raise UsageError("--python", f"{asked!r} is not a path or a command name")
    r = remote.sh(_PROBE, asked, _PROBE_PY, timeout=120)
    path_b, sep, out = r.stdout.partition(b"\0")
    if r.rc == 127 and not sep:
        where = "" if python else " on the box's non-interactive PATH"
        raise HostError(
            f"{remote.target.label}: no Python {asked!r}{where}: {r.err.strip()}",
            "pass --python with the path of the box's Python 3.9+ (e.g. /opt/conda/bin/python)",
        )
    try:
        info: Dict[str, Any] = json.loads(out)
        version = (int(info["version"][0]), int(info["version"][1]), int(info["version"][2]))
    except (ValueError, KeyError, TypeError, IndexError):
        raise HostError(
            f"{remote.target.label}: {asked!r} does not run as a Python "
            f"(exit {r.rc}): {(r.err or r.text).strip()[-500:]}",
            "pass --python with the path of the box's Python 3.9+",
        ) from None
    py = BoxPython(
        path=os.fsdecode(path_b),
        version=version,
        implementation=str(info.get("implementation", "cpython")),
        abiflags=str(info.get("abiflags", "")),
        machine=str(info.get("machine", "")),
        libc=(str(info["libc"][0]), str(info["libc"][1])) if info.get("libc") else ("", ""),
    )
    need = wheelmod.REQUIRES_PYTHON
    if version[:2] < need:
        raise HostError(
            f"{remote.target.label}: {py.path} is Python {py.version_text}; rgt's agent needs "
            f"{need[0]}.{need[1]} or newer",
            "pass --python with a newer Python on the box (conda, pyenv, /usr/bin/python3.X)",
        )
    return py


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
    p = subprocess.run(argv + reqs, stdin=subprocess.DEVNULL, capture_output=True, timeout=1800)
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


def install_agent(
    remote: Remote,
    box_home: str,
    python: Optional[str] = None,
    offline: bool = False,
    extras: Sequence[str] = (),
    *,
    timeout: float = INSTALL_TIMEOUT,
) -> AgentInstall:
    """Make sure rgt's agent, as this controller's own version, is installed on the box under
    ``box_home/agent/``, and return how to run it. Reuses a complete install (after checking that
    it runs); installs otherwise, into a venv or, without the venv module, with pip --target."""
    if not posixpath.isabs(box_home) or "\0" in box_home:
        raise UsageError("RGT_HOME", f"{box_home!r} is not an absolute path on the box")
    unknown = sorted(set(extras) - set(wheelmod.EXTRAS))
    if unknown:
        raise UsageError(
            "extras", f"unknown {', '.join(unknown)}", f"use {', '.join(sorted(wheelmod.EXTRAS))}"
        )
    py = probe_python(remote, python)
    ver = wheelmod.version()
    data = wheelmod.wheel_bytes(ver)
    sha = hashlib.sha256(data).hexdigest()
    key_src = "\0".join([sha, py.path, ",".join(sorted(set(extras)))])
    key = f"{ver}-{hashlib.sha256(os.fsencode(key_src)).hexdigest()[:12]}"
    dir_ = posixpath.join(box_home, "agent", key)
    wheel_dir = posixpath.join(box_home, "wheels", f"rgt-{sha[:12]}")
    wheel_path = posixpath.join(wheel_dir, wheelmod.wheel_filename(ver))
    venv_argv = [posixpath.join(dir_, "venv", "bin", "python"), "-I", "-m", "onbox.cli"]
    target_argv = [py.path, "-I", posixpath.join(dir_, "bin", "rgt-agent")]

    def marker(method: str, argv: List[str]) -> str:
        return json.dumps(
            {
                "argv": argv,
                "env": {},
                "method": method,
                "python": py.path,
                "python_version": py.version_text,
                "version": ver,
                "wheel_sha256": sha,
                "extras": sorted(set(extras)),
            }
        )

    def result(method: str, installed: bool) -> AgentInstall:
        argv = venv_argv if method == "venv" else target_argv
        return AgentInstall(argv, {}, py.path, py.version_text, method, dir_, installed)

    existing = _read_marker(remote, dir_)
    if existing is not None and _runs(remote, result(existing, False).argv, ver):
        return result(existing, False)
    _put(remote, wheel_dir, wheelmod.wheel_filename(ver), data)
    links = ""
    if offline:
        links = posixpath.join(box_home, "wheels")
        with tempfile.TemporaryDirectory(prefix="rgt-wheels-") as tmp:
            _push_wheels(remote, download_wheels(py, extras, tmp), links)
    launcher = _LAUNCHER.format(lib=ascii(posixpath.join(dir_, "lib")))
    r = remote.sh(
        _INSTALL,
        py.path,
        dir_,
        _direct_reference(wheel_path, extras),
        links,
        marker("venv", venv_argv),
        marker("target", target_argv),
        launcher,
        "1" if existing is not None else "0",
        timeout=timeout,
    )
    how = r.text.strip()
    installed = how != "reused"
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
    if r.rc != 0 or how not in ("reused", "venv", "target"):
        raise HostError(
            f"{remote.target.label}: installing the agent in {dir_} failed (exit {r.rc}): "
            f"{(r.err or r.text).strip()[-2000:]}"
        )
    if how == "reused":  # another deploy finished the same install while we waited for the lock
        how = _read_marker(remote, dir_) or "venv"
    install = result(how, installed)
    if not _runs(remote, install.argv, ver):
        raise HostError(
            f"{remote.target.label}: the agent installed in {dir_} does not run",
            f"see {dir_}/install.log on the box",
        )
    return install


def _read_marker(remote: Remote, dir_: str) -> Optional[str]:
    """The method of the complete install in ``dir_``, or None."""
    r = remote.run(["cat", posixpath.join(dir_, MARKER)], timeout=60)
    if r.rc != 0:
        return None
    try:
        method = json.loads(r.stdout).get("method")
    except (ValueError, AttributeError):
        return None
    return method if method in ("venv", "target") else None


def _runs(remote: Remote, argv: List[str], ver: str) -> bool:
    """Whether the installed agent answers ``--version`` with ``ver``."""
    r = remote.run([*argv, "--version"], timeout=120)
    return r.rc == 0 and ver in r.text
