"""The box, and the store, are untrusted input: a hostile one cannot make rgt touch anything
outside the directory it was asked to write (issue 10, findings 2, 3 and the restore and pull
cases of 7).

``rgt pull --from box`` runs against a real sshd box (loopback) whose ``spec.json``, MANIFEST
and ``find`` output are crafted, over both transports (rsync and the ``tail`` stream): a
canary file planted outside DEST, exactly where a staging name the box controls would resolve
on the laptop, must keep its bytes and its mtime, and the pull must end in the integrity error
(exit 6) naming the path. ``rgt-agent restore`` runs as a real process against a ``file://``
store holding a symlink key, a NUL in a MANIFEST path, dangling symlinks, and into a ``--to``
with a symlink planted in it. The bad-input cases (a missing store, ``--to /proc/x``, a
read-only ``--to`` of ``rgt pull``) end in one line with their exit code and leave nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import pytest

from controller.registry import Registry, RunRecord
from controller.remote import SshRemote
from controller.results.pull import pull
from controller.target import Target
from onbox.common.errors import IntegrityError
from onbox.sealing import manifest as mf
from onbox.sealing.fetch import STAGE_PREFIX
from onbox.sealing.quarantine import flag_quarantined
from onbox.sealing.stores import open_store
from onbox.sealing.stores.base import Store
from tests.conftest import Cli, agent_exe, require
from tests.integration.test_pull import _seal
from tests.laptop import nesting
from tests.seaweed import SeaweedServer
from tests.sshd import SshServer, missing, start_sshd

RUN = "r1"
BOX_BYTES = b"bytes the box chose\n" * 7
LAPTOP_BYTES = b"the laptop's own file: not to be read, cut, filled, moved or removed\n" * 90
SECRET = b"a file outside the store that a symlink key points to\n"
TRANSPORTS = ["rsync", "stream"]


# ---- canaries: files outside DEST that must not change


@dataclasses.dataclass(frozen=True)
class Canary:
    path: str
    data: bytes
    mtime_ns: int

    def assert_intact(self) -> None:
        assert os.path.isfile(self.path) and not os.path.islink(self.path), self.path
        with open(self.path, "rb") as f:
            assert f.read() == self.data, f"{self.path} was changed"
        assert os.stat(self.path).st_mtime_ns == self.mtime_ns, f"{self.path} was rewritten"


def _plant(path: str, data: bytes = LAPTOP_BYTES) -> Canary:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    past = 1_600_000_000_000_000_000  # an mtime no write now would leave
    os.utime(path, ns=(past, past))
    return Canary(path, data, past)


def _tree(root: str) -> List[str]:
    out = []
    for here, dirs, files in os.walk(root):
        out += [os.path.relpath(os.path.join(here, n), root) for n in dirs + files]
    return sorted(out)


def _one_line(p: subprocess.CompletedProcess[str]) -> str:
    """The error a CLI printed: one line, no traceback."""
    assert "Traceback" not in p.stderr, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rgt: "), p.stderr
    return lines[0]


# ---- the laptop, the box


def _target(server: SshServer) -> Target:
    return Target(
        "ssh", host="127.0.0.1", user=server.user, port=server.port, identity=server.client_key
    )


@pytest.fixture
def box(sshd: SshServer, laptop: str) -> Iterator[Target]:
    """The real sshd on loopback, as the laptop reaches a box."""
    target = _target(sshd)
    yield target
    SshRemote(target).close()  # the control master ssh keeps for a while


EVIL_FIND = """#!/bin/sh
# A compromised box: for the checkpoint directory, print the records the test planted (the
# format rgt's listing script prints: kind, sha256, size, path, each NUL-terminated).
p=$1; [ "$p" = -H ] && p=$2  # the listing follows the path it is given (find -H PATH)
case "$p" in
  */ckpt) exec cat "$(dirname "$0")/records" ;;
