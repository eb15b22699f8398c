"""The shipped platform profiles: each loads, each agrees with the fact base on the values that
cost data or money (the pin table below, transcribed by hand, each row citing where its values
come from), a broken file is exit 2 through the real CLI naming the file, the field and a fix,
a user override changes only what it sets, and README.md's platform table is the generated one.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, NamedTuple

import pytest

from controller import profiles as prof
from onbox.profiles import load, load_all, names
from onbox.profiles.load import SHIPPED_DIR

ROOT = Path(__file__).resolve().parents[2]
DAY = 86400.0


class Pin(NamedTuple):
    """The fact base's values for one platform."""

    grace: float  # seconds
    verb: str
    reversible: bool
    api: str
    durable: str
    clocks: Dict[str, float]  # danger name -> days, for the clocks with a fixed length
    spot: bool


# Transcribed from platforms.md (the fact base); the comment on each row says which rows.
PINS: Dict[str, Pin] = {
    # §1.B AutoDL (关机 reversible), AD-DANGER 15 d; §1.A durable /root/autodl-fs; §1.0 spot
    # false; grace n/a (Docker's default 10 s for a console stop)
    "autodl": Pin(
        10, "关机 (power off)", True, "none", "/root/autodl-fs", {"auto-release": 15}, False
    ),
    # §1.C reference AWS EC2 Spot ~120 s; §1.A-style off-box durable (no row: S3)
    "aws-spot": Pin(120, "terminate", False, "none", "", {}, True),
    # §1.C reference Azure Spot >=30 s (Preempt event), Appendix A
    "azure-spot": Pin(30, "delete", False, "none", "", {}, True),
    # §1.A Colab durable Drive /content/drive/MyDrive/proj; §1.C grace 0 (no signal);
    # Appendix A idle ~90 min, max ~12 h; §1.B "automatic, free"
    "colab": Pin(
        0,
        "none",
        False,
        "none",
        "/content/drive/MyDrive/proj",
        {"idle-timeout": 90 / 1440, "vm-lifetime": 0.5},
        False,
    ),  # fmt: skip
    # §1.B Featurize 实例归还 (return) irreversible; §1.A durable `work` under /home/featurize
    # (FZ3: ~/work); FZ1: everything outside work and /cloud is wiped on return
    "featurize": Pin(10, "实例归还 (return)", False, "none", "/home/featurize/work", {}, False),
    # §1.C reference GCP Spot ~30 s; GCP Preemptible hard 24 h cap (Appendix A, SR2)
    "gcp-spot": Pin(30, "delete", False, "none", "", {"preemptible-24h": 1}, True),
    # §1.B Generic SSH: manual, usually irreversible; §1.A durable host-dependent (off: --store)
    "generic-ssh": Pin(30, "manual", False, "none", "", {}, False),
    # §1.B Gpushare 关机 reversible; Appendix A GS4/GS5: 10 d release, arrears day 15, /hy-tmp
    # 24 h; §1.A durable /hy-netdisk
    "gpushare": Pin(
        10,
        "关机 (power off)",
        True,
        "none",
        "/hy-netdisk",
        {"auto-release": 10, "arrears-purge": 15, "hy-tmp-wipe": 1},
        False,
    ),  # fmt: skip
    # §1.A Kaggle durable /kaggle/working; Appendix A session ~9 h, idle ~60 min
    "kaggle": Pin(
        0,
        "none",
        False,
        "none",
        "/kaggle/working",
        {"session-cap": 9 / 24, "idle-timeout": 1 / 24},
        False,
    ),  # fmt: skip
    # §1.C Kubernetes terminationGracePeriodSeconds 30 s; §1.A PVC /checkpoints; §1.B delete job
    "kubernetes": Pin(30, "kubectl delete job", False, "none", "/checkpoints", {}, False),
    # §1.B Lambda terminate (the only way), irreversible, REST API; §1.A NFS attach-at-launch
    # only (durable off unless attached: --store)
    "lambda": Pin(30, "terminate", False, "lambda", "", {}, False),
    # §1.B LanRui 停止 (stop) stops compute; §1.A durable /home/user/datadisk
    "lanrui": Pin(10, "停止 (stop)", True, "none", "/home/user/datadisk", {}, False),
    # §1.B Local: n/a
    "local": Pin(30, "none", True, "none", "", {}, False),
    # §1.B Matpool 停止并释放 (stop+release), release irreversible; §1.A durable /mnt
    "matpool": Pin(10, "停止并释放 (stop and release)", False, "none", "/mnt", {}, False),
    # §1.B Paperspace shut-down reversible; Appendix A PS2 free notebooks 6 h, paid 12 h default
    "paperspace": Pin(
        30,
        "shut-down",
        True,
        "paperspace",
        "",
        {"free-notebook-shutdown": 0.25, "notebook-shutdown": 0.5},
        False,
    ),  # fmt: skip
    # §1.B RunPod terminate irreversible; §1.C spot ~5 s; RP8 stale stopped pods ~30 d
    "runpod": Pin(5, "terminate", False, "runpod", "/workspace", {"stale-stopped": 30}, True),
    # §1.C Slurm KillWait 30 s; §1.A durable /scratch/$USER/proj; §1.B none (the job ends)
    "slurm": Pin(30, "none", False, "none", "/scratch/$USER/proj", {}, False),
    # §1.C vast ~0 s, no signal, interruptible; §1.B destroy irreversible; §1.A off-box durable
    "vastai": Pin(0, "destroy", False, "vastai", "", {}, True),
}


