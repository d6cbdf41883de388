"""The listeners' gate: caps per peer and in total that make room for newcomers, and one deadline per connection."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from kspeed.admission import WIND_DOWN, Gate
from kspeed.cli.cluster import wait_for


@pytest.fixture
def pairs():
    """``make()`` returns a connected pair (the gate holds the first end; the test reads the second)."""
    made: list[socket.socket] = []

    def make() -> tuple[socket.socket, socket.socket]:
        a, b = socket.socketpair()
        b.settimeout(5)
        made.extend((a, b))
        return a, b

    yield make
    for sock in made:
        sock.close()


def shut(sock: socket.socket) -> bool:
    """Whether the gate shut the connection down (its other end reads the end of the stream)."""
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    finally:
        sock.settimeout(5)


def test_a_peer_at_its_cap_makes_room_with_its_oldest_connection(pairs):
    gate = Gate("test", total=10, per_peer=2, deadline=60)
    first, second, third, other = (pairs() for _ in range(4))
    gate.enter(first[0], "a")
    gate.enter(second[0], "a")
    gate.enter(other[0], "b")
    ticket = gate.enter(third[0], "a")
    assert shut(first[1])
    assert not shut(second[1]) and not shut(third[1]) and not shut(other[1])
    assert (gate.held("a"), gate.held("b"), gate.displaced) == (2, 1, 1)
    gate.leave(ticket)
    assert gate.held("a") == 1
    gate.close()


def test_at_the_total_cap_the_busiest_peer_makes_room(pairs):
    gate = Gate("test", total=3, per_peer=3, deadline=60)
    a1, a2, b1, c1 = (pairs() for _ in range(4))
    gate.enter(b1[0], "b")  # the oldest of all, but its peer holds only one
    gate.enter(a1[0], "a")
    gate.enter(a2[0], "a")
    gate.enter(c1[0], "c")
    assert shut(a1[1])
    assert not shut(b1[1]) and not shut(a2[1]) and not shut(c1[1])
    assert gate.held() == 3
    gate.close()


def test_a_connection_is_shut_at_its_deadline_whatever_it_sends(pairs):
    gate = Gate("test", total=10, per_peer=10, deadline=0.3)
    slow, done = pairs(), pairs()
    gate.enter(slow[0], "a")
    gate.leave(gate.enter(done[0], "a"))  # left the gate in time: never touched
    wait_for(lambda: shut(slow[1]), 10, "the slow connection shut at its deadline")
    assert gate.expired == 1 and gate.held() == 0
    assert not shut(done[1])
    gate.close()


def test_bad_caps_are_refused():
    with pytest.raises(ValueError):
        Gate("test", total=0, per_peer=1, deadline=1)
    with pytest.raises(ValueError):
        Gate("test", total=1, per_peer=1, deadline=0)


def test_shut_connections_not_yet_left_hold_newcomers_back_and_past_the_wait_refuse_them(pairs):
    gate = Gate("test", total=1, per_peer=1, deadline=60, room_wait=0.2)
    # Each newcomer shuts the one before; their owners never leave, so the shut ones pile up.
    tickets = [gate.enter(pairs()[0], "a") for _ in range(WIND_DOWN + 1)]
    assert all(tickets) and gate.displaced == WIND_DOWN and gate.refused == 0
    begun = time.monotonic()
    assert gate.enter(pairs()[0], "a") is None  # one more shut than WIND_DOWN, and nobody left
    assert time.monotonic() - begun >= 0.2 and gate.refused == 1
    for ticket in tickets[:2]:
        gate.leave(ticket)
    gate.leave(tickets[0])  # (a second leave changes nothing)
    assert gate.enter(pairs()[0], "a") is not None
    gate.close()


def test_a_newcomer_waits_for_an_owner_to_leave_and_then_enters(pairs):
    gate = Gate("test", total=1, per_peer=1, deadline=60, room_wait=30)
    tickets = [gate.enter(pairs()[0], "a") for _ in range(WIND_DOWN + 1)]
    assert all(tickets)
    leaver = threading.Timer(0.2, gate.leave, args=(tickets[0],))
    leaver.start()
    begun = time.monotonic()
    late = gate.enter(pairs()[0], "a")  # WIND_DOWN + 1 shut until the first owner leaves
    assert late is not None and gate.refused == 0
    assert 0.1 <= time.monotonic() - begun < 20
    leaver.join()
    gate.close()
