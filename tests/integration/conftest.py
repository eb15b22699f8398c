"""Fixtures for tests against real services: a throwaway sshd on loopback (tests/sshd.py), a second
one inside a network namespace of its own (tests/netns.py), a throwaway SeaweedFS S3 server
(tests/seaweed.py) and a single-node Slurm (tests/slurm.py) with an sshd login node."""

from __future__ import annotations

from typing import Iterator, Tuple

import pytest

from tests import netns as netnsmod
from tests import seaweed
from tests import slurm as slurmmod
from tests.conftest import require
from tests.netns import Netns
from tests.seaweed import SeaweedServer, start_seaweed
from tests.slurm import SlurmCluster, start_slurm
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


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    """One SeaweedFS S3 server (weed mini) for the whole session, on a fresh directory;
    stopped by PID at the end. ``.endpoint``, ``.access_key``/``.secret_key``, ``.bucket()``
    (a new bucket), ``.store(bucket)`` (an S3Store on it), ``.env()`` (for a child process).

    Skips when the weed binary is missing, except under CI=true.
    """
    why = seaweed.missing()
    require(why is None, why or "")
    server = start_seaweed(str(tmp_path_factory.mktemp("seaweed")))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def netns_sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tuple[Netns, SshServer]]:
    """A box with an address of its own: a network namespace joined to this machine by a veth
    pair (10.200.N.2 inside), with an sshd listening there; checked with a first login. A test
    that cuts the link (``Netns.link_down``) must bring it back (``link_up``). At the end the
    sshd and every connection it left are stopped by PID, and the namespace is deleted.

    Skips when this machine cannot make one (no iproute2, not root, no sshd), except under CI=true.
    """
    why = netnsmod.missing() or missing()
    require(why is None, why or "")
    ns = netnsmod.create_netns()
    try:
        server = start_sshd(
            str(tmp_path_factory.mktemp("netns-sshd")), address=ns.addr, netns=ns.name
        )
        try:
            p = server.run("true", timeout=60)
            assert p.returncode == 0, (
                f"ssh to the namespace's sshd failed ({p.returncode}): {p.stderr}\n"
                f"sshd log:\n{server.log()[-4000:]}"
            )
            yield ns, server
        finally:
            server.stop()
    finally:
        ns.delete()


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """One single-node Slurm (munged, slurmctld, slurmd) for the whole session; its jobs are
    cancelled and its daemons stopped by PID at the end. Clients need ``.env()`` (SLURM_CONF).

    Skips when slurm-wlm or munge is missing (or not root), except under CI=true.
    """
    why = slurmmod.missing()
    require(why is None, why or "")
    cluster = start_slurm(str(tmp_path_factory.mktemp("slurm")))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def slurm_login(
    slurm_cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SshServer]:
    """A "login node" of the session's Slurm: an sshd on loopback whose sessions get the
    cluster's SLURM_CONF (SetEnv), so sbatch, squeue, scontrol and scancel work over ssh as on
    a cluster; checked with a first login; stopped by PID at the end."""
    why = missing()
    require(why is None, why or "")
    server = start_sshd(
        str(tmp_path_factory.mktemp("slurm-login")), set_env={"SLURM_CONF": slurm_cluster.conf}
    )
    try:
        p = server.run("squeue -h", timeout=60)
        assert p.returncode == 0, f"squeue over ssh failed ({p.returncode}): {p.stderr}"
        yield server
    finally:
        server.stop()
