"""The laptop's memory of each run: where it went and how to reach it, so that later commands
need only the run's name.

One JSON file, ``$RGT_CONTROLLER_HOME/runs.json`` (default ``~/.config/rgt``), replaced
atomically under an flock, so two rgt commands at once never lose a record. It holds no
secrets: only the target, the profile, the store (its URL, endpoint and stall) and paths on the
box. A file that does not parse is reported as corrupt (exit 6), never read as empty nor
overwritten.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fcntl
import os
import time
from typing import Any, Dict, Iterator, List, Optional

from controller.remote import controller_home
from controller.target import Target
from onbox.common import jobenv, jsondoc
from onbox.common.durable import make_dirs, write_json
from onbox.common.errors import IntegrityError, NotFound
from onbox.common.rundir import check_name


@dataclasses.dataclass
class RunRecord:
    """One deployed run, as the laptop remembers it."""

    name: str
    target: Target
    profile: str = "generic-ssh"
    store: Optional[str] = None
    # Where the box reads and writes that store, so the laptop opens it there too (runstore.py):
    # the job file's [store] endpoint_url (s3:// only) and stall (seconds). Records written
    # before these fields load with None (boto3's endpoint, the default stall).
    store_endpoint_url: Optional[str] = None
    store_stall: Optional[float] = None
    box_home: str = ""  # RGT_HOME on the box (absolute)
    agent: List[str] = dataclasses.field(default_factory=list)  # argv of rgt-agent on the box
    agent_env: Dict[str, str] = dataclasses.field(default_factory=dict)  # e.g. PYTHONPATH
    release: Optional[str] = None  # the content hash of the code the run started from
    workdir: Optional[str] = None  # the release directory the job runs in
    instance: Optional[str] = None  # the provider's id of the box (rgt deploy --instance)
    # The scheduler that runs the agent, when one does: {"kind": "slurm", "job": ID, ...}
    # (controller/slurm/submit.py); {} for a run the agent was started on directly.
    scheduler: Dict[str, Any] = dataclasses.field(default_factory=dict)
    created: float = dataclasses.field(default_factory=time.time)
    updated: float = dataclasses.field(default_factory=time.time)
    # When `rgt down` took the run off its box and stopped the meter, keeping this record for
    # the run's store, which outlives the box (controller/results/settle.py); None while the
    # run is on its box. Absent from a record written before it: read as None.
    down_at: Optional[float] = None

    def to_json(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        d["target"] = self.target.to_json()
        return d

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> RunRecord:
        fields = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in fields}
        kw["target"] = Target.from_json(d["target"])
        return cls(**kw)

    def taken_down(self) -> str:
        """When ``rgt down`` took the run off its box, as shown ("" while it is on one)."""
        if self.down_at is None:
            return ""
        when = datetime.datetime.fromtimestamp(self.down_at, datetime.timezone.utc)
        return f"taken down at {when.isoformat(timespec='seconds')}"

    def check_on_box(self, what: str) -> None:
        """NotFound (exit 8) when the run was taken down: ``what`` (a command) would reach a
        box that holds nothing of it, and may be gone; only the store has the run now."""
        if self.down_at is None:
            return
        raise NotFound(
            f"run {self.name} was {self.taken_down()} (rgt down): nothing of it is left on "
            f"{self.target.label}, which may be gone, so {what} has nothing to reach",
            f"its store {self.store} has what it sealed: rgt pull {self.name} fetches it, "
            f"rgt status {self.name} reads it",
        )

    def agent_argv(self, *args: str) -> List[str]:
        """argv that runs ``rgt-agent ARGS`` on the box for this run."""
        env = {jobenv.HOME: self.box_home, **self.agent_env}
        return ["env", *[f"{k}={v}" for k, v in env.items()], *self.agent, *args]


class Registry:
    """Load, change and save run records; every change is atomic and serialised."""

    def __init__(self, home: Optional[str] = None) -> None:
        self.home = home or controller_home()
        self.path = os.path.join(self.home, "runs.json")

    @contextlib.contextmanager
    def _locked(self) -> Iterator[Dict[str, Any]]:
        make_dirs(self.home)  # 0700, and so is each parent it makes
        fd = os.open(self.path + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            doc = self._read()
            yield doc
        finally:
            os.close(fd)

    def _corrupt(self, why: str) -> IntegrityError:
        return IntegrityError(
            f"the run registry {self.path} is corrupt: {why}",
            "fix it by hand, or move it aside and deploy each run again to record it (the "
            "runs on the boxes are not touched); rgt will not overwrite it",
        )

    def _read(self) -> Dict[str, Any]:
        """The registry's document. A file that does not parse, or does not hold a ``runs``
        object, raises IntegrityError: read as "no runs", it would make every run "no such
        run" and the next ``put`` would replace every record with one."""
        try:
            with open(self.path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return {"runs": {}}
        except OSError as e:
            raise self._corrupt(f"it cannot be read ({e.strerror})") from None
        try:
            doc = jsondoc.loads(raw)
        except ValueError as e:  # UnicodeDecodeError is one too
            raise self._corrupt(f"not JSON ({e})") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("runs"), dict):
            raise self._corrupt('not an object with a "runs" object')
        return doc

    def _record(self, name: str, d: Any) -> RunRecord:
        try:
            return RunRecord.from_json(d)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise self._corrupt(f"the record of {name!r} is malformed ({e!r})") from None

    def put(self, rec: RunRecord) -> None:
        check_name(rec.name)
        with self._locked() as doc:
            old = doc["runs"].get(rec.name)
            if old is not None:
                rec.created = float(old.get("created", rec.created))
            rec.updated = time.time()
            doc["runs"][rec.name] = rec.to_json()
            write_json(self.path, doc)

    def get(self, name: str) -> RunRecord:
        runs = self._read()["runs"]
        d = runs.get(name)
        if d is None:
            known = ", ".join(sorted(runs)) or "none yet"
            raise NotFound(f"no run named {name!r} on this laptop (known: {known})", "rgt runs")
        return self._record(name, d)

    def all(self) -> List[RunRecord]:
        return [self._record(n, d) for n, d in sorted(self._read()["runs"].items())]

    def mark_down(self, name: str) -> Optional[RunRecord]:
        """Mark the record of ``name`` taken down now (``RunRecord.down_at``); the record, or
        None when there is none to mark."""
        with self._locked() as doc:
            d = doc["runs"].get(name)
            if d is None:
                return None
            d["down_at"] = d["updated"] = time.time()
            write_json(self.path, doc)
            return self._record(name, d)

    def remove(self, name: str) -> None:
        with self._locked() as doc:
            if doc["runs"].pop(name, None) is not None:
                write_json(self.path, doc)
