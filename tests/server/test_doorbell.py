"""The doorbell idle feeds wait on, and an idle feed that waits on it (no polling, prompt close)."""

from __future__ import annotations

import select
import socket
import threading
import time

import pytest

from kspeed import grants
from kspeed.errors import PeerLostError
from kspeed.rdma.base import RegionKey, Writer
from kspeed.server.feeder.doorbell import Doorbell
from kspeed.server.feeder.writer import CLOSE_GRACE, FeederShared, FeedWriter


@pytest.fixture
def bell():
    doorbell = Doorbell()
    yield doorbell
    doorbell.close()


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def test_a_watch_rings_once_when_its_descriptor_turns_readable(bell, pair):
    a, b = pair
    event = threading.Event()
    bell.watch(a.fileno(), event)
    assert not event.wait(0.2)
    b.send(b"x")
    assert event.wait(5)
    event.clear()
    assert not event.wait(0.2)  # one ring per watch, although the byte is still unread
    bell.watch(a.fileno(), event)  # watched again while readable: rings at once
    assert event.wait(5)
    a.recv(1)


def test_the_peers_end_rings_and_a_forgotten_descriptor_never_does(bell, pair):
    a, b = pair
    c, d = socket.socketpair()
    try:
        gone, forgotten = threading.Event(), threading.Event()
        bell.watch(a.fileno(), gone)
        bell.watch(c.fileno(), forgotten)
        bell.forget(c.fileno())
        assert bell.watched == 1
        b.close()
        d.send(b"x")
        assert gone.wait(5)
        assert not forgotten.wait(0.2)
    finally:
        c.close()
        d.close()


def test_close_wakes_every_waiter_stops_its_thread_and_later_watches_ring_at_once(pair):
    a, _b = pair
    doorbell = Doorbell()
    before = threading.active_count()
    waiting = threading.Event()
    doorbell.watch(a.fileno(), waiting)
    assert threading.active_count() == before + 1
    doorbell.close()
    assert waiting.is_set() and threading.active_count() == before and doorbell.watched == 0
    late = threading.Event()
    doorbell.watch(a.fileno(), late)
    assert late.is_set()


class SocketWriter(Writer):
    """A writer over one end of a socket pair: messages only; it counts how often it is read."""

    rail = "shm"
    conn = 1

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reads = 0
        self.sent: list[bytes] = []
        self.interrupted = False

    def recv(self, timeout: float | None = 0.0) -> bytes | None:
        self.reads += 1
        if not select.select([self.sock], [], [], timeout)[0]:
            return None
        data = self.sock.recv(1 << 16)
        if not data:
            raise PeerLostError("the receiver closed its end")
        return data

    def send(self, message: bytes) -> None:
        self.sent.append(message)

    def fileno(self) -> int:
        return self.sock.fileno()

    def interrupt(self) -> None:
        self.interrupted = True
        self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.sock.close()

    def write(self, key, srcs, offset=0, imm=None) -> None:
        raise AssertionError("an idle feed writes nothing")

    def write_many(self, key, ops) -> None:
        raise AssertionError("an idle feed writes nothing")

    def write_checked(self, key, source, batch) -> None:
        raise AssertionError("an idle feed writes nothing")


def idle_feed(sock: socket.socket, events: list) -> tuple[FeedWriter, SocketWriter]:
    writer = SocketWriter(sock)
    feed = FeedWriter("f", "ds", writer, RegionKey("shm", "here", 1, 0, 1 << 20), None, FeederShared(events.append))
    feed.start()
    return feed, writer


def test_an_idle_feed_sleeps_through_the_commands_that_concern_it(pair):
    """A feed with no grants waiting is not woken by a location or a placement of its dataset: it
    has nothing they could make ready (only feeds whose grants wait look again)."""
    a, _b = pair
    feed, writer = idle_feed(a, [])
    try:
        time.sleep(0.5)
        before = writer.reads
        for _ in range(50):
            feed.moved()
        time.sleep(0.5)
        assert writer.reads == before and feed.moves == 50
    finally:
        feed.close()
        feed.shared.doorbell.close()


def test_an_idle_feed_sleeps_until_closed_and_closes_at_once_without_interrupting_its_io(pair):
    a, _b = pair
    feed, writer = idle_feed(a, [])
    time.sleep(1.0)
    assert writer.reads <= 2  # it read once, found nothing, and slept (no polling)
    t0 = time.monotonic()
    feed.close("the test is over")
    assert time.monotonic() - t0 < CLOSE_GRACE and not feed.alive
    assert not writer.interrupted and a.fileno() == -1  # its own thread closed the writer
    assert any(b"the test is over" in m for m in writer.sent)  # after telling the client why
    assert feed.shared.doorbell.watched == 0
    feed.shared.doorbell.close()


def test_an_idle_feed_wakes_when_its_client_goes_and_reports_the_feed_gone(pair):
    a, b = pair
    events: list = []
    feed, _writer = idle_feed(a, events)
    time.sleep(0.2)
    b.close()
    deadline = time.monotonic() + 5
    while feed.alive and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not feed.alive
    assert [type(e).__name__ for e in events if type(e).__name__ == "FeedGone"] == ["FeedGone"]
    feed.shared.doorbell.close()


def test_an_idle_feed_wakes_for_a_grant_and_answers_it(pair):
    a, b = pair
    feed, writer = idle_feed(a, [])
    time.sleep(0.2)
    b.send(grants.encode_grants([grants.Grant(epoch=3, batch=0, ring_offset=0, first=0, end=1, tag=7)]))
    deadline = time.monotonic() + 5
    while not writer.sent and time.monotonic() < deadline:
        time.sleep(0.01)
    refusal = grants.decode(writer.sent[0])
    assert isinstance(refusal, grants.GrantError) and refusal.tag == 7 and "no plan for epoch 3" in refusal.text
    feed.close()
    feed.shared.doorbell.close()


def test_a_descriptor_number_watched_again_without_being_forgotten_still_rings(bell, pair):
    a, b = pair
    first = threading.Event()
    bell.watch(a.fileno(), first)
    bell._bells.pop(a.fileno())  # as if its feed had gone without forgetting it
    second = threading.Event()
    bell.watch(a.fileno(), second)
    b.send(b"x")
    assert second.wait(5) and not first.is_set()
