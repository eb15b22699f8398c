"""The transports of a pull, each into the staged copies and each saying when a file is done:
from the store (its own client), from the box with one rsync (``--inplace``, resumable), or,
without rsync on one end, a stream of ``tail -c +N`` over ssh (resumable too)."""

from __future__ import annotations

import concurrent.futures
import functools
import os
import re
import shutil
import subprocess
import threading
from typing import Callable, List, Optional, Protocol, Tuple

from controller.capture import ERR_HEAD, ERR_TAIL, Kept, drain
from controller.children import Child
from controller.remote import Remote, rsync_e
from controller.results.entries import FILES_FROM, Entry, Sealed, box_join, stage_dirs, stage_path
from onbox.common.errors import (
    HostError,
    IntegrityError,
    RemoteUnreachable,
    StoreError,
    UsageError,
)
from onbox.common.safepath import open_beneath
from onbox.common.storeurl import RESTORE_STALL
from onbox.sealing.fetch import in_parallel
from onbox.sealing.stall import RestoreStalled, Stall, stage_marks, took
from onbox.sealing.stores.base import Lanes, Store, target_error, with_retries

CHUNK = 8 << 20


class Finished(Protocol):
    """What a transport calls once it has written an entry's copy completely (not verified
    yet): with the sha256 of the bytes it wrote, when it hashed them as it wrote them and
    fsynced the copy (a store's download), else None (the checker hashes and fsyncs it)."""

    def __call__(self, e: Entry, sha256: Optional[str] = None) -> None: ...


def fetch_store(
    store: Store,
    items: List[Entry],
    stage_dir: str,
    finished: Finished,
    stall: float = RESTORE_STALL,
) -> int:
    """Each entry from the store by its key, as the agent's restore downloads a checkpoint
    (onbox/sealing/fetch.py ``in_parallel``): several files at once and their requests in
    shared lanes, one GET for a file the MANIFEST says is small (a HEAD first would double the
    requests of a checkpoint of many small objects), ranged GETs for a large one, each file
    hashed while it is written and fsynced once; handed to ``finished`` with that hash. The
    first failure stops the others and is raised once none is running. A download that moves
    nothing for ``stall`` seconds (a store gone silent mid-body, which its client's timeouts
    may wait on for long, or a hung mount for ever) ends as RestoreStalled (exit 14)."""

    def job(e: Entry) -> Callable[[Lanes], None]:
        assert e.key is not None
        key, tmp = e.key, stage_path(stage_dir, e)

        def run(lanes: Lanes) -> None:
            def attempt() -> Optional[str]:
                if lanes.stopped:  # another file failed: no retry, no new download
                    raise concurrent.futures.CancelledError()
                return store.fetch_file(key, tmp, size=e.size, lanes=lanes)  # creates it, O_EXCL

            stage_dirs(stage_dir, e)
            try:
                sha256 = with_retries(attempt, sleep=lanes.pause)
            except IntegrityError as err:
                if type(err) is not IntegrityError:  # UnsafePath and the like say it themselves
                    raise
                raise IntegrityError(  # another size than sealed: refused before it was fetched
                    f"{e.path} ({e.origin}): {err.what}. Nothing was put in place and no "
                    "receipt was written",
                    "the copy at the source is damaged: try the other source, --from box or "
                    "--from store",
                ) from None
            finished(e, sha256)

        return run

    store.plan_fetch({e.key: e.size for e in items if e.key is not None})
    marks = functools.partial(stage_marks, stage_dir)
    in_parallel([job(e) for e in items], stall=Stall(stall, marks, lambda: _stalled(store, stall)))
    return sum(e.size for e in items)


def _stalled(store: Store, bound: float) -> RestoreStalled:
    """The error of a pull from ``store`` that moved nothing for ``bound`` seconds."""
    return RestoreStalled(
        f"{store.url} sent nothing for {took(bound)}: it stopped answering mid-download. "
        "Nothing was put in place and no receipt was written",
        # No parentheses of its own: the CLI's line puts the whole remedy in a pair.
        "check the store and the way to it: the network, a stopped server, a hung mount; then "
        "pull again: it keeps the files already verified and downloads the rest whole. A store "
        "that is slow, not stopped, can be given longer: rgt pull --stall S, or the job file's "
        "[store] stall",
    )


_LINE_MAX = 64 << 10
_XFER = re.compile(rb"rgt-xfer (\d+) (.*)\Z")
_ESCAPE = re.compile(rb"\\#([0-7]{3})")


def _rsync_name(raw: bytes) -> bytes:
    """A file name as rsync logs it, unescaped: rsync writes each byte it will not print as it
    is (a control character; a byte outside ASCII, unless the locale prints it; the backslash of
    a ``\\#ddd`` in the name) as ``\\#`` and three octal digits."""
    return _ESCAPE.sub(lambda m: bytes([int(m.group(1), 8)]), raw)