esac
exec /usr/bin/find "$@"
"""


@pytest.fixture(scope="module")
def evil_sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshServer]:
    """A second real sshd whose sessions find a hostile ``find`` first on PATH."""
    why = missing()
    require(why is None, why or "")
    d = str(tmp_path_factory.mktemp("evil-sshd"))
    evil = os.path.join(d, "bin")
    os.makedirs(evil)
    with open(os.path.join(evil, "find"), "w") as f:
        f.write(EVIL_FIND)
    os.chmod(os.path.join(evil, "find"), 0o755)
    path = f"{evil}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    server = start_sshd(os.path.join(d, "sshd"), set_env={"PATH": path})
    try:
        p = server.run("command -v find", timeout=60)
        assert p.returncode == 0 and p.stdout.strip() == os.path.join(evil, "find"), (
            p.stdout + p.stderr + server.log()[-2000:]
        )
        yield server
    finally:
        server.stop()


@pytest.fixture
def evil_box(evil_sshd: SshServer, laptop: str) -> Iterator[Target]:
    target = _target(evil_sshd)
    yield target
    SshRemote(target).close()


def _box_run(cli: Cli) -> str:
    """A real run on the box that ended SUCCEEDED (no store); its checkpoint dir holds
    victim.bin with BOX_BYTES. Returns the checkpoint dir."""
    cli("run", "--name", RUN, "--", "true", check=True)
    ckpt = os.path.join(cli.home, "runs", RUN, "ckpt")
    os.makedirs(ckpt, exist_ok=True)
    with open(os.path.join(ckpt, "victim.bin"), "wb") as f:
        f.write(BOX_BYTES)
    return ckpt


def _edit_spec(home: str, **changes: Any) -> None:
    path = os.path.join(home, "runs", RUN, "spec.json")
    with open(path) as f:
        spec = json.load(f)
    spec.update(changes)
    with open(path, "w") as f:
        json.dump(spec, f)


def _rec(target: Target, box_home: str, store: Optional[str] = None) -> RunRecord:
    return RunRecord(
        RUN,
        target,
        profile="local" if target.kind == "local" else "generic-ssh",
        store=store,
        box_home=box_home,
        agent=agent_exe(),
    )


def _assert_refused(rec: RunRecord, dest: Path, transport: str, *needles: str) -> IntegrityError:
    with pytest.raises(IntegrityError) as info:
        pull(rec, str(dest), "box", transport=transport)
    err = info.value
    assert err.exit_code == 6
    for n in needles:
        assert n in err.what, err.what
    assert not dest.exists() or _tree(str(dest)) == [], _tree(str(dest))
    return err


def _require(transport: str) -> None:
    require(transport != "rsync" or bool(shutil.which("rsync")), "rsync")


# ---- rgt pull from a hostile box


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_hostile_ckpt_dir_in_the_box_spec_touches_nothing_outside_dest(
    cli: Cli, tmp_path: Path, box: Target, transport: str
) -> None:
    """spec.json's ckpt_dir "/../../<ckpt>" is the checkpoint dir itself on the box, but as a
    staging name under DEST/.rgt-part it climbed to tmp_path/<ckpt>/victim.bin on the laptop:
    the stream cut that file, filled it with the box's bytes and moved it; rsync's cleanup
    unlinked it."""
    _require(transport)
    ckpt = _box_run(cli)
    _edit_spec(cli.home, ckpt_dir="/../../" + ckpt[1:])
    dest = tmp_path / "dest"  # its staging dir is tmp_path/dest/.rgt-part: two levels up
    canary = _plant(os.path.join(str(tmp_path), ckpt[1:], "victim.bin"))
    _assert_refused(_rec(box, cli.home), dest, transport, "ckpt_dir", "'..' component")
    canary.assert_intact()


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(
    "listed,why",
    [
        ("/../../{ckpt}/victim.bin", "outside every directory"),  # the same, through find
        ("{ckpt}/../../../{canary}", "'..' component"),  # under ckpt by its prefix only
        ("{ckpt}/a\x1b[2Jb", "control character"),
        ("{ckpt}/" + "x" * 300, "300 bytes long"),
    ],
    ids=["climbs-from-root", "climbs-from-ckpt", "escape", "long-name"],
)
def test_a_hostile_find_on_the_box_touches_nothing_outside_dest(
    cli: Cli, tmp_path: Path, evil_box: Target, evil_sshd: SshServer, transport: str, listed: str,
    why: str,
) -> None:  # fmt: skip
    _require(transport)
    ckpt = _box_run(cli)
    canary = _plant(os.path.join(str(tmp_path), ckpt[1:], "victim.bin"))
    raw = listed.format(ckpt=ckpt[1:] if listed.startswith("/../") else ckpt, canary=canary.path)
    record = [b"checkpoint", hashlib.sha256(BOX_BYTES).hexdigest().encode(), b"%d" % len(BOX_BYTES)]
    with open(os.path.join(evil_sshd.dir, "..", "bin", "records"), "wb") as f:
        f.write(b"\0".join(record + [raw.encode()]) + b"\0")
    err = _assert_refused(_rec(evil_box, cli.home), tmp_path / "dest", transport, why)
    assert "checkpoints/" in err.what or repr(raw) in err.what, err.what  # the path is named
    canary.assert_intact()


def test_a_hostile_find_printing_a_size_of_thousands_of_digits_is_refused(
    cli: Cli, tmp_path: Path, evil_box: Target, evil_sshd: SshServer
) -> None:
    """5000 digits pass isdigit(); int() of them raised ValueError (Python's 4300-digit limit):
    `rgt pull` ended in a traceback. The listing is refused before any transport runs."""
    ckpt = _box_run(cli)
    record = [b"checkpoint", hashlib.sha256(BOX_BYTES).hexdigest().encode(), b"9" * 5000]
    with open(os.path.join(evil_sshd.dir, "..", "bin", "records"), "wb") as f:
        f.write(b"\0".join(record + [f"{ckpt}/victim.bin".encode()]) + b"\0")
    err = _assert_refused(_rec(evil_box, cli.home), tmp_path / "dest", "stream", "malformed")
    assert "victim.bin" in err.what and len(err.line()) < 500, err.what


@pytest.mark.parametrize(
    "path,real,why",
    [
        ("/etc", "/data/ckpt", "as a root it was not asked for"),
        ("{ckpt}", "/data/../etc", "'..' component"),
        ("{ckpt}", "data/ckpt", "not an absolute path"),
    ],
    ids=["other-root", "climbs", "relative"],
)
def test_a_hostile_listing_of_where_the_checkpoint_dir_leads_is_refused(
    cli: Cli, tmp_path: Path, evil_box: Target, evil_sshd: SshServer, path: str, real: str,
    why: str,
) -> None:  # fmt: skip
    """The lister says where a checkpoint dir that is a link leads (a link in it naming that
    real path leads into it): only of the checkpoint dir asked for, and only an absolute,
    plain path; anything else stops the pull before any transport runs."""
    ckpt = _box_run(cli)
    record = [b"root", b"checkpoint", real.encode(), path.format(ckpt=ckpt).encode()]
    with open(os.path.join(evil_sshd.dir, "..", "bin", "records"), "wb") as f:
        f.write(b"\0".join(record) + b"\0")
    _assert_refused(_rec(evil_box, cli.home), tmp_path / "dest", "stream", why)


def _file_store(tmp_path: Path) -> Store:
    root = tmp_path / "store"
    root.mkdir(exist_ok=True)
    return open_store(f"file://{root}")


def _store_path(store: Store, key: str) -> str:
    return os.path.join(store.url[len("file://") :], *key.split("/"))


def _object_file(store: Store, step: int, path: str) -> str:
    """Where the file:// store holds the bytes of ``path`` (relative to RGT_CKPT_DIR) of
    checkpoint ``step``: the key its MANIFEST names, whatever the sealer's key layout."""
    with open(_store_path(store, mf.manifest_key(RUN, step))) as f:
        doc = json.load(f)
    (key,) = [e["key"] for e in doc["files"] if e["path"] == path]
    return _store_path(store, key)


def _edit_manifest(store: Store, step: int, edit: Any) -> None:
    path = _store_path(store, mf.manifest_key(RUN, step))
    with open(path) as f:
        doc = json.load(f)
    edit(doc)
    with open(path, "w") as f:
        json.dump(doc, f)


def _rename_file(doc: Dict[str, Any], name: str) -> None:
    doc["files"][0]["path"] = name


def _add_under(doc: Dict[str, Any]) -> None:
    under = dict(doc["files"][0])
    under["path"] = doc["files"][0]["path"] + "/under"
    doc["files"].append(under)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(
    "edit,why",
    [
        (lambda d: _rename_file(d, "step_5/a\x00b"), "NUL"),
        (lambda d: _rename_file(d, "step_5/a\\..\\b"), "backslash"),
        (lambda d: _rename_file(d, "step_5/\x1b]0;pwned\x07"), "control character"),
        (lambda d: d["files"][0].update(key=RUN + "/checkpoints/5/a\x00b"), "NUL"),
        (_add_under, "is listed, and so is"),
    ],
    ids=["nul-path", "backslash", "terminal-escape", "nul-key", "file-and-dir"],
)
def test_a_crafted_manifest_on_the_box_is_refused_before_anything_is_made(
    tmp_path: Path, box: Target, transport: str, edit: Any, why: str
) -> None:
    """A file:// store is a directory on the box, read over ssh: its MANIFEST is the box's."""
    _require(transport)
    store = _file_store(tmp_path)
    _seal(str(tmp_path), store, 5, {"model.bin": os.urandom(1000), "b.bin": b"b"})
    _edit_manifest(store, 5, edit)
    _assert_refused(_rec(box, str(tmp_path / "boxhome"), store.url), tmp_path / "d", transport, why)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_hostile_ckpt_dir_with_an_s3_store_is_refused_too(
    cli: Cli,
    tmp_path: Path,
    box: Target,
    transport: str,
    s3_server: SeaweedServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With s3:// the documents come from the store and the bytes from the box's own copies,
    found under spec.json's ckpt_dir: a hostile one climbs out of DEST the same way."""
    _require(transport)
    for k, v in s3_server.env({}).items():
        monkeypatch.setenv(k, v)
    bucket = s3_server.bucket()
    _seal(str(tmp_path), s3_server.store(bucket, "rgt"), 3, {"victim.bin": BOX_BYTES})
    ckpt = _box_run(cli)
    shutil.copytree(str(tmp_path / "ckpt" / "step_3"), os.path.join(ckpt, "step_3"))
    _edit_spec(cli.home, ckpt_dir="/../../" + ckpt[1:])
    canary = _plant(os.path.join(str(tmp_path), ckpt[1:], "step_3", "victim.bin"))
    rec = _rec(box, cli.home, f"s3://{bucket}/rgt")
    _assert_refused(rec, tmp_path / "dest", transport, "ckpt_dir", "'..' component")
    canary.assert_intact()


@pytest.mark.parametrize("source", ["store", "box"])
def test_a_symlink_planted_in_dest_is_refused_and_nothing_is_written_through_it(
    tmp_path: Path, box: Target, source: str
) -> None:
    store = _file_store(tmp_path)
    _seal(str(tmp_path), store, 5, {"model.bin": os.urandom(1000)})
    outside = tmp_path / "outside"
    outside.mkdir()
    canary = _plant(str(outside / "step_5" / "model.bin"))
    dest = tmp_path / "dest"
    dest.mkdir()
    os.symlink(str(outside), str(dest / "checkpoints"))
    target = box if source == "box" else Target("local")
    with pytest.raises(IntegrityError) as info:
        pull(_rec(target, str(tmp_path / "boxhome"), store.url), str(dest), source)
    assert info.value.exit_code == 6
    assert f"{dest / 'checkpoints'} is a symlink" in info.value.what, info.value.what
    canary.assert_intact()
    assert _tree(str(outside)) == ["step_5", "step_5/model.bin"]
    assert os.listdir(dest) == ["checkpoints"]  # nothing made: not even the staging dir


def test_a_symlink_under_a_final_name_is_refused(tmp_path: Path, laptop: str) -> None:
    store = _file_store(tmp_path)
    _seal(str(tmp_path), store, 5, {"model.bin": os.urandom(1000)})
    dest = tmp_path / "dest"
    (dest / "checkpoints" / "step_5").mkdir(parents=True)
    canary = _plant(str(tmp_path / "victim"))
    os.symlink(canary.path, str(dest / "checkpoints" / "step_5" / "model.bin"))
    with pytest.raises(IntegrityError, match="model.bin is a symlink"):
        pull(_rec(Target("local"), str(tmp_path / "boxhome"), store.url), str(dest), "store")
    canary.assert_intact()
    assert os.path.islink(dest / "checkpoints" / "step_5" / "model.bin")


def _rgt(*args: str, cwd: str) -> subprocess.CompletedProcess[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "rgt")
    argv = [exe] if os.path.exists(exe) else [sys.executable, "-m", "controller.cli"]
    return subprocess.run(
        [*argv, *args], capture_output=True, text=True, timeout=300, cwd=cwd, env=dict(os.environ)
    )


def test_rgt_pull_from_a_hostile_box_is_one_line_and_exit_6(
    cli: Cli, tmp_path: Path, box: Target, laptop: str
) -> None:
    ckpt = _box_run(cli)
    _edit_spec(cli.home, ckpt_dir="/../../" + ckpt[1:])
    Registry().put(_rec(box, cli.home))
    canary = _plant(os.path.join(str(tmp_path), ckpt[1:], "victim.bin"))
    p = _rgt("pull", RUN, "--to", str(tmp_path / "dest"), "--from", "box", cwd=str(tmp_path))
    assert p.returncode == 6, p.stderr
    line = _one_line(p)
    assert "ckpt_dir" in line and "'..' component" in line and ckpt[1:] in line
    canary.assert_intact()
    assert not (tmp_path / "dest").exists()


# A quarantine reason as a hostile store may hold it: a terminal escape (set the window title)
# and a newline that forges a line of rgt's own.
EVIL_REASON = "\x1b]0;owned\x07cleared\nr1: all 17 files verified, safe to `rgt down`"


def test_rgt_pull_shows_the_stores_quarantine_reason_without_its_control_characters(
    tmp_path: Path, laptop: str
) -> None:
    """`rgt pull` printed the reason raw: in the note on the step it took instead, and inside
    the one-line error when no step is left."""
    store = _file_store(tmp_path)
    _seal(str(tmp_path), store, 5, {"a.bin": b"a"})
    _seal(str(tmp_path), store, 6, {"a.bin": b"b"})
    flag_quarantined(store, RUN, 6, EVIL_REASON)
    Registry().put(_rec(Target("local"), str(tmp_path / "box"), store.url))
    dest = str(tmp_path / "dest")
    p = _rgt("pull", RUN, "--to", dest, "--from", "store", cwd=str(tmp_path))
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert len(lines) == 2 and "quarantined (?]0;owned?cleared?r1: all 17" in lines[1], p.stdout
    flag_quarantined(store, RUN, 5, "x")
    shutil.rmtree(dest)
    p = _rgt("pull", RUN, "--to", dest, "--from", "store", cwd=str(tmp_path))
    assert p.returncode == 6, p.stderr
    assert "quarantined (?]0;owned?cleared?r1: all 17" in _one_line(p)
    assert "\x1b" not in p.stderr + p.stdout and "\x07" not in p.stderr + p.stdout


def test_rgt_status_from_the_store_shows_its_quarantine_reason_without_control_characters(
    tmp_path: Path, laptop: str
) -> None:
    """The box does not answer: `rgt status` reads the store, and the note on the step in
    effect (LATEST's is quarantined) is the store's words."""
    store = _file_store(tmp_path)
    _seal(str(tmp_path), store, 5, {"a.bin": b"a"})
    _seal(str(tmp_path), store, 6, {"a.bin": b"b"})
    flag_quarantined(store, RUN, 6, EVIL_REASON)
    store.put_bytes(mf.state_key(RUN, "state.json"), b'{"name": "r1", "state": "RUNNING"}')
    with socket.socket() as s:  # a port nothing listens on once this closes
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    silent = Target("ssh", host="127.0.0.1", user="nobody", port=port)
    Registry().put(_rec(silent, "/nonexistent/boxhome", store.url))
    for args in (["status", RUN], ["status", RUN, "--json"]):
        p = _rgt(*args, cwd=str(tmp_path))
        assert p.returncode == 0, p.stderr
        out = p.stdout + p.stderr
        assert "\x1b" not in out and "\x07" not in out and "?]0;owned?cleared" in out, out


# JSON nested past the parser's depth: Python's json raises RecursionError, not ValueError, so
# each reader's "malformed" branch missed it and `rgt` ended in a traceback.
DEEP = "[" * 100_000 + "]" * 100_000


def test_rgt_pull_of_a_spec_nested_too_deep_is_one_line_and_exit_6(
    cli: Cli, tmp_path: Path, box: Target, laptop: str
) -> None:
    _box_run(cli)
    with open(os.path.join(cli.home, "runs", RUN, "spec.json"), "w") as f:
        f.write(DEEP)
    Registry().put(_rec(box, cli.home))
    p = _rgt("pull", RUN, "--to", str(tmp_path / "dest"), "--from", "box", cwd=str(tmp_path))
    assert p.returncode == 6, p.stderr
    assert "spec.json" in _one_line(p) and "not valid JSON" in p.stderr
    assert not (tmp_path / "dest").exists()


def test_rgt_status_skips_box_lines_nested_too_deep_or_not_objects(
    cli: Cli, tmp_path: Path, box: Target, laptop: str
) -> None:
    """events.jsonl is the box's: a line nested too deep, or JSON that is no object, is left
    out of what `rgt status` shows, as a line being written is; the rest is shown."""
    _box_run(cli)
    with open(os.path.join(cli.home, "runs", RUN, "events.jsonl"), "a") as f:
        f.write(DEEP + "\n" + "[1, 2]\n" + '"a string"\n')
    Registry().put(_rec(box, cli.home))
    for args in (["status", RUN], ["status", RUN, "--json"]):
        p = _rgt(*args, cwd=str(tmp_path))
        assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
        assert "SUCCEEDED" in p.stdout, p.stdout


@pytest.mark.parametrize(
    "field,value",
    [
        ("last_exit", "boom"),
        ("scheduler", "slurm"),
        ("progress", [1]),
        ("progress", {"step": 3, "metrics": [1]}),
        ("health", [1]),
        ("warnings", "x"),
        ("agent", "up"),
        ("state", "RUN\x1b[2JNING"),
    ],
    ids=lambda v: v if isinstance(v, str) and v.isidentifier() else None,
)
def test_rgt_status_of_a_box_whose_state_fields_have_the_wrong_types_is_no_traceback(
    cli: Cli, tmp_path: Path, box: Target, laptop: str, field: str, value: Any
) -> None:
    """What `rgt-agent status --json` prints is the box's: a field that should be an object
    and is a string (last_exit, scheduler) ended `rgt status` in an AttributeError. Every
    object field is shaped on arrival (onbox.agent.observe.shaped), and no escape sequence
    reaches the terminal."""
    _box_run(cli)
    path = os.path.join(cli.home, "runs", RUN, "state.json")
    with open(path) as f:
        doc = json.load(f)
    doc[field] = value
    with open(path, "w") as f:
        json.dump(doc, f)
    Registry().put(_rec(box, cli.home))
    for args in (["status", RUN], ["status", RUN, "--json"], ["status"]):
        p = _rgt(*args, cwd=str(tmp_path))
        assert p.returncode == 0 and "Traceback" not in p.stderr, (args, p.stderr)
        assert "\x1b" not in p.stdout, (args, p.stdout)
        assert RUN in p.stdout, (args, p.stdout)
    p = _rgt("report", RUN, "--out", str(tmp_path / "r.html"), cwd=str(tmp_path))
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr


@pytest.mark.parametrize(
    "state", [DEEP, "[1, 2]", "not json"], ids=["nested-too-deep", "not-an-object", "garbage"]
)
def test_rgt_status_from_a_store_whose_state_copy_is_damaged_is_one_line_and_exit_6(
    tmp_path: Path, laptop: str, state: str
) -> None:
    """The box does not answer (nothing listens on its port), so `rgt status` reads the
    store's copy of the state: a damaged one is an integrity error naming it."""
    store = _file_store(tmp_path)
    store.put_bytes(mf.state_key(RUN, "state.json"), state.encode())
    with socket.socket() as s:  # a port nothing listens on once this closes
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    silent = Target("ssh", host="127.0.0.1", user="nobody", port=port)
    Registry().put(_rec(silent, "/nonexistent/boxhome", store.url))
    p = _rgt("status", RUN, cwd=str(tmp_path))
    assert p.returncode == 6, p.stderr
    line = _one_line(p)
    assert "state.json" in line and "not a JSON object" in line, line


@pytest.mark.parametrize("sub", ["", "new/dir"], ids=["existing", "missing-under-it"])
def test_rgt_pull_to_a_read_only_directory_is_one_line_and_leaves_nothing(
    tmp_path: Path, laptop: str, sub: str
) -> None:
    store = _file_store(tmp_path)
    _seal(str(tmp_path), store, 5, {"model.bin": os.urandom(1000)})
    Registry().put(_rec(Target("local"), str(tmp_path / "boxhome"), store.url))
    ro = tmp_path / "ro"
    ro.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], capture_output=True
    )
    require(mounted.returncode == 0, "root, to mount a read-only tmpfs")
    try:
        to = str(ro / sub) if sub else str(ro)
        p = _rgt("pull", RUN, "--to", to, cwd=str(tmp_path))
        assert p.returncode == 9, p.stderr
        line = _one_line(p)
        assert f"cannot pull into {to}" in line and "--to" in line, line
        assert os.listdir(ro) == []
    finally:
        subprocess.run(["umount", str(ro)], check=True)


