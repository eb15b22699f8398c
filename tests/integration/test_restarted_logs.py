"""A run stopped or failed and started again on the same box: each attempt's log reaches the
store once, with its own bytes.

Before, the newer agent (a new epoch, the same run directory, whose attempts/ still held the
older attempts' logs) sealed every attempt's log again under its own epoch: the store held the
older attempts' logs twice (``logs/e1/attempt-0001.log`` and ``logs/e2/attempt-0001.log``),
and `rgt pull` brought them twice. Now an agent seals only the logs no agent sealed into that
store yet (the run directory's ``logs-sealed.json`` says which were); a log whose own agent was
killed before its log document was written is sealed by the next agent, under that agent's
epoch. Real agents on one RGT_HOME, a real file:// store, a real kill -9, real `rgt pull`
processes.
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any, Dict, List, Tuple

from controller.registry import Registry
from controller.remote import open_remote
from controller.results.down import plan_down
from onbox.common.rundir import RunDir
from tests.conftest import Cli
from tests.integration.test_preempted_logs import _pull, _start, _store_root
from tests.integration.test_pull import RUN, _read, _rec


def _pulled_logs(dest: Any) -> Dict[str, bytes]:
    """Every job log under the pull's ``logs/``, by its path there."""
    out = {}
    top = os.path.join(str(dest), "logs")
    for dirpath, _dirs, files in os.walk(top):
        for name in files:
            full = os.path.join(dirpath, name)
            out[os.path.relpath(full, top)] = _read(full)
    return out


def _doc(root: str, *parts: str) -> Dict[str, Any]:
    with open(os.path.join(root, RUN, *parts)) as f:
        doc: Dict[str, Any] = json.load(f)
    return doc


def _paths(doc: Dict[str, Any]) -> List[str]:
    return [x["path"] for x in doc["files"]]


def _failed(cli: Cli, tmp_path: Any, store: str, who: str) -> None:
    _start(cli, tmp_path, store, who, "fail")
    over = cli.wait_over(RUN, "FAILED", "STOPPED", "PREEMPTED", timeout=120)
    assert over["state"] == "FAILED", over


def _no_log_lost(cli: Cli, store: str) -> None:
    """Down's plan of the box calls no job log lost: each is pulled (or in the store)."""
    rec = _rec(store, cli.home)
    text = "\n".join(plan_down(rec, open_remote(rec.target)).lines())
    lost = text.split("will be lost")[1].split("\nkept:")[0] if "will be lost" in text else ""
    assert "job log" not in lost, text


def _pull_two(
    laptop: str,
    cli: Cli,
    dest: Any,
    store: str,
    first: Tuple[str, bytes],
    second: Tuple[str, bytes],
) -> bytes:
    """A real `rgt pull` of the run into ``dest`` brings two logs, named and holding what
    ``first`` and ``second`` say: box A's words in the first only, box A2's in the second.
    The first log's bytes."""
    Registry().put(_rec(store, cli.home))
    p = _pull(laptop, cli, dest)
    assert p.returncode == 0, (p.stdout, p.stderr)
    logs = _pulled_logs(dest)
    assert sorted(logs) == [first[0], second[0]], sorted(logs)
    one, two = logs[first[0]], logs[second[0]]
    assert first[1] in one and b"box A2" not in one, one
    assert second[1] in two and b"box A:" not in two, two
    return one


def test_a_run_failed_twice_on_one_box_has_each_attempts_log_pulled_once(
    cli: Cli, tmp_path: Any, laptop: str
) -> None:
    """Failed (epoch 1, attempt 1), started again on the same box, failed again (epoch 2,
    attempt 2). Before: e2.json and ENDED.json listed attempt 1's log again as
    ``e2/attempt-0001.log``, and the pull brought three logs for two attempts."""
    root = _store_root(tmp_path)
    store = f"file://{root}"
    _failed(cli, tmp_path, store, "A")
    assert _paths(_doc(root, "logs", "e1.json")) == ["e1/attempt-0001.log"]
    _failed(cli, tmp_path, store, "A2")
    assert _paths(_doc(root, "logs", "e2.json")) == ["e2/attempt-0002.log"]
    assert _paths(_doc(root, "ENDED.json")) == ["e2/attempt-0002.log"]

    _pull_two(
        laptop,
        cli,
        tmp_path / "dest",
        store,
        ("e1/attempt-0001.log", b"box A: RuntimeError"),
        ("e2/attempt-0002.log", b"box A2: RuntimeError"),
    )
    _no_log_lost(cli, store)


