"""`rgt doctor TARGET`: the box held against its platform profile, in one round trip that
changes nothing but a probe file it removes (controller/shell/doctor.sh).

Checked, each one verdict (ok, warn or problem, each warning and problem with its remedy):

- the durable location (the profile's ``durable.path``, or a ``--store`` file:// path) is there,
  writable (a probe file created, fsynced and removed; EROFS, EACCES and ENOSPC named), really a
  filesystem of its own, not the work dir's or RGT_HOME's (a durable volume that failed to mount
  is just a directory on the volatile disk), with byte and inode headroom for the checkpoint
  budget (``--budget``);
- egress to the store (s3: its endpoint; hf: $HF_ENDPOINT or the Hub; file: n/a);
- the profile's proxy hook: there, setting http(s)_proxy when sourced, and a request to a known
  host without and with it (bounded; an offline box is only reported);
- Python and CUDA as the profile expects;
- the profile's facts: a warning for tables last checked more than six months ago, and for
  those never tried hands-on.

The first time this laptop meets the target under the profile, its danger clocks and
conveniences are shown (controller/contacts.py; ``--verbose`` shows them again). Exit 0 with no
problem, else HostError (9) after every finding is printed.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from typing import Callable, Dict, List, Optional, Tuple

from controller import contacts, shell
from controller.capture import box_int
from controller.deploy import guess as guessmod
from controller.deploy.audit import Finding, df_free, sections
from controller.deploy.flow import box_home_for
from controller.deploy.request import named_profile
from controller.profiles import user_dirs as profile_dirs
from controller.remote import Remote, open_remote
from controller.target import Target, parse_target
from onbox.common import size
from onbox.common.errors import HostError
from onbox.common.storeurl import StoreURL, parse_store_url
from onbox.common.terminal import printable
from onbox.profiles.schema import Profile

SCRIPT = shell.script("doctor.sh")
DEFAULT_BUDGET = "20G"
BUDGET_INODES = 5000  # a few checkpoints of a sharded model: thousands of small files
NET_TIMEOUT_S = 5
STALE_MONTHS = 6
KNOWN_URL = "https://pypi.org/simple/"
S3_ENDPOINT = "https://s3.amazonaws.com"
HF_ENDPOINT = "https://huggingface.co"
MIN_PYTHON = (3, 9)
# curl's exit codes that say why no answer came.
_CURL = {
    "5": "the proxy's name does not resolve",
    "6": "the host name does not resolve (no DNS, or no egress)",
    "7": "the connection was refused or cut (a firewall, or no route)",
    "28": f"no answer within {NET_TIMEOUT_S} s",
    "35": "the TLS handshake failed (an intercepting proxy?)",
    "60": "its TLS certificate is not trusted here (an intercepting proxy's CA?)",
}
_ERRNO = {
    "Read-only file system": ("EROFS", "remount it read-write, or give --store a writable one"),
    "Permission denied": ("EACCES", "give the box's user write access there (chown or chmod)"),
    "No space left on device": (
        "ENOSPC",
        "free bytes and inodes there (old checkpoints, caches), or give --store another disk",
    ),
}


@dataclasses.dataclass
class Report:
    """What `rgt doctor` found: the profile held against and why, every finding, and the
    first-contact notes shown this time (empty when the target was met before)."""

    target: Target
    guess: guessmod.Guess
    findings: List[Finding]
    first_contact: List[str]

    @property
    def problems(self) -> List[Finding]:
        return [f for f in self.findings if f.level == "problem"]

    def to_json(self) -> Dict[str, object]:
        return {
            "target": self.target.label,
            "profile": self.guess.profile.name,
            "why": self.guess.why,
            "findings": [dataclasses.asdict(f) for f in self.findings],
            "first_contact": self.first_contact,
        }


def parse_size(text: str, field: str = "--budget") -> int:
    """Bytes of "20G", "512M", "1.5T", "4096" (powers of 1024); UsageError otherwise."""
    return size.parse_size(text, field)


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def doctor(
    target_text: str,
    *,
    profile: Optional[str] = None,
    store: Optional[str] = None,
    budget: str = DEFAULT_BUDGET,
    verbose: bool = False,
    today: Optional[datetime.date] = None,
) -> Report:
    """Audit the box against its profile; findings, not exceptions, for what is wrong.

    With no --profile and no host pattern matching, the round trip is made under generic-ssh
    and also lists the profiles' markers; only when they name another profile is it made
    again, under that one."""
    target = parse_target(target_text)
    need = parse_size(budget)
    url = parse_store_url(store, "--store") if store is not None else None
    dirs = profile_dirs()
    guess = named_profile(profile, target, dirs) if profile else None
    if guess is None and target.kind == "local":
        guess = guessmod.chosen(target, dirs)
    if guess is None:
        guess = guessmod.by_host(target, guessmod.candidates(dirs))
    remote = open_remote(target)
    try:
        if guess is not None:
            s = _trip(remote, guess.profile, url)
        else:
            fallback = guessmod.chosen(target, dirs, [])
            markers = guessmod.marker_args(guessmod.candidates(dirs))
            s = _trip(remote, fallback.profile, url, markers)
            guess = guessmod.chosen(target, dirs, s.get("markers") or [])
            if guess.profile.name != fallback.profile.name:
                s = _trip(remote, guess.profile, url)
    finally:
        remote.close()
    prof = guess.profile
    durable, kind, _ = _where(prof, url)
    found: List[Finding] = []
    _durable(s, durable, url.url if url else None, need, found)
    _egress(s.get("egress") or [], kind, found)
    _proxy(prof, s.get("proxy") or [], found)
    _python(prof, s.get("python") or [], found)
    _gpu(prof, s.get("gpu") or [], s.get("cuda") or [], found)
    found += stale_facts(prof, today or datetime.date.today())
    notes = contacts.first_contact(target.label, prof, again=verbose)
    return Report(target, guess, found, notes)


def _where(prof: Profile, url: Optional[StoreURL]) -> Tuple[Optional[str], str, str]:
    """The durable path to check (None: none on the box), the store's kind for the egress
    check ("" for none or file://) and its endpoint when the box's environment names none."""
    durable = url.path if url is not None and url.scheme == "file" else None
    if url is None:
        durable = prof.durable.path or None
    kind = url.scheme if url is not None and url.scheme != "file" else ""
    endpoint = (url.endpoint_url if url else None) or S3_ENDPOINT
    if kind == "hf":
        endpoint = prof.env.vars.get("HF_ENDPOINT") or HF_ENDPOINT
    return durable, kind, endpoint


def _trip(
    remote: Remote,
    prof: Profile,
    url: Optional[StoreURL],
    markers: Tuple[str, str] = ("", ""),
) -> Dict[str, List[str]]:
    """doctor.sh's sections, read under ``prof`` (and rgt_markers' with ``markers``)."""
    durable, kind, endpoint = _where(prof, url)
    res = remote.sh(
        guessmod.MARKERS_SH + SCRIPT,
        box_home_for(remote, ""),
        prof.box.workdir,
        durable or "",
        prof.box.python,
        prof.env.proxy_hook,
        kind,
        endpoint,
        KNOWN_URL if prof.env.proxy_hook else "",
        str(NET_TIMEOUT_S),
        f".rgt-doctor-probe-{os.urandom(6).hex()}",
        *markers,
        timeout=120,
    )
    s = sections(res.text)
    if "fs" not in s:
        raise HostError(
            f"the doctor's script failed on {remote.target.label}: {res.err.strip()[-300:]}"
        )
    return s


def _fs(lines: List[str]) -> Dict[str, List[str]]:
    """doctor.sh's @@fs lines by name: [state, device, fs type, mount point, path]."""
    out = {}
    for line in lines:
        parts = line.split("\t")
        if len(parts) >= 6:
            out[parts[0]] = parts[1:6]
    return out


def _durable(
    s: Dict[str, List[str]],
    path: Optional[str],
    store: Optional[str],
    need: int,
    found: List[Finding],
) -> None:
    """The durable location's verdicts: there, writable, its own filesystem, headroom."""
    if path is None:
        if store is not None:
            found.append(Finding("ok", f"durable store {store} is off the box"))
        else:
            found.append(
                Finding(
                    "warn",
                    "no durable location: this profile keeps none on the box",
                    "give --store: a mount of another disk (file://), s3:// or hf://",
                )
            )
        return
    fs = _fs(s.get("fs") or [])
    state = (fs.get("durable") or ["missing"])[0]
    if state != "dir":
        what = "does not exist" if state == "missing" else "is not a directory"
        found.append(
            Finding(
                "problem",
                f"durable location {path} {what}",
                f"mount the durable volume at {path}, or give --store another location",
            )
        )
        return
    _probe(path, s.get("probe") or [], found)
    _own_fs(path, fs, found)
    df = s.get("df") or []
    if len(df) >= 2:
        _headroom(path, *df_free(df[0], df[1]), need, found)


def _probe(path: str, lines: List[str], found: List[Finding]) -> None:
    line = (lines or ["fail no answer"])[0]
    if line == "ok":
        found.append(Finding("ok", f"{path} is writable (a probe file written, fsynced, removed)"))
        return
    msg = line[len("fail ") :] if line.startswith("fail ") else line
    for text, (code, remedy) in _ERRNO.items():
        if text in msg:
            why = "full" if code == "ENOSPC" else text.lower()
            found.append(Finding("problem", f"{path} is not writable: {why} ({code})", remedy))
            return
    found.append(
        Finding("problem", f"{path} is not writable: {msg[:200]}", "fix it, or give --store")
    )


def _own_fs(path: str, fs: Dict[str, List[str]], found: List[Finding]) -> None:
    """A durable location on the work dir's or RGT_HOME's filesystem is no durable at all."""
    _, dev, fstype, mount, _ = fs["durable"]
    for name, what in (("work", "the work dir"), ("home", "RGT_HOME")):
        other = fs.get(name)
        if other is not None and dev and other[1] == dev:
            found.append(
                Finding(
                    "problem",
                    f"{path} is on the same filesystem as {what} {other[4]} ({fstype}, "
                    f"mounted at {mount}): a durable mount that failed to mount is just a "
                    "directory on the volatile disk",
                    f"mount the durable volume at {path} (check `findmnt {path}`), or give "
                    "--store on another disk, s3:// or hf://",
                )
            )
            return
    found.append(Finding("ok", f"{path} is a filesystem of its own ({fstype} at {mount})"))


def _headroom(
    path: str, free: Optional[int], inodes: Optional[int], need: int, found: List[Finding]
) -> None:
    if free is not None:
        if free < need:
            found.append(
                Finding(
                    "problem",
                    f"{path} has {_gib(free)} free, under the checkpoint budget of {_gib(need)}",
                    "free space there, or lower --budget to what a few checkpoints take",
                )
            )
        else:
            found.append(Finding("ok", f"{_gib(free)} free at {path} (budget {_gib(need)})"))
    if inodes is not None:
        if inodes < BUDGET_INODES:
            found.append(
                Finding(
                    "problem",
                    f"{path} has {inodes} inodes free, under the {BUDGET_INODES} a checkpoint "
                    "budget needs: out of inodes whatever its free bytes",
                    "delete small files there (old checkpoints, caches), or give --store a "
                    "filesystem with more inodes",
                )
            )
        else:
            found.append(Finding("ok", f"{inodes} inodes free at {path} (need {BUDGET_INODES})"))


def _reach(text: str) -> Tuple[bool, str]:
    """rgt_get's "RC CODE": whether an answer came, and how to say it."""
    rc, _, code = text.strip().partition(" ")
    code = code.split(" ")[0]
    if rc == "notool":
        return False, "not tried (neither curl nor wget on the box)"
    if rc == "0":
        return True, f"answered (HTTP {code})"
    why = _CURL.get(rc, f"no answer within {NET_TIMEOUT_S} s")
    return False, f"{why} (curl exit {rc})"


def _egress(lines: List[str], kind: str, found: List[Finding]) -> None:
    if not kind:
        return
    line = (lines or [""])[0]
    url = line.split(" ", 2)[2] if line.count(" ") >= 2 else "?"
    ok, said = _reach(line)
    if ok:
        found.append(Finding("ok", f"egress to the {kind} store's endpoint {url}: {said}"))
        return
    found.append(
        Finding(
            "warn" if said.startswith("not tried") else "problem",
            f"egress to the {kind} store's endpoint {url}: {said}",
            "open egress to it from the box (or its proxy), or seal to a store it can reach",
        )
    )


def _proxy(prof: Profile, lines: List[str], found: List[Finding]) -> None:
    hook = prof.env.proxy_hook
    if not hook:
        return
    got = dict(line.partition(" ")[::2] for line in lines)
    if got.get("hook") != "present":
        found.append(
            Finding(
                "warn",
                f"the profile's proxy hook {hook} is not on the box",
                "the job runs without a proxy; check this is the platform the profile says",
            )
        )
        return
    if not box_int(got.get("set", "0")):
        found.append(
            Finding(
                "warn",
                f"sourcing {hook} sets no http(s)_proxy",
                "read the hook; the job's downloads go without a proxy",
            )
        )
    else:
        found.append(Finding("ok", f"sourcing {hook} sets http(s)_proxy"))
    plain, with_ = _reach(got.get("plain", "")), _reach(got.get("with", ""))
    level = "ok" if with_[0] or plain[0] else "warn"
    found.append(
        Finding(
            level,
            f"a request to {KNOWN_URL}: without the proxy {plain[1]}; with it {with_[1]}",
            "" if level == "ok" else "an offline box: bring dependencies (rgt deploy --offline)",
        )
    )


def _python(prof: Profile, lines: List[str], found: List[Finding]) -> None:
    want = prof.box.python or "python3"
    if not lines or lines[0] == "-":
        found.append(
            Finding(
                "problem",
                f"no Python {want} on the box",
                "give rgt deploy --python PATH (the Python the job's packages are in)",
            )
        )
        return
    ver = (lines[1] if len(lines) > 1 else "").strip()
    parts = tuple(n for n in (box_int(p) for p in ver.split(".")[:2]) if n is not None)
    if len(parts) < 2 or parts < MIN_PYTHON:
        found.append(
            Finding(
                "problem",
                f"{lines[0]} is Python {ver or '?'}; rgt's agent needs 3.9 or newer",
                "give rgt deploy --python PATH to a newer one",
            )
        )
        return
    found.append(Finding("ok", f"python {ver} at {lines[0]}"))


def _gpu(prof: Profile, gpus: List[str], cuda: List[str], found: List[Finding]) -> None:
    gpus = [g.strip() for g in gpus if g.strip()]
    if not gpus:
        found.append(
            Finding(
                "warn",
                "no NVIDIA GPU visible (nvidia-smi found none): CPU only",
                "check the instance has a GPU (a no-GPU mode has none)",
            )
        )
        return
    ver = (cuda or [""])[0].strip() or "?"
    note = f"; the profile says CUDA is {prof.box.cuda}" if prof.box.cuda else ""
    found.append(Finding("ok", f"{len(gpus)} GPU(s): {gpus[0]}, driver CUDA {ver}{note}"))


def _months(checked: str, today: datetime.date) -> int:
    y, m = (int(x) for x in checked.split("-"))
    return (today.year - y) * 12 + today.month - m


def stale_facts(prof: Profile, today: datetime.date) -> List[Finding]:
    """One warning listing the tables last checked more than six months before ``today``,
    and one listing those never tried hands-on."""
    out: List[Finding] = []
    facts = prof.facts()
    old = [f"{w} ({st.checked})" for w, st in facts if _months(st.checked, today) > STALE_MONTHS]
    if old:
        out.append(
            Finding(
                "warn",
                f"profile {prof.name}: facts older than {STALE_MONTHS} months: {', '.join(old)}",
                "check them against the platform's docs, and update checked in the profile",
            )
        )
    untried = [w for w, st in facts if not st.hands_on]
    if untried:
        out.append(
            Finding(
                "warn",
                f"profile {prof.name}: never tested hands-on: {', '.join(untried)}",
                "trust them less; report what you see (and set hands_on) once tried",
            )
        )
    return out


def show(report: Report, emit: Callable[[str], None]) -> None:
    """The report as lines: the profile, first-contact notes, then each finding."""
    emit(report.guess.line)
    for line in report.first_contact:
        emit(line)
    for f in report.findings:  # the box's words in them (a GPU's name, paths, versions)
        emit(printable(f"  {'ok  ' if f.level == 'ok' else f.level.upper() + ':'} {f.what}"))
        if f.remedy and f.level != "ok":
            emit(printable(f"        fix: {f.remedy}"))


def run(
    target: str,
    emit: Callable[[str], None],
    *,
    as_json: bool = False,
    **kw: object,
) -> int:
    """`rgt doctor`: print the report; HostError (exit 9) after it when there is a problem."""
    report = doctor(target, **kw)  # type: ignore[arg-type]
    if as_json:
        emit(json.dumps(report.to_json(), indent=1))
    else:
        show(report, emit)
    if report.problems:
        n = len(report.problems)
        raise HostError(
            f"{report.target.label}: {n} problem{'s' if n > 1 else ''} against profile "
            f"{report.guess.profile.name}: " + "; ".join(f.what for f in report.problems),
            "fix each as its line says, then run rgt doctor again",
        )
    return 0
