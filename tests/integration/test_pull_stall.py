"""`rgt pull --from store` whose store stops answering in the middle of the download.

The laptop's pull from a store downloads as the agent's restore does (onbox/sealing/fetch.py
``in_parallel``), and like the restore it had no bound on a download that moves nothing: from an
S3 store that stopped sending mid-body the pull waited as long as the client's read timeout and
retries allowed (minutes), and only Ctrl-C ended it sooner. Now it ends once nothing has moved
for its bound (the run's ``[store] stall`` as the laptop recorded it, 5 min by default; before,
the job file's bound was not known to the laptop), exit 14 with the store named, nothing under a
final name and no receipt; with the store back, the next pull brings every file whole.

Real processes, real signals: the S3 store is a SeaweedFS of the test's own (``weed mini``),
SIGSTOPped once the pull, a child process, has begun its download (the pull is stopped for that
moment, so that its download cannot end first), and SIGCONTed in a ``finally``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, Dict

import pytest

from controller.results.pull import pull
from onbox.sealing.stores.filecopy import SMALL_FILE
from tests import seaweed
from tests.conftest import ROOT, require
from tests.integration.test_pull import _finals, _read, _rec, _seal, _store
from tests.laptop import nesting as _nesting
from tests.seaweed import start_seaweed

STEP = 4
# Large enough that the download outlasts the moment the test stops the store: what the kernel
# buffers of a loopback connection hold after the stop is a few MiB.
FILE = 48 << 20
WAIT = 60.0  # the test's bound on the pull; before the fix S3's read timeout alone was 60 s
# The pull as `rgt pull` runs it (an RgtError printed as its line, exited with its code): its
# bound is the record's.
PULL = (
    "import json, sys\n"
    "from controller.registry import RunRecord\n"
    "from controller.results.pull import pull\n"
    "from onbox.common.errors import RgtError\n"
    "try:\n"
    "    rec = RunRecord.from_json(json.loads(sys.argv[1]))\n"
    "    pull(rec, sys.argv[2], 'store')\n"
    "except RgtError as e:\n"
    "    print(e.line(), file=sys.stderr)\n"
    "    sys.exit(e.exit_code)\n"
)


def _downloading(dest: str) -> bool:
    """Whether a file of the pull has begun to arrive under its staging directory."""
    return any(names for _, _, names in os.walk(os.path.join(dest, ".rgt-part")))


def test_a_pull_from_a_store_stopped_mid_download_fails_within_its_bound_and_resumes_whole(
    tmp_path: Any, laptop: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before the fix the pull was still waiting when the test gave up (WAIT): the S3 reader's
    receive blocked for its read timeout (60 s), then each request was retried."""
    require(seaweed.missing() is None, seaweed.missing() or "")
    server = start_seaweed(str(tmp_path / "weed"))
    weed, stopped = server.pid, False
    assert weed is not None
    try:
        for k, v in server.env({}).items():  # this process's pull, after the stall
            monkeypatch.setenv(k, v)
        bucket = server.bucket()
        files: Dict[str, bytes] = {f"part-{i}.bin": os.urandom(FILE) for i in range(2)}
        _seal(str(tmp_path), server.store(bucket, "rgt"), STEP, files)
        url = f"s3://{bucket}/rgt"
        rec = dataclasses.replace(_rec(url, str(tmp_path / "box")), store_stall=3.0)
        dest = str(tmp_path / "dest")
        child = subprocess.Popen(
            [sys.executable, "-c", PULL, json.dumps(rec.to_json()), dest],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            deadline = time.monotonic() + 60
            while not _downloading(dest) and child.poll() is None:
                assert time.monotonic() < deadline, "the pull never began its download"
                time.sleep(0.01)
            # The pull held while the store stops: its download cannot end first.
            os.kill(child.pid, signal.SIGSTOP)
            try:
                os.kill(weed, signal.SIGSTOP)
                stopped = True
            finally:
                os.kill(child.pid, signal.SIGCONT)
            try:
                _, err = child.communicate(timeout=WAIT)
            except subprocess.TimeoutExpired:
                pytest.fail(f"the pull still waited on the stalled store after {WAIT:.0f}s")
        finally:
            if child.poll() is None:
                child.kill()
                child.communicate()
        assert child.returncode == 14, err
        assert f"{url} sent nothing for 3s" in err, err
        assert "stopped answering mid-download" in err and "pull again" in err, err
        assert "rgt pull --stall S" in err, err  # the setting that gave the bound
        assert _nesting(err) == 1, err  # the line's remedy in one pair, none inside it
        assert "Traceback" not in err, err
        assert _finals(dest) == []  # nothing under a final name, no receipt

        os.kill(weed, signal.SIGCONT)
        stopped = False
        receipt = pull(rec, dest, "store")
        assert receipt.sealed.step == STEP
        for n, data in files.items():
            assert _read(os.path.join(dest, "checkpoints", f"step_{STEP}", n)) == data
    finally:
        if stopped:
            os.kill(weed, signal.SIGCONT)
        server.stop()


def test_a_pull_from_a_file_store_that_holds_mid_file_says_its_remedy_plainly(
    tmp_path: Any, laptop: str
) -> None:
    """A ``file://`` store whose copy of the file holds after its first piece (a hung mount
    mid-file, ``RGT_HOLD_AT=copy.after_piece``): the pull ends after the run's bound (2 s), exit
    14, and its line's remedy, which the CLI puts in one pair of parentheses, has none of its
    own. Before the fix it read "(check the store and the way to it (the network, ...), then
    pull again ... (a store that is slow, not stopped, ...: rgt pull --stall S, ...))"."""
    store = _store(tmp_path)
    _seal(str(tmp_path), store, STEP, {"model.bin": os.urandom(SMALL_FILE + (1 << 20))})
    rec = dataclasses.replace(_rec(store.url, str(tmp_path / "box")), store_stall=2.0)
    dest = str(tmp_path / "dest")
    release = tmp_path / "release"  # the held copy let go once the pull has ended
    env = dict(os.environ, RGT_HOLD_AT="copy.after_piece", RGT_HOLD_UNTIL=str(release))
    child = subprocess.Popen(
        [sys.executable, "-c", PULL, json.dumps(rec.to_json()), dest],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _, err = child.communicate(timeout=WAIT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the pull still waited on the held store after {WAIT:.0f}s")
    finally:
        release.touch()
        if child.poll() is None:
            child.kill()
            child.communicate()
    assert child.returncode == 14, err
    assert "Traceback" not in err, err
    assert f"{store.url} sent nothing for 2s" in err and "pull again" in err, err
    assert "a hung mount" in err and "rgt pull --stall S" in err, err
    assert _nesting(err) == 1, err
    assert _finals(dest) == []  # nothing under a final name, no receipt