def test_a_log_whose_agent_was_killed_before_sealing_it_is_sealed_once_by_the_next(
    cli: Cli, tmp_path: Any, laptop: str
) -> None:
    """The first agent fails its run, then is killed with SIGKILL while it uploads the log
    (held there): no e1.json. Started again, the run fails once more: the new agent seals
    attempt 1's log (never sealed) and its own attempt 2's, each once, under its epoch."""
    root = _store_root(tmp_path)
    store = f"file://{root}"
    plain = dict(cli.env)
    # The upload of a file hangs (for good: the release file is never made) until the kill.
    cli.env.update(RGT_HOLD_AT="store.put_file", RGT_HOLD_UNTIL=str(tmp_path / "never"))
    _start(cli, tmp_path, store, "A", "fail")
    cli.wait_for(
        RUN,
        lambda s: s["state"] == "FAILED" and s["agent"]["alive"],
        timeout=120,
        what="FAILED, its agent alive and sealing",
    )
    os.kill(cli.status(RUN)["agent"]["pid"], signal.SIGKILL)
    cli.wait_for(RUN, lambda s: not s["agent"]["alive"], timeout=60, what="the agent gone")
    assert not os.path.exists(os.path.join(root, RUN, "logs", "e1.json"))
    cli.env.clear()
    cli.env.update(plain)

    _failed(cli, tmp_path, store, "A2")
    doc = _doc(root, "logs", "e2.json")
    assert _paths(doc) == ["e2/attempt-0001.log", "e2/attempt-0002.log"], doc
    first = _pull_two(
        laptop,
        cli,
        tmp_path / "dest",
        store,
        ("e2/attempt-0001.log", b"box A: RuntimeError"),
        ("e2/attempt-0002.log", b"box A2: RuntimeError"),
    )

    # A third end on this box seals nothing again: both logs are in the store already.
    _failed(cli, tmp_path, store, "A3")
    assert _paths(_doc(root, "logs", "e3.json")) == ["e3/attempt-0003.log"]
    again = tmp_path / "again"
    p = _pull(laptop, cli, again)
    assert p.returncode == 0, (p.stdout, p.stderr)
    logs = _pulled_logs(again)
    assert sorted(logs) == [
        "e2/attempt-0001.log",
        "e2/attempt-0002.log",
        "e3/attempt-0003.log",
    ], sorted(logs)
    assert logs["e2/attempt-0001.log"] == first and b"box A3" in logs["e3/attempt-0003.log"]
    _no_log_lost(cli, store)


def test_a_run_stopped_then_started_again_and_succeeded_has_each_log_pulled_once(
    cli: Cli, tmp_path: Any, laptop: str
) -> None:
    """Stopped (epoch 1, attempt 1: its log sealed with ENDED.json), started again on the same
    box, succeeded (epoch 2, attempt 2). Before: DONE.json listed attempt 1's log again as
    ``e2/attempt-0001.log``, and the pull brought it twice."""
    root = _store_root(tmp_path)
    store = f"file://{root}"
    _start(cli, tmp_path, store, "A", "run")
    cli.wait_output(RUN, "box A: ready")
    cli("stop", RUN, check=True, timeout=120)
    over = cli.wait_over(RUN, "STOPPED", "FAILED", "PREEMPTED", timeout=120)
    assert over["state"] == "STOPPED", over
    assert _paths(_doc(root, "logs", "e1.json")) == ["e1/attempt-0001.log"]
    _start(cli, tmp_path, store, "A2", "ok")
    over = cli.wait_over(RUN, "SUCCEEDED", "FAILED", "STOPPED", timeout=120)
    assert over["state"] == "SUCCEEDED", over
    done = _doc(root, "DONE.json")
    assert [p for p in _paths(done) if p.endswith(".log")] == ["e2/attempt-0002.log"], done

    _pull_two(
        laptop,
        cli,
        tmp_path / "dest",
        store,
        ("e1/attempt-0001.log", b"box A: ready"),
        ("e2/attempt-0002.log", b"box A2: done"),
    )
    _no_log_lost(cli, store)


def _record(cli: Cli) -> Dict[str, Any]:
    """The run directory's logs-sealed.json: which attempts' logs are in the store."""
    with open(RunDir(RUN, cli.home).sealed_logs) as f:
        doc: Dict[str, Any] = json.load(f)["attempts"]
    return doc


