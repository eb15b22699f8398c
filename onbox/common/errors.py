"""The one error root of rgt, and the exit code each kind of error carries.

Every error a user can cause or fix is an ``RgtError``: it says what was wrong, why, and what
to do, and the CLI prints it as one line and exits with its code. Anything else that escapes is
a bug and is shown with its traceback.

    RgtError                      exit 1 (never raised bare)
    ├── UsageError                exit 2   bad flag, value, name, job file
    ├── RemoteUnreachable         exit 3   (controller) the box does not answer
    ├── AuthError                 exit 4   (controller) the box refused the ssh login
    ├── LockedError               exit 5   another agent holds the run
    ├── IntegrityError            exit 6   a record or checkpoint is corrupt
    │   └── CheckpointError       exit 6   (training API) a checkpoint will not load safely
    ├── UnsafeRefused             exit 7   a destructive step was refused
    ├── NotFound                  exit 8   no such run
    ├── HostError                 exit 9   the box cannot do it (unwritable dir, no /proc)
    ├── StopFailed                exit 10  processes of an attempt survived a stop
    ├── StoreError                exit 14  (stores) a durable store could not do it
    │   ├── TransientStoreError   exit 14  worth retrying: network, throttling, a 5xx
    │   ├── PermanentStoreError   exit 14  retrying cannot help: no bucket, ENOSPC, EACCES
    │   │   └── StoreAuthError    exit 14  the store refused the credentials (an AuthError too)
    │   └── PreconditionFailed    exit 14  a conditional write found another version
    ├── CheckpointWriteFailed     exit 15  (training API) a background checkpoint write failed
    ├── MeterRefused              exit 16  (controller) the provider's API refused the meter-stop
    ├── MeterUnresolved           exit 17  (controller) the meter-stop's outcome is not known
    ├── NotReconciled             exit 18  (controller) a sweep's cells are not all sealed+verified
    ├── SmokeFailed               exit 19  (controller) a check of `rgt smoke` failed
    ├── MeterNotSent              exit 20  (controller) the meter-stop was not sent: nothing changed
    ├── WrongStore                exit 21  (controller) the store has no trace of cells seen done
    ├── NotSealed                 exit 22  `rgt-agent sync`: the box's newest complete checkpoint
    │                                      is not sealed (changed while sealed, the store failed)
    └── WaitInterrupted           exit 130 a Ctrl-C (or SIGTERM) ended the command's wait; what it
                                           asked goes on (`rgt-agent stop` of a live run)

``StoreAuthError`` is both: ``except AuthError`` and ``except StoreError`` catch it, and it exits
14 as every store error does, whatever refused (exit 4 is the box's login only).

``rgt-agent run`` (foreground) maps the final state of the run to an exit code as well; see
``FINAL_EXIT_CODES``.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:  # the shim imports this module: typing would cost it ~2 MiB
    from typing import Optional


class RgtError(Exception):
    """Root of every error a user can act on. Subclasses set ``exit_code``."""

    exit_code = 1

    def __init__(self, what: str, remedy: Optional[str] = None) -> None:
        super().__init__(what)
        self.what = what
        self.remedy = remedy

    def line(self) -> str:
        """The one line the CLI prints."""
        return f"rgt: {self.what}" + (f" ({self.remedy})" if self.remedy else "")


class UsageError(RgtError):
    """A flag, a value or a job file is wrong; ``field`` names it."""

    exit_code = 2

    def __init__(self, field: str, problem: str, remedy: Optional[str] = None) -> None:
        super().__init__(f"{field}: {problem}", remedy)
        self.field = field
        self.problem = problem

    def in_file(self, path: str) -> UsageError:
        """This error as a setting of the file ``path``: its message names the file first
        (``path: field: problem``); ``field`` stays the setting's."""
        err = UsageError(self.field, self.problem, self.remedy)
        err.what = f"{path}: {err.what}"
        err.args = (err.what,)
        return err


class RemoteUnreachable(RgtError):
    """The box does not answer (controller side)."""

    exit_code = 3


class AuthError(RgtError):
    """Credentials were refused."""

    exit_code = 4


class LockedError(RgtError):
    """Another agent holds the run's lock; the message names the holder."""

    exit_code = 5


class IntegrityError(RgtError):
    """A record or checkpoint is corrupt or from a newer rgt."""

    exit_code = 6


class CheckpointError(IntegrityError):
    """The training API refuses to load a checkpoint: incomplete, altered, or not plain data."""


class UnsafeRefused(RgtError):
    """A destructive step was refused because it could lose work."""

    exit_code = 7


class NotFound(RgtError):
    """The named run does not exist."""

    exit_code = 8


class HostError(RgtError):
    """The box cannot do what was asked (a directory is not writable, /proc is missing)."""

    exit_code = 9


class StopFailed(RgtError):
    """A stop did not end with every process of the attempt gone."""

    exit_code = 10


class StoreError(RgtError):
    """A store could not do what was asked (onbox/sealing/stores: base.Store's contract)."""

    exit_code = 14


class TransientStoreError(StoreError):
    """Worth retrying: the network, throttling, a 5xx."""


class PermanentStoreError(StoreError):
    """Retrying cannot help: credentials, a missing bucket, a full or read-only disk."""


