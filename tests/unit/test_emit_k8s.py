"""`rgt emit k8s`: the manifests of three job files checked against the Kubernetes API models of
the official Python client (no cluster runs here): every field known to the model, required
fields present, the grace derived from the seal time (measured from a real agent's events in a
file store, or assumed and said so), the failure policy naming rgt's permanent exit codes, no
secret inline."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from typing import Any, Dict, List, Optional

import pytest

from controller.emit import k8s
from onbox.agent import podlaunch
from onbox.common.errors import PERMANENT_EXIT_CODES
from onbox.common.sealtime import SealTime, measure
from tests.conftest import FIXTURES

yaml = pytest.importorskip("yaml")
kclient = pytest.importorskip("kubernetes.client")

RGT = os.path.join(os.path.dirname(sys.executable), "rgt")
AGENT = os.path.join(os.path.dirname(sys.executable), "rgt-agent")
PLANTED_FILE = "hf_" + "Plantedjobfilesecret0123456789"
PLANTED_ENV = "planted-laptop-secret-value-987"


def rgt(
    tmp: str, *args: str, env: Optional[Dict[str, str]] = None
) -> subprocess.CompletedProcess[str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "RGT_"))}
    e.update(RGT_CONTROLLER_HOME=os.path.join(tmp, "ctl"), **(env or {}))
    return subprocess.run([RGT, *args], cwd=tmp, env=e, capture_output=True, text=True, timeout=60)


def job_file(tmp: str, name: str, body: str) -> str:
    path = os.path.join(tmp, f"{name}.toml")
    with open(path, "w") as f:
        f.write(body)
    return path


class _Resp:
    """What ApiClient.deserialize reads: a response whose ``data`` is the JSON body."""

    def __init__(self, doc: Dict[str, Any]) -> None:
        self.data = json.dumps(doc)


def as_v1job(doc: Dict[str, Any]) -> Any:
    return kclient.ApiClient().deserialize(_Resp(doc), "V1Job")


def unknown_fields(doc: Any, model: str, where: str = "") -> List[str]:
    """Every key of ``doc`` that the model ``model`` does not have, recursively."""
    if model.startswith("list["):
        return [
            e for i, v in enumerate(doc) for e in unknown_fields(v, model[5:-1], f"{where}[{i}]")
        ]
    if model.startswith("dict(") or not model.startswith("V1"):
        return []
    cls = getattr(kclient, model)
    by_json = {j: a for a, j in cls.attribute_map.items()}
    bad = []
    for key, value in doc.items():
        if key not in by_json:
            bad.append(f"{where}.{key}")
        else:
            bad += unknown_fields(value, cls.openapi_types[by_json[key]], f"{where}.{key}")
    return bad


def validated(text: str) -> Dict[str, Any]:
    """The manifest, parsed, with every field known to V1Job and the model built from it."""
    doc = yaml.safe_load(text)
    assert unknown_fields(doc, "V1Job") == []
    job = as_v1job(doc)
    assert job.kind == "Job" and job.spec.template.spec.restart_policy == "Never"
    return dict(doc)


def pod(doc: Dict[str, Any]) -> Dict[str, Any]:
    return dict(doc["spec"]["template"]["spec"])


def agent(doc: Dict[str, Any]) -> Dict[str, Any]:
    """The agent: the pod's one init container, a native sidecar."""
    [c] = pod(doc)["initContainers"]
    return dict(c)


def job(doc: Dict[str, Any]) -> Dict[str, Any]:
    """The job's own container: the pod's one main container."""
    [c] = pod(doc)["containers"]
    return dict(c)


def agent_grace(container: Dict[str, Any]) -> int:
    argv = container["command"]
    return int(argv[argv.index("--grace") + 1])


def test_the_model_check_catches_a_typo_and_a_missing_required_field() -> None:
    pod_spec = {"containers": [{"name": "a", "imagee": "x"}]}
    doc = {"apiVersion": "batch/v1", "kind": "Job", "spec": {"template": {"spec": pod_spec}}}
    assert unknown_fields(doc, "V1Job") == [".spec.template.spec.containers[0].imagee"]
    with pytest.raises(ValueError, match="containers"):
        as_v1job({"apiVersion": "batch/v1", "kind": "Job", "spec": {"template": {"spec": {}}}})


