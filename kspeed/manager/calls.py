"""The manager's calls to servers (asyncio channels, one per server address, reused)."""

from __future__ import annotations

from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from kspeed.config import SecurityConfig
from kspeed.control import rpc
from kspeed.proto import kspeed_pb2_grpc

HEALTH_CHECK = "/grpc.health.v1.Health/Check"


class ServerCalls:
    """Calls from the manager to servers, with the cluster's credentials and a deadline."""

    def __init__(self, security: SecurityConfig, timeout: float) -> None:
        self._security = security
        self._metadata = rpc.call_metadata(security)
        self._timeout = timeout
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = rpc.open_channel(address, self._security, aio=True)
        return channel

    async def call(self, address: str, server_id: str, method: str, request: Any, timeout: float | None = None) -> Any:
        """One unary call of ``kspeed.v1.Server`` with errors mapped to :mod:`kspeed.errors`."""
        stub = kspeed_pb2_grpc.ServerStub(self._channel(address))
        try:
            return await getattr(stub, method)(request, timeout=timeout or self._timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            raise rpc.error_from_rpc(exc, f"server {server_id} at {address}") from exc

    async def probe(self, address: str, timeout: float) -> tuple[bool, str]:
        """``grpc.health.v1`` check: (serving, detail)."""
        check = self._channel(address).unary_unary(
            HEALTH_CHECK,
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )
        try:
            reply = await check(health_pb2.HealthCheckRequest(), timeout=timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            return False, f"{exc.code().name.lower()}: {exc.details()}"
        if reply.status == health_pb2.HealthCheckResponse.SERVING:
            return True, ""
        return False, health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status).lower()

    async def forget(self, keep: set[str]) -> None:
        """Close the channels of addresses not in ``keep``."""
        for address in set(self._channels) - keep:
            await self._channels.pop(address).close()

    async def close(self) -> None:
        """Close every channel."""
        await self.forget(set())
