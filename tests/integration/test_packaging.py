"""A clean install, as a user gets one: the wheel and the sdist built by the standard build
frontend (``python -m build``) from a clean copy of the checkout (its tracked and unignored
files), the wheel installed, not editable, into a fresh venv, and its two programs run from a
directory outside the checkout with no PYTHONPATH, so that nothing is imported from the source
tree. A package the build leaves out (``onbox.sealing.stores`` once was) fails here; an editable
install,
which imports from the checkout, never notices.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path
from typing import Any, Dict, Iterator, List, Set

import pytest

from controller.deploy import wheel as wheelmod
from tests.conftest import ROOT, _kill_run_processes, require
from tests.mounts import tmpfs

# Building in an isolated environment and installing the wheel's dependencies both go to the
# package index: minutes at worst, not the default 300 s of a test (the fixtures count).
pytestmark = pytest.mark.timeout(1500)
SLOW = 600  # seconds: the most one build or one pip install may take


@dataclasses.dataclass(frozen=True)
class Dists:
    src: str  # the clean copy the two were built from
    wheel: str
    sdist: str


def _clean_env() -> Dict[str, str]:
    """This environment without anything that points Python or rgt somewhere."""
    drop = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "PYTHONUSERBASE")
    return {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("RGT_")}


def _run(argv: List[str], timeout: float = 60, **kw: Any) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
    assert p.returncode == 0, f"{argv} -> {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


def _checkout_files() -> List[str]:
    """The checkout as a fresh clone of it would be, plus files not yet committed: what git
    tracks or would track (nothing it ignores: no .venv, no egg-info, no build/)."""
    git = shutil.which("git")
    ok = git is not None and (
        subprocess.run(
            [git, "-C", ROOT, "rev-parse", "--show-toplevel"], capture_output=True, timeout=30
        ).returncode
        == 0
    )
    require(ok, "git and a git checkout (the build copies its tracked and unignored files)")
    assert git is not None
    out = _run([git, "-C", ROOT, "ls-files", "-z", "-c", "-o", "--exclude-standard"]).stdout
    return sorted({n for n in out.split("\0") if n and os.path.lexists(os.path.join(ROOT, n))})


@pytest.fixture(scope="session")
def dists(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dists]:
    require(
        importlib.util.find_spec("build") is not None,
        "the build frontend (pip install -e '.[dev]')",
    )
    work = tmp_path_factory.mktemp("dists")
    src, out = str(work / "src"), str(work / "out")
    assert not src.startswith(ROOT + os.sep)
    for name in _checkout_files():
        dest = os.path.join(src, name)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        shutil.copy2(os.path.join(ROOT, name), dest, follow_symlinks=False)
    _run([sys.executable, "-m", "build", "--outdir", out, src], timeout=SLOW, env=_clean_env())
    (whl,) = Path(out).glob("*.whl")
    (sdist,) = Path(out).glob("*.tar.gz")
    yield Dists(src, str(whl), str(sdist))
    shutil.rmtree(work, ignore_errors=True)


@dataclasses.dataclass(frozen=True)
class Venv:
    root: str
    bin: str
    cwd: str  # outside the checkout

    def env(self, home: str) -> Dict[str, str]:
        env = _clean_env()
        env["PATH"] = self.bin + os.pathsep + env.get("PATH", "")
        env["RGT_HOME"] = home
        return env


@pytest.fixture(scope="session")
def venv(dists: Dists, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Venv]:
    """A fresh venv (no system site-packages) with the wheel and its dependencies."""
    work = tmp_path_factory.mktemp("clean-install")
    root, cwd = str(work / "venv"), str(work / "cwd")
    os.makedirs(cwd)
    assert not root.startswith(ROOT + os.sep) and not cwd.startswith(ROOT + os.sep)
    env = _clean_env()
    _run([sys.executable, "-m", "venv", root], timeout=120, env=env, cwd=cwd)
    bin_dir = os.path.join(root, "bin")
    pip = [os.path.join(bin_dir, "python"), "-m", "pip", "--disable-pip-version-check", "-q"]
    _run([*pip, "install", "--no-input", dists.wheel], timeout=SLOW, env=env, cwd=cwd)
    yield Venv(root, bin_dir, cwd)
    shutil.rmtree(work, ignore_errors=True)


def _source_modules(root: str, *packages: str, data: bool = False) -> Set[str]:
    """``.py`` files under ``packages`` of a directory tree, as paths relative to it (with
    ``data``, the package data too: the shell the laptop runs on the box)."""
    found = set()
    for package in packages:
        for here, dirs, files in os.walk(os.path.join(root, package)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for f in files:
                if f.endswith(".py") or (data and f.endswith(".sh")):
                    found.add(os.path.relpath(os.path.join(here, f), root).replace(os.sep, "/"))
    return found


def _wheel_names(data: bytes) -> List[str]:
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        return zf.namelist()


def _profiles() -> Dict[str, bytes]:
    """The checkout's platform profiles, as the wheel names them (onbox/profiles/data links to
    profiles/), with their bytes."""
    out = {}
    for f in sorted(os.listdir(os.path.join(ROOT, "profiles"))):
        if f.endswith(".toml"):
            out[f"onbox/profiles/data/{f}"] = Path(ROOT, "profiles", f).read_bytes()
    assert len(out) >= 18, out.keys()
    return out


def _wheel_profiles(data: bytes) -> Dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        return {n: zf.read(n) for n in zf.namelist() if n.startswith("onbox/profiles/data/")}


def test_the_sdist_holds_every_module_and_the_project_files(dists: Dists) -> None:
    with tarfile.open(dists.sdist) as tf:
        members = [m.name.split("/", 1)[1] for m in tf.getmembers() if "/" in m.name]
    modules = {n for n in members if n.endswith(".py") and n.startswith(("onbox/", "controller/"))}
    assert modules == _source_modules(dists.src, "onbox", "controller")
    for name in ("base", "local", "hf", "s3/__init__"):
        assert f"onbox/sealing/stores/{name}.py" in modules
    shell = {n for n in members if n.startswith("controller/shell/") and n.endswith(".sh")}
    assert shell and shell == _source_modules(dists.src, "controller", data=True) - modules
    assert {"pyproject.toml", "README.md"} <= set(members)


def test_the_wheel_ships_onbox_and_controller_and_nothing_else(dists: Dists) -> None:
    names = _wheel_names(Path(dists.wheel).read_bytes())
    info = f"remote_gpu_trainer-{wheelmod.version()}.dist-info"
    assert {n.split("/", 1)[0] for n in names} == {"onbox", "controller", info}
    code = {n for n in names if not n.startswith(info + "/")}
    # The shell the laptop runs on the box ships as package data (controller/shell/*.sh), and
    # so do the platform profiles (onbox/profiles/data/*.toml).
    assert code == _source_modules(dists.src, "onbox", "controller", data=True) | set(_profiles())
    with zipfile.ZipFile(dists.wheel) as zf:
        scripts = zf.read(f"{info}/entry_points.txt").decode()
    assert "rgt = controller.cli:main" in scripts and "rgt-agent = onbox.cli:main" in scripts


def test_the_box_wheel_carries_the_same_onbox_modules_as_the_standard_wheel(
    dists: Dists,
) -> None:
    """controller/deploy/wheel.py packs the agent's wheel for the box itself: the same ``onbox``."""

    def onbox_modules(names: List[str]) -> Set[str]:
        return {n for n in names if n.startswith("onbox/") and n.endswith(".py")}

    box = onbox_modules(_wheel_names(wheelmod.wheel_bytes()))
    standard = onbox_modules(_wheel_names(Path(dists.wheel).read_bytes()))
    assert box == standard, {"box only": box - standard, "standard only": standard - box}
    assert "onbox/sealing/stores/local.py" in box


