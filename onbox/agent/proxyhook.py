"""A platform's proxy hook, sourced into the job's environment before the job starts.

Some platforms put their network set-up in a shell file that a login shell sources (AutoDL's
/etc/network_turbo exports ``http_proxy``, ``https_proxy``, ``no_proxy`` and a CA bundle). The
job is not started by a login shell, so the agent sources the file itself in ``/bin/sh`` with
the job's base environment, reads back what the shell's environment became (``env -0``), and
gives the job every variable the hook set or changed, before anything else of the job's
environment is applied (the profile's variables and the user's ``[env]`` win over it).

A hook that is missing, fails or hangs (bounded by ``TIMEOUT``) leaves the job's environment as
it was: the job still starts, with one warning. The hook's values are never logged (a proxy
URL may hold a password): the events name the variables only.
"""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Dict, List, Mapping, Optional, Tuple

TIMEOUT = 10.0
# The shell sets these itself; they are not the hook's.
_SHELL_OWN = frozenset({"PWD", "OLDPWD", "SHLVL", "_"})
_SCRIPT = '. "$1" >/dev/null 2>&1 </dev/null; exec env -0'


def source(hook: str, base: Mapping[str, str]) -> Tuple[Dict[str, str], Optional[str]]:
    """The variables ``hook`` exports or changes over ``base``, and None; or ``{}`` and why
    it could not be used (a sentence, never a value)."""
    if not os.path.isfile(hook):
        return {}, f"the proxy hook {hook} does not exist"
    try:
        # Its own session, so a hook that hangs is killed with whatever it started.
        p = subprocess.Popen(
            ["/bin/sh", "-c", _SCRIPT, "sh", hook],
            env=dict(base),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            cwd="/",
            start_new_session=True,
        )
    except OSError as e:
        return {}, f"the proxy hook {hook} could not be sourced: {e.strerror}"
    try:
        out, _ = p.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.communicate()
        return {}, f"sourcing the proxy hook {hook} took over {TIMEOUT:.0f}s"
    if p.returncode != 0:
        return {}, f"sourcing the proxy hook {hook} failed (sh exited {p.returncode})"
    return _changed(out, base), None


def _changed(raw: bytes, base: Mapping[str, str]) -> Dict[str, str]:
    out: Dict[str, str] = {}
    for item in raw.split(b"\0"):
        if b"=" not in item:
            continue
        k, v = item.split(b"=", 1)
        try:
            key, value = k.decode(), v.decode()
        except UnicodeDecodeError:  # a variable the job's environment could not hold as text
            continue
        if key in _SHELL_OWN or not key or base.get(key) == value:
            continue
        out[key] = value
    return out


def names(env: Mapping[str, str]) -> List[str]:
    """The variables' names, sorted: what an event may say of them."""
    return sorted(env)
