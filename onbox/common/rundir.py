"""The one owner of every path rgt writes on the box.

$RGT_HOME/                      RGT_HOME defaults to ~/.rgt
  runs/NAME/                    RGT_RUN_DIR
    spec.json                   the resolved JobSpec (atomic replace)
    state.json                  the run's state (atomic replace, the only writer is the agent)
    events.jsonl                every transition and decision, append-only
    agent.log                   the agent's own log
    lock                        flock'ed by the one agent; holds host, pid, start time
    stop.request                written by `rgt-agent stop` for a live agent
    sync.request                written by `rgt-agent sync`; removed once everything is sealed
    checkpoint.request          written by the agent to ask the job for a checkpoint (trigger
                                "file"; the training API watches it)
    verified/                   0700; the job's ranks' memos of the checkpoints one of them
                                hashed at resume, so the others need not (onbox/train/
                                rankverify.py): NAME.lock, NAME.json
    sealer.json                 the sealer's memory of in-place checkpoint sequences
    sealer-links.json           the sealer's memory of the checkpoint dir's links (last.ckpt)
    epoch.json                  the epoch this box's newest writer of the run took in the store
    logs-sealed.json            which attempts' logs are in the store, under which epoch
                                (onbox/agent/sealedlogs.py)
    staging/                    the sealer's copies of files it uploads (step-N/, logs/)
    attempts/NNNN/output.log    the job's stdout+stderr, unaltered
    attempts/NNNN/output.redacted.log   a copy with each secret masked, for `rgt pull`, when
                                the log holds one (a run without a store, once it ended)
    attempts/NNNN/job.json      written by the shim: the job's pid, start time, tag
    attempts/NNNN/exit.json     written by the shim: the job's exit status
    ckpt/                       default RGT_CKPT_DIR
  secrets/                      0700; secrets the job needs across restarts (controller)
    NAME                        the run's, 0600
    .NAME.staged                a deploy's for its start, until the start is claimed
"""

from __future__ import annotations

import os

from onbox.common import jobenv
from onbox.common.durable import make_dirs, remove_dirs
from onbox.common.errors import HostError, NotFound, UsageError

TYPE_CHECKING = False
if TYPE_CHECKING:  # the shim imports this module: typing would cost it ~2 MiB
    from typing import Dict, List, Mapping, Optional

NAME_PATTERN = "[a-z0-9][a-z0-9._-]{0,62}"
# The name under the run dir (RGT_RUN_DIR) of the agent's request for a checkpoint: the job's
# side (onbox.train) knows the run dir only as RGT_RUN_DIR.
CHECKPOINT_REQUEST = "checkpoint.request"
# While this file is in the run directory, the training API writes no new local checkpoint: the
# disk probe (onbox/health/disk.py) found the disk too full for one.
CHECKPOINT_HOLD = "checkpoint.hold"
# The directory under the run dir where the ranks of a job on one box record which checkpoint
# files one of them verified (onbox/train/rankverify.py), so that the others skip hashing them.
VERIFIED = "verified"
_FIRST = frozenset("abcdefghijklmnopqrstuvwxyz0123456789")
_REST = _FIRST | frozenset("._-")


def is_name(name: object) -> bool:
    """Whether ``name`` matches NAME_PATTERN and holds no "..": safe as a path component, in a
    URL, in a shell word. (No regex: the shim imports this and stays small.)"""
    return (
        isinstance(name, str)
        and 0 < len(name) <= 63
        and name[0] in _FIRST
        and all(c in _REST for c in name)
        and ".." not in name
    )


def check_name(name: str, field: str = "name") -> str:
    """Return ``name`` if it is a valid run name, else raise naming the pattern."""
    if not is_name(name):
        raise UsageError(
            field,
            f"{name!r} is not a valid run name",
            f"use {NAME_PATTERN}: lowercase letters, digits, '.', '_', '-', no '..'",
        )
    return name


def rgt_home(environ: Optional[Mapping[str, str]] = None) -> str:
    """$RGT_HOME, or ~/.rgt."""
    env = os.environ if environ is None else environ
    home = env.get(jobenv.HOME) or os.path.join(os.path.expanduser("~"), ".rgt")
    return os.path.abspath(home)