def fetch_rsync(
    remote: Remote,
    root: str,
    items: List[Entry],
    stage_dir: str,
    bwlimit: Optional[int],
    finished: Finished,
) -> int:
    """One rsync for every file: --inplace into its temporary name, so a killed transfer
    leaves its bytes there and the next one sends only the rest (delta against them).

    rsync's receiver takes one file at a time: once it has received a file, it logs it
    (``--out-format``), and only then closes it and sets its mtime; a file that fails rsync's
    own check is received again later, and logged again. So a file is handed to ``finished``
    once rsync has logged another file after it, or has exited: then rsync is done with it,
    unless it logs it again (then it is handed over again)."""
    listing = os.path.join(stage_dir, FILES_FROM)
    fd = open_beneath(stage_dir, FILES_FROM, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    with open(fd, "wb") as f:
        f.write(b"\0".join(e.src.encode("utf-8", "surrogateescape") for e in items if e.src))
    by_name = {e.src.encode("utf-8", "surrogateescape"): e for e in items if e.src}
    # No file larger than the largest sealed one is taken: a box cannot fill this disk.
    largest = max([e.size for e in items if e.src] or [0])
    # -L: a declared output that is itself a link to a file is listed, hashed and pulled as
    # that file, as the stream's `tail` reads it (without -L rsync skipped it: "missing");
    # every other name listed is a regular file, and one swapped for a link since fails its
    # sha256.
    argv = [
        "rsync", "-s", "-t", "-L", "--inplace", "--partial", "--no-whole-file",
        "--from0", f"--files-from={listing}", "--out-format=rgt-xfer %b %n",
        f"--max-size={max(largest, 1)}",
    ]  # fmt: skip
    if bwlimit:
        argv.append(f"--bwlimit={int(bwlimit)}")
    shell = remote.rsync_shell()
    if shell:
        argv += ["-e", rsync_e(shell)]
    argv += [remote.path_arg(root.rstrip("/") + "/"), stage_dir + "/"]
    p = Child(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout is not None and p.stderr is not None
    # The box's words (its rsync's messages, its login shell's) come on stderr: a bounded
    # head and tail of them is kept, never all.
    errors = Kept(ERR_HEAD, ERR_TAIL)
    stderr, stdout = p.stderr, p.stdout
    drainer = threading.Thread(target=drain, args=(stderr, errors), daemon=True)
    drainer.start()
    fetched = 0
    pending: Optional[Entry] = None
    try:
        # rsync flushes each line as it logs it; a line longer than any it logs (a name is
        # at most PATH_MAX) is read in pieces, none of which matches.
        for line in iter(lambda: stdout.readline(_LINE_MAX), b""):
            m = _XFER.match(line.rstrip(b"\n"))
            if m is None:
                continue
            fetched += int(m.group(1))
            e = by_name.get(_rsync_name(m.group(2)))
            if e is None:
                continue
            if pending is not None and pending is not e:
                finished(pending)
            pending = e
    except BaseException:
        p.kill()
        raise
    finally:
        p.stdout.close()
        rc = p.wait()
        drainer.join()
        stderr.close()
    err = errors.value()
    if rc in (0, 23, 24):  # 23/24: some files missing; verification names them
        if pending is not None:
            finished(pending)
        return fetched
    raise _rsync_failed(remote, rc, err, bool(shell))


def box_has_rsync(remote: Remote) -> bool:
    """Whether the box has an rsync for a pull to run. Asked of the box's /bin/sh: the rsync a
    pull starts is found on the same PATH, but its absence is said by the login shell, each
    its own way (zsh "command not found: rsync", fish "Unknown command: rsync", tcsh "rsync:
    Command not found."), so rsync's failure cannot tell a missing rsync from a broken pull."""
    return remote.sh("command -v rsync >/dev/null 2>&1", timeout=60).rc == 0


def _rsync_failed(remote: Remote, rc: int, err: bytes, shell: bool) -> Exception:
    """The error for rsync's exit ``rc`` with its stderr ``err``."""
    if shell:
        remote.check_transport(rc, err)
    lines = err.decode("utf-8", "replace").strip().splitlines()
    # rsync's sender often has the last word ("Broken pipe") where the receiver's is the cause.
    cause = [ln for ln in lines if "[receiver]" in ln or "No space left" in ln]
    last = cause[:1] or lines[-1:] or [""]
    if rc in (10, 12, 30, 35):
        return RemoteUnreachable(
            f"rsync from {remote.target.label} broke off (exit {rc}): {last[0]}",
            "run the pull again: it continues where it stopped",
        )
    return HostError(f"rsync from {remote.target.label} failed (exit {rc}): {last[0]}")


def fetch_stream(
    remote: Remote,
    root: str,
    items: List[Entry],
    stage_dir: str,
    finished: Finished,
) -> int:
    """Without rsync on one end: ``tail -c +N`` over ssh appends what the partial copy lacks."""
    fetched = 0
    for e in items:
        assert e.src is not None
        try:
            got, rc = _stream_one(remote, root, e, stage_dir)
        except OSError as err:  # this machine's disk refused it (full, read-only)
            raise target_error(err, f"writing {e.origin} into {stage_dir}") from None
        fetched += got
        if rc is None:  # the copy already had every sealed byte
            continue
        if rc != 0:
            remote.check_transport(rc, b"")
            raise HostError(f"reading {e.origin} on {remote.target.label} failed (exit {rc})")
        finished(e)
    return fetched


def _stream_one(remote: Remote, root: str, e: Entry, stage_dir: str) -> Tuple[int, Optional[int]]:
    """(bytes fetched, the remote reader's exit code; None when nothing was missing) of one
    file into its staged copy. No more than its sealed size is written: a box that sends more
    (a file grown since, or a hostile one) cannot fill this disk; verification judges the
    bytes, and the reader cut off once they are all here counts as done."""
    assert e.src is not None
    stage_dirs(stage_dir, e)
    # The partial copy a killed pull left is appended to; a new one is created O_EXCL. Both
    # O_NOFOLLOW, through directories walked without following symlinks.
    try:
        fd = open_beneath(stage_dir, e.stage, os.O_WRONLY | os.O_APPEND)
    except FileNotFoundError:
        fd = open_beneath(stage_dir, e.stage, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL)
    fetched = 0
    with open(fd, "ab") as out:
        have = os.fstat(fd).st_size
        if have > e.size:
            os.ftruncate(fd, 0)
            have = 0
        if have == e.size:
            return 0, None
        p = remote.popen(["tail", "-c", f"+{have + 1}", "--", box_join(root, e.src)])
        assert p.stdout is not None
        left = e.size - have
        cut = False
        try:
            while left > 0:
                b = p.stdout.read(min(CHUNK, left))
                if not b:
                    break
                out.write(b)
                fetched += len(b)
                left -= len(b)
        except BaseException:  # (a Ctrl-C: the ssh is out of the terminal's reach, children.py)
            cut = True
            raise
        finally:
            if left == 0 or cut:
                p.kill()  # by its PID; the rest, if any, is not the sealed file's
            p.stdout.close()
            rc = p.wait()
    return fetched, 0 if left == 0 else rc


def fetcher(
    sealed: Sealed,
    stage_dir: str,
    bwlimit: Optional[int],
    transport: Optional[str],
    remote: Optional[Remote],
    finished: Finished,
    stall: float = RESTORE_STALL,
) -> Callable[[List[Entry]], int]:
    """The fetch of a list of entries into their staged copies (the bytes fetched), from where
    ``sealed`` says they are; each file handed to ``finished`` once its transport is done. A
    download from the store that moves nothing for ``stall`` seconds ends (fetch_store)."""
    if sealed.source == "store":
        assert sealed.store is not None
        store = sealed.store
        return lambda items: fetch_store(store, items, stage_dir, finished, stall) if items else 0
    assert remote is not None and sealed.box_root is not None
    box = _box_fetcher(remote, sealed.box_root, stage_dir, bwlimit, transport, finished)
    if sealed.store is None:
        return box
    store = sealed.store

    def mixed(items: List[Entry]) -> int:
        """From the box, but the entries without a box path (redacted logs) from the store."""
        n = box([e for e in items if e.src is not None])
        for e in items:
            if e.src is not None:
                continue
            try:
                n += fetch_store(store, [e], stage_dir, finished, stall)
            except StoreError as err:
                raise StoreError(
                    f"{e.path} is sealed as a redacted copy ({e.key} in {store.url}) because "
                    f"the job's log on the box holds a secret, and that copy cannot be read: "
                    f"{err.what}. Nothing was put in place and no receipt was written",
                    (err.remedy + "; " if err.remedy else "")
                    + "check the laptop's access to the store and pull again (rgt never "
                    "pulls the box's raw log in its place)",
                ) from None
        return n

    return mixed


def _box_fetcher(
    remote: Remote,
    root: str,
    stage_dir: str,
    bwlimit: Optional[int],
    transport: Optional[str],
    finished: Finished,
) -> Callable[[List[Entry]], int]:
    """From the box (``root``: the directory the entries' ``src`` is relative to), by rsync or
    by stream (``transport``, see ``rgt pull``)."""
    if transport is None:
        transport = "auto" if shutil.which("rsync") else "stream"
    if transport in ("rsync", "auto"):
        forced = transport == "rsync"
        mode = ["rsync?"]

        def fetch(items: List[Entry]) -> int:
            if not items:
                return 0
            if mode[0] == "rsync?":  # asked once, before the first rsync
                mode[0] = "rsync" if box_has_rsync(remote) else "stream"
                if mode[0] == "stream" and forced:
                    raise HostError(
                        f"{remote.target.label} has no rsync", "install it, or pull without it"
                    )
            if mode[0] == "rsync":
                return fetch_rsync(remote, root, items, stage_dir, bwlimit, finished)
            return fetch_stream(remote, root, items, stage_dir, finished)  # tail over ssh

        return fetch
    if transport == "stream":
        return lambda items: fetch_stream(remote, root, items, stage_dir, finished) if items else 0
    raise UsageError("transport", f"{transport!r} is not rsync or stream")
