"""The ``kspeed.v1.Manager`` gRPC service (asyncio: watch streams hold no thread each)."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from kspeed import names
from kspeed._version import __version__
from kspeed.control.rpc import negotiate
from kspeed.errors import ConflictError, ProtocolError
from kspeed.manager.datasets import DatasetCatalog
from kspeed.manager.jobs import JobBoard
from kspeed.manager.membership import DRAINING, Membership
from kspeed.manager.store import Store
from kspeed.manager.tunings import TuningBoard
from kspeed.proto import kspeed_pb2
from kspeed.rdma.rails import rail_names

log = logging.getLogger(__name__)

_ADDRESS = re.compile(r"[A-Za-z0-9._:\[\]-]{1,253}:\d{1,5}")
_MAX_NICS = 64
_MAX_TEXT = 256
WATCH_QUEUE = 1024  # events buffered per watcher before it is resent a snapshot


def validate_registration(request: kspeed_pb2.RegisterServerRequest) -> None:
    """Check a registration's fields.

    Raises:
        ProtocolError: naming the field and the value.
    """
    names.SERVER_ID.check(request.id)
    for name in ("address", "http_address"):
        value = getattr(request, name)
        if not _ADDRESS.fullmatch(value) or not 0 < int(value.rpartition(":")[2]) < 65536:
            raise ProtocolError(f"{name} {value[:80]!r} is not host:port")
    inv = request.inventory
    if len(inv.hostname) > _MAX_TEXT or len(inv.nics) > _MAX_NICS:
        raise ProtocolError(f"inventory too large (hostname {len(inv.hostname)} chars, {len(inv.nics)} NICs)")
    unknown = set(inv.transports) - set(rail_names())
    if unknown:
        raise ProtocolError(f"unknown transport(s) {sorted(unknown)}; known: {rail_names()}")
    if inv.region_size == 0 or inv.memory_bytes < inv.region_size:
        raise ProtocolError(
            f"inventory: memory_bytes {inv.memory_bytes} must hold at least one region of {inv.region_size} bytes"
        )


class ManagerService:
    """Implements every RPC of ``kspeed.v1.Manager`` over a :class:`Membership`."""

    def __init__(
        self,
        membership: Membership,
        catalog: DatasetCatalog,
        store: Store,
        heartbeat_interval: float,
        probe: Callable[[str], Awaitable[tuple[bool, str]]] | None = None,
    ) -> None:
        self._membership = membership
        self._probe = probe
        self._catalog = catalog
        self.jobs = JobBoard()
        self.tunings = TuningBoard(catalog, membership, store)
        self._store = store
        self._heartbeat_interval = heartbeat_interval
        self._started = time.monotonic()
        self.watchers = 0

    async def Hello(self, request: kspeed_pb2.HelloRequest, context: grpc.aio.ServicerContext) -> kspeed_pb2.HelloReply:
        from kspeed._version import FEATURES

        version = negotiate(request.version.protocol_versions)
        return kspeed_pb2.HelloReply(
            protocol_version=version,
            features=sorted(set(FEATURES) & set(request.version.features)),
            manager_version=__version__,
            cluster_id=self._store.cluster_id,
        )

    async def RegisterServer(
        self, request: kspeed_pb2.RegisterServerRequest, context: grpc.aio.ServicerContext
    ) -> kspeed_pb2.RegisterServerReply:
        validate_registration(request)
        version = negotiate(request.version.protocol_versions)
        self._check_cluster(request)
        record = self._membership.register(request, version)
        self._catalog.forget_progress(request.id)
        self._catalog.adopt(request.id, list(request.holding))
        return kspeed_pb2.RegisterServerReply(
            incarnation=record.incarnation,
            protocol_version=version,
            heartbeat_interval_s=self._heartbeat_interval,
            cluster_id=self._store.cluster_id,
            assignments=self._catalog.assignments_for(request.id),
        )

    def _check_cluster(self, request: kspeed_pb2.RegisterServerRequest) -> None:
        """Take over the cluster id of a server that holds data while the registry's own is
        provisional (its file was missing or empty); refuse a server that holds another cluster's data.

        Raises:
            ConflictError: the server holds data of another cluster (named, with what to do).
        """
        theirs, ours = request.cluster_id, self._store.cluster_id
        if not theirs or theirs == ours or not request.holding:
            return
        if self._store.provisional:
            log.warning(
                "cluster id %s taken over from server %s, which holds %d share(s): this manager's registry (%s) was "
                "empty, so it is rebuilt from what the servers hold",
                theirs,
                request.id,
                len(request.holding),
                self._store.path,
            )
            self._store.take_cluster_id(theirs)
            return
        raise ConflictError(
            f"server {request.id!r} holds {len(request.holding)} share(s) of cluster {theirs}, and this manager runs "
            f"cluster {ours} (registry {self._store.path}); point the server at its own cluster's manager, or discard "
            "its data first with `kspeed server purge` on its host (with the server stopped)"
        )

    async def Heartbeat(
        self, request: kspeed_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> kspeed_pb2.HeartbeatReply:
        record = self._membership.heartbeat(request)
        stale, moved, missing = self._catalog.on_heartbeat(request.id, list(request.shares))
        return kspeed_pb2.HeartbeatReply(
            state=record.state,
            heartbeat_interval_s=self._heartbeat_interval,
            drop_datasets=stale,
            drop_shares=moved,
            assign=missing,
            retire=record.state == DRAINING and not self._catalog.holds(request.id),
            records=self._catalog.records_for(list(request.shares)),
        )

    async def DeregisterServer(
        self, request: kspeed_pb2.DeregisterServerRequest, context: grpc.aio.ServicerContext
    ) -> kspeed_pb2.DeregisterServerReply:
        if len(request.reason) > _MAX_TEXT:
            raise ProtocolError(f"deregistration reason of {len(request.reason)} chars exceeds {_MAX_TEXT}")
        self._membership.deregister(request)
        return kspeed_pb2.DeregisterServerReply()

    async def DrainServer(
        self, request: kspeed_pb2.DrainServerRequest, context: grpc.aio.ServicerContext
    ) -> kspeed_pb2.DrainServerReply:
        names.SERVER_ID.check(request.id)
        self._membership.get(request.id)  # NotFoundError for an unknown one
        shares = self._catalog.plan_drain(request.id, allow_degraded=request.allow_degraded)
        record = self._membership.drain(request.id)
        self._catalog.start_drain(request.id, allow_degraded=request.allow_degraded)
        log.warning("server %s: drain requested; %d share(s) to hand off", request.id, len(shares))
        return kspeed_pb2.DrainServerReply(server=record, shares=shares)

    async def ProbeAddress(
        self, request: kspeed_pb2.ProbeAddressRequest, context: grpc.aio.ServicerContext
    ) -> kspeed_pb2.ProbeAddressReply:
        if not _ADDRESS.fullmatch(request.address) or not 0 < int(request.address.rpartition(":")[2]) < 65536:
            raise ProtocolError(f"address {request.address[:80]!r} is not host:port")
        if self._probe is None:
            return kspeed_pb2.ProbeAddressReply(serving=False, detail="this manager does not probe addresses")
        serving, detail = await self._probe(request.address)
        return kspeed_pb2.ProbeAddressReply(serving=serving, detail=detail)

    async def ListServers(
        self, request: kspeed_pb2.ListServersRequest, context: grpc.aio.ServicerContext
    ) -> kspeed_pb2.ListServersReply:
        return kspeed_pb2.ListServersReply(
            servers=self._membership.snapshot(request.include_left), revision=self._membership.revision
        )

    async def WatchMembership(
        self, request: kspeed_pb2.WatchMembershipRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[kspeed_pb2.MembershipEvent]:
        queue: asyncio.Queue[tuple[kspeed_pb2.ServerRecord, int] | None] = asyncio.Queue(WATCH_QUEUE)

        def on_change(record: kspeed_pb2.ServerRecord, revision: int) -> None:
            try:
                queue.put_nowait((record, revision))
            except asyncio.QueueFull:
                # A slow watcher gets a fresh snapshot instead of an unbounded backlog.
                while not queue.empty():
                    queue.get_nowait()
                queue.put_nowait(None)

        unsubscribe = self._membership.subscribe(on_change)
        self.watchers += 1
        try:
            send_snapshot = request.since_revision == 0 or request.since_revision != self._membership.revision
            while True:
                if send_snapshot:
                    yield kspeed_pb2.MembershipEvent(
                        revision=self._membership.revision,
                        snapshot=True,
                        servers=self._membership.snapshot(include_left=True),
                    )
                    send_snapshot = False
                item = await queue.get()
                if item is None:
                    send_snapshot = True
                    continue
                record, revision = item
                yield kspeed_pb2.MembershipEvent(revision=revision, servers=[record])
        finally:
            self.watchers -= 1
            unsubscribe()

    async def GetStatus(
        self, request: kspeed_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> kspeed_pb2.ClusterStatus:
        return self.status()

    def status(self) -> kspeed_pb2.ClusterStatus:
        """The cluster as one message (also rendered as JSON by /v1/status)."""
        return kspeed_pb2.ClusterStatus(
            cluster_id=self._store.cluster_id,
            manager_version=__version__,
            uptime_s=time.monotonic() - self._started,
            servers=self._membership.snapshot(),
            revision=self._membership.revision,
            datasets=self._catalog.datasets(),
        )

    async def CreateDataset(
        self, request: kspeed_pb2.CreateDatasetRequest, context: grpc.aio.ServicerContext
    ) -> kspeed_pb2.CreateDatasetReply:
        return await self._catalog.create(request)

    async def GetDataset(
        self, request: kspeed_pb2.DatasetRequest, context: grpc.aio.ServicerContext
    ) -> kspeed_pb2.DatasetInfo:
        return self._catalog.get(request.name)

    async def ListDatasets(
        self, request: kspeed_pb2.ListDatasetsRequest, context: grpc.aio.ServicerContext
    ) -> kspeed_pb2.ListDatasetsReply:
        return kspeed_pb2.ListDatasetsReply(datasets=self._catalog.datasets())

    async def RemoveDataset(
        self, request: kspeed_pb2.RemoveDatasetRequest, context: grpc.aio.ServicerContext
    ) -> kspeed_pb2.RemoveDatasetReply:
        await self._catalog.remove(request.name, force=request.force)
        return kspeed_pb2.RemoveDatasetReply()

    async def PreloadDataset(
        self, request: kspeed_pb2.DatasetRequest, context: grpc.aio.ServicerContext
    ) -> kspeed_pb2.DatasetInfo:
        return await self._catalog.preload(request.name)

    async def RenewLease(self, request: kspeed_pb2.LeaseRequest, context: grpc.aio.ServicerContext) -> kspeed_pb2.Lease:
        return self._catalog.renew(request.lease_id)

    async def ReleaseLease(
        self, request: kspeed_pb2.LeaseRequest, context: grpc.aio.ServicerContext
    ) -> kspeed_pb2.ReleaseLeaseReply:
        self._catalog.release(request.lease_id)
        return kspeed_pb2.ReleaseLeaseReply()

    async def ReportStats(
        self, request: kspeed_pb2.RankStats, context: grpc.aio.ServicerContext
    ) -> kspeed_pb2.ReportStatsReply:
        self.jobs.report(request)
        return kspeed_pb2.ReportStatsReply()

    async def GetJobStats(
        self, request: kspeed_pb2.JobRequest, context: grpc.aio.ServicerContext
    ) -> kspeed_pb2.JobStats:
        return self.jobs.job(request.job, history=request.history)

    async def GetTuning(
        self, request: kspeed_pb2.TuningRequest, context: grpc.aio.ServicerContext
    ) -> kspeed_pb2.TuningRecord:
        return self.tunings.get(request)

    async def SaveTuning(
        self, request: kspeed_pb2.TuningRecord, context: grpc.aio.ServicerContext
    ) -> kspeed_pb2.SaveTuningReply:
        self.tunings.save(request)
        return kspeed_pb2.SaveTuningReply()

    async def ListJobs(
        self, request: kspeed_pb2.ListJobsRequest, context: grpc.aio.ServicerContext
    ) -> kspeed_pb2.ListJobsReply:
        return kspeed_pb2.ListJobsReply(jobs=self.jobs.jobs())
