"""Items 2 and 3 of the security review: streams nobody ends, and streams that buffer without bound.

Health ``Watch`` streams need no token and send nothing while the status holds: a server counted
them among its streams (28 per address) and never ended them, so a job from the same address got
``BusyError`` on ``StreamPlan``; the manager had no bound at all. Calls that never send their
request held a server's threads the same way. ``StreamPlan`` kept every chunk before it looked at
the first one's feed.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kspeed import DatasetSpec, KSpeedClient
from kspeed.client.feeding import links
from kspeed.proto import kspeed_pb2, kspeed_pb2_grpc
from tests.helpers import client_for
from tests.integration.test_client import config_for
from tests.integration.test_datasets import make_tree
from tests.integration.test_failover import BATCH, SEED, check_epoch
from tests.security.attacks import flood_stream_plan, hold_bodiless_calls, hold_watch_streams

pytestmark = pytest.mark.security

IDLE_S = 2.0  # the daemons' stream_idle_timeout here
WATCHES = 16  # their health_watches (the default): a quarter of them per address


def vm_kib(pid: int, field: str) -> int:
    """A process's ``/proc/<pid>/status`` memory figure (``VmRSS``, ``VmHWM``), in KiB."""
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        line = next(line for line in fh if line.startswith(f"{field}:"))
    return int(line.split()[1])


@pytest.mark.timeout(120)
def test_health_watches_are_ended_when_idle_and_never_take_a_jobs_plan_streams(cluster_factory, tmp_path, monkeypatch):
    files = make_tree(tmp_path / "imgs", max_size=16 * 1024)
    idle = ["--stream-idle-timeout", f"{IDLE_S:g}s"]
    cluster = cluster_factory(1, manager_args=idle, server_args=["--backend-allow", str(tmp_path), *idle])
    monkeypatch.setattr(links, "PLAN_CHUNK", 8)  # every plan part goes as a StreamPlan stream
    monkeypatch.setattr(links, "BUSY_RETRY_S", 5.0)  # (a refused plan fails sooner)
    stop = threading.Event()
    reports: dict[str, object] = {}
    attacks = []
    for name, address in (("server", cluster.servers[0].ready["grpc"]), ("manager", cluster.address)):
        started = threading.Event()
        attack = threading.Thread(
            target=lambda name=name, address=address, started=started: reports.__setitem__(
                name, hold_watch_streams(address, 40, duration=60, stop=stop, started=started)
            )
        )
        attack.start()
        attacks.append((attack, started))
    try:
        assert all(started.wait(15) for _, started in attacks)
        begun = time.monotonic()
        spec = DatasetSpec(name="imgs", uri=str(tmp_path / "imgs"), labels="dirname")
        with KSpeedClient(config=config_for(cluster)) as client:  # from the attacker's address
            ds = client.dataset(spec, batch_size=BATCH, seed=SEED, quiet=True)
            for epoch in (0, 1):
                check_epoch(ds, files, epoch)
            ds.close()
        # The attack outlasts the idle timeout of the first watches, so the reports show it enforced.
        stop.wait(max(0.0, begun + IDLE_S + 2 - time.monotonic()))
    finally:
        stop.set()
        for attack, _ in attacks:
            attack.join(timeout=15)
    for name in ("server", "manager"):
        report = reports[name]
        assert report.refused > 0 and report.opened >= WATCHES // 4, (name, report)  # capped per address
        assert report.closed_by_target >= WATCHES // 4, (name, report)  # ended when idle...
        assert report.longest_held < IDLE_S + 2.5, (name, report)  # ...by the idle timeout


@pytest.mark.timeout(120)
def test_a_stream_plan_for_no_feed_is_refused_at_its_first_chunk(cluster_factory):
    cluster = cluster_factory(1)
    server = cluster.servers[0]
    pid = server.ready["pid"]
    peak = vm_kib(pid, "VmHWM")
    report = flood_stream_plan(server.ready["grpc"], chunks=20, chunk_bytes=16 << 20)
    assert report.code == "NOT_FOUND" and "not open on this server" in report.details, report
    # Nothing was kept: the server's peak memory grew by the few copies of a chunk or two that gRPC
    # and the parser hold in flight, not by the stream's 320 MiB.
    assert (vm_kib(pid, "VmHWM") - peak) << 10 < 8 * (16 << 20)
    assert server.running


@pytest.mark.timeout(120)
def test_calls_that_never_send_their_request_cannot_starve_a_servers_health_checks(cluster_factory):
    deadline = 2.0  # the server's handshake_timeout here: a call's request must come within it
    cluster = cluster_factory(1, server_args=["--rpc-threads", "16", "--handshake-timeout", f"{deadline:g}s"])
    server = cluster.servers[0]
    stop, started = threading.Event(), threading.Event()
    reports = []
    attack = threading.Thread(  # more calls than the server has threads, from the probes' address
        target=lambda: reports.append(
            hold_bodiless_calls(server.ready["grpc"], 40, duration=60, stop=stop, started=started)
        )
    )
    attack.start()
    channel = grpc.insecure_channel(server.ready["grpc"])
    try:
        assert started.wait(15)
        health, stub = health_pb2_grpc.HealthStub(channel), kspeed_pb2_grpc.ServerStub(channel)
        begun = time.monotonic()
        while time.monotonic() < begun + deadline + 2:  # past the deadline of the first calls
            assert (
                health.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                == health_pb2.HealthCheckResponse.SERVING
            )
            assert stub.GetInfo(kspeed_pb2.GetInfoRequest(), timeout=2).id == server.ready["id"]
        with client_for(cluster) as client:  # the manager's probes got through all along
            assert [(r.id, r.state) for r in client.servers()] == [(server.ready["id"], 2)]
    finally:
        stop.set()
        attack.join(timeout=15)
        channel.close()
    (report,) = reports
    assert report.closed_by_target >= 40, report  # each cut by its deadline, or to make room
    assert report.longest_held < deadline + 1.5, report
