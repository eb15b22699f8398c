"""The profile guess of `rgt deploy` and `rgt doctor` (controller/deploy/guess.py) and deploy's
profile checks (controller/deploy/request.py), on the shipped profiles and user overrides:

- a host matching a profile's reach.host_patterns picks it (case-insensitive), with the pattern
  named in the line; no match and no markers read: none, and generic-ssh in the end;
- marker files and init-variable names seen on the box pick the profile with the most of them;
  rgt_markers' output is untrusted: junk lines are ignored;
- rgt_markers (controller/shell/markers.sh) finds the names asked for among an init environment's
  (whole names only, never from a value) with no process per variable: it runs with only tr and
  sed on PATH;
- the local target is always local, and local fits no other target (either way: UsageError);
- an unknown --profile names the known ones; a user-only profile is accepted;
- --on-done is checked against the profile's meter.on_done names, refused with the allowed list.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Dict

import pytest

from controller.deploy import guess
from controller.deploy.request import DeployRequest, check_request
from controller.profiles import user_dirs as profile_dirs
from controller.target import Target, parse_target
from onbox.common.errors import UsageError
from onbox.profiles.load import SHIPPED_DIR


@pytest.fixture
def dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The laptop's user profile directory, empty, under the test's own controller home."""
    monkeypatch.setenv("RGT_CONTROLLER_HOME", str(tmp_path / "ctl"))
    monkeypatch.delenv("RGT_PROFILES_DIR", raising=False)
    d = tmp_path / "ctl" / "profiles"
    d.mkdir(parents=True)
    return d


def _ssh(host: str) -> Target:
    return Target("ssh", host=host, user="root", port=22)


def test_the_host_picks_the_profile_and_says_which_pattern(dirs: Path) -> None:
    ds = profile_dirs()
    assert ds == [str(dirs)]
    g = guess.chosen(_ssh("connect.westb.SeetaCloud.com"), ds)
    assert g.profile.name == "autodl"
    assert g.line == "rgt: profile autodl (host matches *.seetacloud.com)"
    assert guess.chosen(_ssh("ssh.runpod.io"), ds).profile.name == "runpod"
    assert guess.by_host(_ssh("gpu1"), guess.candidates(ds)) is None
    g = guess.chosen(_ssh("gpu1"), ds)
    assert (g.profile.name, g.why) == ("generic-ssh", "no host pattern matched")


def test_markers_seen_on_the_box_pick_the_profile(dirs: Path) -> None:
    ds = profile_dirs()
    files, names = guess.marker_args(guess.candidates(ds))
    assert "/etc/network_turbo" in files.split("\n") and "RUNPOD_POD_ID" in names.split("\n")
    lines = ["file /etc/network_turbo", "file /root/autodl-tmp", "env RUNPOD_POD_ID"]
    g = guess.chosen(_ssh("10.0.0.5"), ds, lines)
    assert g.profile.name == "autodl"  # two of its markers against one of runpod's
    assert g.line == "rgt: profile autodl (the box has /etc/network_turbo, /root/autodl-tmp)"
    g = guess.chosen(_ssh("10.0.0.5"), ds, ["env RUNPOD_POD_ID"])
    assert g.line == "rgt: profile runpod (the box has $RUNPOD_POD_ID)"
    junk = ["", "file", "env", "nonsense /etc/network_turbo", "@@clock", "file /nonexistent"]
    g = guess.chosen(_ssh("10.0.0.5"), ds, junk)
    assert g.profile.name == "generic-ssh"
    assert g.why == "no host pattern or marker of another profile matched"
    # The host wins over markers.
    assert guess.chosen(_ssh("x.runpod.net"), ds, lines).profile.name == "runpod"


