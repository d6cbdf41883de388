"""Epoch plans: ask each server about its IDs, learn their lengths, commit each server its part.

A plan is this rank's ordered IDs for one pass plus what the lookup replies said about them
(owner, length, label) and the ring layout :func:`kspeed.layout.batch_layout` makes of them. Each
server is asked only about the IDs of its share and handed only its part of the plan (positions,
IDs, lengths, offsets), so its cost of a boundary is its share of the order; a grant only names a
batch and a range of positions.

A rank holds two plans at once (the current epoch's and the next one's, planned ahead), so a plan
keeps about 15 bytes per sample (:mod:`kspeed.client.planning.compact`: ``int32`` IDs, ``uint32``
lengths and offsets, ``int16`` labels, an ``int8`` owner, each in its own mapping), and making one
holds no temporary as long as the plan but each server's positions while it is committed:
lookups are asked and answered a Lookup message at a time and merged as they come, the layout is
made a block of batches at a time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from kspeed.client.feeding.links import LOOKUP_CHUNK, Link, RemoteSplit, ServerPlan
from kspeed.client.planning.compact import (
    SCAN_BLOCK,
    U32_MAX,
    held,
    index_dtype,
    mapped,
    narrow_dtype,
    owned_positions,
    store,
)
from kspeed.client.planning.sampling import EpochOrders
from kspeed.errors import (
    CapacityError,
    DatasetError,
    KSpeedError,
    NotHeldError,
    PeerLostError,
    ProtocolError,
    StateError,
    UnavailableError,
)
from kspeed.layout import BatchLayout, batch_layout, batch_starts

__all__ = [
    "EpochPlan",
    "EpochPlanner",
    "PrepSplit",
    "check_fits",
    "compact_layout",
    "make_plan",
    "reaching",
    "remote_positions",
    "server_plan",
]

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class PrepSplit:
    """How a plan splits preprocessing between the servers and this client.

    Attributes:
        server_stages: leading pipeline stages the servers run for remote samples.
        fraction: share of each batch's samples preprocessed on the servers (0..1).
        seed: the job's seed (random stages draw from ``(seed, epoch, sample, stage)``).
        nbytes: ring bytes of a sample after the server stages (their declared output, and the
            status word when skipping).
        skip: a sample whose server stages fail arrives as a failure record (``on_error="skip"``).
        adjustable: the fraction may change while the job runs (``offload="auto"``): every plan
            keeps a per-position ``remote`` array, even with no sample offloaded.
    """

    server_stages: int
    fraction: float
    seed: int
    nbytes: int
    skip: bool = False
    adjustable: bool = False


def remote_positions(count: int, batch_size: int, fraction: float) -> np.ndarray:
    """Which of ``count`` plan positions the servers preprocess: within every batch, the counters
    ``floor((k + 1) * fraction) > floor(k * fraction)`` of its ``k``-th sample, so each batch holds
    the ratio to within one sample (one batch's pattern, repeated)."""
    k = np.arange(max(batch_size, 1), dtype=np.int64)
    pattern = np.floor((k + 1) * fraction + 1e-9) > np.floor(k * fraction + 1e-9)
    out = mapped(count, bool)
    whole = count - count % len(pattern)
    out[:whole].reshape(-1, len(pattern))[:] = pattern
    out[whole:] = pattern[: count - whole]
    return out


@dataclass(eq=False)
class EpochPlan:
    """One committed pass over an epoch's order.

    The per-position arrays are as narrow as their values allow (:mod:`kspeed.client.planning.compact`);
    a batch's slices are widened to ``int64`` where they leave the plan (:class:`kspeed.client.batch.BatchMeta`).

    Attributes:
        epoch: the user's epoch number.
        feed_epoch: the number this pass carries in grants (unique per feed, so two passes over one
            epoch, or a discarded prediction, never collide on the servers).
        ids: sample IDs in delivery order (``int32`` below ``2**31`` samples).
        lengths: their lengths in bytes (``uint32``; ``int64`` past it).
        labels: their labels (-1 without labels: then one read-only -1 for every position).
        owner: per position, the index of the server that writes it.
        layout: where every sample lands relative to its batch (its ``lengths`` are ``lengths``).
        owed: ``(servers, batches)`` booleans: which servers write something in which batch.
        deterministic: the order is a function of (seed, epoch), so the plan may be reused.
        remote: per position, whether the servers preprocess it (``None``: no pipeline on them).
        lookup_s: seconds the lookup on every server took.
        commit_s: seconds the commit to every server took.
    """

    epoch: int
    feed_epoch: int
    ids: np.ndarray
    lengths: np.ndarray
    labels: np.ndarray
    owner: np.ndarray
    layout: BatchLayout
    owed: np.ndarray
    deterministic: bool
    slots: int = field(default=0)
    remote: np.ndarray | None = None
    lookup_s: float = 0.0
    commit_s: float = 0.0
    #: ``(first batch, pass number)`` of each pass the plan is committed as, in batch order: one
    #: at first (``feed_epoch``); a re-split (:meth:`EpochPlanner.resplit`) adds one for its tail
    passes: list[tuple[int, int]] = field(default_factory=list)
    #: share of the batches of the last pass preprocessed on the servers
    fraction: float = 0.0

    def __post_init__(self) -> None:
        if not self.passes:
            self.passes = [(0, self.feed_epoch)]

    @property
    def num_batches(self) -> int:
        return self.layout.num_batches

    def pass_of(self, batch: int) -> int:
        """The pass number grants of ``batch`` carry."""
        for first, number in reversed(self.passes):
            if batch >= first:
                return number
        return self.passes[0][1]

    def pass_numbers(self) -> list[int]:
        """Every pass the servers hold of this plan."""
        return [number for _, number in self.passes]

    def adopt(self, tail: EpochPlan) -> tuple[int, bool]:
        """Take the split of ``tail`` (:meth:`EpochPlanner.resplit` of this plan): its lengths,
        layout and ``remote`` (equal to this plan's before its first batch) and its new pass.
        Returns the pass that one replaces from its first batch on, and whether it replaces all
        of it (the servers drop it then; otherwise they truncate it at that batch)."""
        first, number = tail.passes[-1]
        replaced = self.pass_of(first)
        whole = any(p == (first, replaced) for p in self.passes)
        self.lengths, self.layout, self.remote = tail.lengths, tail.layout, tail.remote
        self.passes = [p for p in self.passes if p[0] < first] + [(first, number)]
        self.feed_epoch, self.fraction = number, tail.fraction
        return replaced, whole

    def passes_before(self, batch: int) -> list[int]:
        """The passes whose batches all lie before ``batch`` (delivered: the servers may let them go),
        taken out of :attr:`passes`."""
        done = [number for (_, number), (following, _) in zip(self.passes, self.passes[1:]) if following <= batch]
        self.passes = [p for p in self.passes if p[1] not in done]
        return done


def reaching(link: Link, call: Callable[[], T]) -> T:
    """``call()`` on ``link``; its server unreachable, or no longer holding the link's share, is a
    lost server (:class:`PeerLostError` naming it and the link's share), which a feed with failover
    carries over (to wherever the manager moved the share)."""
    try:
        return call()
    except (UnavailableError, PeerLostError, NotHeldError) as exc:  # unreachable, our feed or share there gone
        raise PeerLostError(str(exc), server_id=link.server_id, first_id=link.first_id) from exc


class _Answers:
    """The lookups' answers about one order, merged into per-position arrays as they come.

    Every sample must have exactly one owner: one claimed twice is a :class:`ProtocolError` at
    once, one never claimed a :class:`DatasetError` from :meth:`check_owned`.
    """

    def __init__(self, links: Sequence[Link], dataset: str, ids: np.ndarray, labelled: bool) -> None:
        n = len(ids)
        self._links, self._dataset, self._ids, self._labelled = links, dataset, ids, labelled
        self.owner = mapped(n, index_dtype(len(links)), fill=-1)
        self.lengths = mapped(n, np.uint32)
        #: no labels: one -1 read at every position, no memory per sample
        self.labels = mapped(n, np.int16, fill=-1) if labelled else np.broadcast_to(np.int16(-1), (n,))
        self._lock = threading.Lock()

    def add(self, index: int, positions: np.ndarray, lengths: np.ndarray, labels: np.ndarray) -> None:
        """What server ``index`` answered about the samples at ``positions``."""
        with self._lock:
            clash = positions[self.owner[positions] >= 0]
            if len(clash):
                p = int(clash[0])
                raise ProtocolError(
                    f"dataset {self._dataset!r}: sample {int(self._ids[p])} is claimed by "
                    f"{self._links[self.owner[p]].name} and {self._links[index].name}"
                )
            self.owner[positions] = index
            self.lengths = store(self.lengths, positions, lengths)
            if self._labelled and len(labels) == len(positions):
                self.labels = store(self.labels, positions, labels)

    def check_owned(self) -> None:
        """Raises DatasetError naming the first sample no server claimed."""
        orphans = np.flatnonzero(self.owner < 0)
        if len(orphans):
            sample = int(self._ids[orphans[0]])
            raise DatasetError(
                f"dataset {self._dataset!r}: sample {sample} is owned by no server ({len(orphans)} sample(s) "
                "unowned); the dataset's shares do not cover it",
                dataset=self._dataset,
                sample=sample,
            )


def _asked(ids: np.ndarray, link: Link) -> Iterator[np.ndarray]:
    """The positions of ``ids`` to ask ``link`` about, a Lookup message's worth
    (:data:`~kspeed.client.feeding.links.LOOKUP_CHUNK`) at a time; at least one piece, maybe empty,
    so every server hears a lookup.

    A link that knows its share's ID range is asked only about the IDs in it (ownership is
    contiguous ranges, known from the allocation), so a server's lookup costs its share of the
    order, not the whole order; one that does not is asked about every ID.
    """
    first, end = link.first_id, link.end_id
    if first is None or end is None:
        for lo in range(0, max(len(ids), 1), LOOKUP_CHUNK):
            yield np.arange(lo, min(lo + LOOKUP_CHUNK, len(ids)))
        return
    pending = np.zeros(0, dtype=np.int64)
    sent = False
    for lo in range(0, len(ids), SCAN_BLOCK):
        block = ids[lo : lo + SCAN_BLOCK]
        pending = np.concatenate([pending, np.flatnonzero((block >= first) & (block < end)) + lo])
        while len(pending) >= LOOKUP_CHUNK:
            yield pending[:LOOKUP_CHUNK]
            pending, sent = pending[LOOKUP_CHUNK:], True
    if len(pending) or not sent:
        yield pending


def _settle(futures: Sequence[Future[None]]) -> None:
    """Wait for every one of ``futures`` to end, then raise the first one's error.

    Each is waited for by its own ``exception()``, not :func:`concurrent.futures.wait`: that one
    never wakes for a future cancelled while queued (the pool shut down with ``cancel_futures``
    when the dataset closes), and the planner thread waiting in it held the interpreter's exit.

    Raises:
        CancelledError: one was cancelled (the pool was shut down).
    """
    for future in futures:
        with contextlib.suppress(CancelledError):
            future.exception()  # ends with the call's deadline, or at once when cancelled
    for future in futures:
        future.result()


def _lookup_all(
    links: Sequence[Link], dataset: str, ids: np.ndarray, labelled: bool, pool: ThreadPoolExecutor | None
) -> _Answers:
    """Ask each link about the IDs it owns (:func:`_asked`) and merge the answers."""
    answers = _Answers(links, dataset, ids, labelled)

    def one(index: int, link: Link) -> None:
        for asked in _asked(ids, link):
            positions, lengths, labels = reaching(link, functools.partial(link.lookup, dataset, ids[asked]))
            answers.add(index, asked[positions], lengths, labels)

    if pool is None or len(links) == 1:
        for index, link in enumerate(links):
            one(index, link)
    else:
        _settle([pool.submit(one, index, link) for index, link in enumerate(links)])
    answers.check_owned()
    return answers


def make_plan(
    links: Sequence[Link],
    *,
    dataset: str,
    feed_ids: Sequence[str],
    epoch: int,
    feed_epoch: int,
    ids: np.ndarray,
    batch_size: int,
    labelled: bool,
    deterministic: bool,
    ring_bytes: int,
    pool: ThreadPoolExecutor | None = None,
    prep: PrepSplit | None = None,
) -> EpochPlan:
    """Look ``ids`` up on their servers, check the answers, and commit each server its part of the plan.

    Args:
        links: every server of the dataset.
        dataset: its name.
        feed_ids: this client's feed on each link.
        epoch: the user's epoch.
        feed_epoch: the pass number sent to servers.
        ids: the order (the plan keeps a copy, ``int32`` when its IDs fit).
        batch_size: samples per batch.
        labelled: whether lookup replies carry labels.
        deterministic: whether the order may be reused for the same epoch.
        ring_bytes: ring capacity (a batch larger than it is refused here).
        pool: threads to talk to several servers at once.
        prep: how preprocessing is split (remote samples take the server stages' output size).

    Raises:
        DatasetError: a sample is owned by no server (named).
        ProtocolError: two servers claim one sample.
        CapacityError: a batch does not fit in the ring.
    """
    ids = held(ids, narrow_dtype(ids))
    n = len(ids)
    started = time.perf_counter()
    answers = _lookup_all(links, dataset, ids, labelled, pool)
    lookup_s = time.perf_counter() - started
    lengths, remote = answers.lengths, None
    if prep is not None and prep.fraction > 0:
        remote = remote_positions(n, batch_size, prep.fraction)
        lengths = store(lengths, remote, prep.nbytes)
    layout = compact_layout(lengths, batch_size)
    check_fits(layout, ring_bytes, dataset, epoch)
    owed = _owed(answers.owner, len(links), batch_size, layout.num_batches)
    if remote is None and prep is not None and prep.adjustable:
        remote = mapped(n, bool)  # none yet, but a re-split may offload some
    plan = EpochPlan(
        epoch,
        feed_epoch,
        ids,
        lengths,
        answers.labels,
        answers.owner,
        layout,
        owed,
        deterministic,
        remote=remote,
        lookup_s=lookup_s,
        fraction=prep.fraction if prep is not None else 0.0,
    )
    started = time.perf_counter()
    _commit_all(list(enumerate(zip(links, feed_ids, strict=True))), plan, batch_size, pool, prep)
    plan.commit_s = time.perf_counter() - started
    log.debug(
        "dataset %s: epoch %d planned as pass %d (%d samples, %d batches)",
        dataset,
        epoch,
        feed_epoch,
        n,
        layout.num_batches,
    )
    return plan


def _block(batch_size: int) -> int:
    """Positions in a block of whole batches of about :data:`SCAN_BLOCK` positions."""
    return batch_size * max(1, SCAN_BLOCK // batch_size)


def compact_layout(lengths: np.ndarray, batch_size: int) -> BatchLayout:
    """:func:`kspeed.layout.batch_layout` of ``lengths``, made a block of whole batches at a time
    (a batch's offsets depend on its own lengths only) into ``uint32`` offsets while every batch is
    under 4 GiB (``int64`` past it): no ``int64`` temporary as long as the plan.

    Raises:
        ValueError: batch_size is not positive or a length is negative.
    """
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    n = len(lengths)
    starts = held(batch_starts(n, batch_size))
    offsets = mapped(n, np.uint32)
    batch_bytes = mapped(len(starts) - 1, np.int64)
    step = _block(batch_size)
    for lo in range(0, n, step):
        part = batch_layout(lengths[lo : lo + step], batch_size)
        if offsets.dtype == np.uint32 and int(part.batch_bytes.max()) > U32_MAX:
            offsets = held(offsets, np.int64)  # offset + length must fit too (pacing cuts batches by their ends)
        offsets[lo : lo + len(part.offsets)] = part.offsets
        first = lo // batch_size
        batch_bytes[first : first + part.num_batches] = part.batch_bytes
    return BatchLayout(batch_size, starts, offsets, lengths, batch_bytes)


def _owed(owner: np.ndarray, servers: int, batch_size: int, num_batches: int) -> np.ndarray:
    """``(servers, batches)`` booleans: which servers write something in which batch."""
    owed = mapped((servers, num_batches), bool)
    step = _block(batch_size)
    for lo in range(0, len(owner), step):
        block = owner[lo : lo + step]
        owed[block, lo // batch_size + np.arange(len(block)) // batch_size] = True
    return owed


def check_fits(layout: BatchLayout, ring_bytes: int, dataset: str, epoch: int) -> None:
    """Refuse a plan whose largest batch cannot fit in the ring.

    Raises:
        CapacityError: naming the batch, its size and the ring's.
    """
    if not len(layout.batch_bytes):
        return
    b = int(np.argmax(layout.batch_bytes))
    need = int(layout.batch_bytes[b])
    if need > ring_bytes:
        raise CapacityError(
            f"dataset {dataset!r}: batch {b} of epoch {epoch} needs {need} bytes, more than the "
            f"receive ring's {ring_bytes}; raise ring_bytes (KSPEED_RING_BYTES) or lower batch_size"
        )


def server_plan(
    plan: EpochPlan,
    index: int,
    batch_size: int,
    prep: PrepSplit | None,
    first_batch: int = 0,
    number: int | None = None,
) -> ServerPlan:
    """The part of ``plan`` that server ``index`` writes: its positions, and the plan's IDs,
    lengths and offsets it reads its own from; as pass ``number`` (default: the plan's last)."""
    split = None
    if plan.remote is not None and prep is not None:
        split = RemoteSplit(prep.server_stages, prep.seed, plan.epoch, prep.skip)
    return ServerPlan(
        feed_epoch=plan.feed_epoch if number is None else number,
        batch_size=batch_size,
        count=len(plan.ids),
        positions=owned_positions(plan.owner, index),
        plan_ids=plan.ids,
        plan_lengths=plan.lengths,
        plan_offsets=plan.layout.offsets,
        plan_remote=plan.remote,
        split=split,
        first_batch=first_batch,
        epoch=plan.epoch,
    )


def _commit_all(
    targets: Sequence[tuple[int, tuple[Link, str]]],
    plan: EpochPlan,
    batch_size: int,
    pool: ThreadPoolExecutor | None,
    prep: PrepSplit | None,
    first_batch: int = 0,
    number: int | None = None,
) -> None:
    """Commit to each ``(owner index, (link, feed id))`` of ``targets`` its part of ``plan`` (as
    pass ``number``; default: the plan's last)."""

    def one(index: int, link: Link, feed_id: str) -> None:
        part = server_plan(plan, index, batch_size, prep, first_batch, number)
        reaching(link, lambda: link.commit_plan(feed_id, part))

    if pool is None or len(targets) == 1:
        for index, (link, feed_id) in targets:
            one(index, link, feed_id)
        return
    # all answered before one's error is raised: a pass dropped then is dropped wherever it went
    _settle([pool.submit(one, index, link, feed_id) for index, (link, feed_id) in targets])


class EpochPlanner:
    """Plans the epochs of one feed: the sampler's order of an epoch, looked up and committed everywhere.

    Each call is a new pass with its own ``feed_epoch`` (so two passes over one epoch, or a
    discarded prediction, never collide on the servers).

    Args:
        links: every server of the dataset.
        dataset: its name.
        feed_ids: this client's feed on each link.
        orders: the sampler's orders.
        batch_size: samples per batch.
        labelled: whether lookup replies carry labels.
        ring_bytes: ring capacity.
        pool: threads to talk to several servers at once.
        prep: how preprocessing is split between the servers and this client.
        drop: tells the servers to let go of a pass (the feed's ``drop_plan``): one whose plan
            failed part way, committed to some servers and not others (a server lost meanwhile),
            would otherwise be followed there, never granted, ahead of the passes that are.
        truncate: tells the servers a pass is not wanted from a batch on (the feed's
            ``truncate_plan``), when a plan of several passes is committed again after a failover.
    """

    def __init__(
        self,
        links: Sequence[Link],
        *,
        dataset: str,
        feed_ids: Sequence[str],
        orders: EpochOrders,
        batch_size: int,
        labelled: bool,
        ring_bytes: int,
        pool: ThreadPoolExecutor | None = None,
        prep: PrepSplit | None = None,
        drop: Callable[[int], None] | None = None,
        truncate: Callable[[int, int], None] | None = None,
    ) -> None:
        self._drop = drop
        self._truncate = truncate
        self._links = list(links)
        self._feed_ids = list(feed_ids)
        self._prep = prep
        self._dataset = dataset
        self._orders = orders
        self._batch_size = batch_size
        self._labelled = labelled
        self._ring_bytes = ring_bytes
        self._pool = pool
        self._passes = itertools.count(1)

    def replace_link(self, index: int, link: Link, feed_id: str) -> None:
        """Plan with ``link`` (the feed ``feed_id`` there) in place of server ``index`` from now
        on (its share moved there)."""
        self._links[index] = link
        self._feed_ids[index] = feed_id

    @property
    def links(self) -> list[Link]:
        """The links planned with now (a failover's in place of the ones it replaced)."""
        return list(self._links)

    @property
    def prep(self) -> PrepSplit | None:
        """How the next plans split preprocessing."""
        return self._prep

    def set_fraction(self, fraction: float) -> None:
        """Plan the next epochs with ``fraction`` of each batch preprocessed on the servers."""
        if self._prep is not None:
            self._prep = dataclasses.replace(self._prep, fraction=fraction)

    def commit(self, plan: EpochPlan, index: int, first_batch: int = 0) -> None:
        """Commit an existing plan to the server of path ``index`` (one that took a share over),
        from batch ``first_batch`` on (the ones before were delivered): each of its passes that
        still has batches to deliver, the earlier ones told where the next takes over."""
        target = (index, (self._links[index], self._feed_ids[index]))
        passes = plan.passes
        for k, (first, number) in enumerate(passes):
            end = passes[k + 1][0] if k + 1 < len(passes) else plan.num_batches
            if end <= first_batch and k + 1 < len(passes):
                continue
            _commit_all([target], plan, self._batch_size, None, self._prep, max(first, first_batch), number)
            if k + 1 < len(passes) and self._truncate is not None:
                self._truncate(number, end)

    def resplit(self, plan: EpochPlan, first_batch: int, fraction: float) -> EpochPlan:
        """``plan`` with ``fraction`` of each batch from ``first_batch`` on preprocessed on the
        servers, committed to every server as a new pass from that batch on: a new plan object
        sharing the order, owners and labels, with its own lengths, layout and ``remote`` (the
        batches before ``first_batch`` are laid out as in ``plan``). The caller adopts it
        (:meth:`EpochPlan.adopt`) once no batch from ``first_batch`` on was granted meanwhile, and
        tells the servers to truncate the pass it replaces; or drops the new pass.

        Samples that leave the servers' share need their stored lengths again: they are looked up.

        Raises:
            StateError: the plans split nothing (no pipeline on the servers).
            DatasetError, ProtocolError, CapacityError, TransportError: as :func:`make_plan`.
        """
        if self._prep is None or plan.remote is None:
            raise StateError(f"dataset {self._dataset!r}: its plans have no preprocessing to split")
        prep = dataclasses.replace(self._prep, fraction=fraction)
        bs = self._batch_size
        n = len(plan.ids)
        lo = int(plan.layout.starts[min(first_batch, plan.num_batches)])
        remote = remote_positions(n, bs, fraction) if fraction > 0 else mapped(n, bool)
        remote[:lo] = plan.remote[:lo]
        lengths = held(plan.lengths.copy())
        back = lo + np.flatnonzero(~remote[lo:] & plan.remote[lo:])
        if len(back):
            answers = _lookup_all(self._links, self._dataset, held(plan.ids[back]), False, self._pool)
            lengths = store(lengths, back, answers.lengths)
        lengths = store(lengths, lo + np.flatnonzero(remote[lo:]), prep.nbytes)
        layout = compact_layout(lengths, bs)
        check_fits(layout, self._ring_bytes, self._dataset, plan.epoch)
        number = next(self._passes)
        tail = EpochPlan(
            plan.epoch,
            number,
            plan.ids,
            lengths,
            plan.labels,
            plan.owner,
            layout,
            plan.owed,
            plan.deterministic,
            remote=remote,
            passes=[*[p for p in plan.passes if p[0] < first_batch], (first_batch, number)],
            fraction=fraction,
        )
        started = time.perf_counter()
        try:
            targets = list(enumerate(zip(self._links, self._feed_ids, strict=True)))
            _commit_all(targets, tail, bs, self._pool, prep, first_batch)
        except KSpeedError:
            if self._drop is not None:
                self._drop(number)
            raise
        tail.commit_s = time.perf_counter() - started
        log.debug(
            "dataset %s: epoch %d re-split from batch %d as pass %d (%.2f on the servers)",
            self._dataset,
            plan.epoch,
            first_batch,
            number,
            fraction,
        )
        return tail

    def __call__(self, epoch: int) -> EpochPlan:
        """Plan ``epoch`` as a new pass (see :func:`make_plan` for what it raises)."""
        feed_epoch = next(self._passes)
        try:
            return make_plan(
                self._links,
                dataset=self._dataset,
                feed_ids=self._feed_ids,
                epoch=epoch,
                feed_epoch=feed_epoch,
                ids=self._orders.order(epoch),
                batch_size=self._batch_size,
                labelled=self._labelled,
                deterministic=self._orders.deterministic,
                ring_bytes=self._ring_bytes,
                pool=self._pool,
                prep=self._prep,
            )
        except KSpeedError:
            if self._drop is not None:
                self._drop(feed_epoch)
            raise
