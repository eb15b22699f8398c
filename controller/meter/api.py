"""One small client per provider's API for the meter-stop: ``show`` (is the resource still
there, and in what state) and ``stop`` (the one call that stops its meter).

Every call has a client timeout and follows no redirect (the API key must never go to another
host). What can happen to a call is one of three, each its own exception, because what down may
do next depends on it:

- ``Answered``: the provider answered with an HTTP error (its status and a short message);
- ``NotSent``: the request never reached the provider (no connection was made: a name that
  does not resolve, a connection refused or timed out, a TLS handshake that failed): nothing
  changed, and it may be sent again;
- ``NoAnswer``: the request was sent, or was being sent, and no answer came (a timeout, a
  connection cut while it was written or after): the outcome is unknown, and the call must
  never be sent again; only ``show`` may tell. Its ``Unreadable``: a show answered 2xx with
  no JSON object (a proxy's HTML maintenance page, an empty body): it tells nothing, least of
  all "gone".

Only a 404, or the provider's documented not-found document, means gone.

Everything the provider returns is untrusted: only the few fields read here are used, each type
checked, and a message from it is shortened to printable text with the key masked. The keys come
from the environment (``RUNPOD_API_KEY``, ...) and are never logged nor written anywhere.

The documented calls (checked 2026-12 against each provider's API reference):

    runpod      https://rest.runpod.io/v1        DELETE /pods/{id}; GET /pods/{id} (404: gone)
    vastai      https://console.vast.ai/api/v0   DELETE /instances/{id}/; GET /instances/{id}/
                (404, "instances": null or actual_status "destroyed": gone; after the DELETE's
                200, "exited" too: destroy is eventually consistent, VAST15)
    lambda      https://cloud.lambda.ai/api/v1   POST /instance-operations/terminate
                {"instance_ids": [id]}; GET /instances/{id} (404 or status "terminated")
    paperspace  https://api.paperspace.com/v1    PATCH /machines/{id}/stop (reversible);
                GET /machines/{id} (state "off": stopped)
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import re
import urllib.error
import urllib.request
from typing import Any, Dict, Mapping, Optional, Tuple

from controller import envnames
from onbox.common import jsondoc
from onbox.common.errors import UsageError

_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
_READ_MAX = 1 << 20  # an answer larger than this is not one of these APIs'


def check_instance(value: str) -> str:
    """The provider's id of a box, as given to ``--instance``; it goes into a URL's path."""
    if not _ID.match(value or ""):
        raise UsageError(
            "--instance",
            f"{value!r} is not a provider's id of a box",
            "give the pod's, instance's or machine's id as the provider's console shows it "
            "(letters, digits, '.', '_', '-')",
        )
    return value


class Answered(Exception):
    """The provider answered with an HTTP error status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}" + (f": {message}" if message else ""))
        self.status = status


class NotSent(Exception):
    """The request never reached the provider: nothing changed."""


class NoAnswer(Exception):
    """The request was sent and no answer came: its outcome is unknown."""


class Unreadable(NoAnswer):
    """A show was answered 2xx, but not with a JSON object: what the provider has is unknown."""


@dataclasses.dataclass(frozen=True)
class Seen:
    """What ``show`` found: ``gone`` when the provider no longer has the resource."""

    gone: bool
    status: str


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # the 3xx is raised as an HTTPError: an answer rgt does not expect


class _Request(urllib.request.Request):
    """A request that knows whether its connection was made. urllib raises the same URLError
    for a connection refused and for one cut while the request was being written: only the
    first proves that none of it left."""

    connected = False


class _Conn(http.client.HTTPConnection):
    def __init__(self, host: str, *, request: Optional[_Request] = None, **kwargs: Any) -> None:
        super().__init__(host, **kwargs)
        self.request_ = request

    def connect(self) -> None:
        super().connect()
        if self.request_ is not None:
            self.request_.connected = True


class _TlsConn(http.client.HTTPSConnection):
    def __init__(self, host: str, *, request: Optional[_Request] = None, **kwargs: Any) -> None:
        super().__init__(host, **kwargs)
        self.request_ = request

    def connect(self) -> None:
        super().connect()  # the TLS handshake too: no byte of the request went before it
        if self.request_ is not None:
            self.request_.connected = True


class _Http(urllib.request.HTTPHandler):
    def do_open(self, http_class: Any, req: Any, **kwargs: Any) -> http.client.HTTPResponse:
        return super().do_open(_Conn, req, request=req, **kwargs)


class _Https(urllib.request.HTTPSHandler):
    def do_open(self, http_class: Any, req: Any, **kwargs: Any) -> http.client.HTTPResponse:
        return super().do_open(_TlsConn, req, request=req, **kwargs)


