"""Array ops on numpy arrays: dtype conversion, per-channel normalization, and the ``.npy`` decoder.

:func:`cast` and :func:`normalize` follow torchvision's ``ConvertImageDtype`` and ``Normalize`` on
tensors; :func:`npy` reads ``np.save`` files without ``np.load``, so it never unpickles.
"""

from __future__ import annotations

import ast
import struct
from collections.abc import Sequence

import numpy as np

__all__ = ["DTYPES", "NORMALIZE_LAYOUTS", "cast", "channel_stats", "check_scaled_cast", "normalize", "npy"]

DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name) for name in ("uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64")
}
"""The dtype names :func:`cast` accepts."""

NORMALIZE_LAYOUTS = {"chw": -3, "hwc": -1}
"""Layouts :func:`normalize` understands, with the channel axis of each."""

# torchvision maps [0, 1] floats to integers by multiplying by ``max + 1 - eps`` and truncating, so
# the top integer gets as wide a bin as the others instead of only 1.0 (vision PR #2078).
_FLOAT_TO_INT_EPS = 1e-3

_NPY_MAGIC = b"\x93NUMPY"
# The header-length field is 2 bytes in version 1 and 4 bytes in versions 2 and 3.
_NPY_LENGTH_FORMATS = {1: "<H", 2: "<I", 3: "<I"}
# np.load's default ``max_header_size``: larger headers are refused before they are parsed.
_NPY_MAX_HEADER = 10_000
_NPY_KEYS = {"descr", "fortran_order", "shape"}


