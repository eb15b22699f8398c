"""The preflight of an ``hf://`` store: before training starts, prove there is a token, that the
repo is there (created, private, when it is not) and that a probe is written (its sha256 compared
with the Hub's), read back identical and deleted; a public repo is a warning. Its own module, as
an S3 store's is (onbox/sealing/stores/s3/preflight.py): it runs once per start, through the
store's public methods only. Imported only by hf.py, after its guarded import of huggingface_hub.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from typing import TYPE_CHECKING, List

from huggingface_hub import get_token

from onbox.common.errors import IntegrityError, RgtError, StoreAuthError
from onbox.sealing.stores.base import Finding
from onbox.sealing.stores.hfhub import AUTH_MESSAGE

if TYPE_CHECKING:
    from onbox.sealing.stores.hf import HFStore


def preflight(store: HFStore, run: str) -> List[Finding]:
    """Prove ``store`` works for ``run`` (Store.preflight); a StoreError names the failed step."""
    found: List[Finding] = []
    step = "find a Hub token"
    try:
        if store.token is None and get_token() is None:
            raise StoreAuthError(
                f"{store.url}: no Hugging Face token: {AUTH_MESSAGE}", store.tokens
            )
        step = "create or resolve the private repo"
        private = store.ensure_repo()
        step = "write a probe (upload, then compare with the Hub's sha256)"
        key = f"{run}/.rgt-preflight/probe-{os.urandom(4).hex()}"
        payload = os.urandom(64 * 1024)
        fd, probe = tempfile.mkstemp(prefix="rgt-hf-probe-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(payload)
            store.put_file(
                key, probe, sha256=hashlib.sha256(payload).hexdigest(), size=len(payload)
            )
        finally:
            os.unlink(probe)
        step = "read the probe back"
        got = store.get_bytes(key)
        step = "compare"
        if got != payload:
            raise IntegrityError(
                f"{key}: read back "
                + ("nothing" if got is None else f"{len(got)} different bytes"),
                "the Hub or a mirror in between serves other bytes than it stored",
            )
        step = "delete the probe"
        store.delete(key)
    except RgtError as e:
        err = type(e)(f"store preflight failed at '{step}': {e.what}", e.remedy)
        raise err from None
    found.append(
        Finding(
            True,
            f"{store.url} on {store.endpoint}: wrote a probe, the Hub's sha256 matched, "
            "read it back, deleted it",
        )
    )
    if private is False:
        found.append(
            Finding(
                False,
                f"{store.repo_id} is a public repo: anyone can download its checkpoints; "
                "make it private in its settings on the Hub",
            )
        )
    return found
