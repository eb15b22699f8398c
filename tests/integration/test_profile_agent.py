"""rgt-agent acting on a platform profile, through the real command, agents, shims and jobs: the
proxy hook and the profile's variables reach the job, the profile's grace is the stop budget,
the default store is the profile's durable path, the meter cap stops a run between seals, and
the on-done action (a fake power-off: a script writing a marker) runs once after DONE only."""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Dict

from onbox.agent import procfs
from tests.conftest import Cli, fixture

PROXY = "http://user:pw@proxy.test:3128"


def _profiles(cli: Cli, tmp_path: Any, name: str, toml: str) -> str:
    """A user profile dir ($RGT_PROFILES_DIR) holding ``name``.toml over the shipped one."""
    d = tmp_path / "profiles"
    d.mkdir(exist_ok=True)
    (d / f"{name}.toml").write_text(toml)
    cli.env["RGT_PROFILES_DIR"] = str(d)
    return str(d)


def _durable(tmp_path: Any) -> str:
    """The profile's durable path, with the store root the profile defaults to under it made
    (on a real box the durable path is a mount, under which rgt makes it itself)."""
    root = tmp_path / "durable"
    (root / "rgt").mkdir(parents=True, exist_ok=True)
    return str(root)


def _spec(cli: Cli, name: str) -> Dict[str, Any]:
    with open(os.path.join(cli.home, "runs", name, "spec.json")) as f:
        out: Dict[str, Any] = json.load(f)
    return out


def _env_job(tmp_path: Any) -> str:
    """A job whose first act is to write the variables a download cares about."""
    path = tmp_path / "envjob.py"
    out = tmp_path / "env.json"
    keys = [
        "http_proxy",
        "https_proxy",
        "no_proxy",
        "HF_ENDPOINT",
        "HF_HUB_DISABLE_XET",
        "PIP_INDEX_URL",
    ]
    path.write_text(
        "import json, os\n"
        f"json.dump({{k: os.environ.get(k) for k in {keys!r}}}, open({str(out)!r}, 'w'))\n"
    )
    return str(path)


def test_autodl_proxy_hook_and_profile_vars_reach_the_job_first(cli: Cli, tmp_path: Any) -> None:
    hook = tmp_path / "network_turbo"
    hook.write_text(
        f"export http_proxy={PROXY}\nexport https_proxy={PROXY}\n"
        "export no_proxy=localhost,127.0.0.1\necho noise\n"
    )
    fs = _durable(tmp_path)
    _profiles(cli, tmp_path, "autodl", f'[env]\nproxy_hook = "{hook}"\n[durable]\npath = "{fs}"\n')
    job = _env_job(tmp_path)
    p = cli("run", "--profile", "autodl", "--name", "ad", "--", sys.executable, job, timeout=120)
    assert p.returncode == 0, p.stderr
    env = json.loads((tmp_path / "env.json").read_text())
    assert env == {
        "http_proxy": PROXY,
        "https_proxy": PROXY,
        "no_proxy": "localhost,127.0.0.1",
        "HF_ENDPOINT": "https://hf-mirror.com",
        "HF_HUB_DISABLE_XET": "1",
        "PIP_INDEX_URL": "https://pypi.tuna.tsinghua.edu.cn/simple",
    }
    spec = _spec(cli, "ad")
    assert spec["profile"] == "autodl" and spec["grace"] == 10.0
    assert spec["store"] == f"file://{fs}/rgt"  # the profile's durable path: no --store
    assert os.path.exists(os.path.join(fs, "rgt", "ad", "DONE.json"))
    events = cli.events("ad")
    said = [e for e in events if e["kind"] == "proxy_hook"]
    assert len(said) == 1 and said[0]["variables"] == ["http_proxy", "https_proxy", "no_proxy"]
    with open(os.path.join(cli.home, "runs", "ad", "events.jsonl")) as f:
        assert "proxy.test" not in f.read()  # the hook's values are never logged


