"""Where a run goes: parsing TARGET as users paste it.

TARGET is one of:

- ``local``: this machine, no ssh (the embedded default);
- an ssh config alias (``gpu1``), ``host``, ``user@host`` or ``user@host:port``, or ssh's URI
  form ``ssh://[user@]host[:port]``;
- a pasted ssh command line exactly as platforms print it: ``ssh -p 40123
  root@connect.westb.example.com``, ``ssh user@host -p 2222 -i ~/.ssh/key``. Of its options
  ``-p``, ``-i`` (then ``IdentitiesOnly=yes``), ``-l`` and ``-J`` are honoured, the port forwards
  ``-L`` and ``-D`` (for the user's own browser) are left out; any other option is refused by
  name, since it could change what rgt's own ssh options guarantee.

A host that starts with ``-`` is refused (ssh would read it as an option, e.g.
``-oProxyCommand=...``), as is anything with whitespace or control characters in a field.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
from typing import Any, Dict, List, Optional

from onbox.common.errors import UsageError

_HOST = re.compile(r"[A-Za-z0-9_.:%\[\]-]+\Z")  # names, IPv4, [IPv6], ssh config aliases
_USER = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_.-]*\$?\Z")
_JUMP = re.compile(r"[A-Za-z0-9_.@:,\[\]%-]+\Z")
TAKES_VALUE = {"-p": "port", "-i": "identity", "-l": "user", "-J": "jump"}
# Port forwards for the user's own browser (vast.ai's line carries `-L 8080:localhost:8080` for
# Jupyter): left out, with their value. rgt's commands need none, and its one shared connection
# must not hold a local port that the user's own ssh session means to bind.
FORWARDS = ("-L", "-D")


@dataclasses.dataclass(frozen=True)
class Target:
    """A parsed TARGET. ``kind`` is "local" or "ssh"."""

    kind: str
    host: Optional[str] = None
    user: Optional[str] = None
    port: Optional[int] = None
    identity: Optional[str] = None
    jump: Optional[str] = None

    @property
    def label(self) -> str:
        """How the target is shown and remembered (one line, no secrets)."""
        if self.kind == "local":
            return "local"
        who = f"{self.user}@" if self.user else ""
        host = str(self.host)
        # An IPv6 address in brackets, as rgt takes it: fe80::2:22 would not say which is port.
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"{who}{host}" + (f":{self.port}" if self.port else "")

    def to_json(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> Target:
        kw: Dict[str, Any] = {f.name: d.get(f.name) for f in dataclasses.fields(cls)}
        return cls(**kw)


def _refuse(problem: str, remedy: str = "") -> UsageError:
    return UsageError(
        "TARGET",
        problem,
        remedy
        or "give an ssh alias, user@host[:port], ssh://user@host:port, a pasted `ssh ...` line, "
        "or local",
    )


def _port(value: str) -> int:
    if not value.isdigit() or not 0 < int(value) < 65536:
        raise _refuse(f"port {value!r} is not a number from 1 to 65535")
    return int(value)


def _check_host(host: str) -> str:
    if not host:
        raise _refuse("no host given")
    if host.startswith("-"):
        raise _refuse(
            f"host {host!r} starts with '-', which ssh would read as an option",
            "a host name never starts with '-'",
        )
    if not _HOST.match(host):
        raise _refuse(f"host {host!r} has characters no host name or alias has")
    return host


def _check_user(user: str) -> str:
    if not _USER.match(user):
        raise _refuse(f"user {user!r} has characters no user name has")
    return user


def _split_destination(dest: str) -> Dict[str, Any]:
    """user@host[:port] (the port form only where ssh itself would not take it as IPv6), or
    ssh's own URI form, ssh://[user@]host[:port] (an IPv6 host in brackets there)."""
    out: Dict[str, Any] = {}
    if dest[:6].lower() == "ssh://":
        uri = dest[6:]
        uri = uri[:-1] if uri.endswith("/") else uri  # as a browser or a dashboard copies it
        if "/" in uri or "?" in uri or ";" in uri:
            raise _refuse(
                f"{dest!r} has a path or parameters: an ssh:// target is only "
                "ssh://[user@]host[:port]"
            )
        dest = uri
        host = dest.rpartition("@")[2]
        if host.count(":") > 1 and not host.startswith("["):
            raise _refuse(f"{dest!r}: an IPv6 address in an ssh:// target goes in brackets")
    if "@" in dest:
        user, _, dest = dest.rpartition("@")
        out["user"] = _check_user(user)
    if dest.startswith("["):  # [v6addr]:port
        # An address with a zone names its interface: fe80::1%eth0.
        m = re.match(r"\[([0-9A-Fa-f:.]+(?:%[A-Za-z0-9_.-]+)?)\](?::(\d+))?\Z", dest)
        if not m:
            raise _refuse(f"{dest!r} is not [IPv6] or [IPv6]:port")
        out["host"] = m.group(1)
        if m.group(2):
            out["port"] = _port(m.group(2))
        return out
    if dest.count(":") == 1:
        dest, _, port = dest.partition(":")
        out["port"] = _port(port)
    out["host"] = _check_host(dest)
    return out