_OPENER = urllib.request.build_opener(_NoRedirect(), _Http(), _Https())


def _text(raw: bytes, key: str) -> str:
    """A provider's message, as one short printable line with the key masked."""
    try:
        doc = jsondoc.loads(raw)
        if isinstance(doc, dict):
            for k in ("error", "message", "msg", "detail"):
                v = doc.get(k)
                if isinstance(v, dict):
                    v = v.get("message")
                if isinstance(v, str) and v:
                    raw = v.encode()
                    break
    except ValueError:
        pass
    text = raw.decode("utf-8", "replace")
    if key:
        text = text.replace(key, "***")
    return "".join(c if c.isprintable() else " " for c in text).strip()[:200]


def call(
    method: str, url: str, key: str, timeout: float, body: Optional[Dict[str, Any]] = None
) -> Tuple[int, bytes]:
    """(status, body) of one request answered 2xx; Answered, NotSent or NoAnswer."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {key}", "Accept": "application/json"}
    if data is not None:
        headers["Content-Type"] = "application/json"
    req = _Request(url, data=data, method=method, headers=headers)
    try:
        resp = _OPENER.open(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        try:
            raw = e.read(64 * 1024)
        except (OSError, http.client.HTTPException):
            raw = b""
        raise Answered(e.code, _text(raw, key)) from None
    except urllib.error.URLError as e:
        if req.connected:  # cut while the request was being written: some of it may have gone
            raise NoAnswer(f"{method} {url}: cut while it was sent ({e.reason})") from None
        raise NotSent(f"{url.split('/')[2]}: {e.reason}") from None
    except (OSError, http.client.HTTPException) as e:  # sent; the answer never came
        raise NoAnswer(f"{method} {url}: {type(e).__name__}: {e}") from None
    try:
        with resp:
            raw = resp.read(_READ_MAX)
    except (OSError, http.client.HTTPException) as e:
        raise NoAnswer(f"{method} {url}: the answer was cut ({type(e).__name__})") from None
    return resp.status, raw


@dataclasses.dataclass(frozen=True)
class Client:
    """One provider's meter-stop. ``base`` is its API's URL; ``key`` its API key."""

    api: str
    title: str
    noun: str  # what the provider calls the box
    console: str  # where the user looks, in messages
    base: str
    key: str
    timeout: float

    def _url(self, path: str) -> str:
        return self.base.rstrip("/") + path

    def _get(self, path: str) -> Optional[Dict[str, Any]]:
        """The resource's document (a JSON object), or None when the provider says 404; any
        other answer that is no JSON object raises Unreadable, never None."""
        url = self._url(path)
        try:
            status, raw = call("GET", url, self.key, self.timeout)
        except Answered as e:
            if e.status == 404:
                return None
            raise
        return self._object("GET", url, status, raw)

    def _object(self, method: str, url: str, status: int, raw: bytes) -> Dict[str, Any]:
        """The JSON object a 2xx answer holds; Unreadable when it holds none (a proxy's or a
        maintenance page, an empty body): what the provider did is then unknown."""
        try:
            doc = jsondoc.loads(raw)
        except ValueError:
            doc = None
        if not isinstance(doc, dict):
            what = _text(raw, self.key)[:80] or "an empty body"
            raise Unreadable(f"{method} {url}: HTTP {status}, but not a JSON object ({what})")
        return doc

    def show(self, ident: str) -> Seen:
        raise NotImplementedError

    def stop(self, ident: str) -> None:
        raise NotImplementedError

    def settled(self, seen: Seen, accepted: bool) -> bool:
        """Whether the meter is stopped; ``accepted``: the provider answered rgt's stop call
        2xx (not merely sent: one answered 5xx or 404, or never answered, is not accepted)."""
        return seen.gone


def _field(doc: Any, *path: str) -> Any:
    for k in path:
        doc = doc.get(k) if isinstance(doc, dict) else None
    return doc


def _status(v: Any) -> str:
    return v if isinstance(v, str) and len(v) < 64 else "listed"


class RunPod(Client):
    """RunPod pods: terminate is DELETE; the pod is gone when GET says 404 (RP14)."""

    def show(self, ident: str) -> Seen:
        doc = self._get(f"/pods/{ident}")
        if doc is None:
            return Seen(True, "not found (404)")
        return Seen(False, _status(_field(doc, "desiredStatus")))

    def stop(self, ident: str) -> None:
        call("DELETE", self._url(f"/pods/{ident}"), self.key, self.timeout)


class Vast(Client):
    """vast.ai instances: destroy is DELETE; the show endpoint lags behind it (VAST15)."""

    def show(self, ident: str) -> Seen:
        doc = self._get(f"/instances/{ident}/")
        if doc is None:
            return Seen(True, "not found (404)")
        if "instances" in doc and doc["instances"] is None:  # documented; a missing key is not
            return Seen(True, '"instances": null')
        status = _status(_field(doc, "instances", "actual_status"))
        return Seen(status == "destroyed", status)

    def settled(self, seen: Seen, accepted: bool) -> bool:
        # "exited" is a stopped container whose disk still bills; only after the DELETE's 200
        # is it the destroy on its way (VAST15), never after one answered 5xx or not at all.
        return seen.gone or (accepted and seen.status == "exited")

    def stop(self, ident: str) -> None:
        # Only vast.ai's own answer makes an "exited" instance count as destroyed (settled): a
        # proxy's 200 page, or {"success": false}, leaves what it did unknown.
        url = self._url(f"/instances/{ident}/")
        status, raw = call("DELETE", url, self.key, self.timeout)
        if self._object("DELETE", url, status, raw).get("success") is False:
            raise Unreadable(f"DELETE {url}: HTTP {status}, but success false")


class Lambda(Client):
    """Lambda instances: terminate is a POST that can hang (LAM14); gone: 404 or terminated."""

    def show(self, ident: str) -> Seen:
        doc = self._get(f"/instances/{ident}")
        if doc is None:
            return Seen(True, "not found (404)")
        status = _status(_field(doc, "data", "status"))
        return Seen(status == "terminated", status)

    def stop(self, ident: str) -> None:
        body = {"instance_ids": [ident]}
        call("POST", self._url("/instance-operations/terminate"), self.key, self.timeout, body)


class Paperspace(Client):
    """Paperspace machines: the verb is a shut-down (reversible); stopped when state is off."""

    def show(self, ident: str) -> Seen:
        doc = self._get(f"/machines/{ident}")
        if doc is None:
            return Seen(True, "not found (404)")
        return Seen(False, _status(_field(doc, "state")))

    def settled(self, seen: Seen, accepted: bool) -> bool:
        return seen.gone or seen.status == "off"

    def stop(self, ident: str) -> None:
        call("PATCH", self._url(f"/machines/{ident}/stop"), self.key, self.timeout)


# api -> (class, title, noun, console, key variable, base URL variable, default base URL)
_APIS = {
    "runpod": (
        RunPod, "RunPod", "pod", "https://www.console.runpod.io/pods",
        envnames.RUNPOD_API_KEY, envnames.RUNPOD_API, "https://rest.runpod.io/v1",
    ),
    "vastai": (
        Vast, "vast.ai", "instance", "https://cloud.vast.ai/instances/",
        envnames.VAST_API_KEY, envnames.VAST_API, "https://console.vast.ai/api/v0",
    ),
    "lambda": (
        Lambda, "Lambda", "instance", "https://cloud.lambda.ai/instances",
        envnames.LAMBDA_API_KEY, envnames.LAMBDA_API, "https://cloud.lambda.ai/api/v1",
    ),
    "paperspace": (
        Paperspace, "Paperspace", "machine", "https://console.paperspace.com",
        envnames.PAPERSPACE_API_KEY, envnames.PAPERSPACE_API, "https://api.paperspace.com/v1",
    ),
}  # fmt: skip


def noun(api: str) -> str:
    """What ``api``'s provider calls the box ("pod", "instance", "machine")."""
    return _APIS[api][2] if api in _APIS else "box"


def title(api: str) -> str:
    """The provider's name, for messages."""
    return _APIS[api][1] if api in _APIS else api


def key_name(api: str) -> str:
    return _APIS[api][4]


def client(api: str, environ: Optional[Mapping[str, str]] = None) -> Client:
    """The client of ``api`` (a profile's meter.api), its key and URL from the environment."""
    env = os.environ if environ is None else environ
    cls, title, what, console, key_var, url_var, default = _APIS[api]
    key = env.get(key_var, "")
    if not key:
        raise UsageError(
            key_var,
            f"not set: rgt needs {title}'s API key to stop the {what}'s meter; nothing was sent",
            f"export {key_var}=... (an API key of the account that owns the {what}), then run "
            "rgt down again",
        )
    try:
        timeout = float(env.get(envnames.METER_TIMEOUT) or 30)
    except ValueError:
        raise UsageError(envnames.METER_TIMEOUT, "not a number of seconds") from None
    c: Client = cls(api, title, what, console, env.get(url_var) or default, key, timeout)
    return c
