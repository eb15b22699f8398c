"""The platform's preemption notice: watched in the agent, answered with a seal before any signal.

A spot platform that announces an interruption ahead of time (AWS two minutes ahead, Azure at
least 30 s, GCP as the shutdown begins) gives the run time the SIGTERM budget may not have. A
``NoticeWatcher`` thread polls the platform's metadata endpoint every few seconds (AWS asks for
5 s) and, on the first sight of a notice, starts the final seal while the job keeps running: it
asks the job for a checkpoint through its trigger and wakes the seal thread (the same path as
the timer and `rgt-agent sync`, onbox/agent/sealservice.py). The run's state does not change
here: the platform's SIGTERM that follows is handled by the loop as before.

Endpoints (stdlib urllib, short timeouts; everything they answer is untrusted):

- AWS IMDSv2: PUT /latest/api/token (X-aws-ec2-metadata-token-ttl-seconds), then with
  X-aws-ec2-metadata-token GET /latest/meta-data/spot/instance-action (404: none; 200:
  {"action", "time"}) and /latest/meta-data/events/recommendations/rebalance (404: none; 200:
  {"noticeTime"}: an earlier warning, which seals too).
- GCP: GET /computeMetadata/v1/instance/preempted with Metadata-Flavor: Google ("TRUE"/"FALSE").
  It says no time: the profile's notice_lead (else 30 s, the documented shutdown window) is used.
- Azure Scheduled Events: GET /metadata/scheduledevents?api-version=2020-07-01 with Metadata:
  true; an event whose EventType is "Preempt" is the notice, NotBefore its time (RFC 1123).

``RGT_METADATA_URL`` replaces the base URL (tests). A poll that fails is quiet (the next one
tries again); one notice starts one seal, however many polls see it again.
"""

from __future__ import annotations

import dataclasses
import datetime
import email.utils
import http.client
import json
import os
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Callable, Dict, Optional, Set, Tuple

from onbox.common import jobenv

BASES = {
    "aws": "http://169.254.169.254",
    "gcp": "http://metadata.google.internal",
    "azure": "http://169.254.169.254",
}
POLL = 5.0  # seconds between polls: what the AWS documentation recommends
TIMEOUT = 2.0  # per request; the link-local endpoints answer in milliseconds or not at all
# The link-local servers are asked directly: never through the http(s)_proxy a box's environment
# may hold (AutoDL's network_turbo, a corporate proxy), which cannot reach them.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
# What a poll may fail with, all quiet: the network, HTTP, and whatever the answer holds.
POLL_ERRORS = (
    OSError,
    http.client.HTTPException,
    ValueError,
    AttributeError,
    TypeError,
    KeyError,
    RecursionError,
)
GCP_LEAD = 30.0  # GCE's shutdown window after the preemption begins, when no lead is known
TOKEN_TTL = 21600
Event = Callable[..., None]


@dataclasses.dataclass(frozen=True)
class Notice:
    """One announced interruption: the platform, what it said, and when (epoch seconds)."""

    kind: str
    what: str
    at: Optional[float]
    key: str  # the same notice seen again by a later poll has the same key


def _iso(s: str) -> Optional[float]:
    try:
        d = datetime.datetime.strptime(s.strip(), "%Y-%m-%dT%H:%M:%SZ")
    except (ValueError, AttributeError):
        return None
    return d.replace(tzinfo=datetime.timezone.utc).timestamp()


def _rfc1123(s: str) -> Optional[float]:
    try:
        return email.utils.parsedate_to_datetime(s).timestamp()
    except (TypeError, ValueError, IndexError):
        return None


