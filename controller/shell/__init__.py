"""The shell the laptop runs on the box, kept as real ``.sh`` files beside this module.

They ship as package data and are checked by shellcheck in the test command (scripts/check).
Each is POSIX sh: remote.py runs a script under ``/bin/sh`` whatever the login shell is.
"""

import os

HERE = os.path.dirname(os.path.abspath(__file__))


def script(name: str) -> str:
    """The text of ``controller/shell/NAME`` (``NAME`` with its ``.sh``)."""
    with open(os.path.join(HERE, name), encoding="utf-8") as f:
        return f.read()
