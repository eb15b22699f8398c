"""Fixtures for tests against real services: a throwaway sshd on loopback (tests/sshd.py)."""

from __future__ import annotations

from typing import Iterator

import pytest

from tests.conftest import require
from tests.sshd import SshServer, missing, start_sshd


@pytest.fixture(scope="session")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshServer]:
    """One sshd for the whole session, checked with a first login; stopped by PID at the end.

    Skips when this machine cannot run one (no sshd, not root), except under CI=true.
    """
    why = missing()
    require(why is None, why or "")
    server = start_sshd(str(tmp_path_factory.mktemp("sshd")))
    try:
        # The first login also records the host key, so later clients connect without asking.
        p = server.run("true", timeout=60)
        assert p.returncode == 0, (
            f"ssh to the test sshd failed ({p.returncode}): {p.stderr}\n"
            f"sshd log:\n{server.log()[-4000:]}"
        )
        yield server
    finally:
        server.stop()
