"""The release a deploy pushed for a start that failed: removed from the box again when nothing
uses it, within the start's own command, and one line saying what became of it.

A deploy pushes its code as ``releases/<id>`` (controller/deploy/release.py) before the start,
and points the laptop's record and ``deploys/<name>/current`` at it only once the start
succeeded. A start the box refused or failed (the epoch refused, the restore stalled, a job the
box cannot run, the run held by another agent) left that release with nothing pointing at it,
and nothing removed it later: `rgt down` removes the release its record names, a push only the
stale ``.tmp-`` directories of pushes cut off. Every failed redeploy of changed code added one.

So where this deploy created the release (``PushResult.method`` is not "existing": a release
on the box before it may be another run's), the start's line (``START_SH``,
controller/deploy/boxstart.py) is given its deploy's directory: when the start exits non-zero,
the same command runs ``rgt_release_drop`` (controller/shell/release_use.sh), which keeps the
release while a deploy's current link or another run's spec names it, or the run's own spec
names it and the run is not FAILED (a start cut by a preemption or a stop, or another start of
the run, may run it there), and removes it otherwise. Its word is said last on stdout
(boxstart.MARK); the user sees the box's error and exit code as before, and one line before it
(``line``).
"""

from __future__ import annotations

from typing import Optional

from controller.deploy.release import PushResult

_KEPT = {
    "current": "a deploy's current link points at it",
    "used": "another run or deploy on the box uses it",
}


def line(pushed: PushResult, name: str, word: Optional[str]) -> str:
    """What a deploy whose start of run ``name`` failed says of the release it pushed, given
    the drop's ``word`` (none when the release was on the box before this deploy)."""
    rel = f"rgt: release {pushed.id}"
    if pushed.method == "existing":
        return f"{rel} is kept on the box: it was there before this deploy"
    if word == "removed":
        return (
            f"{rel}, which this deploy pushed, was removed from the box again: the start "
            "failed, and no run or deploy uses it"
        )
    if word == "gone":
        return f"{rel}, which this deploy pushed, is no longer on the box"
    if word in _KEPT:
        return f"{rel}, which this deploy pushed, is kept on the box: {_KEPT[word]}"
    if word == "run":
        return (
            f"{rel}, which this deploy pushed, is kept on the box: run {name} there names it "
            "and is not FAILED, so it may run there"
        )
    if word == "failed":
        return (
            f"{rel}, which this deploy pushed, could not be removed from the box: remove "
            f"{pushed.path} by hand once no run uses it"
        )
    return (
        f"{rel}, which this deploy pushed, may be left on the box: the box did not say whether "
        f"it removed it ({pushed.path})"
    )
