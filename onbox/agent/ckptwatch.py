"""Waking the sealer when the job writes a checkpoint: inotify, through watchdog.

The sealing thread (onbox/agent/sealservice.py) finds new checkpoints by a periodic scan; this
wakes it early, when a file in the checkpoint dir is closed after writing or renamed into place.
It is apart because it is the one piece that reaches the OS's file notifications, through an
optional dependency that may be missing or out of inotify watches: either way it says so with
an ``inotify_unavailable`` event and the scan stays the fallback.
"""

from __future__ import annotations

import threading
from typing import Any, Callable


def watch(
    ckpt_dir: str, wake: threading.Event, scan_every: float, event: Callable[..., None]
) -> Any:
    """Set ``wake`` on each file closed, moved or created under ``ckpt_dir``. Returns the
    started watchdog observer (``stop()`` it when sealing ends), or None when the dir is not
    watched (the event says why; the scan every ``scan_every`` seconds still finds it all)."""
    try:
        from watchdog.events import FileSystemEvent, FileSystemEventHandler
        from watchdog.observers import Observer
    except ImportError:
        event(
            "inotify_unavailable",
            f"watchdog is not installed: checkpoints are found by a scan every {scan_every:.0f}s",
            klass="usage",
            remedy="pip install watchdog into the agent's venv",
        )
        return None

    class Handler(FileSystemEventHandler):
        def on_any_event(self, event: FileSystemEvent) -> None:
            if event.event_type in ("closed", "moved", "created"):
                wake.set()

    try:
        observer = Observer()
        observer.daemon = True
        observer.schedule(Handler(), ckpt_dir, recursive=True)
        observer.start()
        return observer
    except OSError as e:  # inotify limits reached: the scan still finds everything
        event(
            "inotify_unavailable",
            f"cannot watch {ckpt_dir}: {e}",
            klass="transient",
            remedy="raise fs.inotify.max_user_watches",
        )
        return None
