"""Durable stores behind one interface (base.Store): ``file://`` here, ``s3://`` and ``hf://``
imported only when used (boto3 and huggingface_hub are optional extras).

``parse_store_url`` (onbox.common.storeurl, re-exported here) checks a URL without opening
anything or importing an extra; ``open_store`` opens the store a URL or a parsed ``StoreURL``
names; ``open_box_store`` opens a run's store on its box, with the store's credentials among
the run's secrets (``rgt deploy --secret-env``, $RGT_HOME/secrets/NAME).
"""

from __future__ import annotations

import os
from typing import Dict, Mapping, Optional, Union

from onbox.common.errors import UsageError

# The parse lives on the ground floor (a JobSpec carries its value); re-exported for callers.
from onbox.common.storeurl import EXAMPLES, SCHEMES, StoreURL, parse_store_url
from onbox.sealing.stores.base import Store

__all__ = [
    "EXAMPLES",
    "SCHEMES",
    "STORE_VARS",
    "Store",
    "StoreURL",
    "open_box_store",
    "open_store",
    "parse_store_url",
]

# The variables of a run's secrets that its store's client is given, by scheme: nothing else of
# them (a job's WANDB_API_KEY, say) reaches the store's code.
STORE_VARS = {
    "s3": (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_REGION",
        "AWS_DEFAULT_REGION",
        "AWS_PROFILE",
        "AWS_ENDPOINT_URL",
    ),
    "hf": ("HF_TOKEN", "HF_ENDPOINT"),
}


def open_box_store(url: Union[str, StoreURL], run: str, staged: bool = False) -> Store:
    """The store of run ``run`` on this box, for everything the agent and ``rgt-agent`` do
    with it (start's preflight and restore, sealing, sync, a stop's seal, ``restore``,
    ``checkpoints``): opened
    with the store's variables among the run's secrets, read here from their 0600 file (never
    from a command line or an environment). A box rented without credentials of its own has
    only those; a run without secrets gets the box's own configuration. ``staged``: the
    secrets a deploy staged for the start being claimed, where there are any, as the run takes
    them once claimed (onbox.agent.claim.take_secrets)."""
    from onbox.common.errors import HostError
    from onbox.common.rundir import RunDir, read_secrets

    rd = RunDir(run)
    path = rd.secrets_file
    if staged and os.path.lexists(rd.staged_secrets_file):
        path = rd.staged_secrets_file
    try:
        secrets = read_secrets(path)
    except OSError as e:
        raise HostError(
            f"cannot read the secrets of run {run!r} for its store: {e.strerror or e}",
            f"send them again: rgt deploy ... --secret-env VAR, or rgt-agent secrets {run}",
        ) from None
    return open_store(url, secrets=secrets)


def open_store(
    url: Union[str, StoreURL],
    *,
    endpoint_url: Optional[str] = None,
    secrets: Optional[Mapping[str, str]] = None,
) -> Store:
    """The store for ``url`` (a string, parsed here, or a parsed ``StoreURL``); a malformed URL
    raises UsageError naming what is wrong. ``endpoint_url`` overrides the value's own.
    ``secrets`` (a run's) give the client the store's variables (STORE_VARS) explicitly."""
    u = url if isinstance(url, StoreURL) else parse_store_url(url)
    given = {k: v for k, v in (secrets or {}).items() if k in STORE_VARS.get(u.scheme, ()) and v}
    # The secrets sent for this run win over the box's own configuration (its environment,
    # ~/.aws, a saved Hub token): they are what the user chose for this run, and a rented box
    # may carry another tenant's or the image's credentials that must not take the run's writes.
    endpoint_url = endpoint_url or u.endpoint_url or given.get("AWS_ENDPOINT_URL")
    if u.scheme == "file":
        from onbox.sealing.stores.local import LocalStore

        return LocalStore(u.path)
    if u.scheme == "s3":
        try:
            from onbox.sealing.stores.s3 import S3Store
        except ImportError as e:
            raise UsageError(
                "store",
                f"s3:// needs boto3 ({e})",
                "pip install 'remote-gpu-trainer[s3]' into the agent's venv",
            ) from None
        _check_key_pair(given)
        return S3Store(
            u.bucket,
            u.prefix,
            endpoint_url=endpoint_url,
            aws_access_key_id=given.get("AWS_ACCESS_KEY_ID"),
            aws_secret_access_key=given.get("AWS_SECRET_ACCESS_KEY"),
            aws_session_token=given.get("AWS_SESSION_TOKEN"),
            region_name=given.get("AWS_REGION") or given.get("AWS_DEFAULT_REGION"),
            profile_name=given.get("AWS_PROFILE"),
        )
    try:
        from onbox.sealing.stores.hf import HFStore
    except ImportError as e:
        raise UsageError(
            "store",
            f"hf:// needs huggingface_hub ({e})",
            "pip install 'remote-gpu-trainer[hf]' into the agent's venv",
        ) from None
    return HFStore(u.repo, u.prefix, token=given.get("HF_TOKEN"), endpoint=given.get("HF_ENDPOINT"))


def _check_key_pair(given: Dict[str, str]) -> None:
    """UsageError when the secrets hold part of an AWS key pair: boto3 would take it for the
    whole credentials (the box's own not consulted) and fail at every request."""
    key, secret = given.get("AWS_ACCESS_KEY_ID"), given.get("AWS_SECRET_ACCESS_KEY")
    if (key or secret or given.get("AWS_SESSION_TOKEN")) and not (key and secret):
        missing = [v for v in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY") if not given.get(v)]
        raise UsageError(
            "--secret-env",
            f"the run's secrets hold part of an AWS key pair, not {' or '.join(missing)}",
            "send AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY together",
        )
