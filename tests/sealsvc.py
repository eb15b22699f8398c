"""The agent's sealing service (onbox/agent/sealservice.py) of a run ``r`` made for a unit
test, real in every part: a run directory, a job spec, a ``file://`` store and a journal under
the test's temporary directory."""

from __future__ import annotations

import os
from typing import Any

from onbox.agent.journal import FileJournal
from onbox.agent.sealservice import SealService
from onbox.agent.spec import JobSpec
from onbox.common.rundir import RunDir
from onbox.common.storeurl import parse_store_url
from onbox.sealing.epochs import take_epoch
from onbox.sealing.sealer import Sealer
from onbox.sealing.stores.base import Store


def seal_service(tmp_path: Any, **spec: Any) -> SealService:
    """The service of run ``r``, its checkpoint dir ``tmp_path/ckpt`` (made) and store
    ``tmp_path/store``; ``spec``: JobSpec's keyword fields (trigger "file" unless given)."""
    rd = RunDir("r", str(tmp_path / "home"))
    rd.create()
    os.makedirs(str(tmp_path / "ckpt"), exist_ok=True)
    os.makedirs(str(tmp_path / "store"), exist_ok=True)  # a store root is the user's to make
    spec.setdefault("trigger", "file")
    job = JobSpec(
        "r",
        ("true",),
        str(tmp_path),
        str(tmp_path / "ckpt"),
        store=parse_store_url("file://" + str(tmp_path / "store")),
        **spec,
    )
    return SealService(job, rd, FileJournal(rd.state, rd.events), lambda sig: None)


def old_box_sealer(run: str, ckpt: str, store: Store, tmp_path: Any) -> Sealer:
    """The real Sealer of run ``run``'s old box over the checkpoint dir ``ckpt``, loaded, with
    an epoch of its own in ``store`` and its stage and state under ``tmp_path``: what sealed
    the checkpoints a test's fresh box then restores."""
    sealer = Sealer(
        run,
        ckpt,
        store,
        str(tmp_path / "old-box-stage"),
        epoch=take_epoch(store, run),
        event=lambda *a, **k: None,
        state_path=str(tmp_path / "old-box-seq.json"),
    )
    sealer.load()
    return sealer
