"""`rgt emit k8s`: a job file as a Kubernetes Job manifest with rgt's agent in the foreground.

**Where the agent runs, and why.** Two containers: the agent as a native sidecar (an
initContainer with ``restartPolicy: Always``, Kubernetes >= 1.29) running ``rgt-agent run --pod``,
and the job as the pod's main container, in the job's image (``--job-image``, default the same),
running ``python3 -m onbox.agent.podlaunch RUN_DIR`` (onbox/agent/podrunner.py has the design).
On cgroup v2 with Kubernetes >= 1.28 one OOM kill takes every process of a container
(Appendix D): with the job in a container of its own, that kill takes the job, its shim and the
launcher, never the agent, which records why, seals what is complete and mirrors the run's state
before the Job's next pod restores. The two share the run directory (an emptyDir at RGT_HOME:
the run dir, the default checkpoint dir, the job lib the agent publishes at ``lib/pod``, which
the job container's PYTHONPATH names) and one PID namespace (``shareProcessNamespace``), so the
agent watches and signals the job's processes by pid as on a box. The sidecar's startup probe
holds the job container back until the job lib is there. The kubelet restarts a dead agent,
which adopts the running attempt. Both containers get the Secret (``envFrom``): the agent for
the store, the job for its own credentials (its environment is its container's, under the
run's variables). GPUs are the job container's.

**Grace.** ``terminationGracePeriodSeconds`` is the measured seal time's lead
(controller/sealbudget.py: ``--seal-time``, else the run's events in the store or
``--seal-from``), and the agent's ``--grace`` is that minus SLACK_S, so the agent has asked for
the checkpoint, sealed it and exited before the kubelet's SIGKILL. When nothing was measured
the manifest says "NOT MEASURED, assumed" in its comments and its annotation.

**Failures.** ``restartPolicy: Never`` (a new pod per try, and with ``podFailurePolicy`` no
second pod while the old one terminates: one writer); disruptions (preemption, eviction,
``DisruptionTarget``) are ignored, not counted against ``backoffLimit``; rgt's permanent exit
codes (errors.PERMANENT_EXIT_CODES) fail the Job, or only that cell of a sweep.

**Secrets** come only from a Secret (``envFrom``); no value of the job file's ``[env]`` or of
this laptop's environment is ever written (the job file itself travels in the image).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Dict, List, Optional, Sequence

from controller.emit.common import (
    check_no_secret,
    comments,
    is_credential_name,
    job_file_credentials,
    load_job,
    relative_job_path,
    to_yaml,
    warn,
)
from onbox.agent.spec import JobSpec, Overrides
from onbox.common.errors import PERMANENT_EXIT_CODES, UsageError
from onbox.common.sealtime import SealTime
from onbox.profiles.schema import Profile

PROFILE = "kubernetes"
AGENT_CONTAINER = "agent"  # the native sidecar
JOB_CONTAINER = "job"  # the main container: its exit code is the run's (podFailurePolicy)
SLACK_S = 5  # the kubelet's and the agent's own lateness between SIGTERM and the seal's end
FLOOR_S = 30  # never less than Kubernetes' own default grace
BACKOFF_LIMIT = 6  # Kubernetes' default, said out loud
RGT_HOME = "/rgt"  # the run directories: an emptyDir both containers mount, volatile like the pod
POD_LIB = f"{RGT_HOME}/lib/pod"  # the job lib the agent publishes (onbox/agent/podrunner.py)
IMAGE_DIR = "/app"  # where the image holds the project (the code is baked into the image)


@dataclasses.dataclass(frozen=True)
class K8sOptions:
    image: str
    pvc: Optional[str] = None
    gpus: int = 0
    secret: Optional[str] = None
    image_dir: str = IMAGE_DIR
    job_image: Optional[str] = None  # the job container's image (default: ``image``)


@dataclasses.dataclass(frozen=True)
class Cell:
    """One Indexed Job index: its run name, command and extra environment."""

    name: str
    command: Sequence[str]
    env: Dict[str, str]
    outputs: Sequence[str] = ()  # the cell's own output paths (rgt-agent run --output)


def k8s_name(run: str) -> str:
    """A DNS-1123 label from a run name (``[a-z0-9._-]``): the Job's metadata.name."""
    label = re.sub(r"[^a-z0-9-]+", "-", run.lower()).strip("-")[:63].strip("-")
    return label or "rgt-job"


def load(job_file: str, store: Optional[str], pvc: Optional[str], profile: Profile) -> JobSpec:
    """The job file read as the pod's agent will read it: with ``--profile kubernetes`` and the
    ``--store`` it will be given (the PVC's, unless the job file or ``--store`` names a bucket).
    The durable path is not on this laptop, so the PVC's store is named, never looked up."""
    plain = load_job(job_file, Overrides(store=store))
    url = pod_store(plain, pvc, profile)
    return load_job(job_file, Overrides(store=url, profile=PROFILE))


