"""The production window: a bounded staging area in the pool where producers put samples for feeders.

Producers (today the backend reader of :mod:`kspeed.server.production`; next preprocessing, the
failover re-reader and the streaming loader) write samples that are not resident in their home
region into the window, in the order the committed plans will consume them; feeders write them
from there into the clients' rings. The window is whole pool regions reserved at start (so the
manager never allocates them to a dataset), cut into equal **chunks**. Each owner (a feed) has
its own open chunk, where its samples are placed back to back (a bump allocator); a sample larger
than a chunk takes consecutive free chunks of one region. A chunk is reused once every sample
placed in it has been freed, so a sample a slow client still needs pins one chunk of its own
feed's, never another feed's room. What the window holds is counted in whole chunks, so
:attr:`ProductionWindow.used` can never exceed :attr:`ProductionWindow.capacity`.
"""

from __future__ import annotations

import dataclasses
import threading
from itertools import count

import numpy as np

from kspeed.errors import CapacityError, ConfigError
from kspeed.layout import SAMPLE_ALIGN
from kspeed.server.pool import WINDOW_OWNER, MemoryPool

__all__ = ["ProductionWindow", "Slot", "chunk_size_for"]

MIN_CHUNK = 64 << 10
CHUNKS_PER_REGION = 32


def chunk_size_for(region_size: int) -> int:
    """The window's chunk size for a pool of ``region_size`` regions: 1/32 of a region, at least 64 KiB."""
    return min(region_size, max(MIN_CHUNK, region_size // CHUNKS_PER_REGION))


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one produced sample sits in the window.

    Attributes:
        ticket: unique id of this placement (feeders count their reads of it by ticket).
        region: the pool region index (feeders map it by path).
        offset: byte offset of the sample in that region.
        nbytes: the sample's length.
        chunks: first chunk (global index) and how many the sample holds alone (0: it shares one).
    """

    ticket: int
    region: int
    offset: int
    nbytes: int
    first_chunk: int
    own_chunks: int


class ProductionWindow:
    """Pool regions reserved for production and the placement of samples in them.

    Thread-safe. :meth:`place` never blocks: it returns ``None`` when the window has no room now
    (the caller waits for :meth:`free` to make some, through :meth:`wait_for_room`).

    Args:
        pool: the server's pool; ``capacity`` bytes of it are reserved as whole regions.
        capacity: bytes to reserve (rounded down to whole regions, at least one region).

    Raises:
        CapacityError: the pool has fewer free regions than the window needs.
    """

    def __init__(self, pool: MemoryPool, capacity: int) -> None:
        region_size = pool.region_size
        regions = max(1, capacity // region_size)
        pool.release(WINDOW_OWNER)  # a window's content never outlives its server process
        try:
            infos = pool.allocate(WINDOW_OWNER, range(regions))
        except CapacityError as exc:
            raise ConfigError(
                f"server.production_window: {regions} region(s) of {region_size} bytes do not fit the pool: {exc}",
                field="server.production_window",
                value=capacity,
            ) from exc
        self.region_size = region_size
        self.chunk = chunk_size_for(region_size)
        self.per_region = region_size // self.chunk
        self.regions = [info.index for info in infos]
        self.paths = {info.index: str(info.path) for info in infos}
        self._arrays = {info.index: pool.array(info.index) for info in infos}
        self._pool = pool
        total = self.per_region * len(self.regions)
        self.capacity = total * self.chunk
        self._live = np.zeros(total, dtype=np.int64)  # samples placed in each chunk and not freed
        self._taken = np.zeros(total, dtype=bool)  # chunk handed out (open, full or owned by a big sample)
        self._open: dict[str, list[int]] = {}  # per owner, [its open chunk, bytes used in it]
        self._tickets = count(1)
        self._cond = threading.Condition()
        self.peak = 0
        self.placed = 0

    # -- placement -------------------------------------------------------------------------------

    @property
    def used(self) -> int:
        """Bytes of the window held now (whole chunks)."""
        with self._cond:
            return self._used()

    def _used(self) -> int:
        idle = sum(1 for chunk, _ in self._open.values() if self._live[chunk] == 0)  # open chunks, emptied
        return (int(self._taken.sum()) - idle) * self.chunk

    def fits(self, nbytes: int) -> bool:
        """Whether a sample of ``nbytes`` can ever be placed (it must fit one region)."""
        return nbytes <= self.region_size

    def place(self, nbytes: int, owner: str = "") -> Slot | None:
        """Room for one sample of ``nbytes`` in ``owner``'s chunks, or ``None`` when the window is full now.

        Raises:
            CapacityError: the sample is larger than a region (it can never be placed).
        """
        if not self.fits(nbytes):
            raise CapacityError(f"a sample of {nbytes} bytes does not fit a window region of {self.region_size}")
        size = max(SAMPLE_ALIGN, -(-nbytes // SAMPLE_ALIGN) * SAMPLE_ALIGN)
        with self._cond:
            if size > self.chunk:
                return self._place_big(nbytes, size)
            current = self._open.get(owner)
            if (current is None or current[1] + size > self.chunk) and not self._open_chunk(owner):
                return None
            current = self._open[owner]
            chunk, offset = current
            current[1] += size
            self._live[chunk] += 1
            return self._slot(chunk, offset, nbytes, 0)

    def _open_chunk(self, owner: str) -> bool:
        self._close_chunk(owner)
        free = np.flatnonzero(~self._taken)
        if not len(free):
            return False
        chunk = int(free[0])
        self._open[owner] = [chunk, 0]
        self._taken[chunk] = True
        self._note_peak()
        return True

    def _close_chunk(self, owner: str) -> None:
        """Stop bumping into ``owner``'s open chunk; it is reused once its samples are freed."""
        current = self._open.pop(owner, None)
        if current is not None and self._live[current[0]] == 0:
            self._taken[current[0]] = False

    def forget(self, owner: str) -> None:
        """An owner is gone (its feed closed): its open chunk goes back once its samples are freed."""
        with self._cond:
            self._close_chunk(owner)
            self._cond.notify_all()

    def _place_big(self, nbytes: int, size: int) -> Slot | None:
        need = -(-size // self.chunk)
        free = ~self._taken
        for r in range(len(self.regions)):
            base = r * self.per_region
            run = 0
            for c in range(self.per_region):
                run = run + 1 if free[base + c] else 0
                if run == need:
                    first = base + c - need + 1
                    self._taken[first : first + need] = True
                    self._live[first] += 1
                    self._note_peak()
                    return self._slot(first, 0, nbytes, need)
        return None

    def _slot(self, chunk: int, offset: int, nbytes: int, own: int) -> Slot:
        region = self.regions[chunk // self.per_region]
        at = (chunk % self.per_region) * self.chunk + offset
        self.placed += 1
        return Slot(next(self._tickets), region, at, nbytes, chunk, own)

    def _note_peak(self) -> None:
        self.peak = max(self.peak, self._used())

    def free(self, slot: Slot) -> None:
        """Give a placed sample's room back (its chunk is reused once all of its samples are freed)."""
        with self._cond:
            chunk = slot.first_chunk
            self._live[chunk] -= 1
            if slot.own_chunks:
                self._taken[chunk : chunk + slot.own_chunks] = False
            elif self._live[chunk] == 0:
                opener = next((o for o, (c, _) in self._open.items() if c == chunk), None)
                if opener is None:
                    self._taken[chunk] = False
                else:
                    self._open[opener][1] = 0  # an open chunk emptied: fill it again from the start
            self._cond.notify_all()

    def wait_for_room(self, timeout: float) -> None:
        """Wait until something is freed (or ``timeout`` seconds pass)."""
        with self._cond:
            self._cond.wait(timeout)

    def region_array(self, region: int) -> np.ndarray:
        """A whole window region (pool index ``region``), writable: producers read into it."""
        return self._arrays[region]

    def view(self, slot: Slot) -> np.ndarray:
        """The bytes of a placed sample (writable)."""
        return self._arrays[slot.region][slot.offset : slot.offset + slot.nbytes]

    def close(self) -> None:
        """Give the window's regions back to the pool."""
        self._pool.release(WINDOW_OWNER)