def test_a_damaged_record_of_sealed_logs_is_learnt_again_from_the_stores_documents(
    cli: Cli, tmp_path: Any, laptop: str
) -> None:
    """Failed (epoch 1, attempt 1 sealed with e1.json), then logs-sealed.json damaged on the box,
    started again, failed again. Before: a record that could not be read counted as none, and
    e2.json listed attempt 1's log again (``e2/attempt-0001.log``), pulled twice. Now the agent
    learns from e1.json, which lists a copy of that log's very bytes, that it is sealed."""
    root = _store_root(tmp_path)
    store = f"file://{root}"
    _failed(cli, tmp_path, store, "A")
    assert _paths(_doc(root, "logs", "e1.json")) == ["e1/attempt-0001.log"]
    with open(RunDir(RUN, cli.home).sealed_logs, "wb") as f:
        f.write(b'{"attempts": {"1": {"epo')  # damaged: not a document rgt wrote
    _failed(cli, tmp_path, store, "A2")
    assert _paths(_doc(root, "logs", "e2.json")) == ["e2/attempt-0002.log"]
    assert _paths(_doc(root, "ENDED.json")) == ["e2/attempt-0002.log"]
    was = _record(cli)
    assert was["1"]["path"] == "e1/attempt-0001.log" and was["1"]["epoch"] == 1, was
    assert was["2"]["path"] == "e2/attempt-0002.log", was
    _pull_two(
        laptop,
        cli,
        tmp_path / "dest",
        store,
        ("e1/attempt-0001.log", b"box A: RuntimeError"),
        ("e2/attempt-0002.log", b"box A2: RuntimeError"),
    )
    _no_log_lost(cli, store)


def test_a_damaged_record_and_no_document_listing_a_log_has_it_sealed_again(
    cli: Cli, tmp_path: Any, laptop: str
) -> None:
    """As above, but e1.json is gone from the store too (its log object left, named by no
    document): nothing shows attempt 1's log sealed, so the next agent seals it again under
    its epoch; when in doubt a log is sealed, never left out."""
    root = _store_root(tmp_path)
    store = f"file://{root}"
    _failed(cli, tmp_path, store, "A")
    with open(RunDir(RUN, cli.home).sealed_logs, "wb") as f:
        f.write(b"[]")  # not a record rgt writes
    os.unlink(os.path.join(root, RUN, "logs", "e1.json"))
    os.unlink(os.path.join(root, RUN, "ENDED.json"))
    _failed(cli, tmp_path, store, "A2")
    assert _paths(_doc(root, "logs", "e2.json")) == ["e2/attempt-0001.log", "e2/attempt-0002.log"]
    _pull_two(
        laptop,
        cli,
        tmp_path / "dest",
        store,
        ("e2/attempt-0001.log", b"box A: RuntimeError"),
        ("e2/attempt-0002.log", b"box A2: RuntimeError"),
    )
    _no_log_lost(cli, store)


def test_an_agent_killed_between_its_log_document_and_the_record_leaves_no_duplicate(
    cli: Cli, tmp_path: Any, laptop: str
) -> None:
    """The first agent fails its run, writes e1.json, and is killed (as SIGKILL would) before
    logs-sealed.json says so. Before: the next agent, finding attempt 1 unrecorded, sealed it
    again as ``e2/attempt-0001.log``. Now the record names e1.json before it is written, and
    the next agent finds the log there, so it seals only its own."""
    root = _store_root(tmp_path)
    store = f"file://{root}"
    plain = dict(cli.env)
    cli.env.update(RGT_CRASH_AT="logs.before_record")
    _start(cli, tmp_path, store, "A", "fail")
    cli.wait_for(
        RUN,
        lambda s: s["state"] == "FAILED" and not s["agent"]["alive"],
        timeout=120,
        what="FAILED and the agent gone",
    )
    cli.env.clear()
    cli.env.update(plain)
    assert _paths(_doc(root, "logs", "e1.json")) == ["e1/attempt-0001.log"]
    assert _record(cli)["1"].get("doc") == f"{RUN}/logs/e1.json"  # cut off: still pending

    _failed(cli, tmp_path, store, "A2")
    assert _paths(_doc(root, "logs", "e2.json")) == ["e2/attempt-0002.log"]
    assert "doc" not in _record(cli)["1"]
    _pull_two(
        laptop,
        cli,
        tmp_path / "dest",
        store,
        ("e1/attempt-0001.log", b"box A: RuntimeError"),
        ("e2/attempt-0002.log", b"box A2: RuntimeError"),
    )
    _no_log_lost(cli, store)
