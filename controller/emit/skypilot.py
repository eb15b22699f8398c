"""`rgt emit skypilot`: a job file as a SkyPilot task YAML for managed jobs (`sky jobs launch`).

- ``run`` is ``rgt-agent run`` in the foreground (``exec``, so SkyPilot's signals reach the agent
  itself); its exit code is the run's final state (errors.FINAL_EXIT_CODES).
- ``setup`` installs rgt from PyPI (``remote-gpu-trainer`` with the store's extra) or a wheel.
- The store is the task's bucket, reached through the store's API (``s3://``, ``hf://``), never
  through a bucket mount: the one-writer rule needs the store's conditional writes, which a
  FUSE mount of a bucket does not give. A ``file://`` store on a cluster VM dies with it and is
  refused.
- ``secrets`` names the credentials with null values: SkyPilot refuses to launch until each is
  given (``sky jobs launch --secret AWS_SECRET_ACCESS_KEY``), and no value is ever written here.
- ``config.hooks`` (SkyPilot PR #9064): on ``preemption`` and ``stop`` the hook asks the live agent
  for a final seal (``rgt-agent sync NAME --timeout T``, T from the measured seal time), and the
  hook's own timeout is a little longer, so rgt's deadline fires first.
- ``resources.job_recovery``: SkyPilot recovers a preempted cluster by itself; rgt's PREEMPTED
  exit (13: the agent was signalled, the cluster lived) and a store that did not answer (14) are
  recovered as well; every other non-zero exit is final (the agent restarts code errors itself,
  and its FAILED is a decision, not a crash).
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from typing import Any, Dict, List, Optional, Tuple

from controller.emit.common import (
    check_no_secret,
    comments,
    job_file_credentials,
    relative_job_path,
    to_yaml,
    warn,
)
from onbox.agent.spec import JobSpec
from onbox.common.errors import FINAL_EXIT_CODES, StoreError, UsageError
from onbox.common.sealtime import SealTime

ASSUMED_SEAL_S = 60.0  # a cloud VM's preemption window is the profile's, unknown here: assumed
HOOK_SLACK_S = 10
HOOK_FAILED = "rgt: the final sync did not seal the newest checkpoint: the line above says why"
STORE_CREDENTIALS = {
    "s3": ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"),
    "hf": ("HF_TOKEN",),
}
EXTRAS = {"s3": "s3", "hf": "hf"}
RECOVER_ON = sorted({FINAL_EXIT_CODES["PREEMPTED"], StoreError.exit_code})
_ACCEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*(:[0-9]+)?")
_VAR = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclasses.dataclass(frozen=True)
class SkyOptions:
    accelerators: Optional[str] = None  # "A100:8"
    use_spot: bool = False
    install: Optional[str] = None  # a pip requirement or wheel path; default from the store
    secret_env: Tuple[str, ...] = ()  # more variable names the job needs (values given at launch)


def _store(spec: JobSpec) -> str:
    if spec.store is None:
        raise UsageError(
            "--store", "a SkyPilot task needs a bucket store", "give --store s3://BUCKET/rgt"
        )
    if spec.store.scheme not in STORE_CREDENTIALS:
        raise UsageError(
            "--store",
            f"{spec.store.url} is a {spec.store.scheme}:// store, which dies with the cluster",
            "give a bucket: --store s3://BUCKET/rgt (or hf://USER/REPO)",
        )
    return spec.store.url


def hook_timeout(seal: SealTime) -> int:
    """How long the preemption hook lets rgt seal: the seal time's lead (never a constant)."""
    return seal.lead(assumed=ASSUMED_SEAL_S, slack=HOOK_SLACK_S, floor=30)


def task(spec: JobSpec, opts: SkyOptions, seal: SealTime, job_file: str) -> Dict[str, Any]:
    """The task (a dict in SkyPilot's YAML field names)."""
    store = _store(spec)
    scheme = spec.store.scheme if spec.store else "s3"
    for v in opts.secret_env:
        if not _VAR.fullmatch(v):
            raise UsageError("--secret-env", f"{v!r} is not a variable name", "e.g. WANDB_API_KEY")
    if opts.accelerators is not None and not _ACCEL.fullmatch(opts.accelerators):
        raise UsageError("--gpus", f"{opts.accelerators!r} is not NAME[:COUNT]", "e.g. A100:8")
    seal_s = hook_timeout(seal)
    run = shlex.join(
        [
            "rgt-agent",
            "run",
            relative_job_path(job_file),
            "--name",
            spec.name,
            "--store",
            store,
            "--grace",
            str(seal_s),
        ]
    )
    install = opts.install or f"remote-gpu-trainer[{EXTRAS[scheme]}]"
    resources: Dict[str, Any] = {
        "use_spot": opts.use_spot,
        "job_recovery": {
            "strategy": "EAGER_NEXT_REGION",
            "max_restarts_on_errors": 0,
            "recover_on_exit_codes": RECOVER_ON,
        },
    }
    if opts.accelerators:
        resources["accelerators"] = opts.accelerators
    names = list(dict.fromkeys([*STORE_CREDENTIALS[scheme], *opts.secret_env]))
    sync = shlex.join(["rgt-agent", "sync", spec.name, "--timeout", f"{seal_s}s"])
    return {
        "name": spec.name,
        "workdir": ".",
        "resources": resources,
        "secrets": {n: None for n in names},
        "setup": f"set -e\npython3 -m pip install --user {shlex.quote(install)}\n",
        "run": f"exec {run}\n",
        "config": {
            "hooks": [
                {
                    # The agent seals what the job has written, then LATEST is what a
                    # recovered cluster restores; a failed sync must not block the event (the
                    # sync's own error line says why: not finished, changed while sealed, or a
                    # run frozen by a NaN loss on purpose).
                    "run": f"{sync} || echo {shlex.quote(HOOK_FAILED)} >&2\n",
                    "events": ["preemption", "stop"],
                    "timeout": seal_s + HOOK_SLACK_S,
                }
            ]
        },
    }


def render(
    spec: JobSpec, opts: SkyOptions, seal: SealTime, job_file: str, environ: Dict[str, str]
) -> str:
    doc = task(spec, opts, seal, job_file)
    creds = job_file_credentials(spec)
    if creds:
        warn(
            f"the job file's [env] holds {', '.join(creds)}: the workdir sync uploads it; move "
            "it out of the job file and pass it with --secret-env NAME"
        )
    t = doc["config"]["hooks"][0]["timeout"] - HOOK_SLACK_S
    if seal.seconds is None:
        words = f"NOT MEASURED, assumed {ASSUMED_SEAL_S:g} s ({seal.source})"
    else:
        words = f"measured: {seal.source}"
    head = comments(
        [
            f"rgt emit skypilot {relative_job_path(job_file)}: run {spec.name}",
            f"seal budget {t} s (the agent's --grace and the hook's sync timeout): {words}",
            "launch: sky jobs launch THIS.yaml "
            + " ".join(f"--secret {n}" for n in doc["secrets"]),
        ]
    )
    text = head + to_yaml(doc) + "\n"
    check_no_secret(text, spec, environ)
    return text


def secret_names(doc: Dict[str, Any]) -> List[str]:
    return list(doc.get("secrets") or {})
