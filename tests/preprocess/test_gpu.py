"""The torch ops against their numpy twins: same draws, same integers, floats within stated ulps.

Everything runs on CPU tensors; the tests marked ``gpu`` repeat the comparisons on a CUDA device.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kspeed.errors import ConfigError
from kspeed.preprocess import gpu, image, tensor, volume
from kspeed.preprocess.rng import sample_rng
from tests.preprocess.photos import jpeg_crop

NO_GPU = not torch.cuda.is_available()
MEAN = [0.485, 0.456, 0.406]
STD = [0.229, 0.224, 0.225]


def ulps(a: np.ndarray, b: np.ndarray) -> int:
    assert a.dtype == b.dtype == np.float32 and a.shape == b.shape
    return int(np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64)).max())


@pytest.fixture(scope="module")
def jpeg() -> bytes:
    """A real photograph, 400x360, as JPEG q90."""
    return jpeg_crop(0, slice(10, 410), slice(100, 460))


@pytest.fixture(scope="module")
def batch(jpeg) -> np.ndarray:
    """Eight 3x64x80 uint8 crops of the photograph (NCHW)."""
    pixels = image.to_chw(image.decode_image(jpeg))
    return np.stack([pixels[:, 20 * i : 20 * i + 64, 30 * i : 30 * i + 80] for i in range(8)])


def rngs(count: int, stage: int = 4) -> list[np.random.Generator | None]:
    return [sample_rng(11, 2, sample, stage) for sample in range(count)]


def test_normalize_equals_numpy(batch):
    x = tensor.cast(batch, dtype="float32")
    got = gpu.apply_batch("normalize", torch.from_numpy(x), [None] * len(x), {"mean": MEAN, "std": STD})
    assert got.dtype == torch.float32
    assert ulps(got.numpy(), tensor.normalize(x, mean=MEAN, std=STD)) == 0
    hwc = np.ascontiguousarray(x[0].transpose(1, 2, 0))
    one = gpu.normalize(torch.from_numpy(hwc), mean=MEAN, std=STD, layout="hwc")
    assert ulps(one.numpy(), tensor.normalize(hwc, mean=MEAN, std=STD, layout="hwc")) == 0
    with pytest.raises(ValueError, match="std must not contain 0"):
        gpu.normalize(torch.from_numpy(x), mean=MEAN, std=[1.0, 0.0, 1.0])
    with pytest.raises(ValueError, match="floating"):
        gpu.normalize(torch.from_numpy(batch), mean=MEAN, std=STD)


@pytest.mark.parametrize(
    ("source", "target", "scale"),
    [
        ("uint8", "float32", True),
        ("float32", "uint8", True),
        ("float64", "int16", True),
        ("float16", "uint8", True),
        ("uint8", "int16", True),
        ("int16", "uint8", True),
        ("float32", "uint8", False),
    ],
)
def test_cast_equals_numpy(source, target, scale):
    rng = np.random.default_rng(0)
    if np.dtype(source).kind == "f":
        x = (rng.random(20_000) * 1.2 - 0.1).astype(source)  # a little outside [0, 1] too
        if not scale:
            x = np.abs(x) * 200
    else:
        info = np.iinfo(source)
        x = rng.integers(info.min, info.max, 20_000, endpoint=True).astype(source)
    got = gpu.cast(torch.from_numpy(x), dtype=target, scale=scale).numpy()
    expected = tensor.cast(x, dtype=target, scale=scale)
    assert got.dtype == expected.dtype
    assert np.array_equal(got, expected)


def test_cast_refusals_match_numpy():
    with pytest.raises(ValueError, match="cannot hold"):
        gpu.cast(torch.zeros(2), dtype="int32")
    with pytest.raises(ValueError, match="unknown dtype"):
        gpu.cast(torch.zeros(2), dtype="bfloat17")
    with pytest.raises(ValueError, match="with scaling"):
        gpu.cast(torch.zeros(2, dtype=torch.bool), dtype="float32")


@pytest.mark.parametrize("layout", ["chw", "hwc"])
def test_flip_batch_makes_the_cpu_choice_per_sample(batch, layout):
    samples = batch if layout == "chw" else np.ascontiguousarray(batch.transpose(0, 2, 3, 1))
    got = gpu.apply_batch("flip", torch.from_numpy(samples), rngs(len(samples)), {"layout": layout})
    flipped = 0
    for i, (sample, generator) in enumerate(zip(samples, rngs(len(samples)))):
        expected = image.flip(sample, generator, layout=layout)
        assert np.array_equal(got[i].numpy(), expected), i
        flipped += not np.array_equal(expected, sample)
    assert 0 < flipped < len(samples)
    one = gpu.flip(torch.from_numpy(samples[0]), sample_rng(11, 2, 0, 4), layout=layout)
    assert np.array_equal(one.numpy(), got[0].numpy())


def test_3d_ops_batch_make_the_cpu_choices():
    volumes = np.random.default_rng(2).poisson(2.0, size=(5, 2, 12, 10, 9)).astype(np.float32)
    crops = gpu.apply_batch("random_crop_3d", torch.from_numpy(volumes), rngs(5, 1), {"size": [8, 6, 5]})
    flips = gpu.apply_batch("flip_3d", torch.from_numpy(volumes), rngs(5, 2), {"p": 0.5})
    for i, volume_ in enumerate(volumes):
        assert np.array_equal(crops[i].numpy(), volume.random_crop_3d(volume_, rngs(5, 1)[i], size=[8, 6, 5]))
        assert np.array_equal(flips[i].numpy(), volume.flip_3d(volume_, rngs(5, 2)[i], p=0.5))
    assert crops.shape == (5, 2, 8, 6, 5) and crops.is_contiguous()
    assert len({tuple(c.flatten()[:8].tolist()) for c in crops}) == 5  # different samples, different crops


def test_log1p_within_one_ulp_of_numpy():
    x = np.random.default_rng(3).gamma(0.5, 50.0, size=(4, 16, 16, 16)).astype(np.float32)
    got = gpu.apply_batch("log1p", torch.from_numpy(x), [None] * 4, {})
    assert ulps(got.numpy(), volume.log1p(x)) <= 1


def test_decode_jpeg_on_cpu_matches_pillow(jpeg):
    got = gpu.decode_jpeg(jpeg, "cpu")
    expected = image.to_chw(image.decode_image(jpeg))
    assert got.dtype == torch.uint8 and tuple(got.shape) == expected.shape
    # Both are libjpeg-turbo at its default settings here: measured identical, not guaranteed.
    assert np.abs(got.numpy().astype(np.int16) - expected).max() <= 1
    assert torch.equal(gpu.decode_jpeg(np.frombuffer(jpeg, np.uint8)), got)
    with pytest.raises(ValueError, match="cannot decode JPEG"):
        gpu.decode_jpeg(jpeg[:100] + bytes(500))


def test_apply_batch_rejects_what_it_cannot_run(batch):
    x = torch.from_numpy(batch)
    with pytest.raises(ConfigError, match="'resize' has no GPU version") as info:
        gpu.apply_batch("resize", x, rngs(8), {"size": 32})
    assert "flip" in str(info.value)
    with pytest.raises(ConfigError) as bad:
        gpu.apply_batch("flip", x, rngs(8), {"p": 2})
    assert bad.value.field == "flip.p"
    with pytest.raises(ValueError, match="3 generators for a batch of 8"):
        gpu.apply_batch("flip", x, rngs(3), {})
    with pytest.raises(ValueError, match="needs every sample's generator"):
        gpu.apply_batch("flip", x, [*rngs(7), None], {})
    assert set(gpu.OPS) == {"normalize", "cast", "log1p", "flip", "random_crop_3d", "flip_3d"}


@pytest.mark.gpu
@pytest.mark.skipif(NO_GPU, reason="needs a CUDA GPU: torch.cuda.is_available() is False")
def test_ops_on_cuda_equal_numpy(batch):
    x = torch.from_numpy(batch).cuda()
    floats = gpu.apply_batch("cast", x, [None] * len(batch), {"dtype": "float32"})
    assert np.array_equal(floats.cpu().numpy(), tensor.cast(batch, dtype="float32"))
    normalized = gpu.apply_batch("normalize", floats, [None] * len(batch), {"mean": MEAN, "std": STD})
    expected = tensor.normalize(tensor.cast(batch, dtype="float32"), mean=MEAN, std=STD)
    assert ulps(normalized.cpu().numpy(), expected) <= 1
    back = gpu.apply_batch("cast", floats, [None] * len(batch), {"dtype": "uint8"})
    assert np.array_equal(back.cpu().numpy(), batch)
    flipped = gpu.apply_batch("flip", x, rngs(len(batch)), {"layout": "chw"})
    for i, generator in enumerate(rngs(len(batch))):
        assert np.array_equal(flipped[i].cpu().numpy(), image.flip(batch[i], generator, layout="chw"))
    volumes = np.random.default_rng(4).poisson(2.0, size=(3, 1, 16, 16, 16)).astype(np.float32)
    crops = gpu.apply_batch("random_crop_3d", torch.from_numpy(volumes).cuda(), rngs(3), {"size": [8, 8, 8]})
    for i, generator in enumerate(rngs(3)):
        assert np.array_equal(crops[i].cpu().numpy(), volume.random_crop_3d(volumes[i], generator, size=[8, 8, 8]))
    logs = gpu.apply_batch("log1p", torch.from_numpy(volumes).cuda(), [None] * 3, {})
    assert ulps(logs.cpu().numpy(), volume.log1p(volumes)) <= 2  # CUDA's log1pf is within 1 ulp of exact


@pytest.mark.gpu
@pytest.mark.skipif(NO_GPU, reason="needs a CUDA GPU: torch.cuda.is_available() is False")
def test_decode_jpeg_on_cuda_is_close_to_pillow(jpeg):
    got = gpu.decode_jpeg(jpeg, "cuda")
    assert got.device.type == "cuda" and got.dtype == torch.uint8
    expected = image.to_chw(image.decode_image(jpeg)).astype(np.int16)
    diff = np.abs(got.cpu().numpy().astype(np.int16) - expected)
    assert diff.mean() < 1.5  # nvJPEG's IDCT and upsampling differ: close, not bit-exact
