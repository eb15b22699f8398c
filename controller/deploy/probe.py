"""One look at the box's Python and, for a wheel, at the agent's install of it, in one round trip.

``PROBE_SH`` (controller/shell/python_probe.sh) defines ``rgt_python_probe``, which resolves the
Python as the agent will run it and runs ``PROBE_PY`` (controller/shell/python_probe.py) with it:
that reports the Python and reads the marker of the newest complete install of this wheel for it
under ``agent/`` (its directory's name is install.py's ``install_key``, computed alike there).
``probe`` runs it as a script of its own; `rgt deploy` runs the same function inside its audit's
round trip (controller/deploy/audit.py) and reads it with ``parse_probe``. What is found is only
found: controller/deploy/install.py decides whether it runs and installs otherwise.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

from controller import shell
from controller.deploy import wheel as wheelmod
from controller.remote import Remote
from onbox.common import jsondoc
from onbox.common.errors import HostError, UsageError

PROBE_SH = shell.script("python_probe.sh")
PROBE_PY = shell.script("python_probe.py")


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


def extras_key(extras: Sequence[str]) -> str:
    """The extras as install.install_key and the probe spell them: sorted, once each, joined by
    commas."""
    return ",".join(sorted(set(extras)))


@dataclasses.dataclass(frozen=True)
class Probed:
    """One look at the box: its Python and, when the look was for a wheel, the newest complete
    install of it for that Python: ``install`` (its directory's name under ``agent/``) and
    ``marker`` (the text of its marker), else None for both."""

    python: BoxPython
    install: Optional[str] = None
    marker: Optional[str] = None


_PYTHON_REMEDY = (
    "pass --python with the path of the box's Python 3.9+ (e.g. /opt/conda/bin/python; conda is "
    "often only on the interactive PATH)"
)


def probe_args(
    python: Optional[str], wheel: Optional[wheelmod.AgentWheel] = None, extras: Sequence[str] = ()
) -> List[str]:
    """The arguments of ``rgt_python_probe`` after HOME: a look at ``python`` and, with
    ``wheel``, for the install of that wheel (with ``extras``) for it."""
    args = [check_python_arg(python), PROBE_PY]
    if wheel is None:
        return [*args, "", "", ""]
    return [*args, wheel.version, wheel.sha256, extras_key(extras)]


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
                info = jsondoc.loads(line)
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
    wheel: Optional[wheelmod.AgentWheel] = None,
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
