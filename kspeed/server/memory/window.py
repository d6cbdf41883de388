"""The production window: a bounded staging area in the pool where producers put samples for feeders.

Producers (production's backend readers, :mod:`kspeed.server.production.core`, and its
preprocessed samples) write samples that are not resident in their home region into the window,
in the order the committed plans will consume them; feeders write them from there into the
clients' rings. The window is whole pool regions reserved at start (so the
manager never allocates them to a dataset), cut into equal **chunks**. Each owner (a feed) has
its own open chunk, where its samples are placed back to back (a bump allocator); a sample larger
than a chunk takes consecutive free chunks of one region. A chunk is reused once every sample
placed in it has been freed, so a sample a slow client still needs pins one chunk of its own
feed's, never another feed's room. What the window holds is counted in whole chunks, so
:attr:`ProductionWindow.used` can never exceed :attr:`ProductionWindow.capacity`.

A share held under a memory policy has a window of its own (:meth:`ProductionWindow.over` the
regions the manager gave it), with chunks sized to its samples (:func:`chunk_size_for_samples`), so
that letting one sample go frees room for about one sample. Tickets are unique across all windows
of a process (feeders count their reads by ticket).
"""

from __future__ import annotations

import dataclasses
import threading
from itertools import count

import numpy as np

from kspeed.errors import CapacityError, ConfigError
from kspeed.layout import SAMPLE_ALIGN
from kspeed.server.memory.pool import WINDOW_OWNER, MemoryPool

__all__ = ["ProductionWindow", "Slot", "chunk_size_for", "chunk_size_for_samples"]

MIN_CHUNK = 64 << 10
CHUNKS_PER_REGION = 32
_TICKETS = count(1)  # one sequence for every window of the process


