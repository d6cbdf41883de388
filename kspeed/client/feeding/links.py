"""The client's control-plane calls to one server: broadcast lookup, OpenFeed, CommitPlan, CloseFeed, positions.

Every failure is converted to :mod:`kspeed.errors` naming the server and its address, so "server
s2 at 10.0.0.7:7071 is unreachable" reaches the training script instead of a bare gRPC status.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np

from kspeed import wire
from kspeed.config import ClientConfig
from kspeed.control import rpc
from kspeed.errors import BusyError
from kspeed.proto import kspeed_pb2, kspeed_pb2_grpc

__all__ = ["LOOKUP_CHUNK", "PLAN_CHUNK", "Link", "RemoteSplit", "ServerLink", "ServerPlan"]

LOOKUP_CHUNK = 1 << 16  # IDs per Lookup call (the server accepts up to 1 << 20)
PLAN_CHUNK = 1 << 18  # IDs per PlanChunk (6 MiB per message); a larger plan part is streamed
PLAN_DEADLINE = 120.0  # CommitPlan streams the whole plan; the server returns at once (it produces as it serves)
BUSY_RETRY_S = 30.0  # how long a lookup or plan is tried again while the server has no stream free
KEEP_POSITION_TIMEOUT_S = (
    5.0  # a live position is awaited before each batch: a server that does not answer is passed over
)

T = TypeVar("T")


@dataclass(frozen=True)
class RemoteSplit:
    """What a plan asks the servers to preprocess: the first ``stages`` stages of the dataset's
    pipeline, random ones drawing from ``(seed, epoch, sample, stage)``."""

    stages: int
    seed: int
    epoch: int
    skip: bool = False


@dataclass(frozen=True)
class ServerPlan:
    """The part of an epoch plan one server writes (``PlanChunk`` in ``proto/kspeed.proto``).

    It holds the positions of the server's samples and reads their IDs, lengths and offsets from
    the whole plan's arrays when asked (:meth:`part`, a chunk at a time as it is sent): while a
    plan is committed to every server at once, the parts cost their positions, not a copy of the plan.

    Attributes:
        feed_epoch: the pass number of the plan.
        batch_size: samples per batch.
        count: the whole plan's length (batch ``b`` is positions ``b*batch_size`` on).
        positions: the plan positions of this server's samples, increasing.
        plan_ids: the whole plan's sample IDs, by position.
        plan_lengths: its lengths in the ring, by position.
        plan_offsets: its byte offsets within their batch, by position.
        plan_remote: by position, whether the servers preprocess it (``None``: none are).
        split: the server stages for the remote samples (``None``: no sample is preprocessed there).
        first_batch: the batches before it were delivered already.
        epoch: the user's epoch (the sampler's; servers keep their figures by it).
    """

    feed_epoch: int
    batch_size: int
    count: int
    positions: np.ndarray
    plan_ids: np.ndarray
    plan_lengths: np.ndarray
    plan_offsets: np.ndarray
    plan_remote: np.ndarray | None = None
    split: RemoteSplit | None = None
    first_batch: int = 0
    epoch: int = 0

    def __len__(self) -> int:
        return len(self.positions)

    def part(self, lo: int = 0, hi: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        """IDs, lengths, offsets and remote flags (``None`` without a split) of this server's
        samples ``lo..hi-1``."""
        at = self.positions[lo:hi]
        remote = self.plan_remote[at] if self.plan_remote is not None and self.split is not None else None
        return self.plan_ids[at], self.plan_lengths[at], self.plan_offsets[at], remote

    @property
    def ids(self) -> np.ndarray:
        """This server's sample IDs."""
        return self.part()[0]

    @property
    def lengths(self) -> np.ndarray:
        """Their lengths in the ring."""
        return self.part()[1]

    @property
    def offsets(self) -> np.ndarray:
        """Their byte offsets within their batch."""
        return self.part()[2]

    @property
    def remote(self) -> np.ndarray | None:
        """Per sample, whether the server preprocesses it (``None``: none are)."""
        return self.part()[3]


