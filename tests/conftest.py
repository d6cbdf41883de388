"""Shared fixtures: the one way tests start real daemons (and always stop them)."""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
from pathlib import Path

import pytest

from kspeed.cli.cluster import LocalCluster
from kspeed.rdma.rails import get_rail, use_verbs_api

# Timers short enough that lifecycle transitions happen within a test's patience.
FAST_MANAGER = [
    "--heartbeat-interval",
    "200ms",
    "--suspect-after",
    "1s",
    "--fail-after",
    "2s",
    "--probe-interval",
    "300ms",
    "--probe-timeout",
    "500ms",
    "--max-request-bytes",
    "64KiB",
]
SERVER_MEMORY = ["--memory", "8MiB", "--region-size", "1MiB"]


@pytest.fixture
def cluster_factory(tmp_path):
    """``make(servers=2, **kwargs)`` starts a :class:`LocalCluster`; all are stopped at teardown."""
    clusters: list[LocalCluster] = []

    def make(servers: int = 2, *, manager_args=(), server_args=(), **kwargs) -> LocalCluster:
        cluster = LocalCluster(
            str(tmp_path / f"cluster-{len(clusters)}"),
            servers=servers,
            manager_args=[*FAST_MANAGER, *manager_args],
            server_args=[*SERVER_MEMORY, *server_args],
            **kwargs,
        )
        clusters.append(cluster)
        cluster.start()
        return cluster

    yield make
    for cluster in clusters:
        cluster.stop()


@pytest.fixture
def cluster(cluster_factory) -> LocalCluster:
    """A running cluster of one manager and two servers, auth off."""
    return cluster_factory(2)


@pytest.fixture
def verbs():
    """The registry's ``verbs`` rail on the strict double of pyverbs (``tests/verbs_double``) for the test."""
    use_verbs_api("tests.verbs_double:api")
    yield get_rail("verbs")
    use_verbs_api(None)


# Seconds the interpreter may take to exit once the session is over before every thread's stack is
# written to stderr and the process ends (a thread or child process the suite left behind would
# otherwise hold the run, and the machine running it, until an outer timeout).
EXIT_GRACE = 120


def leftovers() -> list[str]:
    """What a finished session leaves: live non-daemon threads and child processes, named."""
    found = [
        f"thread {t.name!r}"
        for t in threading.enumerate()
        if t is not threading.main_thread() and t.is_alive() and not t.daemon
    ]
    for task in Path(f"/proc/{os.getpid()}/task").glob("*/children"):
        for pid in task.read_text().split():
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            found.append(f"process {pid}: {command.strip()[:200]}")
    return found


def pytest_sessionfinish(session, exitstatus):
    left = leftovers()
    if left:
        sys.stderr.write("\nthe session left behind (the interpreter may wait on them at exit):\n")
        sys.stderr.writelines(f"  {item}\n" for item in left)
    faulthandler.dump_traceback_later(EXIT_GRACE, exit=True)
