"""The run's notifications from the box: which events a person wants to hear of, sent through
Apprise URLs (``[notify] urls``), and the healthchecks-style dead-man's switch (``deadman``).

It owns the choice (``wanted``: a health verdict at or above ``min_level`` and its recovery,
the terminal states, restarts, stalls, reaped GPU memory, a failed restore, sealing errors at
most once an hour, a preemption notice, an agent that left its run unended), the message
(title ``rgt RUN: WHAT``, body with the reason and the remedy), deduplication, the hourly
rate limit, and the sending, on a thread of its own: ``listen`` (a journal listener, called on
the agent's loop) only puts the event on a bounded queue. Every send runs in a worker thread
joined with ``timeout``: a sink that hangs costs one stuck worker (at most one per sink: the
next send to a stuck sink is skipped), never the sender and never the loop.

Dead-man's switch (https://healthchecks.io/docs/http_api/): ``URL/start`` when the agent begins
supervising, ``URL`` every ``heartbeat`` while it does, and at the end ``URL`` (success) for
SUCCEEDED and STOPPED (the user asked for the stop: not an alarm), ``URL/fail`` for FAILED and
PREEMPTED (the work stopped and needs someone to resume it), and for a run its agent left
unended (a success whose results the store did not take: onbox/agent/letgo.py), whose ping
says why and what to do. The body of each ping says why.

URLs carry tokens: an event or a log names a sink by scheme and host only (``safe_url``), and
Apprise's logger is silenced so it cannot print one. Apprise is an optional import: missing, one
``notify_unavailable`` event and the dead-man's switch still works (urllib).
"""

from __future__ import annotations

import collections
import logging
import re
import threading
import time
import urllib.request
import warnings
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from onbox.health.config import NotifyConfig
from onbox.health.verdict import RANK

TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED", "PREEMPTED")
# Event kinds sent whenever they happen (besides "health" and "state", judged by their fields).
KINDS = ("stall", "gpu_reaped", "restore_failed", "seal_error", "preemption_notice", "agent_left")
THROTTLE = {"seal_error": 3600.0}  # kind -> at most one message per this many seconds
OWN = "notify_"  # the notifier's own events: about the notifier, never notified themselves
QUEUE_MAX = 64
DRAIN = 3.0  # seconds finish() waits in all for the last ping and the queue
HOUR = 3600.0
DEADMAN_END = {"SUCCEEDED": "", "STOPPED": "", "FAILED": "/fail", "PREEMPTED": "/fail"}
_HOST = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+)(?::(\d+))?$")


def safe_url(url: str) -> str:
    """``url`` with only its scheme and host (when the host is a name or an address, not a
    token, as in ``tgram://BOTTOKEN/...``): fit for an event or a log."""
    scheme, sep, rest = url.partition("://")
    if not sep or not re.match(r"^[A-Za-z][A-Za-z0-9+.-]*$", scheme):
        return "…"
    netloc = re.split(r"[/?#]", rest, maxsplit=1)[0].rsplit("@", 1)[-1]
    m = _HOST.match(netloc)
    host = m.group(1) if m else ""
    named = m is not None and ("." in host or host.startswith("[") or host == "localhost")
    shown = netloc if named else "…"
    return f"{scheme}://{shown}/…"


class Message:
    """One notification: what it says, Apprise's type for it, and whether the rate limit may
    hold it back (a terminal state is always sent)."""

    def __init__(self, title: str, body: str, kind: str, urgent: bool = False) -> None:
        self.title, self.body, self.kind, self.urgent = title, body, kind, urgent


def _body(ev: Dict[str, Any]) -> str:
    lines = [str(ev.get("reason") or "")]
    if ev.get("remedy"):
        lines.append(f"remedy: {ev['remedy']}")
    if ev.get("class"):
        lines.append(f"class: {ev['class']}")
    return "\n".join(lines)


def wanted(ev: Dict[str, Any]) -> bool:
    """Whether ``ev`` may become a notification (cheap: ``listen`` asks it on the loop)."""
    kind = ev.get("kind")
    if kind == "state":
        return ev.get("state") in TERMINAL or ev.get("state") == "BACKOFF"
    return kind == "health" or kind in KINDS