class Link(Protocol):
    """What a feed needs of one server: :class:`ServerLink`, or a test double."""

    server_id: str
    address: str
    first_id: int | None  # the share of the dataset it serves (its first sample); None: the server's only one
    end_id: int | None  # the end of that share's IDs; None: unknown (every ID is looked up there)

    @property
    def name(self) -> str: ...

    def lookup(self, dataset: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...

    def open_feed(self, request: kspeed_pb2.OpenFeedRequest) -> kspeed_pb2.OpenFeedReply: ...

    def commit_plan(self, feed_id: str, plan: ServerPlan) -> kspeed_pb2.PlanReply: ...

    def close_feed(self, feed_id: str) -> None: ...

    def keep_position(self, position: kspeed_pb2.Position) -> Callable[[], None]: ...

    def positions(self, dataset: str, job: str) -> list[kspeed_pb2.Position]: ...

    def prep_figures(self, job: str = "") -> kspeed_pb2.PrepFigures | None: ...

    def production_figures(self, dataset: str) -> kspeed_pb2.ProductionFigures | None: ...

    def close(self) -> None: ...


class ServerLink:
    """A channel to one server of a dataset.

    Args:
        server_id: the server's id in the cluster.
        address: its gRPC ``host:port``.
        config: credentials and deadlines.
        first_id: the share of the dataset this link serves (its first sample ID): lookups and
            the feed ask for it (a server may hold several shares of a dataset after a failover).
        end_id: the end of the share's IDs: a plan's lookup sends this server only the IDs in
            ``[first_id, end_id)``.
    """

    def __init__(
        self,
        server_id: str,
        address: str,
        config: ClientConfig,
        *,
        first_id: int | None = None,
        end_id: int | None = None,
    ) -> None:
        self.server_id = server_id
        self.address = address
        self.first_id = first_id
        self.end_id = end_id
        self._timeout = config.timeout
        self._metadata = rpc.call_metadata(config.security)
        self._channel = rpc.open_channel(address, config.security)
        self._stub = kspeed_pb2_grpc.ServerStub(self._channel)

    @property
    def name(self) -> str:
        """``server <id> at <address>``, for messages."""
        return f"server {self.server_id} at {self.address}"

    def lookup(self, dataset: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Which of ``ids`` this server owns: ``(positions, lengths, labels)`` (labels empty without labels).

        Raises:
            NotHeldError: the server no longer holds this link's share (the manager moved it).
            NotFoundError: the server does not host the dataset or an ID does not exist.
            UnavailableError: the server is unreachable.
        """
        deadline = max(self._timeout, 60.0)

        def call(start: int) -> kspeed_pb2.LookupReply:
            request = kspeed_pb2.LookupRequest(dataset=dataset, ids=wire.pack_i64(ids[start : start + LOOKUP_CHUNK]))
            if self.first_id is not None:
                request.first_id = self.first_id
            with rpc.map_rpc_errors(self.name):
                return self._stub.Lookup(request, timeout=deadline, metadata=self._metadata)

        positions, lengths, labels = [], [], []
        for start in range(0, len(ids), LOOKUP_CHUNK):
            reply = call(start)
            positions.append(wire.unpack_u32(reply.positions, f"{self.name}: lookup positions") + start)
            lengths.append(wire.unpack_u32(reply.lengths, f"{self.name}: lookup lengths"))
            labels.append(wire.unpack_i64(reply.labels, f"{self.name}: lookup labels"))
        if not positions:
            return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
        return np.concatenate(positions), np.concatenate(lengths), np.concatenate(labels).astype(np.int64)

    def open_feed(self, request: kspeed_pb2.OpenFeedRequest) -> kspeed_pb2.OpenFeedReply:
        """Ask the server to connect a feeder to our ring (docs/feeding.md, step 2)."""
        if self.first_id is not None:
            request.first_id = self.first_id
        with rpc.map_rpc_errors(self.name):
            return self._stub.OpenFeed(request, timeout=max(self._timeout, 30.0), metadata=self._metadata)

    def commit_plan(self, feed_id: str, plan: ServerPlan) -> kspeed_pb2.PlanReply:
        """Hand over this server's part of an epoch plan; returns at once."""

        def chunks() -> Iterator[kspeed_pb2.PlanChunk]:
            for start in range(0, max(len(plan), 1), PLAN_CHUNK):
                ids, lengths, offsets, remote = plan.part(start, start + PLAN_CHUNK)
                chunk = kspeed_pb2.PlanChunk(
                    ids=wire.pack_i64(ids),
                    lengths=wire.pack_u32(lengths),
                    positions=wire.pack_u32(plan.positions[start : start + PLAN_CHUNK]),
                    offsets=wire.pack_i64(offsets),
                )
                if remote is not None:
                    chunk.remote = np.packbits(remote).tobytes()
                if start == 0:
                    chunk.feed_id, chunk.epoch, chunk.batch_size = feed_id, plan.feed_epoch, plan.batch_size
                    chunk.count, chunk.first_batch, chunk.seed_epoch = plan.count, plan.first_batch, plan.epoch
                    if plan.split is not None:
                        split = plan.split
                        chunk.server_stages, chunk.seed, chunk.seed_epoch = split.stages, split.seed, split.epoch
                        chunk.skip_failed = split.skip
                yield chunk

        def call() -> kspeed_pb2.PlanReply:
            with rpc.map_rpc_errors(self.name):
                if len(plan) <= PLAN_CHUNK:  # one message: a unary call, no stream slot held
                    return self._stub.CommitPlan(next(chunks()), timeout=PLAN_DEADLINE, metadata=self._metadata)
                return self._stub.StreamPlan(chunks(), timeout=PLAN_DEADLINE, metadata=self._metadata)

        return _when_not_busy(call)

    def close_feed(self, feed_id: str) -> None:
        """Tell the server the feed is over."""
        with rpc.map_rpc_errors(self.name):
            self._stub.CloseFeed(
                kspeed_pb2.CloseFeedRequest(feed_id=feed_id), timeout=self._timeout, metadata=self._metadata
            )

    def keep_position(self, position: kspeed_pb2.Position) -> Callable[[], None]:
        """Have the server keep a rank's position for a live resume (docs/resume.md): the call is
        started, and the function returned waits for its answer (several servers' at once).

        Raises (the function returned):
            UnavailableError: the server is unreachable.
        """
        call = self._stub.KeepPosition.future(
            position, timeout=min(self._timeout, KEEP_POSITION_TIMEOUT_S), metadata=self._metadata
        )

        def answered() -> None:
            with rpc.map_rpc_errors(self.name):
                call.result()

        return answered

    def positions(self, dataset: str, job: str) -> list[kspeed_pb2.Position]:
        """The positions the server keeps of ``job``'s ranks on ``dataset``.

        Raises:
            UnavailableError: the server is unreachable.
        """
        with rpc.map_rpc_errors(self.name):
            reply = self._stub.GetPositions(
                kspeed_pb2.PositionsRequest(dataset=dataset, job=job), timeout=self._timeout, metadata=self._metadata
            )
        return list(reply.positions)

    def prep_figures(self, job: str = "") -> kspeed_pb2.PrepFigures | None:
        """The server's preprocessing workers' counters (``None``: it does not report them), with
        ``job``'s samples among them.

        Raises:
            UnavailableError: the server is unreachable.
        """
        with rpc.map_rpc_errors(self.name):
            info = self._stub.GetInfo(
                kspeed_pb2.GetInfoRequest(job=job), timeout=self._timeout, metadata=self._metadata
            )
        return info.prep if info.HasField("prep") else None

    def production_figures(self, dataset: str) -> kspeed_pb2.ProductionFigures | None:
        """What producing ``dataset``'s samples took on the server (``None``: it does not say).

        Raises:
            UnavailableError: the server is unreachable.
        """
        with rpc.map_rpc_errors(self.name):
            info = self._stub.GetInfo(
                kspeed_pb2.GetInfoRequest(dataset=dataset), timeout=self._timeout, metadata=self._metadata
            )
        return info.production if info.HasField("production") else None

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()


def _when_not_busy(call: Callable[[], T]) -> T:
    """``call()``, again after a short, growing pause while the server has no stream free
    (:class:`~kspeed.errors.BusyError`), for at most :data:`BUSY_RETRY_S` seconds."""
    give_up = time.monotonic() + BUSY_RETRY_S
    pause = 0.05
    while True:
        try:
            return call()
        except BusyError:
            if time.monotonic() + pause > give_up:
                raise
            time.sleep(pause * random.uniform(0.5, 1.5))
            pause = min(pause * 2, 1.0)
