"""Shared regions: small datasets' slices placed first-fit, regions taken and given back as needed."""

from __future__ import annotations

import pytest

from kspeed.errors import CapacityError
from kspeed.server.memory.pool import SHARED_OWNER
from kspeed.server.memory.slices import SharedRegions
from tests.server.datasets import REGION

K = 64 << 10


def test_slices_pack_into_one_region_reuse_gaps_and_give_empty_regions_back(pool):
    shared = SharedRegions(pool)
    a, b, c = shared.take("a", 4 * K), shared.take("b", 8 * K), shared.take("c", 2 * K)
    assert a[0] == b[0] == c[0] and [a[1], b[1], c[1]] == [0, 4 * K, 12 * K]
    assert len(pool.regions(SHARED_OWNER)) == 1 and shared.regions() == 1
    assert shared.take("a", 4 * K) == a  # the same slice again
    shared.give("b")
    assert shared.take("d", 6 * K) == (a[0], 4 * K, 6 * K)  # the first gap that fits
    big = shared.take("e", REGION - 6 * K)  # does not fit what is left: a second region
    assert big[0] != a[0] and shared.regions() == 2
    for key in ("a", "c", "d"):
        shared.give(key)
    assert shared.regions() == 1 and len(pool.regions(SHARED_OWNER)) == 1  # the emptied one went back
    shared.give("e")
    shared.give("never-taken")
    assert pool.regions(SHARED_OWNER) == []


def test_a_slice_too_large_or_without_room_is_refused_and_takes_nothing(pool):
    shared = SharedRegions(pool)
    with pytest.raises(CapacityError, match="does not fit a region"):
        shared.take("x", REGION + 1)
    taken = [shared.take(k, REGION) for k in range(8)]  # every region of the pool
    assert len({t[0] for t in taken}) == 8
    with pytest.raises(CapacityError):
        shared.take("one-more", K)
    assert shared.slot("one-more") is None and shared.regions() == 8


def test_slices_do_not_outlive_a_restart(pool):
    shared = SharedRegions(pool)
    shared.take("a", K)
    assert len(pool.regions(SHARED_OWNER)) == 1
    SharedRegions(pool)  # a new host on the same pool
    assert pool.regions(SHARED_OWNER) == []
