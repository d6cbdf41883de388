"""Volume ops for 3-D models (CosmoFlow, 3D-UNet): arrays whose last three axes are D, H, W.

Leading axes (channels) are carried along untouched. Random ops draw from the generator they are
given, in a fixed order, so the same ``(seed, epoch, sample, stage)`` gives the same crop and flips
on any host or device.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["crop_3d_offsets", "flip_3d", "flip_3d_axes", "log1p", "random_crop_3d"]


def log1p(x: np.ndarray) -> np.ndarray:
    """``log(1 + x)`` in ``float32`` (CosmoFlow's scaling of particle counts), within 1 ulp of ``torch.log1p``.

    ``x`` is rounded to ``float32`` first, as ``torch.log1p(x.float())`` does; the logarithm is then
    evaluated in ``float64`` and rounded, because numpy's own ``float32`` routine is up to 2 ulp
    from torch's (measured on CosmoFlow-like counts), while rounding the ``float64`` result is
    nearly always the correctly rounded value, which torch's routine hits to within 0.6 ulp.
    """
    out = np.empty(x.shape, dtype=np.float32)
    np.log1p(x.astype(np.float32, copy=False), out=out, dtype=np.float64)
    return out


def crop_3d_offsets(shape: Sequence[int], rng: np.random.Generator, size: Sequence[int]) -> tuple[int, int, int]:
    """The D, H, W offsets of a random crop of ``size`` from a volume of ``shape`` (last three axes).

    One ``rng.integers(0, dim - s + 1)`` per axis, in D, H, W order.

    Raises:
        ValueError: ``size`` has not three entries, or the volume is smaller than the crop.
    """
    if len(size) != 3:
        raise ValueError(f"crop size must be [d, h, w], got {list(size)}")
    if len(shape) < 3:
        raise ValueError(f"a volume needs at least 3 axes (D, H, W), got shape {tuple(shape)}")
    dims = tuple(shape[-3:])
    if any(s > dim for s, dim in zip(size, dims)):
        raise ValueError(f"volume {dims} is smaller than the crop {tuple(size)}")
    d, h, w = (int(rng.integers(0, dim - s + 1)) for s, dim in zip(size, dims))
    return d, h, w


def random_crop_3d(x: np.ndarray, rng: np.random.Generator, *, size: Sequence[int]) -> np.ndarray:
    """Crop ``size = [d, h, w]`` over the last three axes at uniformly drawn offsets (:func:`crop_3d_offsets`).

    Returns:
        A contiguous copy of the crop.
    """
    d0, h0, w0 = crop_3d_offsets(x.shape, rng, size)
    d, h, w = (int(s) for s in size)
    return np.ascontiguousarray(x[..., d0 : d0 + d, h0 : h0 + h, w0 : w0 + w])


def flip_3d_axes(ndim: int, rng: np.random.Generator, p: float, axes: Sequence[int]) -> tuple[int, ...]:
    """Which of ``axes`` to flip: one ``rng.random() < p`` per axis, in the listed order.

    Raises:
        ValueError: an axis outside an array of ``ndim`` axes, or one axis listed twice.
    """
    for axis in axes:
        if not -ndim <= axis < ndim:
            raise ValueError(f"axis {axis} is out of range for {ndim} axes")
    if len({axis % ndim for axis in axes}) != len(axes):
        raise ValueError(f"axes {list(axes)} name one axis twice")
    return tuple(int(axis) for axis in axes if rng.random() < p)


def flip_3d(
    x: np.ndarray, rng: np.random.Generator, *, p: float = 0.5, axes: Sequence[int] = (-3, -2, -1)
) -> np.ndarray:
    """Flip each of ``axes`` independently with probability ``p`` (:func:`flip_3d_axes`).

    Returns:
        A contiguous array, flipped along the chosen axes.
    """
    chosen = flip_3d_axes(x.ndim, rng, p, axes)
    return np.ascontiguousarray(np.flip(x, axis=chosen) if chosen else x)
