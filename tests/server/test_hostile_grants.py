"""A client's grants as a hostile client sends them: refused as malformed, the feed ended with the
reason, the feed thread never killed by an exception it did not expect."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from kspeed import grants
from kspeed.errors import ProtocolError
from kspeed.rdma.base import RegionKey
from kspeed.server.feeder.writer import FeederShared, FeedWriter
from tests.server.test_doorbell import SocketWriter


def raw_grant(ring_offset: int, epoch: int = grants.PROBE_EPOCH, end: int = 64, tag: int = 9) -> bytes:
    row = np.array([(epoch, 0, ring_offset, 0, end, tag)], dtype=grants.GRANT_DTYPE)
    return grants.encode_grants(row)


@pytest.mark.parametrize("offset", [2**62, 2**63, 2**64 - 1])
def test_a_grant_beyond_any_ring_is_a_malformed_message(offset):
    with pytest.raises(ProtocolError, match=rf"grant tagged 9 .* names ring offset {offset}, beyond"):
        grants.decode(raw_grant(offset))
    decoded = grants.decode(raw_grant(grants.MAX_RING_OFFSET))
    assert int(decoded["ring_offset"][0]) == grants.MAX_RING_OFFSET


@pytest.mark.parametrize("epoch", [grants.PROBE_EPOCH, 3])
def test_a_grant_at_offset_2_63_ends_the_feed_with_the_reason(monkeypatch, epoch):
    uncaught: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: uncaught.append(args.exc_value))
    events: list = []
    a, b = socket.socketpair()
    try:
        writer = SocketWriter(a)
        feed = FeedWriter("f", "ds", writer, RegionKey("shm", "here", 1, 0, 1 << 20), None, FeederShared(events.append))
        feed.start()
        b.send(raw_grant(2**63, epoch=epoch))
        deadline = time.monotonic() + 5
        while feed.alive and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not feed.alive and uncaught == []
        gone = [e for e in events if type(e).__name__ == "FeedGone"]
        assert len(gone) == 1 and "ring offset 9223372036854775808, beyond" in gone[0].why
        assert a.fileno() == -1  # the feed's own thread closed its connection
        feed.shared.doorbell.close()
    finally:
        a.close()
        b.close()
