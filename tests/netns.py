"""A throwaway network namespace joined to this machine by a veth pair: a "rented box" that tests
can cut off the network and bring back.

``create_netns()`` makes namespace NAME with the pair ``vh-NAME`` (here, 10.200.N.1) and
``vb-NAME`` (inside, 10.200.N.2), both up, and the namespace's loopback up. Only the network is
separate: the namespace shares the file system, the PID space and the users with this machine, so
tests see the box's files and processes directly. ``Netns.link_down()``/``link_up()`` cut and
restore the link (established TCP connections stall, new ones time out); ``limit_rate()`` caps
its bandwidth with a tbf qdisc (netem is not available here). ``Netns.delete()`` removes the
namespace, which removes the veth pair with it. Start a server inside with
``tests.sshd.start_sshd(dir, address=ns.addr, netns=ns.name)``.

Traffic goes only to addresses of namespaces the tests create (10.200.N.0/24): N is picked so
that no interface of this machine already uses that subnet, since other test sessions may hold
namespaces of their own at the same time.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
from typing import List, Optional, Sequence


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(
        ["ip", *args], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30
    )
    if check and p.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({p.returncode}): {p.stderr.strip()}")
    return p


def missing() -> Optional[str]:
    """What this machine lacks to make a test namespace, or None when nothing is missing."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` on PATH"
    if os.geteuid() != 0:
        return "root, to create network namespaces"
    p = _ip("netns", "list", check=False)
    if p.returncode != 0:
        return f"`ip netns` ({p.stderr.strip()})"
    return None


@dataclasses.dataclass
class Netns:
    """One network namespace and its veth pair."""

    name: str
    subnet: int  # N of 10.200.N.0/24

    @property
    def host_if(self) -> str:
        return f"vh-{self.name}"

    @property
    def box_if(self) -> str:
        return f"vb-{self.name}"

    @property
    def host_addr(self) -> str:
        """This machine's end of the pair."""
        return f"10.200.{self.subnet}.1"

    @property
    def addr(self) -> str:
        """The namespace's own address (where its servers listen)."""
        return f"10.200.{self.subnet}.2"

    def exec_argv(self, argv: Sequence[str]) -> List[str]:
        """argv that runs ``argv`` inside the namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def link_down(self) -> None:
        """Cut the box off: the box's end of the pair goes down. This machine's end stays up
        (without a carrier), so its route to the box stays and packets to the box vanish, as on a
        lost network; downing this end instead would drop the route and send them to the default
        gateway."""
        _ip("netns", "exec", self.name, "ip", "link", "set", self.box_if, "down")

    def link_up(self) -> None:
        _ip("netns", "exec", self.name, "ip", "link", "set", self.box_if, "up")

    def limit_rate(self, rate: str = "8mbit") -> None:
        """Cap traffic from here to the box (tbf on this machine's end)."""
        p = subprocess.run(
            ["tc", "qdisc", "replace", "dev", self.host_if, "root", "tbf", "rate", rate,
             "burst", "32kb", "latency", "400ms"],
            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        if p.returncode != 0:
            raise RuntimeError(f"tc qdisc replace on {self.host_if} failed: {p.stderr.strip()}")

    def unlimit_rate(self) -> None:
        subprocess.run(
            ["tc", "qdisc", "del", "dev", self.host_if, "root"],
            stdin=subprocess.DEVNULL, capture_output=True, timeout=30,
        )  # fmt: skip

    def link_local(self) -> str:
        """Give the pair the IPv6 link-local addresses fe80::1 (here) and fe80::2 (inside), and
        return the namespace's end as the box's own sshd listens on it (``fe80::2%vb-NAME``).
        This machine reaches it with the zone of its own end (``link_local_here``)."""
        _ip("addr", "add", "fe80::1/64", "dev", self.host_if, "nodad")
        _ip("netns", "exec", self.name, "ip", "addr", "add", "fe80::2/64", "dev", self.box_if,
            "nodad")  # fmt: skip
        return f"fe80::2%{self.box_if}"

    @property
    def link_local_here(self) -> str:
        """The namespace's link-local address with the zone this machine reaches it through."""
        return f"fe80::2%{self.host_if}"

    def delete(self) -> None:
        """Remove the namespace (and with it the veth pair); quiet when it is already gone."""
        _ip("netns", "del", self.name, check=False)
        if _ip("link", "show", self.host_if, check=False).returncode == 0:
            _ip("link", "del", self.host_if, check=False)


def _used_subnets() -> set[int]:
    out = _ip("-4", "-o", "addr", "show", check=False).stdout
    return {int(m) for m in re.findall(r"inet 10\.200\.(\d+)\.", out)}


def create_netns(prefix: str = "rgt") -> Netns:
    """A new namespace named PREFIX + this process's pid (12 characters at most: interface names
    are limited to 15), on a 10.200.N.0/24 no interface here uses; RuntimeError if that fails
    (after undoing what was done)."""
    name = f"{prefix}{os.getpid()}"[:12]
    used = _used_subnets()
    base = os.getpid() % 250
    subnet = next(n for n in ((base + i) % 250 + 1 for i in range(250)) if n not in used)
    ns = Netns(name, subnet)
    if name in _ip("netns", "list", check=False).stdout.split():
        raise RuntimeError(f"a network namespace {name} already exists")
    try:
        _ip("netns", "add", name)
        _ip("link", "add", ns.host_if, "type", "veth", "peer", "name", ns.box_if)
        _ip("link", "set", ns.box_if, "netns", name)
        _ip("addr", "add", f"{ns.host_addr}/24", "dev", ns.host_if)
        _ip("link", "set", ns.host_if, "up")
        _ip("netns", "exec", name, "ip", "addr", "add", f"{ns.addr}/24", "dev", ns.box_if)
        _ip("netns", "exec", name, "ip", "link", "set", ns.box_if, "up")
        _ip("netns", "exec", name, "ip", "link", "set", "lo", "up")
    except Exception:
        ns.delete()
        raise
    return ns
