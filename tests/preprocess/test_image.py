"""The image ops against torchvision's PIL path and Pillow, bit for bit, on real photographs."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.datasets.folder import pil_loader
from torchvision.transforms import InterpolationMode, RandomResizedCrop
from torchvision.transforms import functional as F

from kspeed.preprocess import image
from kspeed.preprocess.rng import sample_rng
from tests.preprocess.photos import sample_photographs

MODES = {
    "nearest": InterpolationMode.NEAREST,
    "bilinear": InterpolationMode.BILINEAR,
    "bicubic": InterpolationMode.BICUBIC,
    "lanczos": InterpolationMode.LANCZOS,
    "box": InterpolationMode.BOX,
    "hamming": InterpolationMode.HAMMING,
}


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> dict[str, tuple[bytes, str]]:
    """Two photographs (portrait 400x360, landscape 360x480) as JPEG q90 and PNG: name -> (bytes, path)."""
    china, flower = sample_photographs()
    crops = {"china": china[10:410, 100:460], "flower": flower[20:380, 50:530]}
    folder = tmp_path_factory.mktemp("photos")
    out = {}
    for name, pixels in crops.items():
        for fmt, options in (("jpeg", {"quality": 90}), ("png", {})):
            buf = io.BytesIO()
            Image.fromarray(pixels).save(buf, format=fmt.upper(), **options)
            path = folder / f"{name}.{fmt}"
            path.write_bytes(buf.getvalue())
            out[f"{name}.{fmt}"] = (buf.getvalue(), str(path))
    return out


@pytest.fixture(scope="module")
def pictures(photos) -> dict[str, Image.Image]:
    """The decoded JPEGs as torchvision's loader gives them."""
    return {name: pil_loader(path) for name, (_, path) in photos.items() if name.endswith(".jpeg")}


def test_decode_equals_torchvision_pil_loader(photos):
    for name, (data, path) in photos.items():
        decoded = image.decode_image(data)
        expected = np.asarray(pil_loader(path))
        assert decoded.dtype == np.uint8 and decoded.shape == expected.shape, name
        assert np.array_equal(decoded, expected), name
        assert decoded.flags.writeable


def test_decode_modes_and_input_types(photos):
    data, path = photos["china.jpeg"]
    gray = image.decode_image(data, mode="L")
    assert gray.ndim == 2
    assert np.array_equal(gray, np.asarray(Image.open(path).convert("L")))
    rgba = image.decode_image(data, mode="RGBA")
    assert rgba.shape[2] == 4 and np.all(rgba[..., 3] == 255)
    reference = image.decode_image(data)
    for variant in (bytearray(data), memoryview(data), np.frombuffer(data, dtype=np.uint8)):
        assert np.array_equal(image.decode_image(variant), reference)


