"""Naming rgt's processes in `ps`: ``rgt-agent agent NAME``, ``rgt-agent shim NAME attempt K``.

setproctitle does the work, but its package imports ``logging`` (about 2.7 MiB in every
agent and shim); the C extension alone is loaded here instead. Without it, the kernel's
15-character command name is set, which ``ps -e`` and ``top`` show.
"""

from __future__ import annotations

import os


def _load_extension() -> object:
    import importlib.machinery
    import importlib.util

    spec = importlib.util.find_spec("setproctitle")  # finds the package without running it
    for where in (spec.submodule_search_locations or []) if spec else []:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = os.path.join(where, "_setproctitle" + suffix)
            if not os.path.exists(path):
                continue
            loader = importlib.machinery.ExtensionFileLoader("setproctitle._setproctitle", path)
            mspec = importlib.util.spec_from_file_location(
                "setproctitle._setproctitle", path, loader=loader
            )
            if mspec is None:
                continue
            mod = importlib.util.module_from_spec(mspec)
            loader.exec_module(mod)
            return mod
    return None


def set_title(text: str) -> None:
    """Show ``text`` as this process's command line; never fails.

    The kernel's command name (15 characters) gets it with '-' for each blank: Slurm's
    proctrack/linuxproc reads /proc/PID/stat with a scanf that a blank in the name throws off,
    and then loses the process and every child of it (neither signalled when the job is
    cancelled or requeued, nor waited for)."""
    try:
        mod = _load_extension()
        if mod is not None:
            mod.setproctitle(text)  # type: ignore[attr-defined]
    except (ImportError, OSError, ValueError):
        pass
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(text.replace(" ", "-")[:15])
    except OSError:
        pass
