"""Item 4 of the security review: the daemons' HTTP endpoints had no deadline and no cap.

951 idle connections gave the manager 961 threads and 972 open files. Each connection now has
``http_timeout`` in all, and at most ``http_connections`` (``http_connections_per_peer`` from one
address) are served at once, the oldest closed to make room.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from kspeed.cli.cluster import wait_for
from tests.helpers import http_get
from tests.security.attacks import idle_http_connections, split_address

pytestmark = pytest.mark.security

TIMEOUT = 2.0  # the manager's http_timeout here
CONNECTIONS, PER_PEER = 32, 8


def threads_and_files(pid: int) -> tuple[int, int]:
    """How many threads and open descriptors a process has."""
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        threads = int(next(line for line in fh if line.startswith("Threads:")).split()[1])
    return threads, len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.timeout(120)
def test_idle_http_connections_are_capped_and_dropped_and_probes_still_answer(cluster_factory):
    limits = ["--http-timeout", f"{TIMEOUT:g}s", "--http-connections", str(CONNECTIONS)]
    cluster = cluster_factory(1, manager_args=[*limits, "--http-connections-per-peer", str(PER_PEER)])
    pid = cluster.manager.ready["pid"]
    threads, files = threads_and_files(pid)
    stop, started = threading.Event(), threading.Event()
    reports = []
    # 100 connections from five loopback addresses, one of them the probes' own.
    attack = threading.Thread(
        target=lambda: reports.append(
            idle_http_connections(
                split_address(cluster.http_address),
                100,
                duration=60,
                sources=[f"127.0.0.{k}" for k in range(1, 6)],
                stop=stop,
                started=started,
            )
        )
    )
    attack.start()
    peak = (0, 0)
    try:
        assert started.wait(15)
        begun = time.monotonic()
        while time.monotonic() < begun + TIMEOUT + 1.5:  # past the deadline of the first connections
            peak = max(peak, threads_and_files(pid))
            # A probe from the attackers' own address is answered all along.
            assert http_get(cluster.http_address, "/healthz") == (200, "ok\n")
            assert http_get(cluster.http_address, "/readyz") == (200, "ready\n")
    finally:
        stop.set()
        attack.join(timeout=15)
    (report,) = reports
    assert report.refused == 0 and report.closed_by_target >= 100, report
    assert report.longest_held < TIMEOUT + 1.5, report  # each dropped by its deadline
    # A thread and a descriptor per connection allowed, and a few more while shut ones wind down.
    assert peak[0] <= threads + CONNECTIONS + 8 and peak[1] <= files + CONNECTIONS + 8, (peak, threads, files)
    wait_for(lambda: threads_and_files(pid)[0] <= threads + 1, 10, "the connections' threads gone")
