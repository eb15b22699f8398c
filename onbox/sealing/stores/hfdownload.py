"""How an ``hf://`` store (onbox/sealing/stores/hf.py) brings a file back from the Hub.

huggingface_hub downloads it into a temporary directory (its ``local_dir``, with a
``cache_dir`` inside it: nothing lands in ``~/.cache/huggingface/hub``), of one commit; a file
for a restore or a pull is then renamed to its destination, next to which that directory was
made (one filesystem), and fsynced, which huggingface_hub does not do. Where the caller knows
the size to expect (a MANIFEST's), the Hub's size and the commit it is of come first (for a
restore or a pull, from one ``paths-info`` for all its files: HFStore.plan_fetch; else from a
HEAD of the file): another size is refused before any byte comes (a file replaced on the
Hub by a larger one cannot fill the box's disk or the laptop's), and the download is of that
very commit, so the size checked is the size received. Imported only by hf.py, after its
guarded import of huggingface_hub.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Callable, Dict, List, Optional, Tuple

from huggingface_hub import HfApi, get_hf_file_metadata, hf_hub_download, hf_hub_url
from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError
from huggingface_hub.hf_api import RepoFile

from onbox.common.durable import fsync_file
from onbox.sealing.stores.base import WRITE_ERRNOS, PermanentStoreError, target_error

# The StoreError for an exception of huggingface_hub, given what was being done (hf.py's).
Error = Callable[[BaseException, str], Exception]
# Paths in one paths-info request of sizes_at: the Hub takes a list; a few hundred keep each
# request small.
BATCH = 500


def download(
    repo_id: str,
    endpoint: str,
    path: str,
    into: str,
    revision: str,
    error: Error,
    token: Optional[str] = None,
) -> Optional[str]:
    """Download ``path`` at ``revision`` under the directory ``into``; its local path, or None
    when the Hub has no such file. ``token`` (None: huggingface_hub's own) reads a private
    repo."""
    try:
        got = hf_hub_download(
            repo_id,
            path,
            revision=revision,
            endpoint=endpoint,
            token=token,
            local_dir=os.path.join(into, "d"),
            cache_dir=os.path.join(into, "c"),
            library_name="rgt",
        )
    except EntryNotFoundError as e:
        if isinstance(e, LocalEntryNotFoundError):
            raise error(e, f"reading {path}") from None
        return None
    except OSError as e:
        if e.errno in WRITE_ERRNOS:  # writing into ``into``: this machine's disk, not the Hub
            raise target_error(e, f"downloading {path} into {into}") from None
        raise error(e, f"reading {path}") from None
    except Exception as e:
        raise error(e, f"reading {path}") from None
    # Old huggingface_hub versions may leave a symlink into cache_dir: move the real file.
    return os.path.realpath(str(got))


def sizes_at(api: HfApi, repo_id: str, paths: List[str], commit: str) -> Dict[str, int]:
    """The size of each of ``paths`` at ``commit``, from ``paths-info`` (BATCH paths a
    request); a path the Hub does not list there is left out. Errors are the caller's."""
    sizes: Dict[str, int] = {}
    for i in range(0, len(paths), BATCH):
        for info in api.get_paths_info(repo_id, paths[i : i + BATCH], revision=commit):
            if isinstance(info, RepoFile):
                sizes[info.path] = int(info.size)
    return sizes


def size_at_head(
    repo_id: str,
    endpoint: str,
    path: str,
    revision: str,
    error: Error,
    token: Optional[str] = None,
) -> Optional[Tuple[Optional[int], Optional[str]]]:
    """(the size the Hub gives ``path`` at ``revision``, the commit that answer is of), from
    a HEAD, before any byte of it; None when the Hub has no such file."""
    try:
        meta = get_hf_file_metadata(
            hf_hub_url(repo_id, path, revision=revision, endpoint=endpoint),
            endpoint=endpoint,
            token=token,
            library_name="rgt",
        )
    except EntryNotFoundError:
        return None
    except Exception as e:
        raise error(e, f"reading {path}") from None
    return meta.size, meta.commit_hash


def download_to(
    repo_id: str,
    endpoint: str,
    path: str,
    dest: str,
    revision: str,
    error: Error,
    key: str,
    url: str,
    token: Optional[str] = None,
) -> None:
    """``path`` (the store's ``key``; ``url``, the store's, for messages) at ``revision``
    downloaded to ``dest``, a new file (never over anything there, a symlink included),
    fsynced."""
    try:
        tmp = tempfile.mkdtemp(prefix=".rgt-hf-", dir=os.path.dirname(os.path.abspath(dest)))
    except OSError as e:
        raise target_error(e, f"writing {dest}") from None
    try:
        local = download(repo_id, endpoint, path, tmp, revision, error, token)
        if local is None:
            raise PermanentStoreError(f"{key} is not in {url}")
        if os.path.lexists(dest):  # as the other stores: a new file, never over a symlink
            raise PermanentStoreError(
                f"downloading {key}: {dest} exists already", "a download writes a new file"
            )
        os.replace(local, dest)
        fsync_file(dest)
    except OSError as e:
        raise target_error(e, f"writing {dest}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
