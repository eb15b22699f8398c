"""A training checkpoint written by rgt's API: its layout, writing it atomically, and reading it
back with integrity checks.

    $RGT_CKPT_DIR/step_1200/
        state.pt             torch.save of {"format", "step", "objects", "rng", "extra"}: every
                             optimizer, scheduler, scaler, data loader and (unless safetensors
                             was asked for) model state, the RNGs and the user's extras
        <model>.safetensors  each model's weights, when safetensors was asked for
        .rgt-complete        written last: {"step", "format", "files": {name: {size, sha256}}}

The directory is built under a hidden temporary name and renamed into place after every file
and the marker are fsynced, so ``step_N`` either does not exist or is whole; the agent's sealer
takes the marker as the sign of a complete checkpoint and reads its step from it. Reading
verifies each file's size and sha256 against the marker and loads with ``weights_only=True``
only; it never falls back to unsafe unpickling.

Standard library at import; torch (and safetensors) when used.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import sys
import time
from typing import IO, Any, Callable, Dict, List, Optional, Set, Tuple, cast

from onbox.common import jobenv, links
from onbox.common.durable import fsync_dir, fsync_file, sha256_file
from onbox.common.errors import CheckpointError
from onbox.train import rankverify

FORMAT = 1
MARKER = jobenv.COMPLETE_MARKER
STATE = "state.pt"
PREFIX = "step_"
_NAME = re.compile(r"step_(\d+)\Z")
# .step_N.rgt-tmp.<pid>.<hex> (a write), .rgt-old.<hex> (moved aside to be replaced), .rgt-del.<hex>
_TMP = re.compile(r"\.(step_\d+)\.rgt-(tmp|old|del)\.(?:(\d+)\.)?")


def name_for(step: int) -> str:
    return f"{PREFIX}{int(step)}"


def path_for(ckpt_dir: str, step: int) -> str:
    return os.path.join(ckpt_dir, name_for(step))


def step_of(name: str) -> Optional[int]:
    m = _NAME.match(name)
    return int(m.group(1)) if m else None


def complete(ckpt_dir: str) -> List[Tuple[int, str]]:
    """(step, path) of every checkpoint with a marker in ``ckpt_dir``, newest first."""
    try:
        names = os.listdir(ckpt_dir)
    except FileNotFoundError:
        return []
    out = []
    for n in names:
        step = step_of(n)
        path = os.path.join(ckpt_dir, n)
        if step is not None and os.path.isfile(os.path.join(path, MARKER)):
            out.append((step, path))
    return sorted(out, reverse=True)


def clean_stale(ckpt_dir: str) -> None:
    """Tidy up after killed saves (never a final name is removed): a checkpoint moved aside to
    be replaced by one of the same step goes back under its name when the new one never got
    there (it was the only copy of that step); the temporary directory of a write whose process
    is gone, and one being deleted, are removed."""
    try:
        names = sorted(os.listdir(ckpt_dir))
    except FileNotFoundError:
        return
    for n in names:
        m = _TMP.match(n)
        if m is None:
            continue
        path, final = os.path.join(ckpt_dir, n), os.path.join(ckpt_dir, m.group(1))
        if m.group(2) == "old" and not os.path.exists(final):
            with contextlib.suppress(OSError):  # else left as it is, for a later start
                os.rename(path, final)
            continue
        if m.group(2) == "tmp" and m.group(3) and _alive(int(m.group(3))):
            continue  # another process's write in progress (a rank's, say)
        shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    """Whether ``pid`` is another process that is running (this one has no write in flight
    while it tidies up: a directory named for it was left by an earlier process)."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: running, someone else's
        return True
    return True


class _HashingFile:
    """A write-only file for ``torch.save`` that hashes what it writes, in L2-sized pieces: each
    piece is read from the staging buffer once, hashed, and copied into the page cache while it
    is still in the CPU's cache. Reading the file back to hash it would cost a second pass over
    the whole state in memory bandwidth, which a training loop on the same socket feels."""

    PIECE = 1 << 20

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), self.PIECE):
            piece = view[start : start + self.PIECE]
            self.sha.update(piece)
            while piece:
                piece = piece[os.write(self.fd, piece) :]
        self.size += len(view)
        return len(view)

    def flush(self) -> None:
        pass