# ---- rgt-agent restore from a hostile store, into a hostile target


def _sealed(tmp_path: Path) -> Store:
    store = _file_store(tmp_path)
    _seal(str(tmp_path), store, 5, {"model.pt": b"the sealed weights"})
    return store


def _restore(cli: Cli, store: Store, dest: str) -> subprocess.CompletedProcess[str]:
    return cli("restore", "--store", store.url, "--name", RUN, "--to", dest)


def _bytes_under(root: str) -> List[bytes]:
    out = []
    for here, _, files in os.walk(root):
        for n in files:
            with open(os.path.join(here, n), "rb") as f:
                out.append(f.read())
    return out


def test_restore_refuses_a_store_key_that_is_a_symlink(cli: Cli, tmp_path: Path) -> None:
    """The key points at a file outside the store, and the MANIFEST was made to match it:
    restore copied that file into --to."""
    store = _sealed(tmp_path)
    secret = _plant(str(tmp_path / "secret"), SECRET)
    key_path = _object_file(store, 5, "step_5/model.pt")
    os.unlink(key_path)
    os.symlink(secret.path, key_path)

    def match_the_secret(doc: Dict[str, Any]) -> None:
        for f in doc["files"]:
            if f["path"] == "step_5/model.pt":
                f.update(size=len(SECRET), sha256=hashlib.sha256(SECRET).hexdigest())

    _edit_manifest(store, 5, match_the_secret)
    dest = str(tmp_path / "restored")
    p = _restore(cli, store, dest)
    assert p.returncode == 6, p.stdout + p.stderr
    line = _one_line(p)
    assert f"{key_path} is a symlink" in line and "no verified checkpoint left" in line, line
    assert not os.path.exists(dest) and SECRET not in _bytes_under(str(tmp_path / "restored"))
    secret.assert_intact()


