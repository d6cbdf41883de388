"""Production: samples made resident in the order the committed plans will consume them.

A committed plan says, for each feed, which of this server's samples its client will need and in
what order. Production keeps, per feed, the position of the first sample not written yet (the
feeders report what they wrote) and makes the next :attr:`Production.depth` samples resident ahead
of it: a sample at home (in its place in the share's pool regions) is served from there with no
copy; one that is not is produced into the production window (:mod:`kspeed.server.memory.window`) by
producer threads, today reading it from the backend. Feeders answer a grant once every sample it
covers is resident (:mod:`kspeed.server.feeder.writer`).

Each feed may hold at most its fair share of the window (the capacity over the feeds with work),
so a client that stops reading cannot starve the others. A window slot is retired once its sample
is no longer within any feed's **horizon** (the unwritten positions among the next ``depth`` of
its plans): the sample is first copied home (so the preload never reads it again, and a later
epoch finds it there), then every feeder is told its new place; the slot is reused when no feeder
is still reading it. Positions granted again (the client fenced a server and grants again what
it had not delivered, survivors included) are unwritten again: they re-enter the horizon, so a
retired sample is found at home or, with no home, produced anew, and each is held until its last
grant is written (:meth:`Production.progress`). A plan the client truncated (it re-split the rest
into a new pass, committed from a later batch) ends there: the positions cut off leave the horizon
at once and what was produced only for them is released, as if they had been written, while the
batches granted before the cut are still produced and served.

The background preload (:mod:`kspeed.server.hosting.preload`) runs beside it and reads what the plans need
after the producers' depth first, then the rest; claims on the share's
:class:`~kspeed.server.memory.residency.Residency` keep the two from reading a sample twice.

**Memory policies.** A share whose dataset does not fit the cluster is held under a policy, in a
window of its own (the regions the manager gave it; nothing is preloaded and nothing goes home):

- ``stream`` (the default for such a dataset): each feed's horizon is as much of its plans as its
  fair share of the share's window holds, into the next epoch's plan once the current one's rest
  fits (a sampler deterministic in (seed, epoch) has it committed early), so the window never
  drains at an epoch boundary. A sample is let go once no feed's horizon holds it and no feed's
  current plan still needs it: every attached consumer was served it (a re-grant after a fence
  reads it again), and none is read twice for one grant of it. Each plan fills chunks of its own, so a
  chunk is freed as its plan is written. Feeds of one share with
  the same order (two jobs on one dataset) share a sample while both horizons hold it, that is
  while they are at most a window apart; beyond that each pays its own reads.
- ``minio``, ``reuse`` and ``lru`` (for comparison) prefetch the same way into a quarter of the
  window and keep written samples in the rest: ``minio`` the first that fit, for good (the rest
  are read each epoch); ``reuse`` lets go, when room is needed, the samples whose next use in the
  known plans is farthest; ``lru`` the least recently written.

Each of these decisions (and those of a share held whole or on demand) is made by the share's
policy object (:mod:`kspeed.server.production.policies`), which production asks, never its name.

Each keeps per sampler epoch its figures (:class:`~kspeed.server.production.state.EpochFigures`:
samples planned and written, misses, backend bytes and requests, the grants' wait for production).
``docs/policies.md`` has the whole design and its measurements.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

import numpy as np

from kspeed.errors import DatasetError, KSpeedError, StateError
from kspeed.histogram import Histogram
from kspeed.proto import kspeed_pb2
from kspeed.server.feeder.columns import CrcColumn, SparseColumn
from kspeed.server.feeder.plan_part import PlanPart
from kspeed.server.feeder.protocol import Command, Failed, FeedProgress, InstallPlan, Locate, Reply
from kspeed.server.feeder.writer import MAX_PLANS
from kspeed.server.hosting.datasets import DatasetHost, ShareKey
from kspeed.server.hosting.index import offset_dtype
from kspeed.server.memory.checksum import crc32c
from kspeed.server.memory.flags import CHUNK, Flags
from kspeed.server.memory.residency import ABSENT, FAILED, HOME, READING, WINDOW
from kspeed.server.memory.window import ProductionWindow, Slot, chunk_size_for_samples
from kspeed.server.prep.workers import PrepWorkers
from kspeed.server.production.groups import GroupState, Membership, Output
from kspeed.server.production.policies import farthest_first
from kspeed.server.production.processed import ProcessedProduction
from kspeed.server.production.state import (
    BackendReader,
    Draining,
    EpochFigures,
    FeedState,
    PlanState,
    PrepSpec,
    Producer,
    ShareState,
    Work,
)

__all__ = ["BackendReader", "PrepSpec", "Producer", "Production"]

log = logging.getLogger(__name__)

TASK_SAMPLES = 8  # samples one producer reads per task
PREP_TASK_SAMPLES = 16  # samples one preprocessing task runs (fewer round trips; still a few ms of work)
RETRY_FAILED_S = 5.0  # a failed sample still needed is read again after this long (and producers with
# nothing to do look again this often, for those)
RATE_SPAN_S = 5.0  # the producer rate is measured over about this long
STOP_WAIT_S = 5.0  # a stop waits this long in all for producers in a backend read (not this long each)
PREEMPT_BATCH = 4  # samples let go at once for a first grant that does not fit


class Production(ProcessedProduction):
    """The production of one server's samples for its feeds.

    Args:
        window: the production window.
        host: the server's datasets.
        tell: sends a command to feeder ``i`` and returns its reply (raises on failure).
        depth: samples made resident ahead of each feed's first unwritten one.
        threads: producer threads.
        producer: what fills the window with raw samples (default: the backend reader).
        prep: the worker processes that run pipelines' server stages (plans with processed
            positions need it).
        verify: feeders check each stored sample's crc32c before they write it (its place is told
            with the checksum its bytes must have there); a sample that fails is re-read
            (:meth:`corrupt`).
    """

    def __init__(
        self,
        window: ProductionWindow,
        host: DatasetHost,
        tell: Callable[[int, Command], Reply],
        *,
        depth: int = 1024,
        threads: int = 8,
        producer: Producer | None = None,
        prep: PrepWorkers | None = None,
        verify: bool = True,
    ) -> None:
        self.window = window
        self.prep = prep
        self.verify = verify
        self.producer = producer or BackendReader()
        self.host = host
        self.depth = max(int(depth), 1)
        self._tell = tell
        self._lock = threading.RLock()
        self._work = threading.Condition(self._lock)
        self._stirs = 0  # bumped by whatever may give producers work (see _produce_loop)
        self._shares: dict[ShareKey, ShareState] = {}
        self._feeds: dict[str, FeedState] = {}
        self._draining: dict[int, Draining] = {}
        self._groups: dict[tuple[ShareKey, str], GroupState] = {}  # (share, group name) -> its sharing
        self._output_tickets: dict[int, Output] = {}  # window ticket -> a group output feeders still read
        self._told: dict[int, set[int]] = {}  # per feeder: the pool regions whose files it was told
        self._turn = itertools.count()
        self._stop = threading.Event()
        self.produced_samples = 0
        self.produced_bytes = 0
        self.failed_samples = 0
        self.window_full = 0  # times a producer found the window full
        self.preempted = 0  # samples let go before use so that a first grant could complete
        self._warned_window = False  # warned that the window cannot hold each feed's next processed batch
        self.waits = Histogram()
        #: per dataset: seconds producers spent reading samples for feeds (ProductionFigures)
        self.fetch_seconds: dict[str, float] = {}
        #: per dataset: samples and bytes producers read from the backend for feeds
        self.fetch_reads: dict[str, tuple[int, int]] = {}
        self._recent: deque[tuple[float, int]] = deque()
        self._threads = [
            threading.Thread(target=self._produce_loop, name=f"producer-{n}", daemon=True)
            for n in range(max(int(threads), 1))
        ]
        for thread in self._threads:
            thread.start()

    # -- feeds and plans (called by the feeder supervisor) ---------------------------------------

    def install(
        self,
        feed_id: str,
        feeder: int,
        key: ShareKey,
        epoch: int,
        plan: PlanPart,
        prep: PrepSpec | None = None,
        first_batch: int = 0,
        user_epoch: int = 0,
        ranks: int = 0,
        job: str = "",
        membership: Membership | None = None,
    ) -> None:
        """Follow a newly committed plan and hand it to its feeder with the samples' current places
        (the positions before batch ``first_batch`` count as written: they were delivered).
        ``user_epoch`` is the sampler's epoch (a memory policy keeps its figures by it); ``ranks``
        the feed's job's ranks, as its client told (0: not told), ``job`` its name and
        ``membership`` its group (:mod:`kspeed.server.production.groups`).

        ``plan.processed`` marks the positions that go through ``prep`` (the server stages of the
        dataset's pipeline) here: they are produced into the window per epoch, never at home.

        Raises:
            KSpeedError: the feeder refused the plan (its feed is gone); nothing is followed.
            ConflictError: the plan's server stages draw from another seed than its group's.
        """
        share = self._share(key)
        processed = plan.processed if plan.processed is not None and plan.processed.any() else None
        with self._lock:
            if membership is not None:
                self._join(share, feed_id, membership, prep if processed is not None else None, self.host.count(key[0]))
            feed = self._feeds.get(feed_id)
            if feed is None or feed.share != key:
                feed = self._feeds[feed_id] = FeedState(feed_id, key, feeder)
            feed.feeder = feeder
            feed.ranks = ranks
            feed.job = job
            feed.membership = membership
            replaced = feed.plans.pop(epoch, None)
            self._unfollow(share, feed, replaced)
            follow = PlanState(
                epoch,
                plan.ids,
                plan.positions,
                plan.starts,
                Flags(len(plan.ids)),
                processed=processed,
                prep=prep if processed is not None else None,
                state=np.zeros(len(plan.ids), dtype=np.int8) if processed is not None else None,
                user_epoch=user_epoch,
            )
            if first_batch > 0:
                follow.delivered_before(int(plan.starts[min(first_batch, len(plan.starts) - 1)]))
            plan.region, plan.src, plan.ticket, crc = self._plan_places(share, plan.ids)
            plan.crc = crc if self.verify else None
            if processed is not None:
                plan.region[processed], plan.src[processed], plan.ticket[processed] = -1, 0, 0
                crc[processed] = -1
            # A feeder maps each region once: it is told only the files it has not been told. (Every
            # plan carried every region's file, and listing them walked the whole pool: a commit
            # cost grew with the server's memory, at every epoch boundary for every rank.)
            told = self._told.setdefault(feeder, set())
            places = {**share.home_paths(), **self.window.paths, **self._window_of(share).paths}
            paths = {i: p for i, p in places.items() if i not in told}
            self._tell(feeder, InstallPlan(feed_id, epoch, plan, paths))
            told.update(paths)
            feed.plans[epoch] = follow
            if share.own_window:  # (a plan committed again after a failover replaces its figures)
                figures = share.figures_of(user_epoch)
                figures.planned += len(plan.ids) - (replaced.planned if replaced else 0)
                figures.written += follow.delivered() - (replaced.delivered() if replaced else 0)
            for old in sorted(feed.plans)[:-MAX_PLANS]:  # as the feeder keeps them
                self._unfollow(share, feed, feed.plans.pop(old))
            self._recount(share, feed)
            self._sweep(share)
            self._stir()
        log.debug("feed %s: plan of epoch %d installed, %d samples of it here", feed_id, epoch, len(plan.ids))
        share.preloader.prioritize(plan.ids)

    def drop_feed(self, feed_id: str) -> None:
        """Stop following a closed feed (its samples in the window are retired when nobody else needs them)."""
        with self._lock:
            feed = self._feeds.get(feed_id)
            share = self._shares.get(feed.share) if feed else None
            if feed is not None:
                for plan in feed.plans.values():
                    if share is not None:
                        self._unfollow(share, feed, plan)
                    else:
                        self._forget_plan(feed, plan)
                self._leave(feed)
                del self._feeds[feed_id]
            self.window.forget(feed_id)
            if feed is not None and share is not None:
                self._sweep(share)
            self._stir()  # (the window's fair share per feed grew)

    def drop_share(self, key: ShareKey) -> None:
        """Forget a dropped share (its feeds are closed): free its window slots."""
        with self._lock:
            share = self._shares.pop(key, None)
            self._drop_groups(key)
            for feed_id in [f for f, feed in self._feeds.items() if feed.share == key]:
                for plan in self._feeds[feed_id].plans.values():
                    self._forget_plan(self._feeds[feed_id], plan)
                self._feeds.pop(feed_id)
            if share is None:
                return
            window = self._window_of(share)
            for slot, _, _ in share.slots.values():
                window.free(slot)
            share.slots.clear()
            share.cache.clear()
            for ticket in [t for t, entry in self._draining.items() if entry.window is window and share.own_window]:
                del self._draining[ticket]

    def progress(self, feeder: int, event: FeedProgress) -> None:
        """A feeder's report: positions granted again, grants written (slots may retire), plans
        truncated or dropped (their positions leave the horizon), grants waiting, waits."""
        for seconds in event.waited:
            self.waits.observe(seconds)
        with self._lock:
            feed = self._feeds.get(event.feed_id)
            share = self._shares.get(feed.share) if feed else None
            if feed is None or share is None:
                return
            feed.waiting = event.waiting
            if event.waited and share.own_window:
                current = next((p for _, p in sorted(feed.plans.items()) if p.next < len(p.ids)), None)
                if current is not None:
                    share.figures_of(current.user_epoch).stall_s += float(sum(event.waited))
            # (before the writes: a grant's repetition is reported no later than the grant's write)
            for epoch, at in event.again:
                plan = feed.plans.get(epoch)
                if plan is not None:
                    self._granted_again(share, feed, plan, at)
            feed.served += len(event.written)
            if len(event.written):
                feed.progressed = time.monotonic()
            for epoch, batch, first, end in event.written.tolist():
                plan = feed.plans.get(epoch)
                if plan is not None:
                    i, j, fresh = plan.mark(batch, first, end)
                    if len(fresh) and feed.membership is not None and (group := self._group_of(feed)) is not None:
                        group.wrote(feed.membership.member, len(fresh), time.monotonic())
                    if len(fresh) and share.own_window:
                        share.figures_of(plan.user_epoch).written += len(fresh)
                    if len(fresh) and feed.counted == epoch:
                        raw = fresh if plan.processed is None else fresh[~plan.processed[fresh]]
                        np.subtract.at(share.uses, plan.ids[raw] - share.lo, 1)
                    if plan.slots:
                        self._release(feed, plan, i, j)
            # (after the writes: a report may carry a plan's last grants and its truncation or drop)
            for epoch, batch in event.truncated:
                plan = feed.plans.get(epoch)
                if plan is not None:
                    self._truncate(share, feed, plan, batch)
            for epoch in event.dropped:  # its samples leave the horizon: their window slots retire
                self._unfollow(share, feed, feed.plans.pop(epoch, None))
            if len(event.written) or event.dropped or event.again or event.truncated:
                self._recount(share, feed)
                self._sweep(share)
                self._stir()  # the feed's horizon moved (and window slots were released)

    def _granted_again(self, share: ShareState, feed: FeedState, plan: PlanState, at: np.ndarray) -> None:
        """Positions ``at`` of ``plan`` were granted again (the client fenced a server and grants
        again what it had not delivered): they are within the feed's horizon again, so those
        written already are made resident anew (read from the backend again where nothing kept
        them) and every one is held until its new grant is written; under the lock."""
        again = plan.granted_again(at)
        if not len(again):
            return
        if share.own_window:
            share.figures_of(plan.user_epoch).written -= len(again)
        if feed.counted == plan.epoch:
            raw = again if plan.processed is None else again[~plan.processed[again]]
            np.add.at(share.uses, plan.ids[raw] - share.lo, 1)
        log.debug("feed %s: %d position(s) of plan %d granted again", feed.feed_id, len(again), plan.epoch)

    def _truncate(self, share: ShareState, feed: FeedState, plan: PlanState, batch: int) -> None:
        """The client no longer wants ``plan`` from ``batch`` on (:meth:`PlanState.truncate`): the
        positions cut off are needed no more by it, as if written, but not counted as written; the
        processed slots made for them are released. (The caller then sweeps: the raw samples
        produced only for them retire.) Under the lock."""
        off = plan.truncate(batch)
        if share.own_window:
            share.figures_of(plan.user_epoch).planned -= len(off)
        if feed.counted == plan.epoch:
            raw = off if plan.processed is None else off[~plan.processed[off]]
            np.subtract.at(share.uses, plan.ids[raw] - share.lo, 1)
        beyond = [k for k in plan.slots if k >= plan.cut]
        if beyond:
            self._release(feed, plan, min(beyond), max(beyond) + 1)
        log.debug(
            "feed %s: plan %d truncated at batch %d, %d position(s) cut off", feed.feed_id, plan.epoch, batch, len(off)
        )

    def freed(self, feeder: int, tickets: Iterable[int]) -> None:
        """A feeder no longer reads these retired window tickets."""
        with self._lock:
            for ticket in tickets:
                entry = self._draining.get(ticket)
                if entry is None:
                    self._output_freed(feeder, ticket)
                    continue
                entry.feeders.discard(feeder)
                if not entry.feeders:
                    del self._draining[ticket]
                    entry.window.free(entry.slot)
                    self._stir()

    def corrupt(self, feed_id: str, reported: Iterable[int]) -> None:
        """A feeder found samples of ``feed_id``'s share whose bytes fail their crc32c check: each is
        checked again where it is now. One corrupt at home is re-read from the backend into its
        place; one corrupt in the window lets its slot go, so that it is produced anew from the
        backend. Both are counted (the share's ``crc_mismatches`` and ``repaired``: its
        ``integrity_repairs``). Then the feeders are told the place of every one again; one that the
        backend no longer gives as it was fails its grants, saying so."""
        with self._lock:
            feed = self._feeds.get(feed_id)
            share = self._shares.get(feed.share) if feed else None
        if share is None:
            return
        try:
            store = self.host.get(*share.key).store
        except KSpeedError:  # dropped meanwhile
            return
        ids = np.unique(np.asarray(list(reported), dtype=np.int64))
        ids = ids[share.preloader.index.owns(ids)]
        home = ids[share.residency.of(ids) == HOME]
        failed: dict[int, str] = {}
        for sample in home.tolist():
            try:
                store.verify(sample)  # re-read from the backend (and counted) if corrupt
            except (DatasetError, StateError) as exc:
                failed[sample] = str(exc)
        with self._lock:
            if self._shares.get(share.key) is not share:
                return
            window = self._window_of(share)
            spoiled = []
            for sample in ids[share.residency.of(ids) == WINDOW].tolist():
                slot, recorded, _ = share.slots[sample]
                if crc32c(window.view(slot)) != recorded:
                    spoiled.append(sample)
                    store.count("crc_mismatches")
                    store.count("repaired")
            if spoiled:
                log.warning(
                    "dataset %s: window copies of %s failed their crc32c check; read again", share.dataset, spoiled
                )
                self._let_go(share, np.array(spoiled, dtype=np.int64))
            if failed:
                bad = np.array(sorted(failed), dtype=np.int64)
                share.residency.fail(bad, [failed[i] for i in bad.tolist()])
                self._failed(share, bad, [failed[i] for i in bad.tolist()])
            placed = np.setdiff1d(ids, np.array([*spoiled, *failed], dtype=np.int64))
            if len(placed):
                region, src, ticket, crc = self._places(share, placed)
                self._broadcast(
                    share, Locate(share.dataset, placed, region, src, ticket, quiet=True, crc=self._checked(crc))
                )
            self._stir()

    # -- state -----------------------------------------------------------------------------------

    def _share(self, key: ShareKey) -> ShareState:
        hosted = self.host.get(*key)
        preloader = hosted.preloader
        with self._lock:
            share = self._shares.get(key)
            if share is None or share.preloader is not preloader:
                if share is not None:
                    self.drop_share(key)
                policy = hosted.policy
                if policy.own_window:
                    regions = hosted.window_regions()
                    size = preloader.pool.region_size
                    chunk = chunk_size_for_samples(preloader.index.length, size, len(regions) * size)
                    window = ProductionWindow.over(preloader.pool, regions, chunk)
                    share = ShareState(key, preloader, window, policy)
                else:
                    share = ShareState(key, preloader, self.window, policy)
                self._shares[key] = share
                preloader.on_home = functools.partial(self._came_home, share)
                preloader.on_failed = functools.partial(self._failed, share)
            return share

    def _places(self, share: ShareState, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Where ``ids`` are now: (pool region or -1, offset, window ticket or 0, the crc32c of their
        bytes there or -1), int64 each."""
        n = len(ids)
        region, src = np.full(n, -1, dtype=np.int64), np.zeros(n, dtype=np.int64)
        ticket, crc = np.zeros(n, dtype=np.int64), np.full(n, -1, dtype=np.int64)
        self._fill_places(share, ids, region, src, ticket, crc)
        return region, src, ticket, crc

    def _plan_places(
        self, share: ShareState, ids: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, SparseColumn, CrcColumn]:
        """:meth:`_places` in a plan part's compact columns (see :mod:`kspeed.server.feeder.plan_part`)."""
        n = len(ids)
        region_dtype = np.int16 if share.preloader.pool.region_count <= np.iinfo(np.int16).max else np.int32
        region = np.full(n, -1, dtype=region_dtype)
        src = np.zeros(n, dtype=offset_dtype(self.window.region_size))
        ticket, crc = SparseColumn(n), CrcColumn(n)
        self._fill_places(share, ids, region, src, ticket, crc)
        return region, src, ticket, crc

    def _fill_places(
        self,
        share: ShareState,
        ids: np.ndarray,
        region: np.ndarray,
        src: np.ndarray,
        ticket: np.ndarray | SparseColumn,
        crc: np.ndarray | CrcColumn,
    ) -> None:
        """Write where ``ids`` are now into the columns given (preset to "nowhere"), a chunk of
        samples at a time, so a plan of millions of samples costs no temporary per sample."""
        for a in range(0, len(ids), CHUNK):
            part = np.asarray(ids[a : a + CHUNK], dtype=np.int64)
            state = share.residency.of(part)
            home = np.flatnonzero(state == HOME)
            if len(home):
                region[a + home], src[a + home] = share.preloader.home(part[home])
                crc[a + home] = self._home_crcs(share, part[home])
            window = np.flatnonzero(state == WINDOW)
            if len(window):
                entries = [share.slots[i] for i in part[window].tolist()]
                region[a + window] = [slot.region for slot, _, _ in entries]
                src[a + window] = [slot.offset for slot, _, _ in entries]
                ticket[a + window] = np.array([slot.ticket for slot, _, _ in entries], dtype=np.int64)
                crc[a + window] = np.array([c for _, c, _ in entries], dtype=np.int64)

    @staticmethod
    def _home_crcs(share: ShareState, ids: np.ndarray) -> np.ndarray:
        """The crc32c recorded for samples ``ids`` at home."""
        return share.preloader.index.crc[np.asarray(ids, dtype=np.int64) - share.lo].astype(np.int64)

    def _checked(self, crc: np.ndarray) -> np.ndarray | None:
        """What a Locate carries as the checksums of its samples (none when feeders do not check)."""
        return np.asarray(crc, dtype=np.int64) if self.verify else None

    def _broadcast(self, share: ShareState, command: Command) -> dict[int, Reply]:
        """Send ``command`` to every feeder with a feed of ``share``; replies by feeder."""
        feeders = sorted({feed.feeder for feed in self._feeds.values() if feed.share == share.key})
        replies = {}
        for index in feeders:
            try:
                replies[index] = self._tell(index, command)
            except KSpeedError as exc:
                log.warning("feeder %d: cannot tell it where samples of %s are: %s", index, share.dataset, exc)
        return replies

    def _window_of(self, share: ShareState) -> ProductionWindow:
        return share.window or self.window

    def _horizon(self, share: ShareState) -> np.ndarray:
        """The samples within some feed's horizon (needed unwritten, ``depth`` positions ahead; for
        a share without a home, as many as the feed's fair share of its window holds)."""
        parts = [np.zeros(0, np.int64)]
        for feed in self._feeds.values():
            if feed.share != share.key:
                continue
            if not share.policy.home:
                parts += list(self._ahead(share, feed).values())
                continue
            budget = self.depth
            for plan in self._followed(share, feed):
                parts.append(plan.ahead(budget))
                budget -= max(plan.cut - plan.next, 0)
                if budget <= 0:
                    break
        return np.concatenate(parts)

    def _ahead(self, share: ShareState, feed: FeedState) -> dict[int, np.ndarray]:
        """For a share without a home, per followed plan, the unwritten raw samples ``feed`` will
        consume next, as many as its fair share of the window holds (at least one).

        Held on demand, only the plan being consumed counts: a window that kept samples for later
        uses would fill with them and starve the ones needed now. A share with its own window
        (a memory policy) looks into the next plans too, once the current one fits: the next
        epoch's samples are loaded while this one ends, so the window does not drain at the boundary.
        """
        limit = self._fair(share)
        lengths = share.preloader.index.length
        # positions to look at: enough to cover the bytes allowed (plus what is written already)
        budget = max(self.depth, 2 * limit // max(int(share.mean_size), 1) + TASK_SAMPLES)
        out: dict[int, np.ndarray] = {}
        for plan in self._followed(share, feed):
            ahead = plan.ahead(budget)
            budget -= max(plan.cut - plan.next, 0)
            nbytes = np.cumsum(lengths[ahead - share.lo])
            cut = int(np.searchsorted(nbytes, limit, side="right"))
            if not out:  # the first grant not written is always within reach, however large
                cut = max(cut, len(plan.first_grant()))
            out[plan.epoch] = ahead[:cut]
            limit -= int(nbytes[cut - 1]) if cut else 0
            if limit <= 0 or budget <= 0 or cut < len(ahead):
                break
        return out

    def _fair(self, share: ShareState, *, processed: bool = False) -> int:
        """Bytes each feed of ``share`` may hold ahead of it: its share of the window it produces
        into, the share's window for raw samples, or (``processed``) the server's production window,
        where every processed position is made.

        The server's window is shared by the feeds with work there: those of shares it holds the
        raw samples of, and those with processed positions to make. A share's own window is
        shared by all of the share's feeds, or by as many as the job's ranks its clients told (a
        rank that has not begun yet, or not opened its feed yet, gets its part kept for it), as
        many sample bytes as it holds at the packing its chunks reach, less the chunks each feed
        fills at once; under a caching policy only its prefetch part counts. Every feed
        may hold at least one chunk.
        """
        own = share.own_window and not processed
        window = self._window_of(share) if own else self.window
        feeds = 0
        ranks = 0
        for f in self._feeds.values():
            if own:
                feeds += f.share == share.key
                ranks = max(ranks, f.ranks if f.share == share.key else 0)
                continue
            other = self._shares.get(f.share)
            busy = [p for p in f.plans.values() if p.next < len(p.ids)]
            if other is not None and busy:
                feeds += self._window_of(other) is window or any(p.processed is not None for p in busy)
        # the ranks whose feeds are not open yet keep their part: the first rank to open does not
        # fill the window with samples the others' first grants would have to push out again
        feeds = max(feeds, ranks)
        room = share.policy.prefetch_room(window.capacity) if window is self._window_of(share) else window.capacity
        if own:
            room = int(room * window.packing())
        return max(room // max(feeds, 1) - window.chunk * window.open_chunks, window.chunk)

    def _holds(self, share: ShareState, feed: FeedState, *, processed: bool = False) -> int:
        """Bytes ``feed`` holds in the window :meth:`_fair` (with the same ``processed``) shares out."""
        if share.own_window:
            return feed.made if processed else feed.held
        return feed.held + feed.made  # (both in the production window)

    @staticmethod
    def _followed(share: ShareState, feed: FeedState) -> list[PlanState]:
        """The plans of ``feed`` production works for, in order: all of them, or for a share held
        on demand the first one not written yet (see :meth:`_ahead`); as the share's policy says."""
        return share.policy.followed([feed.plans[epoch] for epoch in sorted(feed.plans)])

    def _sweep(self, share: ShareState) -> None:
        """Retire the window slots of samples nobody needs now: those no feed's horizon holds (under
        a caching policy they are cached, and cached samples a horizon holds again are held until
        written). A streamed share also holds what a feed's current plan still needs: a sample
        read for a horizon that shrank (as another feed began) stays until written, never read
        twice for one plan."""
        if not share.slots:
            return
        held = np.fromiter(share.slots.keys(), dtype=np.int64, count=len(share.slots))
        needed = np.isin(held, self._horizon(share))
        if share.policy.holds_planned_uses:
            needed |= share.uses[held - share.lo] > 0
        for sample in held[needed].tolist():
            share.policy.needed_again(share.cache, sample)
        loose = held[~needed]
        if share.cache.recent or share.cache.kept:
            loose = np.array([i for i in loose.tolist() if not share.cache.holds(i)], np.int64)
        self._retire(share, loose)

    def _count_uses(self, share: ShareState, plan: PlanState, sign: int) -> None:
        """Add (``sign`` 1) or take away (-1) a plan's unwritten raw positions from the uses of a
        share with its own window."""
        everything = slice(None)
        todo = ~plan.written[everything] & plan.raw(everything)
        np.add.at(share.uses, plan.ids[todo] - share.lo, sign)

    def _recount(self, share: ShareState, feed: FeedState) -> None:
        """Keep the uses of ``feed``'s current plan (its first not written) counted, and only those."""
        if not share.own_window:
            return
        current = self._current(share, feed)
        want = current.epoch if current is not None else None
        if feed.counted == want:
            return
        counted = feed.plans.get(feed.counted) if feed.counted is not None else None
        if counted is not None:
            self._count_uses(share, counted, -1)
            self._window_of(share).forget(f"{feed.feed_id}/{counted.epoch}")  # written: its chunks close
        if current is not None:
            self._count_uses(share, current, +1)
        feed.counted = want

    def _unfollow(self, share: ShareState, feed: FeedState, plan: PlanState | None) -> None:
        """Stop following ``plan`` of ``feed``: its unwritten samples are needed no more by it."""
        if plan is not None and share.own_window:
            if feed.counted == plan.epoch:
                self._count_uses(share, plan, -1)
                feed.counted = None
            self._window_of(share).forget(f"{feed.feed_id}/{plan.epoch}")
        self._forget_plan(feed, plan)

    def _came_home(self, share: ShareState, ids: np.ndarray) -> None:
        """The preload loaded ``ids`` at home: feeders of the dataset's feeds learn where."""
        with self._lock:
            if self._shares.get(share.key) is not share:
                return
            if len(ids):
                region, src = share.preloader.home(ids)
                none = np.zeros(len(ids), np.int64)
                crc = self._checked(self._home_crcs(share, ids))
                self._broadcast(share, Locate(share.dataset, ids, region, src, none, quiet=True, crc=crc))

    def _failed(self, share: ShareState, ids: np.ndarray, reasons: list[str]) -> None:
        with self._lock:
            if self._shares.get(share.key) is not share:
                return
            if len(ids):
                self.failed_samples += len(ids)
                self._broadcast(share, Failed(share.dataset, ids, tuple(reasons)))
                self._stir()

    def _retire(self, share: ShareState, ids: np.ndarray) -> None:
        """Retire the window slots of ``ids`` (written, or no longer planned): a share held whole
        copies them home; one without a home lets them go, or under a caching policy keeps what
        the policy keeps."""
        ids = np.array([i for i in np.unique(ids).tolist() if i in share.slots], dtype=np.int64)
        if not len(ids):
            return
        if share.policy.caching:
            self._keep(share, ids)
            return
        if share.preloader.on_demand:  # no home: the sample is read again if a plan needs it
            self._let_go(share, ids)
            return
        entries = [share.slots.pop(i) for i in ids.tolist()]
        share.preloader.adopt(
            ids, [self.window.view(slot) for slot, _, _ in entries], np.array([c for _, c, _ in entries], np.uint32)
        )
        region, src = share.preloader.home(ids)
        self._relocate(share, ids, region, src, entries, crc=np.array([c for _, c, _ in entries], np.int64))

    def _relocate(
        self,
        share: ShareState,
        ids: np.ndarray,
        region: np.ndarray,
        src: np.ndarray,
        entries: list[tuple[Slot, int, str]],
        crc: np.ndarray | None = None,
    ) -> None:
        """Tell the feeders the new places of ``ids`` (-1: none) and the crc32c of their bytes there,
        and reuse their old slots once no feeder reads them."""
        none = np.zeros(len(ids), np.int64)
        checked = None if crc is None else self._checked(crc)
        replies = self._broadcast(share, Locate(share.dataset, ids, region, src, none, crc=checked))
        busy: dict[int, set[int]] = {}
        for index, reply in replies.items():
            for ticket in reply.busy:
                busy.setdefault(ticket, set()).add(index)
        window = self._window_of(share)
        for slot, _, owner in entries:
            feed = self._feeds.get(owner)
            if feed is not None:
                feed.held -= slot.nbytes
            if slot.ticket in busy:
                self._draining[slot.ticket] = Draining(slot, busy[slot.ticket], window)
            else:
                window.free(slot)
        self._stir()

    def _let_go(self, share: ShareState, ids: np.ndarray) -> None:
        """Free the window slots of ``ids`` (no home): read again from the backend if a plan needs them."""
        entries = [share.slots.pop(i) for i in ids.tolist()]
        for i, (slot, _, _) in zip(ids.tolist(), entries, strict=True):
            share.cache.drop(i, slot.nbytes)
        share.residency.settle(ids, ABSENT)
        none = np.full(len(ids), -1, np.int64)
        self._relocate(share, ids, none, np.zeros(len(ids), np.int64), entries)

    def _keep(self, share: ShareState, ids: np.ndarray) -> None:
        """Caching policies: written samples stay in the window for their next use, as the policy
        keeps them (:meth:`~kspeed.server.production.policies.MemoryPolicy.keeps`). ``lru`` and
        ``reuse`` keep every one (until :meth:`_make_room` lets some go); ``minio`` keeps the first
        ones that fit the part of the window not used for prefetching, for good, and lets the
        rest go (a window too small for the feeds' next grants beside them makes it keep fewer,
        never others)."""
        window = self._window_of(share)
        if share.cache.kept_room is None:
            share.cache.kept_room = share.policy.keep_room(window.capacity)
        going = []
        for i in ids.tolist():
            slot, crc, owner = share.slots[i]
            feed = self._feeds.get(owner)
            if feed is not None:
                feed.held -= slot.nbytes  # no longer this feed's prefetch
            share.slots[i] = (slot, crc, "")
            if not share.policy.keeps(share.cache, i, slot.nbytes):
                going.append(i)
        if going:
            self._let_go(share, np.array(going, np.int64))

    def _make_room(self, share: ShareState, pending: np.ndarray) -> bool:
        """The window is full while ``pending`` samples of ``share`` wait to be placed: move some
        of the share's samples out. Returns whether any went.

        An evicting policy (``lru``, ``reuse``) lets its victims among the cached samples go
        (:meth:`~kspeed.server.production.policies.MemoryPolicy.victims`). Else,
        only for a pending sample of some feed's first grant not written, the share's samples
        needed last leave the window (for a share with its own window, those beyond every
        horizon first): home for a share held whole, else to be read again when their turn
        comes. A window holding later samples (spread thin over chunks, or held by a feed that
        stopped reading) would otherwise keep the grant they follow from ever completing. The
        samples of the first grants and those ``minio`` keeps stay, unless not even the first
        grants fit together: then the senior feed's grant (the feed served least) takes the room
        of the others', so that one grant at a time completes.
        """
        with self._lock:
            if self._shares.get(share.key) is not share:
                return False
            victims = share.policy.victims(share.cache, functools.partial(self._next_use, share))
            if len(victims):
                self._let_go(share, victims)
                return True
            firsts: dict[str, np.ndarray] = {}
            for feed in self._feeds.values():
                plan = self._current(share, feed) if feed.share == share.key else None
                if plan is not None:
                    firsts[feed.feed_id] = plan.first_grant()
            first = np.concatenate([np.zeros(0, np.int64), *firsts.values()])
            if not np.isin(pending, first).any():
                return False
            held = np.fromiter(share.slots.keys(), dtype=np.int64, count=len(share.slots))
            kept = np.fromiter(share.cache.kept, np.int64, len(share.cache.kept))
            movable = ~np.isin(held, first) & ~np.isin(held, kept)
            if share.own_window:
                beyond = movable & ~np.isin(held, self._horizon(share))
                movable = beyond if beyond.any() else movable
            if not movable.any():
                waiting = [f for f, ids in firsts.items() if len(ids)]
                senior = min(waiting, key=lambda f: (self._feeds[f].served, f))
                if not np.isin(pending, firsts[senior]).any():
                    return False
                movable = ~np.isin(held, firsts[senior])
                if (movable & ~np.isin(held, kept)).any():
                    movable &= ~np.isin(held, kept)  # what minio keeps goes last
                self._warn_too_small(share, len(waiting))
                if not movable.any():
                    return False
            victims = farthest_first(held[movable], self._next_use(share, held[movable]), PREEMPT_BATCH)
            if share.cache.kept_room is not None:  # minio keeps less from now on (never another subset)
                share.cache.kept_room -= sum(
                    share.slots[i][0].nbytes for i in victims.tolist() if i in share.cache.kept
                )
            self.preempted += len(victims)
            if share.preloader.on_demand:
                self._let_go(share, victims)
            else:
                self._retire(share, victims)
            return True

    def _warn_too_small(self, share: ShareState, feeds: int) -> None:
        if not share.too_small:
            share.too_small = True
            log.warning(
                "dataset %s: the window of share %d.. (%d bytes) cannot hold the next batch of each of its %d feeds "
                "at once; they are served one grant at a time (give the dataset more memory, its quota, or use "
                "smaller batches)",
                share.dataset,
                share.lo,
                self._window_of(share).capacity,
                feeds,
            )

    def _current(self, share: ShareState, feed: FeedState) -> PlanState | None:
        """The first plan of ``feed`` not written yet (``None``: none)."""
        return next((p for p in self._followed(share, feed) if p.next < len(p.ids)), None)

    def _next_use(self, share: ShareState, ids: np.ndarray) -> np.ndarray:
        """For each of ``ids``, how many samples some feed of the share consumes before it needs it
        again (the plans known now; never needed: larger than any)."""
        nearest = np.full(len(ids), np.iinfo(np.int64).max, dtype=np.int64)
        for feed in self._feeds.values():
            if feed.share != share.key:
                continue
            plans = self._followed(share, feed)
            if not plans:
                continue
            order = np.concatenate([p.ids[p.next :][~p.written[p.next :]] for p in plans])
            if not len(order):
                continue
            uniq, first = np.unique(order, return_index=True)
            at = np.minimum(np.searchsorted(uniq, ids), len(uniq) - 1)
            found = uniq[at] == ids
            nearest[found] = np.minimum(nearest[found], first[at[found]])
        return nearest

    # -- the producers ---------------------------------------------------------------------------

    def _next_work(self) -> Work | None:
        """The next samples to produce: each feed's next absent ones."""
        feeds = list(self._feeds.values())
        busy = [f for f in feeds if any(p.next < len(p.ids) for p in f.plans.values())]
        if not busy:
            return None
        start = next(self._turn) % len(busy)
        fairs: dict[tuple[ShareKey, bool], int] = {}  # (the same for every feed of a share in this look)

        def fair(share: ShareState, processed: bool) -> int:
            key = (share.key, processed)
            if key not in fairs:
                fairs[key] = self._fair(share, processed=processed)
            return fairs[key]

        for feed in busy[start:] + busy[:start]:
            share = self._shares.get(feed.share)
            if share is None:
                continue
            full = self._holds(share, feed) >= fair(share, False)
            made_full = self._holds(share, feed, processed=True) >= fair(share, True)
            # A feed at its fair share of a window still gets the samples of its first grant not
            # written: it may hold part of that grant, which could otherwise never complete. (That
            # goes for its processed positions too: one given back when the window was full, while
            # later ones were made, held the feed at its share until the grant timed out.)
            plan = self._current(share, feed) if full or made_full else None
            if made_full and plan is not None and plan.state is not None:
                work = self._claim_processed(share, feed, plan, plan.first_processed(), first=True)
                if work is not None:
                    return work
            if full:
                first = plan.first_grant() if plan is not None else np.zeros(0, np.int64)
                state = share.residency.of(first)
                taken = share.residency.claim(
                    first[(state == ABSENT) | (state == FAILED)][:TASK_SAMPLES], retry_failed_after=RETRY_FAILED_S
                )
                if plan is not None and len(taken):
                    return Work(share, feed.feed_id, taken, plan.epoch, user_epoch=plan.user_epoch)
            if full and made_full:
                continue
            ahead = {} if share.policy.home or full else self._ahead(share, feed)
            budget = self.depth
            for plan in self._followed(share, feed):
                epoch = plan.epoch
                # (nothing from a truncation's cut; the whole first grant, however large its batch: its
                # positions beyond the depth waited for good while the feed held less than its share)
                window = slice(plan.next, min(max(plan.next + budget, plan.first_span().stop), plan.cut))
                span = plan.ids[window]
                budget -= len(span)
                if plan.processed is not None and plan.state is not None:
                    todo = plan.processed[window] & (plan.state[window] == ABSENT) & ~plan.written[window]
                    work = (
                        None
                        if made_full
                        else self._claim_processed(
                            share, feed, plan, np.flatnonzero(todo) + plan.next, fair=fair(share, True)
                        )
                    )
                    if work is not None:
                        return work
                    span = span[plan.raw(window)]
                if full:
                    span = span[:0]
                elif not share.policy.home:
                    span = ahead.get(epoch, span[:0])
                state = share.residency.of(span)
                wanted = span[(state == ABSENT) | (state == FAILED)]
                if len(wanted):
                    taken = share.residency.claim(wanted[:TASK_SAMPLES], retry_failed_after=RETRY_FAILED_S)
                    if len(taken):
                        return Work(share, feed.feed_id, taken, epoch, user_epoch=plan.user_epoch)
                if budget <= 0:
                    break
        return None

    def _claim_processed(
        self,
        share: ShareState,
        feed: FeedState,
        plan: PlanState,
        todo: np.ndarray,
        *,
        first: bool = False,
        fair: int | None = None,
    ) -> Work | None:
        """Work for processed positions ``todo`` of ``plan`` (not made, not written), a task's worth:
        a group member's positions whose output is made or being made are placed at it (or wait
        for it) instead, and the task is of the next ones to make; None when none is. Placing
        counts in the feed's window share as making does: beyond it (``fair``, found here when not
        given), only the ``first`` grant's."""
        hold = self._held(feed, plan) if len(todo) else False
        if hold:  # (makes nothing: only the positions whose output exists are placed, the rest stay)
            todo = self._with_outputs(feed, plan, todo)
        if fair is None and not first and len(todo) > PREP_TASK_SAMPLES:
            fair = self._fair(share, processed=True)
        for a in range(0, len(todo), PREP_TASK_SAMPLES):
            if not first and a and fair is not None and self._holds(share, feed, processed=True) >= fair:
                break
            at, keys = self._share_out(share, feed, plan, todo[a : a + PREP_TASK_SAMPLES], hold=hold)
            if len(at):
                assert plan.state is not None
                plan.state[at] = READING
                ids = plan.ids[at].astype(np.int64)
                return Work(share, feed.feed_id, ids, plan.epoch, at, plan, outputs=keys, group=self._group_of(feed))
        return None

    def _stir(self) -> None:
        """Something changed that may give producers work: wake one to look; under the lock. A
        producer that finds work wakes the next before it goes (see :meth:`_produce_loop`), so
        every sleeper is woken while there is work, and at most one looks in vain per change
        (waking all of them at every change had a dozen producers scan every feed's plans, under
        the lock, for each task produced)."""
        self._stirs += 1
        self._work.notify()

    def _produce_loop(self) -> None:
        """Produce while there is work. A producer that looked and found none sleeps until stirred
        (a plan installed, a feed's progress, positions granted again, a slot freed, a failure) or, for
        failed samples due a retry, :data:`RETRY_FAILED_S`: looking means scanning every feed's
        plans, and a producer that looked every few milliseconds cost the server a core's
        fraction per hundred idle feeds."""
        fruitless = -1  # the stir count when this producer last looked and found nothing
        while not self._stop.is_set():
            with self._lock:
                if self._stirs == fruitless:
                    self._work.wait(RETRY_FAILED_S)
                    if self._stop.is_set():
                        return
                stirs = self._stirs
                work = self._next_work()
                if work is None:
                    fruitless = stirs
                    continue
                fruitless = -1
                self._work.notify()  # there may be more: the next sleeper looks
            try:
                if work.plan is None:
                    self._produce(work.share, work.feed_id, work.ids, work.user_epoch, work.epoch)
                else:
                    self._produce_processed(work)
            except Exception:  # a bug: log it (the samples were given back), keep producing
                if self._stop.is_set():  # stopping: the preprocessing workers closed under this producer
                    log.debug("dataset %s: producing samples stopped with the server", work.share.dataset)
                    return
                log.exception("dataset %s: producing samples %s failed", work.share.dataset, work.ids[:4].tolist())

    def _fetched(self, dataset: str, seconds: float, samples: int = 0, nbytes: int = 0) -> None:
        """Producers read ``samples`` samples (``nbytes`` bytes) of ``dataset`` from the backend
        in ``seconds``; under the lock."""
        self.fetch_seconds[dataset] = self.fetch_seconds.get(dataset, 0.0) + seconds
        done, read = self.fetch_reads.get(dataset, (0, 0))
        self.fetch_reads[dataset] = (done + samples, read + nbytes)

    def production_figures(self, dataset: str) -> kspeed_pb2.ProductionFigures:
        """What producing ``dataset``'s samples took so far: reads, and preprocessing per stage (a
        client splits the time its grants waited for production in these proportions)."""
        with self._lock:
            fetch = self.fetch_seconds.get(dataset, 0.0)
            samples, nbytes = self.fetch_reads.get(dataset, (0, 0))
        stages = self.prep.seconds_of(dataset) if self.prep is not None else {}
        return kspeed_pb2.ProductionFigures(
            fetch_seconds=fetch,
            stage_seconds=stages,
            fetch_samples=samples,
            fetch_bytes=nbytes,
            groups=self.group_figures(dataset),
        )

    def _produce(self, share: ShareState, feed_id: str, ids: np.ndarray, epoch: int = -1, plan: int = -1) -> None:
        """Read ``ids`` (claimed, for plan ``plan`` of sampler epoch ``epoch``) from the backend
        into window slots and tell the feeders where they are.

        In a share's own window each plan of a feed fills chunks of its own: the samples of one
        chunk are then written, and freed, together (a chunk holding the next epoch's sample
        beside this one's would stay taken for an epoch)."""
        lengths = share.preloader.index.length[ids - share.lo]
        ids, lengths = self._adopt_big(share, ids, lengths)
        window = self._window_of(share)
        owner = f"{feed_id}/{plan}" if share.own_window else feed_id
        slots: list[Slot] = []
        placed = False
        try:
            for n in lengths.tolist():
                slot = window.place(n, owner)
                while slot is None and self._make_room(share, ids[len(slots) :]):
                    slot = window.place(n, owner)
                if slot is None:
                    break
                slots.append(slot)
            if len(slots) < len(ids):  # the window is full: give back what did not fit, wait for room
                share.residency.settle(ids[len(slots) :], ABSENT)
                ids, lengths = ids[: len(slots)], lengths[: len(slots)]
                with self._lock:
                    self.window_full += 1
                if not slots:
                    window.wait_for_room(0.05)
                    return
            started = time.perf_counter()
            crcs, bad = self.producer.produce(share.preloader, ids, slots, window)
            with self._lock:
                ok = np.array([int(i) not in bad for i in ids.tolist()], dtype=bool)
                self._fetched(share.dataset, time.perf_counter() - started, int(ok.sum()), int(lengths[ok].sum()))
                if self._shares.get(share.key) is not share:  # dropped meanwhile
                    return
                self._settle(share, feed_id, ids, lengths, slots, crcs, bad, epoch, plan)
                placed = True
        finally:
            if not placed:
                for slot in slots:
                    window.free(slot)
                share.residency.settle(ids[share.residency.of(ids) == READING], ABSENT)

    def _settle(
        self,
        share: ShareState,
        feed_id: str,
        ids: np.ndarray,
        lengths: np.ndarray,
        slots: list[Slot],
        crcs: np.ndarray,
        bad: dict[int, str],
        epoch: int = -1,
        plan: int = -1,
    ) -> None:
        """Record produced samples (and failed ones) for plan ``plan`` of ``feed_id`` (sampler epoch
        ``epoch``) and tell the feeders; under the lock."""
        ok = np.array([int(i) not in bad for i in ids.tolist()], dtype=bool)
        window = self._window_of(share)
        for k in np.flatnonzero(~ok).tolist():
            window.free(slots[k])
        if share.own_window and epoch >= 0:
            figures = share.figures_of(epoch)
            figures.backend_requests += len(ids)
            figures.backend_bytes += int(lengths[ok].sum())
            figures.misses += int(ok.sum())
        if (~ok).any():
            failed_ids = ids[~ok]
            reasons = [bad[int(i)] for i in failed_ids.tolist()]
            share.residency.fail(failed_ids, reasons)
            self._failed(share, failed_ids, reasons)
        good = ids[ok]
        if not len(good):
            return
        feed = self._feeds.get(feed_id)
        placed = [slots[k] for k in np.flatnonzero(ok).tolist()]
        for sample, slot, crc in zip(good.tolist(), placed, crcs[ok].tolist(), strict=True):
            share.slots[sample] = (slot, crc, feed_id)
            if feed is not None:
                feed.held += slot.nbytes
        share.residency.settle(good, WINDOW)
        nbytes = int(lengths[ok].sum())
        self.produced_samples += len(good)
        self.produced_bytes += nbytes
        self._recent.append((time.monotonic(), nbytes))
        self._broadcast(
            share,
            Locate(
                share.dataset,
                good,
                np.array([s.region for s in placed], np.int64),
                np.array([s.offset for s in placed], np.int64),
                np.array([s.ticket for s in placed], np.int64),
                quiet=True,
                crc=self._checked(crcs[ok]),
            ),
        )
        log.debug("dataset %s: produced %d sample(s) into the window", share.dataset, len(good))
        if feed is None or plan not in feed.plans or feed.plans[plan].cut < len(feed.plans[plan].ids):
            # produced for a plan dropped (or truncated) meanwhile: what no horizon holds goes.
            # (A sample of a plan still followed was in its horizon when claimed; the sweep after
            # the feed's next progress report covers a horizon that shrank since.)
            self._sweep(share)

    def _adopt_big(self, share: ShareState, ids: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Samples larger than a window region cannot be staged: they are read straight home (a
        share held on demand has none: they fail, named)."""
        window = self._window_of(share)
        big = ~np.array([window.fits(n) for n in lengths.tolist()], dtype=bool)
        if not big.any():
            return ids, lengths
        if share.preloader.on_demand:
            reason = (
                f"dataset {share.dataset!r}: the sample is larger than a production window region "
                f"({window.region_size} bytes) and its share has no copy at home to serve it from"
            )
            failed = ids[big]
            share.residency.fail(failed, [reason] * len(failed))
            self._failed(share, failed, [reason] * len(failed))
        else:
            share.residency.settle(ids[big], ABSENT)
            share.preloader.prioritize(ids[big])
        return ids[~big], lengths[~big]

    # -- figures ---------------------------------------------------------------------------------

    def rate(self) -> float:
        """Bytes per second produced over about the last :data:`RATE_SPAN_S` seconds."""
        now = time.monotonic()
        with self._lock:
            while self._recent and now - self._recent[0][0] > RATE_SPAN_S:
                self._recent.popleft()
            return sum(n for _, n in self._recent) / RATE_SPAN_S

    def figures(self, key: ShareKey) -> list[EpochFigures]:
        """The last few plan epochs' figures of a share held under a memory policy (oldest first)."""
        with self._lock:
            share = self._shares.get(key)
            if share is None:
                return []
            return [dataclasses.replace(share.figures[e]) for e in sorted(share.figures)]

    def feed_count(self) -> int:
        """Feeds whose plans production follows (one per open feed)."""
        with self._lock:
            return len(self._feeds)

    def waiting(self) -> int:
        """Grants the feeders last reported waiting on production."""
        with self._lock:
            return sum(feed.waiting for feed in self._feeds.values())

    def stop(self) -> None:
        """Stop the producers and the preprocessing workers they use."""
        self._stop.set()
        with self._lock:
            self._stirs += 1
            self._work.notify_all()
        if self.prep is not None:
            self.prep.close()
        deadline = time.monotonic() + STOP_WAIT_S
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        stuck = [thread.name for thread in self._threads if thread.is_alive()]
        if stuck:  # daemon threads: they end with the process
            log.warning("production stops with %s still busy (a backend read that has not answered)", ", ".join(stuck))
