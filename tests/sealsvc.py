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


def seal_service(tmp_path: Any, **spec: Any) -> SealService:
    """The service of run ``r``, its checkpoint dir ``tmp_path/ckpt`` (made) and store
    ``tmp_path/store``; ``spec``: JobSpec's keyword fields (trigger "file" unless given)."""
    rd = RunDir("r", str(tmp_path / "home"))
    rd.create()
    os.makedirs(str(tmp_path / "ckpt"), exist_ok=True)
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
