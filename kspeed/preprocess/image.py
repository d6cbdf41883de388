"""Image ops on numpy arrays (HWC ``uint8``, or HW for mode ``"L"``), bit-exact with torchvision's PIL path.

Each op does what the torchvision transform of the same name does to a PIL image, through the same
Pillow calls, so a pipeline moved from a torchvision ``Compose`` to KSpeed yields the same bytes.
Random ops draw from the ``np.random.Generator`` they are given and from nothing else.
"""

from __future__ import annotations

import io
import math
import struct
from collections.abc import Sequence

import numpy as np
from PIL import Image

__all__ = [
    "INTERPOLATIONS",
    "LAYOUTS",
    "MODES",
    "PLANES",
    "center_crop",
    "decode_image",
    "flip",
    "pair",
    "pil_filter",
    "planes_shape",
    "random_resized_crop",
    "resize",
    "resized_crop_params",
    "to_chw",
    "write_planes",
]

INTERPOLATIONS: dict[str, Image.Resampling] = {
    "nearest": Image.Resampling.NEAREST,
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "lanczos": Image.Resampling.LANCZOS,
    "box": Image.Resampling.BOX,
    "hamming": Image.Resampling.HAMMING,
}
"""Interpolation names accepted by :func:`resize` and :func:`random_resized_crop`, as Pillow filters."""

MODES = ("RGB", "RGBA", "L")
"""Pillow modes :func:`decode_image` converts to: HWC with 3 or 4 channels, or HW."""

LAYOUTS = ("hwc", "hw", "chw")
"""Array layouts :func:`flip` understands."""

PLANES: dict[str, tuple[str, ...]] = {"RGB": ("R", "G", "B"), "RGBA": ("R", "G", "B", "A"), "L": ("L",)}
"""The bands, in order, of the Pillow modes :func:`write_planes` lays out as uint8 planes."""

# torchvision's RandomResizedCrop tries this many random boxes before falling back to a central crop.
_CROP_ATTEMPTS = 10

# What Pillow raises on input it cannot decode (truncated data, bad markers, broken chunks).
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, struct.error, Image.DecompressionBombError)


def decode_image(data: bytes | bytearray | memoryview | np.ndarray, *, mode: str = "RGB") -> np.ndarray:
    """Decode JPEG or PNG bytes exactly as torchvision's ``pil_loader`` does.

    ``Image.open`` then ``convert(mode)`` at Pillow's exact settings (no ``draft()``, the default
    integer DCT), so the pixels equal those of a torchvision ``ImageFolder``. EXIF orientation is
    not applied, as in torchvision.

    Args:
        data: the encoded file; a ``uint8`` array is read as its bytes.
        mode: ``"RGB"``, ``"RGBA"`` or ``"L"``.

    Returns:
        A writable ``uint8`` array, HWC (HW for ``"L"``).

    Raises:
        ValueError: the bytes are not an image Pillow can decode, or ``mode`` is unknown.
    """
    return np.array(decode_pil(data, mode=mode))


