"""The platform's preemption notice, seen by a real agent over HTTP: a seal before any signal.

The cloud metadata servers cannot run here, so each test has a fake one (a stdlib HTTP server on
127.0.0.1, named "fake_metadata"): it serves the documented paths and, like the real ones, refuses
a request without the platform's header (IMDSv2 token: 401; GCP Metadata-Flavor: 403; Azure
Metadata: 400). The agent, the job, the store and the seal are real.
"""

from __future__ import annotations

import email.utils
import http.server
import json
import os
import signal
import threading
import time
import uuid
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest

from onbox.agent.notice import Metadata, NoticeWatcher
from tests.conftest import Cli, fixture
from tests.polling import latest_step, wait

WRITER = fixture("ckpt_writer.py")


class _Meta:
    """What the fake metadata server announces, and what it was asked."""

    def __init__(self) -> None:
        self.token = uuid.uuid4().hex
        self.aws_action: Optional[Dict[str, str]] = None
        self.aws_rebalance: Optional[Dict[str, str]] = None
        self.gcp_preempted = False
        self.azure_events: List[Dict[str, Any]] = []
        self.raw: Optional[str] = None  # served as the answer of every notice path, when set
        self.asked: List[Tuple[str, int]] = []  # (path, status)
        self.lock = threading.Lock()

    def count(self, path: str, status: int = 200) -> int:
        with self.lock:
            return sum(1 for p, s in self.asked if p == path and s == status)


def _handler(meta: _Meta) -> type:
    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _answer(self, status: int, body: str = "", ctype: str = "text/plain") -> None:
            if meta.raw is not None and status == 200 and "api/token" not in self.path:
                body = meta.raw
            with meta.lock:
                meta.asked.append((self.path, status))
            data = body.encode("utf-8", "surrogateescape")
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_PUT(self) -> None:
            if self.path != "/latest/api/token":
                return self._answer(404)
            if not self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                return self._answer(400)
            self._answer(200, meta.token)

        def do_GET(self) -> None:
            p = self.path
            if p.startswith("/latest/"):
                if self.headers.get("X-aws-ec2-metadata-token") != meta.token:
                    return self._answer(401)
                doc = {
                    "/latest/meta-data/spot/instance-action": meta.aws_action
                    or ({} if meta.raw is not None else None),
                    "/latest/meta-data/events/recommendations/rebalance": meta.aws_rebalance,
                }.get(p)
                if doc is None:
                    return self._answer(404)
                return self._answer(200, json.dumps(doc), "application/json")
            if p == "/computeMetadata/v1/instance/preempted":
                if self.headers.get("Metadata-Flavor") != "Google":
                    return self._answer(403)
                return self._answer(200, "TRUE" if meta.gcp_preempted else "FALSE")
            if p == "/metadata/scheduledevents?api-version=2020-07-01":
                if self.headers.get("Metadata") != "true":
                    return self._answer(400)
                got = {"DocumentIncarnation": len(meta.azure_events), "Events": meta.azure_events}
                return self._answer(200, json.dumps(got), "application/json")
            self._answer(404)

    return Handler


@pytest.fixture
def fake_metadata() -> Iterator[Tuple[_Meta, str]]:
    meta = _Meta()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(meta))
    # shutdown() waits one poll: 0.05 s, not the default 0.5.
    t = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    t.start()
    yield meta, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    t.join(5)


def _event(cli: Cli, name: str, kind: str) -> List[Dict[str, Any]]:
    return [e for e in cli.events(name) if e["kind"] == kind]


def _start(
    cli: Cli, tmp_path: Any, name: str, profile: str, base: str, trigger: str = "signal:USR2"
) -> Tuple[str, int]:
    """A run under ``profile`` whose job checkpoints on SIGUSR2; (store root, job pid), with
    step 1 sealed the normal way."""
    root = str(tmp_path / "durable")
    os.makedirs(root, exist_ok=True)
    job = os.path.join(cli.home, f"{name}.toml")
    with open(job, "w") as f:
        f.write(
            f'profile = "{profile}"\n'
            f"command = {json.dumps([*WRITER, 'on_signal', '1'])}\n"
            f'store = "file://{root}"\n[checkpoint]\ntrigger = "{trigger}"\n'
        )
    cli.env["RGT_METADATA_URL"] = base
    cli.env["RGT_NOTICE_POLL"] = "0.3"
    cli("start", job, "--name", name, check=True)
    st = cli.wait_state(name, "RUNNING", "STARTING")
    wait(lambda: "ready" in cli.log_text(name), what="the job to be ready")
    os.kill(st["pid"], signal.SIGUSR2)
    wait(lambda: latest_step(root, name) == 1, what="step 1 sealed")
    return root, int(st["pid"])


