"""Allocator: balance, contiguity, ownership, capacity and oversized samples."""

from __future__ import annotations

import numpy as np
import pytest

from kspeed.errors import CapacityError, DatasetError
from kspeed.layout import region_bounds
from kspeed.manager.allocator import (
    ServerCapacity,
    allocate,
    allocate_regions,
    allocate_slice,
    allocate_window,
    slice_size,
)

R = 1 << 20


def test_balanced_contiguous_and_covering():
    sizes = np.random.default_rng(0).integers(1, 200_000, 3000)
    servers = [ServerCapacity(f"s{i}", 100) for i in range(4)]
    alloc = allocate("ds", sizes, R, servers)
    assert [s.server_id for s in alloc.shares] == ["s0", "s1", "s2", "s3"]
    assert alloc.shares[0].lo == 0 and alloc.shares[-1].hi == 3000
    for a, b in zip(alloc.shares, alloc.shares[1:], strict=False):
        assert a.hi == b.lo and a.first_region + a.num_regions == b.first_region
    counts = [s.num_regions for s in alloc.shares]
    assert max(counts) - min(counts) <= 1  # allocated memory within one region of each other
    byts = [s.bytes for s in alloc.shares]
    assert max(byts) - min(byts) <= R + max(counts) * int(sizes.max())
    assert sum(byts) == alloc.total_bytes == int(sizes.sum())
    bounds = region_bounds(sizes, R, dataset="ds")
    assert alloc.num_regions == len(bounds) - 1
    for s in alloc.shares:
        assert bounds[s.first_region] == s.lo and bounds[s.first_region + s.num_regions] == s.hi


def test_owner_is_a_pure_function_of_the_allocation():
    sizes = np.full(1000, 100_000)
    alloc = allocate("ds", sizes, R, [ServerCapacity("a", 50), ServerCapacity("b", 50)])
    ids = np.random.default_rng(1).permutation(1000)
    owners = alloc.owner(ids)
    for sid, o in zip(ids, owners, strict=True):
        assert alloc.shares[o].lo <= sid < alloc.shares[o].hi
    with pytest.raises(DatasetError, match="no sample 1000"):
        alloc.owner(np.array([1000]))