def test_every_shipped_profile_loads_and_validates() -> None:
    got = load_all()
    assert [p.name for p in got] == names() and len(got) >= 18
    for p in got:
        assert os.path.dirname(p.file) == SHIPPED_DIR and p.override is None


def test_the_pin_table_names_exactly_the_shipped_profiles() -> None:
    assert sorted(PINS) == names(), "a profile is missing from PINS, or PINS names a removed one"


@pytest.mark.parametrize("name", sorted(PINS))
def test_profile_agrees_with_the_fact_base(name: str) -> None:
    p, pin = load(name), PINS[name]
    assert p.preemption.grace == pin.grace
    assert (p.meter.verb, p.meter.reversible, p.meter.api) == (pin.verb, pin.reversible, pin.api)
    assert p.durable.path == pin.durable
    assert p.preemption.spot is pin.spot
    clocks = {d.name: d.after / DAY for d in p.danger if d.after is not None}
    assert clocks == pytest.approx(pin.clocks)


def test_on_done_is_only_autodl_poweroff() -> None:
    """Only a reversible action that stops the meter from inside may run unattended: AutoDL's
    关机; nowhere else does the fact base say an in-box power-off stops billing (Lambda's keeps
    billing, LAM3)."""
    acts = {p.name: [a.name for a in p.meter.on_done] for p in load_all() if p.meter.on_done}
    assert acts == {"autodl": ["poweroff"]}


@pytest.mark.parametrize("name", names())
def test_the_durable_default_lies_on_storage_that_outlives_the_box(name: str) -> None:
    """The default store (no --store) goes under the durable path: it must lie on a tier of the
    profile's own storage that survives a destroy, or checkpoints go with the box they were
    meant to outlive. Where two tiers share the path (RunPod's /workspace: the pod's volume
    disk or a Network Volume), one must survive, and the deploy warns of the other."""
    p = load(name)
    if not p.durable.path:
        return  # off the box: the user names a store
    tiers = p.tiers_at(p.durable.path)
    assert tiers, f"{name}: the durable path {p.durable.path} lies on none of its storage"
    assert any(t.survives_destroy for t in tiers), (
        f"{name}: the durable path {p.durable.path} lies on {[t.name for t in tiers]}, "
        "which a destroy deletes"
    )


def test_only_autodl_and_local_are_hands_on() -> None:
    assert sorted(p.name for p in load_all() if p.stamp.hands_on) == ["autodl", "local"]


def test_chinese_rentals_get_the_mirror_env() -> None:
    for name in ("autodl", "matpool", "gpushare", "featurize", "lanrui"):
        v = load(name).job_vars()
        assert v["HF_ENDPOINT"] == "https://hf-mirror.com", name
        assert (v["HF_HUB_DISABLE_XET"], v["HF_HUB_ENABLE_HF_TRANSFER"]) == ("1", "0"), name
        assert v["PIP_INDEX_URL"].startswith("https://"), name
    # Gpushare's turbo proxy is exported per session, not sourced: no hook, and the note says so
    g = load("gpushare").env
    assert g.proxy_hook == "" and "per session" in g.note


# ---- broken files, through the real CLI


def _rgt(*args: str, env: Dict[str, str]) -> subprocess.CompletedProcess[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "rgt")
    argv = [exe] if os.path.exists(exe) else [sys.executable, "-m", "controller.cli"]
    return subprocess.run(
        [*argv, *args], capture_output=True, text=True, timeout=60, env={**os.environ, **env}
    )


def _minimal(name: str) -> str:
    """A whole, valid profile named ``name`` (the generic box's file, renamed)."""
    text = (Path(SHIPPED_DIR) / "generic-ssh.toml").read_text()
    return text.replace('name = "generic-ssh"', f'name = "{name}"', 1)


