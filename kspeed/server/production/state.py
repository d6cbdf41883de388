"""What production tracks: the producers' seam, and its records of feeds, plans and shares.

:mod:`kspeed.server.production.core` follows these; they are apart so that module holds the logic.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Protocol

import numpy as np

from kspeed.server.feeder.plan_part import search
from kspeed.server.hosting.preload import Preloader
from kspeed.server.memory.flags import Flags
from kspeed.server.memory.residency import ABSENT
from kspeed.server.memory.window import ProductionWindow, Slot
from kspeed.server.production.groups import GroupState, Membership, OutputKey, plan_lookup
from kspeed.server.production.policies import WHOLE, CacheState, MemoryPolicy, policy_for

__all__ = [
    "BackendReader",
    "Draining",
    "EpochFigures",
    "FeedState",
    "PlanState",
    "PrepSpec",
    "Producer",
    "ShareState",
    "Work",
]

FIGURED_EPOCHS = 8  # epochs whose figures a share keeps


class Producer(Protocol):
    """What fills window slots with a share's raw samples (:class:`BackendReader`; a re-read after a
    failover or a stream is the same read). Preprocessed positions are made per plan instead, by
    :class:`~kspeed.server.production.processed.ProcessedProduction`, which also places them."""

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
    """One installed plan of one feed, as production follows it.

    Its arrays are those of the :class:`~kspeed.server.feeder.plan_part.PlanPart` it was installed
    from (shared, not copied), in their compact dtypes (int32 IDs and positions); the written marks
    are a bit each.

    A plan the client truncated (:meth:`truncate`) ends at :attr:`cut`: the positions from there on
    are marked written, so nothing treats them as due (horizon, first grant, uses), and counted in
    :attr:`truncated` rather than as written samples (:meth:`delivered`).
    """

    epoch: int
    ids: np.ndarray  # owned samples in plan order
    positions: np.ndarray  # their plan positions
    starts: np.ndarray  # plan index of each batch's first position
    written: Flags  # per owned position, written to the client or cut off (a bool array given is packed)
    next: int = 0  # first owned position not written
    processed: np.ndarray | None = None  # per owned position, run through the server stages here
    prep: PrepSpec | None = None  # how (with processed positions)
    state: np.ndarray | None = None  # per processed position: ABSENT, READING (being produced), WINDOW, FAILED
    slots: dict[int, Slot] = dataclasses.field(default_factory=dict)  # owned index -> its produced slot
    user_epoch: int = 0  # the sampler's epoch (figures are kept by it; plans are numbered per feed)
    # per owned position, the writes due beyond the next one (a re-grant while an earlier grant of
    # it was still unwritten); allocated at the first such re-grant
    extra: np.ndarray | None = None
    cut: int = -1  # first owned position the client no longer wants (-1 given: none, the plan's length)
    truncated: int = 0  # positions from cut on that were not written when cut off
    # processed positions placed at (or due) a group's shared output, by owned index
    shared: dict[int, OutputKey] = dataclasses.field(default_factory=dict)
    _order: np.ndarray | None = None  # argsort of ids, made when a group first asks (:meth:`locate`)

    def __post_init__(self) -> None:
        if not isinstance(self.written, Flags):  # (given as a bool per position)
            self.written = Flags.of(self.written)
        if self.cut < 0:
            self.cut = len(self.ids)

    @property
    def planned(self) -> int:
        """Positions the plan still has to write or wrote: all but those cut off unwritten."""
        return len(self.ids) - self.truncated

    def delivered(self) -> int:
        """Positions written to the client (those cut off unwritten are not)."""
        return self.written.sum() - self.truncated

    def mark(self, batch: int, first: int, end: int) -> tuple[int, int, np.ndarray]:
        """Record a written grant; returns the range of owned indices it covered and those of
        them written now (not before, and not due again: a position granted twice stays
        unwritten until its second grant is written)."""
        if not 0 <= batch < len(self.starts) - 1:
            return 0, 0, np.zeros(0, np.int64)
        lo = int(self.starts[batch]) + first
        hi = min(int(self.starts[batch]) + end, int(self.starts[batch + 1]))
        i, j = (int(x) for x in search(self.positions, (lo, hi)))
        span = np.arange(i, j)
        if self.extra is not None:
            due = self.extra[i:j] > 0
            self.extra[span[due]] -= 1
            span = span[~due]
        fresh = span[~self.written[span]]
        self.written.set(fresh)
        self.next = self.written.first(self.next, False)
        return i, j, fresh

    def granted_again(self, at: np.ndarray) -> np.ndarray:
        """Owned positions ``at`` were granted again (a re-grant after a fence): each is due one
        more write. Returns those that were written (unwritten again now: produced anew). Those
        cut off (:meth:`truncate`) are not due again: their grants are refused."""
        at = np.asarray(at, dtype=np.int64)
        at = at[at < self.cut]
        done = at[self.written[at]]
        pending = at[~self.written[at]]
        if len(pending):
            if self.extra is None:
                self.extra = np.zeros(len(self.ids), dtype=np.int32)
            np.add.at(self.extra, pending, 1)
        if len(done):
            self.written.set(done, False)
            self.next = min(self.next, int(done.min()))
        return done

    def delivered_before(self, position: int) -> None:
        """Record the plan positions before ``position`` as written (delivered before a failover)."""
        self.written.set(slice(0, int(search(self.positions, position))))
        self.next = self.written.first(self.next, False)

    def truncate(self, batch: int) -> np.ndarray:
        """The client no longer wants the plan from ``batch`` on: it committed the rest as a new
        pass, and every batch of this one it granted is before ``batch`` (those are still written
        as granted). The positions from ``starts[batch]`` on are cut off: marked written, so they
        leave the horizon and the uses at once and nothing is produced for them, no write of them
        is due any more, and those not written are counted in :attr:`truncated` (not as written
        samples). A later truncation at a later batch changes nothing.

        Returns:
            The owned positions cut off now that were not written (their samples are needed no
            more by this plan).
        """
        batch = min(max(int(batch), 0), len(self.starts) - 1)
        cut = int(search(self.positions, int(self.starts[batch])))
        if cut >= self.cut:
            return np.zeros(0, np.int64)
        off = self.written.positions(cut, self.cut, value=False)
        self.written.set(slice(cut, self.cut))
        if self.extra is not None:
            self.extra[cut:] = 0
        self.cut = cut
        self.truncated += len(off)
        self.next = self.written.first(self.next, False)
        return off

    def locate(self, wanted: np.ndarray) -> np.ndarray:
        """Owned indices of samples ``wanted`` in this plan (-1: not in it)."""
        if self._order is None:
            self._order = np.argsort(self.ids, kind="stable")
        return plan_lookup(self.ids, self._order, np.asarray(wanted, dtype=self.ids.dtype))

    def raw(self, span: slice) -> np.ndarray:
        """Mask of the positions of ``span`` served as raw samples (not processed here)."""
        if self.processed is None:
            return np.ones(len(self.ids[span]), dtype=bool)
        return ~self.processed[span]

    def first_span(self) -> slice:
        """The owned positions from the first unwritten one to the end of its batch (a grant never
        spans two batches, so the feeder's next grant needs at most these); empty when all are written."""
        if self.next >= len(self.ids):
            return slice(len(self.ids), len(self.ids))
        batch = int(np.searchsorted(self.starts, int(self.positions[self.next]), side="right")) - 1
        end = int(search(self.positions, int(self.starts[min(batch + 1, len(self.starts) - 1)])))
        return slice(self.next, max(end, self.next + 1))

    def first_grant(self) -> np.ndarray:
        """The unwritten raw samples of the batch holding the first unwritten position."""
        span = self.first_span()
        return self.ids[span][~self.written[span] & self.raw(span)].astype(np.int64)

    def first_processed(self) -> np.ndarray:
        """The processed positions of the batch holding the first unwritten position that are
        unwritten and not produced (nor being produced)."""
        if self.processed is None or self.state is None:
            return np.zeros(0, np.int64)
        span = self.first_span()
        todo = self.processed[span] & (self.state[span] == ABSENT) & ~self.written[span]
        return np.flatnonzero(todo) + span.start

    def ahead(self, budget: int) -> np.ndarray:
        """The unwritten raw samples among the next ``budget`` positions from :attr:`next`."""
        span = slice(self.next, self.next + budget)
        return self.ids[span][~self.written[span] & self.raw(span)].astype(np.int64)


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
    user_epoch: int = -1  # raw samples read for a plan: its sampler epoch
    outputs: list[OutputKey | None] | None = None  # per processed position: the group output it makes (None: alone)
    group: GroupState | None = None  # the group whose outputs those are


@dataclasses.dataclass
class FeedState:
    feed_id: str
    share: tuple[str, int]  # (dataset, first sample of the share it serves)
    feeder: int
    plans: dict[int, PlanState] = dataclasses.field(default_factory=dict)
    held: int = 0  # bytes of raw samples produced for this feed into its share's window, not retired
    made: int = 0  # production-window bytes of its processed positions (its own slots and its uses of group outputs)
    waiting: int = 0  # grants its feeder reported waiting on production
    served: int = 0  # grants its feeder reported written
    counted: int | None = None  # with its share's own window: the plan whose unwritten uses are counted
    ranks: int = 0  # its job's ranks, as its client told (0: not told)
    job: str = ""  # its job's name, as its client told (the preprocessing workers are shared by job)
    membership: Membership | None = None  # its job's group, as its client told
    progressed: float = dataclasses.field(default_factory=time.monotonic)  # when a grant of it was last written


@dataclasses.dataclass
class Draining:
    slot: Slot
    feeders: set[int]
    window: ProductionWindow  # the window the slot is in


@dataclasses.dataclass
class EpochFigures:
    """What one plan epoch of a share's feeds cost its holder (see ``EpochFigures`` in the protocol)."""

    epoch: int
    planned: int = 0
    written: int = 0
    misses: int = 0
    backend_bytes: int = 0
    backend_requests: int = 0
    stall_s: float = 0.0

    @property
    def hits(self) -> int:
        """Written samples that were resident without a read for this epoch."""
        return max(self.written - self.misses, 0)


class ShareState:
    """One share's production state: its window slots, and under a memory policy its own window.

    Args:
        key: (dataset, first sample of the share).
        preloader: the share's preloader (its index, residency and backend reads).
        window: where its samples are produced (the server's window, or the share's own).
        policy: what production does with the share's samples
            (:mod:`kspeed.server.production.policies`): held whole (the default: samples go home
            once written), on demand (no copy: the server's window keeps a sample until it is
            written) or a memory policy, in the share's own window: ``stream`` (likewise, planned
            as far ahead as it holds) or a caching one (written samples stay, chosen by the policy).
    """

    def __init__(
        self,
        key: tuple[str, int],
        preloader: Preloader,
        window: ProductionWindow | None = None,
        policy: MemoryPolicy | None = None,
    ) -> None:
        self.key = key
        self.dataset = key[0]
        self.preloader = preloader
        self.residency = preloader.residency
        self.lo = preloader.index.lo
        self.size = len(preloader.index.length)
        self.mean_size = preloader.index.total_bytes / self.size if self.size else 0.0
        self.window = window
        self.policy = policy if policy is not None else policy_for(WHOLE)
        self.slots: dict[int, tuple[Slot, int, str]] = {}  # sample -> (slot, crc, feed produced for)
        self.cache = CacheState()  # under a caching policy, the written samples it keeps
        self.figures: dict[int, EpochFigures] = {}
        self.too_small = False  # warned that the window cannot hold one batch of each feed
        # with its own window: per sample, the unwritten positions of its feeds' current plans
        # (no array for a share in the server's window, which never counts them)
        self.uses = np.zeros(self.size if self.own_window else 0, dtype=np.int32)
        pool = preloader.pool
        self._home = {index: str(pool.path(index)) for index in preloader.pool_indices}

    @property
    def own_window(self) -> bool:
        """Whether the share produces into a window of its own (a memory policy)."""
        return self.policy.own_window

    def figures_of(self, epoch: int) -> EpochFigures:
        """The figures of plan epoch ``epoch`` (the oldest are dropped beyond a few epochs)."""
        got = self.figures.get(epoch)
        if got is None:
            got = self.figures[epoch] = EpochFigures(epoch)
            for old in sorted(self.figures)[:-FIGURED_EPOCHS]:
                del self.figures[old]
        return got

    def home_paths(self) -> dict[int, str]:
        """The files of the share's regions (pool index -> path), fixed for the share's life."""
        return self._home
