"""The manager's calls to servers: a channel closed under a call in flight never cuts it short, and
a call that is cut short anyway is an error of the tree, not a bare cancellation (an in-process gRPC
server on loopback stands in for a server; no daemon)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kspeed.config import SecurityConfig
from kspeed.errors import CapacityError, UnavailableError
from kspeed.manager.calls import ServerCalls
from kspeed.manager.datasets import DatasetCatalog
from kspeed.manager.membership import Membership, Timers
from kspeed.manager.store import Store
from kspeed.proto import kspeed_pb2, kspeed_pb2_grpc
from tests.manager.fakes import listing, ready


class SlowServer(kspeed_pb2_grpc.ServerServicer):
    """Answers AssignShare once ``release`` is set (a server listing a slow backend)."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.release = asyncio.Event()

    async def AssignShare(self, request, context):
        self.started.set()
        await self.release.wait()
        return kspeed_pb2.ShareStatus(dataset=request.spec.name)


async def serving(servicer) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    kspeed_pb2_grpc.add_ServerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def assign() -> kspeed_pb2.AssignShareRequest:
    return kspeed_pb2.AssignShareRequest(spec=kspeed_pb2.DatasetSpec(name="ds"))


def test_forgetting_a_server_while_a_call_to_it_is_in_flight_lets_the_call_finish():
    async def run() -> None:
        servicer = SlowServer()
        server, address = await serving(servicer)
        calls = ServerCalls(SecurityConfig(auth="none"), timeout=10.0)
        try:
            call = asyncio.create_task(calls.call(address, "s1", "AssignShare", assign()))
            await servicer.started.wait()
            await calls.forget(set())  # the prober no longer lists it (declared failed meanwhile)
            servicer.release.set()
            reply = await call
            assert reply.dataset == "ds"
            assert address not in calls._channels  # closed once its call ended
        finally:
            await calls.close()
            await server.stop(None)

    asyncio.run(run())


def test_a_call_cut_short_by_a_closing_channel_is_unavailable_not_a_cancellation():
    async def run() -> None:
        servicer = SlowServer()
        server, address = await serving(servicer)
        calls = ServerCalls(SecurityConfig(auth="none"), timeout=10.0)
        try:
            call = asyncio.create_task(calls.call(address, "s1", "AssignShare", assign()))
            await servicer.started.wait()
            await calls.close()  # the manager stops: channels close under their calls
            with pytest.raises(UnavailableError, match=r"server s1 at .*: AssignShare was cut short"):
                await call
        finally:
            await server.stop(None)

    asyncio.run(run())


def test_a_caller_cancelled_mid_call_is_cancelled():
    async def run() -> None:
        servicer = SlowServer()
        server, address = await serving(servicer)
        calls = ServerCalls(SecurityConfig(auth="none"), timeout=10.0)
        try:
            call = asyncio.create_task(calls.call(address, "s1", "AssignShare", assign()))
            await servicer.started.wait()
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
        finally:
            await calls.close()
            await server.stop(None)

    asyncio.run(run())


class HangingAssign:
    """Server calls where the listing answers at once and AssignShare hangs on ``hang`` until cancelled."""

    def __init__(self, hang: str) -> None:
        self.hang = hang
        self.log: list[tuple[str, str]] = []
        self.hanging = asyncio.Event()

    async def call(self, address, server_id, method, request, timeout=None):
        self.log.append((server_id, method))
        if method == "DescribeDataset":
            return listing()
        if method == "AssignShare" and server_id == self.hang:
            self.hanging.set()
            await asyncio.Event().wait()
        return kspeed_pb2.ShareStatus()


def test_a_registration_given_up_mid_assignment_is_undone_on_every_server(tmp_path):
    store = Store(str(tmp_path))
    membership = Membership(store, Timers(1.0, 3.0, 10.0))
    ready(membership, "a", "b")  # one region each besides the window: one share of the dataset each
    calls = HangingAssign(hang="b")
    catalog = DatasetCatalog(store, membership, calls, lease_ttl=60.0)
    spec = kspeed_pb2.DatasetSpec(name="ds", uri="/data/ds")

    async def run() -> None:
        create = asyncio.create_task(catalog.create(kspeed_pb2.CreateDatasetRequest(spec=spec)))
        await calls.hanging.wait()
        create.cancel()  # the client gave up (its deadline passed)
        with pytest.raises(asyncio.CancelledError):
            await create

    asyncio.run(run())
    assert ("a", "AssignShare") in calls.log and ("b", "AssignShare") in calls.log
    dropped = [sid for sid, method in calls.log if method == "DropDataset"]
    assert sorted(dropped) == ["a", "b"]  # b too: it may have taken it as the call was cut
    assert catalog.datasets() == [] and list(store.datasets()) == []


class RefusingAssign(HangingAssign):
    """As :class:`HangingAssign`, and ``refuse``'s AssignShare fails at once."""

    def __init__(self, hang: str, refuse: str) -> None:
        super().__init__(hang)
        self.refuse = refuse

    async def call(self, address, server_id, method, request, timeout=None):
        if method == "AssignShare" and server_id == self.refuse:
            self.log.append((server_id, method))
            await self.hanging.wait()  # the other server is busy listing
            raise CapacityError(f"server {server_id}: no free regions")
        return await super().call(address, server_id, method, request, timeout)


def test_one_server_refusing_ends_the_registration_without_waiting_for_the_others(tmp_path):
    store = Store(str(tmp_path))
    membership = Membership(store, Timers(1.0, 3.0, 10.0))
    ready(membership, "a", "b")  # one region each besides the window: one share of the dataset each
    calls = RefusingAssign(hang="a", refuse="b")
    catalog = DatasetCatalog(store, membership, calls, lease_ttl=60.0)
    spec = kspeed_pb2.DatasetSpec(name="ds", uri="/data/ds")

    async def run() -> None:
        # a's listing never ends; b's refusal must still come back (the assignments run at once)
        await asyncio.wait_for(catalog.create(kspeed_pb2.CreateDatasetRequest(spec=spec)), timeout=5)

    with pytest.raises(CapacityError, match="server b: no free regions"):
        asyncio.run(run())
    assert sorted(sid for sid, method in calls.log if method == "DropDataset") == ["a", "b"]
    assert catalog.datasets() == []
