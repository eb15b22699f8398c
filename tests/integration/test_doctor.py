"""`rgt doctor` (controller/doctor.py) as the real `rgt` CLI, over the real test sshd on loopback.

The box is this machine, so its durable locations are made here for real, as root: a tmpfs out
of inodes (filled with empty files until ENOSPC), a read-only tmpfs, a plain directory on the
work dir's filesystem (a durable volume that failed to mount) and a healthy tmpfs of its own. A
profile override (RGT_PROFILES_DIR) points generic-ssh's durable.path at each. Covered:

- four different, correct verdicts, each with its remedy; only the healthy one exits 0;
- the probe file is removed, and nothing else is left in the healthy mount;
- a profile's stale facts (``checked = "2020-01"``) and never-tested tables are warned about in
  one line each; the first-contact notes (danger clocks, conveniences) are shown on the first
  doctor run only, and again with --verbose;
- the profile guessed from a marker file on the box (a user profile whose reach.markers names a
  file under the test's directory), by doctor and by deploy's audit (its ``@@markers``); a real
  deploy then says so, records it, starts the agent under it and puts the user's profile file
  at $RGT_HOME/profiles/NAME.toml on the box; an --on-done the profile lacks is refused first;
- the proxy hook: sourced, it sets http(s)_proxy; a missing one is warned about.

Every mount is unmounted in a finally; the tests skip where they cannot mount (not root, and CI
unset) and fail under CI=true.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest

from controller.deploy import guess
from controller.deploy.audit import audit
from controller.profiles import user_dirs as profile_dirs
from controller.remote import SshRemote
from controller.target import Target
from onbox.profiles.load import SHIPPED_DIR
from tests.conftest import _kill_run_processes, require
from tests.laptop import laptop_env, run_rgt
from tests.sshd import SshServer

BUDGET = "1M"  # the tmpfs mounts are small; the inode budget (doctor.BUDGET_INODES) stays


class Box:
    """The sshd box seen from a laptop of the test's own (controller home, profile dir)."""

    def __init__(self, sshd: SshServer, tmp: Path) -> None:
        self.sshd = sshd
        self.tmp = tmp
        self.ctl = tmp / "ctl"
        self.profiles = tmp / "profiles"
        self.work = tmp / "work"
        self.box_home = tmp / "box-home"
        for d in (self.ctl, self.profiles, self.work):
            d.mkdir(parents=True, exist_ok=True)

    @property
    def target(self) -> str:
        s = self.sshd
        return f"ssh -p {s.port} -i {s.client_key} {s.user}@{s.host}"

    def override(self, name: str, text: str) -> None:
        (self.profiles / f"{name}.toml").write_text(text)

    def durable_at(self, path: Path, extra: str = "") -> None:
        """generic-ssh with its durable path at ``path`` and its work dir the test's."""
        self.override(
            "generic-ssh",
            f"{extra}\n[box]\nworkdir = {json.dumps(str(self.work))}\n"
            f"python = {json.dumps(sys.executable)}\n"
            f'[durable]\npath = {json.dumps(str(path))}\nnote = "the test\'s"\n',
        )

    def rgt(self, *args: str) -> subprocess.CompletedProcess[str]:
        env = laptop_env(str(self.ctl), str(self.box_home), RGT_PROFILES_DIR=str(self.profiles))
        return run_rgt(args, env, str(self.ctl), timeout=180)

    def doctor(self, *args: str) -> Dict[str, Any]:
        """`rgt doctor --json`: its document, with its exit status as ``rc``."""
        p = self.rgt("doctor", self.target, "--profile", "generic-ssh", "--json", *args)
        assert p.returncode in (0, 9), (p.returncode, p.stdout, p.stderr)
        doc: Dict[str, Any] = json.loads(p.stdout)
        doc["rc"] = p.returncode
        doc["stderr"] = p.stderr
        return doc


def _problems(doc: Dict[str, Any]) -> List[Dict[str, str]]:
    return [f for f in doc["findings"] if f["level"] == "problem"]