@pytest.mark.parametrize(
    "corrupt",
    [b"", b"not an image at all", "truncated", "garbled"],
)
def test_decode_rejects_corrupt_input(photos, corrupt):
    data = photos["flower.jpeg"][0]
    if corrupt == "truncated":
        corrupt = data[: len(data) // 2]
    elif corrupt == "garbled":
        corrupt = data[:2] + bytes(200) + data[202:]
    with pytest.raises(ValueError, match="cannot decode image"):
        image.decode_image(corrupt)


def test_decode_rejects_unknown_mode(photos):
    with pytest.raises(ValueError, match="unknown mode"):
        image.decode_image(photos["china.jpeg"][0], mode="YCbCr")


@pytest.mark.parametrize("interpolation", list(MODES))
@pytest.mark.parametrize(
    ("size", "max_size"),
    [(224, None), ([193], None), ([150, 333], None), (256, 300), (480, None)],
)
def test_resize_equals_torchvision(pictures, interpolation, size, max_size):
    for name, pil in pictures.items():
        expected = F.resize(pil, size, interpolation=MODES[interpolation], max_size=max_size)
        got = image.resize(np.asarray(pil), size=size, interpolation=interpolation, max_size=max_size)
        assert got.shape[:2] == (expected.height, expected.width), name
        assert np.array_equal(got, np.asarray(expected)), name


def test_resize_gray_and_single_channel(pictures):
    pil = pictures["flower.jpeg"].convert("L")
    expected = np.asarray(F.resize(pil, 100))
    assert np.array_equal(image.resize(np.asarray(pil), size=100), expected)
    single = image.resize(np.asarray(pil)[:, :, None], size=100)
    assert single.shape == (*expected.shape, 1)
    assert np.array_equal(single[:, :, 0], expected)


def test_resize_to_same_size_returns_input(pictures):
    x = np.asarray(pictures["china.jpeg"])
    assert image.resize(x, size=list(x.shape[:2])) is x


def test_resize_rejects_bad_size_combinations(pictures):
    x = np.asarray(pictures["china.jpeg"])
    with pytest.raises(ValueError, match="max_size"):
        image.resize(x, size=[100, 100], max_size=200)
    with pytest.raises(ValueError, match="max_size"):
        image.resize(x, size=200, max_size=200)
    with pytest.raises(ValueError, match="interpolation"):
        image.resize(x, size=100, interpolation="cubic")


@pytest.mark.parametrize("size", [224, [224], [201, 173], [399, 359], [401, 100], [100, 361], [450, 500], [3, 4]])
def test_center_crop_equals_torchvision(pictures, size):
    for name, pil in pictures.items():
        expected = np.asarray(F.center_crop(pil, size))
        got = image.center_crop(np.asarray(pil), size=size)
        assert got.flags.c_contiguous
        assert np.array_equal(got, expected), name


def test_center_crop_gray_with_padding(pictures):
    pil = pictures["china.jpeg"].convert("L")
    expected = np.asarray(F.center_crop(pil, [405, 367]))
    assert np.array_equal(image.center_crop(np.asarray(pil), size=[405, 367]), expected)


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic", "nearest", "lanczos"])
@pytest.mark.parametrize("size", [224, [160, 96]])
def test_random_resized_crop_equals_torchvision_resized_crop(pictures, interpolation, size):
    for sample, (name, pil) in enumerate(pictures.items()):
        x = np.asarray(pil)
        for epoch in range(4):
            top, left, h, w = image.resized_crop_params(x.shape[0], x.shape[1], sample_rng(7, epoch, sample, 1))
            out_size = [size, size] if isinstance(size, int) else size
            expected = F.resized_crop(pil, top, left, h, w, out_size, interpolation=MODES[interpolation])
            got = image.random_resized_crop(x, sample_rng(7, epoch, sample, 1), size=size, interpolation=interpolation)
            assert np.array_equal(got, np.asarray(expected)), (name, epoch)


class TorchDraws:
    """A stand-in generator that draws exactly what torchvision's ``get_params`` draws from torch."""

    def uniform(self, low: float, high: float) -> float:
        return torch.empty(1).uniform_(low, high).item()

    def integers(self, low: int, high: int) -> int:
        return int(torch.randint(low, high, size=(1,)).item())


@pytest.mark.parametrize(
    ("shape", "scale", "ratio"),
    [
        ((400, 360), (0.08, 1.0), (3 / 4, 4 / 3)),
        ((360, 480), (0.5, 1.0), (0.5, 2.0)),
        ((60, 500), (0.6, 1.0), (3 / 4, 4 / 3)),  # wide: attempts fail often, falls back to a central crop
        ((500, 60), (0.9, 1.0), (3 / 4, 4 / 3)),
    ],
)
def test_resized_crop_params_follow_torchvision_algorithm(shape, scale, ratio):
    """Fed torch's draws, the box is torchvision's: same attempts, order of draws, rounding and fallback."""
    pil = Image.new("RGB", (shape[1], shape[0]))
    for seed in range(200):
        torch.manual_seed(seed)
        expected = RandomResizedCrop.get_params(pil, list(scale), list(ratio))
        torch.manual_seed(seed)
        got = image.resized_crop_params(shape[0], shape[1], TorchDraws(), scale, ratio)
        assert got == tuple(expected), seed


def test_resized_crop_params_fallback_is_central():
    # No box of 5x to 6x the area fits, so all ten attempts fail and the crop is central.
    assert image.resized_crop_params(100, 400, np.random.default_rng(0), (5.0, 6.0), (3 / 4, 4 / 3)) == (
        0,
        133,
        100,
        133,
    )
    # Too tall for the ratio bounds: the full width, the height of the lowest ratio, centered.
    assert image.resized_crop_params(300, 200, np.random.default_rng(0), (5.0, 6.0), (3 / 4, 4 / 3)) == (
        16,
        0,
        267,
        200,
    )
    # Within the bounds: the whole image.
    assert image.resized_crop_params(300, 240, np.random.default_rng(0), (5.0, 6.0), (3 / 4, 4 / 3)) == (0, 0, 300, 240)


def test_random_resized_crop_is_a_function_of_the_stage_key(pictures):
    x = np.asarray(pictures["china.jpeg"])
    first = image.random_resized_crop(x, sample_rng(1, 2, 3, 4), size=64)
    again = image.random_resized_crop(x, sample_rng(1, 2, 3, 4), size=64)
    assert np.array_equal(first, again)
    boxes = {image.resized_crop_params(400, 360, sample_rng(1, 2, sample, 4)) for sample in range(20)}
    assert len(boxes) == 20
    other_epoch = image.random_resized_crop(x, sample_rng(1, 3, 3, 4), size=64)
    assert not np.array_equal(first, other_epoch)


def test_flip_equals_hflip_and_draws_once(pictures):
    pil = pictures["flower.jpeg"]
    x = np.asarray(pil)
    flipped = np.asarray(F.hflip(pil))
    flips = 0
    for sample in range(40):
        twin = sample_rng(0, 0, sample, 2)
        chosen = twin.random() < 0.5
        rng = sample_rng(0, 0, sample, 2)
        got = image.flip(x, rng)
        assert rng.random() == twin.random()  # exactly one draw was consumed
        assert np.array_equal(got, flipped if chosen else x)
        assert got.flags.c_contiguous
        flips += chosen
    assert 5 < flips < 35


def test_flip_probability_edges_and_layouts(pictures):
    x = np.asarray(pictures["china.jpeg"])
    rng = np.random.default_rng(0)
    assert all(np.array_equal(image.flip(x, rng, p=0.0), x) for _ in range(10))
    assert all(np.array_equal(image.flip(x, rng, p=1.0), x[:, ::-1]) for _ in range(10))
    chw = image.to_chw(x)
    assert np.array_equal(image.flip(chw, rng, p=1.0, layout="chw"), chw[:, :, ::-1])
    gray = x[:, :, 0]
    assert np.array_equal(image.flip(gray, rng, p=1.0, layout="hw"), gray[:, ::-1])
    with pytest.raises(ValueError, match="layout"):
        image.flip(x, rng, layout="nhwc")


def test_decoding_a_jpeg_in_its_own_mode_gives_torchvisions_pixels_without_a_copy(photos):
    data, path = photos["china.jpeg"]
    decoded = image.decode_pil(data)
    assert decoded.mode == "RGB" and decoded.format == "JPEG"  # the decoded image itself, no convert() copy
    assert np.array_equal(np.asarray(decoded), np.asarray(pil_loader(path)))
    assert np.array_equal(np.asarray(image.decode_pil(data, mode="L")), np.asarray(Image.open(path).convert("L")))
    assert image.decode_pil(photos["china.png"][0]).format is None  # another format: converted, as before


def test_planes_are_the_bytes_of_pil_to_tensor(pictures):
    china = pictures["china.jpeg"]
    for pil in (china, china.convert("L"), china.convert("RGBA"), china.crop((3, 5, 120, 97))):
        expected = F.pil_to_tensor(pil).numpy()
        assert image.planes_shape(pil) == expected.shape
        out = np.zeros(expected.size + 7, np.uint8)
        image.write_planes(pil, out[: expected.size])
        assert np.array_equal(out[: expected.size], expected.reshape(-1)) and not out[expected.size :].any()
    assert image.planes_shape(china.convert("P")) is None and image.planes_shape(np.asarray(china)) is None


def test_to_chw_equals_pil_to_tensor(pictures):
    for pil in (pictures["china.jpeg"], pictures["flower.jpeg"].convert("L")):
        expected = F.pil_to_tensor(pil).numpy()
        got = image.to_chw(np.asarray(pil))
        assert got.shape == expected.shape and got.flags.c_contiguous
        assert np.array_equal(got, expected)
    with pytest.raises(ValueError, match="HW or HWC"):
        image.to_chw(np.zeros((2, 3, 4, 5), np.uint8))
