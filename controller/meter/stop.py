"""The meter-stop step of ``rgt down``: after the run is off the box, stop the box's meter
through the provider's API, once, journaled, and poll until the provider no longer has it.

rgt acts only on the resource it was pointed at (``rgt deploy --instance ID`` or ``rgt down N
--instance ID``); with no id it stops nothing and says what to pass. Where the profile has no
API (``meter.api = "none"``) it prints the profile's console steps and calls nothing.

The outcomes (``Outcome.kind``), and where down fails the error it raises:

    gone         the show call said gone before any stop call: nothing was sent
    confirmed    the call was sent and polling saw the resource gone (or off)
    refused      the provider said no (a 4xx): nothing changed      MeterRefused, exit 16
    unresolved   no answer, or still listed when the poll gave up   MeterUnresolved, exit 17
    not sent     the first show told nothing (no connection, a 5xx, MeterNotSent, exit 20
                 a page that is no JSON object), or the call never
                 reached the provider: nothing was sent
    console      no API: the console steps were shown
    no-instance  an API, but no id: nothing was stopped

A second down reads the journal: a call that was sent (or whose outcome is unknown) is never
sent again; down only polls. One that was not sent is sent by the next down.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable, Mapping, Optional

from controller import envnames
from controller.meter import journal
from controller.meter.api import (
    Answered,
    Client,
    NoAnswer,
    NotSent,
    Unreadable,
    check_instance,
    client,
    key_name,
    noun,
    title,
)
from onbox.common.errors import (
    IntegrityError,
    MeterNotSent,
    MeterRefused,
    MeterUnresolved,
    UsageError,
)
from onbox.profiles.schema import Profile


@dataclasses.dataclass
class Outcome:
    """What the meter-stop came to (module docstring); ``stopped``: the meter is off."""

    kind: str
    what: str

    @property
    def stopped(self) -> bool:
        return self.kind in ("gone", "confirmed")


@dataclasses.dataclass
class Step:
    """One run's meter-stop: its name, profile and the resource's id, and how to report."""

    run: str
    profile: Profile
    instance: Optional[str]
    show: Callable[[str], None]
    home: Optional[str] = None
    environ: Optional[Mapping[str, str]] = None
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic

    @property
    def api(self) -> str:
        return self.profile.meter.api

    @property
    def noun(self) -> str:
        return noun(self.api)

    def wait(self) -> float:
        env = os.environ if self.environ is None else self.environ
        try:
            return float(env.get(envnames.METER_WAIT) or 600)
        except ValueError:
            raise UsageError(envnames.METER_WAIT, "not a number of seconds") from None


def pending(run: str, home: Optional[str] = None) -> Optional[journal.Journal]:
    """The run's journal when an earlier down sent its call and its end is not known."""
    j = journal.load(run, home)
    return j if j is not None and j.call_sent else None


def stop_meter(step: Step) -> Outcome:
    """Stop the meter of ``step.instance`` (module docstring)."""
    m = step.profile.meter
    if m.api == "none":
        step.show(
            f"rgt has no API to stop this box's meter ({step.profile.title}); its meter-stop "
            f"is {m.verb}, in the console:"
        )
        for i, line in enumerate(m.console_steps, 1):
            step.show(f"  {i}. {line}")
        return Outcome("console", "the console steps were shown; nothing was called")
    if not step.instance:
        what = (
            f"rgt was not told the {step.noun}'s id, so it stopped nothing: the {step.noun} "
            f"keeps billing (to {m.verb} it: rgt down {step.run} --instance ID)"
        )
        step.show(what)
        return Outcome("no-instance", what)
    check_instance(step.instance)  # it goes into a URL's path: the record's too
    j = journal.load(step.run, step.home)
    if j is not None and j.api != step.api and j.call_sent:
        # Polling this profile's provider could not tell how a call to another one ended.
        raise IntegrityError(
            f"the meter journal {j.path} says an earlier down sent the {j.verb} of {j.api} "
            f"{j.instance}, but the run's profile stops its meter through {step.api}",
            f"check {title(j.api)}'s console for {j.instance}; once it is gone there, move the "
            "journal aside",
        )
    same = j is not None and j.api == step.api and j.instance == step.instance
    if j is not None and not same and j.call_sent:
        raise UsageError(
            "--instance",
            f"an earlier down of {step.run} sent the {j.verb} of {j.api} {j.instance}, and its "
            f"end is not known; rgt will not act on {step.instance} before it is",
            f"rgt down {step.run} --instance {j.instance}",
        )
    if j is not None and same and j.state in ("gone", "confirmed"):
        what = f"the {step.noun} {step.instance}: {j.verb} done already ({j.state}, journaled)"
        step.show(what)
        return Outcome(j.state, what)
    c = client(step.api, step.environ)
    if j is not None and same and j.call_sent:
        step.show(
            f"an earlier down: the {m.verb} of {c.title} {step.noun} {step.instance} was "
            f"{_sent(j)}: rgt never sends it again; polling until the provider no longer lists it"
        )
        return _poll(step, c, j)
    return _first(step, c, journal.start(step.run, step.api, step.instance, m.verb, step.home))


