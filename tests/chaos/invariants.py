"""The invariants of shared/facts/reliability.md §2.1, checked from the store's own bytes.

A ``StoreView`` reads a store without rgt's ``Store`` classes: a ``file://`` store by walking its
directory, an S3 store with boto3 directly, so that a bug in rgt's reader cannot hide a bug in
its writer. Only the JSON of MANIFEST and LATEST is parsed with rgt's parser (for its schema).

Every assertion names the invariant it checks:

- I1 no loss: the newest checkpoint verified before the fault still verifies (``Survivor``);
- I2 LATEST is verified: it names a MANIFEST whose every file is present with its size and
  sha256, and that is not quarantined;
- I3 nothing torn is visible: every MANIFEST not quarantined verifies; no temporary upload is
  left once an agent has started since;
- I5 one writer: LATEST's epoch is the newest epoch that wrote, and every checkpoint that epoch
  sealed is unchanged after a stale agent ran (``Snapshot``);
- I6 forward only: LATEST, watched while the scenario runs (``LatestWatch``), never moves to an
  older epoch, nor to a lower step except away from a quarantined one;
- I8 no secret: a canary value is in no object of the run;
- restorable: ``rgt-agent restore`` on a fresh directory gives exactly the files, sizes and
  sha256 that LATEST's MANIFEST lists.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import json
import os
import subprocess
import threading
import time
from typing import Any, Collection, Dict, List, Optional, Set, Tuple

from onbox.sealing import manifest as mf
from tests.conftest import agent_exe


class StoreView(abc.ABC):
    """Raw access to a store's bytes, for checking and for injecting faults."""

    url: str

    @abc.abstractmethod
    def objects(self, prefix: str) -> Dict[str, int]:
        """Every object under a final name below ``prefix``: key -> size."""

    @abc.abstractmethod
    def temps(self, prefix: str) -> List[str]:
        """Uploads in flight or left behind below ``prefix`` (temporary files, multipart)."""

    @abc.abstractmethod
    def read(self, key: str) -> Optional[bytes]:
        """The object's bytes, None when absent."""

    @abc.abstractmethod
    def write(self, key: str, data: bytes) -> None:
        """Replace the object's bytes (a fault: a bit flip)."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object (a fault: a lost object)."""

    def sha256(self, key: str) -> Optional[str]:
        data = self.read(key)
        return None if data is None else hashlib.sha256(data).hexdigest()


class FileView(StoreView):
    """A ``file://`` store: its directory, walked."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.url = "file://" + root

    def _walk(self, prefix: str) -> List[Tuple[str, str]]:
        out = []
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames.sort()
            for name in filenames:
                full = os.path.join(dirpath, name)
                key = os.path.relpath(full, self.root).replace(os.sep, "/")
                if key.startswith(prefix):
                    out.append((key, full))
        return out

    def objects(self, prefix: str) -> Dict[str, int]:
        out = {}
        for key, full in self._walk(prefix):
            if ".rgt-tmp." in key:
                continue
            try:
                out[key] = os.lstat(full).st_size
            except FileNotFoundError:
                continue
        return out

    def temps(self, prefix: str) -> List[str]:
        return [key for key, _ in self._walk(prefix) if ".rgt-tmp." in key]

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *key.split("/"))

    def read(self, key: str) -> Optional[bytes]:
        try:
            with open(self._path(key), "rb") as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None

    def write(self, key: str, data: bytes) -> None:
        with open(self._path(key), "r+b") as f:  # in place: the same inode, as a disk fault
            f.write(data)
            f.truncate()

    def delete(self, key: str) -> None:
        os.unlink(self._path(key))


class S3View(StoreView):
    """An S3 store, read with a plain boto3 client."""

    def __init__(self, client: Any, bucket: str, prefix: str) -> None:
        self.client = client
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}"

    def _full(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _rel(self, full: str) -> str:
        return full[len(self.prefix) + 1 :] if self.prefix else full

    def objects(self, prefix: str) -> Dict[str, int]:
        out: Dict[str, int] = {}
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self._full(prefix)
        )
        for page in pages:
            for o in page.get("Contents", []):
                out[self._rel(o["Key"])] = int(o["Size"])
        return out

    def temps(self, prefix: str) -> List[str]:
        got = self.client.list_multipart_uploads(Bucket=self.bucket, Prefix=self._full(prefix))
        return [self._rel(u["Key"]) for u in got.get("Uploads", [])]

    def read(self, key: str) -> Optional[bytes]:
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self._full(key))["Body"]
            data: bytes = body.read()
            return data
        except self.client.exceptions.NoSuchKey:
            return None

    def write(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._full(key), Body=data)

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._full(key))


def _json(data: Optional[bytes]) -> Optional[Dict[str, Any]]:
    if data is None:
        return None
    doc = json.loads(data)
    return doc if isinstance(doc, dict) else None


@dataclasses.dataclass
class Survivor:
    """A checkpoint verified before the fault (I1): its MANIFEST's bytes and step."""

    step: int
    manifest: bytes


