"""Boot survival: runs come back by themselves after the box powers on again.

Two halves. ``install_hook`` (called by the agent) puts the platform's way back in place, once:
a script under $RGT_HOME that starts ``rgt-agent boot`` detached, at most once per boot (it
compares /proc/sys/kernel/random/boot_id with the one ``boot`` recorded), wired in where the
platform runs things at power-on: a file in /etc/profile.d (AutoDL restarts the container and
every login shell sources it), one guarded line in /root/onstart.sh (vast.ai), or, only when
asked with ``rgt-agent start --boot-hook``, an @reboot line in /etc/cron.d (OS persistence on
a generic box). Installing it records the boot it was installed in, so a login of this same
boot starts nothing. Not root, or the path not writable: one ``boot_hook_failed`` warning with the
remedy, and the run goes on.

``boot`` (``rgt-agent boot``) records this boot, then starts again every run whose agent is not
alive and whose state is not STOPPED, FAILED or SUCCEEDED, with ``rgt-agent start --name N``
itself (its spec.json, the store's DONE.json check, the run lock: one writer), and leaves a
``boot.json`` in the run for the agent: the start came from a power-on, so it restores from
the store as a new incarnation would (``from_boot``). Quiet and idempotent: it can run at every
login.
"""

from __future__ import annotations

import fcntl
import os
import shlex
import subprocess
import sys
from typing import Callable, List, NamedTuple, Optional

import onbox
from onbox.common import jobenv
from onbox.common.durable import read_json, write_atomic, write_json
from onbox.common.rundir import RunDir, all_runs, rgt_home

ENDED = ("STOPPED", "FAILED", "SUCCEEDED")
BOOT_ID = "/proc/sys/kernel/random/boot_id"
MARK = "# rgt-agent boot hook"
OPT_IN = "boot_hook.json"  # in the run dir: `start --boot-hook` asked for an OS-level hook
FROM_BOOT = "boot.json"  # in the run dir: this start of the run came from `rgt-agent boot`
CRON_PATH = "/etc/cron.d/rgt-agent"
Event = Callable[..., None]


def current_boot() -> str:
    try:
        with open(BOOT_ID) as f:
            return f.read().strip()
    except OSError:
        return ""


def _q(s: str) -> str:
    return shlex.quote(s)


def boot_command() -> List[str]:
    """How the hook starts ``rgt-agent boot``: this Python, this onbox."""
    return [sys.executable, "-m", "onbox.cli", "boot"]


def hook_script(home: str) -> str:
    """The POSIX sh hook: sourced by login shells, so it never exits and leaves no variables."""
    log = os.path.join(home, "boot.log")
    env = f"{jobenv.HOME}={_q(home)} PYTHONPATH={_q(onbox.import_root())} "
    cmd = " ".join(_q(a) for a in boot_command())
    return (
        f"{MARK}: starts `rgt-agent boot` once per boot, in the background, so that rgt runs\n"
        "# interrupted by a power-off come back (written by rgt-agent; remove this file to\n"
        "# stop that). Valid POSIX sh; sourced by login shells, so it never exits.\n"
        f'if [ "$(id -u 2>/dev/null)" = {os.getuid()} ] && [ -r {BOOT_ID} ] &&\n'
        f'    [ "$(cat {BOOT_ID} 2>/dev/null)" != '
        f'"$(cat {_q(boot_id_path(home))} 2>/dev/null)" ]; then\n'
        "    if command -v setsid >/dev/null 2>&1; then\n"
        f"        ( {env}setsid {cmd} </dev/null >>{_q(log)} 2>&1 & )\n"
        "    else\n"
        f"        ( {env}nohup {cmd} </dev/null >>{_q(log)} 2>&1 & )\n"
        "    fi\n"
        "fi\n"
    )


def boot_id_path(home: str) -> str:
    """The boot `rgt-agent boot` last ran in (or the hook was installed in)."""
    return os.path.join(home, "boot_id")


