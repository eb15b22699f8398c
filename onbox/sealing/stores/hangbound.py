"""A bound on the calls of a store that may block far longer than a user waits: on a ``file://``
store a read of its LATEST, a listing, the epoch's put, on a mount whose server stopped answering
(NFS, a FUSE daemon), for ever; on an S3 store whose server or network stopped answering, for
botocore's 4 tries of its 60 s read timeout (241 s measured on a SIGSTOPped SeaweedFS), and for
five times that under base.with_retries; on an ``hf://`` store whose Hub stopped answering, for
ever (huggingface_hub gives its API requests no timeout). The downloads have their own bound
(onbox/sealing/stall.py); this is for the calls before them, which `rgt-agent start` makes in its
main thread (the store's check before the run is claimed, onbox/agent/claim.py; the beginning's
epoch, stale uploads, ledger, history and restore's reads, onbox/agent/sealservice.py; from then
on, for good, every such call of the agent: its sealing thread's, and as it lets go of the run its
mirror's and its seals', in a preemption within what is left of the grace), and for
the commands that read a store and download nothing or download after them (`rgt-agent restore`
and `checkpoints`, onbox/cli.py; every laptop read of a run's store, controller/runstore.py),
which otherwise held the user's terminal as long.

While ``calls_bounded(seconds)`` is entered (or for good after ``bound_calls``), a call marked
``@answers("reading {}")`` runs in a daemon thread, waited for in SIGNAL_POLL cuts (a signal's
handler runs meanwhile: SIGTERM still interrupts a beginning); one that has not returned within
the bound raises ``StoreHung`` (transient, exit 14) and is left. Left, such a call can do no harm:
a daemon does not keep the process from exiting, and if the store answers first, what the call
was doing completes as a killed writer's would (a document is renamed into place, or an S3 object
put, whole or not at all; an epoch created and not recorded is taken as this box's by
onbox/agent/ownership.py; a temporary file or a preflight probe is removed or left as a killed
one is). While a call is still hung the next fails at once (its error names it, and the call
still hung), and base.with_retries does not retry a StoreHung: the user waits the bound once,
not the bound and every backoff. Outside it, or for a call not marked, nothing changes.

The uploads of files (a checkpoint's, onbox/sealing/upload.py; the completion seal's and the
logs', ``watched``) are not bounded so: a big checkpoint's may take far longer than the bound
and still be moving. Where a store says how its uploads move (``watches_uploads``: it adds to
``sent`` as each piece is taken, 1 MiB of a file:// copy or of its disk's writes before the
fsync (filecopy.py, onbox/common/writeback.py ``settle``), an S3 part or small object, 64 KiB
of a file huggingface_hub reads to send to the Hub: hfmoved.py; and ``movement`` may add what
else it sees move, an S3 store its connections' bytes: s3/tcpmoved.py), they are cut once
nothing moved for the bound instead (onbox/sealing/stall.py ``Stall``), as a restore's
downloads are: ``upload_stalled`` (a StoreHung), the upload's threads left as a hung call is.
The grain is what a store slower than it is cut at (1 MiB per 5 min is 3.5 KB/s). What no
counter sees, a file:// fsync's last flush once its data is written, an S3 server's work on a
CompleteMultipartUpload while it sends nothing, is bounded by the same bound: a server silent
that long is not told from a hung one.
While one of them is still hung, the next upload is refused at once (``refuse_upload``), so an
agent letting go waits the bound once, not once per upload. A left upload must therefore end
once the store answers again, or sealing stays off: an S3 one does at botocore's timeouts, an
``hf://`` one at the timeout the store gives huggingface_hub's client (hfmoved.py
``bound_idle_requests``).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from typing import Any, Callable, Iterator, List, Optional, Tuple, TypeVar, cast

from onbox.common.errors import TransientStoreError
from onbox.sealing.stall import STALL_SETTING, Stall, took

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")
# How often the waiting thread wakes to run the handlers of signals a worker took for it (as
# onbox/sealing/fetch.py SIGNAL_POLL).
SIGNAL_POLL = 0.2


class StoreHung(TransientStoreError):
    """A store's call did not return within its bound (``HangBound.calls_bounded``)."""


