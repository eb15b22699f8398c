"""The filesystems a run writes to, by label: what the disk probe (onbox/health/disk.py)
watches, and what an ENOSPC exit (onbox/agent/runner.py) asks about when it tells inodes from
bytes. One list for both, so that the exit blames what the probe saw."""

from __future__ import annotations

import os
from typing import Dict

from onbox.agent.spec import JobSpec


def disk_paths(spec: JobSpec, run_dir: str) -> Dict[str, str]:
    """The paths the run writes to, by label: its own, the caches, the user's ``[health.disk]
    paths``. The disk probe watches them; an ENOSPC exit asks which of them ran out of inodes."""
    paths = {"run": run_dir, "workdir": spec.workdir, "ckpt": spec.ckpt_dir}
    if spec.store is not None and spec.store.url.startswith("file://"):
        paths["store"] = spec.store.url[len("file://") :]
    paths["cache"] = os.environ.get("HF_HOME") or os.path.expanduser("~/.cache")
    for i, extra in enumerate(spec.health.disk.paths):
        paths[f"path{i + 1}"] = os.path.abspath(os.path.join(spec.workdir, extra))
    return paths
