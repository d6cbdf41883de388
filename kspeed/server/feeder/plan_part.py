"""A feeder's part of one plan: the positions it serves, where each sample lies, and which were
granted, as numpy arrays.

It reaches a feeder process inside :class:`~kspeed.server.feeder.protocol.InstallPlan` and is then
that feeder's own state (its ``granted`` marks change as grants arrive); the main process keeps the
same positions in production's share state (:mod:`kspeed.server.feeder.protocol` says how the two
are kept in step).

A plan part is the largest state a server keeps per sample (one per plan, up to four plans per
feed), so its columns take the narrowest form their values fit: IDs and positions int32; lengths
and offsets within a batch uint16 or uint32 (int64 where a value does not fit); pool regions int16
while the pool has fewer than 32768; offsets within a region uint32; window tickets, zero but for
the samples in the window, in a :class:`~kspeed.server.feeder.columns.SparseColumn`; crc32c values
in a :class:`~kspeed.server.feeder.columns.CrcColumn`; the granted marks a bit each. A feeder
widens the few it writes from to int64 as it reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from kspeed.server.feeder.columns import CrcColumn, SparseColumn
from kspeed.server.memory.flags import Flags

__all__ = ["PlanPart", "id_dtype", "narrow", "search"]


def id_dtype(end: int) -> type[np.signedinteger[Any]]:
    """The dtype of sample IDs (or plan positions) below ``end``: int32 while they fit."""
    return np.int32 if end <= np.iinfo(np.int32).max else np.int64


def narrow(values: np.ndarray) -> np.ndarray:
    """Non-negative ``values`` as uint16 or uint32 when they all fit, else as int64."""
    values = np.asarray(values)
    top = int(values.max()) if len(values) else 0
    for dtype in (np.uint16, np.uint32):
        if top <= np.iinfo(dtype).max:
            return values.astype(dtype)
    return values.astype(np.int64, copy=False)


def search(haystack: np.ndarray, values: Any, side: Literal["left", "right"] = "left") -> np.ndarray:
    """:func:`numpy.searchsorted` of non-negative ``values`` in a sorted integer ``haystack``
    without widening it: numpy casts both to a common dtype, so a compact haystack searched for
    int64 values (or Python ints) is copied whole at every call. The values are brought into the
    haystack's dtype instead (clipped to its range: every element of a haystack of IDs or positions
    is below its dtype's maximum, see :func:`id_dtype`)."""
    info = np.iinfo(haystack.dtype)
    return np.searchsorted(haystack, np.clip(values, info.min, info.max).astype(haystack.dtype), side=side)


def _unplaced() -> np.ndarray:
    return np.zeros(0, dtype=np.int64)