def _one(doc: Dict[str, Any], level: str, text: str) -> Dict[str, str]:
    hits: List[Dict[str, str]] = [
        f for f in doc["findings"] if f["level"] == level and text in f["what"]
    ]
    assert len(hits) == 1, (level, text, doc["findings"])
    return hits[0]


class Mounts:
    """tmpfs mounts made for real; ``unmount_all`` (in a finally) leaves none."""

    def __init__(self) -> None:
        self.made: List[str] = []

    def tmpfs(self, path: Path, options: str) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        p = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "rgt-doctor-test", str(path)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if p.returncode != 0:
            require(False, f"mounting a tmpfs failed: {p.stderr.strip()}")
        self.made.append(str(path))
        return path

    def unmount_all(self) -> None:
        for path in reversed(self.made):
            subprocess.run(["umount", "-l", path], capture_output=True, timeout=30)
        left = [m for m in self.made if os.path.ismount(m)]
        assert not left, f"mounts left behind: {left}"


@pytest.fixture
def mounts() -> Iterator[Mounts]:
    require(os.geteuid() == 0, "root, to mount the test's tmpfs durable locations")
    m = Mounts()
    try:
        yield m
    finally:
        m.unmount_all()


@pytest.fixture
def box(sshd: SshServer, tmp_path: Path, controller_env: Dict[str, str]) -> Box:
    return Box(sshd, tmp_path)


def _fill_inodes(path: Path) -> int:
    """Empty files in ``path`` until the filesystem has no inode left; how many it took."""
    n = 0
    while n < 100000:  # bounded: nr_inodes is far below this
        try:
            (path / f"f{n}").touch()
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
            return n
        n += 1
    raise AssertionError(f"{path} never ran out of inodes")


def test_four_durable_mounts_four_verdicts_each_with_its_remedy(box: Box, mounts: Mounts) -> None:
    inodes = mounts.tmpfs(box.tmp / "no-inodes", "size=8m,nr_inodes=64")
    assert _fill_inodes(inodes) > 0
    ro = mounts.tmpfs(box.tmp / "read-only", "ro,size=8m")
    plain = box.tmp / "plain"  # on the work dir's filesystem: a mount that never happened
    plain.mkdir()
    healthy = mounts.tmpfs(box.tmp / "healthy", "size=64m")

    box.durable_at(inodes)
    doc = box.doctor("--budget", BUDGET)
    assert doc["rc"] == 9, doc
    f = _one(doc, "problem", "inodes free")
    assert "out of inodes" in f["what"] and f"{inodes} has 0 inodes free" in f["what"]
    assert "a filesystem with more inodes" in f["remedy"]
    f = _one(doc, "problem", "is not writable")
    assert "full (ENOSPC)" in f["what"] and "free bytes and inodes there" in f["remedy"]
    assert "inodes" in doc["stderr"] and "rgt doctor again" in doc["stderr"]

    box.durable_at(ro)
    doc = box.doctor("--budget", BUDGET)
    assert doc["rc"] == 9, doc
    f = _one(doc, "problem", "is not writable")
    assert "read-only file system (EROFS)" in f["what"]
    assert "remount it read-write" in f["remedy"]
    assert len(_problems(doc)) == 1, _problems(doc)

    box.durable_at(plain)
    doc = box.doctor("--budget", BUDGET)
    assert doc["rc"] == 9, doc
    f = _one(doc, "problem", "same filesystem as the work dir")
    assert "just a directory on the volatile disk" in f["what"]
    assert f"mount the durable volume at {plain}" in f["remedy"]
    assert len(_problems(doc)) == 1, _problems(doc)
    _one(doc, "ok", "is writable")
    assert os.listdir(plain) == []  # the probe file removed

    box.durable_at(healthy)
    doc = box.doctor("--budget", BUDGET)
    assert doc["rc"] == 0, doc
    assert _problems(doc) == []
    _one(doc, "ok", "is writable")
    assert "tmpfs" in _one(doc, "ok", "a filesystem of its own")["what"]
    _one(doc, "ok", "inodes free")
    assert os.listdir(healthy) == []

    # The whole budget counts: 20G does not fit in 64 MiB.
    doc = box.doctor()
    f = _one(doc, "problem", "under the checkpoint budget")
    assert "lower --budget" in f["remedy"] and doc["rc"] == 9


