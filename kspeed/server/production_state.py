"""What production tracks: the producers' seam, and its records of feeds, plans and shares.

:mod:`kspeed.server.production` follows these; they are apart so that module holds the logic.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np

from kspeed.server.preload import Preloader
from kspeed.server.window import ProductionWindow, Slot

__all__ = ["BackendReader", "Draining", "FeedState", "PlanState", "PrepSpec", "Producer", "ShareState", "Work"]


class Producer(Protocol):
    """What fills window slots: the backend reader today; preprocessing workers, the failover
    re-reader and the streaming loader plug in here."""

    def produce(
        self, preloader: Preloader, ids: np.ndarray, slots: list[Slot], window: ProductionWindow
    ) -> tuple[np.ndarray, dict[int, str]]:
        """Write the bytes of ``ids`` into their ``slots``; returns their crc32c and the failed ones with why."""
        ...


class BackendReader:
    """The producer of raw samples: reads them from the backend, checksumming as they land."""

    def produce(
        self, preloader: Preloader, ids: np.ndarray, slots: list[Slot], window: ProductionWindow
    ) -> tuple[np.ndarray, dict[int, str]]:
        crcs = np.zeros(len(ids), dtype=np.uint32)
        errors = []
        for region in sorted({s.region for s in slots}):
            at = [k for k, s in enumerate(slots) if s.region == region]
            got, failed = preloader.source.read_run(
                [int(ids[k]) for k in at],
                window.region_array(region),
                [slots[k].offset for k in at],
                [slots[k].nbytes for k in at],
            )
            crcs[at] = got
            errors.extend(failed)
        preloader.changed(errors)  # a file changed since the listing is recorded for the whole share
        return crcs, {e.sample: str(e) for e in errors if isinstance(e.sample, int)}


@dataclasses.dataclass
class PlanState:
    """One installed plan of one feed, as production follows it."""

    epoch: int
    ids: np.ndarray  # owned samples in plan order
    positions: np.ndarray  # their plan positions
    starts: np.ndarray  # plan index of each batch's first position
    written: np.ndarray  # per owned position, written to the client
    next: int = 0  # first owned position not written
    processed: np.ndarray | None = None  # per owned position, run through the server stages here
    prep: PrepSpec | None = None  # how (with processed positions)
    state: np.ndarray | None = None  # per processed position: ABSENT, READING (being produced), WINDOW, FAILED
    slots: dict[int, Slot] = dataclasses.field(default_factory=dict)  # owned index -> its produced slot

    def mark(self, batch: int, first: int, end: int) -> tuple[int, int]:
        """Record a written grant; returns the range of owned indices it covered."""
        if not 0 <= batch < len(self.starts) - 1:
            return 0, 0
        lo = int(self.starts[batch]) + first
        hi = min(int(self.starts[batch]) + end, int(self.starts[batch + 1]))
        i, j = (int(x) for x in np.searchsorted(self.positions, (lo, hi)))
        self.written[i:j] = True
        while self.next < len(self.written) and self.written[self.next]:
            self.next += 1
        return i, j

    def delivered_before(self, position: int) -> None:
        """Record the plan positions before ``position`` as written (delivered before a failover)."""
        self.written[: int(np.searchsorted(self.positions, position))] = True
        while self.next < len(self.written) and self.written[self.next]:
            self.next += 1

    def raw(self, span: slice) -> np.ndarray:
        """Mask of the positions of ``span`` served as raw samples (not processed here)."""
        if self.processed is None:
            return np.ones(len(self.ids[span]), dtype=bool)
        return ~self.processed[span]

    def ahead(self, budget: int) -> np.ndarray:
        """The unwritten raw samples among the next ``budget`` positions from :attr:`next`."""
        span = slice(self.next, self.next + budget)
        return self.ids[span][~self.written[span] & self.raw(span)]


@dataclasses.dataclass(frozen=True)
class PrepSpec:
    """The server stages a plan's processed positions go through."""

    pipeline: bytes  # serialized kspeed.v1.Pipeline
    stages: int
    seed: int
    epoch: int  # the user's epoch random stages draw from (plans are numbered per feed otherwise)
    nbytes: int  # the declared output's size in the ring (with the status word when skipping)
    skip: bool = False  # a sample whose stages fail is sent as a failure record, not failing its grant
    start: int = 0  # stages already applied to the stored samples (a dataset cached preprocessed)


@dataclasses.dataclass
class Work:
    """Samples a producer makes resident: raw ones (``at`` is None) or processed positions of a plan."""

    share: ShareState
    feed_id: str
    ids: np.ndarray
    epoch: int = -1
    at: np.ndarray | None = None
    plan: PlanState | None = None


@dataclasses.dataclass
class FeedState:
    feed_id: str
    share: tuple[str, int]  # (dataset, first sample of the share it serves)
    feeder: int
    plans: dict[int, PlanState] = dataclasses.field(default_factory=dict)
    held: int = 0  # window bytes produced for this feed and not retired
    waiting: int = 0  # grants its feeder reported waiting on production


@dataclasses.dataclass
class Draining:
    slot: Slot
    feeders: set[int]


class ShareState:
    """One share's production state: its window slots."""

    def __init__(self, key: tuple[str, int], preloader: Preloader) -> None:
        self.key = key
        self.dataset = key[0]
        self.preloader = preloader
        self.residency = preloader.residency
        self.lo = preloader.index.lo
        self.size = len(preloader.index.length)
        self.slots: dict[int, tuple[Slot, int, str]] = {}  # sample -> (slot, crc, feed produced for)
        pool = preloader.pool
        self._home = {index: str(pool.path(index)) for index in preloader.pool_indices}

    def home_paths(self) -> dict[int, str]:
        """The files of the share's regions (pool index -> path), fixed for the share's life."""
        return self._home