@dataclasses.dataclass
class Snapshot:
    """The checkpoints one epoch sealed: step -> (MANIFEST bytes, key -> sha256)."""

    epoch: int
    steps: Dict[int, Tuple[bytes, Dict[str, str]]]


class Checker:
    """The invariants of one run in one store."""

    def __init__(self, view: StoreView, run: str) -> None:
        self.view = view
        self.run = run

    # ---- reading the store
    def latest(self) -> Optional[Dict[str, Any]]:
        return mf.parse_latest(self.view.read(mf.latest_key(self.run)))

    def manifest_keys(self) -> Dict[int, str]:
        out = {}
        for key in self.view.objects(f"{self.run}/checkpoints/"):
            parts = key.split("/")
            if parts[-1] == "MANIFEST.json" and len(parts) == 4 and parts[2].isdigit():
                out[int(parts[2])] = key
        return out

    def manifest(self, step: int) -> Optional[Tuple[bytes, Dict[str, Any]]]:
        key = mf.manifest_key(self.run, step)
        data = self.view.read(key)
        if data is None:
            return None
        return data, mf.parse_manifest(data, key)

    def quarantined(self) -> Set[int]:
        out = set()
        for key in self.view.objects(f"{self.run}/quarantine/"):
            name = key.rsplit("/", 1)[-1]
            if name.endswith(".json") and name[:-5].isdigit():
                out.add(int(name[:-5]))
        return out

    def epochs(self) -> List[int]:
        out = []
        for key in self.view.objects(f"{self.run}/epochs/"):
            tail = key.rsplit("/", 1)[-1]
            if tail.isdigit():
                out.append(int(tail))
        return sorted(out)

    def problems(self, doc: Dict[str, Any]) -> List[str]:
        """What is wrong with the files of a MANIFEST in the store: [] when it verifies."""
        out = []
        sizes = self.view.objects(f"{self.run}/")
        for f in doc["files"]:
            key = f["key"]
            if key not in sizes:
                out.append(f"{key} is missing")
                continue
            if sizes[key] != f["size"]:
                out.append(f"{key} is {sizes[key]} bytes, the MANIFEST says {f['size']}")
                continue
            got = self.view.sha256(key)
            if got != f["sha256"]:
                out.append(
                    f"{key} has sha256 {str(got)[:12]}, the MANIFEST says {f['sha256'][:12]}"
                )
        return out

    def verified_steps(self) -> List[int]:
        bad = self.quarantined()
        out = []
        for step in sorted(self.manifest_keys()):
            got = self.manifest(step)
            if got is not None and step not in bad and not self.problems(got[1]):
                out.append(step)
        return out

    # ---- recording before a fault
    def survivor(self) -> Survivor:
        """The newest verified checkpoint now (I1 says it must survive the fault)."""
        steps = self.verified_steps()
        assert steps, "I1 precondition: the store holds no verified checkpoint before the fault"
        got = self.manifest(steps[-1])
        assert got is not None
        return Survivor(steps[-1], got[0])

    def snapshot(self, epoch: int) -> Snapshot:
        """Every checkpoint ``epoch`` sealed, with the sha256 of each of its objects."""
        steps = {}
        for step in self.manifest_keys():
            got = self.manifest(step)
            if got is None or got[1].get("epoch") != epoch:
                continue
            hashes = {f["key"]: str(self.view.sha256(f["key"])) for f in got[1]["files"]}
            steps[step] = (got[0], hashes)
        assert steps, f"I5 precondition: epoch {epoch} sealed nothing yet"
        return Snapshot(epoch, steps)

    # ---- the invariants
    def assert_latest_verified(self) -> Dict[str, Any]:
        latest = self.latest()
        assert latest is not None, "I2: the store has no LATEST.json"
        step = latest["step"]
        key = latest.get("manifest") or mf.manifest_key(self.run, step)
        data = self.view.read(key)
        assert data is not None, f"I2: LATEST names step {step}, whose MANIFEST {key} is missing"
        doc = mf.parse_manifest(data, key)
        assert doc["step"] == step, f"I2: LATEST names step {step}, its MANIFEST says {doc['step']}"
        bad = self.problems(doc)
        assert not bad, f"I2/I3: LATEST names step {step}, which does not verify: {bad}"
        assert step not in self.quarantined(), f"I2: LATEST names step {step}, quarantined"
        return latest

    def assert_visible_verify(self) -> None:
        bad = self.quarantined()
        for step in sorted(self.manifest_keys()):
            if step in bad:
                continue
            got = self.manifest(step)
            if got is None:
                continue  # pruned meanwhile
            problems = self.problems(got[1])
            assert not problems, (
                f"I3: step {step} has a MANIFEST (so it exists) and is not quarantined, but "
                f"does not verify: {problems}"
            )

    def assert_writer(self, epochs: Collection[int]) -> None:
        """LATEST, and the MANIFEST it names, were written by the newest writer: one of
        ``epochs``, the agents of the box that owns the run now."""
        latest = self.assert_latest_verified()
        want = sorted(epochs)
        assert latest.get("epoch") in want, (
            f"I5/I6: LATEST (step {latest['step']}) was written by epoch {latest.get('epoch')}, "
            f"but the newest writer is epoch {want}"
        )
        got = self.manifest(latest["step"])
        assert got is not None
        assert got[1].get("epoch") in want, (
            f"I5: LATEST names step {latest['step']}, whose MANIFEST was sealed by epoch "
            f"{got[1].get('epoch')}, a stale writer (the newest writer is epoch {want})"
        )

    def assert_unchanged(self, snap: Snapshot) -> None:
        for step, (manifest, hashes) in sorted(snap.steps.items()):
            got = self.manifest(step)
            assert got is not None, (
                f"I1/I5: step {step}, sealed by epoch {snap.epoch} (the newest), lost its MANIFEST"
            )
            assert got[0] == manifest, (
                f"I5: step {step}'s MANIFEST, sealed by epoch {snap.epoch} (the newest), was "
                f"rewritten (now epoch {got[1].get('epoch')})"
            )
            for key, sha in sorted(hashes.items()):
                now = self.view.sha256(key)
                assert now == sha, (
                    f"I5/I1: {key} of step {step}, sealed by epoch {snap.epoch} (the newest), "
                    f"changed: sha256 {sha[:12]} -> {str(now)[:12]}"
                )

    def assert_survived(self, s: Survivor, may_be_pruned: bool = False) -> None:
        got = self.manifest(s.step)
        if got is None and may_be_pruned:
            latest = self.assert_latest_verified()
            assert latest["step"] > s.step, (
                f"I1: step {s.step}, verified before the fault, is gone and LATEST "
                f"({latest['step']}) is not newer"
            )
            return
        assert got is not None, f"I1: step {s.step}, verified before the fault, lost its MANIFEST"
        assert got[0] == s.manifest, f"I1: step {s.step}'s MANIFEST changed after the fault"
        problems = self.problems(got[1])
        assert not problems, (
            f"I1: step {s.step}, verified before the fault, no longer verifies: {problems}"
        )

    def assert_no_temps(self) -> None:
        left = self.view.temps(f"{self.run}/")
        assert not left, f"I3: temporary uploads left behind after a new agent started: {left}"

    def assert_no_secret(self, value: str) -> None:
        needle = value.encode()
        for key in sorted(self.view.objects(f"{self.run}/")):
            data = self.view.read(key) or b""
            assert needle not in data, f"I8: the canary secret is in the store's {key}"

    def assert_restorable(self, env: Dict[str, str], dest: str) -> Dict[str, Any]:
        """``rgt-agent restore`` into the fresh ``dest`` gives exactly LATEST's MANIFEST, and
        every checkpoint the newest epoch sealed is unchanged afterwards (a restore reads; it
        never rewrites or drops what the run's owner sealed)."""
        latest = self.assert_latest_verified()
        epochs = self.epochs()
        owned = self.snapshot(epochs[-1]) if epochs and self._sealed_by(epochs[-1]) else None
        got = self.manifest(latest["step"])
        assert got is not None
        doc = got[1]
        assert not os.path.exists(dest), f"{dest} must be fresh"
        p, found = restore_fresh(env, self.view.url, self.run, dest)
        assert p.returncode == 0, (
            f"restorable: `rgt-agent restore` of LATEST (step {latest['step']}) exited "
            f"{p.returncode}: {p.stdout}{p.stderr}"
        )
        want = {f["path"]: (f["size"], f["sha256"]) for f in doc["files"]}
        assert found == want, (
            f"restorable: a fresh restore of step {latest['step']} gave "
            f"{sorted(found)} (sizes, sha256 differ?), its MANIFEST lists {sorted(want)}"
        )
        if owned is not None:
            self.assert_unchanged(owned)
        return latest

    def _sealed_by(self, epoch: int) -> bool:
        for step in self.manifest_keys():
            got = self.manifest(step)
            if got is not None and got[1].get("epoch") == epoch:
                return True
        return False


