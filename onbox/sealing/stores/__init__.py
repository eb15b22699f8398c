"""Durable stores behind one interface (base.Store): ``file://`` here, ``s3://`` and ``hf://``
imported only when used (boto3 and huggingface_hub are optional extras).

``parse_store_url`` (onbox.common.storeurl, re-exported here) checks a URL without opening
anything or importing an extra; ``open_store`` opens the store a URL or a parsed ``StoreURL``
names.
"""

from __future__ import annotations

from typing import Union

from onbox.common.errors import UsageError

# The parse lives on the ground floor (a JobSpec carries its value); re-exported for callers.
from onbox.common.storeurl import EXAMPLES, SCHEMES, StoreURL, parse_store_url
from onbox.sealing.stores.base import Store

__all__ = ["EXAMPLES", "SCHEMES", "Store", "StoreURL", "open_store", "parse_store_url"]


def open_store(url: Union[str, StoreURL], *, endpoint_url: str | None = None) -> Store:
    """The store for ``url`` (a string, parsed here, or a parsed ``StoreURL``); a malformed URL
    raises UsageError naming what is wrong. ``endpoint_url`` overrides the value's own."""
    u = url if isinstance(url, StoreURL) else parse_store_url(url)
    endpoint_url = endpoint_url or u.endpoint_url
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
        return S3Store(u.bucket, u.prefix, endpoint_url=endpoint_url)
    try:
        from onbox.sealing.stores.hf import HFStore
    except ImportError as e:
        raise UsageError(
            "store",
            f"hf:// needs huggingface_hub ({e})",
            "pip install 'remote-gpu-trainer[hf]' into the agent's venv",
        ) from None
    return HFStore(u.repo, u.prefix)
