"""The array ops against torchvision (``convert_image_dtype``, ``normalize``) and ``np.load``."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from torchvision.transforms import functional as F

from kspeed.preprocess import tensor

IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]


def ulps(a: np.ndarray, b: np.ndarray) -> int:
    """The largest distance in units in the last place between two ``float32`` arrays."""
    assert a.dtype == b.dtype == np.float32 and a.shape == b.shape
    return int(np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64)).max())


def unit_floats() -> np.ndarray:
    """``float32`` values in [0, 1]: random ones, every k/255, and their float neighbours (the bin edges)."""
    grid = np.arange(256, dtype=np.float32) / np.float32(255)
    random = np.random.default_rng(0).random(100_000, dtype=np.float32)
    return np.concatenate([random, grid, np.nextafter(grid, np.float32(0)), np.nextafter(grid, np.float32(1))])


def test_cast_uint8_to_float_equals_torchvision():
    x = np.random.default_rng(1).integers(0, 256, size=(3, 64, 64), dtype=np.uint8)
    x[0, :4, :] = np.arange(256).reshape(4, 64)  # every value
    expected = F.convert_image_dtype(torch.from_numpy(x), torch.float32).numpy()
    got = tensor.cast(x, dtype="float32")
    assert got.dtype == np.float32
    assert np.array_equal(got, expected)


@pytest.mark.parametrize(("source", "target"), [("float32", "uint8"), ("float64", "uint8"), ("float64", "int16")])
def test_cast_float_to_int_equals_torchvision(source, target):
    x = unit_floats().astype(source)
    expected = F.convert_image_dtype(torch.from_numpy(x), getattr(torch, target)).numpy()
    assert np.array_equal(tensor.cast(x, dtype=target), expected)


def test_cast_half_to_uint8_equals_torchvision_below_one():
    # torch multiplies half tensors in float32 and rounds back to half; 1.0 overflows there (see below).
    x = (unit_floats() * 0.99).astype(np.float16)
    expected = F.convert_image_dtype(torch.from_numpy(x), torch.uint8).numpy()
    assert np.array_equal(tensor.cast(x, dtype="uint8"), expected)


def test_cast_float_to_int_clamps_out_of_range():
    x = np.array([-0.5, -0.0, 0.0, 1.0, 1.5, 1e9], dtype=np.float32)
    assert tensor.cast(x, dtype="uint8").tolist() == [0, 0, 0, 255, 255, 255]
    # torchvision wraps half 1.0 to 0 (255.999 rounds to 256 in half precision); the clamp keeps it at 255.
    assert tensor.cast(np.array([1.0], np.float16), dtype="uint8").tolist() == [255]
    assert tensor.cast(np.array([-1.0, 1.0]), dtype="int8").tolist() == [-127, 127]


@pytest.mark.parametrize(
    ("source", "target"),
    [
        ("uint8", "int16"),
        ("int16", "uint8"),
        ("uint8", "int8"),
        ("int8", "uint8"),
        ("int32", "int16"),
        ("int16", "int64"),
        ("uint8", "float16"),
        ("int16", "float64"),
        ("int64", "float32"),
    ],
)
def test_cast_integer_sources_equal_torchvision(source, target):
    info = np.iinfo(source)
    x = np.random.default_rng(2).integers(info.min, info.max, size=50_000, endpoint=True).astype(source)
    x[:2] = [info.min, info.max]
    expected = F.convert_image_dtype(torch.from_numpy(x), getattr(torch, target)).numpy()
    got = tensor.cast(x, dtype=target)
    assert got.dtype == expected.dtype
    assert np.array_equal(got, expected)


def test_cast_without_scale_is_astype_and_same_dtype_is_identity():
    x = np.array([0.2, 3.7, 255.0], dtype=np.float32)
    assert tensor.cast(x, dtype="uint8", scale=False).tolist() == [0, 3, 255]
    assert tensor.cast(x, dtype=np.dtype("float32")) is x
    y = np.arange(4, dtype=np.uint8)
    assert tensor.cast(y, dtype="float64", scale=False).tolist() == [0.0, 1.0, 2.0, 3.0]


def test_cast_refuses_what_torchvision_refuses():
    for source, target in (("float32", "int32"), ("float32", "int64"), ("float64", "int64"), ("float16", "int16")):
        with pytest.raises(ValueError, match="cannot hold"):
            tensor.cast(np.zeros(2, source), dtype=target)
    with pytest.raises(RuntimeError, match="cannot be performed safely"):
        F.convert_image_dtype(torch.zeros(2), torch.int32)
    with pytest.raises(ValueError, match="unknown dtype"):
        tensor.cast(np.zeros(2), dtype="float8")
    with pytest.raises(ValueError, match="with scaling"):
        tensor.cast(np.zeros(2, bool), dtype="float32")


def test_normalize_equals_torchvision_within_one_ulp():
    x = np.random.default_rng(3).random((2, 3, 48, 40), dtype=np.float32)
    expected = F.normalize(torch.from_numpy(x), IMAGENET_MEAN, IMAGENET_STD).numpy()
    got = tensor.normalize(x, mean=IMAGENET_MEAN, std=IMAGENET_STD)
    assert got.dtype == np.float32
    assert ulps(got, expected) <= 1  # measured: 0 on CPU


def test_normalize_layouts_and_broadcast_values():
    x = np.random.default_rng(4).random((3, 16, 20), dtype=np.float32)
    chw = tensor.normalize(x, mean=IMAGENET_MEAN, std=IMAGENET_STD)
    hwc = tensor.normalize(x.transpose(1, 2, 0), mean=IMAGENET_MEAN, std=IMAGENET_STD, layout="hwc")
    assert np.array_equal(hwc.transpose(2, 0, 1), chw)
    one = tensor.normalize(x, mean=0.5, std=[0.25])
    assert np.array_equal(one, (x - np.float32(0.5)) / np.float32(0.25))
    half = tensor.normalize(x.astype(np.float16), mean=0.5, std=0.5)
    assert half.dtype == np.float32


def test_normalize_rejects_bad_input():
    x = np.zeros((3, 4, 4), np.float32)
    with pytest.raises(ValueError, match="std must not contain 0"):
        tensor.normalize(x, mean=IMAGENET_MEAN, std=[0.2, 0.0, 0.2])
    with pytest.raises(ValueError, match="2 values for 3 channels"):
        tensor.normalize(x, mean=[0.5, 0.5], std=IMAGENET_STD)
    with pytest.raises(ValueError, match="floating"):
        tensor.normalize(x.astype(np.uint8), mean=0.5, std=0.5)
    with pytest.raises(ValueError, match="at least 3 axes"):
        tensor.normalize(x[0], mean=0.5, std=0.5)
    with pytest.raises(ValueError, match="layout"):
        tensor.normalize(x, mean=0.5, std=0.5, layout="nchw")


def save(array: np.ndarray, version: tuple[int, int] | None = None) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, array, version=version)
    return buf.getvalue()


ARRAYS = {
    "float32": np.random.default_rng(5).random((3, 5, 7), dtype=np.float32),
    "int16": np.arange(-60, 60, dtype=np.int16).reshape(4, 30),
    "big-endian": np.arange(12, dtype=">f8").reshape(3, 4),
    "uint8": np.arange(200, dtype=np.uint8),
    "bool": np.array([[True, False], [False, True]]),
    "complex": np.array([1 + 2j, -3j], dtype=np.complex64),
    "scalar": np.array(7.5),
    "empty": np.zeros((0, 4), np.float32),
    "fortran": np.asfortranarray(np.arange(24, dtype=np.int32).reshape(2, 3, 4)),
    "strings": np.array(["a", "bcd"]),
    "structured": np.array([(1, 2.0), (3, 4.0)], dtype=[("a", "<i4"), ("b", "<f8")]),
}


@pytest.mark.parametrize("name", list(ARRAYS))
@pytest.mark.parametrize("version", [None, (2, 0), (3, 0)])
def test_npy_equals_np_load(name, version):
    array = ARRAYS[name]
    data = save(array, version)
    expected = np.load(io.BytesIO(data))
    got = tensor.npy(data)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert got.flags.f_contiguous == expected.flags.f_contiguous
    assert np.array_equal(got, expected)


def test_npy_views_the_payload_without_copying():
    array = np.random.default_rng(6).random((64, 64), dtype=np.float32)
    data = bytearray(save(array))
    view = tensor.npy(data)
    assert np.shares_memory(view, np.frombuffer(data, dtype=np.uint8))
    assert view.flags.writeable
    assert not tensor.npy(bytes(data)).flags.writeable
    assert np.array_equal(tensor.npy(np.frombuffer(bytes(data), dtype=np.uint8)), array)
    assert np.array_equal(tensor.npy(memoryview(data)), array)


def test_npy_refuses_objects_without_unpickling():
    buf = io.BytesIO()
    np.save(buf, np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="refusing to unpickle"):
        tensor.npy(buf.getvalue())


def header(text: str, version: int = 1) -> bytes:
    """A ``.npy`` prefix with ``text`` as its header."""
    raw = text.encode("latin1") + b"\n"
    size = len(raw).to_bytes(2 if version == 1 else 4, "little")
    return b"\x93NUMPY" + bytes([version, 0]) + size + raw


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"PK\x03\x04 not npy", "bad magic"),
        (b"\x93NUMPY", "no version"),
        (b"\x93NUMPY\x09\x00\x10\x00", "unsupported .npy version 9.0"),
        (b"\x93NUMPY\x01\x00", "no header length"),
        (b"\x93NUMPY\x01\x00\xff\xff", "exceeds the limit"),
        (b"\x93NUMPY\x01\x00\x40\x00{'descr'", "truncated .npy header"),
        (header("{'descr': '<f4', 'fortran_order': False, 'shape': (2,"), "not a Python literal"),
        (header("[1, 2, 3]"), "not a dictionary"),
        (header("{'descr': '<f4', 'shape': (2,)}"), "keys are"),
        (header("{'descr': '<f4', 'fortran_order': False, 'shape': (2, -1)}"), "bad shape"),
        (header("{'descr': '<f4', 'fortran_order': False, 'shape': [2]}"), "bad shape"),
        (header("{'descr': '<f4', 'fortran_order': 0, 'shape': (2,)}"), "bad fortran_order"),
        (header("{'descr': 'not-a-dtype', 'fortran_order': False, 'shape': (2,)}"), "bad descr"),
        (header("{'descr': '<f4', 'fortran_order': False, 'shape': (2,)}") + bytes(7), "payload is 7 bytes"),
        (header("{'descr': '<f4', 'fortran_order': False, 'shape': (2,)}") + bytes(9), "payload is 9 bytes"),
    ],
)
def test_npy_rejects_bad_files_naming_the_problem(data, message):
    with pytest.raises(ValueError, match=message):
        tensor.npy(data)