def test_the_wheel_pip_builds_carries_every_profile(dists: Dists) -> None:
    assert _wheel_profiles(Path(dists.wheel).read_bytes()) == _profiles()


def test_the_box_wheel_carries_every_profile() -> None:
    """agent_wheel (controller/deploy/wheel.py) packs onbox itself: the profiles must ride along,
    byte for byte, or the agent on the box knows no platform."""
    assert _wheel_profiles(wheelmod.wheel_bytes()) == _profiles()


def test_the_installed_package_loads_every_profile(venv: Venv, tmp_path: Path) -> None:
    """From a directory outside the checkout, the non-editable install finds its own profiles."""
    env = venv.env(str(tmp_path / "home"))
    code = (
        "import json; from onbox.profiles.load import SHIPPED_DIR, load_all; "
        "print(json.dumps([len(load_all()), SHIPPED_DIR]))"
    )
    p = _run([os.path.join(venv.bin, "python"), "-c", code], env=env, cwd=venv.cwd)
    count, shipped = json.loads(p.stdout)
    assert count == len(_profiles()) and shipped.startswith(venv.root + os.sep), p.stdout


def test_the_installed_programs_run_from_the_venv_alone(venv: Venv, tmp_path: Path) -> None:
    env = venv.env(str(tmp_path / "home"))
    version = wheelmod.version()
    for prog in ("rgt-agent", "rgt"):
        p = _run([os.path.join(venv.bin, prog), "--version"], env=env, cwd=venv.cwd)
        assert p.stdout == f"{prog}, version {version}\n"
    code = (
        "import json, onbox, onbox.sealing.stores.local, controller.cli; "
        "mods = (onbox, onbox.sealing.stores.local, controller.cli); "
        "print(json.dumps([m.__file__ for m in mods]))"
    )
    p = _run([os.path.join(venv.bin, "python"), "-c", code], env=env, cwd=venv.cwd)
    for path in json.loads(p.stdout):
        assert path.startswith(venv.root + os.sep), path  # imported from the install, not ROOT


