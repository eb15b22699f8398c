"""Durable stores behind one interface (base.Store): ``file://`` here, ``s3://`` and ``hf://``
imported only when used (boto3 and huggingface_hub are optional extras).

``parse_store_url`` checks a URL without opening anything or importing an extra, so that the
laptop (``rgt deploy``) refuses a bad one with the very rules the box applies, before it changes
anything; ``open_store`` parses, then opens.
"""

from __future__ import annotations

import dataclasses
import re
from urllib.parse import unquote, urlsplit

from onbox.common.errors import UsageError
from onbox.sealing.stores.base import Store

SCHEMES = ("file", "s3", "hf")
EXAMPLES = "e.g. file:///mnt/durable/rgt, s3://bucket/prefix, hf://user/repo"
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]\Z")
_HF_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}\Z")


@dataclasses.dataclass(frozen=True)
class StoreURL:
    """A store URL that parsed: its scheme and where it points. ``path`` is the directory of a
    ``file://`` store; ``bucket`` (S3) or ``repo`` (the Hub's ``user/name``) and ``prefix`` the
    others'."""

    url: str
    scheme: str
    path: str = ""
    bucket: str = ""
    repo: str = ""
    prefix: str = ""


def _clean_prefix(path: str, url: str, field: str) -> str:
    parts = [p for p in path.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise UsageError(field, f"{url!r}: the prefix may not hold '.' or '..'")
    return "/".join(parts)


def parse_store_url(url: str, field: str = "store") -> StoreURL:
    """Check a store URL; a malformed one raises UsageError naming ``field``, what is wrong
    and the accepted forms. Opens nothing, imports no extra."""
    if not isinstance(url, str) or "://" not in url:
        raise UsageError(field, f"{url!r} is not a store URL", EXAMPLES)
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise UsageError(
                field,
                f"{url!r}: file URLs name a local path",
                "write file:///absolute/path (three slashes)",
            )
        path = unquote(parts.path)
        if not path.startswith("/"):
            raise UsageError(field, f"{url!r}: the path must be absolute", EXAMPLES)
        if ".." in path.split("/") or "\0" in path:
            raise UsageError(field, f"{url!r}: the path may not hold '..' or a NUL")
        return StoreURL(url, scheme, path=path)
    if scheme == "s3":
        bucket = parts.netloc
        if not bucket:
            raise UsageError(field, f"{url!r} names no bucket", "write s3://bucket/prefix")
        if not _BUCKET.match(bucket) or ".." in bucket:
            raise UsageError(
                field,
                f"{bucket!r} is not a valid S3 bucket name",
                "3-63 characters: lowercase letters, digits, '.', '-'",
            )
        return StoreURL(url, scheme, bucket=bucket, prefix=_clean_prefix(parts.path, url, field))
    if scheme == "hf":
        segs = [s for s in (parts.netloc + parts.path).split("/") if s]
        if len(segs) < 2 or not all(_HF_PART.match(s) for s in segs[:2]):
            raise UsageError(field, f"{url!r} names no Hub repo", "write hf://user/repo[/prefix]")
        prefix = _clean_prefix("/".join(segs[2:]), url, field)
        return StoreURL(url, scheme, repo=f"{segs[0]}/{segs[1]}", prefix=prefix)
    raise UsageError(
        field,
        f"{url!r}: unknown scheme {scheme!r}",
        "use " + ", ".join(s + "://" for s in SCHEMES[:-1]) + f" or {SCHEMES[-1]}://",
    )


def open_store(url: str, *, endpoint_url: str | None = None) -> Store:
    """The store for ``url``; a malformed URL raises UsageError naming what is wrong."""
    u = parse_store_url(url)
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
