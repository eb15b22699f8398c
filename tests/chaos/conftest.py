"""Fixtures of the chaos suite: the stores under test, and the two tiers.

Short scenarios (a few seconds each) run with the rest of the tests. Long ones are marked
``chaos_long`` and deselected unless RGT_CHAOS_LONG=1 (more crash points per protocol,
every crash point against S3, long pauses): they are the same faults, more of them.

S3 is a real SeaweedFS (tests/seaweed.py), one for the suite; a scenario that kills its server
starts one of its own. Under CI=true a missing ``weed`` fails instead of skipping.
"""

from __future__ import annotations

import os
import uuid
from typing import Any, Iterator, List

import pytest

from tests import seaweed
from tests.chaos.harness import Backend
from tests.chaos.invariants import FileView, S3View
from tests.conftest import require
from tests.seaweed import SeaweedServer, start_seaweed

LONG = os.environ.get("RGT_CHAOS_LONG", "").lower() in ("1", "true", "yes")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "chaos_long: a long chaos scenario (opt-in: RGT_CHAOS_LONG=1)"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    # The long tier is opt-in: deselected (not run, not reported as skipped) unless asked for.
    if LONG:
        return
    long = [item for item in items if "chaos_long" in item.keywords]
    if long:
        config.hook.pytest_deselected(items=long)
        items[:] = [item for item in items if "chaos_long" not in item.keywords]


@pytest.fixture(scope="session")
def chaos_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    """One SeaweedFS for the chaos suite; stopped by PID at the end."""
    why = seaweed.missing()
    require(why is None, why or "")
    server = start_seaweed(str(tmp_path_factory.mktemp("chaos-seaweed")))
    try:
        yield server
    finally:
        server.stop()


def s3_backend(server: SeaweedServer) -> Backend:
    """A fresh bucket on ``server``, as a backend."""
    bucket = server.bucket()
    return Backend("s3", f"s3://{bucket}/rgt", server.env(), S3View(server.client(), bucket, "rgt"))


def file_backend(root: str) -> Backend:
    os.makedirs(root, exist_ok=True)
    env = dict(os.environ)
    return Backend("file", "file://" + root, env, FileView(root))


@pytest.fixture(params=["file", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path: Any) -> Backend:
    """Each store kind rgt seals to on this machine (the Hub needs a token: tests/optin)."""
    if request.param == "file":
        return file_backend(str(tmp_path / "store"))
    server: SeaweedServer = request.getfixturevalue("chaos_s3")
    return s3_backend(server)


@pytest.fixture
def run_name() -> str:
    return f"chaos-{uuid.uuid4().hex[:8]}"
