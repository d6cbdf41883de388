"""The pump: keeps the ring granted ahead of the training loop, across epoch boundaries.

Each request for the next batch first tops up grants while the ring has room (the rest of the
current epoch, then the next epoch's batches once its plan is committed), then polls completions
until the wanted batch is complete. The servers keep writing while the model trains, so on ``shm``
nothing else needs to run in the training process.

One helper thread exists: the next epoch is looked up and committed (two RPC rounds to every
server, which may wait for a preload) on a planner thread while the current epoch is consumed, so
the training loop never stalls for those round trips at the boundary. A sampler deterministic in
(seed, epoch) has its next order computed there; any other has it predicted when the current epoch
starts, and the plan made ahead is used only if the sampler then gives that order
(:mod:`kspeed.client.feeding.foresight`). A sampler whose orders cannot be predicted has each epoch
planned in the caller's thread when it starts.

The same thread makes re-splits (``offload="auto"``, :meth:`Pump.resplit`): the plan being granted
re-split from a batch a little past the first one not granted, as a new pass. The batches from
there wait for it at most :data:`RESPLIT_HOLD_S` (after that they are granted from the old pass
and the re-split, stale, is made again further on); the lead past the cursor is twice what was
granted while the previous one was made.

A plan is the rank's largest structure (about 15 bytes per sample of its share), so the pump
keeps two: the current epoch's and the next one's. One given up part way goes once its batches
still granted have settled (not at the next epoch's start), and one of a sampler drawn anew each
epoch goes before the next one is made when that is not the one made ahead.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from kspeed.client.attribution import Attribution
from kspeed.client.batch import Batch, BatchMeta
from kspeed.client.delivery.device import CpuDelivery, Delivery
from kspeed.client.delivery.ring import RingAllocator
from kspeed.client.feeding.failover import Failover
from kspeed.client.feeding.feed import Feed
from kspeed.client.feeding.feed_state import GrantedBatch
from kspeed.client.feeding.foresight import Foresight
from kspeed.client.planning.plans import EpochPlan, EpochPlanner
from kspeed.errors import CapacityError, KSpeedError, StateError, TransportError
from kspeed.rdma.topology import pin

__all__ = ["Pump"]

log = logging.getLogger(__name__)

T = TypeVar("T")
MAX_CARRIES = 8  # servers lost one after another while the first is being replaced, at most
RESPLIT_LEAD = 2  # batches past the first ungranted one where a re-split starts (more after a miss)
MAX_RESPLIT_LEAD = 64
RESPLIT_RETRY_S = 1.0  # pause after a re-split that failed
RESPLIT_HOLD_S = 0.25  # longest time the batches from a re-split's first one wait for it to be adopted


@dataclass
class _Resplit:
    """A re-split being made on the planner thread."""

    future: Future
    plan: EpochPlan
    first: int  # its first batch: not granted from the old pass while it is made (for a while)
    cursor: int  # the cursor's batch when it was asked for
    hold_until: float


class Pump:
    """Grants and deliveries of one dataset's feed.

    Args:
        feed: the feed.
        plan_epoch: builds and commits the plan of an epoch (``feed_epoch`` chosen by the caller).
        deterministic: whether plans depend only on (seed, epoch), so the next one may be made early.
        thread_cores: cores the planner thread is pinned to (empty: no pinning).
        delivery: how batches reach the training device (default: host views, ``device="cpu"``).
        sample: an ``.npy`` dataset's row dtype and shape, for :meth:`Batch.array`.
        splitter: the planner, when the split of preprocessing may change while the job runs
            (:meth:`resplit`).
        foresight: plans ahead from predictions, for a sampler not ``deterministic`` (``None``:
            each epoch planned when it starts).
    """

    def __init__(
        self,
        feed: Feed,
        plan_epoch: Callable[[int], EpochPlan],
        deterministic: bool,
        thread_cores: tuple[int, ...] = (),
        delivery: Delivery | None = None,
        sample: tuple[str, tuple[int, ...]] = ("", ()),
        splitter: EpochPlanner | None = None,
        foresight: Foresight | None = None,
    ) -> None:
        self.feed = feed
        self.delivery: Delivery = delivery if delivery is not None else CpuDelivery()
        self._plan_epoch = plan_epoch
        self.sample = sample
        self._deterministic = deterministic
        self.foresight = foresight
        self._plans: dict[int, EpochPlan] = {}
        self._future: Future | None = None
        self._future_epoch: int | None = None
        # one thread for plans made ahead and re-splits: passes are numbered in the order they are made
        self._planner = (
            ThreadPoolExecutor(1, thread_name_prefix="kspeed-plan", initializer=pin, initargs=(thread_cores,))
            if deterministic or splitter is not None
            else None
        )
        self._splitter = splitter
        self._wanted: float | None = None  # the split asked for (None: the plans' own)
        self._split: _Resplit | None = None  # a re-split being made
        self._lead = RESPLIT_LEAD
        self._split_retry = 0.0
        self.resplits = 0
        self._queue: deque[GrantedBatch] = deque()
        self._depth = 0  # the most batches ever granted ahead at once (the ring's depth in batches)
        self._cursor: tuple[EpochPlan, int] | None = None
        self._current: EpochPlan | None = None
        self.wait_s = 0.0
        self.last_wait_s = 0.0
        self.delivered = 0
        #: carries the feed over a lost server (``None``: a lost server is an error)
        self.failover: Failover | None = None
        #: where each batch's wait goes (``None``: not attributed)
        self.attribution: Attribution | None = None
        self._waited_from = 0.0  # when the feed last began waiting for a batch's completions
        self._recovered: tuple[float, str] | None = None  # the end of the last recovery and the server lost

    # -- plans -----------------------------------------------------------------------------------

    def _plan_for(self, epoch: int) -> EpochPlan:
        if self._deterministic and epoch in self._plans:
            return self._plans[epoch]
        if self._future is not None and self._future_epoch == epoch:
            future, self._future = self._future, None
            plan = future.result()
        else:
            plan = self._plan_epoch(epoch)
        if self._deterministic:
            self._plans[epoch] = plan
        return plan

    def forget(self, epoch: int) -> None:
        """Let go of ``epoch``'s plan, made or being made (its order changed: a resume at another
        world size); the servers are told to drop it, and the next start plans it again."""
        if self._future is not None and self._future_epoch == epoch:
            self._future.add_done_callback(self._drop_made)
            self._future, self._future_epoch = None, None
        plan = self._plans.pop(epoch, None)
        if plan is None:
            return
        if self._current is plan or any(slot.plan is plan for slot in self._queue):
            self._let_go()
        for number in plan.pass_numbers():
            self.feed.drop_plan(number)

    def forget_all(self) -> None:
        """Let go of every plan made or being made (the rank's split of the epochs changed)."""
        for epoch in [*self._plans, *([self._future_epoch] if self._future_epoch is not None else [])]:
            self.forget(epoch)

    def _prefetch(self, epoch: int) -> None:
        if (
            self._planner is None
            or not self._deterministic
            or epoch in self._plans
            or (self._future is not None and self._future_epoch == epoch)
        ):
            return
        self._future, self._future_epoch = self._planner.submit(self._plan_epoch, epoch), epoch

    def _next_plan(self) -> EpochPlan | None:
        """The predicted next epoch's plan, once committed (never waits)."""
        if self._current is not None and self.foresight is not None:
            return self.foresight.ready()
        if self._current is None or not self._deterministic:
            return None
        epoch = self._current.epoch + 1
        if epoch in self._plans:
            return self._plans[epoch]
        if self._future is not None and self._future_epoch == epoch and self._future.done():
            if self._future.exception() is not None:
                return None  # raised again, in the caller's thread, when the epoch starts
            self._plans[epoch] = self._future.result()
            self._future = None
            return self._plans[epoch]
        return None

    def _retire(self) -> None:
        """Let go of the plans of epochs other than the current one and the next, once nothing
        granted of them is outstanding (the servers are told to drop them too)."""
        keep = {self._current.epoch, self._current.epoch + 1} if self._current else set()
        for epoch, plan in list(self._plans.items()):
            if epoch not in keep and plan.slots == 0:
                for number in plan.pass_numbers():
                    self.feed.drop_plan(number)
                del self._plans[epoch]
        if self.foresight is not None:
            self.foresight.retire()

    # -- epochs ----------------------------------------------------------------------------------

    def start(self, epoch: int, first_batch: int) -> EpochPlan:
        """Make ``epoch`` current from ``first_batch`` on; keep what was already granted if it lines up."""
        if self.foresight is not None:
            ids = self.foresight.draw(epoch)  # the sampler's order, drawn once, as without KSpeed
            plan = self._surviving(lambda: self._drawn_plan(epoch, ids))
        else:
            if not self._deterministic:
                self._let_go()  # its plan is never reused: freed before the next one is made
            plan = self._surviving(lambda: self._plan_for(epoch))
        head = self._queue[0] if self._queue else None
        if head is None or head.plan is not plan or head.batch != first_batch:
            while self._queue:
                slot = self._queue.popleft()
                self.feed.discard(slot)
            self._cursor = (plan, first_batch)
        self._current = plan
        self._retire()
        if self._deterministic:
            self._prefetch(epoch + 1)
        elif self.foresight is not None:
            self.foresight.plan_next()
        self._surviving(lambda: self.top_up(force=True))  # the servers write before the first batch is asked for
        return plan

    def _drawn_plan(self, epoch: int, ids: np.ndarray) -> EpochPlan:
        """The plan of ``ids``, the order the sampler gave for ``epoch``: the one made ahead if it
        predicted that order, else one made now (the current one let go first)."""
        assert self.foresight is not None
        plan = self.foresight.take(epoch, ids)
        if plan is None:
            self._let_go()
            plan = self.foresight.plan(epoch, ids)
        return plan

    def _let_go(self) -> None:
        """Give up what is granted and forget the current plan."""
        while self._queue:
            self.feed.discard(self._queue.popleft())
        self._cursor = self._current = None

    def top_up(self, force: bool = False) -> None:
        """Grant batches while the ring has room.

        Grants go out in chunks: unless ``force``d, nothing is granted while more than half of the
        deepest queue seen is still granted and undelivered. A server then gets many grants in one
        message and serves them with few vectorized writes; one grant per delivered batch would pay
        a message, a wake-up and a write call per batch on both sides.
        """
        if self._wanted is not None:
            self._tend_split()
        if self._cursor is None or (not force and len(self._queue) > self._depth // 2):
            return
        plan, batch = self._cursor
        granted = False
        split = self._split
        while True:
            if split is not None and plan is split.plan and batch >= split.first:
                if time.monotonic() < split.hold_until:
                    break  # granted from the new pass once it is adopted, in a moment
                split = None
            if batch >= plan.num_batches:
                following = self._next_plan() if plan is self._current else None
                if following is None:
                    break
                plan, batch = following, 0
                continue
            slot = self.feed.grant(plan, batch)
            if slot is None:
                break
            self._queue.append(slot)
            batch += 1
            granted = True
        self._cursor = (plan, batch)
        self._depth = max(self._depth, len(self._queue))
        if granted:
            self.feed.flush()

    def next_batch(self, plan: EpochPlan, batch: int) -> Batch:
        """Deliver ``batch`` of ``plan`` (the current epoch), waiting for its completions.

        Raises:
            CapacityError: the ring is full of batches the caller still holds.
        """
        started = time.monotonic()
        self._recovered = None
        slot = self._surviving(lambda: self._wait_for(plan, batch))
        if self.attribution is not None:
            self.attribution.batch(
                started, self._waited_from, slot.sent_at, slot.finished, time.monotonic(), self._recovered
            )
        self._queue.popleft()
        plan.slots -= 1
        layout = plan.layout
        lo, hi = int(layout.starts[batch]), int(layout.starts[batch + 1])
        # int64 copies, never views: the batch reads as before whatever the plan's narrow dtypes,
        # and a batch kept past its epoch does not keep that epoch's whole plan alive
        meta = BatchMeta(
            plan.epoch,
            batch,
            plan.ids[lo:hi].astype(np.int64),
            plan.labels[lo:hi].astype(np.int64),
            layout.offsets[lo:hi].astype(np.int64),
            layout.lengths[lo:hi].astype(np.int64),
            plan.remote[lo:hi].copy() if plan.remote is not None else None,
            *self.sample,
        )
        footprint = RingAllocator.footprint(int(layout.batch_bytes[batch]))
        result = self.delivery.deliver(self.feed.ring, slot.offset, footprint, meta, self.feed.allocator.release_later)
        self.last_wait_s = time.monotonic() - started
        self.wait_s += self.last_wait_s
        self.delivered += 1
        if len(plan.passes) > 1:  # passes re-split away whose batches are all delivered
            for number in plan.passes_before(batch + 1):
                self.feed.drop_plan(number)
        self._retire()  # a plan given up part way goes once its batches still granted have settled
        topped = time.monotonic()
        self._recovered = None
        self._surviving(self.top_up)
        if self._recovered is not None and self.attribution is not None:  # a server lost while granting ahead
            until = self._recovered[0]
            self.attribution.batch(topped, until, until, {}, until, self._recovered)
        return result

    def _wait_for(self, plan: EpochPlan, batch: int) -> GrantedBatch:
        """Wait until ``batch`` of ``plan``, at the head of the queue, is complete."""
        self.delivery.poll()
        self.feed.allocator.drain()
        self.top_up()
        split = self._split
        if not self._queue and split is not None:  # held for a re-split: wait for it, briefly
            with contextlib.suppress(Exception):  # (its error is dealt with where it is adopted)
                split.future.result(timeout=max(split.hold_until - time.monotonic(), 0.0))
            self.top_up(force=True)
        if not self._queue:
            self._make_room(plan, batch)
        slot = self._queue[0]
        if slot.plan is not plan or slot.batch != batch:
            raise StateError(
                f"dataset {self.feed.dataset!r}: expected batch {batch} of epoch {plan.epoch} next, "
                f"but batch {slot.batch} of epoch {slot.plan.epoch} was granted; start a new iteration"
            )
        self._waited_from = time.monotonic()
        self.feed.wait(slot, self._tick)
        return slot

    def _surviving(self, step: Callable[[], T]) -> T:
        """``step()``; when a server is lost meanwhile, carry the feed over (:mod:`kspeed.client.feeding.failover`)
        and do it again."""
        while True:
            try:
                return step()
            except TransportError as exc:  # a cut path (PeerLostError) or a silent server
                if self.failover is None:
                    raise
                self._carry_over(exc)

    def _carry_over(self, cause: TransportError) -> None:
        """Recover from ``cause``; a server lost while another is being replaced is carried over too."""
        assert self.failover is not None
        give_up = time.monotonic() + self.failover.timeout  # one wait in all, however many are lost
        lost = next((p.link.server_id for p in self.feed.paths if p.lost), "")
        for _ in range(MAX_CARRIES):
            try:
                self._grant_again(self.failover.recover(cause))
                self._recovered = (time.monotonic(), lost)
                if self.attribution is not None:
                    self.attribution.rename([p.link.server_id for p in self.feed.paths])
                return
            except TransportError as again:
                cause = again
                if time.monotonic() >= give_up:
                    break
        raise cause

    def _grant_again(self, replaced: list[int]) -> None:
        """After paths were replaced: commit the plans in use to their new servers, then grant again
        everything not delivered yet, from the first undelivered batch."""
        assert self.failover is not None
        head = self._queue[0] if self._queue else None
        restart = (head.plan, head.batch) if head is not None else self._cursor
        while self._queue:
            self.feed.discard(self._queue.popleft())
        if self._future is not None:  # a plan being made may lack the new servers: it is made again
            self._future.add_done_callback(self._drop_made)
        self._future, self._future_epoch = None, None
        if self._split is not None:  # so may a re-split: it is made again from the new cursor
            self._split.future.add_done_callback(self._drop_made)
            self._split = None
        kept = [p for p in (restart[0] if restart else None, self._current) if p is not None]
        for epoch, plan in list(self._plans.items()):
            if all(plan is not k for k in kept):
                for number in plan.pass_numbers():
                    self.feed.drop_plan(number)
                del self._plans[epoch]
        done: list[EpochPlan] = []
        for plan in kept:
            if all(plan is not d for d in done):
                self.failover.recommit(plan, replaced, restart[1] if restart and plan is restart[0] else 0)
                done.append(plan)
        self._cursor = restart
        if self._deterministic and self._current is not None:
            self._prefetch(self._current.epoch + 1)
        if self.foresight is not None:
            self.foresight.forget(kept)
        self.top_up(force=True)

    def _drop_made(self, future: Future) -> None:
        """Tell the servers to let go of the plan (or re-split pass) a discarded ``future`` made
        (they would otherwise follow it, never granted, ahead of the plans that are)."""
        if not future.cancelled() and future.exception() is None:
            self.feed.drop_plan(future.result().feed_epoch)

    # -- re-splits (offload="auto") ----------------------------------------------------------------

    def resplit(self, fraction: float) -> None:
        """Preprocess ``fraction`` of each batch on the servers from the first batch not granted
        yet on, and in the epochs after.

        The plan being granted is re-split on the planner thread as a new pass from a batch a
        little past the first ungranted one (:meth:`EpochPlanner.resplit`); the training thread
        adopts it at its next top-up if no batch from there was granted meanwhile (otherwise it
        is dropped and made again further on), and tells the servers to truncate the pass it
        replaces. A next epoch's plan made ahead with the old split is dropped and made again.
        Which samples the servers preprocess never changes what they are: every random stage
        draws from ``(seed, epoch, sample, stage)`` wherever it runs.

        Raises:
            StateError: this pump's plans cannot be re-split (no planner given).
        """
        if self._splitter is None:
            raise StateError(f"dataset {self.feed.dataset!r}: its preprocessing split cannot change while it runs")
        self._wanted = fraction
        self._splitter.set_fraction(fraction)

    def _tend_split(self) -> None:
        """Adopt a re-split that is ready, or start the one the cursor's plan needs."""
        split = self._split
        if split is not None:
            if not split.future.done():
                return
            self._split = None
            if (
                self._cursor is not None and self._cursor[0] is split.plan
            ):  # the lead: what was granted meanwhile, twice
                advance = self._cursor[1] - split.cursor
                self._lead = min(max(RESPLIT_LEAD, 2 * advance), MAX_RESPLIT_LEAD)
            try:
                tail = split.future.result()
            except KSpeedError as exc:
                log.warning(
                    "dataset %s: re-splitting epoch %d failed (%s); tried again",
                    self.feed.dataset,
                    split.plan.epoch,
                    exc,
                )
                self._split_retry = time.monotonic() + RESPLIT_RETRY_S
                return
            self._adopt(split.plan, tail)
            return
        if self._cursor is None or self._planner is None or time.monotonic() < self._split_retry:
            return
        plan, batch = self._cursor
        assert self._wanted is not None
        if abs(plan.fraction - self._wanted) < 1e-9 or plan.remote is None:
            return
        first = batch + self._lead if plan is self._current or batch > 0 else 0
        if first >= plan.num_batches:
            # the rest of this epoch is granted already (a ring that holds it whole): the next
            # epoch's plan, made ahead with the old split and not granted yet, is re-split whole
            following = self._next_plan() if plan is self._current else None
            if following is None or following.slots or abs(following.fraction - self._wanted) < 1e-9:
                return
            plan, first, batch = following, 0, 0
        splitter, wanted = self._splitter, self._wanted
        assert splitter is not None
        future = self._planner.submit(splitter.resplit, plan, first, wanted)
        self._split = _Resplit(future, plan, first, batch, time.monotonic() + RESPLIT_HOLD_S)

    def _adopt(self, plan: EpochPlan, tail: EpochPlan) -> None:
        """Make ``tail`` (a re-split of ``plan``) the plan's split, if nothing from its first batch
        was granted; otherwise let it go and try again further on."""
        first = tail.passes[-1][0]
        cursor_plan, cursor_batch = self._cursor if self._cursor is not None else (None, 0)
        granted = (
            cursor_batch > first
            if cursor_plan is plan
            else cursor_plan is None or cursor_plan.epoch >= plan.epoch  # the cursor went past it
        )
        if granted:
            self.feed.drop_plan(tail.feed_epoch)
            return
        replaced, whole = plan.adopt(tail)
        if whole:
            self.feed.drop_plan(replaced)
        else:
            self.feed.truncate_plan(replaced, first)
        self.resplits += 1
        log.info(
            "dataset %s: epoch %d from batch %d on: %.2f of each batch preprocessed on the servers",
            self.feed.dataset,
            plan.epoch,
            first,
            plan.fraction,
        )
        # a later epoch's plan made ahead with the old split would be followed before this pass
        # (passes are produced in the order they were made): it goes, and is made again
        for epoch, other in list(self._plans.items()):
            if epoch > plan.epoch and other.slots == 0 and all(other is not s.plan for s in self._queue):
                for number in other.pass_numbers():
                    self.feed.drop_plan(number)
                del self._plans[epoch]
        if self._future is not None and self._future_epoch is not None and self._future_epoch > plan.epoch:
            self._future.add_done_callback(self._drop_made)
            self._future, self._future_epoch = None, None
        if self._deterministic and self._current is not None:
            self._prefetch(self._current.epoch + 1)
        elif self.foresight is not None and self.foresight.ready() is not plan:
            self.foresight.again()

    def _tick(self) -> None:
        self.delivery.poll()
        if self.failover is not None:
            self.failover.fence_failed()
        self.top_up()

    def _room_coming(self) -> bool:
        """Whether ring room will come back without the caller: ranges of given-up batches that a
        server still writes, or quarantined ranges of a lost server (with failover)."""
        with self.feed.lock:
            owed = any(entry.slot.discarded for entry in self.feed.outstanding.values())
        return owed or (self.failover is not None and self.feed.allocator.quarantined > 0)

    def _make_room(self, plan: EpochPlan, batch: int) -> None:
        gc.collect()  # batches dropped in reference cycles give their ranges back here
        self.delivery.poll()
        self.feed.allocator.drain()
        self.top_up(force=True)
        if not self._queue and self.delivery.pending:
            self.delivery.make_room()  # wait for the device work of batches already dropped
            self.feed.allocator.drain()
        self.top_up(force=True)
        # Ranges still written for batches given up (granted again after a failover) come back
        # with their completions, and quarantined ones once their lost writers are gone: wait for those.
        give_up = time.monotonic() + max(self.feed.completion_timeout, self.failover.timeout if self.failover else 0)
        while not self._queue and self._room_coming() and time.monotonic() < give_up:
            with self.feed.lock:
                self.feed.granting.wait_step(self.feed)  # whoever polls the receiver also lifts quarantines
            self.feed.allocator.drain()
            self.top_up(force=True)
        if not self._queue:
            allocator = self.feed.allocator
            need = int(plan.layout.batch_bytes[batch])
            raise CapacityError(
                f"dataset {self.feed.dataset!r}: batch {batch} of epoch {plan.epoch} needs {need} bytes but the "
                f"receive ring ({allocator.capacity} bytes) is full of {allocator.reservations} batch(es) still held "
                f"({allocator.used} bytes, {allocator.quarantined} quarantined); release batches (batch.release() or "
                "drop their tensors) or raise ring_bytes"
            )

    def close(self) -> None:
        """Stop the planner thread: the plans queued are cancelled; one in progress ends when its
        calls do (closing the links ends them), :meth:`join` waits for it."""
        if self._planner is not None:
            self._planner.shutdown(wait=False, cancel_futures=True)
        if self.foresight is not None:
            self.foresight.close()
        self._queue.clear()

    def join(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for the planner threads to end, after :meth:`close`;
        whether they have (a thread left running would hold the interpreter's exit)."""
        give_up = time.monotonic() + timeout
        threads = list(self._planner._threads) if self._planner is not None else []
        for thread in threads:
            thread.join(max(give_up - time.monotonic(), 0.0))
        ended = self.foresight.join(max(give_up - time.monotonic(), 0.0)) if self.foresight is not None else True
        return ended and not any(thread.is_alive() for thread in threads)