_ON_DONE_RM = '[[meter.on_done]]\nname = "rm"\ncommand = ["rm", "-rf", "/"]\nreversible = false\n\n'
BROKEN = [
    # (what, text of a valid file, its replacement, the field the error names, a word of the fix)
    ("unknown field", "[reach]\n", "[reach]\nsssh = 1\n", "reach.sssh", "allowed"),
    ("wrong type", "hands_on = false", 'hands_on = "no"', "hands_on", "true or false"),
    ("missing field", 'verb = "manual"\n', "", "meter.verb", "add it"),
    ("bad duration", 'grace = "30s"', 'grace = "soon"', "preemption.grace", "duration"),
    (
        "irreversible on_done",
        "[preemption]",
        _ON_DONE_RM + "[preemption]",
        "meter.on_done[0].reversible",
        "remove it",
    ),
    ("name not the file's", 'name = "mybox"', 'name = "other"', "name", 'name = "mybox"'),
]


@pytest.mark.parametrize("what,old,new,field,fix", BROKEN, ids=[b[0] for b in BROKEN])
def test_a_broken_profile_is_exit_2_naming_file_field_and_fix(
    tmp_path: Path, what: str, old: str, new: str, field: str, fix: str
) -> None:
    good = _minimal("mybox")
    bad = good.replace(old, new, 1)
    assert bad != good, f"the {what} edit did not apply"
    path = tmp_path / "mybox.toml"
    path.write_text(bad)
    env = {"RGT_PROFILES_DIR": str(tmp_path), "RGT_CONTROLLER_HOME": str(tmp_path / "home")}
    p = _rgt("profiles", "show", "mybox", env=env)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert str(path) in lines[0] and f": {field}:" in lines[0] and fix in lines[0], lines[0]
    path.write_text(good)  # the same file, fixed, loads: the error was the edit's
    assert _rgt("profiles", "show", "mybox", env=env).returncode == 0


def test_a_bad_field_in_an_override_names_the_users_file(tmp_path: Path) -> None:
    mine = tmp_path / "runpod.toml"
    mine.write_text('[preemption]\ngrace = "-5s"\n')
    env = {"RGT_PROFILES_DIR": str(tmp_path), "RGT_CONTROLLER_HOME": str(tmp_path / "home")}
    p = _rgt("profiles", "show", "runpod", env=env)
    assert p.returncode == 2, p.stderr
    line = p.stderr.strip()
    assert str(mine) in line and "preemption.grace" in line and SHIPPED_DIR not in line, line


def test_an_override_changes_only_what_it_sets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "vastai.toml").write_text('[preemption]\ngrace = "3s"\n')
    monkeypatch.setenv("RGT_CONTROLLER_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("RGT_PROFILES_DIR", raising=False)
    base = {p.name: p for p in prof.load_all()}
    monkeypatch.setenv("RGT_PROFILES_DIR", str(tmp_path))
    mine = {p.name: p for p in prof.load_all()}
    assert mine.keys() == base.keys()
    v = mine["vastai"]
    assert v.preemption.grace == 3 and v.override == str(tmp_path / "vastai.toml")
    assert v.preemption.notice == base["vastai"].preemption.notice  # the rest of its table
    restored = prof.to_json(v)
    restored["preemption"]["grace"] = base["vastai"].preemption.grace
    restored["override"] = None
    assert restored == prof.to_json(base["vastai"])
    for name in base.keys() - {"vastai"}:
        assert mine[name] == base[name], name


# ---- the README's table


def test_readme_platform_table_is_the_generated_one() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    want = prof.splice(readme, prof.readme_table(prof.shipped()))
    assert readme == want, (
        "README.md's platform table is stale: python -m controller.profiles --readme"
    )


def test_readme_table_has_a_row_per_profile_and_splice_needs_markers() -> None:
    table = prof.readme_table(prof.shipped())
    rows: List[str] = [r for r in table.splitlines() if r.startswith("| `")]
    assert [r.split("`")[1] for r in rows] == names()
    with pytest.raises(ValueError, match="platforms:begin"):
        prof.splice("no markers here\n", table)


def test_old_and_untested_facts_are_flagged() -> None:
    """Six months after the stamp a fact is old (the fact base's own staleness rule)."""
    vast = load("vastai")  # checked 2026-06, never tested hands-on
    fresh, old = datetime.date(2026, 12, 1), datetime.date(2027, 1, 1)
    assert prof.flags(vast.stamp, fresh) == ["not tested hands-on"]
    assert prof.flags(vast.stamp, old) == ["not tested hands-on", "checked 7 months ago"]
    assert prof.flags(load("autodl").stamp, fresh) == []
    line = next(ln for ln in prof.table([vast], old).splitlines() if ln.startswith("vastai"))
    assert "2026-06 (old)" in line
    assert "(old)" not in prof.table([vast], fresh)
    assert "checked 2026-06 (not tested hands-on; checked 7 months ago)" in prof.describe(vast, old)


def test_durations_read_as_the_profiles_write_them() -> None:
    got = [prof.seconds(s) for s in (None, 0, 5, 90, 5400, 86400, 15 * DAY)]
    assert got == ["-", "0s", "5s", "90s", "90m", "24h", "15d"]