def profiles_dir(home: str) -> str:
    """The user's platform profiles under a home: ``$RGT_HOME/profiles`` on the box,
    ``$RGT_CONTROLLER_HOME/profiles`` on the laptop (onbox/profiles/load.py reads them)."""
    return os.path.join(home, "profiles")


class RunDir:
    """Paths of one run; creating it checks that the box lets us write there."""

    def __init__(self, name: str, home: Optional[str] = None) -> None:
        self.name = check_name(name)
        self.home = home or rgt_home()
        self.path = os.path.join(self.home, "runs", self.name)

    # ---- files
    @property
    def spec(self) -> str:
        return os.path.join(self.path, "spec.json")

    @property
    def state(self) -> str:
        return os.path.join(self.path, "state.json")

    @property
    def events(self) -> str:
        return os.path.join(self.path, "events.jsonl")

    @property
    def agent_log(self) -> str:
        return os.path.join(self.path, "agent.log")

    @property
    def lock(self) -> str:
        return os.path.join(self.path, "lock")

    @property
    def stop_request(self) -> str:
        return os.path.join(self.path, "stop.request")

    @property
    def sync_request(self) -> str:
        """Written by `rgt-agent sync`; the agent removes it once everything is sealed."""
        return os.path.join(self.path, "sync.request")

    @property
    def sealing_frozen(self) -> str:
        """Written by the agent when a training signal (a NaN loss) stopped the run: nothing
        newer than its step is sealed (onbox/agent/freeze.py)."""
        return os.path.join(self.path, "sealing-frozen.json")

    @property
    def checkpoint_request(self) -> str:
        """Written by the agent when the job asked to be told by a file (trigger "file")."""
        return os.path.join(self.path, CHECKPOINT_REQUEST)

    @property
    def sealer_state(self) -> str:
        """The sealer's memory of in-place checkpoint sequences (``ckpt.pt`` rewritten)."""
        return os.path.join(self.path, "sealer.json")

    @property
    def sealer_links(self) -> str:
        """The sealer's memory of the checkpoint dir's links seen leading to checkpoints not
        sealed yet (onbox/sealing/dirlinks.py ``Seen``)."""
        return os.path.join(self.path, "sealer-links.json")

    @property
    def epoch_record(self) -> str:
        """The epoch this box's newest writer of the run took (onbox/agent/ownership.py)."""
        return os.path.join(self.path, "epoch.json")

    @property
    def sealed_logs(self) -> str:
        """Which attempts' logs an agent sealed, into which store, under which epoch and at what
        size (onbox/agent/sealedlogs.py): the next agent seals only the others."""
        return os.path.join(self.path, "logs-sealed.json")

    @property
    def staging(self) -> str:
        """The sealer's copies of what may change while it uploads."""
        return os.path.join(self.path, "staging")

    @property
    def staged_logs(self) -> str:
        """Redacted copies of the job's logs on their way to the store."""
        return os.path.join(self.staging, "logs")

    @property
    def health(self) -> str:
        """The health wing's files: the samples' time series (onbox/health/series.py)."""
        return os.path.join(self.path, "health")

    @property
    def checkpoint_hold(self) -> str:
        """Present while the disk is too full for new local checkpoints (the disk probe writes
        it; the training API reads it before a save)."""
        return os.path.join(self.path, CHECKPOINT_HOLD)

    @property
    def attempts(self) -> str:
        return os.path.join(self.path, "attempts")

    def attempt_dir(self, attempt: int) -> str:
        return os.path.join(self.attempts, f"{attempt:04d}")

    def stacks(self, attempt: int) -> str:
        """Every thread's Python stack of the attempt's processes, dumped at a stall."""
        return os.path.join(self.attempt_dir(attempt), "stacks.txt")

    def output_log(self, attempt: int) -> str:
        return os.path.join(self.attempt_dir(attempt), "output.log")

    def redacted_log(self, attempt: int) -> str:
        """The copy of ``output_log`` with each secret masked (onbox/agent/sealservice.py writes
        it)."""
        return os.path.join(self.attempt_dir(attempt), "output.redacted.log")

    def redacted_log_tmp(self, attempt: int) -> str:
        """Where ``redacted_log`` is written before it is renamed into place (a hidden name)."""
        return os.path.join(self.attempt_dir(attempt), ".output.redacted.log.tmp")

    @property
    def secrets_file(self) -> str:
        """The job's secrets (JSON {VAR: value}, 0600), outside the run directory so that no
        copy of the run (logs, the store's mirror) can carry them."""
        return os.path.join(self.home, "secrets", self.name)

    @property
    def staged_secrets_file(self) -> str:
        """Secrets a deploy stored for the start that comes next (``rgt-agent secrets N
        --for-start``): they become ``secrets_file`` only once that start is claimed, so a
        refused start never replaces the run's own (a hidden name: no run's begins with '.')."""
        return os.path.join(self.home, "secrets", f".{self.name}.staged")

    def job_record(self, attempt: int) -> str:
        return os.path.join(self.attempt_dir(attempt), "job.json")

    def exit_record(self, attempt: int) -> str:
        return os.path.join(self.attempt_dir(attempt), "exit.json")

    def attempt_numbers(self) -> List[int]:
        """Attempts that have a directory, oldest first."""
        try:
            names = os.listdir(self.attempts)
        except FileNotFoundError:
            return []
        return sorted(int(n) for n in names if n.isdigit())

    def exists(self) -> bool:
        return os.path.isfile(self.spec)

    def require(self) -> RunDir:
        if not self.exists():
            raise NotFound(f"no run named {self.name!r} under {self.home}", "see `rgt-agent list`")
        return self

    _UNWRITABLE = "set RGT_HOME to a writable directory on the box's local disk"

    def check(self) -> None:
        """Raise HostError when the run directory could not be made or written; makes nothing
        (``start`` checks everything before it creates anything)."""
        why = unwritable(self.path)
        if why:
            raise HostError(f"run directory {self.path} is not writable: {why}", self._UNWRITABLE)

    def create(self) -> List[str]:
        """Make the run directory and attempts/ (0700, each missing parent up to RGT_HOME too)
        and prove it is writable; the directories it made, for ``remove_dirs``. On HostError
        it has removed them again."""
        created: List[str] = []
        try:
            created = make_dirs(self.attempts)
            probe = os.path.join(self.path, f".write-probe.{os.getpid()}")
            with open(probe, "wb") as f:
                f.write(b"ok")
            os.unlink(probe)
        except OSError as e:
            remove_dirs(created)
            raise HostError(
                f"run directory {self.path} is not writable: {e.strerror}", self._UNWRITABLE
            ) from None
        return created


