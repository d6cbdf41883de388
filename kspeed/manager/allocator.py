"""Allocation of a dataset's regions over servers (pure functions, no state).

A dataset occupies whole regions forming one virtual contiguous address space: byte
``region index x region size + offset``. Samples are packed into regions in ID order without
straddling (:func:`kspeed.layout.region_bounds`, the rule servers lay out their own samples with);
the regions are then dealt out to servers in contiguous runs, so every server owns a contiguous
range of sample IDs and ownership is a pure function of the :class:`Allocation`. Servers are
balanced by memory: their region counts (so their allocated bytes) differ by at most one region
wherever their free regions allow. The sample bytes they hold differ by that plus the unfilled
tails of their regions (a sample never straddles two regions).

A small dataset (at most :data:`SMALL_SHARE` of a region) takes a slice of a region it shares
with other small datasets, on the one server with the most room (:func:`allocate_slice`), so ten
350 KiB datasets do not take ten 128 MiB regions.

A dataset that does not fit (or has a memory policy, :mod:`kspeed.policies`) is allocated by
:func:`allocate_window`: its ID range is still dealt out in contiguous runs of virtual regions,
in proportion to the memory each server can give it, and each server holds only its
``memory_regions`` of them as the share's window; the rest is read from the backend as plans need it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from kspeed.errors import CapacityError, DatasetError
from kspeed.layout import SAMPLE_ALIGN, region_bounds

__all__ = [
    "Allocation",
    "ServerCapacity",
    "Share",
    "allocate",
    "allocate_regions",
    "allocate_slice",
    "allocate_window",
    "slice_size",
]

SMALL_SHARE = 4  # a dataset of at most 1/SMALL_SHARE of a region takes a slice of a shared one
SLICE_ALIGN = 64 << 10  # slices are whole multiples of this


@dataclasses.dataclass(frozen=True)
class ServerCapacity:
    """A candidate server and how many FREE regions it reports."""

    server_id: str
    free_regions: int


@dataclasses.dataclass(frozen=True)
class Share:
    """One server's part of a dataset.

    Attributes:
        server_id: the server.
        first_region: its first virtual region index; it holds ``num_regions`` consecutive ones.
        num_regions: regions allocated on it.
        lo: first sample ID it owns.
        hi: one past its last sample ID.
        bytes: sum of the sizes of its samples.
        memory_regions: regions the server holds for it (``num_regions`` unless the dataset is held
            in part, :func:`allocate_window`).
        slice_bytes: for a small dataset, the bytes of a shared region it takes (0: whole regions).
    """

    server_id: str
    first_region: int
    num_regions: int
    lo: int
    hi: int
    bytes: int
    memory_regions: int = -1
    slice_bytes: int = 0

    def __post_init__(self) -> None:
        if self.memory_regions < 0:
            object.__setattr__(self, "memory_regions", self.num_regions)


@dataclasses.dataclass(frozen=True)
class Allocation:
    """Where a dataset lives: its shares in virtual-region and sample-ID order."""

    dataset: str
    region_size: int
    num_samples: int
    total_bytes: int
    shares: tuple[Share, ...]

    @property
    def num_regions(self) -> int:
        """Regions of the whole dataset."""
        return sum(s.num_regions for s in self.shares)

    @property
    def memory_regions(self) -> int:
        """Regions the servers hold for it."""
        return sum(s.memory_regions for s in self.shares)

    def owner(self, ids: np.ndarray) -> np.ndarray:
        """Index into :attr:`shares` of the server owning each sample ID (vectorized).

        Raises:
            DatasetError: an ID is outside ``0..num_samples-1``.
        """
        ids = np.asarray(ids, dtype=np.int64)
        bad = (ids < 0) | (ids >= self.num_samples)
        if bad.any():
            raise DatasetError(
                f"dataset {self.dataset!r}: no sample {int(ids[bad][0])} (IDs 0..{self.num_samples - 1})",
                dataset=self.dataset,
                sample=int(ids[bad][0]),
            )
        his = np.fromiter((s.hi for s in self.shares), dtype=np.int64, count=len(self.shares))
        return np.searchsorted(his, ids, side="right")

    def share_of(self, server_id: str) -> Share | None:
        """The share of ``server_id``, or ``None`` if it holds nothing of the dataset."""
        return next((s for s in self.shares if s.server_id == server_id), None)


def _balance(need: int, caps: Sequence[int]) -> list[int]:
    """Split ``need`` regions over servers with ``caps``: counts differ by at most one where the caps
    allow (water-filling from the smallest cap up)."""
    counts = [0] * len(caps)
    left = need
    for k, i in enumerate(sorted(range(len(caps)), key=lambda i: caps[i])):
        counts[i] = min(caps[i], -(-left // (len(caps) - k)))
        left -= counts[i]
    return counts


def allocate(
    dataset: str,
    sizes: np.ndarray,
    region_size: int,
    servers: Sequence[ServerCapacity],
    *,
    max_servers: int | None = None,
    headroom: int = 0,
) -> Allocation:
    """Choose servers and whole regions on each for a dataset of samples of ``sizes``: its
    samples are laid out in regions (:func:`kspeed.layout.region_bounds`), then
    :func:`allocate_regions`.

    Raises:
        DatasetError: a sample larger than a region, or an empty dataset.
        CapacityError: as :func:`allocate_regions`.
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    starts = region_bounds(sizes, region_size, dataset=dataset)
    cum = np.concatenate(([0], np.cumsum(sizes)))
    return allocate_regions(
        dataset,
        starts,
        cum[starts[1:]] - cum[starts[:-1]],
        region_size,
        servers,
        max_servers=max_servers,
        headroom=headroom,
    )


