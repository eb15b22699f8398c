"""The background checkpoint writer: a process (not a thread, so serialising, hashing and fsync
never take the training loop's GIL) that writes snapshots staged in shared memory.

The training process (``Writer``) starts it once with the job's own Python and talks to it over
a Unix socket pair: each request carries the snapshot's structure and, as a passed file
descriptor, the memfd holding its tensors (onbox/train/snapshot.py). The writer maps it, builds
zero-copy tensors over it, and writes the checkpoint with ``onbox.train.ckptdir.write`` exactly as a
synchronous save would; it answers with the path or the error. One request at a time.

It ignores SIGTERM and SIGINT (a preemption signals the whole process group; the checkpoint in
flight should still land) and runs at a lower CPU priority than the loop. When the training
process dies, the writer finishes the write it holds, reads end-of-file, and exits. A writer
killed mid-write leaves only a hidden temporary directory, never a checkpoint under its name.

    python -m onbox.train.writer FD

(The training process starts it with ``python -c`` and the same ``main``: ``-m`` of a module
its package has already imported makes Python print a RuntimeWarning into the job's log.)
"""

from __future__ import annotations

import mmap
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

import onbox
from onbox.common.errors import CheckpointWriteFailed

_LEN = struct.Struct("!Q")
NICE = 10
_ENTRY = "import sys; from onbox.train.writer import main; sys.exit(main(sys.argv[1:]))"


def _send(sock: socket.socket, msg: Dict[str, Any], fds: Tuple[int, ...] = ()) -> None:
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    header = _LEN.pack(len(data))
    if fds:
        socket.send_fds(sock, [header], list(fds))
    else:
        sock.sendall(header)
    sock.sendall(data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def _recv(sock: socket.socket) -> Tuple[Dict[str, Any], List[int]]:
    header, fds, _, _ = socket.recv_fds(sock, _LEN.size, 4)
    if not header:
        raise EOFError
    if len(header) < _LEN.size:
        header += _recv_exact(sock, _LEN.size - len(header))
    (n,) = _LEN.unpack(header)
    msg = pickle.loads(_recv_exact(sock, n))
    return msg, list(fds)


class Writer:
    """The training side's handle on the writer process. ``submit`` returns at once; ``poll``
    and ``wait`` return the result of the request in flight (a dict) or raise
    CheckpointWriteFailed with the writer's own error."""

    def __init__(self) -> None:
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self.sock: Optional[socket.socket] = None
        self.inflight: Optional[Dict[str, Any]] = None  # the request, while it runs

    def start(self) -> None:
        """Start the process now (importing torch takes it a second or two), so that the
        first save does not wait for it."""
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(os.environ)
        here = onbox.import_root()
        env["PYTHONPATH"] = here + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _ENTRY, str(child.fileno())],
                pass_fds=(child.fileno(),),
                env=env,
                stdin=subprocess.DEVNULL,
            )
        finally:
            child.close()
        self.sock = parent

    def submit(self, request: Dict[str, Any], memfd: Optional[int]) -> None:
        if self.inflight is not None:
            raise RuntimeError("a checkpoint write is already in flight")
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        assert self.sock is not None
        try:
            _send(self.sock, request, (memfd,) if memfd is not None else ())
        except OSError as e:
            self._dead(f"cannot reach the writer process: {e}")
        self.inflight = request

    def poll(self) -> Optional[Dict[str, Any]]:
        """The finished request's result, or None while it runs (or when none is in flight)."""
        if self.inflight is None or self.sock is None:
            return None
        self.sock.setblocking(False)
        try:
            self.sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return None
        except OSError:
            pass  # reported by the blocking read below
        finally:
            self.sock.setblocking(True)
        return self._answer()

    def wait(self) -> Optional[Dict[str, Any]]:
        """Block until the request in flight is done; its result (None when none was)."""
        if self.inflight is None:
            return None
        return self._answer()

    def _answer(self) -> Dict[str, Any]:
        assert self.sock is not None
        try:
            reply, _ = _recv(self.sock)
        except (EOFError, OSError):
            code = self.proc.wait() if self.proc is not None else None
            self._dead(f"the writer process died (exit status {code}) while writing")
        request, self.inflight = self.inflight, None
        if not reply.get("ok"):
            raise CheckpointWriteFailed(
                f"writing checkpoint step {request and request.get('step')} failed: "
                f"{reply.get('error')}",
                reply.get("remedy") or "the previous checkpoint is intact; see the error",
            )
        return reply

    def _dead(self, why: str) -> Any:
        request, self.inflight = self.inflight, None
        self._reset()
        raise CheckpointWriteFailed(
            f"{why}; checkpoint step {request and request.get('step')} was not written",
            "the previous checkpoint is intact; a new writer starts at the next save",
        )

    def _reset(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            self.proc = None

    def close(self) -> None:
        """Stop the writer (after the request in flight, whose result is then lost: call
        ``wait`` first to see it)."""
        if self.sock is not None:
            try:
                self.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        if self.proc is not None:
            try:
                self.proc.wait(timeout=600)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.sock is not None:
            self.sock.close()
        self.sock, self.proc, self.inflight = None, None, None


# ---------------------------------------------------------------- the process


def _handle(msg: Dict[str, Any], fds: List[int]) -> Dict[str, Any]:
    from onbox.train import ckptdir, snapshot

    t0 = time.monotonic()
    mm = None
    try:
        if fds:
            size = os.fstat(fds[0]).st_size
            mm = mmap.mmap(fds[0], size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        state = snapshot.tensors_from(mm, msg["state"]) if mm is not None else msg["state"]
        weights = snapshot.tensors_from(mm, msg["weights"]) if mm is not None else msg["weights"]
        path, nbytes = ckptdir.write(msg["dir"], msg["step"], state, weights or None)
        for p in msg.get("prune") or ():
            ckptdir.prune(msg["dir"], p["keep"], p.get("protect"))
        del state, weights
        return {"ok": True, "path": path, "bytes": nbytes, "seconds": time.monotonic() - t0}
    except OSError as e:
        return {
            "ok": False,
            "error": f"{e.strerror or e} ({e.filename or msg['dir']})",
            "remedy": "free space or inodes on the checkpoint disk" if e.errno == 28 else None,
        }
    except Exception as e:
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    finally:
        for fd in fds:
            os.close(fd)
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # a tensor still views it; the process ends soon enough
                pass


def main(argv: List[str]) -> int:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        os.nice(NICE)
    except OSError:
        pass
    sock = socket.socket(fileno=int(argv[0]))
    # Import torch now, while the loop trains, not when the first checkpoint is waiting.
    import torch  # noqa: F401

    from onbox.train import ckptdir, snapshot  # noqa: F401

    while True:
        try:
            msg, fds = _recv(sock)
        except (EOFError, ConnectionResetError):
            return 0
        reply = _handle(msg, fds)
        try:
            _send(sock, reply)
        except OSError:  # the training process is gone; what it asked for is written
            return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