def parse_target(text: str) -> Target:
    """A Target from what the user typed or pasted; UsageError naming what is wrong."""
    if any(c in text for c in "\n\r\0\t") or not text.strip():
        raise _refuse("it is empty or has control characters")
    text = text.strip()
    if text == "local":
        return Target("local")
    if not text.startswith("ssh ") and not text.startswith("ssh\t"):
        if " " in text:
            raise _refuse(f"{text!r} has spaces but does not start with `ssh `")
        return Target("ssh", **_split_destination(text))
    try:
        words = shlex.split(text)[1:]
    except ValueError as e:
        raise _refuse(f"cannot split the pasted ssh line: {e}") from None
    fields: Dict[str, Any] = {}
    dest: Optional[str] = None
    i = 0
    while i < len(words):
        w = words[i]
        if w.startswith("-") and len(w) >= 2:  # options may follow the destination too
            flag, inline = w[:2], w[2:]
            if flag in FORWARDS:
                if not inline and i + 1 >= len(words):
                    raise _refuse(f"the ssh option {flag} needs a value")
                i += 1 if inline else 2
                continue
            if flag not in TAKES_VALUE:
                raise _refuse(
                    f"the ssh option {w.split('=')[0]!r} is not one rgt passes on "
                    f"(it honours {', '.join(sorted(TAKES_VALUE))})",
                    "put other options in ~/.ssh/config under a Host alias and give the alias",
                )
            if inline:
                value = inline
            else:
                i += 1
                if i >= len(words):
                    raise _refuse(f"the ssh option {flag} needs a value")
                value = words[i]
            fields[TAKES_VALUE[flag]] = value
        elif dest is None:
            dest = w
        else:
            raise _refuse(
                f"the pasted line runs a command ({' '.join(words[i:])!r})",
                "paste only the connection part: ssh [-p PORT] [-i KEY] user@host",
            )
        i += 1
    if dest is None:
        raise _refuse("the pasted ssh line names no host")
    parsed = _split_destination(dest)
    if "port" in fields:
        parsed["port"] = _port(fields["port"])
    if "user" in fields and "user" not in parsed:
        parsed["user"] = _check_user(fields["user"])
    if "identity" in fields:
        parsed["identity"] = os.path.abspath(os.path.expanduser(fields["identity"]))
        _identity_args(parsed["identity"])  # one ssh cannot be given: refused now, not later
    if "jump" in fields:
        if not _JUMP.match(fields["jump"]) or fields["jump"].startswith("-"):
            raise _refuse(f"jump host {fields['jump']!r} is not user@host[:port][,...]")
        parsed["jump"] = fields["jump"]
    return Target("ssh", **parsed)


def ssh_destination_args(t: Target) -> List[str]:
    """The options and destination for the system ssh client (rgt's own options come first,
    from onbox-independent controller/remote.py)."""
    args: List[str] = []
    if t.port:
        args += ["-p", str(t.port)]
    if t.identity:
        args += [*_identity_args(t.identity), "-o", "IdentitiesOnly=yes"]
    if t.user:
        args += ["-l", t.user]
    if t.jump:
        # ssh expands % tokens in the jump host (a link-local address's zone, %eth0).
        args += ["-J", ssh_literal(t.jump)]
    assert t.host is not None and not t.host.startswith("-")
    return [*args, "--", t.host]


def ssh_literal(text: str) -> str:
    """``text`` as an ssh option that expands ``%`` tokens (ControlPath, IdentityFile,
    UserKnownHostsFile, ProxyJump) must carry it to be read back as itself: ``%%`` for each
    ``%``. ssh's ``${VAR}`` (in those paths) has no such escape (``ssh_unexpandable``)."""
    return text.replace("%", "%%")


def ssh_unexpandable(path: str) -> Optional[str]:
    """Why ``path`` cannot reach ssh as itself in a path option, or None: ssh expands
    ``${VAR}`` there with no escape, and splits an option's value at blanks and quotes."""
    if "${" in path:
        return "has '${', which ssh replaces with an environment variable"
    if any(c in path for c in " \"\\'\t"):
        return "has a blank, a quote or a backslash, which an ssh option cannot carry"
    return None


def _identity_args(path: str) -> List[str]:
    # ssh expands % tokens and ${VAR} in a -i path too, after looking for the file under the
    # path as given: a path with % goes as IdentityFile, which is read the same way, its %
    # written %%.
    if "${" in path or ("%" in path and ssh_unexpandable(path)):
        raise _refuse(
            f"the key {path!r} {ssh_unexpandable(path)}",
            "move the key to a path without those characters (or load it into ssh-agent "
            "and leave -i out)",
        )
    if "%" in path:
        return ["-o", f"IdentityFile={ssh_literal(path)}"]
    return ["-i", path]
