"""The region decoder: the boxes of ``RandomResizedCrop``, the pixels of decode-then-crop up to resampling,
deterministic, and Pillow's whole decode for what libjpeg-turbo cannot do."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torchvision.transforms import (
    Compose,
    InterpolationMode,
    PILToTensor,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
)

from kspeed.client.prep.offload import folder_pipeline
from kspeed.client.prep.workers import pil_file_loader
from kspeed.errors import ConfigError
from kspeed.preprocess import Output, Pipeline, Stage, image, jpeg_region, rng
from kspeed.preprocess.runner import Runner
from tests.preprocess.photos import sample_photographs

needs_decoder = pytest.mark.skipif(not jpeg_region.available(), reason="this install has no region decoder")


@pytest.mark.skipif(
    not (Path("/usr/include/jpeglib.h").exists() and shutil.which("cc")), reason="no libjpeg-turbo headers or compiler"
)
def test_the_region_decoder_is_built_where_libjpeg_turbo_and_a_compiler_are():
    # The extension is optional at install: where it could be built, its absence is a broken build,
    # not a reason for the tests below to skip.
    assert jpeg_region.available(), jpeg_region._MISSING
    assert jpeg_region.version() is not None and jpeg_region.version().startswith(("1.", "2.", "3."))


def encoded(photo: int, size: tuple[int, int], fmt: str = "JPEG", mode: str = "RGB", **save) -> bytes:
    """Sample photograph ``photo`` resized to ``size`` (width, height), converted to ``mode``, encoded."""
    buffer = io.BytesIO()
    Image.fromarray(sample_photographs()[photo]).resize(size).convert(mode).save(buffer, format=fmt, **save)
    return buffer.getvalue()


def decode_then_crop(data: bytes, seed: int, size: int) -> tuple[np.ndarray, tuple[int, int, int, int]]:
    """What Pillow's whole decode and the same box give (the box drawn as the region decoder draws it)."""
    whole = image.decode_pil(data)
    box = image.resized_crop_params(whole.height, whole.width, np.random.default_rng(seed))
    top, left, h, w = box
    resized = whole.resize((size, size), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h))
    return np.asarray(resized), box


@pytest.mark.parametrize(
    ("photo", "size", "save"),
    [
        (0, (640, 427), {"quality": 90}),  # 4:2:0
        (1, (500, 375), {"quality": 85, "subsampling": 0}),  # 4:4:4
        (0, (1600, 1200), {"quality": 90}),  # boxes large enough to decode at 1/2, 1/4
        (1, (480, 480), {"quality": 90, "progressive": True}),
    ],
    ids=["420", "444", "scaled", "progressive"],
)
@needs_decoder
def test_the_crop_is_the_box_of_random_resized_crop_decoded_from_its_region(photo, size, save):
    data = encoded(photo, size, **save)
    for seed in range(12):
        got = jpeg_region.decode_random_resized_crop(data, np.random.default_rng(seed), size=96)
        want, box = decode_then_crop(data, seed, 96)
        assert got.shape == (96, 96, 3) and got.dtype == np.uint8
        # The same box: only the resampling differs (torch's kernel against Pillow's; at a scale,
        # a DCT-domain reduction and the box rounded to whole scaled pixels), by a grey level or
        # two on average, a few at a scale; another box differs by tens.
        diff = np.abs(got.astype(int) - want.astype(int)).mean()
        scaled = min(box[2:]) >= 2 * 96
        assert diff < (6.0 if scaled else 1.5), (seed, box, diff)
        other, _ = decode_then_crop(data, seed + 100, 96)
        assert np.abs(got.astype(int) - other.astype(int)).mean() > 3 * diff, (seed, box)


@needs_decoder
def test_large_boxes_are_decoded_at_the_smallest_scale_that_keeps_the_output_size(monkeypatch):
    data = encoded(0, (1600, 1200))
    scales = []
    native = jpeg_region._NATIVE
    assert native is not None

    class Recording:
        header = staticmethod(native.header)

        @staticmethod
        def decode(data, top, left, height, width, denom):
            scales.append((height, width, denom))
            return native.decode(data, top, left, height, width, denom)

    monkeypatch.setattr(jpeg_region, "_NATIVE", Recording)
    for seed in range(20):
        jpeg_region.decode_random_resized_crop(data, np.random.default_rng(seed), size=[100, 120])
    assert max(d for _, _, d in scales) > 1  # some boxes were large enough for a scale
    for height, width, denom in scales:
        assert height >= 100 and width >= 120  # never fewer pixels than the output
        if denom < 8:  # and half as many again would have been too few (the region spans the box + 2)
            assert height < 2 * 100 + 2 or width < 2 * 120 + 2, (height, width, denom)