class Metadata:
    """HTTP to one platform's metadata server; every answer is read as untrusted text."""

    def __init__(self, kind: str, base: str, lead: Optional[float] = None) -> None:
        self.kind = kind
        self.base = base.rstrip("/")
        self.lead = lead
        self._token: Optional[str] = None
        self._token_until = 0.0

    def _call(self, method: str, path: str, headers: Dict[str, str]) -> Optional[str]:
        """The body of a 200 answer; None for a 404. Other failures raise OSError."""
        req = urllib.request.Request(self.base + path, method=method, headers=headers)
        try:
            with _OPENER.open(req, timeout=TIMEOUT) as r:
                return str(r.read(64 << 10).decode("utf-8", "replace"))
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            if e.code == 401:
                self._token = None  # IMDSv2: an expired token; take a new one next poll
            raise

    def poll(self) -> Optional[Notice]:
        """The notice the platform announces now, or None; raises one of ``POLL_ERRORS``."""
        return {"aws": self._aws, "gcp": self._gcp, "azure": self._azure}[self.kind]()

    def _aws(self) -> Optional[Notice]:
        if self._token is None or time.monotonic() > self._token_until:
            token = self._call(
                "PUT", "/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL)}
            )
            if not token:
                raise ValueError("IMDSv2 gave no token")
            self._token, self._token_until = token.strip(), time.monotonic() + TOKEN_TTL / 2
        h = {"X-aws-ec2-metadata-token": self._token}
        body = self._call("GET", "/latest/meta-data/spot/instance-action", h)
        doc = json.loads(body) if body is not None else None
        if isinstance(doc, dict) and "action" in doc:  # 200 only once one is scheduled
            action, when = str(doc.get("action", "?"))[:40], str(doc.get("time", ""))[:40]
            return Notice("aws", f"spot instance-action {action}", _iso(when), f"action:{when}")
        body = self._call("GET", "/latest/meta-data/events/recommendations/rebalance", h)
        doc = json.loads(body) if body is not None else None
        if isinstance(doc, dict) and "noticeTime" in doc:
            when = str(doc["noticeTime"])[:40]
            # A recommendation announces no interruption time: it is earlier than one.
            return Notice("aws", "rebalance recommendation", None, f"rebalance:{when}")
        return None

    def _gcp(self) -> Optional[Notice]:
        body = self._call(
            "GET", "/computeMetadata/v1/instance/preempted", {"Metadata-Flavor": "Google"}
        )
        if body is None or body.strip().upper() != "TRUE":
            return None
        lead = self.lead if self.lead is not None else GCP_LEAD
        return Notice("gcp", "instance preempted", time.time() + lead, "preempted")

    def _azure(self) -> Optional[Notice]:
        body = self._call(
            "GET", "/metadata/scheduledevents?api-version=2020-07-01", {"Metadata": "true"}
        )
        if body is None:
            return None
        events = json.loads(body).get("Events") or []
        for ev in events if isinstance(events, list) else []:
            if isinstance(ev, dict) and ev.get("EventType") == "Preempt":
                at = _rfc1123(str(ev.get("NotBefore") or ""))
                eid = str(ev.get("EventId", ""))[:80]
                return Notice("azure", "scheduled event Preempt", at, f"preempt:{eid}")
        return None


