"""The run's state and events in the store (``<run>/state/``): what `rgt status` reads when the
box is silent and `rgt report` once it is gone. Written by the agent after each sealing pass and
when it leaves, only while it owns the run.

The fence is checked where the writes are: when a file changed since the last mirror, the
store's ``epochs/`` is listed afresh before it is put (``Sealer.is_writer``, one listing). An
agent that a newer one (another box) took the run over from learns it there even when it has
no checkpoint to seal (the sealer lists ``epochs/`` only before a seal), so it never puts its
state over the newer agent's: not while it idles, and not its STOPPED when it is stopped, over a
run that goes on elsewhere. Once stale, it mirrors nothing again. An agent with no sealer (one
that found the run taken over when it adopted it: onbox/agent/ownership.py) mirrors nothing.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

from onbox.common import redact
from onbox.common.rundir import RunDir
from onbox.sealing import manifest as mf
from onbox.sealing.sealer import Sealer
from onbox.sealing.stores.base import Store


class StateMirror:
    """One agent's mirror of the run directory's state.json, events and health samples."""

    def __init__(self, run: str, rd: RunDir, store: Store) -> None:
        self.run = run
        self.rd = rd
        self.store = store
        self._mirrored: Dict[str, float] = {}  # name -> the mtime last put

    def write(self, sealer: Optional[Sealer], events: bool, health: bool) -> None:
        """Put what changed: state.json; with ``events`` the events (else the store's copy
        holds the run's history: onbox/agent/interval.py); with ``health`` the samples."""
        if sealer is None or sealer.stale:
            return
        files = [("state.json", self.rd.state)]
        if events:
            files.append(("events.jsonl", self.rd.events))
        if health:  # for `rgt report` when the box is gone (onbox/health/series.py)
            files += [
                (n, os.path.join(self.rd.health, n)) for n in ("samples.jsonl", "coarse.jsonl")
            ]
        changed = self._changed(files)
        if not changed or not sealer.is_writer():
            return  # nothing new, or a newer epoch's agent mirrors the run now
        for name, mtime, data in changed:
            # Written redacted by the journal; again here for lines written before a secret
            # was added (`rgt-agent secrets` on a live run) or by an older agent.
            data = redact.for_home(self.rd.home).redact_bytes(data)
            self.store.put_bytes(mf.state_key(self.run, name), data)
            self._mirrored[name] = mtime

    def _changed(self, files: List[Tuple[str, str]]) -> List[Tuple[str, float, bytes]]:
        """(name, mtime, bytes) of each file that changed since it was last put."""
        out = []
        for name, path in files:
            try:
                mtime = os.stat(path).st_mtime
                if self._mirrored.get(name) == mtime:
                    continue
                with open(path, "rb") as f:
                    out.append((name, mtime, f.read()))
            except OSError:
                continue
        return out