@dataclass
class PlanPart:
    """The positions of one epoch plan this server owns, with where their bytes are now and go.

    Attributes:
        starts: plan index of each batch's first position, plus the plan's length.
        positions: sorted plan positions owned by this server.
        ids: per owned position, the sample's ID.
        length: per owned position, the sample's length.
        dst: per owned position, the sample's offset within its batch (the client's layout).
        region: per owned position, the pool region holding the sample now (-1: not produced yet);
            production fills ``region``, ``src``, ``ticket`` and ``crc`` as it installs the plan.
        src: per owned position, the sample's offset in that region.
        ticket: per owned position, the window slot's ticket (0: at home).
        crc: per owned position, the crc32c its bytes must have where they are now (-1: none to
            check, e.g. a processed sample); ``None``: nothing is checked.
        processed: per owned position, whether it is produced here by the dataset's pipeline
            (placed per plan, see :meth:`place`) rather than served as the raw sample (located by ID).
        granted: per owned position, whether a grant asked for it (kept by the feeder; ``None``
            until the first grant).
        cut: the first batch the client no longer grants (it truncated the plan, see
            :class:`~kspeed.grants.TruncatePlan`; kept by the feeder); ``None``: every batch.
    """

    starts: np.ndarray
    positions: np.ndarray
    ids: np.ndarray
    length: np.ndarray
    dst: np.ndarray
    region: np.ndarray = field(default_factory=_unplaced)
    src: np.ndarray = field(default_factory=_unplaced)
    ticket: np.ndarray | SparseColumn = field(default_factory=_unplaced)
    crc: np.ndarray | CrcColumn | None = None
    processed: np.ndarray | None = None
    failures: dict[int, str] = field(default_factory=dict)  # processed owned index -> why it failed
    granted: Flags | None = None
    cut: int | None = None
    _by_id: _ByID | None = field(default=None, repr=False)  # where each sample ID is (made at the first look)

    @property
    def batches(self) -> int:
        """The batches a grant may name: the plan's, or those before its :attr:`cut`."""
        count = len(self.starts) - 1
        return count if self.cut is None else min(count, self.cut)

    def truncate(self, batch: int) -> None:
        """The client grants no batch from ``batch`` on (a later, larger cut changes nothing)."""
        self.cut = max(int(batch), 0) if self.cut is None else min(self.cut, max(int(batch), 0))

    def span(self, batch: int, first: int, end: int) -> tuple[int, int]:
        """The owned positions ``i:j`` that a grant of positions ``first:end`` of ``batch`` covers."""
        lo = int(self.starts[batch]) + first
        hi = min(int(self.starts[batch]) + end, int(self.starts[batch + 1]))
        i, j = search(self.positions, (lo, hi))
        return int(i), int(j)

    def grant(self, i: int, j: int) -> np.ndarray:
        """Record a grant of owned positions ``i:j``; returns those a grant asked for before."""
        if self.granted is None:
            self.granted = Flags(len(self.ids))
        again = np.flatnonzero(self.granted[i:j]) + i
        self.granted.set(slice(i, j))
        return again

    def where(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(owned positions, index into ids)`` of every occurrence of ``ids`` in the plan (per
        ID in the order of ``ids``, its positions in increasing order)."""
        if self._by_id is None:
            self._by_id = _ByID.of(self.ids)
        return self._by_id.find(self.ids, np.asarray(ids, dtype=np.int64))

    def locate(
        self, ids: np.ndarray, region: np.ndarray, src: np.ndarray, ticket: np.ndarray, crc: np.ndarray | None = None
    ) -> np.ndarray:
        """Set the location (and the crc32c to check there, if given) of raw samples ``ids``;
        returns the tickets they had (for the window's bookkeeping)."""
        at, which = self.where(ids)
        if self.processed is not None:
            raw = ~self.processed[at]
            at, which = at[raw], which[raw]
        old = self.ticket[at].copy()
        self.region[at] = region[which]
        self.src[at] = src[which]
        self.ticket[at] = ticket[which]
        if self.crc is not None:
            self.crc[at] = -1 if crc is None else crc[which]
        return old

    def place(self, at: np.ndarray, region: np.ndarray, src: np.ndarray, ticket: np.ndarray) -> np.ndarray:
        """Set the location of processed owned positions ``at`` (nothing to check); returns the tickets they had."""
        old = self.ticket[at].copy()
        self.region[at] = region
        self.src[at] = src
        self.ticket[at] = ticket
        if self.crc is not None:
            self.crc[at] = -1
        return old


@dataclass
class _ByID:
    """The owned positions of a plan grouped by sample ID: IDs ``base + k * 2**shift`` and the next
    ``2**shift - 1`` form bucket ``k``, whose positions are ``order[starts[k]:starts[k + 1]]``, in
    increasing order. Buckets are sized to hold about :data:`_BUCKET_HOLDS` positions, so this
    costs 4 bytes a position (and a little per bucket) where a sorted copy of the IDs beside the
    order would cost 8, and a look-up compares each ID with a bucket's few."""

    base: int
    shift: int
    order: np.ndarray
    starts: np.ndarray

    @classmethod
    def of(cls, ids: np.ndarray) -> _ByID:
        if not len(ids):
            return cls(0, 0, np.zeros(0, dtype=np.int32), np.zeros(1, dtype=np.int32))
        base, top = int(ids.min()), int(ids.max())
        span = (top - base + 1) * _BUCKET_HOLDS / len(ids)  # the IDs of a bucket of _BUCKET_HOLDS positions
        shift = max(int(span).bit_length() - 1, 0)
        bucket = (ids - base) >> shift
        order = np.argsort(bucket, kind="stable").astype(id_dtype(len(ids)))
        counts = np.bincount(bucket, minlength=((top - base) >> shift) + 1)
        return cls(base, shift, order, np.concatenate(([0], np.cumsum(counts))).astype(id_dtype(len(ids))))

    def find(self, ids: np.ndarray, wanted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(positions, index into wanted)`` of the occurrences of ``wanted`` among ``ids``."""
        bucket = (wanted - self.base) >> self.shift
        inside = np.flatnonzero((wanted >= self.base) & (bucket < len(self.starts) - 1))
        first, end = self.starts[bucket[inside]], self.starts[bucket[inside] + 1]
        counts = end - first
        total = int(counts.sum())
        if not total:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        offsets = np.cumsum(counts) - counts
        candidates = self.order[np.repeat(first, counts) + (np.arange(total) - np.repeat(offsets, counts))]
        which = np.repeat(inside, counts)
        match = ids[candidates] == wanted[which]
        return candidates[match].astype(np.int64), which[match]


#: Positions a bucket of :class:`_ByID` holds, about.
_BUCKET_HOLDS = 16
