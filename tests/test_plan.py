"""The layout rules clients, manager and servers share: samples packed into regions, a plan's batches."""

from __future__ import annotations

import numpy as np
import pytest

from kspeed.errors import DatasetError
from kspeed.layout import batch_layout, batch_starts, region_bounds

R = 1000


def test_packs_in_order_without_straddling():
    sizes = np.array([400, 400, 300, 0, 1000, 1, 999], dtype=np.int64)
    assert region_bounds(sizes, R, dataset="ds").tolist() == [0, 2, 4, 5, 7]


def test_every_region_is_full_up_to_the_next_sample():
    sizes = np.random.default_rng(3).integers(0, R, 5000)
    b = region_bounds(sizes, R, dataset="ds")
    cum = np.concatenate(([0], np.cumsum(sizes)))
    used = cum[b[1:]] - cum[b[:-1]]
    assert b[0] == 0 and b[-1] == len(sizes) and (np.diff(b) > 0).all()
    assert (used <= R).all()
    assert (used[:-1] + sizes[b[1:-1]] > R).all()  # the next sample would not have fitted


def test_zero_length_samples_and_empty_input():
    assert region_bounds(np.zeros(5, dtype=np.int64), R, dataset="ds").tolist() == [0, 5]
    assert region_bounds(np.zeros(0, dtype=np.int64), R, dataset="ds").tolist() == [0]


def test_bad_sizes_are_named_by_sample_id():
    with pytest.raises(DatasetError, match="sample 12 is 1001 bytes, larger than a region"):
        region_bounds(np.array([1, 1, 1001]), R, dataset="ds", first_id=10)
    with pytest.raises(DatasetError, match="sample 1 has negative size"):
        region_bounds(np.array([1, -1]), R, dataset="ds")
    with pytest.raises(DatasetError, match="region size must be positive"):
        region_bounds(np.array([1]), 0, dataset="ds")


def test_batch_starts_cover_the_plan_with_only_the_last_batch_short():
    assert batch_starts(10, 4).tolist() == [0, 4, 8, 10]
    assert batch_starts(8, 4).tolist() == [0, 4, 8]
    assert batch_starts(0, 4).tolist() == [0]
    assert batch_layout(np.ones(10, np.int64), 4).starts.tolist() == batch_starts(10, 4).tolist()