class NoticeWatcher:
    """The agent's notice thread: polls, and answers each new notice with one seal.

    ``seal`` is the run's SealService (None without a store: the notice is still an event).
    """

    def __init__(
        self,
        source: Metadata,
        event: Event,
        seal: Any,
        interval: float = POLL,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.source = source
        self.event = event
        self.seal = seal
        self.interval = interval
        self.wall = wall
        self._seen: Set[str] = set()
        self._sealing: Optional[Dict[str, Any]] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="rgt-notice", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            # Not the length of a poll: the agent may be leaving inside a preemption budget,
            # and the thread is a daemon that holds nothing.
            self._thread.join(0.5)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except Exception as e:  # never into the loop: a bug here costs the notice only
                self.event(
                    "notice_bug",
                    f"{type(e).__name__}: {e}; the preemption notice is not watched any more",
                    klass="permanent",
                    remedy="report this; SIGTERM still seals as before",
                )
                return
            self._stop.wait(1.0 if self._sealing else self.interval)

    def step(self) -> None:
        """One poll, then a look at the seal a notice started."""
        try:
            notice = self.source.poll()
        except POLL_ERRORS:
            notice = None  # quiet: the server is down, slow, not there, or answers nonsense
        if notice is not None and notice.key not in self._seen:
            self._seen.add(notice.key)
            self._announce(notice)
        if self._sealing is not None:
            self._check_sealed()

    def _announce(self, notice: Notice) -> None:
        now = self.wall()
        ahead = None if notice.at is None else round(notice.at - now, 1)
        when = (
            f"; the stop is announced for {_stamp(notice.at)}, {ahead:.0f}s from now"
            if notice.at is not None and ahead is not None
            else ""
        )
        self.event(
            "preemption_notice",
            f"{notice.kind}: {notice.what}{when}; sealing the newest checkpoint now, "
            "while the job runs",
            klass="transient",
            notice=notice.kind,
            announced=notice.what,
            at=_stamp(notice.at) if notice.at is not None else None,
            ahead_s=ahead,
        )
        seal = self.seal
        if seal is None or seal.sealer is None:
            return
        self._sealing = {"notice": notice, "since": now, "from": seal.sealer.latest}
        if seal.spec.trigger != "none":
            try:
                seal.ask_job("preemption notice")
            except OSError:  # the request file (trigger "file") cannot be written: seal what is
                pass
        seal.wake()

    def _check_sealed(self) -> None:
        """Done once a checkpoint newer than LATEST at the notice is sealed and nothing newer
        is on the box (with no trigger, once what the box holds is sealed)."""
        from onbox.sealing.discovery import newest_local_step

        job = self._sealing
        assert job is not None
        seal = self.seal
        latest = seal.sealer.latest
        newest = newest_local_step(seal.spec.ckpt_dir)
        moved = latest is not None and (job["from"] is None or latest > job["from"])
        asked = seal.spec.trigger != "none"
        caught_up = newest is None or (latest is not None and latest >= newest)
        notice: Notice = job["notice"]
        now = self.wall()
        if caught_up and (moved or not asked):
            self._sealing = None
            self._report(notice, latest, now)
            return
        limit = (notice.at if notice.at is not None else job["since"]) + 300.0
        if now > limit:
            self._sealing = None
            self.event(
                "notice_seal_unfinished",
                f"no newer checkpoint was sealed after the {notice.kind} notice; LATEST stays "
                f"at step {latest}",
                klass="transient",
                remedy="make the job checkpoint on its trigger (checkpoint.trigger)",
            )
            return
        seal.wake()  # the job's checkpoint may have appeared since the last pass

    def _report(self, notice: Notice, latest: Optional[int], now: float) -> None:
        if notice.at is None:
            said = "the notice announced no time"
            before: Optional[float] = None
        else:
            before = round(notice.at - now, 1)
            said = (
                f"{before:.0f}s before the announced time"
                if before >= 0
                else f"{-before:.0f}s after the announced time"
            )
        self.event(
            "notice_sealed",
            f"the seal the {notice.kind} notice started is done: LATEST is step {latest}, {said}",
            notice=notice.kind,
            step=latest,
            before_s=before,
        )


def _stamp(t: Optional[float]) -> str:
    if t is None:
        return ""
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def notice_kind(spec: Any) -> Tuple[str, Optional[float]]:
    """The run's notice kind and lead: the spec's ``notice`` (from its profile), else the
    profile it names, else none."""
    kind = getattr(spec, "notice", None)
    lead: Optional[float] = None
    name = getattr(spec, "profile", None)
    if name:
        try:
            from onbox.agent.profileuse import load_profile

            p = load_profile(name, os.environ)
            kind = p.preemption.notice if kind in (None, "none") else kind
            lead = p.preemption.notice_lead
        except Exception:  # a profile gone bad since start: watch what the spec says
            pass
    return (kind or "none"), lead


def watcher_for(spec: Any, seal: Any, event: Event) -> Optional[NoticeWatcher]:
    """A started watcher for a run whose platform gives a notice over HTTP, else None."""
    kind, lead = notice_kind(spec)
    if kind not in BASES:
        return None  # "none", or "signal": the platform's signal is the notice
    base = os.environ.get(jobenv.METADATA_URL) or BASES[kind]
    try:
        interval = float(os.environ.get(jobenv.NOTICE_POLL) or POLL)
    except ValueError:
        interval = POLL
    w = NoticeWatcher(Metadata(kind, base, lead), event, seal, interval=max(interval, 0.1))
    w.start()
    return w
