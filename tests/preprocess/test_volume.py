"""The volume ops against torch (``log1p``) and against their specified draws (crop offsets, flips)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kspeed.preprocess import volume
from kspeed.preprocess.rng import sample_rng


def ulps(a: np.ndarray, b: np.ndarray) -> int:
    assert a.dtype == b.dtype == np.float32 and a.shape == b.shape
    return int(np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64)).max())


@pytest.mark.parametrize(
    "values",
    [
        np.random.default_rng(0).poisson(3.0, size=(4, 32, 32, 32)).astype(np.int16),  # CosmoFlow-like counts
        np.random.default_rng(1).gamma(0.5, 50.0, size=200_000),
        np.random.default_rng(2).uniform(-0.999, 1e4, size=200_000).astype(np.float32),
        np.random.default_rng(3).uniform(-1e-6, 1e-6, size=10_000).astype(np.float32),
    ],
)
def test_log1p_equals_torch_within_one_ulp(values):
    expected = torch.log1p(torch.from_numpy(values).to(torch.float32)).numpy()
    got = volume.log1p(values)
    assert got.dtype == np.float32 and got.shape == values.shape
    assert ulps(got, expected) <= 1


def test_crop_offsets_are_uniform_draws_in_d_h_w_order():
    x = np.random.default_rng(4).random((2, 20, 18, 16), dtype=np.float32)
    size = [8, 10, 16]
    for sample in range(10):
        twin = sample_rng(9, 0, sample, 3)
        d0, h0, w0 = (int(twin.integers(0, n - s + 1)) for n, s in zip(x.shape[1:], size))
        got = volume.random_crop_3d(x, sample_rng(9, 0, sample, 3), size=size)
        assert got.shape == (2, 8, 10, 16) and got.flags.c_contiguous
        assert np.array_equal(got, x[:, d0 : d0 + 8, h0 : h0 + 10, w0:])
        assert not np.shares_memory(got, x)


def test_crop_covers_every_offset_and_differs_across_samples():
    x = np.arange(10 * 4 * 4, dtype=np.int32).reshape(10, 4, 4)
    firsts = {int(volume.random_crop_3d(x, sample_rng(0, 0, s, 0), size=(3, 4, 4))[0, 0, 0]) for s in range(200)}
    assert firsts == {16 * d for d in range(8)}  # all 8 depth offsets occur, nothing else
    again = volume.random_crop_3d(x, sample_rng(0, 0, 5, 0), size=(3, 4, 4))
    assert np.array_equal(again, volume.random_crop_3d(x, sample_rng(0, 0, 5, 0), size=(3, 4, 4)))


def test_crop_rejects_small_volumes_and_bad_sizes():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="smaller than the crop"):
        volume.random_crop_3d(np.zeros((8, 8, 8)), rng, size=[9, 4, 4])
    with pytest.raises(ValueError, match=r"\[d, h, w\]"):
        volume.random_crop_3d(np.zeros((8, 8, 8)), rng, size=[4, 4])
    with pytest.raises(ValueError, match="at least 3 axes"):
        volume.random_crop_3d(np.zeros((8, 8)), rng, size=[4, 4, 4])
    whole = volume.random_crop_3d(np.ones((2, 3, 4)), rng, size=[2, 3, 4])
    assert whole.shape == (2, 3, 4)


def test_flip_3d_draws_one_per_axis_in_order():
    x = np.random.default_rng(5).random((3, 6, 7, 8), dtype=np.float32)
    seen = set()
    for sample in range(32):
        twin = sample_rng(1, 1, sample, 2)
        chosen = tuple(axis for axis in (-3, -2, -1) if twin.random() < 0.5)
        rng = sample_rng(1, 1, sample, 2)
        got = volume.flip_3d(x, rng)
        assert rng.random() == twin.random()  # exactly three draws were consumed
        assert np.array_equal(got, np.flip(x, axis=chosen) if chosen else x)
        assert got.flags.c_contiguous
        seen.add(chosen)
    assert len(seen) >= 6  # the eight combinations come up, not one fixed choice


def test_flip_3d_probability_edges_and_axes():
    x = np.arange(2 * 3 * 4, dtype=np.int16).reshape(2, 3, 4)
    rng = np.random.default_rng(0)
    assert np.array_equal(volume.flip_3d(x, rng, p=0.0), x)
    assert np.array_equal(volume.flip_3d(x, rng, p=1.0), x[::-1, ::-1, ::-1])
    assert np.array_equal(volume.flip_3d(x, rng, p=1.0, axes=[1]), x[:, ::-1])
    with pytest.raises(ValueError, match="out of range"):
        volume.flip_3d(x, rng, axes=[3])
    with pytest.raises(ValueError, match="twice"):
        volume.flip_3d(x, rng, axes=[2, -1])
