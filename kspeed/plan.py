"""The shared vocabulary of client, server and manager: epoch plans, layouts of samples into regions and slots.

Everything here is a pure function of its arguments, so every party that applies it to the same
inputs reaches the same answer without asking another: the manager cuts a dataset's ownership
with :func:`region_bounds`, and each server lays out the samples it owns with the very same rule.
Neither :mod:`kspeed.manager` nor :mod:`kspeed.server` imports the other; both import this module.
"""

from __future__ import annotations

import numpy as np

from kspeed.errors import DatasetError

__all__ = ["region_bounds"]


def region_bounds(sizes: np.ndarray, region_size: int, *, dataset: str, first_id: int = 0) -> np.ndarray:
    """Pack samples in ID order into regions; return where each region starts.

    Samples are appended in ID order and a sample never straddles two regions: when the next one
    does not fit, a new region begins. Zero-length samples take no room. The result ``b`` has one
    entry per region plus one: region ``k`` holds the samples at positions ``b[k]..b[k+1]-1`` of
    ``sizes``, and ``b[-1] == len(sizes)``.

    Args:
        sizes: sample sizes in bytes, in ID order.
        region_size: bytes per region.
        dataset: the dataset's name, for messages.
        first_id: the sample ID of ``sizes[0]`` (a server lays out its own ID range), for messages.

    Raises:
        DatasetError: the region size is not positive, or a sample is negative or larger than a
            region (named by its ID).
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    if region_size <= 0:
        raise DatasetError(f"dataset {dataset!r}: region size must be positive, got {region_size}",
                           dataset=dataset)
    too_big = np.flatnonzero(sizes > region_size)
    if len(too_big):
        i = int(too_big[0])
        raise DatasetError(
            f"dataset {dataset!r}: sample {first_id + i} is {int(sizes[i])} bytes, larger than a region "
            f"({region_size} bytes); raise the region size",
            dataset=dataset, sample=first_id + i,
        )
    negative = np.flatnonzero(sizes < 0)
    if len(negative):
        i = int(negative[0])
        raise DatasetError(f"dataset {dataset!r}: sample {first_id + i} has negative size {int(sizes[i])}",
                           dataset=dataset, sample=first_id + i)
    cum = np.concatenate(([0], np.cumsum(sizes)))
    bounds = [0]
    while bounds[-1] < len(sizes):
        bounds.append(int(np.searchsorted(cum, cum[bounds[-1]] + region_size, side="right")) - 1)
    return np.asarray(bounds, dtype=np.int64)