def hook_path(home: str) -> str:
    return os.path.join(home, "boot-hook.sh")


# ---- installing the hook (the agent)
def install_hook(rd: RunDir, profile_name: Optional[str], event: Event) -> Optional[str]:
    """Put the boot hook in place for a run under ``profile_name``; the path wired in, or None.

    Never raises: a failure is one warning event, and the run goes on without the hook."""
    if not profile_name:
        return None
    try:
        from onbox.common.rundir import profiles_dir
        from onbox.profiles.load import load, user_dirs

        boot = load(profile_name, user_dirs(profiles_dir(rd.home))).boot
    except Exception:  # the profile was checked at start; a file changed since costs the hook
        return None
    hook = boot.hook
    opted = read_json(os.path.join(rd.path, OPT_IN)) is not None
    if hook in ("none", "") or (hook == "cron" and not opted):
        return None
    target = boot.path or (CRON_PATH if hook == "cron" else "")
    if not target:
        return None
    try:
        # This boot counts as seen: the hook acts from the next power-on, never on a login of
        # this boot (a run stopped by a SIGTERM now is not the hook's to start again).
        if not os.path.exists(boot_id_path(rd.home)):
            write_atomic(boot_id_path(rd.home), (current_boot() + "\n").encode())
        script = hook_script(rd.home)
        if hook == "profile.d":
            changed = _write_if_changed(target, script.encode(), 0o644)
        else:
            changed = _write_if_changed(hook_path(rd.home), script.encode(), 0o700)
            line = f". {_q(hook_path(rd.home))}  {MARK}\n"
            if hook == "cron":
                user = _user()
                entry = f"@reboot {user} sh -c {_q(line.strip())}\n"
                changed = _write_if_changed(target, entry.encode(), 0o644) or changed
            else:  # onstart: one guarded line, never twice
                changed = _append_once(target, line) or changed
    except OSError as e:
        event(
            "boot_hook_failed",
            f"cannot install the {hook} boot hook at {target}: {e.strerror or e}; after a "
            "power-off the run will not come back by itself",
            klass="usage",
            remedy="run the agent as root, or run `rgt-agent boot` after each power-on",
        )
        return None
    if not changed:
        return target  # in place already (an earlier agent of this or another run put it there)
    event(
        "boot_hook",
        f"{hook} boot hook at {target}: `rgt-agent boot` resumes the run after a power-off"
        + (
            "; this is OS persistence (an @reboot cron entry), asked for with --boot-hook"
            if hook == "cron"
            else ""
        ),
        hook=hook,
        path=target,
    )
    return target


def _user() -> str:
    import pwd

    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())


def _write_if_changed(path: str, data: bytes, mode: int) -> bool:
    """Write ``path`` atomically unless it holds ``data`` already; whether it was written."""
    try:
        with open(path, "rb") as f:
            if f.read() == data:
                return False
    except FileNotFoundError:
        pass
    write_atomic(path, data, mode)
    os.chmod(path, mode)  # not the agent's umask (077): the file is read by login shells
    return True


def _append_once(path: str, line: str) -> bool:
    """Append ``line`` to a script unless a line with the hook's mark is there already; whether
    it was appended."""
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        text = "#!/bin/sh\n"
    if MARK in text:
        return False
    if text and not text.endswith("\n"):
        text += "\n"
    write_atomic(path, (text + line).encode(), 0o755)
    os.chmod(path, 0o755)
    return True


def record_opt_in(rd: RunDir) -> None:
    """`rgt-agent start --boot-hook`: this run may install an OS-level (cron) hook."""
    write_json(os.path.join(rd.path, OPT_IN), {"cron": True})


def take_from_boot(rd: RunDir) -> bool:
    """Whether this agent's start came from `rgt-agent boot` (the mark is used up)."""
    path = os.path.join(rd.path, FROM_BOOT)
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