def decode_pil(data: bytes | bytearray | memoryview | np.ndarray, *, mode: str = "RGB") -> Image.Image:
    """:func:`decode_image` as the PIL image itself (the same pixels, without the array copy), for
    a pipeline whose next stage is a torchvision transform.

    Raises:
        ValueError: the bytes are not an image Pillow can decode, or ``mode`` is unknown.
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8:
            raise ValueError(f"encoded image must be uint8 bytes, got an array of {data.dtype}")
        data = np.ascontiguousarray(data).reshape(-1).data
    try:
        with Image.open(io.BytesIO(data)) as img:
            if img.format == "JPEG" and img.mode == mode:
                img.load()  # convert() would return a copy of these very pixels
                return img
            return img.convert(mode)
    except _DECODE_ERRORS as exc:
        raise ValueError(f"cannot decode image: {exc}") from exc


def resize(
    x: np.ndarray,
    *,
    size: int | Sequence[int],
    interpolation: str = "bilinear",
    antialias: bool = True,
    max_size: int | None = None,
) -> np.ndarray:
    """Resize like ``torchvision.transforms.functional.resize`` on a PIL image.

    An int (or one-element) ``size`` is the new shorter side; the longer side is
    ``int(size * long / short)``, then capped at ``max_size`` with the shorter side scaled down
    alike. A two-element ``size`` is ``[height, width]`` exactly. An image already at the target
    size is returned as is.

    Args:
        x: HWC or HW ``uint8`` image.
        size: target shorter side, or ``[height, width]``.
        interpolation: one of :data:`INTERPOLATIONS`.
        antialias: accepted for torchvision compatibility; Pillow always filters when it shrinks,
            so, as on torchvision's PIL path, it has no effect.
        max_size: bound on the longer side; only with a shorter-side ``size``.

    Raises:
        ValueError: bad ``size``, ``max_size`` or ``interpolation``.
    """
    del antialias  # Pillow has no non-antialiased resampling; torchvision ignores it for PIL too.
    height, width = x.shape[:2]
    out_h, out_w = _output_size(height, width, size, max_size)
    if (out_h, out_w) == (height, width):
        return x
    return _from_pil(_to_pil(x).resize((out_w, out_h), pil_filter(interpolation)), x)


def center_crop(x: np.ndarray, *, size: int | Sequence[int]) -> np.ndarray:
    """Crop the center like ``torchvision.transforms.functional.center_crop``.

    An image smaller than the crop is first zero-padded (the extra pixel of an odd padding going to
    the right or bottom); the offsets are ``round((dim - crop) / 2)`` with Python's round-half-even,
    so a difference of 1 gives offset 0 and a difference of 3 gives offset 2.

    Args:
        x: HWC or HW image.
        size: crop side, or ``[height, width]``.

    Returns:
        A contiguous array of ``size``.
    """
    crop_h, crop_w = pair(size, "size")
    height, width = x.shape[:2]
    if crop_h > height or crop_w > width:
        pad_top = (crop_h - height) // 2 if crop_h > height else 0
        pad_bottom = (crop_h - height + 1) // 2 if crop_h > height else 0
        pad_left = (crop_w - width) // 2 if crop_w > width else 0
        pad_right = (crop_w - width + 1) // 2 if crop_w > width else 0
        widths = [(pad_top, pad_bottom), (pad_left, pad_right)] + [(0, 0)] * (x.ndim - 2)
        x = np.pad(x, widths)
        height, width = x.shape[:2]
    top = round((height - crop_h) / 2.0)
    left = round((width - crop_w) / 2.0)
    return np.ascontiguousarray(x[top : top + crop_h, left : left + crop_w])


def resized_crop_params(
    height: int,
    width: int,
    rng: np.random.Generator,
    scale: Sequence[float] = (0.08, 1.0),
    ratio: Sequence[float] = (3 / 4, 4 / 3),
) -> tuple[int, int, int, int]:
    """The box of a random resized crop: torchvision's ``RandomResizedCrop.get_params`` drawing from ``rng``.

    Up to ten attempts draw an area fraction uniformly from ``scale`` and an aspect ratio
    log-uniformly from ``ratio``; the first box that fits is placed uniformly. When none fits, the
    whole image is cropped centrally to the nearest ratio within bounds.

    Args:
        height: image height.
        width: image width.
        rng: the stage's generator.
        scale: ``[low, high]`` fraction of the image area.
        ratio: ``[low, high]`` aspect ratio (width / height).

    Returns:
        ``(top, left, h, w)`` of the box.
    """
    area = height * width
    log_low, log_high = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(_CROP_ATTEMPTS):
        target_area = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_low, log_high))
        w = round(math.sqrt(target_area * aspect))
        h = round(math.sqrt(target_area / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return top, left, h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w = width
        h = round(w / min(ratio))
    elif in_ratio > max(ratio):
        h = height
        w = round(h * max(ratio))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def random_resized_crop(
    x: np.ndarray,
    rng: np.random.Generator,
    *,
    size: int | Sequence[int],
    scale: Sequence[float] = (0.08, 1.0),
    ratio: Sequence[float] = (3 / 4, 4 / 3),
    interpolation: str = "bilinear",
    antialias: bool = True,
) -> np.ndarray:
    """Crop a random box (:func:`resized_crop_params`) and resize it to ``size``, as ``RandomResizedCrop``.

    The crop and resize are those of ``torchvision.transforms.functional.resized_crop`` on a PIL
    image, so for the same box the pixels are identical.

    Args:
        x: HWC or HW ``uint8`` image.
        rng: the stage's generator.
        size: output side, or ``[height, width]``.
        scale: ``[low, high]`` fraction of the image area.
        ratio: ``[low, high]`` aspect ratio (width / height).
        interpolation: one of :data:`INTERPOLATIONS`.
        antialias: accepted for torchvision compatibility; no effect (see :func:`resize`).
    """
    del antialias
    out_h, out_w = pair(size, "size")
    top, left, h, w = resized_crop_params(x.shape[0], x.shape[1], rng, scale, ratio)
    img = _to_pil(x).crop((left, top, left + w, top + h))
    if (h, w) != (out_h, out_w):
        img = img.resize((out_w, out_h), pil_filter(interpolation))
    return _from_pil(img, x)


def flip(x: np.ndarray, rng: np.random.Generator, *, p: float = 0.5, layout: str = "hwc") -> np.ndarray:
    """Flip horizontally with probability ``p``, as torchvision's ``RandomHorizontalFlip``.

    Exactly one draw, ``rng.random() < p``, whatever ``p`` is, so later draws of the stage do not
    depend on it.

    Args:
        x: image in ``layout``.
        rng: the stage's generator.
        p: probability of flipping.
        layout: ``"hwc"`` or ``"hw"`` (width is axis 1) or ``"chw"`` (width is the last axis).

    Returns:
        A contiguous array, flipped or not.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {', '.join(LAYOUTS)}")
    if rng.random() < p:
        return np.ascontiguousarray(np.flip(x, axis=-1 if layout == "chw" else 1))
    return np.ascontiguousarray(x)


