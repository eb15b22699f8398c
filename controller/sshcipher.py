"""The ciphers rgt asks ssh for (controller/remote.py puts them among its options).

Where neither the user's nor the system's ssh configuration chooses them (``ssh -G``
gives the same list as with no configuration at all), AES-GCM goes first in OpenSSH's own
list. OpenSSH's default, chacha20-poly1305, runs in software; AES-GCM runs on the AES and
carry-less multiply instructions every laptop and server CPU of the last decade has, at a
third of the CPU per byte, which is what bounds a pull over ssh. A configured list is left
alone, and the server still picks from the whole default list.
"""

from __future__ import annotations

import os
import re
import subprocess
from typing import List, Optional, Sequence

from controller import children
from onbox.common.errors import UsageError

FAST_CIPHERS = ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com")


def ssh_settings(config_args: Sequence[str], dest: Sequence[str]) -> Optional[str]:
    """What ``ssh -G`` says the client would use for ``dest`` (one ``name value`` a line, the
    configuration applied), or None when ssh cannot say. A configuration with a ``%`` that ssh
    takes for a token it does not know (a zone in a Hostname: fe80::1%eth0) fails every ssh
    command, with words rgt would not show: UsageError, naming ssh's line."""
    try:
        p = children.run(["ssh", *config_args, "-G", *dest], timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    stderr, stdout = p.stderr.decode(errors="replace"), p.stdout.decode(errors="replace")
    bad = re.search(r"^.*unknown key %.*$", stderr, re.MULTILINE)
    if p.returncode != 0 and bad:
        raise UsageError(
            "ssh configuration",
            f"ssh cannot read a % in the configuration for {dest[-1]!r}: {bad.group(0).strip()}",
            "write a % that is not one of ssh's tokens as %% in your ssh config "
            "(an IPv6 zone: Hostname fe80::1%%eth0)",
        )
    return stdout if p.returncode == 0 else None


def effective_ciphers(config_args: Sequence[str], dest: Sequence[str]) -> Optional[str]:
    return _ciphers(ssh_settings(config_args, dest))


def _ciphers(settings: Optional[str]) -> Optional[str]:
    found = re.search(r"^ciphers (\S+)$", settings or "", re.MULTILINE)
    return found.group(1) if found else None


def cipher_preference(
    config_args: Sequence[str], dest: Sequence[str], settings: Optional[str] = None
) -> List[str]:
    """``-o Ciphers=...`` with AES-GCM first, or nothing where a configuration chose the
    ciphers, the CPU lacks AES instructions, or ssh cannot say (module docstring).
    ``settings``: ``ssh_settings(config_args, dest)`` when the caller has it already."""
    if not has_aes():
        return []
    ours = _ciphers(settings) if settings is not None else effective_ciphers(config_args, dest)
    bare = effective_ciphers(["-F", os.devnull], dest)
    if ours is None or ours != bare:
        return []
    default = ours.split(",")
    fast = [c for c in FAST_CIPHERS if c in default]
    if not fast:
        return []
    return ["-o", "Ciphers=" + ",".join(fast + [c for c in default if c not in fast])]


def has_aes() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return bool(re.search(r"^(flags|Features)\s*:.*\baes\b", f.read(), re.MULTILINE))
    except OSError:
        return True  # not Linux (a Mac): every Apple and Intel Mac CPU has AES instructions
