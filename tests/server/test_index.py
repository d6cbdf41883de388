"""Sample index: layout, vectorized lookup over a shuffled epoch, persistence."""

from __future__ import annotations

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
