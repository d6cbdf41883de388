"""The built-in ops on torch tensors, on any device, for stages placed on the GPU after delivery.

Each op takes the same parameters as its numpy twin in :mod:`kspeed.preprocess.ops` and draws its
random decisions from the same per-sample ``np.random.Generator`` in the same order, so moving a
stage between CPU and GPU never changes which crop or flip a sample gets. Integer results equal the
numpy op's; float results are within the tolerance each op states. :func:`apply_batch` runs one op
over a batch whose first axis is the samples.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kspeed.errors import ConfigError
from kspeed.preprocess import image, ops, tensor, volume
from kspeed.preprocess.tensor import _FLOAT_TO_INT_EPS

__all__ = [
    "OPS",
    "apply_batch",
    "cast",
    "decode_jpeg",
    "flip",
    "flip_3d",
    "log1p",
    "normalize",
    "random_crop_3d",
]

_TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in tensor.DTYPES}
_NUMPY_NAMES = {dtype: name for name, dtype in _TORCH_DTYPES.items()}


def cast(x: torch.Tensor, *, dtype: str | torch.dtype, scale: bool = True) -> torch.Tensor:
    """:func:`kspeed.preprocess.tensor.cast` on a tensor: torchvision's ``ConvertImageDtype`` when ``scale``.

    Results equal the numpy op's on any device: the integer-to-float division is by a tensor, not a
    Python number, because CUDA divides by a scalar as a multiplication by its reciprocal (1 ulp off,
    and so is torchvision's own ``convert_image_dtype`` on CUDA).
    """
    target = _torch_dtype(dtype)
    if x.dtype == target:
        return x
    if not scale:
        return x.to(target)
    source = _NUMPY_NAMES.get(x.dtype)
    if source is None:
        raise ValueError(f"cannot convert a tensor of {x.dtype} with scaling")
    tensor.check_scaled_cast(np.dtype(source), np.dtype(_NUMPY_NAMES[target]))
    if x.is_floating_point():
        if target.is_floating_point:
            return x.to(target)
        info = torch.iinfo(target)
        return (x * (info.max + 1.0 - _FLOAT_TO_INT_EPS)).clamp_(info.min, info.max).to(target)
    in_max = torch.iinfo(x.dtype).max
    if target.is_floating_point:
        return x.to(target) / torch.tensor(in_max, dtype=target, device=x.device)
    out_max = torch.iinfo(target).max
    if in_max > out_max:
        return torch.div(x, (in_max + 1) // (out_max + 1), rounding_mode="floor").to(target)
    return x.to(target) * ((out_max + 1) // (in_max + 1))


def normalize(
    x: torch.Tensor, *, mean: float | Sequence[float], std: float | Sequence[float], layout: str = "chw"
) -> torch.Tensor:
    """:func:`kspeed.preprocess.tensor.normalize` on a tensor (a batch too): ``float32`` ``(x - mean) / std``.

    Within 1 ulp of the numpy op (measured: equal on CPU; both are one IEEE subtraction and one
    division per element, with ``mean`` and ``std`` as tensors, never as reciprocals).
    """
    if layout not in tensor.NORMALIZE_LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {', '.join(tensor.NORMALIZE_LAYOUTS)}")
    if not x.is_floating_point():
        raise ValueError(f"normalize needs a floating tensor, got {x.dtype}; cast it first")
    axis = tensor.NORMALIZE_LAYOUTS[layout]
    if x.dim() < -axis:
        raise ValueError(f"layout {layout!r} needs at least {-axis} axes, got shape {tuple(x.shape)}")
    mean_c, std_c = tensor.channel_stats(mean, std, x.shape[axis])
    shape = (-1, 1, 1) if layout == "chw" else (-1,)
    mean_t = torch.from_numpy(np.array(mean_c)).to(x.device).view(shape)
    std_t = torch.from_numpy(np.array(std_c)).to(x.device).view(shape)
    return (x.to(torch.float32) - mean_t) / std_t


def flip(x: torch.Tensor, rng: np.random.Generator, *, p: float = 0.5, layout: str = "hwc") -> torch.Tensor:
    """:func:`kspeed.preprocess.image.flip` on one sample: the same single draw, the same axis.

    The default layout is the numpy op's (``"hwc"``), so a stage means the same wherever it runs;
    tensors delivered as CHW need ``layout="chw"``.
    """
    axis = _flip_axis(layout)
    return x.flip(axis) if rng.random() < p else x


def random_crop_3d(x: torch.Tensor, rng: np.random.Generator, *, size: Sequence[int]) -> torch.Tensor:
    """:func:`kspeed.preprocess.volume.random_crop_3d` on one volume: the same offsets, a contiguous crop."""
    d0, h0, w0 = volume.crop_3d_offsets(tuple(x.shape), rng, size)
    d, h, w = (int(s) for s in size)
    return x[..., d0 : d0 + d, h0 : h0 + h, w0 : w0 + w].contiguous()


def flip_3d(
    x: torch.Tensor, rng: np.random.Generator, *, p: float = 0.5, axes: Sequence[int] = (-3, -2, -1)
) -> torch.Tensor:
    """:func:`kspeed.preprocess.volume.flip_3d` on one volume: the same draws, the same flips."""
    chosen = volume.flip_3d_axes(x.dim(), rng, p, axes)
    return x.flip(chosen) if chosen else x


def log1p(x: torch.Tensor) -> torch.Tensor:
    """``log(1 + x)`` in ``float32``, as :func:`kspeed.preprocess.volume.log1p`.

    Within 1 ulp of the numpy op on CPU, within 2 on CUDA (its ``log1pf`` is accurate to 1 ulp, the
    numpy op to half an ulp).
    """
    return torch.log1p(x.to(torch.float32))


def decode_jpeg(data: bytes | bytearray | memoryview | np.ndarray, device: str | torch.device = "cpu") -> torch.Tensor:
    """Decode a JPEG to an RGB CHW ``uint8`` tensor on ``device`` with ``torchvision.io.decode_jpeg``.

    On a CUDA device this is nvJPEG, whose IDCT and chroma upsampling differ from libjpeg's: its
    pixels are close to, but outside the bit-exactness guarantee of,
    :func:`kspeed.preprocess.image.decode_image`. Use it for throughput, not for reproducing a
    CPU pipeline byte for byte. (On CPU it is libjpeg-turbo, measured identical to Pillow's pixels.)
    torchvision 0.29 deprecates its image codecs in favour of TorchCodec and warns once; this is the
    one place to switch.

    Raises:
        ValueError: the bytes are not a JPEG torchvision can decode.
    """
    from torchvision.io import ImageReadMode  # type: ignore[import-untyped]
    from torchvision.io import decode_jpeg as tv_decode_jpeg

    raw = np.ascontiguousarray(data).reshape(-1).data if isinstance(data, np.ndarray) else data
    encoded = torch.frombuffer(bytearray(memoryview(raw).cast("B")), dtype=torch.uint8)
    try:
        out = tv_decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device)
    except RuntimeError as exc:
        raise ValueError(f"cannot decode JPEG: {exc}") from exc
    if not isinstance(out, torch.Tensor):  # decode_jpeg returns a list only when given a list
        raise ValueError("cannot decode JPEG: unexpected result")
    return out


def _flip_batch(
    batch: torch.Tensor, rngs: Sequence[np.random.Generator], *, p: float = 0.5, layout: str = "hwc"
) -> torch.Tensor:
    """:func:`flip` over a batch: every sample's one draw, then a single ``torch.where``."""
    axis = _flip_axis(layout)
    chosen = torch.tensor([rng.random() < p for rng in rngs], dtype=torch.bool, device=batch.device)
    flipped = batch.flip(axis if axis < 0 else axis + 1)
    return torch.where(chosen.view(-1, *[1] * (batch.dim() - 1)), flipped, batch)


def _per_sample(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """A random op over a batch, sample by sample, stacked (all samples share a shape, so do the results)."""

    def run(batch: torch.Tensor, rngs: Sequence[np.random.Generator], **params: Any) -> torch.Tensor:
        return torch.stack([fn(sample, rng, **params) for sample, rng in zip(batch, rngs)])

    return run


@dataclass(frozen=True)
class _GpuOp:
    """A torch op: ``run(batch, **params)``, or ``run(batch, generators, **params)`` when ``random``."""

    run: Callable[..., torch.Tensor]
    random: bool


OPS: Mapping[str, _GpuOp] = types.MappingProxyType(
    {
        "normalize": _GpuOp(normalize, random=False),
        "cast": _GpuOp(cast, random=False),
        "log1p": _GpuOp(log1p, random=False),
        "flip": _GpuOp(_flip_batch, random=True),
        "random_crop_3d": _GpuOp(_per_sample(random_crop_3d), random=True),
        "flip_3d": _GpuOp(_per_sample(flip_3d), random=True),
    }
)
"""The ops :func:`apply_batch` runs, by their pipeline name."""


def apply_batch(
    name: str, batch: torch.Tensor, rngs: Sequence[np.random.Generator | None], params: Mapping[str, Any]
) -> torch.Tensor:
    """Run op ``name`` over ``batch`` (first axis = samples), sample ``i`` drawing from ``rngs[i]``.

    Elementwise ops run on the whole batch at once; ``flip`` draws every sample's decision, then
    flips in one ``torch.where``; the 3-D ops go sample by sample and stack (all samples share a
    shape, so their crops do too).

    Raises:
        ConfigError: an op with no GPU version, or bad parameters (see :func:`ops.check_params`).
        ValueError: ``rngs`` does not have one generator per sample, or a random op got ``None``.
    """
    op = OPS.get(name)
    if op is None:
        raise ConfigError(f"op {name!r} has no GPU version; GPU ops: {', '.join(sorted(OPS))}", value=name)
    ops.check_params(name, params)
    if not op.random:
        return op.run(batch, **params)
    if len(rngs) != batch.shape[0]:
        raise ValueError(f"op {name!r} got {len(rngs)} generators for a batch of {batch.shape[0]}")
    if any(rng is None for rng in rngs):
        raise ValueError(f"op {name!r} is random and needs every sample's generator")
    return op.run(batch, [rng for rng in rngs if rng is not None], **params)


def _torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _TORCH_DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(_TORCH_DTYPES)}") from None


def _flip_axis(layout: str) -> int:
    """The width axis of one sample in ``layout``: 1 for HWC/HW, the last for CHW (as the numpy op)."""
    if layout not in image.LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {', '.join(image.LAYOUTS)}")
    return -1 if layout == "chw" else 1