def _crc32_off() -> Any:
    """torch's zip writer computes a CRC32 of every record by default, a full extra pass over the
    state; nothing checks it (torch.load does not) and the marker's sha256 covers the file, so
    rgt's own writes skip it where this torch lets them (2.6 and later)."""
    try:
        from torch.utils.serialization import config
    except ImportError:
        return contextlib.nullcontext()
    if not hasattr(getattr(config, "save", None), "compute_crc32"):
        return contextlib.nullcontext()
    patch = config.patch  # type: ignore[attr-defined]  # set on the module at import
    return patch({"save.compute_crc32": False})


def _save_state(state: Dict[str, Any], path: str) -> Tuple[str, int]:
    """torch.save ``state`` to ``path`` and fsync it; (sha256, size) of what was written."""
    import torch

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        out = _HashingFile(fd)
        with _crc32_off():
            torch.save(state, cast(IO[bytes], out))
        os.fsync(fd)
    finally:
        os.close(fd)
    return out.sha.hexdigest(), out.size


def write(
    ckpt_dir: str,
    step: int,
    state: Dict[str, Any],
    weights: Optional[Dict[str, Dict[str, Any]]] = None,
) -> Tuple[str, int]:
    """Write checkpoint ``step`` atomically; (its path, bytes written). ``weights`` maps a model's
    name to its state dict, saved as ``<name>.safetensors``."""
    os.makedirs(ckpt_dir, exist_ok=True)
    final = path_for(ckpt_dir, step)
    tmp = os.path.join(ckpt_dir, f".{name_for(step)}.rgt-tmp.{os.getpid()}.{os.urandom(3).hex()}")
    os.mkdir(tmp)
    try:
        files: Dict[str, Dict[str, Any]] = {}
        sha, size = _save_state(state, os.path.join(tmp, STATE))
        files[STATE] = {"size": size, "sha256": sha}
        for model, sd in (weights or {}).items():
            from safetensors.torch import save_file

            fname = f"{model}.safetensors"
            path = os.path.join(tmp, fname)
            # safetensors writes the file itself (no stream to hash on the way): read it back.
            save_file(_untied(sd), path, metadata={"rgt_step": str(step)})
            fsync_file(path)
            sha, size = sha256_file(path)
            files[fname] = {"size": size, "sha256": sha}
        marker = {"step": int(step), "format": FORMAT, "files": files, "created": time.time()}
        put_in_place(tmp, final, marker)
    except BaseException as e:
        # Judged before the partial files go: they are what filled the disk.
        full = _out_of_room(ckpt_dir) if isinstance(e, Exception) else None
        shutil.rmtree(tmp, ignore_errors=True)
        if full is not None:  # torch.save reports ENOSPC as an opaque RuntimeError
            raise full from e
        raise
    return final, sum(f["size"] for f in files.values())


def put_in_place(tmp: str, final: str, marker: Dict[str, Any]) -> None:
    """Write ``marker`` last into the directory ``tmp`` (every file in it already fsynced),
    then rename ``tmp`` to ``final`` in the same parent, replacing a checkpoint saved at the same
    step before, and fsync the parent: ``final`` is whole or absent after a crash."""
    with open(os.path.join(tmp, MARKER), "w") as f:
        json.dump(marker, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp)
    parent = os.path.dirname(final)
    old = None
    if os.path.exists(final):  # the same step saved again (after a resume): replace it
        old = os.path.join(parent, f".{os.path.basename(final)}.rgt-old.{os.urandom(3).hex()}")
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(parent)
    if old is not None:
        # Deleted under the name of a deletion, not .rgt-old: clean_stale puts an .rgt-old
        # back under ``final`` once that is gone, and a kill part-way through this rmtree
        # would leave it marked over missing files.
        gone = os.path.join(parent, f".{os.path.basename(final)}.rgt-del.{os.urandom(3).hex()}")
        with contextlib.suppress(OSError):
            os.rename(old, gone)
            old = gone
        shutil.rmtree(old, ignore_errors=True)


