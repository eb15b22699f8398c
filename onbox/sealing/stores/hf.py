"""``hf://user/repo[/prefix]``: a (private) model repo on the Hugging Face Hub.

Everything goes through huggingface_hub's ``HfApi``, configured the library's own way: the token
from ``HF_TOKEN`` (else the one ``hf auth login`` saved), the endpoint from ``HF_ENDPOINT`` (a
mirror or a self-hosted Hub), read when the store is opened; a run's own ``HF_TOKEN`` and
``HF_ENDPOINT`` secrets, where it has them, are given explicitly and win. Key ``K`` is the file
``prefix/K`` of the repo's ``main`` branch; the first write creates the repo, private.

Every put is one commit, so it is atomic: readers see the old file or the new one. The content
goes up first (LFS or Xet) and is committed only if the sha256 huggingface_hub computed from the
bytes it sent is the caller's. After the commit the store asks the Hub what it now holds there
(``paths-info`` at that commit) and compares without downloading: for an LFS (or Xet) file the
sha256 the Hub recorded must equal the caller's; for a small regular file the git blob id must
equal ``sha1(b"blob SIZE\\0" + bytes)`` computed here from the very bytes that were sent. A
mismatch removes the object again and raises ``IntegrityError``.

``put_bytes(if_absent=True)`` checks at the head commit it read and commits with that commit as
``parent_commit``: the Hub refuses (412) a commit whose parent is no longer the head, and the
store then looks again (PreconditionFailed if the key is there now). ``put_bytes(if_match=V)``
does the same with the file's git blob id (its version, what ``get_versioned`` returns): the
file at that head must still be blob V, and the commit's parent is that head, so nothing another
writer committed in between is overwritten.

A file is handed to huggingface_hub as a file object whose reads count as the upload's movement
(hfmoved.py): an upload the Hub takes nothing of for ``[store] stall`` is cut (hangbound.py
``watched``), one that moves is not; that takes the LFS batch API's HTTP transfer, never Xet
(hf_xet reads the file where nothing can be counted). Once a bound is given (``bound_calls``),
huggingface_hub's requests time out after twice it without a byte moved, so a cut upload's
thread ends and the next upload is not refused for good. Downloads go to a temporary
``local_dir`` next to the destination, with a ``cache_dir`` inside it: nothing lands in
``~/.cache/huggingface/hub``; a restore's or a pull's is refused before its bytes when the
Hub's size is not the MANIFEST's (onbox/sealing/stores/hfdownload.py).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import shutil
import tempfile
from typing import BinaryIO, Dict, Iterator, List, Mapping, Optional, Tuple, Union, cast

from onbox.common.errors import IntegrityError, UsageError
from onbox.common.safepath import open_regular

try:
    from huggingface_hub import (
        CommitOperationAdd,
        CommitOperationDelete,
        HfApi,
    )
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )
    from huggingface_hub.hf_api import RepoFile
except ImportError as e:  # not installed, or older than huggingface_hub.errors (0.24)
    raise UsageError(
        "store",
        f"hf:// stores need huggingface_hub >= 0.24 ({e})",
        "pip install 'remote-gpu-trainer[hf]' (or 'huggingface_hub>=0.24')",
    ) from e

from onbox.sealing.stall import STALL_SETTING
from onbox.sealing.stores.base import (
    Finding,
    Lanes,
    ObjectInfo,
    PermanentStoreError,
    PreconditionFailed,
    Store,
    TransientStoreError,
    check_key,
    os_error,
)
from onbox.sealing.stores.hangbound import HangBound, answers
from onbox.sealing.stores.hfdownload import download, download_to, size_at_head, sizes_at
from onbox.sealing.stores.hfhub import git_blob_id, http_status, mismatch, store_error
from onbox.sealing.stores.hfmoved import Counted, bound_idle_requests, quiet_xet_fallback
from onbox.sealing.stores.hfpreflight import preflight as run_preflight

REVISION = "main"
# Up to this size put_file reads the file into memory once: the bytes it hashes are the bytes it
# sends, and a regular (non-LFS) file's git blob id can be checked against them. The Hub stores
# larger files in LFS, whose sha256 it reports itself.
INLINE_MAX = 10 * 1024 * 1024
IF_ABSENT_ATTEMPTS = 5
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
quiet_xet_fallback()


def _info(key: str, f: RepoFile) -> ObjectInfo:
    """ObjectInfo from the Hub's entry: sha256 only for LFS files (the Hub knows no other)."""
    if f.lfs is not None:
        sha256: Optional[str] = f.lfs.sha256
    else:  # a regular file: only the empty one's sha256 is known without its bytes
        sha256 = EMPTY_SHA256 if f.size == 0 else None
    return ObjectInfo(key, f.size, sha256, f.blob_id)


