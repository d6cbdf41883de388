"""The manager's calls to servers (asyncio channels, one per server address, reused).

Every call has a deadline and ends in a reply or an error of :mod:`kspeed.errors`. A channel is
closed only once no call is using it: closing one under a call in flight cancels that call, and a
bare cancellation escaping an allocation would skip its rollback.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from kspeed.config import SecurityConfig
from kspeed.control import rpc
from kspeed.errors import UnavailableError
from kspeed.proto import kspeed_pb2_grpc

HEALTH_CHECK = "/grpc.health.v1.Health/Check"


class ServerCalls:
    """Calls from the manager to servers, with the cluster's credentials and a deadline."""

    def __init__(self, security: SecurityConfig, timeout: float) -> None:
        self._security = security
        self._metadata = rpc.call_metadata(security)
        self._timeout = timeout
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._busy: collections.Counter[str] = collections.Counter()  # calls in flight per address
        self._closing: set[str] = set()  # addresses to close once their calls end

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = rpc.open_channel(address, self._security, aio=True)
        return channel

    async def call(self, address: str, server_id: str, method: str, request: Any, timeout: float | None = None) -> Any:
        """One unary call of ``kspeed.v1.Server`` with errors mapped to :mod:`kspeed.errors`.

        Raises:
            KSpeedError: the server's answer, mapped; UnavailableError when the call was cut short
                without the caller being cancelled.
        """
        stub = kspeed_pb2_grpc.ServerStub(self._channel(address))
        self._busy[address] += 1
        try:
            return await getattr(stub, method)(request, timeout=timeout or self._timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            raise rpc.error_from_rpc(exc, f"server {server_id} at {address}") from exc
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if task is None or getattr(task, "cancelling", lambda: 1)():  # (Python 3.10 cannot tell: unwind)
                raise  # the caller is being cancelled: let it unwind
            raise UnavailableError(
                f"server {server_id} at {address}: {method} was cut short (its channel closed)"
            ) from exc
        finally:
            await self._done(address)

    async def _done(self, address: str) -> None:
        self._busy[address] -= 1
        if self._busy[address] <= 0:
            del self._busy[address]
            if address in self._closing:
                self._closing.discard(address)
                channel = self._channels.pop(address, None)
                if channel is not None:
                    await channel.close()

    async def probe(self, address: str, timeout: float) -> tuple[bool, str]:
        """``grpc.health.v1`` check: (serving, detail)."""
        check = self._channel(address).unary_unary(
            HEALTH_CHECK,
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )
        self._busy[address] += 1
        try:
            reply = await check(health_pb2.HealthCheckRequest(), timeout=timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            return False, f"{exc.code().name.lower()}: {exc.details()}"
        finally:
            await self._done(address)
        if reply.status == health_pb2.HealthCheckResponse.SERVING:
            return True, ""
        return False, health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status).lower()

    async def forget(self, keep: set[str]) -> None:
        """Close the channels of addresses not in ``keep`` (a channel in use once its calls end)."""
        self._closing -= keep
        for address in set(self._channels) - keep:
            if self._busy[address]:
                self._closing.add(address)
            else:
                await self._channels.pop(address).close()

    async def close(self) -> None:
        """Close every channel (the manager is stopping: calls still in flight are cut)."""
        self._closing.clear()
        for address in list(self._channels):
            await self._channels.pop(address).close()