@pytest.mark.parametrize("where", ["dir", "final"])
def test_restore_refuses_a_symlink_planted_in_the_target(
    cli: Cli, tmp_path: Path, where: str
) -> None:
    store = _sealed(tmp_path)
    outside = tmp_path / "outside"
    dest = tmp_path / "restored"
    if where == "dir":  # --to/step_5 -> outside: the files were written into outside/
        canary = _plant(str(outside / "model.pt"))
        dest.mkdir()
        os.symlink(str(outside), str(dest / "step_5"))
        link = dest / "step_5"
    else:  # --to/step_5/model.pt -> outside/model.pt
        canary = _plant(str(outside / "model.pt"))
        (dest / "step_5").mkdir(parents=True)
        link = dest / "step_5" / "model.pt"
        os.symlink(canary.path, str(link))
    p = _restore(cli, store, str(dest))
    assert p.returncode == 6, p.stdout + p.stderr
    line = _one_line(p)
    assert f"{link} is a symlink" in line, line
    canary.assert_intact()
    assert sorted(os.listdir(outside)) == ["model.pt"]
    assert os.path.islink(link)
    assert not [n for n in _tree(str(dest)) if ".rgt-restore" in n]  # the staging dir is gone
    # The store is not blamed: a refusal on this box quarantines nothing.
    assert not os.path.exists(_store_path(store, mf.quarantine_key(RUN, 5)))