def unwritable(path: str) -> Optional[str]:
    """Why the directory ``path`` could not be made or written into, or None when it looks
    possible; creates nothing. (Only making it can prove it: /proc answers access() yes.)"""
    p = os.path.abspath(path)
    while not os.path.lexists(p):
        p = os.path.dirname(p)
    if not os.path.isdir(p):
        return f"{p} is not a directory"
    if os.access(p, os.W_OK | os.X_OK):
        return None
    try:
        if os.statvfs(p).f_flag & os.ST_RDONLY:
            return f"{p} is on a read-only file system"
    except OSError:
        pass
    return f"{p} is not writable by this user (uid {os.getuid()})"


def drop_secrets(path: str) -> bool:
    """The secrets file ``path`` (a ``RunDir.secrets_file``) removed; True when there was one."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def read_secrets(path: str) -> Dict[str, str]:
    """The secrets in ``path`` (a ``RunDir.secrets_file``): {} when there is none. Read without
    following a symlink; OSError when the file is readable by others or is not a JSON object of
    strings. The one reader, for the job's environment (the shim) and the store's credentials
    (onbox.sealing.stores.open_box_store)."""
    import json

    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return {}
    try:
        if os.fstat(fd).st_mode & 0o077:
            raise OSError(0, f"{path} is readable by others; chmod 600 it")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read()
    finally:
        os.close(fd)
    try:
        secrets = json.loads(data)
    except ValueError:
        raise OSError(0, f"{path} is not a JSON object of strings") from None
    if not isinstance(secrets, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in secrets.items()
    ):
        raise OSError(0, f"{path} is not a JSON object of strings")
    return secrets


def all_runs(home: Optional[str] = None) -> List[RunDir]:
    """Every run under RGT_HOME, by name."""
    home = home or rgt_home()
    try:
        names = sorted(os.listdir(os.path.join(home, "runs")))
    except FileNotFoundError:
        return []
    runs = []
    for n in names:
        try:
            rd = RunDir(n, home)
        except UsageError:  # a stray directory with a name rgt would never make
            continue
        if rd.exists():
            runs.append(rd)
    return runs