class HFStore(HangBound, Store):
    """A store in a model repo of the Hugging Face Hub (or a mirror of it); its calls before a
    download may be bounded (hangbound.py): huggingface_hub gives its API requests no timeout,
    so a Hub that stopped answering held them for ever. Its uploads of files are watched for
    movement (hfmoved.py)."""

    hangs = "the Hub (or the mirror HF_ENDPOINT names), or the network to it, stopped answering"
    to_check = "check the Hub, status.huggingface.co or the mirror's server, and the network to it"
    watches_uploads = True  # each read of a file as it is sent, and each step done, is ``moved``

    def __init__(
        self,
        repo_id: str,
        prefix: str = "",
        *,
        token: Optional[str] = None,
        endpoint: Optional[str] = None,
    ) -> None:
        """``token`` and ``endpoint`` (a run's secrets, onbox.sealing.stores.open_store) win
        over HF_TOKEN or the saved token, and over HF_ENDPOINT."""
        self.repo_id = repo_id
        self.prefix = "/".join(p for p in prefix.split("/") if p)
        self.url = f"hf://{repo_id}" + (f"/{self.prefix}" if self.prefix else "")
        self.token = token  # None: huggingface_hub's own (HF_TOKEN, else `hf auth login`'s)
        # huggingface_hub reads HF_ENDPOINT once, when it is imported; read it again here so a
        # store opened later still honours it.
        endpoint = (endpoint or os.environ.get("HF_ENDPOINT", "")).strip().rstrip("/") or None
        self.api = HfApi(endpoint=endpoint, token=token, library_name="rgt")
        self.endpoint: str = self.api.endpoint
        self._repo_ready = False
        self._private: Optional[bool] = None
        # plan_fetch's answers, taken by fetch_file: key -> (the Hub's size, the commit)
        self._planned: Dict[str, Tuple[int, str]] = {}
        self.tokens = f"write tokens are made at {self.endpoint}/settings/tokens"

    def bound_calls(self, seconds: float, longer: str = STALL_SETTING) -> None:
        """As HangBound's (``calls_bounded`` too); huggingface_hub's requests are given a
        timeout that ends an upload's thread left after a cut (hfmoved.py)."""
        bound_idle_requests(seconds)
        super().bound_calls(seconds, longer)

    # -- helpers ---------------------------------------------------------------------------

    def _path(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _key(self, path: str) -> str:
        # A listed path becomes a key rgt reads, deletes or downloads to a local path: one that
        # rgt could not have written is refused (UnsafePath), not used.
        return check_key(path[len(self.prefix) + 1 :] if self.prefix else path)

    def _error(self, e: BaseException, doing: str) -> Exception:
        """The StoreError for an exception raised by huggingface_hub (hferrors.store_error)."""
        where = f"{doing} ({self.url} on {self.endpoint})"
        return store_error(
            e, where, repo_id=self.repo_id, branch=REVISION, tokens=self.tokens, token=self.token
        )

    def ensure_repo(self) -> Optional[bool]:
        """Create the repo, private, unless it exists (checked first: a token that may write to
        the repo need not be allowed to create repos); once per store. Whether it is private."""
        if self._repo_ready:
            return self._private
        doing = f"opening (or creating, private) the repo {self.repo_id}"
        try:
            try:
                self._private = self.api.model_info(self.repo_id).private
            except RepositoryNotFoundError:
                self.api.create_repo(self.repo_id, private=True, exist_ok=True, repo_type="model")
                self._private = True
        except Exception as e:
            raise self._error(e, doing) from None
        self._repo_ready = True
        return self._private

    def _head(self) -> str:
        try:
            sha = self.api.model_info(self.repo_id, revision=REVISION).sha
        except Exception as e:
            raise self._error(e, "reading the head commit") from None
        if not sha:
            raise TransientStoreError(f"{self.url}: the Hub returned no head commit")
        return sha

    def _file(self, path: str, revision: str = REVISION, doing: str = "stat") -> Optional[RepoFile]:
        """The Hub's RepoFile for ``path`` at ``revision``, or None."""
        try:
            infos = self.api.get_paths_info(self.repo_id, [path], revision=revision)
        except Exception as e:
            raise self._error(e, f"{doing} {path}") from None
        for info in infos:
            if isinstance(info, RepoFile) and info.path == path:
                return info
        return None

    def _commit_add(
        self,
        key: str,
        path: str,
        src: Union[bytes, BinaryIO],
        message: str,
        parent: Optional[str] = None,
        sha256: Optional[str] = None,
    ) -> str:
        """Commit one file; the commit id (or the head's, when nothing changed).

        The content goes up first (LFS or Xet); if the sha256 huggingface_hub computed from the
        bytes it sent is not ``sha256``, nothing is committed."""
        op = CommitOperationAdd(path_in_repo=path, path_or_fileobj=src)
        self.api.preupload_lfs_files(self.repo_id, [op], revision=REVISION)
        self.moved()  # the content is up: an answer is movement, as a piece read is
        sent = op.upload_info.sha256.hex()
        if sha256 is not None and sent != sha256:
            raise IntegrityError(
                f"{key}: the bytes uploaded to {self.url} have sha256 {sent[:12]}, "
                f"expected {sha256[:12]}; nothing was committed",
                "the source changed after it was hashed: put again",
            )
        info = self.api.create_commit(
            self.repo_id,
            [op],
            commit_message=message,
            revision=REVISION,
            parent_commit=parent,
        )
        self.moved()
        return str(info.oid)

    def _discard(self, path: str, revision: str) -> bool:
        """Best effort: remove a file that failed verification, unless the repo moved on."""
        try:
            self.api.create_commit(
                self.repo_id,
                [CommitOperationDelete(path_in_repo=path)],
                commit_message=f"rgt: remove {path} (failed verification)",
                revision=REVISION,
                parent_commit=revision,
            )
        except Exception:
            return False
        return True

    def _verify(
        self,
        key: str,
        path: str,
        revision: str,
        *,
        size: int,
        sha256: str,
        blob_id: Optional[str] = None,
        local: Optional[str] = None,
    ) -> ObjectInfo:
        """Compare what the Hub holds at ``revision`` with what was sent; IntegrityError else."""
        f = self._file(path, revision, doing="verifying")
        problem = mismatch(
            f, path, revision, size=size, sha256=sha256, blob_id=blob_id, local=local
        )
        if problem is not None:
            removed = f is not None and self._discard(path, revision)
            raise IntegrityError(
                f"{key}: the upload to {self.url} does not match its source: {problem}"
                + ("; removed it again" if removed else ""),
                "the source changed during the upload, or the Hub stored other bytes; put again",
            )
        return ObjectInfo(key, size, sha256, None if f is None else f.blob_id)

    def _download(self, path: str, into: str, revision: str = REVISION) -> Optional[str]:
        """Download ``path`` under the directory ``into``; its local path, or None if absent."""
        return download(self.repo_id, self.endpoint, path, into, revision, self._error, self.token)

    # -- the Store interface -----------------------------------------------------------------

    def put_file(self, key: str, path: str, *, sha256: Optional[str], size: int) -> ObjectInfo:
        if sha256 is None:
            raise ValueError("this store needs the caller's sha256")
        repo_path = self._path(key)
        blob_id = None
        self.ensure_repo()
        try:
            src: Union[int, bytes] = open_regular(path)  # a FIFO, a link: refused
        except OSError as e:
            raise os_error(e, f"reading {path}") from None
        if size <= INLINE_MAX:
            try:
                with open(src, "rb") as f:
                    data = f.read()
            except OSError as e:
                raise os_error(e, f"reading {path}") from None
            got = hashlib.sha256(data).hexdigest()
            if len(data) != size or got != sha256:
                raise IntegrityError(
                    f"{key}: {path} does not match the sha256 it was given "
                    f"({len(data)} bytes sha256 {got[:12]}, expected {size} bytes {sha256[:12]})",
                    "the source changed after it was hashed",
                )
            src, blob_id = data, git_blob_id(data)
        try:
            with Counted(src, self.moved) as f:  # its reads are the upload's movement
                put = cast(BinaryIO, f)  # an io.BufferedIOBase, as huggingface_hub checks
                revision = self._commit_add(key, repo_path, put, f"rgt: put {key}", sha256=sha256)
        except Exception as e:
            raise self._error(e, f"uploading {key}") from None
        return self._verify(
            key, repo_path, revision, size=size, sha256=sha256, blob_id=blob_id, local=path
        )

    @answers("writing {}")
    def put_bytes(
        self, key: str, data: bytes, *, if_absent: bool = False, if_match: Optional[str] = None
    ) -> ObjectInfo:
        repo_path = self._path(key)
        self.ensure_repo()
        sha256, blob_id = hashlib.sha256(data).hexdigest(), git_blob_id(data)
        if not if_absent and if_match is None:
            try:
                revision = self._commit_add(key, repo_path, data, f"rgt: put {key}")
            except Exception as e:
                raise self._error(e, f"writing {key}") from None
            return self._verify(
                key, repo_path, revision, size=len(data), sha256=sha256, blob_id=blob_id
            )
        for _ in range(IF_ABSENT_ATTEMPTS):
            head = self._head()
            now = self._file(repo_path, head, doing="checking")
            if if_match is None and now is not None:
                raise PreconditionFailed(f"{key} already exists in {self.url}")
            if if_match is not None and (now is None or now.blob_id != if_match):
                raise PreconditionFailed(f"{key} in {self.url} is not at version {if_match}")
            try:
                revision = self._commit_add(key, repo_path, data, f"rgt: create {key}", parent=head)
            except HfHubHTTPError as e:
                if http_status(e) == 412:  # the head moved since we looked: look again
                    continue
                raise self._error(e, f"creating {key}") from None
            except Exception as e:
                raise self._error(e, f"creating {key}") from None
            return self._verify(
                key, repo_path, revision, size=len(data), sha256=sha256, blob_id=blob_id
            )
        raise TransientStoreError(
            f"creating {key} in {self.url}: the repo changed under every one of "
            f"{IF_ABSENT_ATTEMPTS} attempts"
        )

    @answers("reading {}")
    def get_bytes(self, key: str) -> Optional[bytes]:
        path = self._path(key)
        tmp = tempfile.mkdtemp(prefix="rgt-hf-")
        try:
            local = self._download(path, tmp)
            if local is None:
                return None
            with open(local, "rb") as f:
                return f.read()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    @answers("reading {}")
    def get_versioned(self, key: str) -> Optional[Tuple[bytes, str]]:
        path = self._path(key)
        head = self._head()  # the bytes and the blob id of one commit, read together
        f = self._file(path, head, doing="reading")
        if f is None:
            return None
        tmp = tempfile.mkdtemp(prefix="rgt-hf-")
        try:
            local = self._download(path, tmp, revision=head)
            if local is None:
                return None
            with open(local, "rb") as fh:
                return fh.read(), f.blob_id
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    @answers("asking the sizes of the files to download")
    def plan_fetch(self, sizes: Mapping[str, int]) -> None:
        """The Hub's size of every key in ``sizes`` at the head commit, from paths-info
        (hfdownload.sizes_at): a few requests for a checkpoint of 1,000 files, not a HEAD per
        file. Each fetch_file takes its key's answer and downloads that commit. Best effort:
        a file the Hub did not answer for is asked for by its fetch's own HEAD, as before."""
        try:
            commit = self._head()
            keys = {self._path(k): k for k in sizes}
            found = sizes_at(self.api, self.repo_id, sorted(keys), commit)
            self._planned = {keys[p]: (n, commit) for p, n in found.items() if p in keys}
        except Exception:  # any failure: each fetch asks for itself, as it did before
            self._planned = {}

    def fetch_file(
        self, key: str, dest: str, *, size: Optional[int] = None, lanes: Optional[Lanes] = None
    ) -> Optional[str]:
        """``get_file``; with ``size``, the Hub's size (plan_fetch's, else a HEAD's) refuses a
        file of another size before its bytes, and the download is of the commit that answer
        is of (hfdownload.py). None: huggingface_hub returns no hash; the caller reads the file
        back."""
        if lanes is not None and lanes.stopped:
            raise concurrent.futures.CancelledError()
        path, revision = self._path(key), REVISION
        if size is not None:
            found: Optional[Tuple[Optional[int], Optional[str]]] = self._planned.pop(key, None)
            if found is None:  # not planned, or taken by an earlier try: ask now
                found = size_at_head(
                    self.repo_id, self.endpoint, path, REVISION, self._error, self.token
                )
            if found is None:
                raise PermanentStoreError(f"{key} is not in {self.url}")
            if found[0] is not None and found[0] != size:
                raise IntegrityError(
                    f"{self.url}/{key}: {found[0]} bytes in the store, the MANIFEST says "
                    f"{size} bytes",
                    "the object in the store is not the one sealed, damaged or replaced: "
                    "nothing of it was downloaded",
                )
            revision = found[1] or REVISION
        download_to(
            self.repo_id,
            self.endpoint,
            path,
            dest,
            revision,
            self._error,
            key,
            self.url,
            self.token,
        )
        return None

    def get_file(self, key: str, dest: str) -> None:
        path = self._path(key)
        download_to(
            self.repo_id,
            self.endpoint,
            path,
            dest,
            REVISION,
            self._error,
            key,
            self.url,
            self.token,
        )

    @answers("looking at {}")
    def stat(self, key: str) -> Optional[ObjectInfo]:
        f = self._file(self._path(key))
        return None if f is None else _info(key, f)

    @answers("listing {}", whole=True)
    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        parts = [p for p in prefix.split("/") if p][:-1] if prefix else []
        folder = "/".join(([self.prefix] if self.prefix else []) + parts)
        want = f"{self.prefix}/{prefix}" if self.prefix else prefix
        try:
            entries = self.api.list_repo_tree(
                self.repo_id, folder or None, recursive=True, revision=REVISION
            )
            for f in entries:
                path = f.path
                if not isinstance(f, RepoFile) or not path.startswith(want):
                    continue
                if self.prefix and not path.startswith(self.prefix + "/"):
                    continue
                if not self.prefix and path == ".gitattributes":
                    continue  # the repo's own, not an object of ours
                yield _info(self._key(path), f)
        except EntryNotFoundError as e:
            if isinstance(e, LocalEntryNotFoundError):
                raise self._error(e, f"listing {prefix!r}") from None
            return  # no such folder: nothing under the prefix
        except Exception as e:
            raise self._error(e, f"listing {prefix!r}") from None

    @answers("deleting {}")
    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            self.api.delete_file(
                path, self.repo_id, revision=REVISION, commit_message=f"rgt: delete {key}"
            )
        except EntryNotFoundError as e:
            if isinstance(e, LocalEntryNotFoundError):
                raise self._error(e, f"deleting {key}") from None
        except Exception as e:
            raise self._error(e, f"deleting {key}") from None

    @answers("its preflight for {}")
    def preflight(self, run: str) -> List[Finding]:
        return run_preflight(self, run)