def test_restore_of_a_manifest_with_a_nul_in_a_path_is_one_line(cli: Cli, tmp_path: Path) -> None:
    store = _sealed(tmp_path)
    _edit_manifest(store, 5, lambda d: _rename_file(d, "step_5/model\x00.pt"))
    dest = str(tmp_path / "restored")
    p = _restore(cli, store, dest)
    assert p.returncode == 6, p.stdout + p.stderr
    line = _one_line(p)
    assert "NUL" in line and "'step_5/model\\x00.pt'" in line, line
    assert not os.path.exists(dest)


def test_restore_refuses_a_manifest_path_inside_its_own_staging_dir(
    cli: Cli, tmp_path: Path
) -> None:
    """Such a file would be renamed into the staging dir and removed with it: restored, and
    gone. The sealer never seals a hidden name, so the MANIFEST was crafted."""
    store = _sealed(tmp_path)
    _edit_manifest(store, 5, lambda d: _rename_file(d, ".rgt-restore-x/model.pt"))
    p = _restore(cli, store, str(tmp_path / "restored"))
    assert p.returncode == 6, p.stdout + p.stderr
    assert "'.rgt-restore-x/model.pt', a name of rgt's own staging" in _one_line(p)
    assert not (tmp_path / "restored").exists()


def test_restore_with_a_dangling_symlink_under_checkpoints(cli: Cli, tmp_path: Path) -> None:
    """A stray dangling symlink next to a checkpoint's files is listed, never followed, and
    the checkpoint restores; one in place of a file the MANIFEST lists is refused (exit 6)."""
    store = _sealed(tmp_path)
    step_dir = os.path.dirname(_object_file(store, 5, "step_5/model.pt"))
    os.symlink(str(tmp_path / "nowhere"), os.path.join(step_dir, "stray"))
    dest = str(tmp_path / "restored")
    p = _restore(cli, store, dest)
    assert p.returncode == 0, p.stdout + p.stderr
    with open(os.path.join(dest, "step_5", "model.pt"), "rb") as f:
        assert f.read() == b"the sealed weights"

    os.unlink(os.path.join(step_dir, "model.pt"))
    os.symlink(str(tmp_path / "nowhere"), os.path.join(step_dir, "model.pt"))
    p = _restore(cli, store, str(tmp_path / "again"))
    assert p.returncode == 6, p.stdout + p.stderr
    assert "model.pt is a symlink" in _one_line(p)
    assert not os.path.exists(tmp_path / "again")