def test_stale_facts_warned_and_first_contact_shown_once(box: Box, mounts: Mounts) -> None:
    healthy = mounts.tmpfs(box.tmp / "healthy", "size=16m")
    box.durable_at(healthy, extra='checked = "2020-01"')
    first = box.rgt("doctor", box.target, "--profile", "generic-ssh", "--budget", BUDGET)
    assert first.returncode == 0, (first.stdout, first.stderr)
    out = first.stdout
    stale = [ln for ln in out.splitlines() if "facts older than 6 months" in ln]
    assert len(stale) == 1 and "reach (2020-01)" in stale[0] and "durable (2020-01)" in stale[0]
    untried = [ln for ln in out.splitlines() if "never tested hands-on" in ln]
    assert len(untried) == 1 and "meter" in untried[0], out
    assert "update checked in the profile" in out
    assert "first contact with" in out
    assert "danger: forgotten-box" in out and "tip: " in out

    second = box.rgt("doctor", box.target, "--profile", "generic-ssh", "--budget", BUDGET)
    assert second.returncode == 0, second.stderr
    assert "first contact" not in second.stdout and "danger:" not in second.stdout
    assert "facts older than 6 months" in second.stdout  # the warning stays

    again = box.rgt("doctor", box.target, "--profile", "generic-ssh", "--verbose")
    assert "danger: forgotten-box" in again.stdout
    seen = json.loads((box.ctl / "contacts.json").read_text())["seen"]
    assert list(seen) == [f"{box.sshd.user}@{box.sshd.host}:{box.sshd.port} generic-ssh"]


def _commands(box: Box) -> int:
    """Commands the box's sshd has started so far (one per ssh command, multiplexed or not)."""
    return box.sshd.log().count("Starting session: ")


def _marked_profile(box: Box) -> Path:
    """A user profile of its own, recognised by a marker file under the test's directory."""
    marker = box.tmp / "marker dir" / "this-is-testbox"
    marker.parent.mkdir()
    marker.write_text("")
    text = (Path(SHIPPED_DIR) / "generic-ssh.toml").read_text()
    text = text.replace('name = "generic-ssh"', 'name = "testbox"')
    text = text.replace("[reach]\n", f"[reach]\nmarkers = [{json.dumps(str(marker))}]\n", 1)
    box.override("testbox", text)
    return marker


