"""`rgt down` stops the meter: each provider's API, as a fake HTTP server on 127.0.0.1.

A cloud provider's API cannot run here, so each test uses a fake of it (hence "fake" in every
name): stdlib http.server in a thread, implementing the documented endpoints and auth (Bearer)
of RunPod, vast.ai, Lambda and Paperspace, and recording every request. What a user relies on:
down calls the provider only after the receipt gate and the typed confirmation; it sends exactly
the documented calls for the one resource it was pointed at; it sends the stop call once, even
when its outcome is unknown (a second down only polls); it polls until the resource is really
gone; and a refusal or an unknown end is typed, with its own exit code.

The runs are real agent runs on this machine (tests/integration/test_down.py's ``Box``); the
scenarios that need no box call controller.meter with a journal directory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest

from controller.meter import journal
from controller.meter.stop import Step, stop_meter
from controller.registry import Registry, RunRecord
from controller.results.down import down
from controller.results.pull import pull
from onbox.common.errors import (
    IntegrityError,
    MeterNotSent,
    MeterRefused,
    MeterUnresolved,
    NotFound,
)
from onbox.profiles.load import load as load_profile
from tests.integration import test_down
from tests.integration.test_down import RUN, Box

# test_down's fixture: a real agent run with one sealed checkpoint (the laptop home: conftest's).
box = test_down.box

KEY = "k3y-" + "x" * 20
IDS = {"runpod": "pod1abc", "vastai": "4242", "lambda": "0920582c7ff041399e34823a0be62549",
       "paperspace": "psabc123"}  # fmt: skip
# api -> (profile name, key variable, base URL variable)
APIS = {
    "runpod": ("runpod", "RUNPOD_API_KEY", "RGT_RUNPOD_API"),
    "vastai": ("vastai", "VAST_API_KEY", "RGT_VAST_API"),
    "lambda": ("lambda", "LAMBDA_API_KEY", "RGT_LAMBDA_API"),
    "paperspace": ("paperspace", "PAPERSPACE_API_KEY", "RGT_PAPERSPACE_API"),
}
# The documented stop call of each: (method, path, body).
STOP = {
    "runpod": ("DELETE", "/pods/pod1abc", None),
    "vastai": ("DELETE", "/instances/4242/", None),
    "lambda": (
        "POST",
        "/instance-operations/terminate",
        {"instance_ids": ["0920582c7ff041399e34823a0be62549"]},
    ),
    "paperspace": ("PATCH", "/machines/psabc123/stop", None),
}
SHOW = {
    "runpod": "/pods/pod1abc",
    "vastai": "/instances/4242/",
    "lambda": "/instances/0920582c7ff041399e34823a0be62549",
    "paperspace": "/machines/psabc123",
}


class FakeApi:
    """One provider's API: ``present`` (does it have the resource), ``linger`` (how many shows
    after the stop still list it as running), ``stop_mode`` ("ok", "drop": read the request and
    close the connection without an answer, or an HTTP status to answer with), ``exited`` (a
    vast.ai instance that was stopped, not destroyed: its disk still bills), ``page`` (raw bytes
    the show answers with HTTP 200 instead of the API's document, as a proxy's maintenance page
    does; from the start, or only once stopped when ``page_after_stop``), ``show_status`` (an
    HTTP status every show answers with, as an API that is down answers 503)."""

    def __init__(self, api: str) -> None:
        self.api = api
        self.present = True
        self.linger = 0
        self.stop_mode: Any = "ok"
        self.stopped = False
        self.exited = False
        self.page: Optional[bytes] = None
        self.page_after_stop = False
        self.show_status: Optional[int] = None
        self.requests: List[Tuple[str, str, str, Any]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _any(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n) if n else b""
                body = json.loads(raw) if raw else None
                auth = self.headers.get("Authorization", "")
                fake.requests.append((self.command, self.path, auth, body))
                status, doc = fake.answer(self.command, self.path, auth, body)
                if status == 0:  # drop: no answer at all
                    self.close_connection = True
                    return
                if status == -1:  # hang: answer only after the client's timeout
                    time.sleep(3)
                    status, doc = 200, {"data": {"terminated_instances": []}}
                page = isinstance(doc, bytes)  # a page, not the API's JSON
                out = doc if page else json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/html" if page else "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            do_GET = do_DELETE = do_POST = do_PATCH = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        # Polled for shutdown every 0.05 s, not the default 0.5: close() waits one poll for
        # each of the four fakes, and every test of this file closes them.
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)

    def answer(self, method: str, path: str, auth: str, body: Any) -> Tuple[int, Any]:
        if auth != f"Bearer {KEY}":
            return 401, {"error": "invalid api key"}
        if (method, path, body) == STOP[self.api]:
            if self.stop_mode in ("drop", "hang"):
                self.stopped = True  # the provider acted; its answer never came in time
                return (0 if self.stop_mode == "drop" else -1), None
            if self.stop_mode == "page":  # a proxy's 200 page: whether it reached vast, unknown
                self.stopped = True
                return 200, b"<html><body>502 upstream, retried</body></html>"
            if self.stop_mode == "nosuccess":
                return 200, {"success": False, "error": "busy"}
            if self.stop_mode != "ok":
                return int(self.stop_mode), {"error": "not allowed"}
            if not self.present:
                return 404, {"error": "not found"}
            self.stopped = True
            return 200, {"success": True}
        if method == "GET" and path == SHOW[self.api]:
            return self._show()
        return 404, {"error": f"no such endpoint {method} {path}"}

    def _show(self) -> Tuple[int, Any]:
        if self.show_status is not None:
            return self.show_status, {"error": "upstream unavailable"}
        if self.page is not None and (self.stopped or not self.page_after_stop):
            return 200, self.page
        running = self.present and (not self.stopped or self.linger > 0)
        if self.stopped and self.linger > 0:
            self.linger -= 1
        ident = IDS[self.api]
        if self.api == "runpod":
            return (200, {"id": ident, "desiredStatus": "RUNNING"}) if running else (404, {})
        if self.api == "vastai":
            if not self.present:
                return 200, {"instances": None}
            if running:
                status = "exited" if self.exited else "running"
                return 200, {"instances": {"id": 4242, "actual_status": status}}
            # VAST15: after the destroy's 200 it still shows, exited, then null.
            return 200, {"instances": {"id": 4242, "actual_status": "exited"}}
        if self.api == "lambda":
            if not self.present:
                return 404, {"error": {"code": "global/object-does-not-exist"}}
            return 200, {"data": {"id": ident, "status": "active" if running else "terminated"}}
        if not self.present:
            return 404, {"error": "not found"}
        return 200, {"id": ident, "state": "ready" if running else "off"}

    def calls(self) -> List[Tuple[str, str]]:
        return [(m, p) for m, p, _, _ in self.requests]

    def stops(self) -> int:
        return sum(1 for m, p, _, b in self.requests if (m, p, b) == STOP[self.api])


@pytest.fixture
def fakes(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Dict[str, FakeApi]]:
    """A fake of every provider's API, each named to rgt by its RGT_*_API and key."""
    d = tmp_path / "profiles"
    d.mkdir()  # the shipped profiles, and no user's file over them
    monkeypatch.setenv("RGT_PROFILES_DIR", str(d))
    for v in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy"):
        monkeypatch.delenv(v, raising=False)
    out = {api: FakeApi(api) for api in APIS}
    for api, (_, key_var, url_var) in APIS.items():
        monkeypatch.setenv(key_var, KEY)
        monkeypatch.setenv(url_var, out[api].url)
    monkeypatch.setenv("RGT_METER_TIMEOUT", "5")
    yield out
    for f in out.values():
        f.close()


