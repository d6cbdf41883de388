"""The shared vocabulary of client, server and manager: epoch plans, layouts of samples into regions and slots.

Everything here is a pure function of its arguments, so every party that applies it to the same
inputs reaches the same answer without asking another: the manager cuts a dataset's ownership
with :func:`region_bounds`, and each server lays out the samples it owns with the very same rule;
a client lays out the batches of an epoch in the receive ring with :func:`batch_layout` and hands
each server the offsets of its samples with the plan, so a grant names only a batch and a range of
positions, never a sample.
Neither :mod:`kspeed.manager` nor :mod:`kspeed.server` imports the other; both import this module.
"""

from __future__ import annotations

import numpy as np

from kspeed.errors import DatasetError

__all__ = ["SAMPLE_ALIGN", "BatchLayout", "batch_layout", "batch_starts", "region_bounds"]

#: Every sample starts at a multiple of this many bytes within its batch, so typed zero-copy views
#: (int64, float64) of the received bytes are aligned. A batch starts at a multiple of it too.
SAMPLE_ALIGN = 8


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
        raise DatasetError(f"dataset {dataset!r}: region size must be positive, got {region_size}", dataset=dataset)
    too_big = np.flatnonzero(sizes > region_size)
    if len(too_big):
        i = int(too_big[0])
        raise DatasetError(
            f"dataset {dataset!r}: sample {first_id + i} is {int(sizes[i])} bytes, larger than a region "
            f"({region_size} bytes); raise the region size",
            dataset=dataset,
            sample=first_id + i,
        )
    negative = np.flatnonzero(sizes < 0)
    if len(negative):
        i = int(negative[0])
        raise DatasetError(
            f"dataset {dataset!r}: sample {first_id + i} has negative size {int(sizes[i])}",
            dataset=dataset,
            sample=first_id + i,
        )
    cum = np.concatenate(([0], np.cumsum(sizes)))
    bounds = [0]
    while bounds[-1] < len(sizes):
        bounds.append(int(np.searchsorted(cum, cum[bounds[-1]] + region_size, side="right")) - 1)
    return np.asarray(bounds, dtype=np.int64)


class BatchLayout:
    """Where every sample of an epoch plan lands, relative to the start of its batch.

    Attributes:
        batch_size: samples per batch (the last batch may be shorter).
        starts: index into the plan of each batch's first sample, plus one final entry (the
            plan's length): batch ``b`` is positions ``starts[b]..starts[b+1]-1``.
        offsets: per position, the byte offset of the sample within its batch.
        lengths: per position, the sample's length in bytes.
        batch_bytes: per batch, the bytes it occupies (aligned to :data:`SAMPLE_ALIGN`).
    """

    def __init__(
        self, batch_size: int, starts: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, batch_bytes: np.ndarray
    ) -> None:
        self.batch_size = batch_size
        self.starts = starts
        self.offsets = offsets
        self.lengths = lengths
        self.batch_bytes = batch_bytes

    @property
    def num_batches(self) -> int:
        """Number of batches."""
        return len(self.starts) - 1

    def positions(self, batch: int, first: int = 0, end: int | None = None) -> tuple[int, int]:
        """Plan positions ``[lo, hi)`` of the sub-range ``[first, end)`` of ``batch``."""
        lo, hi = int(self.starts[batch]), int(self.starts[batch + 1])
        end = hi - lo if end is None else end
        return lo + min(first, hi - lo), lo + min(end, hi - lo)


def batch_starts(count: int, batch_size: int) -> np.ndarray:
    """Plan position of each batch's first sample, then ``count``: batch ``b`` is positions
    ``starts[b]:starts[b + 1]``, every batch full but the last. The client and every server derive
    a plan's batches from its length and batch size alone, with this."""
    return np.append(np.arange(0, count, batch_size, dtype=np.int64), np.int64(count))


def batch_layout(lengths: np.ndarray, batch_size: int) -> BatchLayout:
    """Lay out an epoch plan's batches: samples back to back in plan order, each aligned.

    The client calls this with the lengths the lookup replies gave and hands each server the
    offsets of its own samples with the plan; batch ``b`` is positions ``b*batch_size`` on, so a
    server places its samples of any batch without hearing about the others.

    Args:
        lengths: sample lengths in plan (sampler) order.
        batch_size: samples per batch; the last batch holds the remainder.

    Raises:
        ValueError: batch_size is not positive or a length is negative.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    if len(lengths) and int(lengths.min()) < 0:
        raise ValueError("sample lengths must not be negative")
    n = len(lengths)
    starts = batch_starts(n, batch_size)
    padded = (lengths + (SAMPLE_ALIGN - 1)) // SAMPLE_ALIGN * SAMPLE_ALIGN
    cum = np.cumsum(padded) - padded  # exclusive prefix sum over the whole plan
    batch_of = np.arange(n, dtype=np.int64) // batch_size
    offsets = cum - cum[starts[:-1]][batch_of] if n else cum
    ends = np.append(cum, cum[-1] + padded[-1] if n else 0)
    batch_bytes = ends[starts[1:]] - ends[starts[:-1]] if n else np.zeros(0, dtype=np.int64)
    return BatchLayout(batch_size, starts, offsets, lengths, batch_bytes)
