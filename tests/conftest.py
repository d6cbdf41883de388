"""Shared fixtures: the one way tests start real daemons (and always stop them)."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
from pathlib import Path

import pytest

from kspeed.cli.cluster import QUICK_FAILURE_DETECTION, LocalCluster
from kspeed.rdma.rails import get_rail, use_verbs_api

# Timers short enough that lifecycle transitions happen within a test's patience.
FAST_MANAGER = [*QUICK_FAILURE_DETECTION, "--max-request-bytes", "64KiB"]
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


# Seconds the interpreter may take to exit once the session is over. Then every thread's stack is
# written to stderr and the process ends with the session's status: a thread or child process the
# suite left behind would otherwise hold the run, and the machine running it, until an outer
# timeout. A backstop in C (faulthandler) ends it, status 1, if even that cannot run.
EXIT_GRACE = 120


def _end_a_hung_exit(status: int) -> None:
    sys.stderr.write(
        f"\nthe interpreter has not exited {EXIT_GRACE} s after the session ended "
        f"(status {status}); what each thread is doing:\n"
    )
    faulthandler.dump_traceback(all_threads=True)
    sys.stderr.flush()
    os._exit(status)


def _command(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    except OSError:
        return "?"


def _ancestors() -> set[str]:
    pids, pid = set(), os.getpid()
    while pid > 1:
        pids.add(str(pid))
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
    return pids


def _holders_of_our_output() -> list[str]:
    """Processes outside this one's line of ancestors that hold its stdout or stderr: whatever runs
    the suite waits for them to let go of its output, however long they live."""
    ours = set()
    for fd in (1, 2):
        with contextlib.suppress(OSError):
            ours.add(os.readlink(f"/proc/self/fd/{fd}"))
    mine = _ancestors()
    holders = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or entry.name in mine:
            continue
        for fd in ("1", "2"):
            try:
                if os.readlink(entry / "fd" / fd) in ours:
                    holders.append(entry.name)
                    break
            except OSError:
                continue
    return holders


def leftovers() -> tuple[list[str], list[str]]:
    """What a finished session leaves: live non-daemon threads and child processes, named; and the
    processes (children or not) that hold its output."""
    found = [
        f"thread {t.name!r}"
        for t in threading.enumerate()
        if t is not threading.main_thread() and t.is_alive() and not t.daemon
    ]
    for task in Path(f"/proc/{os.getpid()}/task").glob("*/children"):
        found.extend(f"process {pid}: {_command(pid)}" for pid in task.read_text().split())
    return found, _holders_of_our_output()


def pytest_sessionfinish(session, exitstatus):
    left, holders = leftovers()
    if left:
        sys.stderr.write("\nthe session left behind (the interpreter may wait on them at exit):\n")
        sys.stderr.writelines(f"  {item}\n" for item in left)
    if holders:
        # Left alive, they would hold the run (and the machine running it) until an outer timeout.
        sys.stderr.write("\nprocesses the session left holding its output, killed:\n")
        for pid in holders:
            sys.stderr.write(f"  process {pid}: {_command(pid)}\n")
            with contextlib.suppress(OSError):
                os.kill(int(pid), signal.SIGKILL)
    watchdog = threading.Timer(EXIT_GRACE, _end_a_hung_exit, args=(int(exitstatus),))
    watchdog.daemon = True
    watchdog.start()
    faulthandler.dump_traceback_later(EXIT_GRACE + 60, exit=True)
