"""What an ``hf://`` store (onbox/sealing/stores/hf.py) reads from the Hub's answers besides
its files: the StoreError each exception of huggingface_hub means (transient or permanent, a
StoreAuthError where the Hub refused the token or found none), and the git blob id the Hub
gives a regular file, computed here from the bytes sent to compare with it, and what differs
between what the Hub holds after a commit and what was sent (``mismatch``). Imported only by
hf.py (and hfpreflight.py), after its guarded import of huggingface_hub.
"""

from __future__ import annotations

import hashlib
import os
from typing import List, Optional, Tuple

from huggingface_hub import get_token
from huggingface_hub.errors import (
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.hf_api import RepoFile

from onbox.common.errors import (
    IntegrityError,
    PermanentStoreError,
    RgtError,
    StoreAuthError,
    TransientStoreError,
)
from onbox.sealing.stores.base import os_error

AUTH_MESSAGE = "token refused or without write scope: set HF_TOKEN to a write token"
# Exceptions of the HTTP stacks huggingface_hub has used (httpx2 now, requests before 1.0):
# the network, not the Hub, failed.
_TRANSPORT_MODULES = ("httpx", "httpcore", "requests", "urllib3")
CHUNK = 1 << 20


def git_blob_id(data: bytes) -> str:
    """The git object id of a blob holding ``data`` (what the Hub reports for regular files)."""
    h = hashlib.sha1()
    h.update(b"blob %d\0" % len(data))
    h.update(data)
    return h.hexdigest()


def hashes_of_file(path: str) -> Tuple[int, str, str]:
    """(size, sha256, git blob id) of a local file, from one read."""
    size = os.path.getsize(path)
    s256, s1 = hashlib.sha256(), hashlib.sha1()
    s1.update(b"blob %d\0" % size)
    n = 0
    with open(path, "rb") as f:
        while True:
            b = f.read(CHUNK)
            if not b:
                break
            n += len(b)
            s256.update(b)
            s1.update(b)
    if n != size:
        raise IntegrityError(
            f"{path} changed size while it was read", "do not write it during a put"
        )
    return size, s256.hexdigest(), s1.hexdigest()


def mismatch(
    f: Optional[RepoFile],
    path: str,
    revision: str,
    *,
    size: int,
    sha256: str,
    blob_id: Optional[str] = None,
    local: Optional[str] = None,
) -> Optional[str]:
    """How the Hub's entry ``f`` for ``path`` at commit ``revision`` differs from what was sent
    (``size`` bytes of ``sha256``; a regular file's git ``blob_id``, else computed here from
    ``local``), or None when it is what was sent."""
    problem = None
    if f is None:
        problem = f"the Hub has no {path} at commit {revision[:12]}"
    else:
        hub_size, hub_blob = f.size, f.blob_id
        if f.lfs is not None:
            hub_sha256 = f.lfs.sha256
            if hub_sha256 != sha256 or hub_size != size:
                problem = (
                    f"the Hub holds {hub_size} bytes sha256 {hub_sha256[:12]}, "
                    f"expected {size} bytes sha256 {sha256[:12]}"
                )
        else:
            if blob_id is None:  # a large file the Hub kept out of LFS: hash it here
                assert local is not None
                got_size, got_sha256, blob_id = hashes_of_file(local)
                if got_size != size or got_sha256 != sha256:
                    problem = f"{local} changed since its sha256 was computed"
            if problem is None and (hub_blob != blob_id or hub_size != size):
                problem = (
                    f"the Hub holds {hub_size} bytes git blob {hub_blob[:12]}, "
                    f"expected {size} bytes git blob {blob_id[:12]}"
                )
    return problem


def _chain(e: BaseException) -> List[BaseException]:
    """``e`` and the exceptions it was raised from, outermost first."""
    out: List[BaseException] = []
    cur: Optional[BaseException] = e
    while cur is not None and cur not in out:
        out.append(cur)
        cur = cur.__cause__ or (None if cur.__suppress_context__ else cur.__context__)
    return out


def http_status(e: HfHubHTTPError) -> int:
    """The HTTP status of the Hub's answer; 0 when there was none."""
    response = getattr(e, "response", None)
    code = getattr(response, "status_code", None)
    return code if isinstance(code, int) else 0


def _server_says(e: HfHubHTTPError) -> str:
    msg = getattr(e, "server_message", None)
    return str(msg).strip().splitlines()[0] if msg else _first_line(e)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def store_error(
    e: BaseException,
    where: str,
    *,
    repo_id: str,
    branch: str,
    tokens: str,
    token: Optional[str] = None,
) -> Exception:
    """The StoreError for ``e``, raised by huggingface_hub while doing ``where`` (what, on which
    store: the repo ``repo_id``, its ``branch``); ``tokens`` says where write tokens are made;
    ``token`` is the one the store was given (None: huggingface_hub's own, if any).
    Re-raises what it cannot place."""
    for c in _chain(e):
        if isinstance(c, RgtError):
            return c
        if isinstance(c, RepositoryNotFoundError):
            if http_status(c) == 401 and token is None and get_token() is None:
                return StoreAuthError(f"{where}: no Hugging Face token: {AUTH_MESSAGE}", tokens)
            return PermanentStoreError(
                f"{where}: the Hub has no repo {repo_id} that this token can see",
                "check the repo in the store URL, and that HF_TOKEN belongs to its owner",
            )
        if isinstance(c, RevisionNotFoundError):
            return PermanentStoreError(f"{where}: the repo has no branch {branch!r}")
        if isinstance(c, HfHubHTTPError):
            code = http_status(c)
            what = f"{where}: HTTP {code}: {_server_says(c)}"
            if code in (401, 403):
                return StoreAuthError(
                    f"{where}: HTTP {code} ({_server_says(c)}): {AUTH_MESSAGE}", tokens
                )
            if code in (408, 412, 425, 429) or code >= 500 or code == 0:
                return TransientStoreError(what)
            return PermanentStoreError(what)
        if isinstance(c, OfflineModeIsEnabled):
            return PermanentStoreError(f"{where}: HF_HUB_OFFLINE is set", "unset it")
        if type(c).__name__ == "FileMetadataError":
            return PermanentStoreError(
                f"{where}: {_first_line(c)}", "check that HF_ENDPOINT points to a Hub"
            )
        if type(c).__module__.split(".")[0].startswith(_TRANSPORT_MODULES) or isinstance(
            c, (ConnectionError, TimeoutError)
        ):
            return TransientStoreError(f"{where}: {type(c).__name__}: {c}")
        if isinstance(c, LocalEntryNotFoundError):
            continue  # hf_hub_download's wrapper: the reason is its cause
        if isinstance(c, OSError):
            return os_error(c, where)
    if isinstance(e, LocalEntryNotFoundError):
        return TransientStoreError(f"{where}: could not reach the Hub")
    if isinstance(e, (ValueError, RuntimeError)):  # malformed answers, LFS batch errors
        root = _chain(e)[-1]
        why = "" if root is e else f" ({type(root).__name__}: {_first_line(root)})"
        return PermanentStoreError(f"{where}: {_first_line(e)}{why}")
    raise e