def test_restore_from_a_missing_store_leaves_no_empty_target(cli: Cli, tmp_path: Path) -> None:
    dest = tmp_path / "restored"
    p = cli(
        "restore", "--store", f"file://{tmp_path}/nonexistent", "--name", RUN, "--to", str(dest)
    )
    assert p.returncode == 8, p.stderr
    line = _one_line(p)
    assert "no sealed checkpoint" in line and "does not exist" in line, line
    assert not dest.exists()
    p = cli("restore", "--store", f"file://{tmp_path}/nonexistent/{RUN}", cwd=str(tmp_path))
    assert p.returncode == 8 and not (tmp_path / f"{RUN}-restored").exists(), p.stderr


@pytest.mark.parametrize(
    "to,code,needle",
    [
        ("/proc/x", 9, "cannot restore into /proc/x"),
        ("{tmp}/a-file", 9, "not a directory"),
        ("{tmp}/a-file/x", 9, "not a directory"),
        ("{tmp}/has-a-file", 9, "step_5 is not a directory"),
        ("{tmp}/has-a-dir", 9, "a directory is in its place"),
    ],
    ids=["proc", "a-file", "under-a-file", "a-file-on-the-way", "a-dir-in-place"],
)
def test_restore_into_a_target_that_cannot_be_written_is_one_line(
    cli: Cli, tmp_path: Path, to: str, code: int, needle: str
) -> None:
    store = _sealed(tmp_path)
    (tmp_path / "a-file").write_bytes(b"x")
    (tmp_path / "has-a-file").mkdir()
    (tmp_path / "has-a-file" / "step_5").write_bytes(b"x")
    (tmp_path / "has-a-dir" / "step_5" / "model.pt").mkdir(parents=True)
    before = _tree(str(tmp_path))
    p = _restore(cli, store, to.format(tmp=tmp_path))
    assert p.returncode == code, p.stdout + p.stderr
    line = _one_line(p)
    # The CLI puts the remedy in one pair of parentheses: none of its own inside it.
    assert needle in line and nesting(line) == 1, line
    assert _tree(str(tmp_path)) == before


