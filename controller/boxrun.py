"""The one reader of a run on the box: its paths, its spec.json and its agent's status.

The paths are onbox.common.rundir.RunDir's, under the RGT_HOME the box reported at deploy
(never built here by hand). ``rgt-agent status NAME --json`` is run from here (``status_argv``),
and where a caller needs the spec and the status together they come in one round trip
(``read``). Everything read from the box is untrusted input: the spec must be a JSON object,
the status JSON; ``run_dir`` checks RGT_HOME and the name before they become names on the
laptop, ``spec_dirs`` the spec's directories.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

from controller.registry import RunRecord
from controller.remote import Remote
from controller.shell import script
from onbox.agent.observe import shaped
from onbox.common import jsondoc
from onbox.common.errors import HostError, IntegrityError, NotFound, UsageError
from onbox.common.rundir import RunDir
from onbox.common.safepath import safe_abs, safe_rel

_STATUS_RC = b"\nrgt-status-rc "


def run_dir(rec: RunRecord) -> RunDir:
    """The run's directory on the box ($RGT_HOME/runs/NAME), its RGT_HOME absolute and
    normalised and its name a plain one: its paths become staging names on the laptop."""
    if not rec.box_home.startswith("/"):
        raise UsageError(
            "run", f"the record of {rec.name!r} has no RGT_HOME on the box", "deploy it again"
        )
    # The box reported its RGT_HOME at deploy: it becomes part of staging names here.
    home = safe_abs(rec.box_home.rstrip("/") or "/", f"RGT_HOME of {rec.name!r} on the box")
    return RunDir(safe_rel(rec.name, "run name"), home)


def look_dir(rec: RunRecord) -> RunDir:
    """The run's directory on the box, for a look that only passes its paths to the box's
    shell as arguments (status, watch, deploy's look): RGT_HOME as recorded, unchecked."""
    return RunDir(rec.name, rec.box_home or "/")


def status_argv(rec: RunRecord) -> List[str]:
    """The argv of ``rgt-agent status NAME --json`` on the box."""
    return rec.agent_argv("status", rec.name, "--json")


def status(rec: RunRecord, remote: Remote) -> Dict[str, Any]:
    """``rgt-agent status N --json`` on the box (HostError when it fails or prints no JSON)."""
    r = remote.run(status_argv(rec), env=None, timeout=60)
    return _status_doc(rec, remote, r.rc, r.stdout, r.err)


def poll_status(rec: RunRecord, remote: Remote) -> Dict[str, Any]:
    """``rgt-agent status N --json`` as a poll reads it: {} when it printed no JSON object."""
    r = remote.run(status_argv(rec), timeout=60)
    try:
        doc = jsondoc.loads(r.stdout)
    except ValueError:
        return {}
    return shaped(doc) if isinstance(doc, dict) else {}


def _status_doc(rec: RunRecord, remote: Remote, rc: int, out: bytes, err: str) -> Dict[str, Any]:
    if rc != 0:
        raise HostError(
            f"rgt-agent status {rec.name} failed on {remote.target.label} (exit {rc}): "
            f"{err.strip()[-300:]}"
        )
    try:
        doc = jsondoc.loads(out)
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        raise HostError(f"rgt-agent status {rec.name} printed no JSON object")
    return shaped(doc)


def spec(rec: RunRecord, remote: Remote) -> Dict[str, Any]:
    """The run's spec.json on the box (NotFound when its directory is gone)."""
    path = run_dir(rec).spec
    r = remote.sh('[ -f "$1" ] || exit 44; exec cat -- "$1"', path, what=f"cat {path}")
    if r.rc == 44:
        return _spec_doc(rec, remote, path, None)
    if r.rc != 0:
        raise HostError(f"cannot read {path} on {remote.target.label}: {r.err.strip()}")
    return _spec_doc(rec, remote, path, r.stdout)


def _spec_doc(rec: RunRecord, remote: Remote, path: str, data: Optional[bytes]) -> Dict[str, Any]:
    if data is None:
        raise NotFound(
            f"run {rec.name!r} has no run directory on {remote.target.label} ({path})",
            "was it taken down? pull --from store",
        )
    try:
        doc = jsondoc.loads(data)
    except ValueError:
        raise IntegrityError(f"{path} on {remote.target.label} is not valid JSON") from None
    if not isinstance(doc, dict):
        raise IntegrityError(f"{path} on {remote.target.label} is not a JSON object")
    return doc


@dataclasses.dataclass(frozen=True)
class BoxRun:
    """A run as its box sees it, read in one round trip."""

    spec: Dict[str, Any]
    status: Dict[str, Any]


def read(rec: RunRecord, remote: Remote) -> BoxRun:
    """The run's spec.json and ``rgt-agent status N --json``, in one round trip, checked as
    ``spec`` and ``status`` check them, the spec first."""
    path = run_dir(rec).spec
    what = f"rgt-agent status {rec.name} --json with {path}"
    r = remote.sh(script("boxrun.sh"), path, *status_argv(rec), timeout=120, what=what)
    if r.rc != 0:
        raise HostError(f"cannot read {path} on {remote.target.label}: {r.err.strip()}")
    at = r.stdout.find(_STATUS_RC)
    end = r.stdout.find(b"\n", at + len(_STATUS_RC)) if at >= 0 else -1
    rc = r.stdout[at + len(_STATUS_RC) : end] if end >= 0 else b""
    rest = r.stdout[end + 1 :]
    if not rc.isdigit() or rest[:2] not in (b"N\n", b"F\n"):
        raise HostError(f"reading the run {rec.name!r} on {remote.target.label} was cut short")
    doc = _spec_doc(rec, remote, path, rest[2:] if rest[:2] == b"F\n" else None)
    return BoxRun(doc, _status_doc(rec, remote, int(rc), r.stdout[:at], r.err))


def spec_dirs(rec: RunRecord, doc: Dict[str, Any], remote: Remote) -> Tuple[str, str]:
    """``ckpt_dir`` and ``workdir`` of the box's spec.json, refused (exit 6) unless absolute
    and normalised as the agent writes them: they become staging names on the laptop."""
    where = f"spec.json of {rec.name!r} on {remote.target.label}"
    remedy = "the agent writes them absolute and normalised: the box's spec.json was altered"
    return (
        safe_abs(doc.get("ckpt_dir"), f"{where}: ckpt_dir", remedy),
        safe_abs(doc.get("workdir"), f"{where}: workdir", remedy),
    )
