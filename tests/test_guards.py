"""The gRPC servers' guards on an in-process server: health watches, streams, calls without a request."""

from __future__ import annotations

import asyncio
import threading
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer as AioHealthServicer

from kspeed.cli.cluster import wait_for
from kspeed.control.arrivals import ArrivalGuard
from kspeed.control.streams import AioStreamGuard, StreamGuard

SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture
def sync_server():
    """``start(threads, arrivals, streams)`` serves grpc.health.v1 behind the guards; returns the address."""
    made = []

    def start(threads: int, arrivals: ArrivalGuard, streams: StreamGuard) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(threads), interceptors=[arrivals, streams])
        health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        made.append((server, arrivals, streams))
        return f"127.0.0.1:{port}"

    yield start
    for server, arrivals, streams in made:
        server.stop(0).wait()
        arrivals.close()
        streams.close()


def test_watches_hold_no_thread_are_capped_per_address_and_end_when_idle(sync_server):
    address = sync_server(2, ArrivalGuard(5.0, 2), StreamGuard(4, 2, 1.0, watches=8))
    channel = grpc.insecure_channel(address)
    stub = health_pb2_grpc.HealthStub(channel)
    watches = []
    for _ in range(2):  # two per address (a quarter of 8)
        watches.append(stub.Watch(health_pb2.HealthCheckRequest(), timeout=30))
        assert next(watches[-1]).status == SERVING
    with pytest.raises(grpc.RpcError) as refused:
        next(stub.Watch(health_pb2.HealthCheckRequest(), timeout=30))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # Two open watches on a pool of two threads: a check is still answered.
    assert stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == SERVING
    # Nothing to send for a second: each ends, status OK.
    for watch in watches:
        assert list(watch) == []
        assert watch.code() == grpc.StatusCode.OK
    channel.close()


def test_calls_that_never_send_their_request_are_cut(sync_server):
    arrivals = ArrivalGuard(1.0, 2)
    address = sync_server(4, arrivals, StreamGuard(2, 1, 30.0))
    channel = grpc.insecure_channel(address)
    never = threading.Event()

    def silent():
        never.wait()
        yield from ()

    bodiless = channel.stream_unary(
        "/grpc.health.v1.Health/Check", request_serializer=bytes, response_deserializer=bytes
    )
    held = [bodiless.future(silent(), timeout=30) for _ in range(6)]  # more than the pool's threads
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        assert stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status == SERVING
        wait_for(lambda: all(call.done() for call in held), 10, "the calls without a request cut")
        assert {call.code() for call in held} == {grpc.StatusCode.CANCELLED}
        assert arrivals.cut >= 6
    finally:
        never.set()
        channel.close()


def test_the_asyncio_guard_caps_watches_answers_a_refused_one_after_a_wait_and_ends_idle_ones(monkeypatch):
    # Refused at once, a peer renewing its watches made the manager refuse ~180 a second.
    monkeypatch.setattr("kspeed.control.streams.REFUSAL_DELAY_S", 0.5)

    async def scenario() -> tuple[list, grpc.StatusCode, float]:
        guard = AioStreamGuard(4, 2, 1.0, watches=4)
        server = grpc.aio.server(interceptors=[guard])
        health_pb2_grpc.add_HealthServicer_to_server(AioHealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            first = stub.Watch(health_pb2.HealthCheckRequest())
            statuses = [(await first.read()).status]
            began = asyncio.get_running_loop().time()
            with pytest.raises(grpc.aio.AioRpcError) as refused:  # one per address (a quarter of 4)
                await stub.Watch(health_pb2.HealthCheckRequest()).read()
            waited = asyncio.get_running_loop().time() - began
            assert await first.read() is grpc.aio.EOF  # ended when idle, status OK
            return statuses, refused.value.code(), waited
        finally:
            await channel.close()
            await server.stop(0)
            await guard.close()

    statuses, refused, waited = asyncio.run(scenario())
    assert statuses == [SERVING]
    assert refused == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert waited >= 0.5  # answered once the wait was over, not before


def test_refusals_are_counted_and_logged_at_the_1st_10th_100th_and_1000th(caplog):
    # An attacker renewing refused watches every 0.2 s made 176 WARNING lines a second.
    from kspeed.control.streams import _Admission

    admission = _Admission(limit=4, per_peer=4, watches=4, idle_s=60)
    assert not isinstance(admission.admit("ipv4:10.0.0.1", "/grpc.health.v1.Health/Watch"), str)
    with caplog.at_level("DEBUG", logger="kspeed.control.streams"):
        for _ in range(1000):
            refusal = admission.admit("ipv4:10.0.0.1", "/grpc.health.v1.Health/Watch")
            assert isinstance(refusal, str) and "at most 4 (1 per caller)" in refusal
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert [m.rsplit("; ", 1)[1] for m in warned] == [f"{n} refused so far)" for n in (1, 10, 100, 1000)]
    assert admission.refused == 1000 and len(caplog.records) == 1000
