"""A host key ssh would not accept, told apart (controller/remote.py ``check_transport``): a key
other than the one recorded (HostKeyChanged) or none recorded where ssh may not take one unasked
(HostKeyUnknown); the box's own or a jump host's. Both exit 4, as a refused login does: no retry
helps, a person has to look.

ssh prints "REMOTE HOST IDENTIFICATION HAS CHANGED" only for a real change; "Host key
verification failed" alone means the key is not known (or revoked). The box's own key is checked
with rgt's options (its known_hosts first, ``accept-new``), so a key not known there is taken; a
jump host's own ssh runs with the ssh configuration alone (its known_hosts, its
StrictHostKeyChecking, where ``ask`` cannot ask: rgt runs ssh apart from the terminal), so a
jump host whose key was never seen is where an unknown key is met.

Under ControlPersist, ssh sends a jump host's own ssh's words to /dev/null: rgt's connections
through one that failed before the handshake showed only "kex_exchange_identification:
Connection closed by remote host", whatever the jump host's trouble (its key, its login, its
address). ``proxy_words`` hears them from one more try without multiplexing.

A recorded key is looked up as ssh looks it up: under the name ``ssh -G`` resolves the target
to (its HostKeyAlias, else its HostName, as ``[host]:port`` off port 22), not the alias typed.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
from typing import List, Optional, Sequence, Tuple

from controller.capture import capture
from controller.sshcipher import ssh_settings
from onbox.common.errors import AuthError
from onbox.common.terminal import printable


class HostKeyChanged(AuthError):
    """A host (the box, or a jump host on the way) presents a key other than the one
    recorded for it."""


class HostKeyUnknown(AuthError):
    """ssh could not verify a host's key (the box's, or a jump host's on the way): none is
    recorded for it where ssh looks, and ssh may not take one unasked."""


@dataclasses.dataclass
class Route:
    """What ssh resolves for one target (``ssh -G``), as host-key errors need it."""

    label: str  # the target as rgt shows it
    config_args: List[str]  # -F FILE, or nothing
    dest: List[str]  # the target's options and host (controller/target.py)
    settings: Optional[str]  # ``ssh -G``'s text for them, or None
    known_hosts: List[str]  # where the box's keys are recorded, rgt's file first

    def setting(self, name: str) -> Optional[str]:
        return setting(self.settings, name)

    @property
    def proxy(self) -> Optional[str]:
        """The jump hosts (ProxyJump) or the ProxyCommand the connection goes through."""
        jump = self.setting("proxyjump")
        if jump:
            return jump
        command = self.setting("proxycommand")
        return f"the ProxyCommand `{command}`" if command else None

    @property
    def hop(self) -> str:
        """The jump hosts or ProxyCommand, as the subject of a sentence."""
        proxy = self.proxy or ""
        return proxy if proxy.startswith("the ") else f"the jump host {proxy}"

    @property
    def manual(self) -> str:
        """The ssh command line a person runs to connect once by hand (it asks about keys)."""
        dest = [a for a in self.dest if a != "--"]
        return shlex.join(["ssh", *self.config_args, *dest, "true"])


# How ssh says its proxy (a jump host's ssh) ended before the SSH handshake began.
PROXY_CLOSED = re.compile(r"kex_exchange_identification: |Connection closed by UNKNOWN port")


def proxy_words(argv: List[str]) -> Optional[str]:
    """What a connection's jump host (ProxyJump, ProxyCommand) says when it fails, or None if
    it connects now. ssh sends a proxy's stderr to /dev/null where the connection may outlive
    it (ControlPersist), so a jump host that refused a key or a login, or could not be reached,
    showed only as a connection closed before the handshake (PROXY_CLOSED). ``argv``: the same
    connection without multiplexing, running nothing (``exit``), so the proxy is heard."""
    try:  # (the ConnectTimeout of each hop bounds it well within)
        got = capture(argv, timeout=60, limit=4096, over="tail")
    except (subprocess.TimeoutExpired, FileNotFoundError):
        return None
    return got.stderr.decode("utf-8", "replace") if got.rc == 255 else None


def setting(settings: Optional[str], name: str) -> Optional[str]:
    """The value of ``name`` in ``ssh -G``'s text, or None."""
    found = re.search(rf"^{name} (.+)$", settings or "", re.MULTILINE)
    return found.group(1).strip() if found else None


def known_name(settings: Optional[str], host: str, port: Optional[int]) -> str:
    """The name ssh records a host's key under (``known_hosts``): its HostKeyAlias, else its
    resolved HostName, ``[host]:port`` off port 22; ``host`` and ``port`` where ssh cannot
    say."""
    alias = setting(settings, "hostkeyalias")
    if alias:
        return alias
    host = setting(settings, "hostname") or host
    port = int(setting(settings, "port") or port or 22)
    return f"[{host}]:{port}" if port != 22 else host


def fingerprints(name: str, files: Sequence[str]) -> List[str]:
    """The fingerprints recorded for ``name`` in ``files`` (hashed names included)."""
    out = []
    for f in files:
        if not os.path.exists(f):
            continue
        # Bounded as the box's output is: the file holds the keys hosts presented. A file
        # that is missing or unreadable has nothing for ssh-keygen to print.
        argv = ["ssh-keygen", "-l", "-F", name, "-f", f]
        p = capture(argv, timeout=30, limit=64 << 10, over="cut")
        out += re.findall(r"(SHA256:[A-Za-z0-9+/=]+)", p.stdout.decode("ascii", "replace"))
    return out