def _first(step: Step, c: Client, j: journal.Journal) -> Outcome:
    """No call sent yet: ask, then send it once, then poll."""
    ident, verb = j.instance, j.verb
    where = f"{c.title} {step.noun} {ident}"
    try:
        seen = c.show(ident)
    except Answered as e:
        if 400 <= e.status < 500:
            raise _refused(
                step, c, f"{c.title} refused to show the {step.noun} {ident}: {e}"
            ) from None
        # A 5xx (or a 3xx) is an answer, but none about the box: it tells nothing, as below.
        raise _not_sent(step, c, f"{c.title}'s API answered {e}") from None
    except Unreadable as e:  # not a 404: whether it is still there is not known
        raise _not_sent(step, c, f"{c.title}'s API gave no answer rgt can read ({e})") from None
    except (NotSent, NoAnswer) as e:
        raise _not_sent(step, c, f"{c.title}'s API did not answer ({e})") from None
    if c.settled(seen, accepted=False):
        was = "gone" if seen.gone else seen.status
        what = f"the {step.noun} {ident} was {was} already ({seen.status}): nothing sent"
        j.note("gone", what)
        step.show(what)
        return Outcome("gone", what)
    j.note("intent", f"{verb} {where} (it was {seen.status})")
    step.show(f"{verb} {where} (it is {seen.status}) ...")
    try:
        c.stop(ident)
    except Answered as e:
        if 400 <= e.status < 500 and e.status != 404:
            j.note("refused", str(e))
            what = f"{c.title} refused to {verb} the {step.noun} {ident}: {e}"
            raise _refused(step, c, what) from None
        # A 404 (gone under us) or a 5xx or 3xx: the provider may have acted. Poll, never resend.
        j.unknown = e.status >= 300 and e.status != 404
        j.answer = str(e)
        j.note("sent", f"answered {e}: polling")
    except NotSent as e:
        j.note("not-sent", str(e))
        raise MeterNotSent(
            f"{where}: the {verb} call never reached {c.title} ({e}); nothing changed: the "
            f"{step.noun} keeps billing",
            f"run rgt down {step.run} again (it sends the {verb}); or {verb} it at {c.console}",
        ) from None
    except NoAnswer as e:
        j.unknown = True
        if isinstance(e, Unreadable):  # answered, but with nothing rgt can read
            j.answer = str(e)
        said = "answered" if j.answer else "no answer"
        j.note("sent", f"{said} ({e}): the outcome is unknown; polling, never re-sending")
    else:
        j.accepted = True
        j.note("sent", "accepted")
    return _poll(step, c, j)


def _not_sent(step: Step, c: Client, why: str) -> MeterNotSent:
    """The first show told nothing: whether the box is gone is not known, and nothing was sent."""
    m = step.profile.meter
    return MeterNotSent(
        f"{c.title} {step.noun} {step.instance}: {why}, so whether the {step.noun} is gone is "
        f"not known; nothing was sent: it may still be billing",
        f"run rgt down {step.run} again later (it sends the {m.verb}); or {m.verb} it at "
        f"{c.console}",
    )


def _refused(step: Step, c: Client, what: str) -> MeterRefused:
    return MeterRefused(
        f"{what}; nothing changed: the {step.noun} keeps billing",
        f"check {key_name(c.api)} (a key of the account that owns it) and the id, then rgt down "
        f"{step.run} again; or {step.profile.meter.verb} it at {c.console}",
    )


def _sent(j: journal.Journal) -> str:
    """What came of the journaled call, as told in messages ("the terminate was ...")."""
    if j.accepted:
        return "sent and it was accepted"
    if j.answer:  # a 5xx or 3xx, a 404, a page: answered, though not accepted
        return f"sent and answered ({j.answer})" + (
            ", so its outcome is unknown" if j.unknown else ""
        )
    if j.unknown:
        return "sent and got no answer"
    return "perhaps sent (an earlier rgt stopped before it saw what came of it)"


def _poll(step: Step, c: Client, j: journal.Journal) -> Outcome:
    """Show until the resource is gone (bounded, with backoff); confirmed or unresolved."""
    wait = step.wait()
    deadline = step.clock() + wait
    delay, last, polls = 0.5, "no answer yet", 0
    while True:
        polls += 1
        try:
            seen = c.show(j.instance)
        except (Answered, NotSent, NoAnswer) as e:
            last = str(e)
        else:
            if c.settled(seen, accepted=j.accepted):
                what = f"the {step.noun} {j.instance}: {j.verb} confirmed, {seen.status}"
                what += f" ({polls} poll{'' if polls == 1 else 's'})"
                j.note("confirmed", what)
                step.show(what)
                return Outcome("confirmed", what)
            last = f"still listed: {seen.status}"
        if step.clock() + delay > deadline:
            break
        step.sleep(delay)
        delay = min(delay * 2, 15.0)
    j.note("unresolved", f"after {wait:.0f} s of polling: {last}")
    raise MeterUnresolved(
        f"{c.title} {step.noun} {j.instance}: the {j.verb} was {_sent(j)}, but after {wait:.0f} s "
        f"the provider still does not say it is gone ({last}); it may still be billing",
        f"check {c.console}: the {step.noun} {j.instance} must be gone"
        + (" or off" if step.profile.meter.reversible else "")
        + f"; rgt down {step.run} polls again and never re-sends the {j.verb}",
    )
