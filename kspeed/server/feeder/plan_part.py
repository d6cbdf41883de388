"""A feeder's part of one plan: the positions it serves, where each sample lies, and which were
granted, as numpy arrays.

It reaches a feeder process inside :class:`~kspeed.server.feeder.protocol.InstallPlan` and is then
that feeder's own state (its ``granted`` marks change as grants arrive); the main process keeps the
same positions in production's share state (:mod:`kspeed.server.feeder.protocol` says how the two
are kept in step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["PlanPart"]


@dataclass
class PlanPart:
    """The positions of one epoch plan this server owns, with where their bytes are now and go.

    Attributes:
        starts: plan index of each batch's first position, plus the plan's length.
        positions: sorted plan positions owned by this server.
        ids: per owned position, the sample's ID.
        length: per owned position, the sample's length.
        dst: per owned position, the sample's offset within its batch (the client's layout).
        region: per owned position, the pool region holding the sample now (-1: not produced yet).
        src: per owned position, the sample's offset in that region.
        ticket: per owned position, the window slot's ticket (0: at home).
        crc: per owned position, the crc32c its bytes must have where they are now (-1: none to
            check, e.g. a processed sample); ``None``: nothing is checked.
        processed: per owned position, whether it is produced here by the dataset's pipeline
            (placed per plan, see :meth:`place`) rather than served as the raw sample (located by ID).
        granted: per owned position, whether a grant asked for it (kept by the feeder; ``None``
            until the first grant).
    """

    starts: np.ndarray
    positions: np.ndarray
    ids: np.ndarray
    length: np.ndarray
    dst: np.ndarray
    region: np.ndarray
    src: np.ndarray
    ticket: np.ndarray
    crc: np.ndarray | None = None
    processed: np.ndarray | None = None
    failures: dict[int, str] = field(default_factory=dict)  # processed owned index -> why it failed
    granted: np.ndarray | None = None
    _order: np.ndarray | None = field(default=None, repr=False)

    def span(self, batch: int, first: int, end: int) -> tuple[int, int]:
        """The owned positions ``i:j`` that a grant of positions ``first:end`` of ``batch`` covers."""
        lo = int(self.starts[batch]) + first
        hi = min(int(self.starts[batch]) + end, int(self.starts[batch + 1]))
        i, j = np.searchsorted(self.positions, (lo, hi))
        return int(i), int(j)

    def grant(self, i: int, j: int) -> np.ndarray:
        """Record a grant of owned positions ``i:j``; returns those a grant asked for before."""
        if self.granted is None:
            self.granted = np.zeros(len(self.ids), dtype=bool)
        again = np.flatnonzero(self.granted[i:j]) + i
        self.granted[i:j] = True
        return again

    def where(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(owned positions, index into ids)`` of every occurrence of ``ids`` in the plan."""
        if self._order is None:
            self._order = np.argsort(self.ids, kind="stable")
        order = self._order
        ordered = self.ids[order]
        ids = np.asarray(ids, dtype=np.int64)
        lo = np.searchsorted(ordered, ids, side="left")
        hi = np.searchsorted(ordered, ids, side="right")
        counts = hi - lo
        total = int(counts.sum())
        if not total:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        starts = np.cumsum(counts) - counts
        at = np.repeat(lo, counts) + (np.arange(total) - np.repeat(starts, counts))
        return order[at], np.repeat(np.arange(len(ids)), counts)

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