@needs_decoder
def test_the_same_sample_and_seed_give_the_same_bytes_and_another_seed_another_crop():
    data = encoded(1, (500, 375))
    first = jpeg_region.decode_random_resized_crop(data, np.random.default_rng(3), size=64)
    again = jpeg_region.decode_random_resized_crop(bytearray(data), np.random.default_rng(3), size=64)
    other = jpeg_region.decode_random_resized_crop(data, np.random.default_rng(4), size=64)
    assert np.array_equal(first, again)
    assert not np.array_equal(first, other)
    as_array = jpeg_region.decode_random_resized_crop(np.frombuffer(data, np.uint8), np.random.default_rng(3), size=64)
    assert np.array_equal(first, as_array)


@needs_decoder
def test_a_greyscale_jpeg_becomes_rgb():
    data = encoded(0, (400, 300), mode="L", quality=90)
    for seed in range(6):
        got = jpeg_region.decode_random_resized_crop(data, np.random.default_rng(seed), size=48)
        want, box = decode_then_crop(data, seed, 48)
        assert got.shape == (48, 48, 3)
        limit = 6.0 if min(box[2:]) >= 2 * 48 else 1.5
        assert np.abs(got.astype(int) - want.astype(int)).mean() < limit, (seed, box)


@pytest.mark.parametrize(("fmt", "mode"), [("PNG", "RGB"), ("JPEG", "CMYK")])
@needs_decoder
def test_what_libjpeg_turbo_cannot_decode_here_goes_through_pillows_whole_decode(fmt, mode):
    data = encoded(1, (320, 240), fmt=fmt, mode=mode)
    got = jpeg_region.decode_random_resized_crop(data, np.random.default_rng(9), size=40)
    whole = np.asarray(image.decode_pil(data))
    top, left, h, w = image.resized_crop_params(whole.shape[0], whole.shape[1], np.random.default_rng(9))
    crop = torch.from_numpy(whole[top : top + h, left : left + w].copy()).permute(2, 0, 1).unsqueeze(0)
    want = F.interpolate(crop, size=(40, 40), mode="bilinear", antialias=True)[0].permute(1, 2, 0).numpy()
    assert np.array_equal(got, want)  # exactly: the same decode, the same box, the same resize


@needs_decoder
@pytest.mark.parametrize("interpolation", ["box", "lanczos", "hamming"])
def test_filters_torch_lacks_are_pillows_on_the_fractional_box(interpolation):
    data = encoded(0, (1600, 1200))
    for seed in range(4):
        got = jpeg_region.decode_random_resized_crop(
            data, np.random.default_rng(seed), size=64, interpolation=interpolation
        )
        whole = image.decode_pil(data)
        top, left, h, w = image.resized_crop_params(whole.height, whole.width, np.random.default_rng(seed))
        want = whole.resize((64, 64), image.pil_filter(interpolation), box=(left, top, left + w, top + h))
        assert got.shape == (64, 64, 3) and np.abs(got.astype(int) - np.asarray(want, int)).mean() < 6.0


@needs_decoder
def test_broken_bytes_raise_what_the_decoder_says():
    # Only the rows down to the box's last are read: a file cut off before them fails (damage
    # below a box goes unnoticed for that crop, as with any region decoder).
    data = encoded(0, (400, 300), quality=90)
    with pytest.raises(ValueError, match="cannot decode image"):
        jpeg_region.decode_random_resized_crop(data[:700], np.random.default_rng(0), size=32)
    with pytest.raises(ValueError, match="cannot decode image"):
        jpeg_region.decode_random_resized_crop(b"not an image", np.random.default_rng(0), size=32)
    with pytest.raises(ValueError, match="uint8"):
        jpeg_region.decode_random_resized_crop(np.zeros(8, np.int32), np.random.default_rng(0), size=32)


