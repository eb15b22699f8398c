"""The release a deploy pushed, when the deploy fails before its run uses it: removed from the
box again where nothing uses it, and one line saying what became of it.

A deploy pushes its code as ``releases/<id>`` (controller/deploy/release.py) before the start,
and points the laptop's record and ``deploys/<name>/current`` at it only once the start
succeeded. A deploy that failed after the push (the start refused or failed; before it, the
agent's install, the secrets' staging, the profile override, a run live on another release;
the Slurm submit refused) left that release with nothing pointing at it, and nothing removed
it later: `rgt down` removes the release its record names, a push only the stale ``.tmp-``
directories of pushes cut off. Every failed redeploy of changed code added one.

So where this deploy created the release (``PushResult.method`` is not "existing": a release
on the box before it may be another run's), ``rgt_release_drop`` (controller/shell/release_use.sh)
runs after such a failure: it keeps the release while a deploy's current link, another deploy's
hold (``deploys/M/pending``: a deploy of the same code under another name, starting in it),
another run's spec or the run's own spec names it (whatever the run's state: the start claimed
the run before it failed, so `rgt deploy T --name N` with no command starts that spec, in this
release, and must find it), and removes it otherwise, printing one word. Such a kept release
goes once the run's spec moves off it and nothing else names it (the next start of the run,
failed or not, or `rgt down` of it: ``rgt_release_left``). After a failed start it runs
within the start's own command (``START_SH``, controller/deploy/boxstart.py, its word after
boxstart.MARK); after a failure
before the start, or a submit the cluster refused with nothing submitted, in one command of its
own (``Left``), on that failure path only. The user sees the deploy's error and exit code as
before, and one line before it (``line``; a release that was on the box before this deploy is
kept, and the line says so, after a failure before the start as after a failed start; this
deploy's hold on it goes all the same). That line is only said (``tell``): a stderr that is gone
(a closed pipe, a closed file) never replaces the
deploy's own error.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

from controller.deploy.release import PushResult, deploy_path
from controller.remote import Remote
from controller.shell import script
from onbox.common.errors import RemoteUnreachable, RgtError
from onbox.common.rundir import RunDir

# The drop on its own: $1 the release, $2 the run's directory, $3 its deploy's; and the deploy's
# hold on a release it did not push let go (release_use.sh), $1 the release, $2 the deploy's.
_DROP_SH = script("release_use.sh") + 'rgt_locked "${3%/*}" rgt_release_drop "$@" || echo failed\n'
_UNHOLD_SH = script("release_use.sh") + 'rgt_locked "${2%/*}" rgt_release_unhold "$@"\n'
_DROP_TIMEOUT = 120.0
_KEPT = {
    "current": "a deploy's current link points at it",
    "used": "another run or deploy on the box uses it",
}
# The word for a drop that never reached the box (rgt_release_drop prints none with a dash).
UNREACHED = "-unreached"


class Left:
    """The release ``pushed`` that a deploy of run ``name`` pushed to ``box_home``, until the
    deploy's start or submit takes it on: ``until_start`` drops it when the deploy fails
    before that, ``drop`` when a submit was refused. At most once; removed only where this
    deploy created it, and one on the box before it is said to be kept."""

    def __init__(
        self,
        remote: Remote,
        pushed: PushResult,
        box_home: str,
        name: str,
        say: Callable[[str], None],
    ) -> None:
        self.remote, self.pushed, self.name, self.say = remote, pushed, name, say
        self.run_dir = RunDir(name, box_home).path
        self.deploy_dir = deploy_path(box_home, name)
        self.done = False

    @contextlib.contextmanager
    def until_start(self) -> Iterator[None]:
        """The steps between the push and the start: an RgtError or a Ctrl-C out of them
        drops the release (``drop``), then goes on as it was."""
        try:
            yield
        except RgtError:
            self.drop("the deploy failed before its start")
            raise
        except KeyboardInterrupt:  # nothing has run in the release: it goes as with an error
            self.drop("the deploy was interrupted before its start")
            raise

    def drop(self, why: str) -> None:
        """Remove the release from the box where nothing uses it, in one command, and say what
        became of it; ``why``: what failed. Never raises: the caller's error is the one to
        show, with its exit code (a box that cannot be reached, or a second Ctrl-C, leaves the
        release, and the line says so)."""
        if self.done:
            return
        self.done = True
        if self.pushed.method == "existing":  # another run's, maybe: kept, and no longer held
            with contextlib.suppress(RgtError, OSError, KeyboardInterrupt):
                self.remote.sh(_UNHOLD_SH, self.pushed.path, self.deploy_dir, timeout=_DROP_TIMEOUT)
            tell(self.say, line(self.pushed, self.name, None, why))
            return
        word: Optional[str] = None
        try:
            r = self.remote.sh(
                _DROP_SH, self.pushed.path, self.run_dir, self.deploy_dir, timeout=_DROP_TIMEOUT
            )
            if r.rc == 0:
                word = r.text.strip()
        except RemoteUnreachable:
            word = UNREACHED
        except (RgtError, OSError, KeyboardInterrupt):
            word = None
        tell(self.say, line(self.pushed, self.name, word, why))


def tell(say: Callable[[str], None], text: str) -> None:
    """``say`` the line of what became of the release, on a failure path: a stderr that is
    gone (``rgt deploy 2>&1 | head`` once head is done: EPIPE; a closed file) leaves it unsaid
    rather than replace the deploy's own error and exit code, which follow it."""
    try:
        say(text)
    except (OSError, ValueError):
        pass


def line(pushed: PushResult, name: str, word: Optional[str], why: str = "the start failed") -> str:
    """What a deploy of run ``name`` that failed (``why``) says of the release it pushed, given
    the drop's ``word`` (none when the release was on the box before this deploy)."""
    rel = f"rgt: release {pushed.id}"
    if pushed.method == "existing":
        return f"{rel} is kept on the box: it was there before this deploy"
    if word == "removed":
        return (
            f"{rel}, which this deploy pushed, was removed from the box again: {why}, and no "
            "run or deploy uses it"
        )
    if word == "gone":
        return f"{rel}, which this deploy pushed, is no longer on the box"
    if word in _KEPT:
        return f"{rel}, which this deploy pushed, is kept on the box: {_KEPT[word]}"
    if word == "run":
        return (
            f"{rel}, which this deploy pushed, is kept on the box: run {name}'s spec there names "
            f"it (the start claimed the run before it failed), so `rgt deploy` of --name {name} "
            "with no command starts the run in it"
        )
    if word == "failed":
        return (
            f"{rel}, which this deploy pushed, could not be removed from the box: remove "
            f"{pushed.path} by hand once no run uses it"
        )
    if word == UNREACHED:
        return (
            f"{rel}, which this deploy pushed, was not removed from the box: {why}, and the box "
            f"could not be reached to remove it; remove {pushed.path} by hand once no run uses it"
        )
    return (
        f"{rel}, which this deploy pushed, may be left on the box: the box did not say whether "
        f"it removed it ({pushed.path})"
    )