def _assert_sealed_before_any_signal(
    cli: Cli, name: str, root: str, pid: int, lead: float
) -> Dict[str, Any]:
    done = wait(lambda: _event(cli, name, "notice_sealed"), what="the notice's seal")[0]
    assert latest_step(root, name) == 2  # the checkpoint the job wrote when the notice came
    assert done["step"] == 2
    notice = _event(cli, name, "preemption_notice")
    assert len(notice) == 1, notice
    assert 0 < notice[0]["ahead_s"] <= lead + 1, notice
    assert 0 < done["before_s"] <= notice[0]["ahead_s"], done
    os.kill(pid, 0)  # the job still runs: nothing was signalled to stop it
    st = cli.status(name)
    assert st["state"] in ("STARTING", "RUNNING") and st["pid"] == pid
    kinds = [e["kind"] for e in cli.events(name)]
    assert "preempt" not in kinds and "stop" not in kinds, kinds
    return notice[0]


def _one_seal_per_notice(cli: Cli, name: str, meta: _Meta, path: str) -> None:
    seen = meta.count(path)
    wait(lambda: meta.count(path) >= seen + 5, what="more polls of the same notice")
    assert len(_event(cli, name, "preemption_notice")) == 1
    asked = [e for e in _event(cli, name, "checkpoint_asked") if "notice" in e["reason"]]
    assert len(asked) == 1, asked


def test_fake_metadata_aws_notice_seals_before_any_signal(
    cli: Cli, tmp_path: Any, fake_metadata: Tuple[_Meta, str]
) -> None:
    meta, base = fake_metadata
    root, pid = _start(cli, tmp_path, "naws", "aws-spot", base)
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 120))
    meta.aws_action = {"action": "terminate", "time": when}
    notice = _assert_sealed_before_any_signal(cli, "naws", root, pid, 120)
    assert notice["notice"] == "aws" and "terminate" in notice["announced"]
    _one_seal_per_notice(cli, "naws", meta, "/latest/meta-data/spot/instance-action")
    assert meta.count("/latest/meta-data/spot/instance-action", 401) == 0  # IMDSv2 all along
    cli("stop", "naws", "--grace", "5", check=True)