def allocate_regions(
    dataset: str,
    starts: np.ndarray,
    region_bytes: np.ndarray,
    region_size: int,
    servers: Sequence[ServerCapacity],
    *,
    max_servers: int | None = None,
    headroom: int = 0,
) -> Allocation:
    """Choose servers and whole regions on each for a dataset laid out in regions.

    Args:
        dataset: the dataset's name, for messages.
        starts: the first sample ID of each region, then the sample count (what
            :func:`kspeed.layout.region_bounds` returns).
        region_bytes: bytes of samples in each region.
        region_size: bytes per region.
        servers: candidates with their free region counts.
        max_servers: use at most this many servers (those with the most free regions); all by default.
        headroom: regions to leave free on every server (room for other datasets or streaming).

    Returns:
        The allocation; servers appear in ``server_id`` order, each with a contiguous run of
        virtual regions and the matching contiguous range of sample IDs.

    Raises:
        DatasetError: empty dataset, or a layout that is not one (starts not increasing from 0,
            bytes not one per region or over the region size).
        CapacityError: the free regions (after headroom) cannot hold the dataset; nothing chosen.
    """
    starts = np.asarray(starts, dtype=np.int64)
    region_bytes = np.asarray(region_bytes, dtype=np.int64)
    count = int(starts[-1]) if len(starts) else 0
    if count == 0:
        raise DatasetError(f"dataset {dataset!r}: no samples to allocate", dataset=dataset)
    if (
        int(starts[0]) != 0
        or bool((np.diff(starts) <= 0).any())
        or len(region_bytes) != len(starts) - 1
        or bool(((region_bytes < 0) | (region_bytes > region_size)).any())
    ):
        raise DatasetError(
            f"dataset {dataset!r}: a layout of {len(starts) - 1} regions of {region_size} bytes with "
            f"{len(region_bytes)} byte counts is malformed",
            dataset=dataset,
        )
    need = len(starts) - 1
    total = int(region_bytes.sum())
    ranked = sorted(servers, key=lambda s: (-s.free_regions, s.server_id))
    if max_servers is not None:
        ranked = ranked[: max(max_servers, 0)]
    caps = [max(s.free_regions - headroom, 0) for s in ranked]
    available = sum(caps)
    if available < need:
        raise CapacityError(
            f"dataset {dataset!r} needs {need} regions of {region_size} bytes ({total} bytes in "
            f"{count} samples); {available} available on {len(ranked)} servers "
            f"(headroom {headroom} per server)"
        )
    candidates = sorted((s.server_id, c) for s, c in zip(ranked, caps, strict=True) if c > 0)
    cum = np.concatenate(([0], np.cumsum(region_bytes)))
    counts = _balance(need, [c for _, c in candidates])
    shares, region = [], 0
    for (server_id, _), n in zip(candidates, counts, strict=True):
        if n == 0:
            continue
        lo, hi = int(starts[region]), int(starts[region + n])
        shares.append(Share(server_id, region, n, lo, hi, int(cum[region + n] - cum[region])))
        region += n
    return Allocation(dataset, region_size, count, total, tuple(shares))


