"""``StreamPlan`` checks each chunk as it arrives: a stream that breaks a rule is refused before the
server keeps (or even reads) what follows."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from kspeed import wire
from kspeed.errors import CapacityError, NotFoundError, ProtocolError
from kspeed.proto import kspeed_pb2
from kspeed.server.service import ServerService


class _Feeders:
    """The feeder pool as the service sees it: one open feed of a 1,000-sample dataset."""

    def __init__(self) -> None:
        self.committed: list[tuple[str, int]] = []

    def dataset_of(self, feed_id: str) -> str:
        if feed_id != "feed-1":
            raise NotFoundError(f"feed {feed_id!r} is not open on this server (call OpenFeed first)")
        return "imgs"

    def commit_plan(self, feed_id: str, epoch: int, batch_size: int, offer, **kwargs) -> kspeed_pb2.PlanReply:
        self.committed.append((feed_id, len(offer.ids)))
        return kspeed_pb2.PlanReply(owned=len(offer.ids))


class _Host:
    def count(self, dataset: str) -> int:
        return 1000


def service(max_plan_bytes: int = 1 << 30) -> tuple[ServerService, _Feeders]:
    feeders = _Feeders()
    host = _Host()
    return ServerService(
        "srv", "mgr", host, feeders, lambda: None, lambda: (True, 1), max_plan_bytes=max_plan_bytes
    ), feeders  # type: ignore[arg-type]


def chunk(first: int, n: int, **head) -> kspeed_pb2.PlanChunk:
    ids = np.arange(first, first + n)
    return kspeed_pb2.PlanChunk(
        ids=wire.pack_i64(ids),
        lengths=wire.pack_u32(np.zeros(n, np.uint32)),
        positions=wire.pack_u32(ids.astype(np.uint32)),
        offsets=wire.pack_i64(np.zeros(n, np.int64)),
        **head,
    )


def stream(*chunks: kspeed_pb2.PlanChunk) -> Iterator[kspeed_pb2.PlanChunk]:
    """The chunks, then a failure if the service reads past them (it should have refused already)."""
    yield from chunks
    pytest.fail("the service read past the chunk that broke the rules")


def test_a_stream_naming_no_open_feed_is_refused_at_its_first_chunk():
    svc, feeders = service()
    with pytest.raises(NotFoundError, match="not open on this server"):
        svc.StreamPlan(stream(chunk(0, 10, feed_id="gone", count=1000)), None)
    with pytest.raises(ProtocolError, match="must name the feed"):
        svc.StreamPlan(stream(chunk(0, 10, count=1000)), None)
    assert feeders.committed == []


def test_a_stream_holding_more_ids_than_its_plan_is_refused_at_the_chunk_that_passes_it():
    svc, feeders = service()
    with pytest.raises(ProtocolError, match="beyond the plan's 15 samples"):
        svc.StreamPlan(stream(chunk(0, 10, feed_id="feed-1", count=15), chunk(10, 10)), None)
    with pytest.raises(ProtocolError, match="exceeds"):
        svc.StreamPlan(stream(chunk(0, 1, feed_id="feed-1", count=1 << 40)), None)
    assert feeders.committed == []


def test_a_stream_past_max_plan_bytes_is_refused_at_the_chunk_that_passes_it():
    svc, feeders = service(max_plan_bytes=24 * 15)  # 15 samples' worth
    with pytest.raises(CapacityError, match=r"server\.max_plan_bytes"):
        svc.StreamPlan(stream(chunk(0, 10, feed_id="feed-1", count=1000), chunk(10, 10)), None)
    assert feeders.committed == []


def test_a_well_formed_stream_is_committed_whole():
    svc, feeders = service()
    chunks = iter([chunk(0, 10, feed_id="feed-1", count=30), chunk(10, 10), chunk(20, 10)])
    assert svc.StreamPlan(chunks, None).owned == 30
    assert feeders.committed == [("feed-1", 30)]