# ---- resuming at boot (`rgt-agent boot`)
def resumable(rd: RunDir) -> bool:
    """A run whose agent is gone and whose incarnation did not end by itself or by a stop."""
    from onbox.agent.lock import is_held

    try:
        state = read_json(rd.state)
    except ValueError:
        return False
    if not state or state.get("state") in ENDED or read_json(rd.spec) is None:
        return False
    return not is_held(rd.lock)


def boot(say: Callable[[str], None], home: Optional[str] = None) -> int:
    """Record this boot, then start every resumable run again; the number started."""
    home = home or rgt_home()
    os.makedirs(home, mode=0o700, exist_ok=True)
    fd = os.open(os.path.join(home, "boot.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # two logins at once: the second finds nothing to do
        write_atomic(boot_id_path(home), (current_boot() + "\n").encode())
        # Every run's `start` at once: each waits out its own restore (minutes from a remote
        # store, and a power-on is when a disk comes back empty), and one run's must not hold
        # back the next's. None is bounded in total: `start` gives up on an agent that goes
        # silent (onbox/agent/detach.py), never on one that is busy.
        starting = [_begin_start(rd) for rd in all_runs(home) if resumable(rd)]
        return sum(_end_start(s, say) for s in starting)
    finally:
        os.close(fd)


class _Starting(NamedTuple):
    """One run's `rgt-agent start` under way (``proc`` None: it could not be run, ``why``)."""

    rd: RunDir
    mark: str
    proc: Optional[subprocess.Popen[str]]
    why: str


def _begin_start(rd: RunDir) -> _Starting:
    """`rgt-agent start --name N`, as a user would type it after a power-on, begun."""
    mark = os.path.join(rd.path, FROM_BOOT)
    write_json(mark, {"boot_id": current_boot()})
    env = {k: v for k, v in os.environ.items() if k != jobenv.ATTEMPT_TAG}
    env[jobenv.HOME] = rd.home
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "onbox.cli", "start", "--name", rd.name],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd="/",
        )
    except OSError as e:
        return _Starting(rd, mark, None, str(e))
    return _Starting(rd, mark, proc, "")


def _end_start(s: _Starting, say: Callable[[str], None]) -> int:
    """Wait for ``s`` to end and say how it went: 1 when the run started, else 0."""
    try:
        if s.proc is None:
            say(f"rgt-agent boot: {s.rd.name}: {s.why}")
            return 0
        out, err = s.proc.communicate()
    finally:
        if not _agent_took(s.rd):
            _unmark(s.mark)
    say(f"rgt-agent boot: {s.rd.name}: {_outcome(s.proc.returncode, out, err)}")
    return 1 if s.proc.returncode == 0 else 0


def _outcome(code: int, out: str, err: str) -> str:
    """What `rgt-agent start` did, in one line (its first line saying so): started or
    re-attached; else its error (the ``rgt:`` line: for a run preempted or stopped during its
    restore, onbox/agent/detach.py ``NotStarted`` says so and what to do), then whatever else
    it printed on stderr (its warnings), on lines of their own; not its progress (a long
    restore's ``rgt-agent: ...`` lines, onbox/agent/detach.py ``Progress``)."""
    if code == 0:
        lines = out.strip().splitlines()
        said = [ln for ln in lines if ln.startswith(("started", "re-attached", "run "))]
        return (said or lines or ["started (`rgt-agent start` printed nothing)"])[0]
    from onbox.agent.detach import PROGRESS_PREFIX  # (lazily: a boot with nothing failed)

    lines = [ln for ln in err.strip().splitlines() if not ln.startswith(PROGRESS_PREFIX)]
    errors = [ln for ln in lines if ln.startswith("rgt: ")]
    why = errors[-1][len("rgt: ") :] if errors else f"`rgt-agent start` failed (exit {code})"
    rest = [ln for ln in lines if not errors or ln != errors[-1]]
    return "\n".join([f"not started: {why}", *rest])


def _agent_took(rd: RunDir) -> bool:
    return not os.path.exists(os.path.join(rd.path, FROM_BOOT))


def _unmark(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
