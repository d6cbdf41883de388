"""Slices of shared regions: small datasets packed into pool regions they share.

A dataset far smaller than a region (the manager decides: :func:`kspeed.manager.allocator.slice_size`)
takes a **slice** of a region it shares with other small datasets instead of a region of its own.
:class:`SharedRegions` holds those regions (pool owner :data:`SHARED_OWNER`) and places each
share's slice first-fit at an offset aligned to :data:`~kspeed.manager.allocator.SLICE_ALIGN`;
a region whose last slice is given back returns to the pool. Feeders address a slice's samples
as any others (pool region, byte offset), so nothing else knows.

Slices are not re-adopted after a restart: the shared regions are released when the host starts
(a small dataset loads again in moments), so a slice's bytes never outlive the process that
placed them.
"""

from __future__ import annotations

import threading

from kspeed.errors import CapacityError
from kspeed.server.memory.pool import SHARED_OWNER, MemoryPool

__all__ = ["SharedRegions", "Slice"]

Slice = tuple[int, int, int]  # (pool region index, byte offset, bytes)


class SharedRegions:
    """The slices of one server's shared regions, by owner key (thread-safe).

    Args:
        pool: the server's pool; shared regions are allocated from it as needed.
    """

    def __init__(self, pool: MemoryPool) -> None:
        self.pool = pool
        self._lock = threading.Lock()
        self._regions: dict[int, list[tuple[int, int, object]]] = {}  # pool index -> sorted (offset, size, key)
        self._vindex: dict[int, int] = {}  # pool index -> its virtual index under SHARED_OWNER
        self._slots: dict[object, Slice] = {}
        pool.release(SHARED_OWNER)  # slices never outlive the process that placed them

    def take(self, key: object, size: int) -> Slice:
        """A slice of ``size`` bytes for ``key`` (the same one again if ``key`` holds one of that size).

        Raises:
            CapacityError: ``size`` exceeds a region, or no shared region has room and the pool
                has no free region left; nothing is taken.
        """
        with self._lock:
            held = self._slots.get(key)
            if held is not None and held[2] == size:
                return held
            if held is not None:
                self._give(key)
            if not 0 < size <= self.pool.region_size:
                raise CapacityError(f"a slice of {size} bytes does not fit a region of {self.pool.region_size}")
            for index, used in self._regions.items():
                at = self._gap(used, size)
                if at is not None:
                    return self._place(key, index, at, size)
            vindex = max(self._vindex.values(), default=-1) + 1
            (info,) = self.pool.allocate(SHARED_OWNER, [vindex])
            self._regions[info.index] = []
            self._vindex[info.index] = vindex
            return self._place(key, info.index, 0, size)

    def give(self, key: object) -> None:
        """Give ``key``'s slice back (a region left empty returns to the pool)."""
        with self._lock:
            self._give(key)

    def slot(self, key: object) -> Slice | None:
        """Where ``key``'s slice is, if it holds one."""
        with self._lock:
            return self._slots.get(key)

    def regions(self) -> int:
        """Shared regions held now."""
        with self._lock:
            return len(self._regions)

    def _gap(self, used: list[tuple[int, int, object]], size: int) -> int | None:
        at = 0
        for offset, length, _ in used:
            if offset - at >= size:
                return at
            at = offset + length
        return at if self.pool.region_size - at >= size else None

    def _place(self, key: object, index: int, at: int, size: int) -> Slice:
        used = self._regions[index]
        used.append((at, size, key))
        used.sort(key=lambda entry: entry[0])
        slot = (index, at, size)
        self._slots[key] = slot
        return slot

    def _give(self, key: object) -> None:
        slot = self._slots.pop(key, None)
        if slot is None:
            return
        index = slot[0]
        self._regions[index] = [e for e in self._regions[index] if e[2] != key]
        if not self._regions[index]:
            del self._regions[index]
            self.pool.release(SHARED_OWNER, [self._vindex.pop(index)])
