"""Durable stores behind one interface (base.Store): ``file://`` here, ``s3://`` and ``hf://``
imported only when used (boto3 and huggingface_hub are optional extras)."""

from __future__ import annotations

import re
from urllib.parse import unquote, urlsplit

from onbox.errors import UsageError
from onbox.stores.base import Store

_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]\Z")
_HF_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}\Z")


def _clean_prefix(path: str, url: str) -> str:
    parts = [p for p in path.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise UsageError("store", f"{url!r}: the prefix may not hold '.' or '..'")
    return "/".join(parts)


def open_store(url: str, *, endpoint_url: str | None = None) -> Store:
    """The store for ``url``; a malformed URL raises UsageError naming what is wrong."""
    if not isinstance(url, str) or "://" not in url:
        raise UsageError(
            "store",
            f"{url!r} is not a store URL",
            "e.g. file:///mnt/durable/rgt, s3://bucket/prefix, hf://user/repo",
        )
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise UsageError(
                "store",
                f"{url!r}: file URLs name a local path",
                "write file:///absolute/path (three slashes)",
            )
        path = unquote(parts.path)
        if not path.startswith("/"):
            raise UsageError("store", f"{url!r}: the path must be absolute")
        if ".." in path.split("/"):
            raise UsageError("store", f"{url!r}: the path may not hold '..'")
        from onbox.stores.local import LocalStore

        return LocalStore(path)
    if scheme == "s3":
        bucket = parts.netloc
        if not bucket:
            raise UsageError("store", f"{url!r} names no bucket", "write s3://bucket/prefix")
        if not _BUCKET.match(bucket) or ".." in bucket:
            raise UsageError(
                "store",
                f"{bucket!r} is not a valid S3 bucket name",
                "3-63 characters: lowercase letters, digits, '.', '-'",
            )
        try:
            from onbox.stores.s3 import S3Store
        except ImportError as e:
            raise UsageError(
                "store",
                f"s3:// needs boto3 ({e})",
                "pip install 'remote-gpu-trainer[s3]' into the agent's venv",
            ) from None
        return S3Store(bucket, _clean_prefix(parts.path, url), endpoint_url=endpoint_url)
    if scheme == "hf":
        segs = [s for s in (parts.netloc + parts.path).split("/") if s]
        if len(segs) < 2 or not all(_HF_PART.match(s) for s in segs[:2]):
            raise UsageError("store", f"{url!r} names no Hub repo", "write hf://user/repo[/prefix]")
        try:
            from onbox.stores.hf import HFStore
        except ImportError as e:
            raise UsageError(
                "store",
                f"hf:// needs huggingface_hub ({e})",
                "pip install 'remote-gpu-trainer[hf]' into the agent's venv",
            ) from None
        return HFStore(f"{segs[0]}/{segs[1]}", _clean_prefix("/".join(segs[2:]), url))
    raise UsageError("store", f"{url!r}: unknown scheme {scheme!r}", "use file://, s3:// or hf://")