def pod_store(spec: JobSpec, pvc: Optional[str], profile: Profile) -> str:
    """The store URL as the pod sees it: the PVC's durable path, or the bucket."""
    url = spec.store.url if spec.store else None
    if url and not url.startswith("file://"):
        return url
    if pvc:
        default = profile.default_store()
        if default is None:  # a user's override dropped the durable path
            raise UsageError("--pvc", f"the {PROFILE} profile has no durable path to mount it at")
        return default
    if url:
        raise UsageError(
            "--store",
            f"{url} is a file store, and a pod's own disk dies with it",
            "give --pvc NAME (mounted at the durable path) or a bucket: --store s3://BUCKET/rgt",
        )
    raise UsageError("--store", "a pod needs a durable store", "give --pvc NAME or --store URL")


def grace_seconds(seal: SealTime, profile: Profile) -> int:
    """The pod's terminationGracePeriodSeconds, from the seal time (never a constant)."""
    return seal.lead(assumed=profile.preemption.grace, slack=SLACK_S, floor=FLOOR_S)


def _grace_words(seal: SealTime, profile: Profile, pod_grace: int) -> str:
    if seal.seconds is None:
        return (
            f"NOT MEASURED, assumed {profile.preemption.grace:g} s ({seal.source}): "
            f"grace {pod_grace} s; measure it (--seal-time S, or a store with this run's "
            "sealed events) and emit again"
        )
    # seal.source says how it was had ("measured: ...", "given: --seal-time S").
    return f"{seal.source}; grace {pod_grace} s"


def agent_argv(job_path: str, run: str, store: str, grace: int) -> List[str]:
    return [
        "rgt-agent",
        "run",
        "--pod",
        job_path,
        "--name",
        run,
        "--store",
        store,
        "--grace",
        str(grace),
        "--profile",
        PROFILE,
    ]


# A fixed program (never built from user values) that picks this index's cell: its argv and env
# come as one JSON argument.
_PICK_CELL = (
    "import json, os, sys\n"
    "cell = json.loads(sys.argv[1])[int(os.environ['JOB_COMPLETION_INDEX'])]\n"
    "os.environ.update(cell['env'])\n"
    "os.execvp(cell['argv'][0], cell['argv'])\n"
)


def _cell_command(cells: Sequence[Cell], base: List[str]) -> List[str]:
    import json

    for c in cells:
        bad = sorted(k for k in c.env if is_credential_name(k))
        if bad:
            raise UsageError(
                f"cell {c.name}: env.{bad[0]}",
                "a credential in a sweep's parameters would be written into the manifest",
                "put it in a Secret (--secret NAME)",
            )
    table = []
    for c in cells:
        argv = list(base)
        argv[argv.index("--name") + 1] = c.name
        argv += [a for o in c.outputs for a in ("--output", o)]
        table.append({"argv": argv + (["--", *c.command] if c.command else []), "env": c.env})
    return ["python3", "-c", _PICK_CELL, json.dumps(table, sort_keys=True)]


# The sidecar's startup probe: the job container starts only once the job lib is published.
_LIB_READY = f"import os, sys; sys.exit(not os.path.exists('{POD_LIB}/onbox/agent/podlaunch.py'))"


def _common(opts: K8sOptions) -> Dict[str, Any]:
    """What both containers have: the working dir, RGT_HOME, the shared emptyDir, the Secret."""
    c: Dict[str, Any] = {
        "workingDir": opts.image_dir,
        "env": [
            {"name": "RGT_HOME", "value": RGT_HOME},
            {"name": "PYTHONUNBUFFERED", "value": "1"},
        ],
        "volumeMounts": [{"name": "rgt-home", "mountPath": RGT_HOME}],
    }
    if opts.secret:
        c["envFrom"] = [{"secretRef": {"name": opts.secret}}]
    return c


def _agent_container(command: List[str], opts: K8sOptions, profile: Profile) -> Dict[str, Any]:
    c: Dict[str, Any] = {"name": AGENT_CONTAINER, "image": opts.image, "command": command}
    c.update(_common(opts))
    c["restartPolicy"] = "Always"  # a native sidecar: restarted when it dies, stopped last
    c["startupProbe"] = {
        "exec": {"command": ["python3", "-c", _LIB_READY]},
        "periodSeconds": 1,
        "failureThreshold": 300,
    }
    if opts.pvc:
        c["volumeMounts"].append({"name": "checkpoints", "mountPath": profile.durable.path})
    return c


def _job_container(run_dirs: List[str], opts: K8sOptions, profile: Profile) -> Dict[str, Any]:
    command = ["python3", "-m", "onbox.agent.podlaunch", *run_dirs]
    c: Dict[str, Any] = {
        "name": JOB_CONTAINER,
        "image": opts.job_image or opts.image,
        "command": command,
        **_common(opts),
    }
    c["env"].append({"name": "PYTHONPATH", "value": POD_LIB})
    if opts.gpus:
        gpus = {"nvidia.com/gpu": str(opts.gpus)}
        c["resources"] = {"limits": dict(gpus), "requests": dict(gpus)}
    return c