class Chooser:
    """Events -> messages; remembers which probes were raised so that their return to ok is
    news. Runs on the sender thread only."""

    def __init__(self, run: str, min_level: str) -> None:
        self.run = run
        self.min_rank = RANK[min_level]
        self.raised: Dict[str, str] = {}  # probe -> level last notified

    def message(self, ev: Dict[str, Any]) -> Optional[Message]:
        kind = str(ev.get("kind"))
        title = f"rgt {self.run}: "
        if kind == "state":
            state = str(ev.get("state"))
            if state == "BACKOFF":
                again = f"restarting after attempt {ev.get('attempt')}"
                return Message(title + again, _body(ev), "warning")
            kinds = {"SUCCEEDED": "success", "FAILED": "failure", "PREEMPTED": "warning"}
            return Message(title + state, _body(ev), kinds.get(state, "info"), urgent=True)
        if kind == "health":
            return self._health(ev, title)
        what = {
            "stall": ("stalled", "failure"),
            "gpu_reaped": ("GPU memory of an earlier attempt freed", "warning"),
            "restore_failed": ("could not begin", "failure"),  # the body says what failed
            "seal_error": ("checkpoint sealing failed", "warning"),
            "preemption_notice": ("preemption notice", "warning"),
            # The agent's last word on a run it leaves unended (a success whose results the
            # store did not take): no terminal state is said, so this is.
            "agent_left": ("the agent left the run unended", "failure"),
        }.get(kind)
        if what is None:
            return None
        # The agent's last word is never held back by the hourly limit, as a terminal state's.
        return Message(title + what[0], _body(ev), what[1], urgent=kind == "agent_left")

    def _health(self, ev: Dict[str, Any], title: str) -> Optional[Message]:
        probe, level = str(ev.get("probe") or "health"), str(ev.get("level"))
        if level == "ok":
            if self.raised.pop(probe, None) is None:
                return None
            return Message(title + f"{probe} ok again", _body(ev), "success")
        if RANK.get(level, -1) < self.min_rank:
            return None
        self.raised[probe] = level
        kind = "failure" if level == "alert" else "warning"
        return Message(title + f"{probe} {level}", _body(ev), kind)


class Limits:
    """Deduplication (the same title and body within ``dedup`` seconds), a per-kind throttle
    (``THROTTLE``) and the hourly rate limit; counts what each held back."""

    def __init__(self, cfg: NotifyConfig, clock: Callable[[], float]) -> None:
        self.cfg, self.clock = cfg, clock
        self.seen: Dict[Tuple[str, str], float] = {}
        self.kinds: Dict[str, float] = {}
        self.sent: Deque[float] = collections.deque()
        self.counts = {"deduped": 0, "throttled": 0, "limited": 0}
        self.limiting = False  # a notify_limited event was written for this stretch

    def admit(self, kind: str, msg: Message) -> str:
        """ "send", or why not: "deduped", "throttled", "limited"."""
        now = self.clock()
        key = (msg.title, msg.body)
        if now - self.seen.get(key, -1e18) < self.cfg.dedup:
            return self._no("deduped")
        gap = THROTTLE.get(kind)
        if gap is not None and now - self.kinds.get(kind, -1e18) < gap:
            return self._no("throttled")
        while self.sent and now - self.sent[0] >= HOUR:
            self.sent.popleft()
        if not msg.urgent and len(self.sent) >= self.cfg.rate_per_hour:
            return self._no("limited")
        if len(self.sent) < self.cfg.rate_per_hour:
            self.limiting = False
        if len(self.seen) > 512:  # bounded: forget what is past the dedup window
            self.seen = {k: t for k, t in self.seen.items() if now - t < self.cfg.dedup}
        self.seen[key] = now
        if gap is not None:
            self.kinds[kind] = now
        self.sent.append(now)
        return "send"

    def _no(self, why: str) -> str:
        self.counts[why] += 1
        return why