def test_a_missing_hook_warns_and_the_job_still_runs(cli: Cli, tmp_path: Any) -> None:
    fs = _durable(tmp_path)
    missing = tmp_path / "no-such-hook"
    _profiles(
        cli, tmp_path, "autodl", f'[env]\nproxy_hook = "{missing}"\n[durable]\npath = "{fs}"\n'
    )
    job = _env_job(tmp_path)
    p = cli("run", "--profile", "autodl", "--name", "ad2", "--", sys.executable, job, timeout=120)
    assert p.returncode == 0, p.stderr
    env = json.loads((tmp_path / "env.json").read_text())
    assert env["HF_ENDPOINT"] == "https://hf-mirror.com" and env["http_proxy"] is None
    failed = [e for e in cli.events("ad2") if e["kind"] == "proxy_hook_failed"]
    assert len(failed) == 1 and str(missing) in failed[0]["reason"] and failed[0]["remedy"]


def test_runpod_grace_is_the_stop_budget(cli: Cli, tmp_path: Any) -> None:
    _profiles(cli, tmp_path, "runpod", f'[durable]\npath = "{_durable(tmp_path)}"\n')
    cli(
        "start", "--profile", "runpod", "--name", "rp", "--", *fixture("ignore_term.py"), check=True
    )
    st = cli.wait_state("rp", "RUNNING", timeout=30)
    assert _spec(cli, "rp")["grace"] == 5.0
    job = st["pid"]
    cli("stop", "rp", check=True, timeout=60)  # ignores SIGTERM: SIGKILL after the grace
    st = cli.status("rp")
    assert st["state"] == "STOPPED" and st["stop"]["grace"] == 5.0
    assert st["last_exit"]["signal"] == 9
    assert procfs.identity(job) is None


def test_the_grace_flag_wins_over_the_profile(cli: Cli, tmp_path: Any) -> None:
    _profiles(cli, tmp_path, "runpod", f'[durable]\npath = "{_durable(tmp_path)}"\n')
    cli(
        "start",
        "--grace",
        "12",
        "--profile",
        "runpod",
        "--name",
        "rg",
        "--",
        *fixture("hang.py"),
        check=True,
    )
    spec = _spec(cli, "rg")
    assert spec["grace"] == 12.0 and spec["profile"] == "runpod" and spec["notice"] == "signal"
    cli("stop", "rg", "--grace", "1", check=True)


def test_a_bad_profile_is_refused_before_anything_is_made(cli: Cli) -> None:
    p = cli("start", "--profile", "nope", "--name", "bad", "--", *fixture("hang.py"))
    assert p.returncode == 2 and "nope" in p.stderr and "runpod" in p.stderr
    assert not os.path.exists(os.path.join(cli.home, "runs", "bad"))


CKPT_JOB = """\
import io, os, signal, sys, time, zipfile
d = os.environ["RGT_CKPT_DIR"]
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
step = 0
while not stop:
    step += 1
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("step", str(step))
    tmp = os.path.join(d, ".step_%d.pt.tmp" % step)
    with open(tmp, "wb") as f:
        f.write(buf.getvalue())
    os.rename(tmp, os.path.join(d, "step_%d.pt" % step))
    print("step", step, flush=True)
    time.sleep(0.3)
sys.exit(0)
"""


def test_the_meter_cap_stops_the_run_with_its_newest_checkpoint_sealed(
    cli: Cli, tmp_path: Any
) -> None:
    from onbox.sealing import manifest as mf
    from onbox.sealing.discovery import newest_local_step
    from onbox.sealing.stores import open_store

    fs = _durable(tmp_path)
    job = tmp_path / "ckptjob.py"
    job.write_text(CKPT_JOB)
    cli(
        "start",
        "--store",
        f"file://{fs}",
        "--deadline",
        "3s",
        "--name",
        "cap",
        "--",
        sys.executable,
        str(job),
        check=True,
    )
    spec = _spec(cli, "cap")
    assert spec["deadline"] is not None
    st = cli.wait_state("cap", "STOPPED", "FAILED", "SUCCEEDED", timeout=90)
    assert st["state"] == "STOPPED"
    kinds = [e["kind"] for e in cli.events("cap")]
    assert "meter_cap" in kinds
    cap = next(e for e in cli.events("cap") if e["kind"] == "meter_cap")
    assert cap["deadline"] == spec["deadline"]
    latest = mf.parse_latest(open_store(f"file://{fs}").get_bytes(mf.latest_key("cap")))
    newest = newest_local_step(spec["ckpt_dir"])
    assert newest is not None and latest is not None and latest["step"] == newest
    sealed = [e for e in cli.events("cap") if e["kind"] == "meter_cap_sealed"]
    assert len(sealed) == 1 and sealed[0]["verified"] is True


