"""How far an S3 store's connections have moved, as the kernel counts it: for each TCP socket of
this process connected to the store's port, the bytes its peer acknowledged and the bytes it
received (``TCP_INFO``'s ``tcpi_bytes_acked`` and ``tcpi_bytes_received``, Linux 4.1 on).

Why: an upload's movement (onbox/sealing/stores/hangbound.py) was counted per object and per
part put, and a part is 8 to 64 MiB (multipart.py ``part_size_for``), sent by botocore in one
``sendall``; a link slower than a part per ``[store] stall`` in every request in flight was cut
as stalled though it moved. Counting the body's bytes as they are sent would need the send
itself in pieces (a Python loop and a syscall per piece, on the path of every byte); this reads
the sockets instead, only when the watch looks (``Stall.every``, at most every 2 s): a listing
of the process's descriptors and a ``getsockopt`` on a duplicate of each socket to that port,
nothing on the send path. What it counts is the store's own answer: bytes the server's kernel
took (a server stopped, or a link cut, acknowledges nothing), and the bytes of its answers,
including the whitespace AWS sends while a long CompleteMultipartUpload assembles the object.

Where it cannot see (not Linux, no ``/proc``, a proxy on another port), it says nothing, and
the watch goes by the pieces put, as before.
"""

from __future__ import annotations

import os
import socket
import struct
from typing import Tuple

# Where tcpi_bytes_acked and tcpi_bytes_received lie in struct tcp_info (linux/tcp.h: 8 bytes
# of u8 fields, 24 u32, the pacing rates' two u64, then these two u64); the struct only grows.
_AT, _NEED = 120, 136
_TCP_INFO = getattr(socket, "TCP_INFO", None)


def tcp_moved(port: int) -> Tuple[Tuple[int, int], ...]:
    """(descriptor, bytes acknowledged + received) of each TCP socket of this process whose
    peer's port is ``port``, in descriptor order; () where that cannot be read."""
    if _TCP_INFO is None:
        return ()
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return ()
    out = []
    for name in names:
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            # A duplicate: closing it here leaves the connection and its owner's descriptor.
            fd = os.dup(int(name))
        except (OSError, ValueError):  # closed meanwhile
            continue
        try:
            s = socket.socket(fileno=fd)
        except OSError:  # reused meanwhile by another kind of file
            os.close(fd)
            continue
        try:
            if s.type != socket.SOCK_STREAM or s.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            if s.getpeername()[1] != port:
                continue
            info = s.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _NEED)
        except OSError:  # not connected (yet, or any more)
            continue
        finally:
            s.close()
        if len(info) >= _NEED:
            acked, received = struct.unpack_from("=QQ", info, _AT)
            out.append((int(name), acked + received))
    return tuple(sorted(out))