def test_the_installed_agent_starts_stops_and_mirrors_a_run_into_a_file_store(
    venv: Venv, tmp_path: Path
) -> None:
    home, store = str(tmp_path / "home"), str(tmp_path / "store")
    os.mkdir(store)  # a store root is the user's to make
    env = venv.env(home)

    def agent(*args: str) -> subprocess.CompletedProcess[str]:
        return _run([os.path.join(venv.bin, "rgt-agent"), *args], env=env, cwd=venv.cwd)

    def status() -> Dict[str, Any]:
        doc: Dict[str, Any] = json.loads(agent("status", "clean", "--json").stdout)
        return doc

    job = [os.path.join(venv.bin, "python"), "-c", "import time; time.sleep(60)"]
    try:
        p = agent("start", "--store", "file://" + store, "--name", "clean", "--", *job)
        assert "started run clean" in p.stdout, p.stdout
        deadline = time.monotonic() + 30
        while not ((st := status())["job_alive"] and st["agent"]["alive"]):
            assert time.monotonic() < deadline, st
            time.sleep(0.2)
        assert st["state"] in ("STARTING", "RUNNING") and st["command"] == job
        mirror = os.path.join(store, "clean", "state", "state.json")
        deadline = time.monotonic() + 30
        while not os.path.exists(
            mirror
        ):  # the agent reached the store through onbox.sealing.stores
            assert time.monotonic() < deadline, sorted(Path(store).rglob("*"))
            time.sleep(0.2)

        agent("stop", "clean", "--grace", "5")
        st = status()
        assert (st["state"], st["job_alive"]) == ("STOPPED", False), st
        assert "ended by stop" in st["last_exit"]["reason"]
    finally:
        _kill_run_processes(home)


# Run by the job's Python: which of the job lib's modules Python compiled from source while
# importing the training API (none, when their bytecode came with them), and where it came from.
_COMPILED = """
import importlib._bootstrap_external as bx, json, sys
compiled = []
to_code = bx.SourceLoader.source_to_code
def spy(self, data, path, *a, **k):
    compiled.append(path)
    return to_code(self, data, path, *a, **k)
bx.SourceLoader.source_to_code = spy
import onbox.train, onbox.train.checkpointer
print(json.dumps([onbox.train.__file__, [p for p in compiled if p.startswith(sys.argv[1])]]))
"""


@pytest.mark.parametrize("where", ["same filesystem", "a tmpfs"])
def test_a_job_on_a_fresh_box_imports_the_training_api_without_compiling_it(
    venv: Venv, tmp_path: Path, where: str
) -> None:
    """The job lib the agent makes on a fresh box (its own copy of ``onbox`` for the job's
    PYTHONPATH) carries the bytecode pip compiled at install, whether it is linked from the
    install or copied (another filesystem refuses the link): the job's first import of the
    training API loads it instead of compiling every module again at each restart."""
    base = str(tmp_path / "fs")
    ctx = tmpfs(base, "size=64m") if where == "a tmpfs" else contextlib.nullcontext(base)
    with ctx:
        home = os.path.join(base, "home")
        env = venv.env(home)
        make = f"from onbox.agent.runner import ensure_job_lib; print(ensure_job_lib({home!r}))"
        lib = _run([os.path.join(venv.bin, "python"), "-c", make], env=env, cwd=venv.cwd).stdout
        lib = lib.strip()
        assert lib.startswith(home + os.sep), lib
        # Nothing written back: what the box has at the job's first start is what counts.
        env.update(PYTHONPATH=lib, PYTHONDONTWRITEBYTECODE="1")
        argv = [os.path.join(venv.bin, "python"), "-c", _COMPILED, lib]
        origin, compiled = json.loads(_run(argv, env=env, cwd=venv.cwd).stdout)
        assert origin == os.path.join(lib, "onbox", "train", "__init__.py")
        assert compiled == []