class HangBound:
    """The bound, for a Store class whose calls may hang (mixed in before ``Store``); ``hangs``
    and ``to_check`` say, in its error, what hangs and what to look at."""

    url: str
    hangs = "the mount under it hangs"
    # No parentheses in the remedy (to_check and _remedy): the CLI's line puts it in a pair.
    to_check = "check the mount and its server, NFS or a FUSE daemon"
    _bound: Optional[float] = None
    _longer = STALL_SETTING  # how a user gives the store longer, for the error
    _hung: Optional[Tuple[str, float]] = None  # (what, bound) of a call left past its bound
    _left: Optional[threading.Thread] = None
    # The uploads' movement (the class docstring): what the store has taken so far, in pieces;
    # only read for a change. An upload cut as stalled: (what, bound, its threads).
    watches_uploads = False
    sent = 0
    _stuck: Optional[Tuple[str, float, List[threading.Thread]]] = None

    @contextlib.contextmanager
    def calls_bounded(self, seconds: float, longer: str = STALL_SETTING) -> Iterator[None]:
        """Each call marked ``@answers`` made meanwhile gives up after ``seconds``; its error
        says ``longer`` (the setting that gives the store longer)."""
        was = self._bound, self._longer
        self.bound_calls(seconds, longer)
        try:
            yield
        finally:
            self._bound, self._longer = was

    def bound_calls(self, seconds: float, longer: str = STALL_SETTING) -> None:
        """As ``calls_bounded``, for the rest of this store's life."""
        self._bound, self._longer = seconds, longer

    def _within(self, bound: float, what: str, fn: Callable[[], Any]) -> Any:
        left = self._left
        if left is not None and left.is_alive() and self._hung is not None:
            raise self._refused(what, *self._hung)
        t, done, out = _worker(fn, "rgt-store-call")
        t.start()
        deadline = time.monotonic() + bound
        while not done.wait(SIGNAL_POLL):
            if time.monotonic() >= deadline:
                self._left, self._hung = t, (what, bound)
                raise self._hung_error(bound, what)
        return _result(out)

    def moved(self) -> None:
        """A piece of an upload was taken by the store."""
        self.sent += 1  # racy between threads, and harmless: only a change is looked for

    def movement(self) -> object:
        """What the uploads' watch compares (any change is movement): the pieces taken, and
        where a store can see more of its own progress (S3: its connections' bytes), that."""
        return self.sent

    def upload_bound(self) -> Optional[float]:
        """How long an upload may move nothing (the calls' bound), or None: not watched."""
        return self._bound if self.watches_uploads else None

    def upload_stalled(self, what: str, bound: float, threads: List[threading.Thread]) -> StoreHung:
        """The error of an upload that moved nothing for ``bound``, its ``threads`` left."""
        self._stuck = (what, bound, threads)
        return StoreHung(
            f"{self.url} took nothing for {took(bound)} ({what}): {self.hangs}; nothing of it "
            "was put in place",
            self._remedy(),
        )

    def refuse_upload(self, what: str) -> None:
        """StoreHung, at once, while an upload cut as stalled is still hung."""
        stuck = self._stuck
        if stuck is not None and any(t.is_alive() for t in stuck[2]):
            raise self._refused(what, stuck[0], stuck[1])

    def watched(self, what: str, fn: Callable[[], T]) -> T:
        """``fn``, one upload (``what``), cut once the store took nothing of it for the
        bound (``upload_bound``; not watched: run as it is)."""
        bound = self.upload_bound()
        if bound is None:
            return fn()
        self.refuse_upload(what)
        t, done, out = _worker(fn, "rgt-store-upload")
        stall = Stall(bound, self.movement, lambda: self.upload_stalled(what, bound, [t]))
        t.start()
        while not done.wait(SIGNAL_POLL):
            stall.check()
        return cast(T, _result(out))

    def _hung_error(self, bound: float, what: str) -> StoreHung:
        return StoreHung(
            f"{self.url} did not answer for {took(bound)} ({what}): {self.hangs}; nothing was "
            "put in place",
            self._remedy(),
        )

    def _refused(self, what: str, hung: str, bound: float) -> StoreHung:
        """The error of a call not made (``what``) because an earlier one (``hung``) is still
        running past its ``bound``: it names both, the refused call first, as what was not
        done (the hung call's own error was said to its caller)."""
        return StoreHung(
            f"{self.url} was not asked ({what}): an earlier call ({hung}) is still hung, past "
            f"its bound of {took(bound)}: {self.hangs}; nothing was put in place",
            self._remedy(),
        )

    def _remedy(self) -> str:
        return (
            f"{self.to_check}, then try again; a store that slow can be given longer: "
            f"{self._longer}"
        )


def _worker(
    fn: Callable[[], Any], name: str
) -> Tuple[threading.Thread, threading.Event, List[Any]]:
    """A daemon thread (not started) that runs ``fn`` once: (it, set when done, its outcome
    for ``_result``)."""
    out: List[Any] = []
    done = threading.Event()

    def run() -> None:
        try:
            out.append((True, fn()))
        except BaseException as e:  # raised in the waiting thread
            out.append((False, e))
        finally:
            done.set()

    return threading.Thread(target=run, name=name, daemon=True), done, out


def _result(out: List[Any]) -> Any:
    """What ``_worker``'s ``fn`` returned, or what it raised, raised here."""
    ok, value = out[0]
    if not ok:
        raise value
    return value


def answers(what: str, whole: bool = False) -> Callable[[F], F]:
    """Mark a method of a HangBound store as bounded while ``calls_bounded``: ``what`` says
    the call in an error (``{}``: its first argument); ``whole``: it returns an iterator,
    then read whole in the worker (a listing)."""

    def mark(method: F) -> F:
        @functools.wraps(method)
        def call(self: HangBound, *args: Any, **kwargs: Any) -> Any:
            bound = self._bound
            if bound is None:
                return method(self, *args, **kwargs)
            if whole:
                got = self._within(bound, what.format(*args), lambda: list(method(self, *args)))
                return iter(got)
            return self._within(bound, what.format(*args), lambda: method(self, *args, **kwargs))

        return cast(F, call)

    return mark


def watched(store: object, what: str, fn: Callable[[], T]) -> T:
    """``HangBound.watched`` where ``store`` is one; else ``fn()``."""
    return store.watched(what, fn) if isinstance(store, HangBound) else fn()


def upload_bound(store: object) -> Optional[float]:
    """``HangBound.upload_bound`` where ``store`` is one; else None."""
    return store.upload_bound() if isinstance(store, HangBound) else None


def refuse_upload(store: object, what: str) -> None:
    """``HangBound.refuse_upload`` where ``store`` is one."""
    if isinstance(store, HangBound):
        store.refuse_upload(what)
