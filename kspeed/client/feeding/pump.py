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

A plan is the rank's largest structure (about 15 bytes per sample of its share), so the pump
keeps two: the current epoch's and the next one's. One given up part way goes once its batches
still granted have settled (not at the next epoch's start), and one of a sampler drawn anew each
epoch goes before the next one is made when that is not the one made ahead.
"""

from __future__ import annotations

import gc
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import numpy as np

from kspeed.client.batch import Batch, BatchMeta
from kspeed.client.delivery.device import CpuDelivery, Delivery
from kspeed.client.delivery.ring import RingAllocator
from kspeed.client.feeding.failover import Failover
from kspeed.client.feeding.feed import Feed
from kspeed.client.feeding.feed_state import GrantedBatch
from kspeed.client.feeding.foresight import Foresight
from kspeed.client.planning.plans import EpochPlan
from kspeed.errors import CapacityError, StateError, TransportError
from kspeed.rdma.topology import pin

__all__ = ["Pump"]

log = logging.getLogger(__name__)

T = TypeVar("T")
MAX_CARRIES = 8  # servers lost one after another while the first is being replaced, at most


class Pump:
    """Grants and deliveries of one dataset's feed.

    Args:
        feed: the feed.
        plan_epoch: builds and commits the plan of an epoch (``feed_epoch`` chosen by the caller).
        deterministic: whether plans depend only on (seed, epoch), so the next one may be made early.
        thread_cores: cores the planner thread is pinned to (empty: no pinning).
        delivery: how batches reach the training device (default: host views, ``device="cpu"``).
        sample: an ``.npy`` dataset's row dtype and shape, for :meth:`Batch.array`.
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
        self._planner = (
            ThreadPoolExecutor(1, thread_name_prefix="kspeed-plan", initializer=pin, initargs=(thread_cores,))
            if deterministic
            else None
        )
        self._queue: deque[GrantedBatch] = deque()
        self._depth = 0  # the most batches ever granted ahead at once (the ring's depth in batches)
        self._cursor: tuple[EpochPlan, int] | None = None
        self._current: EpochPlan | None = None
        self.wait_s = 0.0
        self.last_wait_s = 0.0
        self.delivered = 0
        #: carries the feed over a lost server (``None``: a lost server is an error)
        self.failover: Failover | None = None

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

    def _prefetch(self, epoch: int) -> None:
        if self._planner is None or epoch in self._plans or (self._future is not None and self._future_epoch == epoch):
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
                self.feed.drop_plan(plan.feed_epoch)
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
        if self._cursor is None or (not force and len(self._queue) > self._depth // 2):
            return
        plan, batch = self._cursor
        granted = False
        while True:
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
        slot = self._surviving(lambda: self._wait_for(plan, batch))
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
        self._retire()  # a plan given up part way goes once its batches still granted have settled
        self._surviving(self.top_up)
        return result

    def _wait_for(self, plan: EpochPlan, batch: int) -> GrantedBatch:
        """Wait until ``batch`` of ``plan``, at the head of the queue, is complete."""
        self.delivery.poll()
        self.feed.allocator.drain()
        self.top_up()
        if not self._queue:
            self._make_room(plan, batch)
        slot = self._queue[0]
        if slot.plan is not plan or slot.batch != batch:
            raise StateError(
                f"dataset {self.feed.dataset!r}: expected batch {batch} of epoch {plan.epoch} next, "
                f"but batch {slot.batch} of epoch {slot.plan.epoch} was granted; start a new iteration"
            )
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
        for _ in range(MAX_CARRIES):
            try:
                self._grant_again(self.failover.recover(cause))
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
        kept = [p for p in (restart[0] if restart else None, self._current) if p is not None]
        for epoch, plan in list(self._plans.items()):
            if all(plan is not k for k in kept):
                self.feed.drop_plan(plan.feed_epoch)
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
        """Tell the servers to let go of the plan a discarded ``future`` made (they would otherwise
        follow it, never granted, ahead of the plans that are)."""
        if not future.cancelled() and future.exception() is None:
            self.feed.drop_plan(future.result().feed_epoch)

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
        """Stop the planner thread (a plan in progress finishes on its own)."""
        if self._planner is not None:
            self._planner.shutdown(wait=False, cancel_futures=True)
        if self.foresight is not None:
            self.foresight.close()
        self._queue.clear()
