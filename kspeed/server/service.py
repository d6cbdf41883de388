"""The ``kspeed.v1.Server`` gRPC service (sync server: a few long calls, many threads of I/O)."""

from __future__ import annotations

from collections.abc import Callable

import grpc

from kspeed._version import PROTOCOL_VERSIONS, __version__
from kspeed.proto import kspeed_pb2


class ServerService:
    """Implements every RPC of ``kspeed.v1.Server``."""

    def __init__(self, server_id: str, manager_address: str,
                 inventory: Callable[[], kspeed_pb2.ServerInventory], registration: Callable[[], tuple[bool, int]]
                 ) -> None:
        self._id = server_id
        self._manager = manager_address
        self._inventory = inventory
        self._registration = registration

    def GetInfo(self, request: kspeed_pb2.GetInfoRequest, context: grpc.ServicerContext) -> kspeed_pb2.ServerInfo:
        registered, incarnation = self._registration()
        return kspeed_pb2.ServerInfo(id=self._id, inventory=self._inventory(), software_version=__version__,
                                     protocol_versions=PROTOCOL_VERSIONS, manager_address=self._manager,
                                     registered=registered, incarnation=incarnation)
