"""`rgt sweep` and `rgt reconcile` on a store that stopped answering: each cell's documents are
read from the store on the laptop, and each read is bounded by the base job file's ``[store]
stall`` (as every other laptop read of a store, controller/runstore.py), so the command ends
(exit 14, the store and the read named) instead of waiting on botocore's 4 x 60 s per read and
base.with_retries' five tries of that, for each cell. A hung store is not a cell's verdict:
reconcile does not call the cells "unverified" (which `rgt sweep` would re-run as fresh runs).

Real processes and real signals: a ``weed mini`` of the test's own, SIGSTOPped after the store
was written, then SIGCONTed and ended by PID (tests/integration/test_store_hung.py ``_weed``);
every CLI run is bounded (WAIT) and killed by PID past it. The sweep's box is never reached:
the first thing `rgt sweep` does for a cell is ask the store whether it is sealed already.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Dict, List

import pytest

from tests.integration.test_store_hung import _bounded, _stop, _weed
from tests.laptop import rgt_exe


def _plan(tmp_path: Any, url: str, endpoint: str) -> str:
    """A sweep of two cells under ``url``, whose job file gives the store 2 s."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "job.toml").write_text(
        f'[store]\nurl = "{url}"\nendpoint_url = "{endpoint}"\nstall = "2s"\n'
    )
    plan = project / "PLAN.toml"
    plan.write_text(
        f'name = "sw"\nstore = "{url}"\njob = "job.toml"\n'
        'targets = ["rgt-sweep-stall-box.invalid"]\n'
        f'command = ["{sys.executable}", "-c", "pass", "{{seed}}"]\n'
        "[grid]\nseed = [0, 1]\n"
    )
    return str(plan)


@pytest.mark.parametrize("command", [["reconcile"], ["sweep", "--no-wait"]])
def test_a_sweeps_reads_of_a_stopped_s3_store_end_after_the_job_files_stall(
    tmp_path: Any, controller_env: Dict[str, str], command: List[str]
) -> None:
    """Before the fix the sweep's store was opened unbounded: `rgt reconcile` and `rgt sweep`
    waited on the first cell's DONE.json read (botocore's 241 s, five times over under
    with_retries) and were still waiting when the test gave up (WAIT)."""
    with _weed(tmp_path) as (server, store, stopped):
        plan = _plan(tmp_path, store.url, server.endpoint)
        env = server.env(dict(os.environ, **controller_env))
        _stop(server, stopped)
        rc, out, err = _bounded([*rgt_exe(), *command, plan], env, str(tmp_path))
    assert rc == 14, (out, err)
    # reconcile lists the sweep's prefix (for duplicates) before it reads any cell
    first = "(listing sw-)" if command == ["reconcile"] else "(reading sw-"
    assert f"{store.url} did not answer for 2s {first}" in err, err
    assert "stopped answering" in err and "[store] stall" in err, err
    assert "Traceback" not in err, err
    if command == ["reconcile"]:  # no verdict recorded: the store said nothing of the cells
        home = controller_env["RGT_CONTROLLER_HOME"]
        with open(os.path.join(home, "sweeps", "sw.json")) as f:
            cells = json.load(f)["cells"]
        assert all(c.get("verdict") is None for c in cells.values()), cells