def key_refused(text: str, route: Route, target_name: str) -> Optional[AuthError]:
    """The error for ssh's ``text`` when it refused a host key, or None. ``target_name``: the
    box's ``known_name``."""
    changed = re.search(r"Host key for (\S+) has changed", text)
    if "IDENTIFICATION HAS CHANGED" in text:
        name = printable(changed.group(1)) if changed else target_name
        if route.proxy and name != target_name:
            return _jump_changed(text, route, name)
        return _changed(text, route, target_name)
    if "Host key verification failed" not in text:
        return None
    named = re.search(r"No \S+ host key is known for (\S+) and", text)
    line = _line(text, named)
    if route.proxy:
        return _jump_unknown(route, printable(named.group(1)) if named else None, line)
    return HostKeyUnknown(
        f"the host key of {route.label} could not be verified, so ssh did not connect "
        f"(ssh: {line})",
        f"connect once from a terminal with `{route.manual}` and check the key it shows",
    )


def _changed(text: str, route: Route, name: str) -> HostKeyChanged:
    known = fingerprints(name, route.known_hosts)
    return HostKeyChanged(
        f"{route.label} presents a different host key than the one recorded: "
        f"recorded {', '.join(known) or '(unreadable)'}, now {_now(text)}. Not connecting.",
        f"if the box was rebuilt, remove its line from {route.known_hosts[0]} "
        "(ssh-keygen -R HOST -f FILE) and deploy again; "
        "otherwise someone may be intercepting the connection",
    )


def _jump_changed(text: str, route: Route, name: str) -> HostKeyChanged:
    # Where the jump host's ssh looks: the file ssh names (the line of the key it refused)
    # is one of them; the text alone is not trusted to name a file to read.
    files = _resolve_hop(route, name)[2]
    known = fingerprints(name, files)
    offending = re.search(r"^Offending \S+ key in (.+):\d+\s*$", text, re.MULTILINE)
    named = offending.group(1) if offending and offending.group(1) in files else None
    where = named or (files[0] if files else "the known_hosts of your ssh configuration")
    return HostKeyChanged(
        f"the jump host {name} on the way to {route.label} presents a different host key "
        f"than the one recorded: recorded {', '.join(known) or '(unreadable)'}, now "
        f"{_now(text)}. Not connecting.",
        f"if the jump host was rebuilt, remove its line from {where}: "
        f"ssh-keygen -R {shlex.quote(name)} -f {shlex.quote(where)}; otherwise someone may be "
        "intercepting the connection",
    )


def _jump_unknown(route: Route, name: Optional[str], line: str) -> HostKeyUnknown:
    proxy = route.proxy or ""
    # ssh names the host when it refuses (StrictHostKeyChecking yes), not when it could only
    # have asked: then it is the one jump host, if there is one.
    hop = name or (proxy if "," not in proxy and not proxy.startswith("the ") else None)
    host, port, files = _resolve_hop(route, hop) if hop else (None, 22, [])
    who = f"the jump host {hop}" if hop else f"a jump host of {proxy}"
    scan = f"ssh-keyscan {f'-p {port} ' if port != 22 else ''}{host or 'HOST'}"
    record = files[0] if files else "~/.ssh/known_hosts"
    return HostKeyUnknown(
        f"the host key of {who} on the way to {route.label} is not known, so ssh did not "
        f"connect: a jump host's key is checked with your ssh configuration alone, not rgt's "
        f"accept-new, and ssh cannot ask you from within rgt (ssh: {line})",
        f"connect once from a terminal with `{route.manual}` and check the key it asks about, "
        f"or record the key you checked with `{scan} >> {record}`",
    )


def _resolve_hop(route: Route, hop: str) -> Tuple[Optional[str], int, List[str]]:
    """The host, port and known_hosts files of a jump host (``[host]:port`` as ssh names it
    in known_hosts, or ``user@host:port`` as ProxyJump gives it), resolved by ``ssh -G``."""
    spec = hop.removeprefix("ssh://").rsplit("@", 1)[-1]
    m = re.fullmatch(r"\[([^\]]+)\](?::(\d+))?|([^:]+)(?::(\d+))?", spec)
    if not m:
        return None, 22, []
    host, port = m.group(1) or m.group(3), m.group(2) or m.group(4)
    if host.startswith("-"):
        return None, 22, []
    settings = ssh_settings(route.config_args, [*(["-p", port] if port else []), "--", host])
    resolved = setting(settings, "hostname") or host
    files = (setting(settings, "userknownhostsfile") or "").split()
    return resolved, int(setting(settings, "port") or port or 22), files


def _now(text: str) -> str:
    new = re.search(r"(SHA256:[A-Za-z0-9+/=]+)", text)
    return new.group(1) if new else "(see ssh -v)"


def _line(text: str, named: Optional[re.Match[str]]) -> str:
    if named:
        return printable(named.group(0).removesuffix(" and").strip())
    return "Host key verification failed."