@needs_decoder
def test_a_header_declaring_a_decompression_bomb_is_refused_before_anything_is_decoded(monkeypatch):
    data = bytearray(encoded(0, (64, 48)))
    sof = data.index(b"\xff\xc0")  # baseline frame header: length, precision, height, width
    data[sof + 5 : sof + 9] = (60000).to_bytes(2, "big") + (60000).to_bytes(2, "big")
    native = jpeg_region._NATIVE
    assert native is not None and native.header(bytes(data))[:2] == (60000, 60000)

    class NoDecode:
        header = staticmethod(native.header)

        @staticmethod
        def decode(*args):
            raise AssertionError("decoded a bomb")

    monkeypatch.setattr(jpeg_region, "_NATIVE", NoDecode)
    with pytest.raises(ValueError, match=r"declares 60000x60000 .* a decompression bomb"):
        jpeg_region.decode_random_resized_crop(bytes(data), np.random.default_rng(0), size=32)


@needs_decoder
def test_the_native_decoder_refuses_a_region_outside_the_image_or_a_scale_it_lacks():
    native = jpeg_region._NATIVE
    assert native is not None
    data = encoded(0, (400, 300))
    assert native.header(data)[:3] == (300, 400, 3)
    with pytest.raises(ValueError, match=r"outside the 150x200 image scaled by 1/2"):
        native.decode(data, 100, 0, 60, 10, 2)
    with pytest.raises(ValueError, match="scale denominator 3"):
        native.decode(data, 0, 0, 10, 10, 3)
    with pytest.raises(ValueError, match="empty region"):
        native.decode(data, 0, 0, 0, 10, 1)
    pixels, rows, columns, first = native.decode(data, 10, 37, 20, 30, 1)
    assert rows == 20 and first <= 37 and first + columns >= 67 and len(pixels) == rows * columns * 3


def test_an_install_without_the_region_decoder_refuses_the_stage_and_names_the_fix(monkeypatch):
    monkeypatch.setattr(jpeg_region, "_NATIVE", None)
    monkeypatch.setattr(jpeg_region, "_MISSING", "No module named 'kspeed.preprocess._jpegregion'")
    with pytest.raises(ConfigError, match="libjpeg62-turbo-dev") as caught:
        Stage("decode_random_resized_crop", {"size": 32})
    assert "_jpegregion" in str(caught.value)
    assert jpeg_region.version() is None


@needs_decoder
def test_a_stage_with_a_torchvision_successor_runs_on_the_pil_image():
    # The runner keeps the crop as the PIL image the torchvision transform takes; the bytes equal
    # the op's own array.
    data = encoded(1, (500, 375))
    output = Output(shape=(3, 56, 56), dtype="uint8", kind="tensor")
    pipeline_stages = [
        Stage("decode_random_resized_crop", {"size": 56}),
        Stage("torchvision.transforms:PILToTensor", {}, output=output),
    ]
    got = Runner(Pipeline(pipeline_stages)).run(data, seed=5, epoch=1, sample=3)
    alone = jpeg_region.decode_random_resized_crop(data, rng.sample_rng(5, 1, 3, 0), size=56)
    assert np.array_equal(got.numpy(), alone.transpose(2, 0, 1))


@needs_decoder
def test_wraps_region_decode_fuses_the_decode_and_a_leading_random_resized_crop():
    augment = Compose([RandomResizedCrop(64), RandomHorizontalFlip(), PILToTensor()])
    pipeline, _ = folder_pipeline(pil_file_loader, augment, region_decode=True)
    assert pipeline is not None
    assert [(s.op.rsplit(":", 1)[-1], s.place) for s in pipeline.stages] == [
        ("decode_random_resized_crop", "server"),
        ("RandomHorizontalFlip", "server"),
        ("PILToTensor", "server"),
    ]
    assert pipeline.stages[0].params == {
        "size": [64, 64],
        "scale": [0.08, 1.0],
        "ratio": [0.75, 4 / 3],
        "interpolation": "bilinear",
    }
    with pytest.raises(ConfigError, match="the first transform is Resize, not RandomResizedCrop"):
        folder_pipeline(
            pil_file_loader, Compose([Resize(80), RandomResizedCrop(64), PILToTensor()]), region_decode=True
        )
    exact = RandomResizedCrop(64, interpolation=InterpolationMode.NEAREST_EXACT)
    with pytest.raises(ConfigError, match="nearest-exact"):
        folder_pipeline(pil_file_loader, Compose([exact, PILToTensor()]), region_decode=True)
