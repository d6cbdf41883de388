"""Production of preprocessed samples: a plan's processed positions, run through the dataset's
server stages by the preprocessing workers (:mod:`kspeed.server.prep.workers`), each result copied by
the server into the sample's production-window slot (the sandboxed workers map no pool memory).

Unlike raw samples, which are made resident once and served from home afterwards, processed
samples are per plan (random stages draw from the epoch): each position is produced into its own
window slot, placed in the feeder's plan, and its slot reused once written (a position granted
again after a fence is produced again, identically). :class:`ProcessedProduction` is the part of
:class:`kspeed.server.production.core.Production` that does this; it uses its lock, window, feeds and
feeder commands.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from kspeed.errors import KSpeedError
from kspeed.server.feeder.protocol import Command, Place, Reply
from kspeed.server.memory.residency import ABSENT, FAILED, HOME, READING, WINDOW
from kspeed.server.memory.window import ProductionWindow, Slot
from kspeed.server.prep.workers import PrepTask, PrepWorkers
from kspeed.server.production.groups import OutputKey
from kspeed.server.production.sharing import SharedProduction
from kspeed.server.production.state import Draining, FeedState, PlanState, ShareState, Work

__all__ = ["ProcessedProduction"]

log = logging.getLogger(__name__)

LATER = 1 << 40  # how far past a feed's first grant a position of a later plan than its current one counts


class ProcessedProduction(SharedProduction):
    """Processed positions of plans: produced by the preprocessing workers, placed per plan (or,
    for a group's members, at the group's shared outputs: :class:`SharedProduction`)."""

    window: ProductionWindow
    prep: PrepWorkers | None
    failed_samples: int
    window_full: int
    preempted: int
    _warned_window: bool
    produced_samples: int
    produced_bytes: int
    _lock: threading.RLock
    _tell: Callable[[int, Command], Reply]
    _feeds: dict[str, FeedState]
    _draining: dict[int, Draining]
    _recent: deque[tuple[float, int]]
    _came_home: Callable[[ShareState, np.ndarray], None]
    _fetched: Callable[[str, float, int, int], None]

    def _forget_plan(self, feed: FeedState, plan: PlanState | None) -> None:
        """Free the processed slots of a plan no longer followed (its feeder dropped it too); under the lock."""
        if plan is None:
            return
        for k in list(plan.shared):
            plan.slots.pop(k, None)
            self._unshare(feed, plan, k, set(), written=False)
        for slot in plan.slots.values():
            feed.made -= slot.nbytes
            self.window.free(slot)
        plan.slots.clear()

    def _release(self, feed: FeedState, plan: PlanState, i: int, j: int) -> None:
        """A grant of processed positions ``i:j`` was written (or they were cut off by a
        truncation): the slots of those written for good (not granted again meanwhile) are reused
        once the feeder no longer reads them; under the lock."""
        at = [k for k in range(i, j) if k in plan.slots and plan.written[k]]
        if not at:
            return
        slots = [plan.slots.pop(k) for k in at]
        if plan.state is not None:
            plan.state[at] = ABSENT
        none = np.zeros(len(at), np.int64)
        try:
            busy = set(
                self._tell(feed.feeder, Place(feed.feed_id, plan.epoch, np.array(at), none - 1, none, none)).busy
            )
        except KSpeedError:
            busy = set()  # the feed is gone: nothing reads its slots any more
        if plan.shared:  # (the group's outputs: released when no member needs them)
            own = [k not in plan.shared for k in at]
            for k in [k for k, mine in zip(at, own, strict=True) if not mine]:
                self._unshare(feed, plan, k, busy, written=True)
            slots = [slot for slot, mine in zip(slots, own, strict=True) if mine]
        for slot in slots:
            feed.made -= slot.nbytes
            if slot.ticket in busy:
                self._draining[slot.ticket] = Draining(slot, {feed.feeder}, self.window)
            else:
                self.window.free(slot)

    def _preempt(self, feed_id: str, count: int = 4) -> bool:
        """The window is full while processed positions of ``feed_id``'s first grant wait to be
        made: un-place up to ``count`` processed samples (a feed's own, or a group's output from
        every plan it is placed in) that no first grant uses, those needed last first; they are
        made again when their turn comes. When every one belongs to some first grant (the window
        cannot hold the next batch of each feed), the senior feed's grant (of the feeds whose next
        batch is not made whole, the one written last longest ago) takes the room of the others',
        so that one grant at a time completes. Without this, feeds that each hold part of their
        first grant wait forever for room the others hold; and a senior chosen as the feed served
        least (the one with the fewest grants written) let a feed of larger batches wait over a
        minute while the others took each freed chunk first. Returns whether any went."""
        with self._lock:
            firsts: dict[str, tuple[int, int]] = {}
            short: set[str] = set()  # feeds whose first grant is not all made yet
            for feed in self._feeds.values():
                plan = next((p for _, p in sorted(feed.plans.items()) if p.next < len(p.ids)), None)
                if plan is not None and plan.processed is not None and plan.state is not None:
                    span = plan.first_span()
                    firsts[feed.feed_id] = (plan.epoch, span.stop)
                    todo = plan.processed[span] & ~plan.written[span] & (plan.state[span] != WINDOW)
                    if todo.any():
                        short.add(feed.feed_id)

            def ahead(fid: str, epoch: int, k: int) -> int:
                """How far past ``fid``'s first grant position ``k`` of its plan ``epoch`` is (< 0: within it)."""
                first = firsts.get(fid)
                if first is None or epoch > first[0]:
                    return LATER
                return k - first[1] if epoch == first[0] else -1

            own = [
                (ahead(f.feed_id, p.epoch, k), f, p, k)
                for f in self._feeds.values()
                for p in f.plans.values()
                for k in p.slots
                if k not in p.shared
            ]
            outputs = [
                (min((ahead(*use) for use in o.users), default=LATER), g, o)
                for g in self._groups.values()
                for o in g.outputs.values()
                if o.slot is not None and o.users
            ]
            # (how far past a first grant, and how to let it go)
            victims: list[tuple[int, Callable[[], None]]] = [
                (d, functools.partial(self._unplace_own, f, p, k)) for d, f, p, k in own if d >= 0
            ]
            victims += [(d, functools.partial(self._let_output_go, g, o)) for d, g, o in outputs if d >= 0]
            if not victims:
                # Every one is in a first grant. Those made whole are written soon (their clients
                # read them): the room of the others goes to the senior of those still short.
                senior = min(
                    (f for f in self._feeds.values() if f.feed_id in short),
                    key=lambda f: (f.progressed, f.feed_id),
                    default=None,
                )
                if senior is None or senior.feed_id != feed_id:
                    return False
                victims = [
                    (0, functools.partial(self._unplace_own, f, p, k))
                    for _, f, p, k in own
                    if f.feed_id != feed_id and f.feed_id in short
                ]
                victims += [
                    (0, functools.partial(self._let_output_go, g, o))
                    for _, g, o in outputs
                    if all(use[0] in short and use[0] != feed_id for use in o.users if ahead(*use) < 0)
                ]
                if victims:
                    self._warn_window(len(firsts))
            victims.sort(key=lambda v: -v[0])
            for _, let_go in victims[:count]:
                let_go()
            self.preempted += min(len(victims), count)
            return bool(victims)

    def _unplace_own(self, feed: FeedState, plan: PlanState, k: int) -> None:
        """Take the processed sample at position ``k`` out of ``feed``'s plan: it is made again."""
        slot = plan.slots.pop(k)
        feed.made -= slot.nbytes
        if plan.state is not None:
            plan.state[k] = ABSENT
        none = np.zeros(1, dtype=np.int64)
        try:
            busy = set(
                self._tell(
                    feed.feeder, Place(feed.feed_id, plan.epoch, np.array([k], np.int64), none - 1, none, none)
                ).busy
            )
        except KSpeedError:
            busy = set()
        if slot.ticket in busy:
            self._draining[slot.ticket] = Draining(slot, {feed.feeder}, self.window)
        else:
            self.window.free(slot)

    def _warn_window(self, feeds: int) -> None:
        if not self._warned_window:
            self._warned_window = True
            log.warning(
                "the production window (%d bytes) cannot hold the next batch of each of its %d feeds' preprocessed "
                "samples at once; they are served one grant at a time (give the server a larger production_window, "
                "or use smaller batches)",
                self.window.capacity,
                feeds,
            )

    def _produce_processed(self, work: Work) -> None:
        """Run claimed positions of a plan through the server stages into window slots; tell the feeder."""
        plan, at, ids, share = work.plan, work.at, work.ids, work.share
        assert plan is not None and at is not None and plan.prep is not None and plan.state is not None
        prep = plan.prep
        keys: list[OutputKey | None] = list(work.outputs) if work.outputs is not None else [None] * len(at)
        group_owner = work.group.owner if work.group is not None else work.feed_id
        slots: list[Slot] = []
        placed = False
        try:
            with self._lock:
                span = plan.first_span()
                urgent = bool(((at >= span.start) & (at < span.stop)).any())
            for key in keys:
                slot = self.window.place(prep.nbytes, group_owner if key is not None else work.feed_id)
                while slot is None and (self._let_kept_go() or (urgent and self._preempt(work.feed_id))):
                    slot = self.window.place(prep.nbytes, group_owner if key is not None else work.feed_id)
                if slot is None:
                    break
                slots.append(slot)
            if len(slots) < len(at):
                with self._lock:
                    plan.state[at[len(slots) :]] = ABSENT
                    self._abandon_outputs(work.group, keys[len(slots) :])
                    self.window_full += 1
                at, ids, keys = at[: len(slots)], ids[: len(slots)], keys[: len(slots)]
                if not slots:
                    self.window.wait_for_room(0.05)
                    placed = True
                    return
            started = time.perf_counter()
            inputs, bad, read = self._raw_inputs(share, ids)
            with self._lock:
                ok = read[~np.isin(read, np.fromiter(bad, np.int64, len(bad)))]
                nbytes = int(share.preloader.index.length[ok - share.lo].sum())
                self._fetched(share.dataset, time.perf_counter() - started, len(ok), nbytes)
                if share.own_window and len(read):  # the reads are counted for the plan they were made for
                    figures = share.figures_of(plan.user_epoch)
                    figures.backend_requests += len(read)
                    figures.backend_bytes += nbytes
                    figures.misses += len(ok)
            keep = [k for k in range(len(ids)) if int(ids[k]) not in bad]
            results: dict[int, int | str] = {int(ids[k]): bad[int(ids[k])] for k in range(len(ids)) if k not in keep}
            if keep:
                if self.prep is None:
                    raise KSpeedError("this server has no preprocessing workers")
                task = PrepTask(
                    share.dataset,
                    prep.pipeline,
                    prep.stages,
                    prep.seed,
                    prep.epoch,
                    tuple(int(ids[k]) for k in keep),
                    tuple(inputs[k] for k in keep),
                    tuple(self.window.view(slots[k]) for k in keep),
                    prep.skip,
                    prep.start,
                )
                with self._lock:
                    owner = self._feeds.get(work.feed_id)
                job = (owner.job if owner is not None else "") or work.feed_id
                for k, result in zip(keep, self.prep.run(task, job=job), strict=True):
                    results[int(ids[k])] = result if not isinstance(result, bytes) else len(result)
            with self._lock:
                shared = [n for n, key in enumerate(keys) if key is not None]
                if shared:  # (whoever still waits for them is placed, this plan's position or not)
                    self._settle_outputs(
                        work.group,
                        [keys[n] for n in shared],  # type: ignore[misc]
                        [slots[n] for n in shared],
                        [results[int(ids[n])] for n in shared],
                    )
                    mine = [n for n, key in enumerate(keys) if key is None]
                    at, ids, slots = at[mine], ids[mine], [slots[n] for n in mine]
                placed = True
                feed = self._feeds.get(work.feed_id)
                if feed is None or feed.plans.get(work.epoch) is not plan:  # dropped meanwhile
                    for slot in slots:
                        self.window.free(slot)
                    return
                if len(at):
                    self._settle_processed(share, feed, plan, at, ids, slots, [results[int(i)] for i in ids])
        finally:
            if not placed:
                for slot in slots:
                    self.window.free(slot)
                with self._lock:
                    self._abandon_outputs(work.group, keys)
                    plan.state[at[plan.state[at] == READING]] = ABSENT

    def _raw_inputs(
        self, share: ShareState, ids: np.ndarray
    ) -> tuple[list[bytes | np.ndarray], dict[int, str], np.ndarray]:
        """Each sample's stored bytes for a worker: a view of its home (the server copies it to the
        worker, which maps no pool memory) or read from the backend now (and then brought home,
        unless the preload is reading it too, or the share has no home). Returns the inputs, the
        samples that could not be read with why, and the samples read from the backend."""
        index = share.preloader.index
        lengths = index.length[ids - share.lo]
        inputs: list[bytes | np.ndarray] = [b""] * len(ids)
        home = share.residency.of(ids) == HOME
        for k in np.flatnonzero(home).tolist():
            pos = int(ids[k]) - index.lo
            at = int(index.offset[pos])
            inputs[k] = share.preloader.region_array(int(index.region[pos]))[at : at + int(lengths[k])]
        away = np.flatnonzero(~home)
        if not len(away):
            return inputs, {}, ids[away]
        offsets = np.zeros(len(away) + 1, dtype=np.int64)
        np.cumsum(lengths[away], out=offsets[1:])
        buffer = np.empty(max(int(offsets[-1]), 1), dtype=np.uint8)
        # Those no one else is reading come home too, so the preload does not read them again. A
        # share with no home (a memory policy, or on demand) keeps no raw copy of a processed
        # position: claiming one there left it claimed for good, and adopting it failed the task
        # after its read, so every sample was read twice.
        homeless = share.preloader.on_demand
        claimed = set() if homeless else set(share.residency.claim(ids[away]).tolist())
        crcs, errors = share.preloader.source.read_run(
            [int(ids[k]) for k in away], buffer, offsets[:-1].tolist(), lengths[away].tolist()
        )
        share.preloader.changed(errors)
        failed = {e.sample: str(e) for e in errors if isinstance(e.sample, int)}
        for n, k in enumerate(away.tolist()):
            inputs[k] = buffer[offsets[n] : offsets[n + 1]].tobytes()
        home_now = [n for n, k in enumerate(away.tolist()) if int(ids[k]) in claimed and int(ids[k]) not in failed]
        if home_now:
            came = ids[away[home_now]]
            share.preloader.adopt(
                came, [buffer[offsets[n] : offsets[n + 1]] for n in home_now], np.asarray(crcs, np.uint32)[home_now]
            )
            self._came_home(share, came)
        unread = np.array([i for i in claimed if i in failed], dtype=np.int64)
        if len(unread):
            share.residency.fail(unread, [failed[int(i)] for i in unread.tolist()])
        return inputs, failed, ids[away]

    def _settle_processed(
        self,
        share: ShareState,
        feed: FeedState,
        plan: PlanState,
        at: np.ndarray,
        ids: np.ndarray,
        slots: list[Slot],
        results: list[int | str],
    ) -> None:
        """Record processed positions and tell the feeder where they are (or why they failed); under the lock."""
        assert plan.state is not None and plan.prep is not None
        cut = at >= plan.cut  # cut off by a truncation while they were produced: needed no more
        if cut.any():
            for k in np.flatnonzero(cut).tolist():
                self.window.free(slots[k])
            plan.state[at[cut]] = ABSENT
            keep = np.flatnonzero(~cut)
            at = at[keep]
            slots, results = [slots[k] for k in keep.tolist()], [results[k] for k in keep.tolist()]
            if not len(at):
                return
        failures = [str(r) for r in results if isinstance(r, str)]
        if failures and plan.prep.skip:  # the failure records were written in the slots: serve them
            self.failed_samples += len(failures)
            log.warning("dataset %s: %d sample(s) skipped: %s", share.dataset, len(failures), failures[0])
            results = [len(r) if isinstance(r, str) else r for r in results]
        ok = np.array([not isinstance(r, str) for r in results], dtype=bool)
        for k in np.flatnonzero(~ok).tolist():
            self.window.free(slots[k])
        if (~ok).any():
            plan.state[at[~ok]] = FAILED
            reasons = tuple(str(r) for r in results if isinstance(r, str))
            self.failed_samples += len(reasons)
            log.warning("dataset %s: %d sample(s) failed preprocessing: %s", share.dataset, len(reasons), reasons[0])
            none = np.zeros(len(reasons), np.int64)
            with contextlib.suppress(KSpeedError):  # this plan's grants of them fail (another plan may skip them)
                self._tell(feed.feeder, Place(feed.feed_id, plan.epoch, at[~ok], none - 1, none, none, reasons))
        good = np.flatnonzero(ok)
        if not len(good):
            return
        placed = [slots[k] for k in good.tolist()]
        for k, slot in zip(at[good].tolist(), placed, strict=True):
            plan.slots[k] = slot
            feed.made += slot.nbytes
        plan.state[at[good]] = WINDOW
        nbytes = int(sum(int(results[k]) for k in good.tolist()))
        self.produced_samples += len(good)
        self.produced_bytes += nbytes
        self._recent.append((time.monotonic(), nbytes))
        try:
            self._tell(
                feed.feeder,
                Place(
                    feed.feed_id,
                    plan.epoch,
                    at[good],
                    np.array([s.region for s in placed], np.int64),
                    np.array([s.offset for s in placed], np.int64),
                    np.array([s.ticket for s in placed], np.int64),
                    quiet=True,  # (positions being made: no slot of theirs to leave)
                ),
            )
        except KSpeedError as exc:  # the feeder is gone
            log.debug("feed %s: cannot place processed samples: %s", feed.feed_id, exc)