def to_chw(x: np.ndarray) -> np.ndarray:
    """HWC to contiguous CHW (HW to 1xHxW), as torchvision's ``PILToTensor``."""
    if x.ndim == 2:
        return np.ascontiguousarray(x[np.newaxis])
    if x.ndim != 3:
        raise ValueError(f"expected an HW or HWC image, got shape {x.shape}")
    return np.ascontiguousarray(x.transpose(2, 0, 1))


def planes_shape(img: object) -> tuple[int, int, int] | None:
    """The ``(channels, height, width)`` :func:`write_planes` gives ``img``, or None when it is not a
    PIL image of one of the :data:`PLANES` modes."""
    if not isinstance(img, Image.Image) or img.mode not in PLANES:
        return None
    return len(PLANES[img.mode]), img.height, img.width


def write_planes(img: Image.Image, out: np.ndarray) -> None:
    """Write ``img`` into ``out`` (uint8, :func:`planes_shape`'s bytes) as CHW planes: the bytes of
    ``np.array(img)`` transposed to CHW, as torchvision's ``PILToTensor`` holds them, each band
    packed straight from Pillow's pixels (no interleaved array, no transposing copy)."""
    plane = img.height * img.width
    for channel, band in enumerate(PLANES[img.mode]):
        out[channel * plane : (channel + 1) * plane] = np.frombuffer(img.tobytes("raw", band), dtype=np.uint8)


def _output_size(height: int, width: int, size: int | Sequence[int], max_size: int | None) -> tuple[int, int]:
    """torchvision's ``_compute_resized_output_size``: the ``(height, width)`` a resize produces."""
    if isinstance(size, (int, np.integer)):
        size = [int(size)]
    if len(size) == 2:
        if max_size is not None:
            raise ValueError("max_size applies only to a shorter-side size, not to [height, width]")
        return int(size[0]), int(size[1])
    if len(size) != 1:
        raise ValueError(f"size must be an int or have 1 or 2 elements, got {list(size)}")
    short, long = (width, height) if width <= height else (height, width)
    new_short = int(size[0])
    new_long = int(new_short * long / short)
    if max_size is not None:
        if max_size <= new_short:
            raise ValueError(f"max_size={max_size} must be greater than the shorter side size={new_short}")
        if new_long > max_size:
            new_short, new_long = int(max_size * new_short / new_long), max_size
    return (new_long, new_short) if width <= height else (new_short, new_long)


def pair(size: int | Sequence[int], name: str) -> tuple[int, int]:
    """``size`` as ``(height, width)``: an int or one element means a square."""
    if isinstance(size, (int, np.integer)):
        return int(size), int(size)
    if len(size) == 1:
        return int(size[0]), int(size[0])
    if len(size) == 2:
        return int(size[0]), int(size[1])
    raise ValueError(f"{name} must be an int or have 1 or 2 elements, got {list(size)}")


def pil_filter(interpolation: str) -> Image.Resampling:
    """The Pillow filter of an interpolation name of :data:`INTERPOLATIONS`."""
    try:
        return INTERPOLATIONS[interpolation]
    except KeyError:
        known = ", ".join(INTERPOLATIONS)
        raise ValueError(f"unknown interpolation {interpolation!r}; expected one of {known}") from None


def _to_pil(x: np.ndarray) -> Image.Image:
    """A PIL view of an HWC/HW array; a single channel is handled as mode ``"L"``."""
    if x.ndim == 3 and x.shape[2] == 1:
        x = x[:, :, 0]
    if x.ndim not in (2, 3):
        raise ValueError(f"expected an HW or HWC image, got shape {x.shape}")
    try:
        return Image.fromarray(np.ascontiguousarray(x))
    except TypeError as exc:
        raise ValueError(f"Pillow cannot hold an image of shape {x.shape} and dtype {x.dtype}") from exc


def _from_pil(img: Image.Image, like: np.ndarray) -> np.ndarray:
    """The array of ``img`` with the channel layout of ``like`` (a single channel keeps its axis)."""
    out = np.array(img)
    if like.ndim == 3 and like.shape[2] == 1:
        out = out[:, :, np.newaxis]
    return out
