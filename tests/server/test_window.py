"""The production window: placement in chunks of reserved pool regions, never beyond its capacity."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kspeed.errors import CapacityError, ConfigError
from kspeed.server.memory.pool import WINDOW_OWNER
from kspeed.server.memory.residency import ABSENT, FAILED, HOME, READING, WINDOW, Residency
from kspeed.server.memory.window import ProductionWindow
from tests.server.datasets import REGION


def test_regions_are_reserved_in_the_pool_and_given_back(pool):
    window = ProductionWindow(pool, 2 * REGION + 12345)
    assert len(pool.regions(WINDOW_OWNER)) == 2 and window.capacity == 2 * REGION
    with pytest.raises(ConfigError, match="production_window"):
        ProductionWindow(pool, 9 * REGION)  # more than the pool: named, and the first window is intact
    window.close()
    assert pool.regions(WINDOW_OWNER) == []


def test_random_placements_stay_disjoint_and_within_capacity(pool):
    window = ProductionWindow(pool, REGION)
    rng = np.random.default_rng(1)
    live: dict[int, tuple] = {}
    for step in range(4000):
        if live and (rng.random() < 0.45 or len(live) > 300):
            ticket = int(rng.choice(list(live)))
            slot, data = live.pop(ticket)
            assert window.view(slot).tobytes() == data  # nobody wrote over it
            window.free(slot)
            continue
        size = int(rng.choice([0, 8, 1000, 30_000, 70_000, 200_000]))
        slot = window.place(size)
        if slot is None:
            if size <= window.chunk:  # refused only when no chunk is left (a big one may meet fragments)
                assert window.used >= window.capacity - window.chunk
            continue
        data = rng.bytes(size)
        window.view(slot)[:] = np.frombuffer(data, np.uint8)
        live[slot.ticket] = (slot, data)
        assert window.used <= window.capacity and window.peak <= window.capacity, step
    for slot, data in live.values():
        assert window.view(slot).tobytes() == data
        window.free(slot)
    assert window.used == 0 and 0 < window.peak <= window.capacity


def test_full_window_returns_none_until_something_is_freed(pool):
    window = ProductionWindow(pool, REGION)
    slots = []
    while (slot := window.place(window.chunk)) is not None:
        slots.append(slot)
    assert len(slots) == window.capacity // window.chunk and window.used == window.capacity
    woke = threading.Event()
    waiter = threading.Thread(target=lambda: (window.wait_for_room(10), woke.set()))
    waiter.start()
    window.free(slots.pop())
    waiter.join(timeout=5)
    assert woke.is_set() and window.place(window.chunk) is not None


def test_one_pinned_sample_pins_one_chunk_only(pool):
    window = ProductionWindow(pool, REGION)
    small = [window.place(100) for _ in range(10)]  # all in the first chunk
    assert {s.first_chunk for s in small if s} == {small[0].first_chunk}
    big = window.place(3 * window.chunk)  # takes three whole chunks of its own
    assert big is not None and big.own_chunks == 3 and big.offset % window.chunk == 0
    for s in small[1:]:
        window.free(s)
    assert window.used == 4 * window.chunk  # the pinned first chunk and the big sample's three
    window.free(big)
    assert window.used == window.chunk
    with pytest.raises(CapacityError, match="does not fit"):
        window.place(REGION + 1)


def test_residency_claims_each_sample_once():
    residency = Residency(100, np.array([False, True, False, False, False]))
    assert residency.of(np.arange(100, 105)).tolist() == [ABSENT, HOME, ABSENT, ABSENT, ABSENT]
    taken = residency.claim(np.array([102, 101, 102, 100]))  # a duplicate, and one at home
    assert taken.tolist() == [102, 100]
    assert residency.claim(np.array([100, 102])).tolist() == []  # already being read
    residency.settle(np.array([102]), WINDOW)
    residency.fail(np.array([100]), ["backend down"])
    assert residency.reasons == {100: "backend down"} and residency.count(FAILED) == 1
    assert residency.claim(np.array([100])).tolist() == []  # failed: not retried by default ...
    assert residency.claim(np.array([100]), retry_failed_after=0.0).tolist() == [100]  # ... unless asked
    assert residency.of(np.array([100, 102])).tolist() == [READING, WINDOW]
    residency.settle(np.array([100]), HOME)
    assert residency.reasons == {} and residency.count(HOME) == 2