def restore_fresh(
    env: Dict[str, str], url: str, run: str, dest: str
) -> Tuple[subprocess.CompletedProcess[str], Dict[str, Tuple[int, str]]]:
    """Run the real ``rgt-agent restore`` of ``run`` into ``dest`` (a fresh box: its own
    RGT_HOME) and read back what landed there: relative path -> (size, sha256)."""
    env = dict(env, RGT_HOME=dest + ".home")
    p = subprocess.run(
        [*agent_exe(), "restore", "--store", url, "--name", run, "--to", dest],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    found = {}
    for dirpath, _, filenames in os.walk(dest):
        for name in filenames:
            full = os.path.join(dirpath, name)
            with open(full, "rb") as f:
                data = f.read()
            rel = os.path.relpath(full, dest).replace(os.sep, "/")
            found[rel] = (len(data), hashlib.sha256(data).hexdigest())
    return p, found


class LatestWatch:
    """Samples LATEST.json while a scenario runs (I6: never an older epoch, never a lower step
    unless away from a quarantined one). Use as a context manager; ``check`` at the end."""

    def __init__(self, view: StoreView, run: str, every: float = 0.1) -> None:
        self.view = view
        self.run = run
        self.every = every
        self.seen: List[Tuple[int, int]] = []
        self.errors: List[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="latest-watch", daemon=True)

    def __enter__(self) -> LatestWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(10)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            time.sleep(self.every)

    def sample(self) -> None:
        try:
            doc = _json(self.view.read(mf.latest_key(self.run)))
        except Exception as e:  # the store may be down on purpose (an outage scenario)
            self.errors.append(repr(e))
            return
        if doc is None:
            return
        now = (int(doc.get("epoch") or 0), int(doc["step"]))
        if not self.seen or self.seen[-1] != now:
            self.seen.append(now)

    def check(self, quarantined: Set[int]) -> None:
        self.sample()
        for (e0, s0), (e1, s1) in zip(self.seen, self.seen[1:]):
            assert e1 >= e0, f"I5/I6: LATEST went back from epoch {e0} to {e1} ({self.seen})"
            assert s1 >= s0 or s0 in quarantined, (
                f"I6: LATEST went back from step {s0} to {s1}, and {s0} is not quarantined "
                f"(seen: {self.seen})"
            )
