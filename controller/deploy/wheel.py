"""rgt's own wheel, built from the code this controller runs, for installing the agent on a box.

The agent is never fetched by name from a package index: another project owns the name ``rgt`` on
PyPI, and the box must run exactly the agent this controller speaks to. So the controller packs
the ``onbox`` package it imports into a wheel itself (a wheel is a zip with a ``.dist-info``
directory; no build backend is needed) and pushes that file. The wheel is reproducible: fixed
timestamps and modes, files in a fixed order, so the same code always gives the same bytes and the
same sha256, which names the agent's install directory on the box.

Only ``onbox/`` goes in (the box never runs ``controller``). Its dependencies are the runtime ones
of pyproject.toml (kept equal by a test), plus the extras the agent's stores use: ``s3`` (boto3)
and ``hf`` (huggingface_hub).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import io
import os
import stat
import tempfile
import zipfile
from typing import Dict, List, Optional, Sequence, Tuple

import onbox

DIST_NAME = onbox.DIST_NAME  # "remote-gpu-trainer"
SUMMARY = "Keep long GPU training jobs alive, durable and cheap on rented boxes"
REQUIRES_PYTHON = (3, 9)
ENTRY_POINTS = {"rgt-agent": "onbox.cli:main"}
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)  # the earliest a zip can say: no build time leaks into the hash


@dataclasses.dataclass(frozen=True)
class Requirement:
    """One dependency of the agent. ``below`` is a Python version the requirement stops applying
    at (``python_version < "3.11"``): kept as data so an offline download for a box's Python can
    decide it without a marker evaluator."""

    spec: str
    below: Optional[Tuple[int, int]] = None

    def applies_to(self, version: Tuple[int, ...]) -> bool:
        return self.below is None or tuple(version[:2]) < self.below

    def requires_dist(self, extra: Optional[str] = None) -> str:
        markers = []
        if self.below is not None:
            markers.append(f'python_version < "{self.below[0]}.{self.below[1]}"')
        if extra is not None:
            markers.append(f'extra == "{extra}"')
        return self.spec + ("; " + " and ".join(markers) if markers else "")


# pyproject.toml's [project] dependencies and the agent's store extras (a test keeps them equal).
REQUIRES: Tuple[Requirement, ...] = (
    Requirement("click>=8.0"),
    Requirement("setproctitle>=1.2"),
    Requirement("watchdog>=2.1"),
    Requirement("psutil>=5.8"),
    Requirement("tomli>=1.1", below=(3, 11)),
)
# pyproject.toml's dependencies that only the laptop's `rgt` uses: the box's agent goes without.
LAPTOP_ONLY = ("rich",)
EXTRAS: Dict[str, Tuple[Requirement, ...]] = {
    "s3": (Requirement("boto3>=1.35"),),
    "hf": (Requirement("huggingface_hub>=0.24"),),
}


def version() -> str:
    """The version of the rgt this controller runs."""
    # (Imported here: importlib.metadata brings the email package, which no command needs
    # before it builds the wheel.)
    import importlib.metadata

    try:
        return importlib.metadata.version(DIST_NAME)
    except importlib.metadata.PackageNotFoundError:
        return str(getattr(onbox, "__version__", "0.0.0"))


def wheel_filename(ver: Optional[str] = None) -> str:
    return f"{DIST_NAME.replace('-', '_')}-{(ver or version()).replace('-', '_')}-py3-none-any.whl"


def package_files() -> List[Tuple[str, str]]:
    """(path in the wheel, path on disk) of every module of the importable ``onbox``: the
    ``.py`` files of its packages (directories with an ``__init__.py``), as setuptools finds
    them, and the platform profiles (package data), so no editor's or another tool's stray
    file (``.#x.py``, a scratch directory) rides along and changes the wheel's hash."""
    root = os.path.dirname(os.path.abspath(onbox.__file__))
    out = []
    for here, dirs, files in os.walk(root):
        dirs[:] = sorted(
            d
            for d in dirs
            if not d.startswith(".") and os.path.isfile(os.path.join(here, d, "__init__.py"))
        )
        for f in files:
            if f.endswith(".py") and not f.startswith("."):
                path = os.path.join(here, f)
                rel = os.path.relpath(path, os.path.dirname(root)).replace(os.sep, "/")
                out.append((rel, path))
    # The platform profiles are data the agent reads (onbox/profiles/data is profiles/).
    data = os.path.join(root, "profiles", "data")
    for f in sorted(os.listdir(data)):
        if f.endswith(".toml") and not f.startswith("."):
            out.append((f"onbox/profiles/data/{f}", os.path.join(data, f)))
    return sorted(out)


def metadata_text(ver: str) -> str:
    lines = [
        "Metadata-Version: 2.1",
        f"Name: {DIST_NAME}",
        f"Version: {ver}",
        f"Summary: {SUMMARY}",
        "License: Apache-2.0",
        f"Requires-Python: >={REQUIRES_PYTHON[0]}.{REQUIRES_PYTHON[1]}",
    ]
    lines += [f"Requires-Dist: {r.requires_dist()}" for r in REQUIRES]
    for extra, reqs in sorted(EXTRAS.items()):
        lines.append(f"Provides-Extra: {extra}")
        lines += [f"Requires-Dist: {r.requires_dist(extra)}" for r in reqs]
    return "\n".join(lines) + "\n"


def requirements_for(py_version: Tuple[int, ...], extras: Sequence[str] = ()) -> List[str]:
    """The agent's direct requirements on a box with Python ``py_version`` (for pip download)."""
    reqs = list(REQUIRES) + [r for e in sorted(set(extras)) for r in EXTRAS[e]]
    return [r.spec for r in reqs if r.applies_to(py_version)]


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return "sha256=" + digest.decode()


def _add(zf: zipfile.ZipFile, name: str, data: bytes) -> None:
    info = zipfile.ZipInfo(name, date_time=_ZIP_TIME)
    info.compress_type = zipfile.ZIP_DEFLATED
    info.create_system = 3  # unix, so that the mode below is read
    info.external_attr = (stat.S_IFREG | 0o644) << 16
    zf.writestr(info, data)


def package_contents() -> List[Tuple[str, bytes]]:
    """(path in the wheel, bytes) of every file of ``package_files``."""
    out = []
    for rel, path in package_files():
        with open(path, "rb") as f:
            out.append((rel, f.read()))
    return out


def wheel_bytes(
    ver: Optional[str] = None, contents: Optional[List[Tuple[str, bytes]]] = None
) -> bytes:
    """The wheel's content (the same bytes for the same code): of ``contents`` when given (what
    ``package_contents`` read), else of the package's files as they are now."""
    ver = ver or version()
    dist_info = f"{DIST_NAME.replace('-', '_')}-{ver.replace('-', '_')}.dist-info"
    entries = list(package_contents() if contents is None else contents)
    entries.append((f"{dist_info}/METADATA", metadata_text(ver).encode()))
    wheel = (
        "Wheel-Version: 1.0\nGenerator: rgt (controller/deploy/wheel.py)\n"
        "Root-Is-Purelib: true\nTag: py3-none-any\n"
    )
    entries.append((f"{dist_info}/WHEEL", wheel.encode()))
    scripts = "".join(f"{k} = {v}\n" for k, v in sorted(ENTRY_POINTS.items()))
    entries.append((f"{dist_info}/entry_points.txt", f"[console_scripts]\n{scripts}".encode()))
    entries.append((f"{dist_info}/top_level.txt", b"onbox\n"))
    record = "".join(f"{n},{_record_hash(d)},{len(d)}\n" for n, d in entries)
    record += f"{dist_info}/RECORD,,\n"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in entries:
            _add(zf, name, data)
        _add(zf, f"{dist_info}/RECORD", record.encode())
    return buf.getvalue()


@dataclasses.dataclass(frozen=True)
class AgentWheel:
    """rgt's wheel as this controller builds it: its sha256 names the agent's install on the box."""

    version: str
    data: bytes = dataclasses.field(repr=False)
    sha256: str


def agent_wheel() -> AgentWheel:
    """This controller's wheel, built here in memory."""
    ver = version()
    data = wheel_bytes(ver)
    return AgentWheel(ver, data, hashlib.sha256(data).hexdigest())


def build_wheel(dest_dir: str) -> str:
    """Write rgt's wheel into ``dest_dir`` (atomically) and return its path."""
    ver = version()
    data = wheel_bytes(ver)
    os.makedirs(dest_dir, exist_ok=True)
    path = os.path.join(dest_dir, wheel_filename(ver))
    fd, tmp = tempfile.mkstemp(dir=dest_dir, prefix=".wheel-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
