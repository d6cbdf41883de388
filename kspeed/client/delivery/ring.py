"""Byte allocation in the receive ring: reserve at the head, release in any order, quarantine for fencing.

Batches are laid out back to back from where the last one ended (the head), so in steady state the
ring fills and drains like a FIFO. Users may hold batches as long as they like (gradient
accumulation, queued copies), so releases arrive out of order; the next reservation therefore
takes the first gap large enough at or after the head, wrapping once to the start, and simply steps
over ranges still held. A range quarantined by fencing is not handed out again while a writer that
was cut off may still map it (docs/feeding.md, Fencing); the feed lifts the quarantine once the
rail says that writer is gone.
"""

from __future__ import annotations

import bisect
from collections import deque

from kspeed.layout import SAMPLE_ALIGN

__all__ = ["RingAllocator"]


def _aligned(nbytes: int) -> int:
    return max(SAMPLE_ALIGN, -(-nbytes // SAMPLE_ALIGN) * SAMPLE_ALIGN)


class RingAllocator:
    """Reservations of byte ranges in a ring of ``capacity`` bytes.

    Only the owning thread calls :meth:`reserve`, :meth:`release` and :meth:`quarantine`;
    :meth:`release_later` may be called from any thread (garbage-collection finalizers of batch
    views) and takes effect at the next reservation.

    Args:
        capacity: ring size in bytes.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._starts: list[int] = []
        self._ends: dict[int, int] = {}
        self._quarantined: set[int] = set()
        self._later: deque[int] = deque()
        self._head = 0

    @staticmethod
    def footprint(nbytes: int) -> int:
        """Bytes a reservation of ``nbytes`` takes (aligned, never zero)."""
        return _aligned(nbytes)

    def reserve(self, nbytes: int) -> int | None:
        """Reserve ``nbytes`` (aligned up) and return the offset, or ``None`` when no gap fits now."""
        self.drain()
        size = _aligned(nbytes)
        if size > self.capacity:
            return None
        head = self._head
        gaps = self._gaps()
        for start, end in gaps:  # first fit at or after the head ...
            lo = max(start, head)
            if end - lo >= size:
                return self._take(lo, size)
        for start, end in gaps:  # ... then from the start of the ring
            if start >= head:
                break
            if end - start >= size:
                return self._take(start, size)
        return None

    def _gaps(self) -> list[tuple[int, int]]:
        gaps, prev = [], 0
        for start in self._starts:
            if start > prev:
                gaps.append((prev, start))
            prev = self._ends[start]
        if prev < self.capacity:
            gaps.append((prev, self.capacity))
        return gaps

    def _take(self, offset: int, size: int) -> int:
        bisect.insort(self._starts, offset)
        self._ends[offset] = offset + size
        self._head = offset + size if offset + size < self.capacity else 0
        return offset

    def release(self, offset: int) -> None:
        """Give the range reserved at ``offset`` back (a quarantined or unknown range is left alone)."""
        if offset in self._quarantined or offset not in self._ends:
            return
        del self._ends[offset]
        self._starts.pop(bisect.bisect_left(self._starts, offset))

    def release_later(self, offset: int) -> None:
        """Release from any thread: queued, applied by the owner's next :meth:`reserve` or :meth:`drain`."""
        self._later.append(offset)

    def drain(self) -> None:
        """Apply the releases queued by :meth:`release_later`."""
        while self._later:
            self.release(self._later.popleft())

    def quarantine(self, offset: int) -> None:
        """Hand out the range reserved at ``offset`` no more, until :meth:`unquarantine`: its
        writer may still write there."""
        if offset in self._ends:
            self._quarantined.add(offset)

    def unquarantine(self, offset: int) -> None:
        """The range's writer can write no more: it is an ordinary reservation again (released by
        :meth:`release` like any other)."""
        self._quarantined.discard(offset)

    def is_quarantined(self, offset: int) -> bool:
        """Whether the range reserved at ``offset`` is quarantined."""
        return offset in self._quarantined

    @property
    def used(self) -> int:
        """Bytes reserved now (quarantined ranges included)."""
        return sum(self._ends[s] - s for s in self._starts)

    @property
    def quarantined(self) -> int:
        """Bytes lost to quarantine."""
        return sum(self._ends[s] - s for s in self._quarantined)

    @property
    def reservations(self) -> int:
        """Ranges reserved now."""
        return len(self._starts)