def _out_of_room(ckpt_dir: str) -> Optional[OSError]:
    """ENOSPC, said plainly, when the disk is (nearly) out of bytes or inodes."""
    try:
        st = os.statvfs(ckpt_dir)
    except OSError:
        return None
    free = st.f_bavail * st.f_frsize
    if st.f_files and st.f_favail == 0:
        return OSError(errno.ENOSPC, "No inodes left on the checkpoint disk", ckpt_dir)
    if free < 16 << 20:
        return OSError(
            errno.ENOSPC, f"No space left on the checkpoint disk ({free} bytes free)", ckpt_dir
        )
    return None


def _untied(sd: Dict[str, Any]) -> Dict[str, Any]:
    """safetensors refuses tensors that share memory (tied weights): give each its own copy
    when two share one (rare, and small next to the model)."""
    seen: Dict[Tuple[int, int], str] = {}
    out = {}
    for k, t in sd.items():
        key = (t.data_ptr(), t.numel()) if t.numel() else (id(t), 0)
        out[k] = t.clone() if key in seen else t.contiguous()
        seen.setdefault(key, k)
    return out


def check_keep(keep: Any) -> int:
    """``keep``, the number of newest checkpoints rotation leaves, checked when a checkpointer
    is made: a bad one would otherwise fail only after the first save was written."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(
            f"keep must be a whole number of checkpoints, 1 or more, not {keep!r}: "
            "rotation keeps the newest keep (give a large one to keep them all)"
        )
    return keep


def prune(
    ckpt_dir: str,
    keep: int,
    protect: Optional[str] = None,
    found: Optional[List[Tuple[int, str]]] = None,
) -> List[str]:
    """Delete all but the newest ``keep`` checkpoints (never ``protect``: the one just written,
    which a higher step left behind by an earlier run, e.g. a damaged one that load skipped,
    would otherwise push out); what was deleted. ``found``: the (step, path) of the ones to
    rotate, newest first (an adapter's own kind; default: every complete one in ckpt_dir).

    A user's symlinks (links.within): one in the dir counts as its target, ranked by the newest
    of its names (what resume would load through), and goes with it, so a kept link never
    dangles and a kept checkpoint keeps its links; one out of the dir is neither counted nor
    touched (resume skips it). A checkpoint that another link in the dir names (``best``) is
    never deleted: that link would dangle."""
    groups: Dict[str, List[str]] = {}  # real path -> its names in ``found``, newest first
    for _, path in complete(ckpt_dir) if found is None else found:
        if links.within(path) is not None:
            groups.setdefault(os.path.realpath(path), []).append(path)
    rotated = {os.path.abspath(p) for names in groups.values() for p in names}
    held = {os.path.realpath(protect)} if protect is not None else set()
    held |= _named_by_links(ckpt_dir, rotated)
    gone = []
    for real, names in list(groups.items())[max(keep, 1) :]:
        if real in held:
            continue
        # The links first: a kill part-way through leaves no link to a deleted checkpoint.
        for path in sorted(names, key=lambda p: not os.path.islink(p)):
            remove(path)
            gone.append(path)
    return gone


def _named_by_links(ckpt_dir: str, rotated: Set[str]) -> Set[str]:
    """The real paths that a symlink in ``ckpt_dir`` other than those in ``rotated`` (abs
    paths) leads to, inside the dir."""
    return {real for path, real in links.inbound(ckpt_dir) if os.path.abspath(path) not in rotated}


def remove(path: str) -> None:
    """Delete the checkpoint at ``path``: a directory is first renamed to a hidden name in one
    step, so that a kill part-way through leaves no marker over missing files under a final
    name (the sealer would seal that as a complete checkpoint); clean_stale takes what is left.
    A file (Lightning's step_N.ckpt) goes in one unlink."""
    if not os.path.isdir(path) or os.path.islink(path):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    parent, name = os.path.split(path)
    gone = os.path.join(parent, f".{name}.rgt-del.{os.urandom(3).hex()}")
    try:
        os.rename(path, gone)
    except FileNotFoundError:
        return
    shutil.rmtree(gone, ignore_errors=True)


def verify(path: str, fmt: Any = FORMAT, hashes: bool = True) -> Dict[str, Any]:
    """The marker of the checkpoint at ``path`` after checking every file it lists (names may
    hold ``/``: files in subdirectories); raises CheckpointError naming the first file that is
    missing, short, long or altered. ``fmt``: the marker's format required (None: any).
    ``hashes``: False checks presence and sizes only (a stat each, not a read of the whole
    checkpoint): an alteration that keeps the size is found only with the sha256. The ranks of
    a job on one box hash it once for all of them (onbox/train/rankverify.py)."""
    try:
        with open(os.path.join(path, MARKER), "rb") as f:
            raw = f.read()
        marker = json.loads(raw)
        files = marker["files"]
        int(marker["step"])
    except FileNotFoundError:
        raise CheckpointError(
            f"{path} has no {MARKER}: it is not a complete rgt checkpoint",
            "it was cut off while written; use an older one",
        ) from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}/{MARKER} is unreadable: {e}", "use an older one") from None
    if fmt is not None and marker.get("format") != fmt:
        raise CheckpointError(
            f"{path} has format {marker.get('format')!r}; this rgt reads format {fmt}",
            "load it with the rgt version that wrote it",
        )
    if hashes:
        rankverify.check(path, raw, files)
    else:
        rankverify.stat_files(path, files)
    return dict(marker)


def newest_verified(
    found: List[Tuple[int, str]],
    check: Callable[[str], Dict[str, Any]] = verify,
    say: bool = True,
) -> Optional[Tuple[int, str, Dict[str, Any]]]:
    """(step, path, what ``check`` returned) of the first of ``found`` ((step, path), newest
    first) that ``check`` passes, None when none does. A scanned checkpoint that fails it
    (CheckpointError: damaged, cut off) is skipped with a line on stderr, so a run resumes
    from the newest whole one instead of crashing on (or loading) a broken newest.

    A symlink (Lightning's ``last.ckpt``, a user's ``step_N.ckpt``) is checked through its
    target when that lies in the checkpoint dir (the sealer seals it there under its own name),
    and skipped when it lies outside: the sealer never follows a link
    (onbox/sealing/discovery.py), so the store never holds what it points to, and a run resumed
    from it would go back to an older step on the next box. ``say``: False skips silently
    (a question, such as ``Checkpointer.latest``, not the load itself)."""
    for step, path in found:
        real = links.within(path)
        if real is None:
            if not say:
                continue
            print(
                f"rgt: skipping checkpoint step {step}: {path} is a symlink to "
                f"{os.path.realpath(path)}, outside the checkpoint dir (never sealed); resume "
                "reads only checkpoints in it (a link to one in it is fine)",
                file=sys.stderr,
                flush=True,
            )
            continue
        try:
            return step, path, check(real)
        except CheckpointError as e:
            if say:
                print(f"rgt: skipping checkpoint step {step}: {e.what}", file=sys.stderr)
    return None


def named_dir(path: str) -> str:
    """The checkpoint directory ``path`` names (RGT_RESUME_FROM, a path given to load): itself,
    or the directory of a file inside one."""
    if os.path.isfile(path) and os.path.basename(path) != MARKER:
        return os.path.dirname(path)
    return path


def read(
    path: str, marker: Optional[Dict[str, Any]] = None
) -> Tuple[Dict[str, Any], Dict[str, Dict[str, Any]]]:
    """(state, weights by model name) of a checkpoint, loaded weights-only; verified first
    unless the caller passes the marker ``verify`` just returned."""
    import torch

    if marker is None:
        marker = verify(path)
    try:
        state = torch.load(os.path.join(path, STATE), map_location="cpu", weights_only=True)
    except Exception as e:  # UnpicklingError for anything that is not plain data
        raise CheckpointError(
            f"{path}/{STATE} cannot be loaded weights-only: {type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}",
            "rgt never unpickles arbitrary objects; store only tensors and plain data in extras",
        ) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path}/{STATE} is not an rgt training state", "use another")
    weights = {}
    for fname in marker["files"]:
        if fname.endswith(".safetensors"):
            from safetensors.torch import load_file

            weights[fname[: -len(".safetensors")]] = load_file(os.path.join(path, fname))
    return state, weights
