"""Every thread's Python stack of the attempt's Python processes, dumped into one file at a
stall: py-spy where it can attach (``py-spy dump --pid P``, a subprocess with a timeout), else
the ``faulthandler`` handler rgt's sitecustomize installs in the job's interpreter
(onbox/health/stackhook.py), asked with ``STACKS_SIGNAL``.

The signal's default action kills, so it goes only to a process whose ``/proc/PID/status``
``SigCgt`` mask shows a handler for it (a shell, a C program, a Python started with ``-S`` would
die of it). ``$RGT_PYSPY=off`` hides py-spy (the tests take the faulthandler path so).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from typing import Callable, Dict, List, Mapping, Optional, Tuple

from onbox.common import jobenv

PYSPY_VAR = "RGT_PYSPY"  # "off": do not use py-spy (else: found on PATH or next to Python)
PYSPY_TIMEOUT = 10.0  # seconds one ``py-spy dump`` may take (it pauses the process meanwhile)
HANDLER_WAIT = 3.0  # seconds a faulthandler dump may take to appear
MAX_PROCESSES = 32  # a bound on the work of one dump (dataloader workers, ranks)
FIRST_FRAMES = 6
# A frame line of py-spy ("    train (train.py:12)") or of faulthandler
# ('  File "train.py", line 12 in train').
_FRAME = re.compile(r'^\s+(?:File "[^"]*", line \d+ in \S+|\S+ \([^()]*:\d+\))\s*$')


@dataclasses.dataclass
class Dump:
    """What a dump did: the file, how each process answered, the first frames found."""

    path: str
    how: Dict[int, str] = dataclasses.field(default_factory=dict)  # pid -> py-spy|faulthandler|none
    frames: List[str] = dataclasses.field(default_factory=list)


def pyspy_path(environ: Mapping[str, str]) -> Optional[str]:
    """py-spy's executable, or None when it is hidden or not installed."""
    if environ.get(PYSPY_VAR, "").strip().lower() in ("off", "0", "no", "false"):
        return None
    found = shutil.which("py-spy", path=environ.get("PATH"))
    if found:
        return found
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return beside if os.access(beside, os.X_OK) else None


def catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (its SigCgt mask); False if unread."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def attempt_processes(
    tag: Optional[str], owner: Callable[[Optional[str], Optional[str]], Optional[str]]
) -> List[Tuple[int, str]]:
    """(pid, command line) of each process of the running attempt, found by its tag."""
    try:
        import psutil
    except ImportError:  # the agent depends on it; a broken install just finds nothing
        return []
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            env_tag = p.environ().get(jobenv.ATTEMPT_TAG)
            if owner(env_tag, tag) != "current":
                continue
            found.append((p.pid, " ".join(p.cmdline()) or p.name()))
        except (psutil.Error, OSError):  # gone, or not ours to read
            continue
    return sorted(found)[:MAX_PROCESSES]


def _looks_python(cmd: str) -> bool:
    return "python" in (cmd.split() or [""])[0].rsplit("/", 1)[-1]


def _pyspy(exe: str, pid: int) -> Tuple[bool, str]:
    """(attached, output or why not); the subprocess is killed by PID past the timeout."""
    proc = subprocess.Popen(
        [exe, "dump", "--pid", str(pid)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=PYSPY_TIMEOUT)
    except subprocess.TimeoutExpired:
        try:
            os.kill(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.communicate()
        return False, f"py-spy took over {PYSPY_TIMEOUT:.0f} s"
    text = out.decode("utf-8", "replace")
    if proc.returncode != 0:
        lines = [ln for ln in text.splitlines() if ln.strip()]
        return False, f"py-spy failed ({proc.returncode}): {lines[-1] if lines else ''}"
    return True, text


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _ask_handler(path: str, pid: int) -> bool:
    """Send the hook's signal and wait (bounded) for its dump to land in ``path``."""
    before = _size(path)
    try:
        os.kill(pid, jobenv.STACKS_SIGNAL)
    except OSError:
        return False
    deadline = time.monotonic() + HANDLER_WAIT
    last, steady = before, 0
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = _size(path)
        steady = steady + 1 if now == last and now > before else 0
        if steady >= 4:  # written, and no longer growing
            return True
        last = now
    return _size(path) > before


def _append(path: str, text: str) -> None:
    with open(path, "a") as f:
        f.write(text)


def dump(
    path: str,
    processes: List[Tuple[int, str]],
    environ: Mapping[str, str],
    why: str = "",
) -> Dump:
    """Dump every thread's stack of each of ``processes`` into ``path`` (appended)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    out = Dump(path)
    exe = pyspy_path(environ)
    _append(path, f"=== {time.strftime('%Y-%m-%dT%H:%M:%S%z')} {why}\n")
    for pid, cmd in processes:
        handler = catches(pid, jobenv.STACKS_SIGNAL)
        if not handler and not _looks_python(cmd):
            continue  # a shell or a C program: no Python stack to read, and no handler
        head = f"--- pid {pid}: {cmd[:200]}\n"
        said = "py-spy is off or not installed"
        if exe is not None:
            ok, text = _pyspy(exe, pid)
            if ok:
                _append(path, f"{head}(py-spy)\n{text}\n")
                out.how[pid] = "py-spy"
                continue
            said = text
        if handler:
            _append(path, f"{head}(faulthandler; {said})\n")
            if _ask_handler(path, pid):
                _append(path, "\n")
                out.how[pid] = "faulthandler"
                continue
            said += "; the faulthandler hook wrote nothing"
        _append(path, f"{head}no stacks: {said}\n\n")
        out.how[pid] = "none"
    out.frames = first_frames(path)
    return out


def first_frames(path: str, limit: int = FIRST_FRAMES, budget: int = 1 << 20) -> List[str]:
    """The first frame lines of the newest dump in ``path``: the event shows them."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, _size(path) - budget))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    newest = text.rsplit("\n=== ", 1)[-1]
    return [ln.strip() for ln in newest.splitlines() if _FRAME.match(ln)][:limit]