def allocate_window(
    dataset: str,
    starts: np.ndarray,
    region_bytes: np.ndarray,
    region_size: int,
    servers: Sequence[ServerCapacity],
    *,
    budget: int | None = None,
    headroom: int = 0,
) -> Allocation:
    """Allocate a dataset held in part: each server holds some regions as its share's window.

    The memory (at most ``budget`` regions, or every free one) is balanced over the servers as
    :func:`allocate_regions` balances a whole dataset; the dataset's virtual regions are then
    dealt out in contiguous runs in proportion to each server's memory, so a server streams a
    part of the dataset as large, relative to its memory, as every other's. A share never holds
    more regions than its part has.

    Raises:
        DatasetError: as :func:`allocate_regions`.
        CapacityError: no server has a free region (after headroom), or ``budget`` is under one.
    """
    starts = np.asarray(starts, dtype=np.int64)
    region_bytes = np.asarray(region_bytes, dtype=np.int64)
    whole = allocate_regions(dataset, starts, region_bytes, region_size, [ServerCapacity("", len(starts) - 1)])
    need = whole.num_regions
    ranked = sorted(servers, key=lambda s: (-s.free_regions, s.server_id))
    caps = [max(s.free_regions - headroom, 0) for s in ranked]
    memory = min(sum(caps), need if budget is None else min(int(budget), need))
    if memory < 1:
        raise CapacityError(
            f"dataset {dataset!r}: no region of {region_size} bytes to hold any of it "
            f"({sum(caps)} free on {len(ranked)} servers (headroom {headroom} per server), budget {budget})"
        )
    candidates = sorted((s.server_id, c) for s, c in zip(ranked, caps, strict=True) if c > 0)
    held = _balance(memory, [c for _, c in candidates])
    parts = [(sid, m) for (sid, _), m in zip(candidates, held, strict=True) if m > 0]
    parts = parts[: min(len(parts), need)]  # every share holds at least one virtual region
    memory = sum(m for _, m in parts)
    # Virtual regions in proportion to memory (largest remainders), at least one each.
    exact = [need * m / memory for _, m in parts]
    counts = [max(int(x), 1) for x in exact]
    order = sorted(range(len(parts)), key=lambda k: (counts[k] - exact[k], k))
    k = 0
    while sum(counts) < need:
        counts[order[k % len(order)]] += 1
        k += 1
    while sum(counts) > need:
        biggest = max(range(len(counts)), key=lambda k: (counts[k], -k))
        counts[biggest] -= 1
    cum = np.concatenate(([0], np.cumsum(region_bytes)))
    shares, region = [], 0
    for (server_id, m), n in zip(parts, counts, strict=True):
        lo, hi = int(starts[region]), int(starts[region + n])
        shares.append(Share(server_id, region, n, lo, hi, int(cum[region + n] - cum[region]), min(m, n)))
        region += n
    return Allocation(dataset, region_size, whole.num_samples, whole.total_bytes, tuple(shares))


def slice_size(count: int, total_bytes: int, region_size: int) -> int:
    """The slice a small dataset of ``count`` samples and ``total_bytes`` takes (its samples
    aligned, rounded up to :data:`SLICE_ALIGN`), or 0 when it is not small."""
    need = total_bytes + SAMPLE_ALIGN * count
    size = -(-need // SLICE_ALIGN) * SLICE_ALIGN
    return size if size <= region_size // SMALL_SHARE else 0


def allocate_slice(
    dataset: str, count: int, total_bytes: int, size: int, region_size: int, room: Sequence[tuple[str, int]]
) -> Allocation:
    """Allocate a small dataset as one share of ``size`` bytes of a shared region on the server
    with the most room (``room``: server id and free bytes, counting the rest of its shared regions).

    Raises:
        CapacityError: no server has ``size`` bytes of room.
    """
    fits = sorted((r for r in room if r[1] >= size), key=lambda r: (-r[1], r[0]))
    if not fits:
        raise CapacityError(
            f"dataset {dataset!r} needs a slice of {size} bytes; the most room on a server is "
            f"{max((r[1] for r in room), default=0)} bytes"
        )
    share = Share(fits[0][0], 0, 1, 0, count, total_bytes, 1, size)  # (its one virtual region: the slice)
    return Allocation(dataset, region_size, count, total_bytes, (share,))