def test_respects_free_counts_and_headroom():
    sizes = np.full(100, R // 2)
    alloc = allocate("ds", sizes, R, [ServerCapacity("a", 3), ServerCapacity("b", 100)], headroom=1)
    assert alloc.share_of("a").num_regions == 2 and alloc.share_of("b").num_regions == 48
    one = allocate("ds", sizes, R, [ServerCapacity("a", 30), ServerCapacity("b", 100)], max_servers=1)
    assert [s.server_id for s in one.shares] == ["b"]


def test_capacity_error_names_need_and_available():
    sizes = np.full(10, R)
    with pytest.raises(CapacityError, match=r"'ds' needs 10 regions.*9 available on 2 servers"):
        allocate("ds", sizes, R, [ServerCapacity("a", 4), ServerCapacity("b", 5)])


def test_oversized_sample_and_empty_dataset():
    with pytest.raises(DatasetError, match="sample 2 is"):
        allocate("ds", np.array([1, 2, R + 1]), R, [ServerCapacity("a", 10)])
    with pytest.raises(DatasetError, match="no samples"):
        allocate("ds", np.array([], dtype=np.int64), R, [ServerCapacity("a", 10)])


def test_zero_length_samples_fit():
    alloc = allocate("ds", np.zeros(5, dtype=np.int64), R, [ServerCapacity("a", 1)])
    assert alloc.num_regions == 1 and alloc.shares[0].hi == 5


def test_a_region_layout_allocates_as_the_sizes_do():
    # The manager allocates from the lister's region layout (one entry per region); it must cut
    # the very shares the per-sample sizes would, and refuse a layout that is not one.
    sizes = np.random.default_rng(4).integers(0, 400, 5000)
    caps = [ServerCapacity("a", 900), ServerCapacity("b", 700), ServerCapacity("c", 900)]
    starts = region_bounds(sizes, 1000, dataset="d")
    cum = np.concatenate(([0], np.cumsum(sizes)))
    by_regions = allocate_regions("d", starts, cum[starts[1:]] - cum[starts[:-1]], 1000, caps)
    assert by_regions == allocate("d", sizes, 1000, caps)
    swapped = starts.copy()
    swapped[[1, 2]] = swapped[[2, 1]]
    for bad_starts, bad_bytes in (
        (swapped, cum[starts[1:]] - cum[starts[:-1]]),  # not increasing
        (starts, (cum[starts[1:]] - cum[starts[:-1]])[:-1]),  # one byte count short
        (starts, np.full(len(starts) - 1, 1001)),  # more bytes than a region
    ):
        with pytest.raises(DatasetError, match="malformed"):
            allocate_regions("d", bad_starts, bad_bytes, 1000, caps)
    with pytest.raises(DatasetError, match="no samples"):
        allocate_regions("d", np.array([0]), np.zeros(0), 1000, caps)


def window_of(sizes, servers, budget=None):
    starts = region_bounds(sizes, R, dataset="ds")
    cum = np.concatenate(([0], np.cumsum(sizes)))
    return allocate_window("ds", starts, cum[starts[1:]] - cum[starts[:-1]], R, servers, budget=budget)


def test_a_dataset_held_in_part_splits_its_ids_in_proportion_to_memory():
    sizes = np.full(3000, R // 10)  # 300 regions
    alloc = window_of(sizes, [ServerCapacity("a", 20), ServerCapacity("b", 60), ServerCapacity("c", 100)], budget=90)
    assert alloc.memory_regions == 90 and alloc.num_regions == 300
    held = {s.server_id: s.memory_regions for s in alloc.shares}
    assert held == {"a": 20, "b": 35, "c": 35}  # balanced where the free regions allow
    for s in alloc.shares:  # each server's part of the dataset is as large, relative to its memory, as the others'
        assert abs(s.num_regions / s.memory_regions - 300 / 90) < 0.1, s
    assert alloc.shares[0].lo == 0 and alloc.shares[-1].hi == 3000
    for a, b in zip(alloc.shares, alloc.shares[1:], strict=False):
        assert a.hi == b.lo and a.first_region + a.num_regions == b.first_region
    ids = np.arange(3000)
    assert np.array_equal(alloc.owner(ids), np.repeat(np.arange(3), [s.hi - s.lo for s in alloc.shares]))


def test_a_window_never_exceeds_the_free_regions_or_the_part_it_holds():
    sizes = np.full(40, R // 2)  # 20 regions
    every = window_of(sizes, [ServerCapacity("a", 4), ServerCapacity("b", 3)])
    assert [(s.memory_regions, s.num_regions) for s in every.shares] == [(4, 11), (3, 9)]
    small = window_of(np.full(3, R // 2), [ServerCapacity(f"s{i}", 9) for i in range(4)])  # 2 regions, 4 servers
    assert len(small.shares) == 2 and all(s.memory_regions == s.num_regions == 1 for s in small.shares)
    with pytest.raises(CapacityError, match="no region of 1048576 bytes"):
        window_of(sizes, [ServerCapacity("a", 0)])
    with pytest.raises(CapacityError, match="budget 0"):
        window_of(sizes, [ServerCapacity("a", 5)], budget=0)


def test_a_small_dataset_takes_a_slice_on_the_server_with_the_most_room():
    assert slice_size(100, 300_000, 128 << 20) == 5 * (64 << 10)  # 300 kB + alignment, in 64 KiB units
    assert slice_size(10, 40 << 20, 128 << 20) == 0  # over a quarter of a region: whole regions
    alloc = allocate_slice("tiny", 100, 300_000, 6 * (64 << 10), 128 << 20, [("a", 1 << 20), ("b", 5 << 20)])
    (share,) = alloc.shares
    assert (share.server_id, share.lo, share.hi, share.slice_bytes, share.num_regions) == ("b", 0, 100, 6 << 16, 1)
    assert np.array_equal(alloc.owner(np.arange(100)), np.zeros(100, dtype=np.int64))
    with pytest.raises(CapacityError, match="slice of 393216 bytes"):
        allocate_slice("tiny", 100, 300_000, 6 * (64 << 10), 128 << 20, [("a", 1000)])