def test_markers_match_whole_names_without_a_process_per_variable(tmp_path: Path) -> None:
    # An init process of a rented container holds dozens of variables: a grep for each cost
    # every deploy's audit a process per variable, one after the other.
    environ = tmp_path / "environ"
    held = [b"PATH=/usr/bin", b"RUNPOD_POD_ID=abc", b"SLURM_JOB=x", b"X=SLURM_JOB_ID"]
    held += [b"MULTI=line1\nAUTODL=2"] + [b"V%d=v" % i for i in range(50)]
    environ.write_bytes(b"\0".join(held) + b"\0")
    marker = tmp_path / "marker"
    marker.write_text("")
    bin_dir = tmp_path / "bin"  # only what the function may start
    bin_dir.mkdir()
    for tool in ("tr", "sed"):
        (bin_dir / tool).symlink_to(shutil.which(tool) or tool)
    files = f"{marker}\n{tmp_path / 'absent'}"
    names = "AUTODL\nPATH\nRUNPOD_POD_ID\nSLURM_JOB_ID"
    p = subprocess.run(
        ["/bin/sh", "-c", guess.MARKERS_SH + 'rgt_markers "$@"', "sh", files, names, str(environ)],
        env={"PATH": str(bin_dir)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert p.returncode == 0, p.stderr
    # AUTODL and SLURM_JOB_ID only ever appear in values (AUTODL after a newline in one).
    assert sorted(p.stdout.splitlines()) == ["env PATH", "env RUNPOD_POD_ID", f"file {marker}"]
    assert p.stderr == ""


def test_a_user_profile_is_guessed_by_its_own_marker(dirs: Path) -> None:
    text = (Path(SHIPPED_DIR) / "generic-ssh.toml").read_text()
    text = text.replace('name = "generic-ssh"', 'name = "labbox"')
    text = text.replace("[reach]\n", '[reach]\nmarkers = ["/etc/labbox"]\n', 1)
    (dirs / "labbox.toml").write_text(text)
    g = guess.chosen(_ssh("10.0.0.5"), profile_dirs(), ["file /etc/labbox"])
    assert g.line == "rgt: profile labbox (the box has /etc/labbox)"


def _req(target: str, **kw: object) -> DeployRequest:
    return DeployRequest(target=target, command=["true"], **kw)  # type: ignore[arg-type]


def test_local_fits_only_the_local_target(dirs: Path) -> None:
    env: Dict[str, str] = {}
    plan = check_request(_req("local"), env)
    assert plan.profile == "local" and plan.guess is not None
    with pytest.raises(UsageError, match="does not fit target local"):
        check_request(_req("local", profile="autodl"), env)
    with pytest.raises(UsageError, match="profile local does not fit target root@gpu1"):
        check_request(_req("root@gpu1", profile="local"), env)
    assert guess.chosen(parse_target("local"), profile_dirs()).profile.name == "local"


def test_any_profile_by_name_else_the_host_else_the_markers_later(dirs: Path) -> None:
    env: Dict[str, str] = {}
    assert check_request(_req("root@gpu1", profile="runpod"), env).profile == "runpod"
    assert check_request(_req("root@connect.x.seetacloud.com"), env).profile == "autodl"
    later = check_request(_req("root@gpu1"), env)
    assert later.guess is None and later.profile == ""  # the audit's markers decide
    with pytest.raises(UsageError) as e:
        check_request(_req("root@gpu1", profile="nosuch"), env)
    assert "'nosuch' is not a profile" in str(e.value) and "autodl" in (e.value.remedy or "")


def test_on_done_is_checked_against_the_profile(dirs: Path) -> None:
    env: Dict[str, str] = {}
    plan = check_request(_req("root@gpu1", profile="autodl", on_done="poweroff"), env)
    assert plan.req.on_done == "poweroff"
    with pytest.raises(UsageError) as e:
        check_request(_req("root@gpu1", profile="autodl", on_done="destroy"), env)
    assert "offers no on-done action 'destroy'" in str(e.value)
    assert e.value.remedy == "allowed: poweroff"
    with pytest.raises(UsageError) as e:
        check_request(_req("root@gpu1", profile="generic-ssh", on_done="poweroff"), env)
    assert "offers none" in (e.value.remedy or "")


def test_secrets_are_refused_for_a_slurm_run_whose_home_is_shared(dirs: Path) -> None:
    """A cluster's $HOME is on every node: rgt's 0600 secrets file would be on a shared mount,
    which it never allows; refused before anything changes, saying where credentials go."""
    env = {"HF_TOKEN": "hf_secretvalue"}
    req = _req("login1", profile="slurm", slurm_time="10", secret_env=["HF_TOKEN"])
    with pytest.raises(UsageError, match="--secret-env.*shared filesystem") as e:
        check_request(req, env)
    assert "hf_secretvalue" not in str(e.value) and "~/.aws/credentials" in str(e.value.remedy)
    assert check_request(_req("login1", profile="slurm", slurm_time="10"), env).slurm is not None