def test_fake_metadata_aws_rebalance_recommendation_seals_too(
    cli: Cli, tmp_path: Any, fake_metadata: Tuple[_Meta, str]
) -> None:
    meta, base = fake_metadata
    root, _ = _start(cli, tmp_path, "nreb", "aws-spot", base)
    meta.aws_rebalance = {"noticeTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    done = wait(lambda: _event(cli, "nreb", "notice_sealed"), what="the seal")[0]
    assert done["step"] == 2 and latest_step(root, "nreb") == 2
    assert "rebalance" in _event(cli, "nreb", "preemption_notice")[0]["announced"]
    cli("stop", "nreb", "--grace", "5", check=True)


def test_fake_metadata_gcp_preempted_seals(
    cli: Cli, tmp_path: Any, fake_metadata: Tuple[_Meta, str]
) -> None:
    meta, base = fake_metadata
    root, pid = _start(cli, tmp_path, "ngcp", "gcp-spot", base)
    meta.gcp_preempted = True
    notice = _assert_sealed_before_any_signal(cli, "ngcp", root, pid, 30)
    assert notice["notice"] == "gcp"
    assert meta.count("/computeMetadata/v1/instance/preempted", 403) == 0
    cli("stop", "ngcp", "--grace", "5", check=True)


def test_fake_metadata_azure_preempt_event_seals(
    cli: Cli, tmp_path: Any, fake_metadata: Tuple[_Meta, str]
) -> None:
    meta, base = fake_metadata
    root, pid = _start(cli, tmp_path, "naz", "azure-spot", base)
    not_before = email.utils.formatdate(time.time() + 30, usegmt=True)
    meta.azure_events = [
        {"EventId": "A1", "EventType": "Freeze", "NotBefore": not_before},  # not a preemption
        {"EventId": "B2", "EventType": "Preempt", "NotBefore": not_before, "Resources": ["vm"]},
    ]
    notice = _assert_sealed_before_any_signal(cli, "naz", root, pid, 30)
    assert notice["notice"] == "azure"
    path = "/metadata/scheduledevents?api-version=2020-07-01"
    _one_seal_per_notice(cli, "naz", meta, path)
    assert meta.count(path, 400) == 0
    cli("stop", "naz", "--grace", "5", check=True)


def test_fake_metadata_no_notice_forces_no_seal(
    cli: Cli, tmp_path: Any, fake_metadata: Tuple[_Meta, str]
) -> None:
    meta, base = fake_metadata
    root, pid = _start(cli, tmp_path, "nnone", "aws-spot", base)
    path = "/latest/meta-data/spot/instance-action"
    wait(lambda: meta.count(path, 404) >= 5, what="polls answered 404")
    assert meta.count(path, 401) == 0
    assert not _event(cli, "nnone", "preemption_notice")
    assert latest_step(root, "nnone") == 1
    assert not [e for e in _event(cli, "nnone", "checkpoint_asked") if "notice" in e["reason"]]
    os.kill(pid, 0)
    cli("stop", "nnone", "--grace", "5", check=True)


def test_fake_metadata_refuses_requests_without_the_platform_header(
    fake_metadata: Tuple[_Meta, str],
) -> None:
    """The fake is strict like the real servers, so the tests above can fail."""
    import urllib.error
    import urllib.request

    _, base = fake_metadata
    for path, code in (
        ("/latest/meta-data/spot/instance-action", 401),
        ("/computeMetadata/v1/instance/preempted", 403),
        ("/metadata/scheduledevents?api-version=2020-07-01", 400),
    ):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(base + path, timeout=5)
        assert e.value.code == code
        e.value.close()


def test_fake_metadata_nonsense_is_quiet(fake_metadata: Tuple[_Meta, str]) -> None:
    """Whatever the server answers, a poll never raises into the agent: nonsense is no notice,
    and an odd but well-formed Preempt event is still one."""
    meta, base = fake_metadata
    events: List[Tuple[str, Dict[str, Any]]] = []
    nonsense = ["not json", "[1, 2]", '"a string"', '{"action": 5, "time": null}', "[" * 100000]
    nonsense += ['{"Events": "x"}', '{"Events": [5, null]}', "\u0000\udcff" * 1000]
    for kind in ("aws", "gcp", "azure"):
        for raw in nonsense:
            meta.raw = raw
            w = NoticeWatcher(Metadata(kind, base), lambda k, r, **kw: events.append((k, kw)), None)
            w.step()
    assert {k for k, _ in events} <= {"preemption_notice"}, events
    assert [kw["notice"] for _, kw in events] == ["aws"]  # {"action": 5}: an action, no time
    meta.raw = '{"Events": [{"EventType": "Preempt", "NotBefore": 7}]}'
    n = Metadata("azure", base).poll()
    assert n is not None and n.at is None


def test_fake_metadata_is_asked_past_a_proxy(
    fake_metadata: Tuple[_Meta, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A box's http_proxy (AutoDL's network_turbo sets one) cannot reach link-local servers."""
    meta, base = fake_metadata
    for var in ("http_proxy", "HTTP_PROXY"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    meta.gcp_preempted = True
    n = Metadata("gcp", base, lead=30).poll()
    assert n is not None and n.kind == "gcp" and n.at is not None


def test_fake_metadata_notice_without_a_trigger_seals_what_the_box_holds(
    cli: Cli, tmp_path: Any, fake_metadata: Tuple[_Meta, str]
) -> None:
    """A job that cannot be asked for a checkpoint: the notice seals what is on the box (here
    step 1, sealed already) and says so, asking the job for nothing."""
    meta, base = fake_metadata
    root, pid = _start(cli, tmp_path, "ntrig", "aws-spot", base, trigger="none")
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 120))
    meta.aws_action = {"action": "stop", "time": when}
    done = wait(lambda: _event(cli, "ntrig", "notice_sealed"), what="the notice's seal")[0]
    assert done["step"] == 1 and latest_step(root, "ntrig") == 1
    assert not _event(cli, "ntrig", "checkpoint_asked")
    os.kill(pid, 0)
    cli("stop", "ntrig", "--grace", "5", check=True)