def chunk_size_for(region_size: int) -> int:
    """The window's chunk size for a pool of ``region_size`` regions: 1/32 of a region, at least 64 KiB."""
    return min(region_size, max(MIN_CHUNK, region_size // CHUNKS_PER_REGION))


def chunk_size_for_samples(sizes: np.ndarray, region_size: int, capacity: int) -> int:
    """The chunk size of a share's own window of ``capacity`` bytes: eight times the 99th
    percentile sample (samples then fill a chunk to within a few percent, and few are larger than
    one), but at most :func:`chunk_size_for` the region size and at most a 64th of the window
    (a small window is cut finely, so that the chunks its feeds fill at once leave it room;
    samples larger than a chunk take consecutive chunks of their own), aligned."""
    sizes = np.asarray(sizes, dtype=np.int64)
    if not len(sizes):
        return chunk_size_for(region_size)
    want = max(8 * int(np.percentile(sizes, 99)), SAMPLE_ALIGN)
    want = min(want, chunk_size_for(region_size), max(capacity // 64, SAMPLE_ALIGN))
    return -(-want // SAMPLE_ALIGN) * SAMPLE_ALIGN


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
        self._setup(pool, [info.index for info in infos], chunk_size_for(region_size), owned=True)

    @classmethod
    def over(cls, pool: MemoryPool, regions: list[int], chunk: int, open_chunks: int = 2) -> ProductionWindow:
        """A window over pool regions someone else holds (a share's, :mod:`kspeed.server.hosting.datasets`):
        :meth:`close` leaves them to their holder. Each owner fills up to ``open_chunks`` chunks at
        once, a sample going to the first with room (so a sample that does not fit the rest of a
        chunk leaves it open for smaller ones rather than wasting it).

        Raises:
            ConfigError: no region, or a chunk size outside 1..region size.
        """
        if not regions or not 0 < chunk <= pool.region_size:
            raise ConfigError(
                f"a window needs regions ({len(regions)} given) and a chunk of 1..{pool.region_size} bytes ({chunk})"
            )
        window = cls.__new__(cls)
        window._setup(pool, list(regions), int(chunk), owned=False)
        window.open_chunks = max(int(open_chunks), 1)
        return window

    def _setup(self, pool: MemoryPool, regions: list[int], chunk: int, *, owned: bool) -> None:
        region_size = pool.region_size
        self.region_size = region_size
        self.chunk = chunk
        self.per_region = region_size // self.chunk
        self.regions = list(regions)
        self.paths = {index: str(pool.path(index)) for index in regions}
        self._arrays = {index: pool.array(index) for index in regions}
        self._pool = pool
        self._owned = owned
        self.open_chunks = 1  # chunks each owner fills at once (a sample goes to the first with room)
        total = self.per_region * len(self.regions)
        self.capacity = total * self.chunk
        self._live = np.zeros(total, dtype=np.int64)  # samples placed in each chunk and not freed
        self._taken = np.zeros(total, dtype=bool)  # chunk handed out (open, full or owned by a big sample)
        self._open: dict[str, list[list[int]]] = {}  # per owner, its open chunks: [chunk, bytes used in it]
        self._opener: dict[int, str] = {}  # open chunk -> its owner
        self._cond = threading.Condition()
        self.peak = 0
        self.placed = 0
        self.live_bytes = 0  # bytes of the samples placed and not freed
        self._packed = self._packed_chunks = 0  # bytes placed in chunks since closed, and those chunks

    # -- placement -------------------------------------------------------------------------------

    @property
    def used(self) -> int:
        """Bytes of the window held now (whole chunks)."""
        with self._cond:
            return self._used()

    def _used(self) -> int:
        idle = sum(1 for chunk in self._opener if self._live[chunk] == 0)  # open chunks, emptied
        return (int(self._taken.sum()) - idle) * self.chunk

    def packing(self) -> float:
        """How full samples leave the chunks they were placed in, over the window's life (a prior
        of 3/4 over the first chunks): the bytes of samples a window of this size holds, per
        byte of it."""
        with self._cond:
            prior = 16
            return (self._packed + 0.75 * prior * self.chunk) / ((self._packed_chunks + prior) * self.chunk)

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
            opens = self._open.get(owner, [])
            current = next((entry for entry in opens if entry[1] + size <= self.chunk), None)
            if current is None:
                if len(opens) >= self.open_chunks:
                    self._close(owner, max(opens, key=lambda entry: entry[1]))  # the fullest one
                current = self._open_chunk(owner)
                if current is None:
                    return None
            chunk, offset = current
            current[1] += size
            self._live[chunk] += 1
            return self._slot(chunk, offset, nbytes, 0)

    def _open_chunk(self, owner: str) -> list[int] | None:
        chunk = int(np.argmin(self._taken))
        if self._taken[chunk]:
            return None
        entry = [chunk, 0]
        self._open.setdefault(owner, []).append(entry)
        self._opener[chunk] = owner
        self._taken[chunk] = True
        self._note_peak()
        return entry

    def _close(self, owner: str, entry: list[int]) -> None:
        """Stop bumping into one of ``owner``'s open chunks; it is reused once its samples are freed."""
        self._packed += entry[1]
        self._packed_chunks += 1
        self._open[owner].remove(entry)
        if not self._open[owner]:
            del self._open[owner]
        del self._opener[entry[0]]
        if self._live[entry[0]] == 0:
            self._taken[entry[0]] = False

    def forget(self, owner: str) -> None:
        """An owner is gone (its feed closed): its open chunk goes back once its samples are freed."""
        with self._cond:
            for entry in list(self._open.get(owner, ())):
                self._close(owner, entry)
            self._cond.notify_all()

    def _place_big(self, nbytes: int, size: int) -> Slot | None:
        """The first run of free chunks within one region that holds ``size`` bytes."""
        need = -(-size // self.chunk)
        if need > self.per_region:
            return None
        free = (~self._taken).reshape(len(self.regions), self.per_region).astype(np.int32)
        runs = np.zeros((len(self.regions), self.per_region + 1), dtype=np.int32)
        np.cumsum(free, axis=1, out=runs[:, 1:])
        fits = np.argwhere(runs[:, need:] - runs[:, :-need] == need)
        if not len(fits):
            return None
        first = int(fits[0][0]) * self.per_region + int(fits[0][1])
        self._packed += size
        self._packed_chunks += need
        self._taken[first : first + need] = True
        self._live[first] += 1
        self._note_peak()
        return self._slot(first, 0, nbytes, need)

    def _slot(self, chunk: int, offset: int, nbytes: int, own: int) -> Slot:
        region = self.regions[chunk // self.per_region]
        at = (chunk % self.per_region) * self.chunk + offset
        self.placed += 1
        self.live_bytes += nbytes
        return Slot(next(_TICKETS), region, at, nbytes, chunk, own)

    def _note_peak(self) -> None:
        self.peak = max(self.peak, self._used())

    def free(self, slot: Slot) -> None:
        """Give a placed sample's room back (its chunk is reused once all of its samples are freed)."""
        with self._cond:
            chunk = slot.first_chunk
            self._live[chunk] -= 1
            self.live_bytes -= slot.nbytes
            if slot.own_chunks:
                self._taken[chunk : chunk + slot.own_chunks] = False
            elif self._live[chunk] == 0:
                opener = self._opener.get(chunk)
                if opener is None:
                    self._taken[chunk] = False
                else:  # an open chunk emptied: fill it again from the start
                    next(entry for entry in self._open[opener] if entry[0] == chunk)[1] = 0
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
        """Give the window's regions back to the pool (a window :meth:`over` regions held by
        someone else leaves them to their holder)."""
        if self._owned:
            self._pool.release(WINDOW_OWNER)
