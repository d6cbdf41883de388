"""A feed whose client truncated a plan (TRUNCATE_PLAN): the batches before the cut are served, a
grant from the cut on is refused like any invalid grant, and production is told (no daemon)."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kspeed import grants
from kspeed.rdma.base import RegionKey
from kspeed.server.feeder.protocol import FeedProgress
from kspeed.server.feeder.writer import FeederShared, FeedWriter
from tests.server.test_doorbell import SocketWriter
from tests.server.test_production import plan_of

EPOCH = 5


class RecordingWriter(SocketWriter):
    """Messages over a socket, and the tags of the grants it wrote."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(sock)
        self.tags: list[int] = []

    def write_batch(self, key, source, src_offsets, lengths, dst_offsets, imms=None) -> None:
        self.tags.extend(imms or [])


class OneRegion:
    """The pool as a feeder maps it: one region of zeros."""

    def get(self, index: int) -> np.ndarray:
        return np.zeros(1 << 16, dtype=np.uint8)


@contextlib.contextmanager
def serving(part, events: list, **options) -> Iterator[tuple[FeedWriter, RecordingWriter, socket.socket]]:
    """A started feed serving ``part`` as plan ``EPOCH`` over a socket pair, reporting into
    ``events`` (``options``: the feed's keyword arguments); yields it, its writer and the client's
    end, and closes them."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # (one message per recv)
    writer = RecordingWriter(a)
    shared = FeederShared(events.append)
    feed = FeedWriter("f", "ds", writer, RegionKey("shm", "here", 1, 0, 1 << 20), OneRegion(), shared, **options)
    feed.install(EPOCH, part)
    feed.start()
    try:
        yield feed, writer, b
    finally:
        feed.close()
        shared.doorbell.close()
        a.close()
        b.close()


@pytest.fixture
def feed():
    """A feed serving plan ``EPOCH`` (4 batches of 10 positions, every sample resident); yields it,
    its writer, the client's end and the events it reports."""
    events: list = []
    part = plan_of(np.arange(40), np.full(40, 8), 10)
    part.region[:] = 0
    with serving(part, events) as (feed, writer, client):
        yield feed, writer, client, events


def grant(batch: int) -> grants.Grant:
    return grants.Grant(EPOCH, batch, ring_offset=1024 * batch, first=0, end=10, tag=100 + batch)


def until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_truncated_plan_is_served_before_its_cut_and_refused_from_it(feed):
    feed, writer, client, events = feed
    client.send(grants.encode_truncate_plan(EPOCH, 2))
    client.send(grants.encode_grants([grant(b) for b in range(4)]))

    def progress() -> list[FeedProgress]:
        return [e for e in events if isinstance(e, FeedProgress)]

    until(lambda: len(writer.tags) + len(writer.sent) == 4 and sum(len(p.written) for p in progress()) == 2)
    assert sorted(writer.tags) == [100, 101]  # the batches granted before the cut are written
    refused = [grants.decode(m) for m in writer.sent]
    assert [(r.batch, r.tag) for r in refused] == [(2, 102), (3, 103)]
    assert all(isinstance(r, grants.GrantError) and "truncated at batch 2" in r.text for r in refused)
    # production learns of the cut once, and of the writes before it
    assert [t for p in progress() for t in p.truncated] == [(EPOCH, 2)]
    assert sorted(int(b) for p in progress() for b in p.written[:, 1]) == [0, 1]
    part = feed.plans[EPOCH]
    assert part.granted is not None and not part.granted[20:].any()  # refused grants ask for nothing
    # a later truncation at a later batch does not grant the cut-off batches again
    client.send(grants.encode_truncate_plan(EPOCH, 3))
    client.send(grants.encode_grants([grant(2)]))
    until(lambda: len(writer.sent) == 3)
    assert grants.decode(writer.sent[-1]).tag == 102 and part.cut == 2 and feed.alive
