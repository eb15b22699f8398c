"""``rgt profiles`` and ``rgt profiles show P`` through the real CLI as a subprocess: the table,
one profile's facts, their JSON, and a user's file in ``$RGT_CONTROLLER_HOME/profiles`` (the
laptop's default user directory) shown as the override it is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict

from onbox.profiles import names


def _rgt(*args: str, env: Dict[str, str]) -> subprocess.CompletedProcess[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "rgt")
    argv = [exe] if os.path.exists(exe) else [sys.executable, "-m", "controller.cli"]
    full = {k: v for k, v in os.environ.items() if k != "RGT_PROFILES_DIR"}
    return subprocess.run(
        [*argv, *args], capture_output=True, text=True, timeout=60, env={**full, **env}
    )


def _home(tmp_path: Path) -> Dict[str, str]:
    return {"RGT_CONTROLLER_HOME": str(tmp_path / "controller")}


def test_the_table_lists_every_profile(tmp_path: Path) -> None:
    p = _rgt("profiles", env=_home(tmp_path))
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].split()[:3] == ["NAME", "TITLE", "KIND"] and "HANDS-ON" in lines[0]
    assert [ln.split()[0] for ln in lines[1:]] == names()
    vast = next(ln for ln in lines if ln.startswith("vastai "))
    assert "destroy" in vast and " 0s " in vast and "(off the box)" in vast


def test_the_table_as_json(tmp_path: Path) -> None:
    p = _rgt("profiles", "--json", env=_home(tmp_path))
    assert p.returncode == 0, p.stderr
    rows = {r["name"]: r for r in json.loads(p.stdout)}
    assert sorted(rows) == names()
    auto = rows["autodl"]
    assert (auto["meter_verb"], auto["reversible"], auto["grace_s"]) == (
        "关机 (power off)",
        True,
        10,
    )
    assert auto["durable_path"] == "/root/autodl-fs" and auto["hands_on"] is True


def test_show_gives_every_fact_of_one_profile(tmp_path: Path) -> None:
    p = _rgt("profiles", "show", "gpushare", env=_home(tmp_path))
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert out.startswith("gpushare: ") and "loaded from " in out and "gpushare.toml" in out
    assert "not tested hands-on" in out
    for fact in (
        "/hy-netdisk",  # durable
        "stop no  destroy no",  # the survival matrix: / resets on stop
        "stop yes destroy yes",
        "auto-release after 10d",  # danger clocks
        "arrears-purge after 15d",
        "meter stop: 关机 (power off) (reversible: yes; no API: by hand)",
        "HF_ENDPOINT=https://hf-mirror.com",  # env
        "PIP_INDEX_URL=https://pypi.tuna.tsinghua.edu.cn/simple",
        "无卡模式",  # conveniences
    ):
        assert fact in out, fact


def test_show_json_is_the_whole_profile(tmp_path: Path) -> None:
    p = _rgt("profiles", "show", "vastai", "--json", env=_home(tmp_path))
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["name"] == "vastai" and doc["override"] is None
    assert doc["boot"]["hook"] == "onstart" and doc["boot"]["path"] == "/root/onstart.sh"
    assert doc["preemption"]["grace"] == 0 and doc["meter"]["api"] == "vastai"
    assert [d["name"] for d in doc["danger"]] == ["rental-end", "zero-balance"]


def test_a_file_in_the_controller_home_overrides_one_fact(tmp_path: Path) -> None:
    env = _home(tmp_path)
    mine = tmp_path / "controller" / "profiles" / "lambda.toml"
    mine.parent.mkdir(parents=True)
    mine.write_text('[preemption]\ngrace = "45s"\n')
    p = _rgt("profiles", "show", "lambda", "--json", env=env)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["preemption"]["grace"] == 45 and doc["override"] == str(mine)
    assert doc["meter"]["verb"] == "terminate"  # the rest is the shipped file's
    shown = _rgt("profiles", "show", "lambda", env=env).stdout
    assert f"overridden by {mine}" in shown and "grace 45s" in shown
    table = _rgt("profiles", env=env).stdout
    assert any(ln.startswith("lambda *") for ln in table.splitlines())
    assert "overridden by a file of yours" in table


def test_show_an_unknown_profile_is_exit_2_listing_the_known(tmp_path: Path) -> None:
    p = _rgt("profiles", "show", "nosuch", env=_home(tmp_path))
    assert p.returncode == 2 and "'nosuch' is not a profile" in p.stderr
    assert "autodl" in p.stderr and len(p.stderr.strip().splitlines()) == 1
