"""The store URL as a value: ``StoreURL``, parsed once from ``--store`` or the job file's
``store`` (a URL, or a table with ``url``, ``endpoint_url`` and ``stall``) and carried in the
JobSpec. ``stall`` (``restore_stall``) is how long a restore's download may move no byte before
it is given up as a transient store failure (onbox/sealing/fetch.py).

The parse opens nothing and imports no extra, so that the laptop (``rgt deploy``) refuses a bad
URL with the very rules the box applies, before it changes anything;
``onbox.sealing.stores.open_store`` opens the store a value names.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Optional
from urllib.parse import unquote, urlsplit

from onbox.common.duration import parse_duration
from onbox.common.errors import UsageError

SCHEMES = ("file", "s3", "hf")
EXAMPLES = "e.g. file:///mnt/durable/rgt, s3://bucket/prefix, hf://user/repo"
STORE_KEYS = {"url", "endpoint_url", "stall"}
# A restore whose bytes do not move this long ends (TransientStoreError, exit 14): several
# times one request's read timeout (S3: 60 s), so a blip is ridden out by the retries, and a
# black-holed network or a hung mount is told within minutes, not never (rclone's IO idle
# timeout, --timeout, is 5 min too). Movement is counted as it reaches the disk, a request's
# buffer at a time (S3: 4 MiB): a link slower than that buffer per bound needs a longer one.
RESTORE_STALL = 300.0
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]\Z")
_HF_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}\Z")


@dataclasses.dataclass(frozen=True)
class StoreURL:
    """A store URL that parsed: its scheme and where it points. ``path`` is the directory of a
    ``file://`` store; ``bucket`` (S3) or ``repo`` (the Hub's ``user/name``) and ``prefix`` the
    others'. ``endpoint_url`` (S3 only) overrides the endpoint boto3's configuration gives."""

    url: str
    scheme: str
    path: str = ""
    bucket: str = ""
    repo: str = ""
    prefix: str = ""
    endpoint_url: Optional[str] = None

    def __str__(self) -> str:
        return self.url


def _clean_prefix(path: str, url: str, field: str) -> str:
    parts = [p for p in path.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise UsageError(field, f"{url!r}: the prefix may not hold '.' or '..'")
    return "/".join(parts)


def parse_store_url(url: str, field: str = "store") -> StoreURL:
    """Check a store URL; a malformed one raises UsageError naming ``field``, what is wrong
    and the accepted forms. Opens nothing, imports no extra."""
    if not isinstance(url, str) or "://" not in url:
        # A bare absolute path is the commonest slip: its URL is said, not guessed silently
        # (the store must be durable, and the path is on the box, not this machine).
        remedy = (
            f"write file://{url} for that path" if isinstance(url, str) and url[:1] == "/" else ""
        )
        raise UsageError(field, f"{url!r} is not a store URL", remedy or EXAMPLES)
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


def check_endpoint_url(value: Any, field: str = "store.endpoint_url") -> str:
    """An S3 endpoint: an http:// or https:// URL with a host."""
    example = 'e.g. endpoint_url = "https://s3.example.com" or "http://127.0.0.1:8333"'
    if isinstance(value, str):
        try:
            parts = urlsplit(value)
            port_ok = parts.port is None or parts.port > 0
        except ValueError:  # a port that is not a number
            port_ok = False
        if parts.scheme.lower() in ("http", "https") and parts.hostname and port_ok:
            return value
    raise UsageError(field, f"{value!r} is not an http:// or https:// URL", example)


def with_endpoint(store: StoreURL, endpoint_url: Optional[str], field: str) -> StoreURL:
    """``store`` with ``endpoint_url``; only an S3 store has an endpoint to override."""
    if endpoint_url is None:
        return store
    endpoint_url = check_endpoint_url(endpoint_url, field)
    if store.scheme != "s3":
        raise UsageError(
            field,
            f"applies only to an s3:// store, not {store.url!r}",
            "remove endpoint_url, or use an s3:// store URL",
        )
    return dataclasses.replace(store, endpoint_url=endpoint_url)


def parse_store_setting(value: Any, field: str = "store") -> StoreURL:
    """The job file's ``store``: a URL (``store = "s3://b/p"``) or a table (``[store]`` with
    ``url`` and ``endpoint_url``)."""
    if not isinstance(value, dict):
        return parse_store_url(value, field)
    extra = sorted(set(value) - STORE_KEYS)
    if extra:
        raise UsageError(
            f"{field}.{extra[0]}", "unknown setting", f"valid: {', '.join(sorted(STORE_KEYS))}"
        )
    if "url" not in value:
        raise UsageError(
            f"{field}.url", "is missing", f'e.g. url = "s3://bucket/prefix" ({EXAMPLES})'
        )
    store = parse_store_url(value["url"], f"{field}.url")
    restore_stall(value, field)
    return with_endpoint(store, value.get("endpoint_url"), f"{field}.endpoint_url")


def restore_stall(value: Any, field: str = "store") -> float:
    """The job file's ``store.stall`` in seconds (RESTORE_STALL when ``value``, the ``store``
    setting, is a plain URL or a table without it); a bad one raises UsageError naming it."""
    if not isinstance(value, dict) or value.get("stall") is None:
        return RESTORE_STALL
    return parse_duration(value["stall"], f"{field}.stall")
