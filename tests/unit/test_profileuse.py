"""What a platform profile changes in a JobSpec, the meter cap and the on-done choice: the user's
values always win, a bad name is refused before anything starts (exit 2)."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List

import pytest

from onbox.agent.meter import POLL, MeterCap
from onbox.agent.ondone import run_once
from onbox.agent.spec import JobSpec, Overrides, build_spec
from onbox.common.errors import HostError, UsageError
from onbox.common.rundir import RunDir


def _build(tmp_path: Any, toml: str = "", environ: Any = None, **flags: Any) -> JobSpec:
    job = None
    if toml:
        job = str(tmp_path / "job.toml")
        with open(job, "w") as f:
            f.write('command = ["true"]\n' + toml)
    env = {"PATH": os.environ["PATH"], "RGT_HOME": str(tmp_path / "home")}
    if environ is None:  # the shipped durable paths (/workspace, /root/autodl-fs) are not here
        vol = tmp_path / "vol"
        vol.mkdir(exist_ok=True)
        _durable(tmp_path, "runpod", str(vol))
        environ = _durable(tmp_path, "autodl", str(vol))
    env.update(environ)
    if job is None:
        flags.setdefault("command", ["true"])
    return build_spec(
        job,
        Overrides(**flags),
        cwd=str(tmp_path),
        environ=env,
        default_name="job",
        run_dir_of=lambda n: str(tmp_path / "runs" / n),
    )


def _durable(tmp_path: Any, name: str, path: str) -> Dict[str, str]:
    """A user profile dir whose ``name`` profile has its durable path at ``path``."""
    d = tmp_path / "profiles"
    d.mkdir(exist_ok=True)
    (d / f"{name}.toml").write_text(f'[durable]\npath = "{path}"\n')
    return {"RGT_PROFILES_DIR": str(d)}


def test_runpod_gives_grace_env_store_and_notice(tmp_path: Any) -> None:
    vol = tmp_path / "workspace"
    vol.mkdir()
    spec = _build(tmp_path, profile="runpod", environ=_durable(tmp_path, "runpod", str(vol)))
    assert spec.profile == "runpod" and spec.grace == 5.0 and spec.notice == "signal"
    assert spec.env["HF_HOME"] == "/workspace/hf"
    assert spec.store is not None and spec.store.url == f"file://{vol}/rgt"
    assert spec.proxy_hook == "" and spec.deadline is None and spec.on_done is None


def test_the_users_values_win_over_the_profile(tmp_path: Any) -> None:
    toml = 'grace = 40\nstore = "file:///data/s"\n[env]\nHF_HOME = "/mine"\n'
    spec = _build(tmp_path, toml, profile="runpod")
    assert spec.grace == 40.0 and spec.env["HF_HOME"] == "/mine"
    assert spec.env["PIP_CACHE_DIR"] == "/workspace/.cache/pip"
    assert spec.store is not None and spec.store.url == "file:///data/s"
    assert _build(tmp_path, profile="runpod", grace="12").grace == 12.0
    assert _build(tmp_path, 'profile = "runpod"\n', grace="12").grace == 12.0


def test_the_flag_names_the_profile_over_the_job_file(tmp_path: Any) -> None:
    spec = _build(tmp_path, 'profile = "runpod"\n', profile="autodl")
    assert spec.profile == "autodl" and spec.grace == 10.0
    assert spec.proxy_hook == "/etc/network_turbo"
    assert spec.env["PIP_INDEX_URL"] == "https://pypi.tuna.tsinghua.edu.cn/simple"


def test_no_profile_keeps_the_old_defaults(tmp_path: Any) -> None:
    spec = _build(tmp_path)
    assert spec.profile is None and spec.grace == 30.0 and spec.store is None and spec.env == {}


def test_a_user_override_dir_is_read(tmp_path: Any) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    spec = _build(tmp_path, profile="runpod", environ=_durable(tmp_path, "runpod", str(a)))
    assert spec.store is not None and spec.store.url == f"file://{a}/rgt"
    # $RGT_HOME/profiles is the box's user dir when RGT_PROFILES_DIR is not set
    home = tmp_path / "home" / "profiles"
    home.mkdir(parents=True)
    (home / "runpod.toml").write_text(f'[durable]\npath = "{b}"\n')
    spec = _build(tmp_path, profile="runpod", environ={})
    assert spec.store is not None and spec.store.url == f"file://{b}/rgt"


def test_a_missing_durable_path_is_refused_as_the_default_store(tmp_path: Any) -> None:
    gone = tmp_path / "not-mounted"
    with pytest.raises(HostError) as e:
        _build(tmp_path, profile="runpod", environ=_durable(tmp_path, "runpod", str(gone)))
    assert str(gone) in e.value.line() and "--store" in e.value.line()
    assert not gone.exists()
    spec = _build(  # a store the user names needs no durable path
        tmp_path,
        profile="runpod",
        store="file:///data/s",
        environ=_durable(tmp_path, "runpod", str(gone)),
    )
    assert spec.store is not None and spec.store.url == "file:///data/s"


@pytest.mark.parametrize(
    "flags,field",
    [
        ({"profile": "nope"}, "--profile"),
        ({"on_done": "poweroff"}, "--on-done"),
        ({"profile": "runpod", "on_done": "poweroff"}, "--on-done"),
        ({"profile": "autodl", "on_done": "reboot"}, "--on-done"),
        ({"max_cost": "20"}, "--max-cost"),
        ({"price": "2"}, "--price"),
        ({"max_cost": "-1", "price": "2"}, "--max-cost"),
        ({"deadline": "soon"}, "--deadline"),
    ],
)
def test_bad_choices_are_usage_errors(tmp_path: Any, flags: Dict[str, str], field: str) -> None:
    with pytest.raises(UsageError) as e:
        _build(tmp_path, **flags)
    assert e.value.exit_code == 2 and field in e.value.line()


def test_on_done_errors_say_what_is_allowed(tmp_path: Any) -> None:
    with pytest.raises(UsageError) as e:
        _build(tmp_path, profile="autodl", on_done="reboot")
    assert "poweroff" in e.value.line()
    with pytest.raises(UsageError) as e:
        _build(tmp_path, profile="runpod", on_done="poweroff")
    assert "no reversible automatic meter-stop" in e.value.line()


def test_on_done_picks_the_profiles_action(tmp_path: Any) -> None:
    spec = _build(tmp_path, 'on_done = "poweroff"\n', profile="autodl")
    assert spec.on_done == "poweroff" and spec.on_done_command == ("shutdown", "-h", "now")


def test_meter_cap_is_an_absolute_deadline(tmp_path: Any) -> None:
    import time

    before = time.time()
    spec = _build(tmp_path, deadline="72h")
    assert (
        spec.deadline is not None and before + 72 * 3600 <= spec.deadline <= time.time() + 72 * 3600
    )
    spec = _build(tmp_path, max_cost="20", price="2")  # 10 hours
    assert spec.deadline is not None and abs(spec.deadline - before - 36000) < 60
    spec = _build(tmp_path, '[meter]\ndeadline = "1h"\nmax_cost = 20\nprice_per_hour = 2\n')
    assert spec.deadline is not None and abs(spec.deadline - before - 3600) < 60  # the earlier
    spec = _build(tmp_path, '[meter]\ndeadline = "1h"\n', deadline="2h")  # the flag wins
    assert spec.deadline is not None and abs(spec.deadline - before - 7200) < 60
    with pytest.raises(UsageError):
        _build(tmp_path, "[meter]\ncost = 3\n")


def test_new_fields_round_trip_and_old_spec_files_read(tmp_path: Any) -> None:
    spec = _build(tmp_path, 'on_done = "poweroff"\n', profile="autodl", deadline="3s")
    doc = json.loads(json.dumps(spec.to_json()))
    assert JobSpec.from_json(doc) == spec
    for key in ("profile", "proxy_hook", "notice", "on_done", "on_done_command", "deadline"):
        del doc[key]
    old = JobSpec.from_json(doc)
    assert (old.profile, old.proxy_hook, old.notice, old.on_done, old.deadline) == (
        None,
        "",
        "none",
        None,
        None,
    )
    assert old.on_done_command == ()


def test_a_cap_reached_during_a_seal_waits_for_the_seal() -> None:
    from onbox.agent.states import State

    now = [100.0]
    cap = MeterCap(103.0, clock=lambda: now[0])
    sup, seal = _Sup(State.RUNNING), _Seal()
    seal.sealing = False
    assert not cap.due(sealing=False) and cap.wait(sup, seal) == 3.0
    now[0] = 104.0
    assert not cap.due(sealing=True)  # a seal is in progress: not yet
    seal.sealing = True
    assert cap.wait(sup, seal) == POLL
    assert cap.wait(_Sup(State.STOPPING), seal) is None  # a stop under way: nothing to wait for
    assert cap.due(sealing=False)  # the seal ended
    assert not cap.due(sealing=False) and cap.wait(sup, None) is None  # once
    assert MeterCap(None).wait(sup, None) is None


def test_a_new_agent_keeps_a_fired_cap_and_a_new_deadline_arms_it_again() -> None:
    doc = {"state": "STOPPING", "meter_cap": {"deadline": 5.0}}
    cap = MeterCap.resume(5.0, doc)
    assert cap.fired and cap.stopping
    cap = MeterCap.resume(5.0, dict(doc, state="STOPPED"))
    assert cap.fired and not cap.stopping  # started again after its cap: not capped at once
    cap = MeterCap.resume(9.0, dict(doc, state="STOPPED"))
    assert not cap.fired and not cap.stopping
    assert not MeterCap.resume(5.0, None).fired


class _Sup:
    def __init__(self, state: Any) -> None:
        self.state = state
        self.extra: Dict[str, Any] = {}
        self.stops: List[str] = []

    def request_stop(self, reason: str) -> None:
        self.stops.append(reason)


class _Seal:
    def __init__(self) -> None:
        self.sealing = True
        self.capped = False
        self.asked: List[str] = []

    def ask_job(self, why: str) -> None:
        self.asked.append(why)


def test_the_cap_asks_for_a_checkpoint_then_stops_but_not_mid_seal() -> None:
    from onbox.agent.states import State

    events: List[str] = []
    sup, seal = _Sup(State.RUNNING), _Seal()
    cap = MeterCap(1.0, clock=lambda: 2.0)
    cap.check(sup, seal, lambda kind, reason, **kw: events.append(kind))
    assert sup.stops == [] and events == []  # waiting for the seal in progress
    seal.sealing = False
    cap.check(sup, seal, lambda kind, reason, **kw: events.append(kind))
    assert seal.asked == ["meter cap"] and seal.capped and sup.stops == ["stop"]
    assert events == ["meter_cap"] and sup.extra["meter_cap"] == {"deadline": 1.0}


def test_on_done_runs_once_and_a_shebangless_script_runs_with_sh(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RGT_HOME", str(tmp_path / "home"))
    rd = RunDir("od")
    os.makedirs(rd.path)
    marker = tmp_path / "marker"
    script = tmp_path / "fake-poweroff"
    script.write_text('echo off >> "$1"\n')  # no #! line: exec fails with ENOEXEC
    script.chmod(0o755)
    events: List[Dict[str, Any]] = []

    def event(kind: str, reason: str, **kw: Any) -> None:
        events.append(dict(kw, kind=kind))

    assert run_once("poweroff", [str(script), str(marker)], rd, "test", event) == 0
    assert run_once("poweroff", [str(script), str(marker)], rd, "test", event) is None
    assert marker.read_text() == "off\n"
    kinds = [e["kind"] for e in events]
    # Not run again is no failure and no meter left running: a kind of its own, not the
    # on_done_skipped (class usage) of a run whose result is not verified.
    assert kinds == ["on_done_started", "on_done_finished", "on_done_started_before"]
    assert events[-1].get("klass") is None and events[-1]["action"] == "poweroff", events


def test_on_done_that_fails_says_so(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RGT_HOME", str(tmp_path / "home"))
    rd = RunDir("od")
    os.makedirs(rd.path)
    events: List[Dict[str, Any]] = []

    def event(kind: str, reason: str, **kw: Any) -> None:
        events.append(dict(kw, kind=kind))

    assert run_once("poweroff", ["sh", "-c", "exit 3"], rd, "test", event) == 3
    assert events[-1]["kind"] == "on_done_failed" and events[-1]["code"] == 3
    os.unlink(os.path.join(rd.path, "on_done.json"))
    assert run_once("poweroff", [str(tmp_path / "missing")], rd, "test", event) is None
    assert events[-1]["kind"] == "on_done_failed"


def test_on_done_needs_a_store(tmp_path: Any) -> None:
    d = tmp_path / "profiles"
    d.mkdir(exist_ok=True)
    (d / "autodl.toml").write_text('[durable]\npath = ""\n')
    with pytest.raises(UsageError) as e:
        _build(tmp_path, profile="autodl", on_done="poweroff", environ={"RGT_PROFILES_DIR": str(d)})
    assert "--store" in e.value.line()
    spec = _build(
        tmp_path,
        profile="autodl",
        on_done="poweroff",
        store="file:///data/s",
        environ={"RGT_PROFILES_DIR": str(d)},
    )
    assert spec.on_done == "poweroff"


def test_a_proxy_hook_gives_what_it_exported_or_changed(tmp_path: Any) -> None:
    from onbox.agent.proxyhook import source

    hook = tmp_path / "turbo"
    hook.write_text(
        "export http_proxy=http://p:1\nexport KEEP=same\n"
        'PATH="/opt/x:$PATH"\nexport PATH\necho hi\n'
    )
    got, why = source(str(hook), {"PATH": "/usr/bin:/bin", "KEEP": "same"})
    assert why is None and got == {"http_proxy": "http://p:1", "PATH": "/opt/x:/usr/bin:/bin"}
    hook.write_text("exit 4\n")
    got, why = source(str(hook), {"PATH": "/usr/bin:/bin"})
    assert got == {} and why is not None and "failed" in why
    got, why = source(str(tmp_path / "none"), {})
    assert got == {} and why is not None and "does not exist" in why


def test_a_run_started_again_keeps_its_profile_and_takes_a_new_cap(tmp_path: Any) -> None:
    from onbox.agent.profileuse import apply_again

    spec = _build(tmp_path, profile="runpod", deadline="1h")
    env = {"RGT_HOME": str(tmp_path / "home")}
    assert apply_again(spec, Overrides(), env) == spec  # nothing given: the last spec
    again = apply_again(spec, Overrides(deadline="2h"), env)
    assert again.deadline is not None and spec.deadline is not None
    assert again.deadline > spec.deadline
    with pytest.raises(UsageError) as e:
        apply_again(spec, Overrides(profile="autodl"), env)
    assert "runpod" in e.value.line()
    with pytest.raises(UsageError):  # runpod has no on-done action
        apply_again(spec, Overrides(on_done="poweroff"), env)


def test_a_durable_path_with_the_boxs_variables_is_expanded(tmp_path: Any) -> None:
    """Slurm's durable path is /scratch/$USER/proj: the default store is this box's, expanded;
    a variable the box does not set is refused, not made into a directory named '$X'."""
    scratch = tmp_path / "scratch" / "alice" / "proj"
    scratch.mkdir(parents=True)
    env = _durable(tmp_path, "slurm", str(tmp_path / "scratch" / "$USER" / "proj"))
    spec = _build(tmp_path, profile="slurm", environ={**env, "USER": "alice"})
    assert spec.store is not None and spec.store.url == f"file://{scratch}/rgt"
    env = _durable(tmp_path, "slurm", "/scratch/$RGT_TEST_UNSET_VAR/proj")
    with pytest.raises(HostError, match="variable this box does not set"):
        _build(tmp_path, profile="slurm", environ=env)