def test_a_restore_that_fails_midway_removes_the_directories_it_made(
    cli: Cli, tmp_path: Path
) -> None:
    """A file the store holds damaged (not a hostile name): quarantined, the restore fails
    (exit 6), and --to, made for it, is gone again."""
    store = _sealed(tmp_path)
    with open(_object_file(store, 5, "step_5/model.pt"), "ab") as f:
        f.write(b"!")
    dest = tmp_path / "new" / "restored"
    p = _restore(cli, store, str(dest))
    assert p.returncode == 6, p.stdout + p.stderr
    assert "MANIFEST says" in _one_line(p)
    assert not (tmp_path / "new").exists()


def test_two_restores_into_one_directory_both_end_whole(cli: Cli, tmp_path: Path) -> None:
    """The agent's restore at start and a hand-run `rgt-agent restore --to` into the same
    directory: the second cleared every staging directory it found as a killed restore's, the
    first's live one included, and the first then failed with its files gone. Restore A is
    frozen (SIGSTOP) once its stage exists, B runs whole, A is let go and ends whole too; a
    stage a killed restore left is still cleared."""
    store = _file_store(tmp_path)
    files = {f"shard{i:04d}.bin": os.urandom(2048) for i in range(1500)}
    _seal(str(tmp_path), store, 5, files)
    dest = tmp_path / "target"
    dest.mkdir()
    left = dest / f"{STAGE_PREFIX}killed"  # what a SIGKILLed restore leaves
    left.mkdir()
    (left / "0").write_bytes(b"a copy of an object")
    a = subprocess.Popen(
        [*agent_exe(), "restore", "--store", store.url, "--name", RUN, "--to", str(dest)],
        env=cli.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and a.poll() is None:
            if [n for n in os.listdir(dest) if n.startswith(STAGE_PREFIX) and n != left.name]:
                a.send_signal(signal.SIGSTOP)
                break
            time.sleep(0.001)
        stages = [n for n in os.listdir(dest) if n.startswith(STAGE_PREFIX)]
        assert a.poll() is None and len(stages) == 1 and not left.exists(), stages
        assert not (dest / "step_5").exists()  # A is midway: nothing renamed into place yet
        b = _restore(cli, store, str(dest))
        assert b.returncode == 0, b.stdout + b.stderr
        # B left A's live stage alone
        assert sorted(os.listdir(dest)) == sorted(["step_5", *stages])
        a.send_signal(signal.SIGCONT)
        out, err = a.communicate(timeout=120)
        assert a.returncode == 0, out + err
    finally:
        if a.poll() is None:
            a.send_signal(signal.SIGCONT)
            a.kill()
            a.wait()
    assert sorted(os.listdir(dest)) == ["step_5"]
    for name, data in files.items():
        assert (dest / "step_5" / name).read_bytes() == data, name


def test_a_name_in_the_store_rgt_could_not_have_written_is_never_listed_as_a_key(
    tmp_path: Path,
) -> None:
    """A file put in a file:// store by hand (a backslash in its name) is no object of rgt's:
    it is never handed out as a key (to be read, pulled or deleted), and the listing of the
    run's own objects goes on past it (a restore's fallback lists them: eb87b45)."""
    store = _sealed(tmp_path)
    odd = os.path.join(os.path.dirname(_store_path(store, mf.manifest_key(RUN, 5))), "a\\b")
    with open(odd, "w") as f:
        f.write("x")
    keys = [info.key for info in store.list(f"{RUN}/checkpoints/")]
    assert mf.manifest_key(RUN, 5) in keys
    assert not [k for k in keys if "\\" in k or k.endswith("/a")], keys
