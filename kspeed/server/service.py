"""The ``kspeed.v1.Server`` gRPC service (sync server: a few long calls, many threads of I/O)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import grpc
import numpy as np

from kspeed import wire
from kspeed._version import PROTOCOL_VERSIONS, __version__
from kspeed.config import format_bytes
from kspeed.control import rpc
from kspeed.errors import CapacityError, NotFoundError, ProtocolError
from kspeed.proto import kspeed_pb2
from kspeed.server.feeder.supervisor import MAX_PLAN, FeederSupervisor, PlanOffer
from kspeed.server.hosting.datasets import DatasetHost, decode_ids
from kspeed.server.positions import Positions

MAX_LOOKUP_CHUNK = 1 << 20  # IDs per Lookup call
MAX_READ_IDS = 1 << 16  # IDs per Read call
MAX_READ_BYTES = 64 << 20  # bytes per Read reply (the channels' message limit)


class ServerService:
    """Implements every RPC of ``kspeed.v1.Server`` over a :class:`DatasetHost`."""

    def __init__(
        self,
        server_id: str,
        manager_address: str,
        host: DatasetHost,
        feeders: FeederSupervisor,
        inventory: Callable[[], kspeed_pb2.ServerInventory],
        registration: Callable[[], tuple[bool, int]],
        *,
        max_plan_bytes: int,
        prep_figures: Callable[[str], kspeed_pb2.PrepFigures | None] = lambda job: None,
        production_figures: Callable[[str], kspeed_pb2.ProductionFigures | None] = lambda dataset: None,
        positions: Positions | None = None,
    ) -> None:
        self._id = server_id
        self._max_plan_bytes = max_plan_bytes
        self._feeders = feeders
        self._manager = manager_address
        self._host = host
        self._inventory = inventory
        self._registration = registration
        self._prep_figures = prep_figures
        self._production_figures = production_figures
        self._positions = positions if positions is not None else Positions()

    def GetInfo(self, request: kspeed_pb2.GetInfoRequest, context: grpc.ServicerContext) -> kspeed_pb2.ServerInfo:
        registered, incarnation = self._registration()
        return kspeed_pb2.ServerInfo(
            id=self._id,
            inventory=self._inventory(),
            software_version=__version__,
            protocol_versions=PROTOCOL_VERSIONS,
            manager_address=self._manager,
            registered=registered,
            incarnation=incarnation,
            prep=self._prep_figures(request.job),
            production=self._production_figures(request.dataset) if request.dataset else None,
        )

    def DescribeDataset(
        self, request: kspeed_pb2.DatasetSpec, context: grpc.ServicerContext
    ) -> kspeed_pb2.DescribeDatasetReply:
        return self._host.describe(request)

    def AssignShare(
        self, request: kspeed_pb2.AssignShareRequest, context: grpc.ServicerContext
    ) -> kspeed_pb2.ShareStatus:
        return self._host.assign(request)

    def StartPreload(self, request: kspeed_pb2.DatasetRequest, context: grpc.ServicerContext) -> kspeed_pb2.ShareStatus:
        return self._host.start_preload(request.name, request.first_id if request.HasField("first_id") else None)

    def DropDataset(
        self, request: kspeed_pb2.DatasetRequest, context: grpc.ServicerContext
    ) -> kspeed_pb2.DropDatasetReply:
        # Closes the share's feeds first (DatasetHost.on_drop): their clients are told why, or, when
        # only one share of it goes (served elsewhere now), their connections are cut.
        if request.HasField("first_id"):
            self._host.get(request.name, request.first_id)
            self._host.drop(request.name, final=False, first=request.first_id)
        else:
            self._host.drop(request.name, f"dataset {request.name!r} was removed from the cluster (kspeed dataset rm)")
        return kspeed_pb2.DropDatasetReply()

    def CheckShare(
        self, request: kspeed_pb2.CheckShareRequest, context: grpc.ServicerContext
    ) -> kspeed_pb2.ShareStatus:
        return self._host.check(request.name, int(request.limit), attach=request.attach)

    def FetchListing(
        self, request: kspeed_pb2.FetchListingRequest, context: grpc.ServicerContext
    ) -> Iterator[kspeed_pb2.ListingChunk]:
        if self._host.listings is None:
            raise NotFoundError("this server keeps no listings")
        return self._host.listings.chunks(request.listing_id)

    def Lookup(self, request: kspeed_pb2.LookupRequest, context: grpc.ServicerContext) -> kspeed_pb2.LookupReply:
        if not request.dataset:
            raise ProtocolError("Lookup: the request must name the dataset")
        if len(request.ids) > 8 * MAX_LOOKUP_CHUNK:
            raise ProtocolError(f"Lookup: {len(request.ids) // 8} IDs exceed {MAX_LOOKUP_CHUNK} per call")
        first = request.first_id if request.HasField("first_id") else None
        if first is not None:
            self._host.get(request.dataset, first)  # a share that moved away: NotHeldError, whatever the IDs
        ids = decode_ids(request.ids, request.dataset, self._host.count(request.dataset))
        return self._host.lookup(request.dataset, ids, first)

    def Read(self, request: kspeed_pb2.ReadRequest, context: grpc.ServicerContext) -> kspeed_pb2.ReadReply:
        if len(request.ids) > 8 * MAX_READ_IDS:
            raise ProtocolError(f"Read: {len(request.ids) // 8} IDs exceed {MAX_READ_IDS} per call")
        ids = decode_ids(request.ids, request.dataset, self._host.count(request.dataset))
        nbytes = self._host.nbytes(request.dataset, ids)
        if nbytes > MAX_READ_BYTES:
            raise ProtocolError(
                f"Read: {len(ids)} samples of dataset {request.dataset!r} hold {nbytes} bytes, more "
                f"than {MAX_READ_BYTES} per call; ask for fewer samples per call"
            )
        return self._host.read(request.dataset, ids)

    def OpenFeed(self, request: kspeed_pb2.OpenFeedRequest, context: grpc.ServicerContext) -> kspeed_pb2.OpenFeedReply:
        reply = self._feeders.open(request, rpc.caller_addresses(context.peer()))
        reply.server_id = self._id
        return reply

    def CommitPlan(self, request: kspeed_pb2.PlanChunk, context: grpc.ServicerContext) -> kspeed_pb2.PlanReply:
        return self._commit([request])

    def StreamPlan(
        self, requests: Iterator[kspeed_pb2.PlanChunk], context: grpc.ServicerContext
    ) -> kspeed_pb2.PlanReply:
        return self._commit(requests)

    def _commit(self, requests: Iterable[kspeed_pb2.PlanChunk]) -> kspeed_pb2.PlanReply:
        """Install the plan part of ``requests`` (one message, or the chunks of a stream).

        Each chunk is checked as it arrives, before it is kept: the first must name an open feed
        and a plan of at most :data:`MAX_PLAN` samples, and the chunks together may hold no more
        IDs than that plan and no more than ``max_plan_bytes``. A stream that breaks a rule is
        refused at once, whatever follows it, so a call's memory is bounded.
        """
        head = None
        dataset = ""
        taken = kept = 0  # IDs and bytes of the chunks so far
        ids, lengths, positions, offsets, remote = [], [], [], [], []
        for chunk in requests:
            if head is None:
                if not chunk.feed_id:
                    raise ProtocolError("CommitPlan: the first chunk must name the feed")
                dataset = self._feeders.dataset_of(chunk.feed_id)  # NotFoundError: nothing was kept
                if chunk.count > MAX_PLAN:
                    raise ProtocolError(f"CommitPlan: a plan of {chunk.count} samples exceeds {MAX_PLAN}")
                head = chunk
            count = len(chunk.ids) // 8
            taken += count
            kept += len(chunk.ids) + len(chunk.lengths) + len(chunk.positions) + len(chunk.offsets) + len(chunk.remote)
            if taken > head.count:
                raise ProtocolError(
                    f"CommitPlan: the chunks hold {taken} IDs or more, beyond the plan's {head.count} samples"
                )
            if kept > self._max_plan_bytes:
                raise CapacityError(
                    f"CommitPlan: plan part of feed {head.feed_id} exceeds {format_bytes(self._max_plan_bytes)} "
                    f"(server.max_plan_bytes, about 24 bytes a sample): raise it on the servers, or spread the "
                    "dataset over more servers"
                )
            if (
                len(chunk.ids) % 8
                or len(chunk.lengths) != 4 * count
                or len(chunk.positions) != 4 * count
                or len(chunk.offsets) != 8 * count
            ):
                raise ProtocolError(
                    "CommitPlan: each chunk needs int64 ids and as many uint32 lengths, uint32 positions "
                    "and int64 offsets"
                )
            if chunk.remote and len(chunk.remote) != (count + 7) // 8:
                raise ProtocolError(f"CommitPlan: a chunk of {count} IDs needs {(count + 7) // 8} bytes of remote bits")
            ids.append(chunk.ids)
            lengths.append(chunk.lengths)
            positions.append(chunk.positions)
            offsets.append(chunk.offsets)
            bits = np.frombuffer(chunk.remote, dtype=np.uint8)
            remote.append(np.unpackbits(bits, count=count).astype(bool) if len(bits) else np.zeros(count, bool))
        if head is None:
            raise ProtocolError("CommitPlan: the first chunk must name the feed")
        processed = np.concatenate(remote) if remote else np.zeros(0, bool)
        plan = PlanOffer(
            count=int(head.count),
            positions=wire.unpack_u32(b"".join(positions), "CommitPlan: positions"),
            ids=decode_ids(b"".join(ids), dataset, self._host.count(dataset)),
            lengths=wire.unpack_u32(b"".join(lengths), "CommitPlan: lengths"),
            offsets=wire.unpack_i64(b"".join(offsets), "CommitPlan: offsets"),
            processed=processed if processed.any() else None,
        )
        return self._feeders.commit_plan(
            head.feed_id,
            head.epoch,
            head.batch_size,
            plan,
            server_stages=head.server_stages,
            seed=head.seed,
            seed_epoch=head.seed_epoch,
            skip_failed=head.skip_failed,
            first_batch=head.first_batch,
        )

    def CloseFeed(
        self, request: kspeed_pb2.CloseFeedRequest, context: grpc.ServicerContext
    ) -> kspeed_pb2.CloseFeedReply:
        self._feeders.close(request.feed_id)
        return kspeed_pb2.CloseFeedReply()

    def KeepPosition(self, request: kspeed_pb2.Position, context: grpc.ServicerContext) -> kspeed_pb2.KeepPositionReply:
        self._positions.keep(request)
        return kspeed_pb2.KeepPositionReply()

    def GetPositions(
        self, request: kspeed_pb2.PositionsRequest, context: grpc.ServicerContext
    ) -> kspeed_pb2.PositionsReply:
        return kspeed_pb2.PositionsReply(positions=self._positions.of(request.dataset, request.job))
