"""Sample index: layout, vectorized lookup over a shuffled epoch, persistence."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kspeed.errors import DatasetError, NotFoundError, StateError
from kspeed.server.hosting.index import SampleIndex

R = 1000


def test_layout_packs_in_order_without_straddling():
    sizes = np.array([400, 400, 300, 0, 1000, 1, 999], dtype=np.int64)
    idx = SampleIndex("ds", 10, sizes, R, first_region=5)
    assert idx.region.tolist() == [5, 5, 6, 6, 7, 8, 8]
    assert idx.offset.tolist() == [0, 400, 0, 300, 0, 0, 1]
    assert idx.bounds.tolist() == [10, 12, 14, 15, 17]
    ends = idx.offset + idx.length
    assert (ends <= R).all()


def test_sample_larger_than_region_is_named():
    with pytest.raises(DatasetError, match="sample 12 is 1001 bytes"):
        SampleIndex("ds", 10, np.array([1, 1, 1001]), R)


def test_lookup_over_a_shuffled_epoch():
    rng = np.random.default_rng(0)
    sizes = rng.integers(0, 500, 100_000)
    lo, hi = 30_000, 60_000
    idx = SampleIndex("ds", lo, sizes[lo:hi], 1 << 20)
    epoch = rng.permutation(100_000)
    mask, lengths = idx.lookup(epoch)
    assert np.array_equal(mask, (epoch >= lo) & (epoch < hi))
    assert np.array_equal(lengths, sizes[epoch[mask]])
    _region, _offset, length, _ = idx.locate(epoch[mask][:10])
    assert np.array_equal(length, sizes[epoch[mask][:10]])
    with pytest.raises(NotFoundError, match="not owned"):
        idx.locate(np.array([lo - 1]))
    with pytest.raises(StateError, match="not loaded"):
        idx.check_loaded(lo)


def test_save_and_load_roundtrip_and_mismatch(tmp_path):
    sizes = np.array([5, 6, 7], dtype=np.int64)
    idx = SampleIndex("ds", 0, sizes, R, fingerprint="abc")
    idx.mark_loaded(np.array([0, 2]), np.array([11, 33], dtype=np.uint32))
    path = tmp_path / "i.npz"
    idx.save(path)
    again = SampleIndex.load(path, dataset="ds", lo=0, sizes=sizes, region_size=R, fingerprint="abc")
    assert again.loaded.tolist() == [True, False, True] and again.crc.tolist() == [11, 0, 33]
    other = SampleIndex.load(path, dataset="ds", lo=0, sizes=sizes, region_size=R, fingerprint="changed")
    assert not other.loaded.any()
    path.write_bytes(b"garbage")
    assert not SampleIndex.load(path, dataset="ds", lo=0, sizes=sizes, region_size=R).loaded.any()


def reference_layout(sizes: np.ndarray, region_size: int, first_region: int) -> tuple[list[int], list[int]]:
    """Each sample's region and offset, appended in ID order one by one (a sample that does not fit
    the rest of a region starts the next one)."""
    regions, offsets, region, used = [], [], first_region, 0
    for size in sizes.tolist():
        if used and used + size > region_size:
            region, used = region + 1, 0
        regions.append(region)
        offsets.append(used)
        used += size
    return regions, offsets


@pytest.mark.parametrize("seed", range(5))
def test_the_compact_layout_is_the_one_of_appending_in_order(seed, monkeypatch):
    monkeypatch.setattr("kspeed.server.hosting.index.CHUNK", 1000)  # several chunks per region, and across regions
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, 300, 5000) * (rng.random(5000) < 0.9)
    idx = SampleIndex("ds", 70, sizes, 20_000, first_region=3)
    regions, offsets = reference_layout(sizes, 20_000, 3)
    assert idx.region.tolist() == regions and idx.offset.tolist() == offsets
    assert idx.offset.dtype == np.uint32 and idx.num_regions == regions[-1] - 2
    at = rng.integers(0, 5000, 50)
    assert idx.region[at].tolist() == [regions[i] for i in at.tolist()] and idx.region[-1] == regions[-1]
    assert idx.region.local(at).tolist() == [regions[i] - 3 for i in at.tolist()]


def test_the_index_keeps_no_copy_of_the_sizes_and_a_bit_per_loaded_flag():
    sizes = np.full(100_000, 10, dtype=np.int64)
    idx = SampleIndex("ds", 0, sizes, 1 << 20)
    assert np.shares_memory(idx.length, sizes)
    assert idx.offset.nbytes + idx.crc.nbytes + idx.loaded.nbytes == 100_000 * 8 + 12_500


def test_loaded_bytes_follow_marks_and_clears():
    sizes = np.array([5, 6, 7, 8], dtype=np.int64)
    idx = SampleIndex("ds", 10, sizes, R)
    idx.mark_loaded(np.array([10, 12, 12]), np.array([1, 2, 3], dtype=np.uint32))
    assert (idx.loaded_count, idx.loaded_bytes, idx.total_bytes) == (2, 12, 26)
    idx.mark_loaded(np.array([12, 13]), np.array([4, 5], dtype=np.uint32))
    assert (idx.loaded_count, idx.loaded_bytes) == (3, 20) and idx.crc.tolist() == [1, 0, 4, 5]
    idx.clear(11, 13)
    assert (idx.loaded_count, idx.loaded_bytes) == (2, 13) and idx.loaded.tolist() == [True, False, False, True]


def test_an_index_saved_with_a_bool_per_flag_is_read(tmp_path):
    sizes = np.array([5, 6, 7], dtype=np.int64)
    meta = {"format": 1, "dataset": "ds", "lo": 0, "hi": 3, "region_size": R, "first_region": 0, "fingerprint": "f"}
    path = tmp_path / "i.npz"
    with open(path, "wb") as fh:
        np.savez(
            fh,
            meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
            length=sizes,
            crc=np.array([9, 0, 7], dtype=np.uint32),
            loaded=np.array([True, False, True]),
        )
    again = SampleIndex.load(path, dataset="ds", lo=0, sizes=sizes, region_size=R, fingerprint="f")
    assert again.loaded.tolist() == [True, False, True] and again.crc.tolist() == [9, 0, 7]
    assert again.loaded_bytes == 12
