"""The client's control-plane calls to one server: broadcast lookup, OpenFeed, CommitPlan, CloseFeed.

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

__all__ = ["LOOKUP_CHUNK", "PLAN_CHUNK", "Link", "ServerLink"]

LOOKUP_CHUNK = 1 << 16  # IDs per Lookup request (the server accepts up to 1 << 20)
PLAN_CHUNK = 1 << 18  # IDs per PlanChunk (3 MiB per message)
PLAN_DEADLINE = 120.0  # CommitPlan streams the whole plan; the server returns at once (it produces as it serves)
BUSY_RETRY_S = 30.0  # how long a lookup or plan is tried again while the server has no stream free

T = TypeVar("T")


@dataclass(frozen=True)
class RemoteSplit:
    """What a plan asks the servers to preprocess: per position ``remote``, the first ``stages``
    stages of the dataset's pipeline, random ones drawing from ``(seed, epoch, sample, stage)``."""

    remote: np.ndarray
    stages: int
    seed: int
    epoch: int
    skip: bool = False


class Link(Protocol):
    """What a feed needs of one server: :class:`ServerLink`, or a test double."""

    server_id: str
    address: str
    first_id: int | None  # the share of the dataset it serves (its first sample); None: the server's only one

    @property
    def name(self) -> str: ...

    def lookup(self, dataset: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...

    def open_feed(self, request: kspeed_pb2.OpenFeedRequest) -> kspeed_pb2.OpenFeedReply: ...

    def commit_plan(
        self,
        feed_id: str,
        epoch: int,
        batch_size: int,
        ids: np.ndarray,
        lengths: np.ndarray,
        split: RemoteSplit | None = None,
        first_batch: int = 0,
    ) -> kspeed_pb2.PlanReply: ...

    def close_feed(self, feed_id: str) -> None: ...

    def close(self) -> None: ...


class ServerLink:
    """A channel to one server of a dataset.

    Args:
        server_id: the server's id in the cluster.
        address: its gRPC ``host:port``.
        config: credentials and deadlines.
        first_id: the share of the dataset this link serves (its first sample ID): lookups and
            the feed ask for it (a server may hold several shares of a dataset after a failover).
    """

    def __init__(self, server_id: str, address: str, config: ClientConfig, *, first_id: int | None = None) -> None:
        self.server_id = server_id
        self.address = address
        self.first_id = first_id
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
            NotFoundError: the server does not host the dataset or an ID does not exist.
            UnavailableError: the server is unreachable.
        """

        def chunks() -> Iterator[kspeed_pb2.LookupRequest]:
            for start in range(0, max(len(ids), 1), LOOKUP_CHUNK):
                chunk = kspeed_pb2.LookupRequest(
                    dataset=dataset if start == 0 else "", ids=wire.pack_i64(ids[start : start + LOOKUP_CHUNK])
                )
                if start == 0 and self.first_id is not None:
                    chunk.first_id = self.first_id
                yield chunk

        deadline = max(self._timeout, 60.0)

        def call() -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
            positions, lengths, labels = [], [], []
            with rpc.map_rpc_errors(self.name):
                replies = self._stub.Lookup(chunks(), timeout=deadline, metadata=self._metadata)
                for start, reply in zip(range(0, max(len(ids), 1), LOOKUP_CHUNK), replies):
                    positions.append(wire.unpack_u32(reply.positions, f"{self.name}: lookup positions") + start)
                    lengths.append(wire.unpack_u32(reply.lengths, f"{self.name}: lookup lengths"))
                    labels.append(wire.unpack_i64(reply.labels, f"{self.name}: lookup labels"))
            return positions, lengths, labels

        positions, lengths, labels = _when_not_busy(call)
        if not positions:
            return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
        return np.concatenate(positions), np.concatenate(lengths), np.concatenate(labels).astype(np.int64)

    def open_feed(self, request: kspeed_pb2.OpenFeedRequest) -> kspeed_pb2.OpenFeedReply:
        """Ask the server to connect a feeder to our ring (docs/feeding.md, step 2)."""
        if self.first_id is not None:
            request.first_id = self.first_id
        with rpc.map_rpc_errors(self.name):
            return self._stub.OpenFeed(request, timeout=max(self._timeout, 30.0), metadata=self._metadata)

    def commit_plan(
        self,
        feed_id: str,
        epoch: int,
        batch_size: int,
        ids: np.ndarray,
        lengths: np.ndarray,
        split: RemoteSplit | None = None,
        first_batch: int = 0,
    ) -> kspeed_pb2.PlanReply:
        """Hand over an epoch plan (with the positions the server preprocesses; from batch
        ``first_batch`` on, the ones before were delivered already); returns at once."""

        def chunks() -> Iterator[kspeed_pb2.PlanChunk]:
            for start in range(0, max(len(ids), 1), PLAN_CHUNK):
                chunk = kspeed_pb2.PlanChunk(
                    ids=wire.pack_i64(ids[start : start + PLAN_CHUNK]),
                    lengths=wire.pack_u32(lengths[start : start + PLAN_CHUNK]),
                )
                if split is not None:
                    chunk.remote = np.packbits(split.remote[start : start + PLAN_CHUNK]).tobytes()
                if start == 0:
                    chunk.feed_id, chunk.epoch, chunk.batch_size = feed_id, epoch, batch_size
                    chunk.first_batch = first_batch
                    if split is not None:
                        chunk.server_stages, chunk.seed, chunk.seed_epoch = split.stages, split.seed, split.epoch
                        chunk.skip_failed = split.skip
                yield chunk

        def call() -> kspeed_pb2.PlanReply:
            with rpc.map_rpc_errors(self.name):
                return self._stub.CommitPlan(chunks(), timeout=PLAN_DEADLINE, metadata=self._metadata)

        return _when_not_busy(call)

    def close_feed(self, feed_id: str) -> None:
        """Tell the server the feed is over."""
        with rpc.map_rpc_errors(self.name):
            self._stub.CloseFeed(
                kspeed_pb2.CloseFeedRequest(feed_id=feed_id), timeout=self._timeout, metadata=self._metadata
            )

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