def _failure_policy(indexed: bool) -> Dict[str, Any]:
    return {
        "rules": [
            # Preemption and eviction: the next pod restores and resumes; no retry is spent.
            {
                "action": "Ignore",
                "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
            },
            # Bad input, credentials, a corrupt store, a refused action, FAILED, STOPPED: no
            # retry can fix them. In a sweep only that cell fails.
            {
                "action": "FailIndex" if indexed else "FailJob",
                "onExitCodes": {
                    "containerName": JOB_CONTAINER,  # the launcher exits with the run's code
                    "operator": "In",
                    "values": sorted(PERMANENT_EXIT_CODES),
                },
            },
        ]
    }


def manifest(
    spec: JobSpec,
    opts: K8sOptions,
    profile: Profile,
    seal: SealTime,
    job_file: str,
    cells: Optional[Sequence[Cell]] = None,
    sweep_name: Optional[str] = None,
) -> Dict[str, Any]:
    """The Job manifest (a dict in the API's field names)."""
    store = pod_store(spec, opts.pvc, profile)
    pod_grace = grace_seconds(seal, profile)
    agent_grace = pod_grace - SLACK_S
    job_path = f"{opts.image_dir.rstrip('/')}/{relative_job_path(job_file)}"
    base = agent_argv(job_path, spec.name, store, agent_grace)
    command = _cell_command(cells, base) if cells else base
    run_dirs = (
        [f"{RGT_HOME}/runs/{c.name}" for c in cells] if cells else [f"{RGT_HOME}/runs/{spec.name}"]
    )
    volumes: List[Dict[str, Any]] = [{"name": "rgt-home", "emptyDir": {}}]
    if opts.pvc:
        volumes.append({"name": "checkpoints", "persistentVolumeClaim": {"claimName": opts.pvc}})
    name = k8s_name(sweep_name or spec.name)
    labels = {"app.kubernetes.io/managed-by": "rgt", "rgt.dev/run": name}
    job_spec: Dict[str, Any] = {
        "podFailurePolicy": _failure_policy(bool(cells)),
        "template": {
            "metadata": {"labels": dict(labels)},
            "spec": {
                "restartPolicy": "Never",
                "terminationGracePeriodSeconds": pod_grace,
                "shareProcessNamespace": True,  # the agent watches and signals the job by pid
                "initContainers": [_agent_container(command, opts, profile)],
                "containers": [_job_container(run_dirs, opts, profile)],
                "volumes": volumes,
            },
        },
    }
    if cells:
        job_spec.update(
            completionMode="Indexed",
            completions=len(cells),
            parallelism=len(cells),
            backoffLimitPerIndex=BACKOFF_LIMIT,
        )
    else:
        job_spec["backoffLimit"] = BACKOFF_LIMIT
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": name,
            "labels": labels,
            "annotations": {
                "rgt.dev/grace": _grace_words(seal, profile, pod_grace),
                "rgt.dev/agent-grace": f"{agent_grace} s (the pod's grace less {SLACK_S} s)",
                "rgt.dev/oom-isolation": f"the job has its own container ({JOB_CONTAINER}) "
                f"beside the agent's native sidecar ({AGENT_CONTAINER}): an OOM kill there takes "
                "the job's processes, never the agent, which seals what is complete; the next "
                "pod resumes",
            },
        },
        "spec": job_spec,
    }


def render(
    spec: JobSpec,
    opts: K8sOptions,
    profile: Profile,
    seal: SealTime,
    job_file: str,
    environ: Dict[str, str],
    cells: Optional[Sequence[Cell]] = None,
    sweep_name: Optional[str] = None,
) -> str:
    """The manifest as YAML, with comments saying where its numbers came from."""
    doc = manifest(spec, opts, profile, seal, job_file, cells, sweep_name)
    pod = doc["spec"]["template"]["spec"]
    creds = job_file_credentials(spec)
    if creds:
        warn(
            f"the job file's [env] holds {', '.join(creds)}: the job file is baked into the "
            "image with it; move it into a Secret (--secret NAME) and out of the job file"
        )
    if (spec.store is None or spec.store.scheme != "file") and not opts.secret and not opts.pvc:
        warn(f"no --secret: the agent reaches {doc_store(doc)} with the pod's own identity only")
    head = comments(
        [
            f"rgt emit k8s {relative_job_path(job_file)}: run {spec.name}",
            f"terminationGracePeriodSeconds {pod['terminationGracePeriodSeconds']}: "
            + doc["metadata"]["annotations"]["rgt.dev/grace"],
            "the agent's --grace is " + doc["metadata"]["annotations"]["rgt.dev/agent-grace"],
            f"exit codes {sorted(PERMANENT_EXIT_CODES)} are permanent (podFailurePolicy)",
        ]
    )
    text = head + to_yaml(doc) + "\n"
    check_no_secret(text, spec, environ)
    return text


def doc_store(doc: Dict[str, Any]) -> str:
    argv = doc["spec"]["template"]["spec"]["initContainers"][0]["command"]
    return str(argv[argv.index("--store") + 1]) if "--store" in argv else "the sweep's store"