def test_the_profile_is_guessed_from_a_marker_file_on_the_box(
    box: Box, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = _marked_profile(box)
    n = _commands(box)
    p = box.rgt("doctor", box.target, "--budget", BUDGET)
    assert f"rgt: profile testbox (the box has {marker})" in p.stdout, (p.stdout, p.stderr)
    assert _commands(box) - n == 2  # the markers named another profile: once more under it

    # deploy's audit reads the same markers in its one round trip.
    monkeypatch.setenv("RGT_PROFILES_DIR", str(box.profiles))
    s = box.sshd
    remote = SshRemote(
        Target("ssh", host="127.0.0.1", port=s.port, user=s.user, identity=s.client_key)
    )
    try:
        dirs = profile_dirs()
        rep = audit(
            remote,
            python=sys.executable,
            box_home=str(box.box_home),
            markers=guess.marker_args(guess.candidates(dirs)),
        )
        assert rep.markers == [f"file {marker}"], rep.markers
        g = guess.chosen(remote.target, dirs, rep.markers)
        assert (g.profile.name, g.line) == (
            "testbox",
            f"rgt: profile testbox (the box has {marker})",
        )
        marker.unlink()
        rep = audit(
            remote,
            python=sys.executable,
            box_home=str(box.box_home),
            markers=guess.marker_args(guess.candidates(dirs)),
        )
        assert rep.markers == []
        assert guess.chosen(remote.target, dirs, rep.markers).profile.name == "generic-ssh"
        n = _commands(box)
        p = box.rgt("doctor", box.target, "--budget", BUDGET)
        assert "rgt: profile generic-ssh (no host pattern or marker" in p.stdout, p.stdout
        assert _commands(box) - n == 1  # one round trip: generic-ssh's, markers and all
    finally:
        with contextlib.suppress(Exception):
            remote.close()


def test_the_proxy_hook_is_sourced_and_a_missing_one_warned(box: Box) -> None:
    """A hook that sets a proxy nobody answers on: the doctor says it sets http(s)_proxy and
    reports the request without and with it (bounded; this box is offline or not)."""
    hook = box.tmp / "network turbo"
    hook.write_text("export https_proxy=http://127.0.0.1:9 http_proxy=http://127.0.0.1:9\n")
    box.override(
        "autodl",
        f"[env]\nproxy_hook = {json.dumps(str(hook))}\n"
        f"[box]\nworkdir = {json.dumps(str(box.work))}\npython = {json.dumps(sys.executable)}\n"
        f'[durable]\npath = ""\nnote = "off the box in this test"\n',
    )
    p = box.rgt("doctor", box.target, "--profile", "autodl", "--json", "--store", "file:///x")
    doc = json.loads(p.stdout)
    _one(doc, "ok", f"sourcing {hook} sets http(s)_proxy")
    f = [x for x in doc["findings"] if "a request to https://pypi.org" in x["what"]]
    assert len(f) == 1 and "without the proxy" in f[0]["what"] and "with it" in f[0]["what"], f
    assert "curl exit 7" in f[0]["what"] or "curl exit 5" in f[0]["what"], f  # port 9: refused
    assert doc["first_contact"] and "auto-release" in " ".join(doc["first_contact"])

    hook.unlink()
    doc = json.loads(box.rgt("doctor", box.target, "--profile", "autodl", "--json").stdout)
    w = _one(doc, "warn", f"proxy hook {hook} is not on the box")
    assert "the job runs without a proxy" in w["remedy"]
    assert doc["first_contact"] == []


def test_deploy_guesses_from_the_marker_and_puts_the_user_profile_on_the_box(box: Box) -> None:
    """deploy with no --profile on a box that has testbox's marker: the profile is testbox,
    said in one line, recorded, passed to rgt-agent start, and the user's file (a profile the
    package does not ship) is at $RGT_HOME/profiles/testbox.toml on the box before the start.
    An --on-done the profile does not offer is refused before the box is touched."""
    marker = _marked_profile(box)
    project = box.tmp / "project"
    project.mkdir()
    (project / "job.py").write_text("print('hello from the job', flush=True)\n")
    store = box.tmp / "store"
    store.mkdir()
    name = f"doctor-guess-{os.getpid()}"
    base = [
        "deploy", box.target, "--name", name, "--python", sys.executable,
        "--project", str(project), "--store", f"file://{store}",
    ]  # fmt: skip
    p = box.rgt(*base, "--on-done", "poweroff", "--", sys.executable, "job.py")
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert "offers no on-done action 'poweroff'" in p.stderr and "offers none" in p.stderr
    assert not box.box_home.exists()  # refused before anything on the box

    try:
        p = box.rgt(*base, "--", sys.executable, "job.py")
        assert p.returncode == 0, p.stderr
        assert f"rgt: profile testbox (the box has {marker})" in p.stderr
        assert "first contact with" in p.stderr and "danger: forgotten-box" in p.stderr
        on_box = box.box_home / "profiles" / "testbox.toml"
        assert on_box.read_bytes() == (box.profiles / "testbox.toml").read_bytes()
        assert oct(on_box.stat().st_mode & 0o777) == "0o600"
        runs = json.loads((box.ctl / "runs.json").read_text())["runs"]
        assert runs[name]["profile"] == "testbox"
        spec = json.loads((box.box_home / "runs" / name / "spec.json").read_text())
        assert spec.get("profile") == "testbox", spec  # the agent ran under it
    finally:
        _kill_run_processes(str(box.box_home))
