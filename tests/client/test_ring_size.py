"""The receive ring's size: room for a few batches, at least MIN_RING, no more than a small dataset needs."""

from __future__ import annotations

import pytest

from kspeed.client.feeding.builder import MIN_RING, RING_BATCHES, ring_size
from kspeed.errors import CapacityError
from kspeed.layout import SAMPLE_ALIGN
from kspeed.proto import kspeed_pb2


def info(count: int, total: int) -> kspeed_pb2.DatasetInfo:
    return kspeed_pb2.DatasetInfo(
        spec=kspeed_pb2.DatasetSpec(name="d"), fingerprint=kspeed_pb2.Fingerprint(count=count, total_bytes=total)
    )


def test_a_large_dataset_gets_the_minimum_or_room_for_its_batches():
    assert ring_size(info(10_000_000, 10_000_000 * 400), 64, 0) == MIN_RING
    big = ring_size(info(1_000_000, 1_000_000 * (4 << 20)), 64, 0)
    assert big == RING_BATCHES * 64 * (4 << 20)


def test_a_small_dataset_gets_twice_its_bytes_never_less_than_its_batches():
    small = ring_size(info(40_000, 40_000 * 400), 64, 0)
    assert small == 2 * 40_000 * (400 + SAMPLE_ALIGN) < MIN_RING
    assert small >= RING_BATCHES * 64 * 400
    tiny = ring_size(info(10, 10 * 100), 64, 0)  # fewer samples than a batch: still room for whole batches
    assert tiny == RING_BATCHES * 64 * 104


def test_a_ring_asked_for_or_capped_is_kept_to():
    assert ring_size(info(40_000, 40_000 * 400), 64, 12345) == 12345
    assert ring_size(info(10_000_000, 10_000_000 * 400), 64, 0, cap=1 << 20) == 1 << 20
    with pytest.raises(CapacityError, match="ring_max_bytes"):
        ring_size(info(100, 100 * (1 << 20)), 64, 0, cap=1 << 20)
