"""The box's Python, looked at by itself: run by ``rgt_python_probe`` (python_probe.sh) as
``PYTHON -c <this file's text> PYTHON [AGENT_DIR VERSION SHA256 EXTRAS]``.

It runs under any Python from 2.7 on, so that an old one is reported instead of crashing (hence
type comments, not annotations). argv: the Python's path as the shell resolved it, then, to look
for an install too, the agent/ directory, rgt's version, the wheel's sha256 and the extras (as
controller/deploy/install.py ``install_key`` names them). Prints one JSON line.
"""

import binascii
import hashlib
import json
import os
import platform
import sys


def raw(s):  # type: (str) -> bytes
    """An argument as the bytes it came as (Python 2's str is bytes already)."""
    if hasattr(os, "fsencode"):
        return os.fsencode(s)
    return s  # type: ignore[return-value]


def newest_install(root, key):  # type: (bytes, bytes) -> bytes | None
    """KEY, or KEY-N (N >= 2: made next to one an agent still ran from): the complete one with
    the highest N."""
    best, best_n = None, 0
    try:
        names = os.listdir(root)
    except OSError:
        names = []
    for name in names:
        tail = name[len(key) + 1 :]
        if name == key:
            n = 1
        elif name.startswith(key + b"-") and tail.isdigit():
            n = int(tail)
        else:
            continue
        if n > best_n and os.path.isfile(os.path.join(root, name, b".rgt-agent.json")):
            best, best_n = name, n
    return best


out = {
    "path": binascii.hexlify(raw(sys.argv[1])).decode("ascii"),
    "version": list(sys.version_info[:3]),
    "implementation": getattr(getattr(sys, "implementation", None), "name", "cpython"),
    "abiflags": getattr(sys, "abiflags", ""),
    "machine": platform.machine(),
    "libc": list(platform.libc_ver()),
}
if len(sys.argv) > 5 and sys.argv[3]:
    root, ver, sha, extras = [raw(a) for a in sys.argv[2:6]]
    digest = hashlib.sha256(b"\0".join([sha, raw(sys.argv[1]), extras])).hexdigest()
    name = newest_install(root, ver + b"-" + digest[:12].encode("ascii"))
    out["install"] = None
    if name:
        try:
            with open(os.path.join(root, name, b".rgt-agent.json"), "rb") as f:
                out["marker"] = f.read().decode("utf-8", "replace")
            out["install"] = name.decode("ascii")
        # Python 2.7's open raises IOError, which is no OSError there.
        except (IOError, OSError, UnicodeError):  # noqa: UP024
            pass
print(json.dumps(out))