def _poweroff_profile(cli: Cli, tmp_path: Any) -> Any:
    """An AutoDL override whose on-done "poweroff" is a fake: a shebang-less script (as some
    images ship /usr/bin/shutdown) recording whether DONE.json was in the store when it ran."""
    fs = _durable(tmp_path)
    marker = tmp_path / "powered-off"
    script = tmp_path / "fake-shutdown"
    script.write_text(
        f'if [ -f "{fs}/rgt/$2/DONE.json" ]; then echo after-done >> "$1"; '
        'else echo before-done >> "$1"; fi\n'
    )
    script.chmod(0o755)
    _profiles(
        cli,
        tmp_path,
        "autodl",
        f'[env]\nproxy_hook = ""\n[durable]\npath = "{fs}"\n'
        f'[[meter.on_done]]\nname = "poweroff"\n'
        f'command = [{json.dumps(str(script))}, {json.dumps(str(marker))}, "od"]\n'
        "reversible = true\n",
    )
    return marker


def test_fake_poweroff_runs_once_after_done_is_in_the_store(cli: Cli, tmp_path: Any) -> None:
    marker = _poweroff_profile(cli, tmp_path)
    p = cli(
        "run",
        "--profile",
        "autodl",
        "--on-done",
        "poweroff",
        "--name",
        "od",
        "--",
        sys.executable,
        "-c",
        "print('trained')",
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert marker.read_text() == "after-done\n"
    kinds = [e["kind"] for e in cli.events("od")]
    assert kinds.count("on_done_started") == 1 and "on_done_failed" not in kinds
    assert kinds.index("done") < kinds.index("on_done_started")
    assert _spec(cli, "od")["on_done_command"][1] == str(marker)


def test_fake_poweroff_never_runs_after_a_failed_job(cli: Cli, tmp_path: Any) -> None:
    marker = _poweroff_profile(cli, tmp_path)
    job = tmp_path / "od.toml"
    job.write_text(
        f'name = "od"\nprofile = "autodl"\non_done = "poweroff"\n'
        f'command = [{json.dumps(sys.executable)}, "-c", "import sys; sys.exit(3)"]\n'
        "[restart]\nmax_error_restarts = 0\n"
    )
    p = cli("run", str(job), timeout=120)
    assert p.returncode != 0
    assert cli.status("od")["state"] == "FAILED"
    assert not marker.exists()
    kinds = [e["kind"] for e in cli.events("od")]
    assert "on_done_started" not in kinds and "on_done_skipped" in kinds


def test_fake_poweroff_runs_after_a_meter_caps_verified_final_seal(cli: Cli, tmp_path: Any) -> None:
    marker = _poweroff_profile(cli, tmp_path)
    job = tmp_path / "ckptjob.py"
    job.write_text(CKPT_JOB)
    cli(
        "start",
        "--profile",
        "autodl",
        "--on-done",
        "poweroff",
        "--deadline",
        "3s",
        "--name",
        "od",
        "--",
        sys.executable,
        str(job),
        check=True,
    )
    assert cli.wait_state("od", "STOPPED", "FAILED", "SUCCEEDED", timeout=90)["state"] == "STOPPED"
    cli.wait_for("od", lambda s: not s["agent"]["alive"], what="the agent to exit")
    events = cli.events("od")
    kinds = [e["kind"] for e in events]
    assert kinds.index("meter_cap_sealed") < kinds.index("on_done_started")
    assert kinds.count("on_done_started") == 1
    assert marker.read_text() == "before-done\n"  # a capped run has no DONE.json: its LATEST
