"""Decode only the region a random resized crop keeps: an opt-in fast path for decode + ``RandomResizedCrop``.

The commonest image pipeline decodes a whole photograph and then keeps a random box of it,
8-100% of its area, resized to 224x224. :func:`decode_random_resized_crop` draws the box first,
from the JPEG header's size (:func:`kspeed.preprocess.image.resized_crop_params`, torchvision's
``RandomResizedCrop.get_params`` from the stage's generator), then has libjpeg-turbo decode only
that box (``kspeed.preprocess._jpegregion``, as DALI's ``image_random_crop`` does):

- rows above the box are skipped without their inverse DCT and colour conversion, rows below it
  are never read, and columns beside it are not transformed (widened to whole MCUs);
- when the box is at least twice the output size, it is decoded scaled by 1/2, 1/4 or 1/8 in the
  DCT domain (libjpeg's SIMD scaled IDCTs) to the smallest scale that still has as many pixels
  as the output in each direction;
- the box is then resampled to ``size``: bilinear and bicubic by torch's antialiased uint8 kernel
  (torchvision's tensor path, two to three times faster than Pillow's here, and the same bytes
  under every ``ATEN_CPU_CAPABILITY``), at a scale on the box rounded to whole scaled pixels; the
  other filters by Pillow's, fractional edges included.

What the model sees is therefore **a different but equally distributed augmentation**: the same
boxes with the same probabilities as ``RandomResizedCrop``, and pixels that differ from
decode-then-crop by the resampling (a DCT-domain reduction, then the filter). It is still
deterministic: the same sample, seed, epoch and stage give the same bytes on any host with the
same libjpeg-turbo, Pillow and torch (servers report them, and a split between hosts that differ
is refused). Images that are not baseline or progressive YCbCr/RGB/greyscale JPEGs (PNG, CMYK),
and JPEGs libjpeg finds corrupt, go through Pillow's full decode with the same box (and fail as
:func:`kspeed.preprocess.image.decode_image` would).
Only the data down to the box's last row is read, so damage below a box goes unnoticed for
that crop (as with any region decoder); a later epoch's box that reaches it fails.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Sequence
from types import ModuleType

import numpy as np
from PIL import Image

from kspeed.errors import ConfigError
from kspeed.preprocess import image

__all__ = ["available", "decode_random_resized_crop", "decode_random_resized_crop_pil", "require", "version"]

#: Scale denominators libjpeg-turbo decodes with SIMD scaled IDCTs, the largest first.
DENOMINATORS = (8, 4, 2, 1)


def _load() -> tuple[ModuleType | None, str]:
    try:
        return importlib.import_module("kspeed.preprocess._jpegregion"), ""
    except ImportError as exc:
        return None, str(exc)


_NATIVE, _MISSING = _load()


def available() -> bool:
    """Whether this install has the region decoder (built against libjpeg-turbo's headers)."""
    return _NATIVE is not None


def version() -> str | None:
    """The libjpeg-turbo the region decoder was built against (``"2.1.5"``), ``None`` without it."""
    if _NATIVE is None:
        return None
    number = int(getattr(_NATIVE, "LIBJPEG_TURBO_VERSION_NUMBER", 0))
    return f"{number // 1000000}.{number // 1000 % 1000}.{number % 1000}" if number else "libjpeg"


def require() -> None:
    """Raise unless the region decoder is here.

    Raises:
        ConfigError: naming what is missing and how to build it.
    """
    if _NATIVE is None:
        raise ConfigError(
            "decode_random_resized_crop needs KSpeed's region decoder (kspeed.preprocess._jpegregion), which "
            f"this install lacks ({_MISSING}); install libjpeg-turbo's headers (Debian: libjpeg62-turbo-dev, "
            "Fedora: libjpeg-turbo-devel) and a C compiler, then reinstall KSpeed",
            field="pipeline",
            value="decode_random_resized_crop",
        )


def decode_random_resized_crop(
    data: bytes | bytearray | memoryview | np.ndarray,
    rng: np.random.Generator,
    *,
    size: int | Sequence[int],
    scale: Sequence[float] = (0.08, 1.0),
    ratio: Sequence[float] = (3 / 4, 4 / 3),
    interpolation: str = "bilinear",
) -> np.ndarray:
    """Decode the bytes of an image and keep a random resized crop, decoding only the crop's region.

    Args:
        data: the encoded file; a ``uint8`` array is read as its bytes.
        rng: the stage's generator.
        size: output side, or ``[height, width]``.
        scale: ``[low, high]`` fraction of the image area.
        ratio: ``[low, high]`` aspect ratio (width / height).
        interpolation: one of :data:`kspeed.preprocess.image.INTERPOLATIONS`.

    Returns:
        An HWC ``uint8`` RGB array of ``size``.

    Raises:
        ConfigError: this install has no region decoder (:func:`require`).
        ValueError: the bytes are not an image Pillow or libjpeg can decode.
    """
    return np.array(
        decode_random_resized_crop_pil(data, rng, size=size, scale=scale, ratio=ratio, interpolation=interpolation)
    )


def decode_random_resized_crop_pil(
    data: bytes | bytearray | memoryview | np.ndarray,
    rng: np.random.Generator,
    *,
    size: int | Sequence[int],
    scale: Sequence[float] = (0.08, 1.0),
    ratio: Sequence[float] = (3 / 4, 4 / 3),
    interpolation: str = "bilinear",
) -> Image.Image:
    """:func:`decode_random_resized_crop` as the RGB PIL image, for a pipeline whose next stage is a
    torchvision transform."""
    require()
    assert _NATIVE is not None
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8:
            raise ValueError(f"encoded image must be uint8 bytes, got an array of {data.dtype}")
        data = np.ascontiguousarray(data).reshape(-1).data
    out_h, out_w = image.pair(size, "size")
    image.pil_filter(interpolation)  # an unknown name fails before any decode
    try:
        height, width, _, _ = _NATIVE.header(data)
    except ValueError:  # not a JPEG: Pillow decodes it whole
        whole = np.array(image.decode_pil(data, mode="RGB"))  # writable, as torch wants
        top, left, h, w = image.resized_crop_params(whole.shape[0], whole.shape[1], rng, scale, ratio)
        return _resample(whole, (left, top, left + w, top + h), (out_h, out_w), interpolation)
    _check_size(height, width)
    top, left, h, w = image.resized_crop_params(height, width, rng, scale, ratio)
    denom = next(d for d in DENOMINATORS if d == 1 or (h // d >= out_h and w // d >= out_w))
    # The box in the image scaled by 1/denom (libjpeg rounds the scaled size up), and the whole
    # rows and columns that cover it.
    y0, x0, y1, x1 = top / denom, left / denom, (top + h) / denom, (left + w) / denom
    first_row, first_col = math.floor(y0), math.floor(x0)
    rows = min(math.ceil(y1), -(-height // denom)) - first_row
    cols = min(math.ceil(x1), -(-width // denom)) - first_col
    try:
        pixels, rows, columns, kept = _NATIVE.decode(data, first_row, first_col, rows, cols, denom)
    except ValueError:  # a colour space without RGB (CMYK), or data libjpeg finds corrupt
        whole = np.array(image.decode_pil(data, mode="RGB"))  # writable, as torch wants
        return _resample(whole, (left, top, left + w, top + h), (out_h, out_w), interpolation)
    block = np.frombuffer(pixels, np.uint8).reshape(rows, columns, 3)
    return _resample(block, (x0 - kept, y0 - first_row, x1 - kept, y1 - first_row), (out_h, out_w), interpolation)


def _check_size(height: int, width: int) -> None:
    """Refuse a header that declares more than twice Pillow's ``Image.MAX_IMAGE_PIXELS``, as Pillow's
    whole decode does (a decompression bomb: libjpeg would allocate for the declared size, a
    progressive image's coefficients for all of it, before any data is read).

    Raises:
        ValueError: naming the size and the limit.
    """
    limit = Image.MAX_IMAGE_PIXELS
    if limit is not None and height * width > 2 * limit:
        raise ValueError(
            f"cannot decode image: its header declares {width}x{height} = {height * width} pixels, over twice "
            f"PIL.Image.MAX_IMAGE_PIXELS ({limit}): a decompression bomb (raise that limit for larger images)"
        )


#: Filters resampled by torch's antialiased uint8 kernel; the others by Pillow's.
_TORCH_FILTERS = ("bilinear", "bicubic")


def _resample(
    block: np.ndarray, box: tuple[float, float, float, float], size: tuple[int, int], interpolation: str
) -> Image.Image:
    """The ``box`` (left, top, right, bottom) of the HWC RGB ``block`` resampled to ``size`` (height, width)."""
    if interpolation not in _TORCH_FILTERS:
        img = Image.frombuffer("RGB", (block.shape[1], block.shape[0]), np.ascontiguousarray(block), "raw", "RGB", 0, 1)
        return img.resize((size[1], size[0]), image.pil_filter(interpolation), box=box)
    import torch
    import torch.nn.functional as F

    left, top = (min(round(v), limit - 1) for v, limit in zip(box[:2], (block.shape[1], block.shape[0])))
    right, bottom = (max(round(v), low + 1) for v, low in zip(box[2:], (left, top)))
    region = torch.from_numpy(block[top:bottom, left:right]).permute(2, 0, 1).unsqueeze(0)
    planes = region.contiguous(memory_format=torch.channels_last)  # the kernel's fast layout
    out = F.interpolate(planes, size=size, mode=interpolation, antialias=True, align_corners=False)
    return Image.fromarray(out[0].permute(1, 2, 0).numpy())
