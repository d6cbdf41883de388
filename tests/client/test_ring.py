"""The ring allocator: back to back at the head, out-of-order release, wrap-around, quarantine."""

from __future__ import annotations

import threading

from kspeed.client.delivery.ring import RingAllocator


def test_back_to_back_then_full():
    ring = RingAllocator(100 * 8)
    assert [ring.reserve(80) for _ in range(10)] == [i * 80 for i in range(10)]
    assert ring.reserve(8) is None
    assert ring.used == 800 and ring.reservations == 10


def test_sizes_are_aligned_and_never_zero():
    ring = RingAllocator(64)
    assert ring.reserve(0) == 0
    assert ring.reserve(3) == 8
    assert ring.reserve(9) == 16
    assert ring.used == 8 + 8 + 16


def test_out_of_order_release_and_wrap():
    ring = RingAllocator(384)
    a, b, c, d = (ring.reserve(96) for _ in range(4))
    assert (a, b, c, d) == (0, 96, 192, 288)
    ring.release(c)  # a held batch (a) does not block reuse of c's range ...
    assert ring.reserve(96) == 192
    ring.release(a)  # ... and the head wraps to the start once the end is taken
    assert ring.reserve(96) == 0
    assert ring.reserve(96) is None
    ring.release(b)
    assert ring.reserve(56) == 96  # first fit after the head
    assert ring.reserve(56) is None  # the 40 bytes left at 152 do not fit


def test_quarantined_ranges_are_never_reused():
    ring = RingAllocator(288)
    a = ring.reserve(96)
    b = ring.reserve(96)
    ring.quarantine(a)
    ring.release(a)  # ignored: a fenced writer may still map it
    ring.release(b)
    assert ring.quarantined == 96
    got = [ring.reserve(96), ring.reserve(96)]
    assert a not in got and sorted(got) == [96, 192]
    assert ring.reserve(96) is None


def test_release_later_from_another_thread():
    ring = RingAllocator(200)
    a = ring.reserve(200)
    worker = threading.Thread(target=ring.release_later, args=(a,))
    worker.start()
    worker.join()
    assert ring.used == 200  # applied by the owner, not by the finalizer's thread
    assert ring.reserve(200) == 0


def test_larger_than_the_ring_is_refused():
    ring = RingAllocator(64)
    assert ring.reserve(65) is None
    assert ring.used == 0
