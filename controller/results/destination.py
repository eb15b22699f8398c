"""Where ``rgt pull`` puts things (controller/results/pull.py runs it): DEST checked before
anything is fetched (no symlink, directory or file in the way; no other run's verified pull; no
two names of the state that DEST's filesystem takes for one file: ``refuse_folded_twins``),
one pull at a time into it (a flock on DEST itself), the staging directory ``DEST/.rgt-part``
made and cleared of what is in the way, and the verified copies placed under their final
names: every rename through directory descriptors walked without following symlinks, the old
receipt removed before the first, completeness markers last. What DEST holds in the pull's
layout that this pull did not bring (an older pull's checkpoint the run no longer has sealed)
is named for the receipt (``not_covered``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import posixpath
import secrets
import shutil
import stat
import unicodedata
from concurrent.futures import ThreadPoolExecutor
from typing import (
    AbstractSet,
    Dict,
    Iterable,
    Iterator,
    List,
    NamedTuple,
    Optional,
    Tuple,
)

from controller.results.entries import COPY, Entry
from controller.results.hashing import HASHERS
from controller.results.receipt import load_receipt, receipt_path, remove_receipts
from controller.results.transport import CHUNK
from onbox.common.durable import fsync_dir, fsync_file
from onbox.common.errors import HostError, IntegrityError, UnsafeRefused, UsageError
from onbox.common.safepath import (
    UnsafePath,
    lstat_beneath,
    open_beneath,
    replace_beneath,
    safe_join,
    symlink_error,
    unlink_beneath,
)
from onbox.sealing.discovery import MARKERS
from onbox.sealing.stores.base import target_error

# Where `rgt pull N` puts a run without --to: RESULTS_DIR/N, relative to where it runs (the
# project, as a rule). A directory of rgt's own, which ignores itself (``ignore_all``).
RESULTS_DIR = "rgt-results"
IGNORE_ALL = (
    "# Made by `rgt pull`: what it pulls here stays on this machine, out of git and out of\n"
    "# every release `rgt deploy` pushes. Copy a file elsewhere in the project to ship it.\n"
    "*\n"
)


def make_stage(stage_dir: str) -> bool:
    """The staging directory: made here 0700 (True), or left by an earlier pull of this user
    (False; then a real directory of this user's, not a symlink); nothing else is staged into."""
    try:
        os.mkdir(stage_dir, 0o700)
        return True
    except FileExistsError:
        pass
    st = os.lstat(stage_dir)
    if stat.S_ISLNK(st.st_mode):
        raise symlink_error(stage_dir)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise UnsafePath(
            f"{stage_dir} is not a staging directory this user made",
            stage_dir,
            "remove it, or pull into another --to",
        )
    return False


@contextlib.contextmanager
def dest_lock(dest: str) -> Iterator[None]:
    """One pull at a time into ``dest``: a flock on the directory itself, held from before the
    staging directory is made until it is removed after the receipt. (A lock file inside the
    staging directory was removed with it while the pull that held it still ran, so a second
    and a third pull could then stage into one directory at once.)"""
    try:
        fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # --to's own choice
    except OSError as err:
        raise cannot(dest, err) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UsageError("--to", f"another pull into {dest} is running") from None
        yield
    finally:
        os.close(fd)


def refuse_other_runs_pull(run: str, dest: str) -> None:
    """A DEST that holds another run's verified pull is not pulled into: its files would be
    replaced and its receipt removed, while the laptop's receipt of that run still says they
    are there (and `rgt down` of it would believe it)."""
    try:
        here = load_receipt(receipt_path(dest))
    except IntegrityError:  # damaged: it vouches for nothing, and the pull replaces it
        return
    if here is not None and here.run != run:
        raise UsageError(
            "--to",
            f"{dest} holds the verified pull of run {here.run!r}; pulling {run!r} there would "
            "overwrite it: pull into another directory",
        )


class Folding(NamedTuple):
    """What a directory's filesystem takes for one name: names differing in case only
    ("Model.pt", "model.pt": macOS's APFS by default, Windows, ext4 with casefold), or in
    Unicode normal form only (NFC and NFD "é": APFS whatever its case)."""

    case: bool
    normal: bool

    def key(self, name: str) -> str:
        """``name`` as the filesystem compares it (conservatively: Python's full case folding,
        canonical decomposition)."""
        if self.normal:
            name = unicodedata.normalize("NFD", name)
        if self.case:
            name = name.casefold()
            name = unicodedata.normalize("NFD", name) if self.normal else name
        return name

    def says(self) -> str:
        """What it folds, in words."""
        return " and ".join(
            w for w, on in (("case", self.case), ("Unicode normal form", self.normal)) if on
        )


# Every folding a filesystem may do: a listing with no twins under any needs no probe.
FOLDINGS = (Folding(True, True), Folding(True, False), Folding(False, True))


def probe_folding(d: str) -> Folding:
    """Whether the filesystem of directory ``d`` folds case, or normal forms: a name made there
    (then removed), and whether its twin (the other case; the other normal form) is that file."""
    base = os.path.join(d, f".rgt-fold-{os.getpid()}-{secrets.token_hex(4)}-")
    made = base + "A\u00e9"  # "Aé", é composed (NFC)
    os.close(os.open(made, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
    try:
        st = os.lstat(made)
        return Folding(_same(base + "a\u00e9", st), _same(base + "Ae\u0301", st))
    finally:
        os.unlink(made)


def _same(twin: str, st: os.stat_result) -> bool:
    try:
        return os.path.samestat(os.lstat(twin), st)
    except FileNotFoundError:
        return False


def folded_twins(names: Iterable[str], folding: Folding) -> Optional[Tuple[str, str]]:
    """Two of ``names`` that are one name under ``folding``, or of which one is, so folded, a
    directory on the way to the other; None when there are none."""
    by_key: Dict[str, str] = {}
    for name in sorted(set(names)):
        other = by_key.setdefault(folding.key(name), name)
        if other != name:
            return other, name
    for key, name in by_key.items():
        parts = key.split("/")
        for i in range(1, len(parts)):
            head = by_key.get("/".join(parts[:i]))
            if head is not None:
                return head, name
    return None


def refuse_folded_twins(dest: str, entries: List[Entry]) -> None:
    """UnsafeRefused (exit 7) when two final names (or two staging names) of ``entries`` would
    be one file in ``dest``: its filesystem folds what tells them apart, and one would silently
    overwrite the other while the receipt lists both. Only a listing with such twins under some
    folding probes ``dest`` (a name made and removed there): none, nothing is written."""
    groups = [[e.path for e in entries], [e.stage for e in entries]]
    if all(folded_twins(names, f) is None for names in groups for f in FOLDINGS):
        return
    try:
        folding = probe_folding(dest)
    except OSError as err:
        raise cannot(dest, err) from None
    for names in groups:
        twins = folded_twins(names, folding) if folding.case or folding.normal else None
        if twins is not None:
            raise UnsafeRefused(
                f"cannot pull into {dest}: its filesystem does not tell names apart by "
                f"{folding.says()}, and the sealed state holds both {ascii(twins[0])} and "
                f"{ascii(twins[1])}: one would overwrite the other there (non-ASCII shown escaped, "
                "to tell them apart). Nothing was fetched",
                "pull into a directory on a filesystem that tells them apart (macOS: a "
                "case-sensitive APFS volume, made in Disk Utility; Linux: one without casefold)",
            )


def clear_in_the_way(stage_dir: str, items: List[Entry]) -> None:
    """What an earlier pull left under a staging name that is not a file now (a directory,
    when the store listed ``key/x`` then and ``key`` now), or in place of a directory on the
    way to one: removed. Everything under the staging directory is this user's own copies."""
    for e in items:
        parts = e.stage.split("/")
        for i in range(1, len(parts) + 1):
            path = os.path.join(stage_dir, *parts[:i])
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                break
            last = i == len(parts)
            if last and stat.S_ISREG(st.st_mode) or not last and stat.S_ISDIR(st.st_mode):
                continue
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(path)
            else:
                os.unlink(path)
            break


def cannot(dest: str, err: OSError) -> HostError:
    return HostError(
        f"cannot pull into {dest}: {err.strerror or err}"
        + (f" ({err.filename})" if err.filename else ""),
        "pull into a directory this user can write (--to DIR)",
    )


def make_dest(dest: str, results: Optional[str] = None) -> None:
    """DEST and the parents it lacks; those made are removed again when it cannot be.
    ``results``: the directory of rgt's own DEST is in (pull's default, RESULTS_DIR), given
    its ``.gitignore`` (``ignore_all``)."""
    missing = []
    d = dest
    while not os.path.lexists(d) and os.path.dirname(d) != d:
        missing.append(d)
        d = os.path.dirname(d)
    try:
        os.makedirs(dest, exist_ok=True)
    except OSError as err:
        for d in missing:
            with contextlib.suppress(OSError):
                os.rmdir(d)
        raise cannot(dest, err) from None
    if results is not None:
        try:
            ignore_all(results)
        except OSError as err:
            raise cannot(dest, err) from None


def ignore_all(results: str) -> None:
    """A ``.gitignore`` holding ``*`` in rgt's results directory ``results``, as a virtualenv
    or .pytest_cache has one: git ignores what is pulled there, and so the next `rgt deploy`
    does not push it back to the box (outside git, controller/deploy/project.py honours the
    same file). Written where there is none, also in a results directory an older rgt made;
    one already there (the user's, whatever it holds) is left as it is."""
    path = os.path.join(results, ".gitignore")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o644)
    except FileExistsError:
        return
    with open(fd, "w", encoding="utf-8") as f:
        f.write(IGNORE_ALL)


def _in_the_way(path: str) -> str:
    """The file that is not a directory on ``path``'s way: ``path`` itself, or the nearest of
    its parents that is there (``--to FILE/sub``: FILE, not FILE/sub, which is not there)."""
    p = path
    while True:
        try:
            if not stat.S_ISDIR(os.stat(p).st_mode):
                return p
        except OSError:  # not there, or under a file: look one up
            pass
        parent = os.path.dirname(p)
        if parent == p:
            return path
        p = parent


def check_dest(dest: str, entries: List[Entry], links: Iterable[str] = ()) -> None:
    """Before anything is fetched: no final name, nor a directory on the way to it, is a
    symlink (UnsafePath, exit 6), a directory or a file in the way (UsageError). ``links``:
    the names (under DEST/checkpoints) of the links the pull makes; the directory each is made
    in, and every one on the way to it, is a directory or not there yet, never a symlink."""
    for e in entries:
        _check_final(dest, e.path)
    for d in sorted({f"checkpoints/{n}".rpartition("/")[0] for n in links}):
        st = _lstat(dest, d)
        if st is not None and stat.S_ISLNK(st.st_mode):
            raise symlink_error(os.path.join(dest, *d.split("/")))
        if st is not None and not stat.S_ISDIR(st.st_mode):
            raise UsageError(
                "--to",
                f"{os.path.join(dest, *d.split('/'))} is a file, where the pull makes links",
                "move that file away, or pull to another directory",
            )


def _check_final(dest: str, path: str) -> None:
    st = _lstat(dest, path)
    if st is None:
        return
    final = os.path.join(dest, *path.split("/"))
    if stat.S_ISLNK(st.st_mode):
        raise symlink_error(final)
    if stat.S_ISDIR(st.st_mode):
        raise UsageError("--to", f"{final} is a directory; the pull would put a file there")


def _lstat(dest: str, path: str) -> Optional[os.stat_result]:
    """``lstat_beneath``, its errors said as check_dest's: a file on the way (UsageError), a
    symlink on the way (UnsafePath), any other (HostError)."""
    try:
        return lstat_beneath(dest, path, "file")
    except NotADirectoryError as err:
        raise UsageError(
            "--to",
            f"{_in_the_way(str(err.filename or dest))} is a file, where the pull needs a directory",
            "move that file away, or give --to a directory (or a new one's path) that is not "
            "under a file",
        ) from None
    except OSError as err:  # e.g. a parent of --to this user cannot search
        raise cannot(dest, err) from None


def place(
    run: str,
    dest: str,
    stage_dir: str,
    entries: List[Entry],
    home: Optional[str],
    durable: AbstractSet[str] = frozenset(),
) -> None:
    """Every verified temporary copy to its final name: fsynced (unless ``durable`` says it was
    already, after its last write), renamed, directories fsynced. The copies of bytes listed
    under a second name are made in the stage first, so that nothing after the old receipt is
    removed can run out of room but a rename; the old receipt goes before any rename, so no
    receipt ever describes a mix of two pulls; completeness markers are renamed last, so a
    pull cut midway never shows a checkpoint as complete whose files are not all there."""
    last: Dict[str, Entry] = {}
    for e in entries:
        last[e.stage] = e
    staged = {id(e): e.stage if last[e.stage] is e else f"{COPY}{i}" for i, e in enumerate(entries)}
    try:
        for e in entries:
            if last[e.stage] is not e:
                _copy_in_stage(stage_dir, e.stage, staged[id(e)])
        todo = [safe_join(stage_dir, s) for s in last if s not in durable]
        with ThreadPoolExecutor(HASHERS) as pool:
            list(pool.map(fsync_file, todo))
        remove_receipts(run, dest, home)
        dirs = set()
        # Renamed through directory descriptors walked from DEST without following symlinks:
        # a symlink planted since check_dest is refused, never written through.
        for e in sorted(entries, key=lambda e: _is_marker(e.path)):
            replace_beneath(stage_dir, staged[id(e)], dest, e.path)
            d = os.path.dirname(os.path.join(dest, *e.path.split("/")))
            while d.startswith(dest) and d not in dirs:
                dirs.add(d)
                d = os.path.dirname(d)
        for d in sorted(dirs, key=len, reverse=True):
            fsync_dir(d)
    except UnsafePath:
        raise
    except OSError as err:
        raise target_error(err, f"placing the pulled files in {dest}") from None


# The most files not covered named one by one in a receipt; the rest are counted.
MAX_NOT_COVERED = 100
# The directories a pull puts files in (controller/results/pull.py's layout): only these are
# looked through, as DEST may be a directory of the user's (--to .) with files of its own.
LAYOUT = ("checkpoints", "outputs", "logs")


def not_covered(dest: str, covered: AbstractSet[str]) -> List[str]:
    """The files and links under DEST's layout directories that are not in ``covered`` (this
    pull's final names and the links it made): an older pull's that this one did not replace
    (a checkpoint the job has since removed, a pull of nothing over a pull of files), or put
    there by hand. They stay where they are (a user's script may read them), but the receipt
    names them, so none looks as if this pull brought and verified it. Walked without
    following a symlink: a link is named itself."""
    out: List[str] = []
    for top in LAYOUT:
        root = os.path.join(dest, top)
        if not os.path.lexists(root):
            continue
        if os.path.islink(root) or not os.path.isdir(root):
            out.append(top)
            continue
        for dirpath, dirnames, files in os.walk(root):
            rel = os.path.relpath(dirpath, dest).replace(os.sep, "/")
            links = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
            for name in files + links:
                path = f"{rel}/{name}"
                if path not in covered:
                    out.append(path)
    out.sort()
    if len(out) > MAX_NOT_COVERED:
        out[MAX_NOT_COVERED:] = [f"and {len(out) - MAX_NOT_COVERED} more"]
    return out


def _is_marker(path: str) -> bool:
    """A file whose presence says its checkpoint directory is complete."""
    return posixpath.basename(path) in MARKERS


def _copy_in_stage(stage_dir: str, src_name: str, name: str) -> None:
    """The bytes of ``src_name`` again as ``name`` in the stage, fsynced."""
    unlink_beneath(stage_dir, name)  # a killed pull's
    src = open_beneath(stage_dir, src_name, os.O_RDONLY)
    with open(src, "rb") as fin:
        out = open_beneath(stage_dir, name, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        with open(out, "wb") as fout:
            shutil.copyfileobj(fin, fout, CHUNK)
            fout.flush()
            os.fsync(out)
