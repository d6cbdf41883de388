"""A synchronous client of the manager's control plane, shared by the CLI and the client library.

The first call performs the version handshake (``Hello``), so an incompatible manager is reported
with both sides' versions before anything else happens.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

from kspeed.config import ClientConfig
from kspeed.control import rpc
from kspeed.control.membership_watch import MembershipWatch
from kspeed.errors import NotFoundError
from kspeed.proto import kspeed_pb2, kspeed_pb2_grpc


class ManagerClient:
    """Calls to the manager at ``config.manager`` with the configured token, TLS and deadline."""

    def __init__(self, config: ClientConfig, peer_name: str = "kspeed-client") -> None:
        self.config = config
        self.address = config.manager
        self._peer_name = peer_name
        self._metadata = rpc.call_metadata(config.security)
        self._channel = rpc.open_channel(config.manager, config.security)
        self._stub = kspeed_pb2_grpc.ManagerStub(self._channel)
        self.hello: kspeed_pb2.HelloReply | None = None
        self._membership: MembershipWatch | None = None
        self._lock = threading.Lock()

    def call(self, method: str, request: Any, *, timeout: float | None = None) -> Any:
        """One unary call, with errors mapped to :mod:`kspeed.errors`."""
        if self.hello is None and method != "Hello":
            self.handshake()
        with rpc.map_rpc_errors(f"manager at {self.address}"):
            return getattr(self._stub, method)(request, timeout=timeout or self.config.timeout, metadata=self._metadata)

    def handshake(self) -> kspeed_pb2.HelloReply:
        """Agree on a protocol version with the manager.

        Raises:
            VersionMismatchError: naming the versions each side speaks.
        """
        self.hello = self.call("Hello", kspeed_pb2.HelloRequest(version=rpc.peer_version(), peer_name=self._peer_name))
        return self.hello

    def status(self) -> kspeed_pb2.ClusterStatus:
        """The cluster status."""
        return self.call("GetStatus", kspeed_pb2.GetStatusRequest())

    def servers(self, include_left: bool = False) -> list[kspeed_pb2.ServerRecord]:
        """The registered servers."""
        return list(self.call("ListServers", kspeed_pb2.ListServersRequest(include_left=include_left)).servers)

    def watch_membership(
        self, since_revision: int = 0
    ) -> tuple[Iterator[kspeed_pb2.MembershipEvent], Callable[[], Any]]:
        """The manager's membership events from ``since_revision`` on (0: a snapshot first), and a
        function that cancels the stream. Iterating raises :mod:`kspeed.errors` when it breaks."""
        stream = self._stub.WatchMembership(
            kspeed_pb2.WatchMembershipRequest(since_revision=since_revision), metadata=self._metadata
        )

        def events() -> Iterator[kspeed_pb2.MembershipEvent]:
            with rpc.map_rpc_errors(f"manager at {self.address}"):
                yield from stream

        return events(), stream.cancel

    def membership(self) -> MembershipWatch:
        """The membership, followed from the watch stream from the first call on (see
        :mod:`kspeed.control.membership_watch`)."""
        with self._lock:
            if self._membership is None:
                self._membership = MembershipWatch(self.watch_membership)
            return self._membership

    def create_dataset(
        self, spec: kspeed_pb2.DatasetSpec, *, operator: bool = False, holder: str = "", lease_ttl: float = 0.0
    ) -> kspeed_pb2.CreateDatasetReply:
        """Register ``spec`` (or attach to it); a job (``operator=False``) gets a lease."""
        owners = kspeed_pb2.DatasetOwner
        owner = owners.DATASET_OWNER_OPERATOR if operator else owners.DATASET_OWNER_JOB
        request = kspeed_pb2.CreateDatasetRequest(spec=spec, owner=owner, holder=holder, lease_ttl_s=lease_ttl)
        # Listing a large backend takes time: allow the manager's own deadline for server calls.
        return self.call("CreateDataset", request, timeout=max(self.config.timeout, 180.0))

    def dataset(self, name: str) -> kspeed_pb2.DatasetInfo:
        """One dataset with its progress."""
        return self.call("GetDataset", kspeed_pb2.DatasetRequest(name=name))

    def tuning(self, dataset: str, model: str) -> kspeed_pb2.TuningRecord | None:
        """The offload decision kept for ``dataset`` and ``model`` (``None``: none kept)."""
        try:
            return self.call("GetTuning", kspeed_pb2.TuningRequest(dataset=dataset, model=model))
        except NotFoundError:
            return None

    def save_tuning(self, record: kspeed_pb2.TuningRecord) -> None:
        """Keep an offload decision for the next run of the same pipeline, model and servers."""
        self.call("SaveTuning", record)

    def datasets(self) -> list[kspeed_pb2.DatasetInfo]:
        """Every dataset."""
        return list(self.call("ListDatasets", kspeed_pb2.ListDatasetsRequest()).datasets)

    def remove_dataset(self, name: str, *, force: bool = False) -> None:
        """Remove a dataset and free its memory on the servers (refused while jobs hold it, unless ``force``)."""
        request = kspeed_pb2.RemoveDatasetRequest(name=name, force=force)
        self.call("RemoveDataset", request, timeout=max(self.config.timeout, 60.0))

    def preload(self, name: str) -> kspeed_pb2.DatasetInfo:
        """Start (or join) the preload; returns at once."""
        return self.call("PreloadDataset", kspeed_pb2.DatasetRequest(name=name))

    def drain_server(self, server_id: str, *, allow_degraded: bool = False) -> kspeed_pb2.DrainServerReply:
        """Start handing a server's shares to others; it leaves once they are held elsewhere."""
        return self.call("DrainServer", kspeed_pb2.DrainServerRequest(id=server_id, allow_degraded=allow_degraded))

    def renew_lease(self, lease_id: str) -> kspeed_pb2.Lease:
        """Extend a lease by its TTL."""
        return self.call("RenewLease", kspeed_pb2.LeaseRequest(lease_id=lease_id))

    def release_lease(self, lease_id: str) -> None:
        """End a lease now."""
        self.call("ReleaseLease", kspeed_pb2.LeaseRequest(lease_id=lease_id))

    def close(self) -> None:
        """Stop following the membership and close the channel."""
        with self._lock:
            watch, self._membership = self._membership, None
        if watch is not None:
            watch.close()
        self._channel.close()

    def __enter__(self) -> ManagerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