class StoreAuthError(PermanentStoreError, AuthError):
    """The store refused the credentials, or found none: an AuthError that is a store's, so
    sealing reports it as the store's refusal (not a bug) and it exits 14."""

    exit_code = 14


class PreconditionFailed(StoreError):
    """A conditional write found the key already there, or not at the version it was given."""


class CheckpointWriteFailed(RgtError):
    """A checkpoint the training API was writing in the background failed; raised in the
    training loop at its next call, never dropped."""

    exit_code = 15


class MeterRefused(RgtError):
    """The provider's API said no to the meter-stop (401, 403, another 4xx): nothing changed."""

    exit_code = 16


class MeterUnresolved(RgtError):
    """The meter-stop's outcome is not known (no answer, or the resource still listed when the
    poll gave up): the message says what to check in the provider's console."""

    exit_code = 17


class MeterNotSent(RgtError):
    """The meter-stop call was not sent: the provider's API could not be reached, or answered
    its show with an error or a page that tells nothing (a 5xx, a proxy's page), or the call
    never reached it. Nothing changed there; a later down sends it. Not MeterUnresolved (exit
    17): no call of rgt's is out whose outcome is unknown."""

    exit_code = 20


class NotReconciled(RgtError):
    """``rgt reconcile``: some cell of the sweep's roster is missing, failed, unverified, or
    claimed twice (controller/sweep/reconcile.py); the report lists each."""

    exit_code = 18


class SmokeFailed(RgtError):
    """``rgt smoke``: the first of its checks that failed (controller/smoke/); the message
    names the check and why, the remedy what to change in the job."""

    exit_code = 19


class WrongStore(RgtError):
    """``rgt sweep``: the store this laptop reads holds no trace of cells the sweep saw
    succeed there (not even the epoch each agent takes before its job starts): most likely not
    the store their boxes write to (a wrong bucket, prefix, endpoint or directory, a mount not
    there). Nothing is deployed: in the store its box writes to, each such run has its
    DONE.json, so its agent would refuse to train it again."""

    exit_code = 21


class NotSealed(RgtError):
    """``rgt-agent sync``: after the seal, the box holds a complete checkpoint newer than the
    store's LATEST (onbox/agent/synccheck.py); the message says which step, and why where the
    agent said it (it changed while it was sealed, the store failed). A sync again may seal it.
    A run whose sealing was frozen on purpose (a NaN loss) is UnsafeRefused (exit 7) instead:
    no sync can, nor should, seal it."""

    exit_code = 22


class WaitInterrupted(RgtError):
    """A person's Ctrl-C (or a SIGTERM) ended a command's wait for what it had asked, which goes
    on without it (`rgt-agent stop` of a live run: the agent carries the stop); 130, as a
    shell's Ctrl-C."""

    exit_code = 130


# Exit codes of `rgt-agent run` by final state, so a Slurm or Kubernetes wrapper can act on them.
FINAL_EXIT_CODES = {
    "SUCCEEDED": 0,
    "FAILED": 11,
    "STOPPED": 12,
    "PREEMPTED": 13,
}

# Exit codes that no retry can fix, for a scheduler's failure policy (a Kubernetes Job's
# podFailurePolicy FailJob, a Slurm requeue refused): bad input (2), credentials (4), a corrupt
# store (6), a refused unsafe action (7), a run FAILED by its policy (11: crash loop, NaN loss,
# error budget spent) and a run the user STOPPED (12). PREEMPTED (13) and everything else may
# succeed on a new pod or allocation.
PERMANENT_EXIT_CODES = (
    UsageError.exit_code,
    AuthError.exit_code,
    IntegrityError.exit_code,
    UnsafeRefused.exit_code,
    FINAL_EXIT_CODES["FAILED"],
    FINAL_EXIT_CODES["STOPPED"],
)


# The class of the tree that owns each exit code (UsageError, exit 2, needs a field: not here).
_BY_CODE = {
    c.exit_code: c
    for c in (
        RemoteUnreachable,
        AuthError,
        LockedError,
        IntegrityError,
        UnsafeRefused,
        NotFound,
        HostError,
        StopFailed,
        StoreError,
        CheckpointWriteFailed,
        MeterRefused,
        MeterUnresolved,
        NotReconciled,
        SmokeFailed,
        MeterNotSent,
        WrongStore,
        NotSealed,
        WaitInterrupted,
    )
}


def event_class(e: RgtError) -> str:
    """The ``class`` an event about ``e`` carries: integrity for a damaged record, transient
    for a store that may answer again, permanent for the rest (retrying cannot help)."""
    if isinstance(e, IntegrityError):
        return "integrity"
    return "transient" if isinstance(e, TransientStoreError) else "permanent"


def error_from_code(code: int, what: str, remedy: Optional[str] = None) -> RgtError:
    """An error another process reported by its exit code (the agent to ``rgt-agent start``),
    rebuilt as the tree's class for that code, so that it is caught and exits as what it is."""
    cls = _BY_CODE.get(code)
    if cls is not None:
        return cls(what, remedy)
    err = RgtError(what, remedy)
    err.exit_code = code if code > 0 else 1
    return err