def test_plain_job_with_a_pvc_measured_from_a_real_agents_seals(tmp_path: Any) -> None:
    tmp = str(tmp_path)
    store = os.path.join(tmp, "store")
    os.mkdir(store)
    # A real agent run seals two checkpoints into a file store and mirrors its events there.
    real = job_file(
        tmp,
        "real",
        f'name = "plain"\ncommand = [{json.dumps(sys.executable)}, '
        f'{json.dumps(os.path.join(FIXTURES, "ckpt_writer.py"))}, "inplace", "2", "0.2"]\n'
        f'store = "file://{store}"\n',
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RGT_")}
    env["RGT_HOME"] = os.path.join(tmp, "box")
    ran = subprocess.run([AGENT, "run", real], env=env, capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stderr
    with open(os.path.join(store, "plain", "state", "events.jsonl")) as f:
        expected = measure([json.loads(line) for line in f])
    assert expected.seconds is not None

    plain = job_file(tmp, "plain", 'name = "plain"\ncommand = ["python", "train.py"]\n')
    r = rgt(tmp, "emit", "k8s", plain, "--image", "reg/img:1", "--pvc", "ckpt",
            "--seal-from", f"file://{store}")  # fmt: skip
    assert r.returncode == 0, r.stderr
    doc = validated(r.stdout)
    p = pod(doc)
    grace = expected.lead(assumed=30, slack=k8s.SLACK_S, floor=k8s.FLOOR_S)
    assert p["terminationGracePeriodSeconds"] == grace
    assert agent_grace(agent(doc)) == grace - k8s.SLACK_S
    assert doc["metadata"]["annotations"]["rgt.dev/grace"].startswith("measured: ")
    assert "measured: measured" not in doc["metadata"]["annotations"]["rgt.dev/grace"]
    assert "measured" in r.stdout.splitlines()[1]
    assert p["volumes"][1] == {
        "name": "checkpoints",
        "persistentVolumeClaim": {"claimName": "ckpt"},
    }
    c = agent(doc)
    assert {"name": "checkpoints", "mountPath": "/checkpoints"} in c["volumeMounts"]
    argv = c["command"]
    assert argv[:4] == ["rgt-agent", "run", "--pod", "/app/plain.toml"]
    assert argv[argv.index("--store") + 1] == "file:///checkpoints/rgt"
    # The job has a container of its own, started by the launcher in the shared run dir.
    j = job(doc)
    assert j["command"] == ["python3", "-m", "onbox.agent.podlaunch", "/rgt/runs/plain"]
    assert {"name": "PYTHONPATH", "value": k8s.POD_LIB} in j["env"]
    shared = {"name": "rgt-home", "mountPath": k8s.RGT_HOME}
    assert shared in j["volumeMounts"] and shared in c["volumeMounts"]
    assert p["volumes"][0] == {"name": "rgt-home", "emptyDir": {}}
    model = as_v1job(doc).spec.template.spec
    assert model.share_process_namespace is True
    assert model.init_containers[0].restart_policy == "Always"  # a native sidecar
    assert model.init_containers[0].startup_probe._exec.command[:2] == ["python3", "-c"]
    assert "own container" in doc["metadata"]["annotations"]["rgt.dev/oom-isolation"]
    rules = doc["spec"]["podFailurePolicy"]["rules"]
    assert rules[0] == {
        "action": "Ignore",
        "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
    }
    assert rules[1]["action"] == "FailJob"
    assert rules[1]["onExitCodes"] == {
        "containerName": j["name"],  # the main container: the launcher exits with rgt's code
        "operator": "In",
        "values": sorted(PERMANENT_EXIT_CODES),
    }
    assert doc["spec"]["backoffLimit"] >= 1


def test_s3_job_takes_secrets_only_from_a_secret(tmp_path: Any) -> None:
    tmp = str(tmp_path)
    body = (
        'name = "s3job"\ncommand = ["torchrun", "train.py"]\nstore = "s3://bucket/rgt"\n'
        f'[env]\nHF_TOKEN = "{PLANTED_FILE}"\nWANDB_MODE = "offline"\n'
    )
    jf = job_file(tmp, "s3job", body)
    env = {"AWS_SECRET_ACCESS_KEY": PLANTED_ENV, "HF_TOKEN": PLANTED_ENV + "x"}
    r = rgt(tmp, "emit", "k8s", jf, "--image", "img", "--secret", "s3-creds", "--seal-time", "20",
            env=env)  # fmt: skip
    assert r.returncode == 0, r.stderr
    for planted in (PLANTED_FILE, PLANTED_ENV):
        assert planted not in r.stdout and planted not in r.stderr
    assert "HF_TOKEN" in r.stderr  # the user is told to move it into a Secret
    doc = validated(r.stdout)
    c = agent(doc)
    for each in (c, job(doc)):  # the agent for the store, the job for its own credentials
        assert each["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]
        assert all("valueFrom" in e or not k8s_secretish(e["name"]) for e in each["env"])
    grace = SealTime(20.0, 1, "given").lead(assumed=30, slack=k8s.SLACK_S, floor=k8s.FLOOR_S)
    assert pod(doc)["terminationGracePeriodSeconds"] == grace == math.ceil(2 * 20 + k8s.SLACK_S)
    assert agent_grace(c) == grace - k8s.SLACK_S
    assert "resources" not in c and "resources" not in job(doc)  # no GPUs asked


def k8s_secretish(name: str) -> bool:
    from controller.emit.common import is_credential_name

    return is_credential_name(name)


PLAN = """name = "lr"
command = ["python", "train.py", "--lr", "{lr}", "--out", "{out}"]
targets = ["local"]
store = "s3://bucket/sweeps"
outputs = ["out"]
[grid]
lr = [0.1, 0.01, "A.b"]
"""


def test_gpu_sweep_is_an_indexed_job_whose_index_picks_the_cell(tmp_path: Any) -> None:
    from controller.sweep.plan import load_plan

    tmp = str(tmp_path)
    jf = job_file(tmp, "base", 'name = "base"\ncommand = ["python", "train.py"]\n')
    plan = job_file(tmp, "plan", PLAN)
    cells = load_plan(plan).cells
    r = rgt(tmp, "emit", "k8s", jf, "--image", "img", "--gpus", "4", "--secret", "s",
            "--sweep", plan)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "NOT MEASURED, assumed 30 s" in r.stdout.splitlines()[1]
    doc = validated(r.stdout)
    s = doc["spec"]
    assert (s["completionMode"], s["completions"]) == ("Indexed", len(cells))
    assert s["backoffLimitPerIndex"] >= 1 and "backoffLimit" not in s
    assert s["podFailurePolicy"]["rules"][1]["action"] == "FailIndex"
    assert job(doc)["resources"] == {
        "limits": {"nvidia.com/gpu": "4"},
        "requests": {"nvidia.com/gpu": "4"},
    }
    c = agent(doc)
    assert "resources" not in c
    launcher = job(doc)["command"]
    assert launcher[:3] == ["python3", "-m", "onbox.agent.podlaunch"]

    # The container's own command, run for real with a stand-in rgt-agent that prints what it got.
    bindir = os.path.join(tmp, "bin")
    os.mkdir(bindir)
    with open(os.path.join(bindir, "rgt-agent"), "w") as f:
        f.write('#!/bin/sh\necho "CELL=$RGT_CELL"; for a in "$@"; do echo "$a"; done\n')
    os.chmod(os.path.join(bindir, "rgt-agent"), 0o755)
    seen = set()
    for cell in cells:
        env = dict(os.environ, PATH=bindir + os.pathsep + os.environ["PATH"])
        env["JOB_COMPLETION_INDEX"] = str(cell.index)
        out = subprocess.run(c["command"], env=env, capture_output=True, text=True, timeout=30)
        lines = out.stdout.splitlines()
        assert lines[0] == f"CELL={cell.name}"
        assert lines[lines.index("--name") + 1] == cell.name
        assert lines[lines.index("--store") + 1] == "s3://bucket/sweeps"
        assert lines[lines.index("--output") + 1] == cell.outputs[0]
        assert lines[lines.index("--") + 1 :] == cell.command
        # The job container's launcher picks the same index's run dir.
        assert podlaunch.pick(launcher[3:], env) == f"{k8s.RGT_HOME}/runs/{cell.name}"
        seen.add(cell.name)
    assert len(seen) == len(cells) == 3


def _mirrored_seal(store: str, run: str, seconds: float) -> None:
    """``run``'s mirrored events in the file store ``store``: one asked-for seal of ``seconds``."""
    from onbox.agent.journal import iso

    state = os.path.join(store, run, "state")
    os.makedirs(state)
    with open(os.path.join(state, "events.jsonl"), "w") as f:
        for kind, at in (("checkpoint_asked", 0.0), ("sealed", seconds)):
            f.write(json.dumps({"time": iso(1_790_000_000.0 + at), "kind": kind}) + "\n")


def test_a_sweeps_grace_covers_the_longest_seal_measured_over_its_cells(tmp_path: Any) -> None:
    """Every index of the Job gets the one pod grace: it is measured from the cells' own runs
    (here in a copy of the sweep's store, --seal-from), never under the job file's name (no
    run there), and it is the longest seal of them,
    so that the slowest cell's final seal is not cut short by the kubelet's SIGKILL."""
    from controller.sweep.plan import load_plan

    tmp = str(tmp_path)
    store = os.path.join(tmp, "sweeps")
    jf = job_file(tmp, "base", 'name = "base"\ncommand = ["python", "train.py"]\n')
    plan = job_file(tmp, "plan", PLAN)
    cells = load_plan(plan).cells
    _mirrored_seal(store, cells[0].name, 100.0)
    _mirrored_seal(store, cells[1].name, 300.0)  # not the first cell: the slowest
    r = rgt(tmp, "emit", "k8s", jf, "--image", "img", "--secret", "s", "--sweep", plan,
            "--seal-from", f"file://{store}")  # fmt: skip
    assert r.returncode == 0, r.stderr
    doc = validated(r.stdout)
    longest = SealTime(300.0, 1, "").lead(assumed=30, slack=k8s.SLACK_S, floor=k8s.FLOOR_S)
    assert pod(doc)["terminationGracePeriodSeconds"] == longest
    said = doc["metadata"]["annotations"]["rgt.dev/grace"]
    assert said.startswith("measured") and f"run {cells[1].name}" in said, said
    assert "the slowest of the sweep's 3 cells, 2 of them measured" in said, said


def test_a_bad_sweep_plan_is_the_plans_usage_error(tmp_path: Any) -> None:
    tmp = str(tmp_path)
    jf = job_file(tmp, "j", 'name = "j"\ncommand = ["python", "t.py"]\n')
    plan = job_file(tmp, "plan", 'name = "s"\n')
    r = rgt(tmp, "emit", "k8s", jf, "--image", "i", "--pvc", "c", "--sweep", plan)
    assert r.returncode == 2, r.stderr
    assert r.stdout == ""


@pytest.mark.parametrize(
    ("body", "args", "field"),
    [
        ('name = "x"\ncommand = ["python"]\nbogus = 1\n', [], "bogus"),
        ('name = "x"\ncommand = ["python"]\nstore = "file:///mnt/x"\n', [], "--store"),
        ('name = "x"\ncommand = ["python"]\n', [], "--store"),
        ('name = "x"\ncommand = ["python"]\n', ["--pvc", "Bad_Name"], "--pvc"),
        (
            'name = "x"\ncommand = ["python"]\n',
            ["--pvc", "c", "--seal-time", "soon"],
            "--seal-time",
        ),
    ],
)
def test_bad_input_is_a_usage_error_naming_the_field(
    tmp_path: Any, body: str, args: List[str], field: str
) -> None:
    tmp = str(tmp_path)
    jf = job_file(tmp, "job", body)
    r = rgt(tmp, "emit", "k8s", jf, "--image", "i", *args)
    assert r.returncode == 2
    assert field in r.stderr and r.stdout == ""


def test_missing_job_file_and_atomic_out(tmp_path: Any) -> None:
    tmp = str(tmp_path)
    r = rgt(tmp, "emit", "k8s", "nope.toml", "--image", "i", "--pvc", "c")
    assert r.returncode == 2 and "nope.toml" in r.stderr
    jf = job_file(tmp, "job", 'name = "x"\ncommand = ["python"]\n')
    out = os.path.join(tmp, "job.yaml")
    with open(out, "w") as f:
        f.write("old\n")
    r = rgt(tmp, "emit", "k8s", jf, "--image", "i", "--pvc", "c", "--out", out)
    assert r.returncode == 0, r.stderr
    with open(out) as f:
        validated(f.read())
    assert set(os.listdir(tmp)) - {"ctl"} == {"job.toml", "job.yaml"}  # no temporary left