def cast(x: np.ndarray, *, dtype: str | np.dtype, scale: bool = True) -> np.ndarray:
    """Convert ``x`` to ``dtype``, rescaling values like torchvision's ``ConvertImageDtype`` when ``scale``.

    With ``scale``: integers become floats divided by the integer type's maximum (``uint8`` /255);
    floats become integers as ``trunc(x * (max + 1 - 0.001))`` computed in the float type, which
    maps ``[0, 1]`` onto the whole integer range; integers to integers shift by the ratio of the
    ranges; floats to floats are a plain conversion. Out-of-range floats, which torchvision leaves
    undefined, are clamped to the integer range here. Without ``scale`` it is ``x.astype(dtype)``.
    An array already of ``dtype`` is returned as is.

    Args:
        x: the array.
        dtype: target dtype, one of :data:`DTYPES` by name or as ``np.dtype``.
        scale: rescale values to the target's range, as torchvision does.

    Raises:
        ValueError: an unknown dtype, or a float-to-integer conversion into an integer wider than the
            float's mantissa (``float16`` to ``int16`` and wider, ``float32`` to ``int32`` and wider,
            ``float64`` to ``int64``); torchvision refuses these too, except the ``float16`` ones,
            which overflow there.
    """
    target = _dtype(dtype)
    if x.dtype == target:
        return x
    if not scale:
        return x.astype(target)
    check_scaled_cast(x.dtype, target)
    if x.dtype.kind == "f":
        if target.kind == "f":
            return x.astype(target)
        info = np.iinfo(target)
        # torch multiplies half tensors in float32 and rounds the product back to half.
        compute = np.float32 if x.dtype == np.float16 else x.dtype.type
        scaled = (x.astype(compute, copy=False) * compute(info.max + 1.0 - _FLOAT_TO_INT_EPS)).astype(x.dtype)
        return np.clip(scaled, info.min, info.max).astype(target)
    in_max = int(np.iinfo(x.dtype).max)
    if target.kind == "f":
        return x.astype(target) / target.type(in_max)
    out_max = int(np.iinfo(target).max)
    if in_max > out_max:
        return (x // ((in_max + 1) // (out_max + 1))).astype(target)
    return x.astype(target) * target.type((out_max + 1) // (in_max + 1))


def normalize(
    x: np.ndarray, *, mean: float | Sequence[float], std: float | Sequence[float], layout: str = "chw"
) -> np.ndarray:
    """``(x - mean) / std`` per channel in ``float32``, as torchvision's ``Normalize`` on a float tensor.

    The subtraction and the division are done in ``float32`` with ``mean`` and ``std`` rounded to
    ``float32`` first, as torchvision does, so results equal ``F.normalize`` to within 1 ulp
    (measured: identical on CPU).

    Args:
        x: a floating array whose channel axis is given by ``layout``; leading batch axes are fine
            for ``"chw"``.
        mean: per-channel means, or one for all channels.
        std: per-channel standard deviations, or one for all channels.
        layout: ``"chw"`` (channels at axis -3) or ``"hwc"`` (channels last).

    Raises:
        ValueError: ``x`` is not floating, a ``std`` is 0, or ``mean``/``std`` do not match the channels.
    """
    if layout not in NORMALIZE_LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {', '.join(NORMALIZE_LAYOUTS)}")
    if x.dtype.kind != "f":
        raise ValueError(f"normalize needs a floating array, got {x.dtype}; cast it first")
    axis = NORMALIZE_LAYOUTS[layout]
    if x.ndim < -axis:
        raise ValueError(f"layout {layout!r} needs at least {-axis} axes, got shape {x.shape}")
    mean_c, std_c = channel_stats(mean, std, x.shape[axis])
    shape = (-1, 1, 1) if layout == "chw" else (-1,)
    return (x.astype(np.float32, copy=False) - mean_c.reshape(shape)) / std_c.reshape(shape)


def check_scaled_cast(source: np.dtype, target: np.dtype) -> None:
    """Refuse the scaled conversions :func:`cast` cannot do (see its Raises section).

    Raises:
        ValueError: ``source`` is neither integer nor float, or a float whose mantissa is narrower
            than the integer ``target``.
    """
    if source.kind not in "iuf":
        raise ValueError(f"cannot convert an array of {source} with scaling")
    if source.kind == "f" and target.kind in "iu":
        info = np.iinfo(target)
        if np.finfo(source).nmant < info.bits - (1 if info.min < 0 else 0):
            raise ValueError(f"cannot convert {source} to {target} with scaling: the float cannot hold its range")


def channel_stats(
    mean: float | Sequence[float], std: float | Sequence[float], channels: int
) -> tuple[np.ndarray, np.ndarray]:
    """``mean`` and ``std`` as ``float32`` vectors of one entry per channel (a single value is repeated).

    Raises:
        ValueError: a length other than 1 or ``channels``, or a ``std`` of 0.
    """
    mean_c = _per_channel(mean, channels, "mean")
    std_c = _per_channel(std, channels, "std")
    if not np.all(std_c):
        raise ValueError(f"std must not contain 0, got {std_c.tolist()}")
    return mean_c, std_c


def npy(data: bytes | bytearray | memoryview | np.ndarray) -> np.ndarray:
    """The array stored in ``.npy`` bytes (``np.save``'s format, versions 1 to 3), as a view of the payload.

    The header is read with :func:`ast.literal_eval` and the payload is not copied: the result is
    read-only when ``data`` is (``bytes``). Object dtypes are refused, so nothing is ever unpickled.

    Args:
        data: the file's bytes; a ``uint8`` array is read as its bytes.

    Returns:
        The array, with the stored dtype (byte order kept), shape and memory order.

    Raises:
        ValueError: a bad magic, version, header, dtype or payload size, naming which.
    """
    buf = memoryview(np.ascontiguousarray(data).reshape(-1).data if isinstance(data, np.ndarray) else data).cast("B")
    if bytes(buf[: len(_NPY_MAGIC)]) != _NPY_MAGIC:
        raise ValueError("not a .npy file: bad magic string")
    if len(buf) < len(_NPY_MAGIC) + 2:
        raise ValueError("truncated .npy header: no version")
    major, minor = buf[6], buf[7]
    length_format = _NPY_LENGTH_FORMATS.get(major)
    if length_format is None or minor != 0:
        raise ValueError(f"unsupported .npy version {major}.{minor}")
    start = len(_NPY_MAGIC) + 2 + struct.calcsize(length_format)
    if len(buf) < start:
        raise ValueError("truncated .npy header: no header length")
    (header_len,) = struct.unpack_from(length_format, buf, len(_NPY_MAGIC) + 2)
    if header_len > _NPY_MAX_HEADER:
        raise ValueError(f".npy header of {header_len} bytes exceeds the limit of {_NPY_MAX_HEADER}")
    offset = start + header_len
    if len(buf) < offset:
        raise ValueError(f"truncated .npy header: {header_len} bytes announced, {len(buf) - start} present")
    dtype, shape, fortran = _npy_header(bytes(buf[start:offset]), "utf-8" if major == 3 else "latin1")
    count = 1
    for dim in shape:
        count *= dim
    expected = count * dtype.itemsize
    if len(buf) - offset != expected:
        raise ValueError(f".npy payload is {len(buf) - offset} bytes but shape {shape} of {dtype.str} needs {expected}")
    if expected == 0:
        return np.zeros(shape, dtype=dtype, order="F" if fortran else "C")
    flat = np.frombuffer(buf, dtype=dtype, count=count, offset=offset)
    return flat.reshape(shape, order="F" if fortran else "C")


def _npy_header(raw: bytes, encoding: str) -> tuple[np.dtype, tuple[int, ...], bool]:
    """Parse the header dictionary of a ``.npy`` file into ``(dtype, shape, fortran_order)``."""
    try:
        header = ast.literal_eval(raw.decode(encoding))
    except (UnicodeDecodeError, SyntaxError, ValueError, MemoryError, RecursionError) as exc:
        raise ValueError(f".npy header is not a Python literal: {exc}") from exc
    if not isinstance(header, dict):
        raise ValueError(f".npy header is not a dictionary: {type(header).__name__}")
    if set(header) != _NPY_KEYS:
        raise ValueError(f".npy header keys are {sorted(map(str, header))}, expected {sorted(_NPY_KEYS)}")
    shape = header["shape"]
    if not isinstance(shape, tuple) or not all(type(dim) is int and dim >= 0 for dim in shape):
        raise ValueError(f".npy header has a bad shape: {shape!r}")
    fortran = header["fortran_order"]
    if not isinstance(fortran, bool):
        raise ValueError(f".npy header has a bad fortran_order: {fortran!r}")
    try:
        dtype = np.lib.format.descr_to_dtype(header["descr"])
    except (TypeError, ValueError) as exc:
        raise ValueError(f".npy header has a bad descr {header['descr']!r}: {exc}") from exc
    if dtype.hasobject:
        raise ValueError(f".npy holds Python objects (descr {header['descr']!r}); refusing to unpickle")
    return dtype, shape, fortran


def _dtype(dtype: str | np.dtype) -> np.dtype:
    name = np.dtype(dtype).name if isinstance(dtype, np.dtype) else dtype
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    return DTYPES[name]


def _per_channel(values: float | Sequence[float], channels: int, name: str) -> np.ndarray:
    """``values`` as a ``float32`` vector of one entry per channel (one value is repeated)."""
    vector = np.atleast_1d(np.asarray(values, dtype=np.float32))
    if vector.ndim != 1 or vector.size not in (1, channels):
        raise ValueError(f"{name} has {vector.size} values for {channels} channels")
    return np.broadcast_to(vector, (channels,))
