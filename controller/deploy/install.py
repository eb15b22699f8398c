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
first on ``sys.path``. The agent always runs with ``python -I`` (isolated: neither the working
directory, which is the release of the user's code, nor PYTHONPATH can shadow its imports), and
with no extra environment, so the job it starts sees the box's own PYTHONPATH and nothing of
rgt's dependencies.

rgt itself is always the wheel built from this controller (controller/deploy/wheel.py); its
dependencies come from the box's package index (the box's own pip configuration, mirrors
included) or, with ``offline``, from wheels this machine downloads for the box's Python and
platform and pushes. An existing complete install is reused, so a second deploy installs nothing.

Finding the install takes one look at the box (``probe``: ``PROBE_SH`` runs ``_PROBE_PY`` on the
box's Python, which reports the Python and reads the marker of the newest complete install of
this wheel for it); `rgt deploy` runs that look inside its audit's round trip and hands it to
``install_agent``. A found install is reused once its agent answers ``--version`` with this
version; one that does not is installed again: in place, unless a process still runs from it (a
live run's agent or shim, which would lose its files), and then next to it, as ``<key>-<n>``.
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

from controller.deploy import wheel as wheelmod
from controller.remote import Remote, Result
from onbox.common import jobenv
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


def check_python_arg(python: Optional[str]) -> str:
    """The Python to look for on the box: ``python`` (``--python``), else ``python3``; UsageError
    for what cannot be a path or a command name."""
    asked = python or "python3"
    if not asked or asked.startswith("-") or any(c in asked for c in "\0\n"):
        raise UsageError("--python", f"{asked!r} is not a path or a command name")
    return asked


@dataclasses.dataclass(frozen=True)
class AgentWheel:
    """rgt's wheel as this controller builds it (controller/deploy/wheel.py): its sha256 names the
    install on the box."""

    version: str
    data: bytes = dataclasses.field(repr=False)
    sha256: str


def agent_wheel() -> AgentWheel:
    """This controller's wheel, built here in memory."""
    ver = wheelmod.version()
    data = wheelmod.wheel_bytes(ver)
    return AgentWheel(ver, data, hashlib.sha256(data).hexdigest())


def _extras_key(extras: Sequence[str]) -> str:
    return ",".join(sorted(set(extras)))


def install_key(wheel: AgentWheel, python: str, extras: Sequence[str] = ()) -> str:
    """The name of the install's directory under ``agent/``: the version, then a hash of the
    wheel, the Python's path and the extras (the box's probe, _PROBE_PY, computes it alike)."""
    src = "\0".join([wheel.sha256, python, _extras_key(extras)])
    return f"{wheel.version}-{hashlib.sha256(os.fsencode(src)).hexdigest()[:12]}"


@dataclasses.dataclass(frozen=True)
class Probed:
    """One look at the box: its Python and, when the look was for a wheel, the newest complete
    install of it for that Python: ``install`` (its directory's name under ``agent/``) and
    ``marker`` (the text of its marker), else None for both."""

    python: BoxPython
    install: Optional[str] = None
    marker: Optional[str] = None


# Runs under any Python from 2.7 on, so that an old one is reported instead of crashing. argv:
# the Python's path as the shell resolved it, then, to look for an install too, the agent/
# directory, rgt's version, the wheel's sha256 and the extras (as install_key names them). Prints
# one JSON line.
_PROBE_PY = r"""
import binascii, hashlib, json, os, platform, sys


def raw(s):  # an argument as the bytes it came as
    return os.fsencode(s) if hasattr(os, "fsencode") else s


def newest_install(root, key):
    # KEY, or KEY-N (N >= 2: made next to one an agent still ran from): the complete one with
    # the highest N.
    best, best_n = None, 0
    try:
        names = os.listdir(root)
    except OSError:
        names = []
    for name in names:
        tail = name[len(key) + 1:]
        if name == key:
            n = 1
        elif name.startswith(key + b"-") and tail.isdigit():
            n = int(tail)
        else:
            continue
        if n > best_n and os.path.isfile(os.path.join(root, name, b".rgt-agent.json")):
            best, best_n = name, n
    return best


out = {
    "path": binascii.hexlify(raw(sys.argv[1])).decode("ascii"),
    "version": list(sys.version_info[:3]),
    "implementation": getattr(getattr(sys, "implementation", None), "name", "cpython"),
    "abiflags": getattr(sys, "abiflags", ""),
    "machine": platform.machine(),
    "libc": list(platform.libc_ver()),
}
if len(sys.argv) > 5 and sys.argv[3]:
    root, ver, sha, extras = [raw(a) for a in sys.argv[2:6]]
    digest = hashlib.sha256(b"\0".join([sha, raw(sys.argv[1]), extras])).hexdigest()
    name = newest_install(root, ver + b"-" + digest[:12].encode("ascii"))
    out["install"] = None
    if name:
        try:
            with open(os.path.join(root, name, b".rgt-agent.json"), "rb") as f:
                out["marker"] = f.read().decode("utf-8", "replace")
            out["install"] = name.decode("ascii")
        except (IOError, OSError, UnicodeError):
            pass
print(json.dumps(out))
"""

# A shell function, for a script of its own or the audit's: `rgt_python_probe HOME PYTHON CODE
# VERSION SHA256 EXTRAS` resolves PYTHON as the agent will run it (a name on PATH, or a path: a
# relative one made absolute) and runs CODE (_PROBE_PY) with it: to report the Python and, when
# VERSION is not "", to find the install of that wheel under HOME/agent. It prints "missing" and
# why on the next line when there is no such executable file; else "path " and the path in hex
# (byte for byte, whatever it holds), what the probe printed (stderr too: its JSON comes last)
# and "rc N", N the probe's exit status.
PROBE_SH = r"""
rgt_python_probe() {
  rgt_home=$1; rgt_py=$2; rgt_code=$3; shift 3
  case "$rgt_py" in
    /*) ;;
    */*) rgt_py="$(pwd)/$rgt_py" ;;
    *) if ! rgt_py=$(command -v "$rgt_py" 2>/dev/null); then
         printf 'missing\nnot on PATH (%s)\n' "$PATH"; return 0
       fi ;;
  esac
  if [ ! -f "$rgt_py" ] || [ ! -x "$rgt_py" ]; then
    printf 'missing\n%s is not an executable file\n' "$rgt_py"; return 0
  fi
  printf 'path '; printf '%s' "$rgt_py" | od -An -v -tx1 | tr -d ' \n'; echo
  if [ -n "$1" ]; then "$rgt_py" -c "$rgt_code" "$rgt_py" "$rgt_home/agent" "$@" 2>&1
  else "$rgt_py" -c "$rgt_code" "$rgt_py" 2>&1; fi
  echo "rc $?"
}
"""

_PYTHON_REMEDY = (
    "pass --python with the path of the box's Python 3.9+ (e.g. /opt/conda/bin/python; conda is "
    "often only on the interactive PATH)"
)


def probe_args(
    python: Optional[str], wheel: Optional[AgentWheel] = None, extras: Sequence[str] = ()
) -> List[str]:
    """The arguments of ``rgt_python_probe`` after HOME: a look at ``python`` and, with
    ``wheel``, for the install of that wheel (with ``extras``) for it."""
    args = [check_python_arg(python), _PROBE_PY]
    if wheel is None:
        return [*args, "", "", ""]
    return [*args, wheel.version, wheel.sha256, _extras_key(extras)]


def parse_probe(python: Optional[str], lines: Sequence[str]) -> Probed:
    """What ``rgt_python_probe`` printed, as lines. HostError (not naming the box) when there is
    no such Python, it does not run as one, or it is older than the agent needs."""
    asked = check_python_arg(python)
    lines = list(lines)
    if lines[:1] == ["missing"]:
        where = "" if python else " on the box's non-interactive PATH"
        why = " ".join(ln.strip() for ln in lines[1:]).strip()
        raise HostError(f"no Python {asked!r}{where}: {why}", _PYTHON_REMEDY)
    path_hex = ""
    if lines and lines[0].startswith("path "):
        path_hex = lines.pop(0)[len("path ") :].strip()
    status = lines.pop()[len("rc ") :] if lines and lines[-1].startswith("rc ") else "?"
    info: Dict[str, Any] = {}
    for line in reversed(lines):
        if line.startswith("{"):
            try:
                info = json.loads(line)
            except ValueError:
                pass
            break
    try:
        version = (int(info["version"][0]), int(info["version"][1]), int(info["version"][2]))
        path = os.fsdecode(bytes.fromhex(path_hex or str(info["path"])))
    except (ValueError, KeyError, TypeError, IndexError):
        text = "\n".join(lines).strip()
        raise HostError(
            f"{asked!r} does not run as a Python (exit {status}): {text[-500:]}",
            "pass --python with the path of the box's Python 3.9+",
        ) from None
    libc = info.get("libc")
    py = BoxPython(
        path=path,
        version=version,
        implementation=str(info.get("implementation", "cpython")),
        abiflags=str(info.get("abiflags", "")),
        machine=str(info.get("machine", "")),
        libc=(str(libc[0]), str(libc[1]))
        if isinstance(libc, list) and len(libc) == 2
        else ("", ""),
    )
    need = wheelmod.REQUIRES_PYTHON
    if version[:2] < need:
        raise HostError(
            f"{py.path} is Python {py.version_text}; rgt's agent needs {need[0]}.{need[1]} "
            "or newer",
            "pass --python with a newer Python on the box (conda, pyenv, /usr/bin/python3.X)",
        )
    install, marker = info.get("install"), info.get("marker")
    if not isinstance(install, str) or not isinstance(marker, str):
        return Probed(py)
    return Probed(py, install, marker)


def probe(
    remote: Remote,
    python: Optional[str] = None,
    box_home: Optional[str] = None,
    wheel: Optional[AgentWheel] = None,
    extras: Sequence[str] = (),
) -> Probed:
    """Look at the box's Python (``python``: a path or a name on PATH, else ``python3`` on the
    box's non-interactive PATH) and, with ``box_home`` and ``wheel``, for the install of that wheel
    for it, in one round trip. HostError when the Python is missing, does not run, or is older
    than 3.9."""
    args = probe_args(python, wheel if box_home else None, extras)
    r = remote.sh(PROBE_SH + 'rgt_python_probe "$@"\n', box_home or "", *args, timeout=120)
    try:
        return parse_probe(python, r.text.splitlines())
    except HostError as e:
        raise HostError(f"{remote.target.label}: {e.what}", e.remedy) from None


def probe_python(remote: Remote, python: Optional[str] = None) -> BoxPython:
    """The box's Python: ``python`` (a path or a name on PATH), else ``python3`` on the box's
    non-interactive PATH. HostError when it is missing, does not run, or is older than 3.9."""
    return probe(remote, python).python


# $1 dir, $2 file name: stdin into dir/name, atomically; nothing when it is already there.
_PUT = r"""
set -eu
umask 077
[ -f "$1/$2" ] && { cat >/dev/null; exit 0; }
mkdir -p "$1"
cat > "$1/.$2.part.$$"
mv -f "$1/.$2.part.$$" "$1/$2"
"""

# $1 python, $2 install dir, $3 requirement, $4 find-links dir for --offline ("" otherwise),
# $5 marker for a venv install, $6 marker for a --target install, $7 the launcher, $8 "1" to
# discard an existing install. Prints "reused", "venv" or "target"; exit 20 when pip failed,
# 21 when the box has neither a working venv module nor pip, 23 ("busy") when the directory must
# be replaced but a process still runs from it.
_INSTALL = r"""
set -u
umask 077   # the agent's install, like every directory of rgt's on the box, is the user's alone
py="$1"; dir="$2"; req="$3"; links="$4"; mark_venv="$5"; mark_target="$6"; launcher="$7"
mkdir -p "${dir%/*}"
exec 9>>"$dir.lock"
if command -v flock >/dev/null 2>&1; then flock 9; fi   # one install at a time; none: go on
if [ "$8" != 1 ] && [ -f "$dir/.rgt-agent.json" ]; then echo reused; exit 0; fi
# Every agent and shim loads its setproctitle extension from its install, so a process that maps
# a file of this directory runs from it: removing the directory would pull its files from under
# a live run (a respawned agent would not start). The caller installs next to it instead.
if [ -e "$dir" ]; then
  real=$(cd "$dir" 2>/dev/null && pwd -P) || real=$dir
  if grep -qsF -e "$dir/" -e "$real/" /proc/[0-9]*/maps; then echo busy; exit 23; fi
fi
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
        method = json.loads(marker or "").get("method")
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
    if not posixpath.isabs(box_home) or "\0" in box_home:
        raise UsageError(jobenv.HOME, f"{box_home!r} is not an absolute path on the box")
    unknown = sorted(set(extras) - set(wheelmod.EXTRAS))
    if unknown:
        raise UsageError(
            "extras", f"unknown {', '.join(unknown)}", f"use {', '.join(sorted(wheelmod.EXTRAS))}"
        )
    wheel = wheel or agent_wheel()
    if probed is None:
        probed = probe(remote, python, box_home, wheel, extras)
    py = probed.python
    existing = found_install(probed, box_home, wheel, extras)
    if existing is not None and not broken and _runs(remote, existing.argv, wheel.version):
        return existing
    ver = wheel.version
    wheel_dir = posixpath.join(box_home, "wheels", f"rgt-{wheel.sha256[:12]}")
    _put(remote, wheel_dir, wheelmod.wheel_filename(ver), wheel.data)
    links = ""
    if offline:
        links = posixpath.join(box_home, "wheels")
        with tempfile.TemporaryDirectory(prefix="rgt-wheels-") as tmp:
            _push_wheels(remote, download_wheels(py, extras, tmp), links)
    requirement = _direct_reference(posixpath.join(wheel_dir, wheelmod.wheel_filename(ver)), extras)
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
    install = _install(how, dir_, py, installed)
    if not _runs(remote, install.argv, ver):
        raise HostError(
            f"{remote.target.label}: the agent installed in {dir_} does not run",
            f"see {dir_}/install.log on the box",
        )
    return install


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