def _record(b: Box, profile: str, instance: Optional[str]) -> RunRecord:
    rec = dataclasses.replace(b.record(), profile=profile, instance=instance)
    Registry().put(rec)
    return rec


def _profile(api: str) -> Any:
    return load_profile(APIS[api][0], [os.environ["RGT_PROFILES_DIR"]])


# ---- through rgt down, on a real run


def test_fake_runpod_rgt_down_cli_terminates_the_pod_only_after_the_gate(
    box: Box, tmp_path: Any, fakes: Dict[str, FakeApi]
) -> None:
    """The real `rgt down` command: refused without a receipt (no request), then after a pull
    it terminates the pod it was pointed at (--instance) and polls until RunPod says 404."""
    fake = fakes["runpod"]
    _record(box, "runpod", None)
    rgt = [os.path.join(os.path.dirname(sys.executable), "rgt")]
    argv = [*rgt, "down", RUN, "--yes", "--instance", IDS["runpod"]]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert p.returncode == 7, p.stderr
    assert "no verification receipt" in p.stderr and fake.requests == []
    box.intact()

    pull(Registry().get(RUN), str(tmp_path / "dest"), "store")
    # No API key: refused before anything is done on the box or sent.
    env = {k: v for k, v in os.environ.items() if k != "RUNPOD_API_KEY"}
    p = subprocess.run(
        argv, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL, env=env
    )
    assert p.returncode == 2 and "RUNPOD_API_KEY: not set" in p.stderr, p.stderr
    assert fake.requests == []
    box.intact()

    fake.linger = 2
    p = subprocess.run(argv, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stdout + p.stderr
    # The plan said what the terminate leaves and what keeps billing, before anything was done.
    assert "down will terminate the pod pod1abc through RunPod's API (irreversible)" in p.stdout
    assert "volume (/workspace): LOST" in p.stdout
    assert "network-volume (/workspace): survives" in p.stdout
    assert "keeps billing after the terminate: Network Volumes bill" in p.stdout
    assert "danger, stale-stopped" in p.stdout
    assert "terminate confirmed" in p.stdout
    assert (
        fake.calls()
        == [("GET", "/pods/pod1abc"), ("DELETE", "/pods/pod1abc")] + [("GET", "/pods/pod1abc")] * 3
    )
    assert {auth for _, _, auth, _ in fake.requests} == {f"Bearer {KEY}"}
    assert KEY not in p.stdout + p.stderr
    with open(journal.journal_path(RUN)) as f:
        text = f.read()
    assert KEY not in text and json.loads(text)["state"] == "confirmed"
    with pytest.raises(NotFound):
        Registry().get(RUN)
    assert not os.path.exists(box.run_dir)


@pytest.mark.parametrize("api", ["vastai", "lambda", "paperspace"])
def test_fake_provider_rgt_down_sends_exactly_the_documented_calls(
    box: Box, tmp_path: Any, fakes: Dict[str, FakeApi], api: str
) -> None:
    rec = _record(box, APIS[api][0], IDS[api])  # rgt deploy --instance ID recorded it
    pull(rec, str(tmp_path / "dest"), "store")
    shown: List[str] = []
    plan = down(rec, yes=True, interactive=False, ask=lambda p: "", show=shown.append)
    fake = fakes[api]
    method, path, body = STOP[api]
    assert [(m, p, b) for m, p, _, b in fake.requests] == [
        ("GET", SHOW[api], None),
        (method, path, body),
        ("GET", SHOW[api], None),
    ]
    assert all(auth == f"Bearer {KEY}" for _, _, auth, _ in fake.requests)
    assert any(d.startswith("meter: confirmed") for d in plan.done)
    assert all(not f.requests for a, f in fakes.items() if a != api)  # no other provider
    if api == "paperspace":
        assert "(reversible)" in "\n".join(shown) and "shut-down confirmed, off" in shown[-2]
        # The store is on the notebook's root (/), wiped at the shut-down: nothing to keep.
        with pytest.raises(NotFound):
            Registry().get(RUN)
    else:  # on no storage of the profile's, so not deleted with it: kept for `rgt pull`
        assert Registry().get(RUN).down_at is not None


def test_fake_autodl_down_prints_the_console_steps_and_calls_nothing(
    box: Box, tmp_path: Any, fakes: Dict[str, FakeApi]
) -> None:
    rec = _record(box, "autodl", "whatever-id")
    pull(rec, str(tmp_path / "dest"), "store")
    shown: List[str] = []
    down(rec, yes=True, interactive=False, ask=lambda p: "", show=shown.append)
    text = "\n".join(shown)
    steps = load_profile("autodl").meter.console_steps
    assert steps and all(f"{i}. {s}" in text for i, s in enumerate(steps, 1))
    assert "keeps billing until you stop it in your provider's console" in text
    assert "danger, auto-release" in text
    assert all(not f.requests for f in fakes.values())


def test_fake_runpod_unknown_outcome_second_down_only_polls(
    box: Box, tmp_path: Any, fakes: Dict[str, FakeApi], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The DELETE is taken and the connection dropped: unresolved (exit 17), the record stays;
    a second down never re-sends the DELETE, polls, and confirms once RunPod says 404."""
    fake = fakes["runpod"]
    fake.stop_mode, fake.linger = "drop", 10**6
    monkeypatch.setenv("RGT_METER_WAIT", "1")
    rec = _record(box, "runpod", IDS["runpod"])
    pull(rec, str(tmp_path / "dest"), "store")
    with pytest.raises(MeterUnresolved, match="got no answer") as info:
        down(rec, yes=True, interactive=False, ask=lambda p: "", show=lambda line: None)
    assert info.value.exit_code == 17
    assert "check https://www.console.runpod.io/pods" in info.value.line()
    assert Registry().get(RUN).instance == IDS["runpod"]  # kept for the second down
    assert not os.path.exists(box.run_dir) and fake.stops() == 1

    fake.linger = 1
    shown: List[str] = []
    plan = down(
        Registry().get(RUN), yes=True, interactive=False, ask=lambda p: "", show=shown.append
    )
    assert fake.stops() == 1  # one DELETE in all
    assert fake.calls()[-2:] == [("GET", "/pods/pod1abc")] * 2
    assert any("never sends it again" in line for line in shown)
    assert any(d.startswith("meter: confirmed") for d in plan.done)
    with pytest.raises(NotFound):
        Registry().get(RUN)


def test_fake_runpod_no_instance_stops_nothing_and_says_what_to_pass(
    box: Box, tmp_path: Any, fakes: Dict[str, FakeApi]
) -> None:
    rec = _record(box, "runpod", None)
    pull(rec, str(tmp_path / "dest"), "store")
    shown: List[str] = []
    down(rec, yes=True, interactive=False, ask=lambda p: "", show=shown.append)
    text = "\n".join(shown)
    assert "rgt was not told the pod's id" in text and f"rgt down {RUN} --instance ID" in text
    assert fakes["runpod"].requests == []
    assert Registry().get(RUN).name == RUN  # kept, for rgt down N --instance ID


# ---- the meter step alone, with a journal directory


def _step(api: str, home: str, shown: List[str], wait: str = "5") -> Step:
    env = dict(os.environ, RGT_METER_WAIT=wait)
    return Step("r9", _profile(api), IDS[api], shown.append, home, env, sleep=lambda s: None)


@pytest.mark.parametrize("api", list(APIS))
def test_fake_provider_listed_for_a_few_polls_after_the_stop_is_confirmed(
    fakes: Dict[str, FakeApi], tmp_path: Any, api: str
) -> None:
    fake = fakes[api]
    fake.linger = 3
    shown: List[str] = []
    out = stop_meter(_step(api, str(tmp_path), shown))
    assert out.kind == "confirmed" and out.stopped
    assert fake.stops() == 1
    assert fake.calls().count(("GET", SHOW[api])) == 1 + 3 + 1
    j = journal.load("r9", str(tmp_path))
    assert j is not None and j.state == "confirmed" and not j.unknown


@pytest.mark.parametrize("api", list(APIS))
def test_fake_provider_dropped_stop_is_unresolved_and_never_resent(
    fakes: Dict[str, FakeApi], tmp_path: Any, api: str
) -> None:
    fake = fakes[api]
    fake.stop_mode, fake.linger = "drop", 10**6
    shown: List[str] = []
    with pytest.raises(MeterUnresolved) as info:
        stop_meter(_step(api, str(tmp_path), shown, wait="0.5"))
    assert info.value.exit_code == 17 and "got no answer" in info.value.what
    j = journal.load("r9", str(tmp_path))
    assert j is not None and j.state == "unresolved" and j.unknown
    # A second down: polls only; still listed: unresolved again; then gone: confirmed.
    with pytest.raises(MeterUnresolved):
        stop_meter(_step(api, str(tmp_path), shown, wait="0.5"))
    fake.linger = 0
    if api == "vastai":  # VAST15: after a DELETE with no answer, "exited" is not gone yet
        with pytest.raises(MeterUnresolved, match="still listed: exited"):
            stop_meter(_step(api, str(tmp_path), shown, wait="0.5"))
        fake.present = False  # "instances": null
    assert stop_meter(_step(api, str(tmp_path), shown)).kind == "confirmed"
    assert fake.stops() == 1


@pytest.mark.parametrize("api", list(APIS))
def test_fake_provider_refused_stop_is_typed_and_not_retried(
    fakes: Dict[str, FakeApi], tmp_path: Any, api: str
) -> None:
    fake = fakes[api]
    fake.stop_mode = 403
    with pytest.raises(MeterRefused, match="refused to") as info:
        stop_meter(_step(api, str(tmp_path), []))
    assert info.value.exit_code == 16 and "nothing changed" in info.value.what
    assert fake.stops() == 1 and len(fake.requests) == 2  # the show, the one stop
    j = journal.load("r9", str(tmp_path))
    assert j is not None and j.state == "refused"


@pytest.mark.parametrize("api", list(APIS))
def test_fake_provider_wrong_key_is_refused_before_any_stop(
    fakes: Dict[str, FakeApi], tmp_path: Any, api: str
) -> None:
    step = _step(api, str(tmp_path), [])
    step.environ = dict(step.environ or {}, **{APIS[api][1]: "wrong"})
    with pytest.raises(MeterRefused, match="HTTP 401: invalid api key") as info:
        stop_meter(step)
    assert "wrong" not in info.value.line()
    assert fakes[api].calls() == [("GET", SHOW[api])]


@pytest.mark.parametrize("api", list(APIS))
def test_fake_provider_already_gone_sends_no_stop(
    fakes: Dict[str, FakeApi], tmp_path: Any, api: str
) -> None:
    fakes[api].present = False
    out = stop_meter(_step(api, str(tmp_path), []))
    assert out.kind == "gone" and out.stopped
    assert fakes[api].calls() == [("GET", SHOW[api])]


def test_fake_runpod_missing_key_sends_nothing(fakes: Dict[str, FakeApi], tmp_path: Any) -> None:
    step = _step("runpod", str(tmp_path), [])
    step.environ = {k: v for k, v in (step.environ or {}).items() if k != "RUNPOD_API_KEY"}
    with pytest.raises(Exception, match="RUNPOD_API_KEY: not set") as info:
        stop_meter(step)
    assert getattr(info.value, "exit_code", None) == 2
    assert fakes["runpod"].requests == []
    assert re.search(r"export RUNPOD_API_KEY=", str(getattr(info.value, "remedy", "")))


def test_fake_lambda_terminate_that_hangs_past_the_timeout_is_never_resent(
    fakes: Dict[str, FakeApi], tmp_path: Any
) -> None:
    """LAM14: the terminate call can hang. The client's timeout ends it, the outcome is
    unknown, and rgt re-queries state instead of sending the terminate again."""
    fake = fakes["lambda"]
    fake.stop_mode = "hang"
    step = _step("lambda", str(tmp_path), [])
    step.environ = dict(step.environ or {}, RGT_METER_TIMEOUT="1")
    out = stop_meter(step)
    assert out.kind == "confirmed"
    assert fake.stops() == 1 and fake.calls()[-1] == ("GET", SHOW["lambda"])
    j = journal.load("r9", str(tmp_path))
    assert j is not None and j.unknown and "no answer" in j.events[1]["what"]


def test_fake_runpod_bad_instance_id_is_refused_before_anything(
    fakes: Dict[str, FakeApi], tmp_path: Any, laptop: str
) -> None:
    rgt = os.path.join(os.path.dirname(sys.executable), "rgt")
    for argv in (["down", RUN], ["deploy", "local"]):
        p = subprocess.run(
            [rgt, *argv, "--instance", "../pods/x"], capture_output=True, text=True, timeout=60
        )
        assert p.returncode == 2 and "--instance: '../pods/x' is not a provider's id" in p.stderr
    step = _step("runpod", str(tmp_path), [])
    step.instance = "x/../../v2"  # from a record edited by hand: refused all the same
    with pytest.raises(Exception, match="is not a provider's id"):
        stop_meter(step)
    assert all(not f.requests for f in fakes.values())


# ---- what is not gone: an answer rgt cannot read, and a vast.ai instance only exited

PAGE = b"<html><body>503 upstream maintenance, try again later</body></html>"


@pytest.mark.parametrize("api,status", [(a, 503) for a in APIS] + [("runpod", 302)])
def test_fake_provider_show_answered_5xx_sends_nothing_and_says_not_sent(
    fakes: Dict[str, FakeApi], tmp_path: Any, api: str, status: int
) -> None:
    """The provider's API answers the first show 503 (or a redirect rgt does not follow): it
    answered, but not about the box. Nothing was sent and the box may still bill: not sent,
    exit 20 (not 3: the box was never asked; not 17: no call is out whose outcome is unknown).
    A later down, once the API answers, sends the stop and confirms."""
    fake = fakes[api]
    fake.show_status = status
    shown: List[str] = []
    with pytest.raises(MeterNotSent) as info:
        stop_meter(_step(api, str(tmp_path), shown))
    assert info.value.exit_code == 20
    line = info.value.line()
    assert f"answered HTTP {status}" in line and "nothing was sent" in line
    assert "may still be billing" in line and "rgt down r9 again later" in line
    assert fake.calls() == [("GET", SHOW[api])] and fake.stops() == 0
    j = journal.load("r9", str(tmp_path))
    assert j is None or not j.call_sent

    fake.show_status = None
    assert stop_meter(_step(api, str(tmp_path), shown)).kind == "confirmed"
    assert fake.stops() == 1


@pytest.mark.parametrize("api", list(APIS))
@pytest.mark.parametrize("page", [PAGE, b"", b"null"], ids=["html", "empty", "null"])
def test_fake_provider_show_200_that_is_no_json_object_is_unresolved_never_gone(
    fakes: Dict[str, FakeApi], tmp_path: Any, api: str, page: bytes
) -> None:
    """A show answered 200 with a maintenance page (or nothing, or JSON null) is not the 404
    that says gone: down must not report the box gone while it keeps billing. Not sent (exit
    20); a later down, once the API reads again, sends the stop and confirms."""
    fake = fakes[api]
    fake.page = page
    shown: List[str] = []
    with pytest.raises(MeterNotSent) as info:
        stop_meter(_step(api, str(tmp_path), shown))
    assert info.value.exit_code == 20
    line = info.value.line()
    assert "nothing was sent" in line and "may still be billing" in line
    assert "not a JSON object" in line and "gone" not in "\n".join(shown)
    assert fake.calls() == [("GET", SHOW[api])] and fake.stops() == 0
    j = journal.load("r9", str(tmp_path))
    assert j is None or j.state not in ("gone", "confirmed")

    fake.page = None
    out = stop_meter(_step(api, str(tmp_path), shown))
    assert out.kind == "confirmed" and fake.stops() == 1


@pytest.mark.parametrize("api", list(APIS))
def test_fake_provider_polled_show_200_that_is_no_json_is_unresolved_not_confirmed(
    fakes: Dict[str, FakeApi], tmp_path: Any, api: str
) -> None:
    """The stop was accepted, then every show answers a maintenance page: rgt cannot tell
    whether the box is gone, so the end is unresolved (exit 17), never confirmed."""
    fake = fakes[api]
    fake.page, fake.page_after_stop = PAGE, True
    with pytest.raises(MeterUnresolved) as info:
        stop_meter(_step(api, str(tmp_path), [], wait="0.5"))
    assert info.value.exit_code == 17
    assert "may still be billing" in info.value.what and "not a JSON object" in info.value.what
    j = journal.load("r9", str(tmp_path))
    assert j is not None and j.state == "unresolved"
    fake.page = None  # the API reads again: a second down polls only and confirms
    assert stop_meter(_step(api, str(tmp_path), [])).kind == "confirmed"
    assert fake.stops() == 1


@pytest.mark.parametrize("doc", [b"{}", b'{"success": false, "error": "busy"}'])
def test_fake_vast_show_without_instances_is_not_gone(
    fakes: Dict[str, FakeApi], tmp_path: Any, doc: bytes
) -> None:
    """vast.ai's not-found is "instances": null; a document with no "instances" at all is not
    it: the instance is still listed, and the destroy is not confirmed by it."""
    fake = fakes["vastai"]
    fake.page = doc
    with pytest.raises(MeterUnresolved) as info:
        stop_meter(_step("vastai", str(tmp_path), [], wait="0.5"))
    assert info.value.exit_code == 17 and "may still be billing" in info.value.what
    j = journal.load("r9", str(tmp_path))
    assert j is not None and j.state == "unresolved"


def test_fake_runpod_down_with_a_maintenance_page_keeps_the_record(
    box: Box, tmp_path: Any, fakes: Dict[str, FakeApi]
) -> None:
    """Through down: RunPod's show answers an HTML page with 200. down fails, nothing sent (exit
    20), and keeps the run's record, so that a later down can still terminate the pod."""
    fake = fakes["runpod"]
    fake.page = PAGE
    rec = _record(box, "runpod", IDS["runpod"])
    pull(rec, str(tmp_path / "dest"), "store")
    shown: List[str] = []
    with pytest.raises(MeterNotSent) as info:
        down(rec, yes=True, interactive=False, ask=lambda p: "", show=shown.append)
    assert info.value.exit_code == 20 and "nothing was sent" in info.value.what
    assert not any("gone already" in line or " is down" in line for line in shown)
    assert Registry().get(RUN).instance == IDS["runpod"] and fake.stops() == 0


@pytest.mark.parametrize("stop_mode", [500, 404, "drop", "page", "nosuccess"])
def test_fake_vast_exited_instance_is_not_destroyed_unless_the_delete_was_accepted(
    fakes: Dict[str, FakeApi], tmp_path: Any, stop_mode: Any
) -> None:
    """VAST15: "exited" counts as destroyed only after the DELETE's 200. An exited instance
    (its disk still bills) whose DELETE was answered 500 or 404, or never answered, or
    answered 200 by something that is not vast.ai's API (a proxy's page) or with success
    false, is unresolved (exit 17), on this down and on the next one, until vast.ai says it is
    gone."""
    fake = fakes["vastai"]
    fake.exited, fake.stop_mode, fake.linger = True, stop_mode, 10**6
    with pytest.raises(MeterUnresolved) as info:
        stop_meter(_step("vastai", str(tmp_path), [], wait="0.5"))
    assert info.value.exit_code == 17
    assert "still listed: exited" in info.value.what and "may still be billing" in info.value.what
    j = journal.load("r9", str(tmp_path))
    assert j is not None and j.state == "unresolved"
    with pytest.raises(MeterUnresolved):  # a second down polls, and exited is still not gone
        stop_meter(_step("vastai", str(tmp_path), [], wait="0.5"))
    fake.present = False  # "instances": null
    assert stop_meter(_step("vastai", str(tmp_path), [])).kind == "confirmed"
    assert fake.stops() == 1


def test_fake_vast_exited_after_an_accepted_delete_is_confirmed_by_a_later_down(
    fakes: Dict[str, FakeApi], tmp_path: Any
) -> None:
    """The DELETE's 200 is journaled: a second down that finds the instance exited confirms."""
    fake = fakes["vastai"]
    fake.linger = 10**6  # still listed running after the accepted DELETE
    with pytest.raises(MeterUnresolved, match="it was accepted"):
        stop_meter(_step("vastai", str(tmp_path), [], wait="0.5"))
    fake.linger = 0  # VAST15: now it shows exited
    out = stop_meter(_step("vastai", str(tmp_path), []))
    assert out.kind == "confirmed" and "exited" in out.what and fake.stops() == 1


# ---- what down says of a call it sent: what really came of it, as journaled


@pytest.mark.parametrize("stop_mode", [503, 302, 404])
def test_fake_runpod_answered_stop_says_how_it_was_answered_not_no_answer(
    fakes: Dict[str, FakeApi], tmp_path: Any, stop_mode: int
) -> None:
    """The DELETE was answered 503 (or 302, or 404) and the pod stays listed: down says the
    call was answered so (for a 5xx or 3xx: its outcome is unknown), never that it got no
    answer nor that it was accepted; the journal keeps the answer, and a second down says the
    same while it only polls."""
    fake = fakes["runpod"]
    fake.stop_mode, fake.linger = stop_mode, 10**6
    with pytest.raises(MeterUnresolved) as info:
        stop_meter(_step("runpod", str(tmp_path), [], wait="0.5"))
    what = info.value.what
    assert f"the terminate was sent and answered (HTTP {stop_mode}: not allowed)" in what
    assert ("its outcome is unknown" in what) == (stop_mode != 404)
    assert "no answer" not in what and "accepted" not in what
    j = journal.load("r9", str(tmp_path))
    assert j is not None and j.answer == f"HTTP {stop_mode}: not allowed"
    assert j.unknown == (stop_mode != 404) and not j.accepted

    shown: List[str] = []
    with pytest.raises(MeterUnresolved):
        stop_meter(_step("runpod", str(tmp_path), shown, wait="0.5"))
    assert any(f"answered (HTTP {stop_mode}" in line for line in shown), shown
    assert not any("no answer" in line for line in shown) and fake.stops() == 1


def test_fake_runpod_call_journaled_as_intent_only_is_not_said_accepted(
    fakes: Dict[str, FakeApi], tmp_path: Any
) -> None:
    """rgt died between journaling the intent and the call's answer: down polls only (the call
    may have gone out) and, when the pod stays listed, says the call may have been sent, never
    that it was accepted."""
    fake = fakes["runpod"]
    journal.start("r9", "runpod", IDS["runpod"], "terminate", str(tmp_path)).note("intent", "x")
    with pytest.raises(MeterUnresolved) as info:
        stop_meter(_step("runpod", str(tmp_path), [], wait="0.5"))
    assert "accepted" not in info.value.what and "no answer" not in info.value.what
    assert "the terminate was perhaps sent" in info.value.what
    assert fake.stops() == 0


# ---- a journal edited on disk: malformed (exit 6), never read as something it does not say


def _sent_vast_journal(home: str) -> str:
    """The journal rgt writes when vast.ai's DELETE got no answer; its path."""
    j = journal.start("r9", "vastai", IDS["vastai"], "destroy", home)
    j.unknown = True
    j.note("sent", "no answer (test): the outcome is unknown; polling, never re-sending")
    return j.path


@pytest.mark.parametrize(
    "key,value",
    [
        ("accepted", "false"),  # a string is not a bool: bool("false") is True
        ("unknown", "no"),
        ("unknown", 0),
        ("events", "abc"),
        ("events", [1, 2]),
        ("answer", 503),
        ("verb", ["destroy"]),
        ("instance", 4242),  # an id is a string: str() made it "4242", the one asked for
        ("instance", "../x"),  # not a provider's id: it would go into a URL's path
        ("run", "other"),  # another run's journal under this run's name
        ("api", "runpod"),  # a call out at another provider: polling vast.ai tells nothing
        ("state", None),
        ("instance", None),  # no key at all
        (None, None),  # not a JSON object
    ],
)
def test_fake_vast_edited_journal_is_malformed_and_nothing_is_called(
    fakes: Dict[str, FakeApi], tmp_path: Any, key: Optional[str], value: Any
) -> None:
    """The journal is rgt's, but lives on a disk the user may edit. A field of the wrong type,
    another run's or another provider's journal, or an id that is no id, is malformed (exit 6):
    it is never coerced nor trusted (an "accepted": "false" read as true would take the exited,
    still billing instance for destroyed), and nothing is sent or polled."""
    fake = fakes["vastai"]
    fake.exited, fake.linger = True, 10**6
    path = _sent_vast_journal(str(tmp_path))
    with open(path) as f:
        doc = json.load(f)
    if key is None:
        doc = [doc]
    elif value is None:
        del doc[key]
    else:
        doc[key] = value
    with open(path, "w") as f:
        json.dump(doc, f)
    with pytest.raises(IntegrityError) as info:
        stop_meter(_step("vastai", str(tmp_path), [], wait="0.5"))
    assert info.value.exit_code == 6 and f"the meter journal {path}" in info.value.what
    assert fake.requests == []


def test_fake_vast_older_journal_without_the_newer_fields_still_reads(
    fakes: Dict[str, FakeApi], tmp_path: Any
) -> None:
    """A journal of an older rgt has no "accepted", "unknown", "answer" nor "events": read as
    not accepted, and polled (never re-sent)."""
    path = _sent_vast_journal(str(tmp_path))
    with open(path) as f:
        doc = json.load(f)
    for k in ("accepted", "unknown", "answer", "events"):
        del doc[k]
    with open(path, "w") as f:
        json.dump(doc, f)
    fakes["vastai"].present = False
    assert stop_meter(_step("vastai", str(tmp_path), [])).kind == "confirmed"
    assert fakes["vastai"].stops() == 0
