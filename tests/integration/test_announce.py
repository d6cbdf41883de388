"""What a server announces, and a server the manager cannot probe saying so in its own log.

The first test puts the manager and a server in their own namespaces of a
:class:`tests.netlab.NetLab` (root only; skipped with the reason elsewhere), the server listening on
``0.0.0.0`` as ``deploy/`` configures it: the host name resolves to loopback here (as Debian's
``127.0.1.1`` line does), so a server that announced its host name would be probed by the manager
on the manager's own loopback and never become ready.
"""

from __future__ import annotations

import json
import socket
import sys
from collections.abc import Iterator

import pytest

from kspeed.cli.cluster import LocalCluster, wait_for
from tests.conftest import FAST_MANAGER, SERVER_MEMORY
from tests.netlab import NetLab, netlab_unavailable


def log_of(daemon) -> str:
    with open(daemon.log_file, encoding="utf-8", errors="replace") as fh:
        return fh.read()


def test_a_server_on_a_wildcard_address_announces_one_the_manager_reaches(tmp_path):
    reason = netlab_unavailable()
    if reason:
        pytest.skip(reason)
    with NetLab(["mgr", "s0"]) as lab:
        where = {"manager": "mgr", "server-0": "s0"}
        cluster = LocalCluster(
            str(tmp_path / "cluster"),
            servers=1,
            manager_host=lab.address("mgr"),
            server_hosts=["0.0.0.0"],
            launch_prefix=lambda name: lab.prefix(where[name]),
            manager_args=FAST_MANAGER,
            server_args=SERVER_MEMORY,
        )
        try:
            cluster.start(timeout=30)  # READY: the manager's probes reached the announced address
            status = lab.run(
                "mgr", sys.executable, "-m", "kspeed.cli", "status", "--json", "--manager", cluster.address,
                "--auth", "none",
            )  # fmt: skip
            [server] = json.loads(status.stdout)["servers"]
            assert server["address"].rpartition(":")[0] == lab.address("s0")
            said = log_of(cluster.servers[0])
            assert f"announcing {server['address']}" in said and "server.advertise" in said
        finally:
            cluster.stop()


@pytest.fixture
def dead_port() -> Iterator[int]:
    """A loopback port bound but not listening: connections to it are refused, and nobody else takes it."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    yield sock.getsockname()[1]
    sock.close()


def test_a_server_the_manager_cannot_probe_says_why_it_is_not_ready(cluster_factory, dead_port):
    cluster = cluster_factory(0, server_args=["--advertise", f"127.0.0.1:{dead_port}"])
    server = cluster.add_server(member=False)
    warned = "no health probe has reached this server"
    wait_for(lambda: warned in log_of(server), 30, "the server's warning")
    said = log_of(server)
    assert f"127.0.0.1:{dead_port} (server.advertise)" in said and "KSPEED_SERVER_ADVERTISE" in said