class Notifier:
    """The run's notifier: ``listen`` on the journal, ``start`` when supervising begins,
    ``finish(state)`` at the agent's exit."""

    def __init__(
        self,
        cfg: NotifyConfig,
        run: str,
        event: Callable[..., None],
        *,
        clock: Callable[[], float] = time.monotonic,
        queue_max: int = QUEUE_MAX,
    ) -> None:
        self.cfg, self.run, self.clock = cfg, run, clock
        self._event = event
        self.chooser = Chooser(run, cfg.min_level)
        self.limits = Limits(cfg, clock)
        self._q: Deque[Dict[str, Any]] = collections.deque()
        self._queue_max = queue_max
        self._cond = threading.Condition()
        self._final: Optional[str] = None
        self._why = ""  # finish's: why the agent left a run that is not terminal
        self._closed = False
        self._bug = False
        self._thread: Optional[threading.Thread] = None
        self._busy: Dict[str, threading.Thread] = {}  # sink -> its stuck worker
        self._failing: Dict[str, bool] = {}
        self._sinks: Optional[List[Tuple[str, Any]]] = None  # (url, Apprise object)
        self.counts = {"queued": 0, "dropped": 0, "sent": 0, "failed": 0, "stuck": 0, "pings": 0}

    # ---- the loop's side: never blocks
    def listen(self, ev: Dict[str, Any]) -> None:
        """The journal's listener: queue what may be news; drop the oldest when full."""
        if str(ev.get("kind", "")).startswith(OWN) or not wanted(ev):
            return
        with self._cond:
            if len(self._q) >= self._queue_max:
                self._q.popleft()
                self.counts["dropped"] += 1
            self._q.append(ev)
            self.counts["queued"] += 1
            self._cond.notify()

    def backlog(self) -> List[Dict[str, Any]]:
        """The events waiting to be sent, oldest first."""
        with self._cond:
            return list(self._q)

    def start(self) -> None:
        """The sender thread; its first act is the dead-man's ``/start``."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="rgt-notify", daemon=True)
        self._thread.start()

    def finish(self, state: str, drain: float = DRAIN, why: str = "") -> None:
        """The run ended in ``state`` (or its agent left it so, ``why``: what the last ping
        says after it): the last ping and what is queued, within ``drain`` s."""
        with self._cond:
            self._final, self._why = state, why
            self._cond.notify()
        self.start()  # an agent that fails before supervising still says so
        assert self._thread is not None
        self._thread.join(drain)
        self._closed = True  # a sender still stuck may not write events after the agent
        lost = {k: v for k, v in self.counts.items() if k in ("dropped", "failed", "stuck") and v}
        lost.update({k: v for k, v in self.limits.counts.items() if k == "limited" and v})
        if lost:  # written here, on the agent's thread, while it still holds the run
            try:
                self._event(
                    "notify_summary",
                    "notifications not delivered: "
                    + ", ".join(f"{k} {v}" for k, v in sorted(lost.items())),
                    counts=dict(self.counts, **self.limits.counts),
                )
            except Exception:
                pass

    # ---- the sender thread
    def _loop(self) -> None:
        if self.cfg.deadman:
            self._ping("/start", f"rgt {self.run}: supervising")
        self._apprise()  # loaded now, not in the run's last seconds (it takes a second or two)
        beat = self.clock() + self.cfg.heartbeat
        while True:
            with self._cond:
                while not self._q and self._final is None:
                    wait = beat - self.clock() if self.cfg.deadman else None
                    if wait is not None and wait <= 0:
                        break
                    self._cond.wait(wait)
                ev = self._q.popleft() if self._q else None
                final = self._final
            if ev is not None:
                self._guarded(ev)
            if final is not None:
                self._last(final)
                return
            if self.cfg.deadman and self.clock() >= beat:
                self._ping("", f"rgt {self.run}: alive")
                beat = self.clock() + self.cfg.heartbeat

    def _last(self, state: str) -> None:
        """The end: the dead-man's verdict first (it matters most), then the queue."""
        if self.cfg.deadman:
            why = f": {self._scrub(self._why)}" if self._why else ""
            self._ping(DEADMAN_END.get(state, "/fail"), f"rgt {self.run}: {state}{why}")
        while not self._closed:
            with self._cond:
                ev = self._q.popleft() if self._q else None
            if ev is None:
                return
            self._guarded(ev)

    def _guarded(self, ev: Dict[str, Any]) -> None:
        try:
            self._handle(ev)
        except Exception as e:  # the sender must outlive a bug: say so once, go on
            if not self._bug:
                self._bug = True
                self._say(
                    "notify_bug",
                    f"{type(e).__name__}: {self._scrub(str(e))}",
                    klass="permanent",
                    remedy="report this; the run goes on",
                )

    def _handle(self, ev: Dict[str, Any]) -> None:
        try:
            msg = self.chooser.message(ev)
        except Exception:  # a malformed event must not end the sender
            return
        if msg is None:
            return
        why = self.limits.admit(str(ev.get("kind")), msg)
        if why == "limited" and not self.limits.limiting:
            self.limits.limiting = True
            self._say(
                "notify_limited",
                f"more than {self.cfg.rate_per_hour} notifications in an hour: holding back "
                "the rest of this hour (terminal states still go)",
                remedy="raise [notify] rate_per_hour, or look at the run: something repeats",
            )
        if why == "send":
            self._send(msg)

    def _send(self, msg: Message) -> None:
        sinks = self._apprise()
        jobs = [(url, _apprise_job(obj, msg)) for url, obj in sinks]
        for url, ok in self._bounded(jobs).items():
            self._result(url, ok)

    def _ping(self, suffix: str, body: str) -> None:
        url = self.cfg.deadman
        if not url:
            return
        self.counts["pings"] += 1
        timeout = self.cfg.timeout
        ok = self._bounded([(url, lambda: _http_ping(url + suffix, body, timeout))])[url]
        self._result(url, ok, what="dead-man's switch ping")

    def _result(self, url: str, ok: Optional[bool], what: str = "notification") -> None:
        """Count; an event when a sink starts failing (not at each failure: a down sink)."""
        if ok:
            self.counts["sent"] += 1
            self._failing[url] = False
            return
        self.counts["failed" if ok is not None else "stuck"] += 1
        if self._failing.get(url):
            return
        self._failing[url] = True
        why = "it failed" if ok is not None else f"no answer within {self.cfg.timeout:g}s"
        self._say(
            "notify_failed",
            f"{what} to {safe_url(url)} not delivered: {why}; the run goes on",
            klass="transient",
            remedy="check the URL and that the service answers from the box",
            sink=safe_url(url),
        )

    def _bounded(self, jobs: List[Tuple[str, Callable[[], bool]]]) -> Dict[str, Optional[bool]]:
        """Run each (sink, send) in a worker of its own, all within ``timeout``: True/False
        when it finished, None when it hangs (the worker is left, the sink marked busy) or the
        sink's last worker is still stuck (skipped: at most one stuck worker per sink)."""
        results: Dict[str, Optional[bool]] = {}
        workers = []
        for sink, fn in jobs:
            stuck = self._busy.get(sink)
            if stuck is not None and stuck.is_alive():
                results[sink] = None
                continue
            box: List[bool] = []
            t = threading.Thread(target=_capture, args=(fn, box), name="rgt-notify-send")
            t.daemon = True
            t.start()
            workers.append((sink, t, box))
        deadline = self.clock() + self.cfg.timeout
        for sink, t, box in workers:
            t.join(max(0.0, deadline - self.clock()))
            if t.is_alive():
                self._busy[sink] = t
                results[sink] = None
            else:
                self._busy.pop(sink, None)
                results[sink] = bool(box and box[0])
        return results

    def _apprise(self) -> List[Tuple[str, Any]]:
        """One Apprise object per URL (each sink's result is its own), made once, here on the
        sender thread (importing Apprise and its plugins takes a while)."""
        if self._sinks is not None:
            return self._sinks
        self._sinks = []
        if not self.cfg.urls:
            return self._sinks
        # Its plugins load at the first add(): their deprecation warnings are not the run's
        # news (and under warnings-as-errors they would raise); the logger may print a URL.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                import apprise

                logging.getLogger("apprise").setLevel(logging.CRITICAL + 1)
                logging.getLogger("apprise").propagate = False
                objs = [(url, apprise.Apprise()) for url in self.cfg.urls]
                added = [(url, obj) for url, obj in objs if obj.add(url)]
            except Exception as e:  # ImportError, or a broken install
                self._say(
                    "notify_unavailable",
                    f"apprise cannot be used in the agent's Python ({type(e).__name__}): no "
                    "notifications are sent (the dead-man's switch still pings)",
                    klass="usage",  # the agent's install must change, as a URL of notify_bad_url
                    remedy="pip install 'remote-gpu-trainer[notify]' into the agent's venv",
                )
                return self._sinks
        for url, _ in objs:
            if not any(u == url for u, _ in added):
                self._say(
                    "notify_bad_url",
                    f"{safe_url(url)} is not a URL Apprise can send to; it is left out",
                    klass="usage",
                    remedy="fix it in [notify] urls (see Apprise's wiki for the service)",
                )
        self._sinks = added
        return self._sinks

    def _scrub(self, text: str) -> str:
        """``text`` with every configured URL (tokens and all) named by ``safe_url``."""
        for url in (*self.cfg.urls, self.cfg.deadman or ""):
            if url:
                text = text.replace(url, safe_url(url))
        return text

    def _say(self, kind: str, reason: str, **data: Any) -> None:
        if self._closed:
            return
        try:
            self._event(kind, reason, **data)
        except Exception:  # the journal's trouble is not the notifier's to raise
            pass


def _capture(fn: Callable[[], bool], box: List[bool]) -> None:
    try:
        box.append(bool(fn()))
    except Exception:  # a send that raises is a failed send
        box.append(False)


def _apprise_job(obj: Any, msg: Message) -> Callable[[], bool]:
    def send() -> bool:
        import apprise

        return bool(
            obj.notify(
                body=msg.body,
                title=msg.title,
                notify_type=apprise.NotifyType(msg.kind),
                body_format=apprise.NotifyFormat.TEXT,
            )
        )

    return send


def _http_ping(url: str, body: str, timeout: float) -> bool:
    """A healthchecks-style ping: POST with the body (the service keeps it as the ping's
    log); any 2xx is delivered."""
    req = urllib.request.Request(
        url, data=body.encode(), method="POST", headers={"User-Agent": "rgt-agent"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 (the user's URL)
        return 200 <= int(r.status) < 300
