"""How a feed's grants reach its servers: all the ring can hold at once, or paced within a window.

:class:`Unpaced` grants every batch the ring has room for and sends the grants from the caller's
thread; the training loop polls completions when it waits for a batch, and nothing else runs.
:class:`Paced` splits batches into sub-batches and lets a :class:`~kspeed.client.feeding.pacing.Pacer`
decide what may be on its way (docs/feeding.md, Pacing); since only a window is granted at a time,
a pacing thread takes in completions and sends the next sub-batches while the training loop
computes. It is then the receiver's only user: calls from other threads (fencing, dropping a plan)
are handed to it.

Both keep the feed's bookkeeping the same: one :class:`Outstanding` per grant sent or queued,
keyed by its tag in :attr:`Feed.outstanding`, answered by one completion or one ERROR.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from kspeed import grants
from kspeed.client.delivery.ring import RingAllocator
from kspeed.client.feeding.feed_state import GrantedBatch, ServerPath
from kspeed.client.feeding.pacing import SIZE_CLASSES, Pacer, SubGrant
from kspeed.errors import KSpeedError, PeerLostError, TransportError, UnavailableError
from kspeed.rdma.base import Completions, Receiver

__all__ = ["Granting", "Outstanding", "Paced", "Unpaced"]

log = logging.getLogger(__name__)

WAIT_TICK = 0.05  # longest single wait for progress, so timeouts and top-ups are checked often
PACE_TICK = 0.001  # longest wait of the pacing thread for completions while it has work (or had it lately)
IDLE_TICK = 0.01  # longest wait of the pacing thread after a while without work
PROBE_REPEAT = 2  # probes per size class and server; the fastest counts


class Feed(Protocol):
    """What a granting uses of its :class:`~kspeed.client.feeding.feed.Feed` (the feed owns the
    state; the granting decides when grants go and who waits, under the feed's lock)."""

    dataset: str
    lock: threading.RLock
    changed: threading.Condition
    progress: int
    receiver: Receiver
    allocator: RingAllocator
    paths: list[ServerPath]
    outstanding: dict[int, Outstanding]

    def next_tag(self, path: ServerPath) -> int: ...
    def send_grants(self, path: ServerPath, rows: Sequence[grants.Grant]) -> None: ...
    def poll(self, timeout: float = 0.0) -> None: ...
    def accept(self, done: Completions) -> None: ...
    def take_messages(self) -> None: ...
    def tend(self) -> None: ...
    def lost(self, exc: PeerLostError) -> None: ...


@dataclass(eq=False)
class Outstanding:
    """A grant sent or queued and not yet answered.

    Attributes:
        slot: the batch it is part of.
        path: the index of the server it was granted to.
        sub: its sub-batch when paced (``None`` unpaced).
    """

    slot: GrantedBatch
    path: int
    sub: SubGrant | None = None


class Granting(ABC):
    """The strategy of a :class:`~kspeed.client.feeding.feed.Feed` for sending grants and waiting for progress.

    Methods marked "lock held" are called with the feed's lock held.
    """

    #: The failure of a helper thread, raised in the training loop (``None`` while all is well).
    failure: KSpeedError | None = None

    def start(self, feed: Feed, probe_timeout: float) -> None:  # noqa: B027 (optional hook)
        """Begin, once every server's feeder has connected."""

    @abstractmethod
    def queue(self, feed: Feed, slot: GrantedBatch, owed: list[int]) -> None:
        """Queue the grants of a reserved batch for the servers ``owed`` (lock held)."""

    @abstractmethod
    def flush(self) -> None:
        """Send what was queued."""

    @abstractmethod
    def wait_step(self, feed: Feed) -> None:
        """Wait a little for progress on the feed (lock held)."""

    @abstractmethod
    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """Make a receiver call from any thread (errors are ignored: the path is failing anyway)."""

    def completed(self, entry: Outstanding, now: float) -> None:  # noqa: B027 (optional hook)
        """A grant was answered, by a completion or an ERROR (lock held)."""

    def held(self, held: grants.Held) -> None:  # noqa: B027 (optional hook)
        """Grants that waited at their server for production, and how long (lock held)."""

    def dropped(self, path: int) -> None:  # noqa: B027 (optional hook)
        """A server's path was fenced: forget its queued grants (lock held)."""

    def stats(self) -> dict[str, Any] | None:
        """Pacing figures, or ``None`` when not paced."""
        return None

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Stop any helper thread."""


class Unpaced(Granting):
    """Every batch the ring can hold is granted at once: one grant per server that writes in it."""

    def __init__(self) -> None:
        self._feed: Feed | None = None
        self._queued: dict[int, list[grants.Grant]] = {}

    def start(self, feed: Feed, probe_timeout: float) -> None:
        self._feed = feed

    def queue(self, feed: Feed, slot: GrantedBatch, owed: list[int]) -> None:
        layout = slot.plan.layout
        size = int(layout.starts[slot.batch + 1] - layout.starts[slot.batch])
        for index in owed:
            tag = feed.next_tag(feed.paths[index])
            feed.outstanding[tag] = Outstanding(slot, index)
            self._queued.setdefault(index, []).append(
                grants.Grant(slot.plan.pass_of(slot.batch), slot.batch, slot.offset, 0, size, tag)
            )
            slot.owed[index] = 1

    def flush(self) -> None:
        feed = self._feed
        if feed is None:
            return
        with feed.lock:
            queued, self._queued = self._queued, {}
            for index, rows in queued.items():
                feed.send_grants(feed.paths[index], rows)

    def wait_step(self, feed: Feed) -> None:
        feed.poll(WAIT_TICK)

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        with contextlib.suppress(KSpeedError):
            fn(*args)

    def dropped(self, path: int) -> None:
        self._queued.pop(path, None)


class Paced(Granting):
    """Sub-batches within the pacer's window, sent by a pacing thread that is the receiver's only user.

    Args:
        pacer: the window, the sub-batch size and the per-server credit.
    """

    def __init__(self, pacer: Pacer) -> None:
        self.pacer = pacer
        self._feed: Feed | None = None
        self._order = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._deferred: collections.deque[tuple[Callable[..., Any], tuple[Any, ...]]] = collections.deque()
        self.probed_rate = 0.0  # bytes/s of the fastest probe (one server's path), 0 before the probes

    # -- start: probes, then the thread ----------------------------------------------------------

    def start(self, feed: Feed, probe_timeout: float) -> None:
        self._feed = feed
        self._probe(feed, probe_timeout)
        self._thread = threading.Thread(target=self._run, args=(feed,), name=f"kspeed-pace-{feed.dataset}", daemon=True)
        self._thread.start()

    def _probe(self, feed: Feed, timeout: float) -> None:
        """Fill the pacer's latency tables: probe grants of each size class, one server at a time.

        A probe writes filler at the start of the still empty ring. A server that answers a probe
        with ERROR (one that predates probes) or not at all keeps no table; pacing then borrows the
        other servers' entries.
        """
        best_rate = 0.0
        sizes = [size for size in SIZE_CLASSES if size <= feed.allocator.capacity]
        for path in feed.paths:
            for index, size in enumerate(sizes):
                fastest = None
                for _ in range(PROBE_REPEAT):
                    seconds = self._probe_once(feed, path, size, timeout)
                    if seconds is None:
                        break
                    fastest = seconds if fastest is None else min(fastest, seconds)
                if fastest is None:
                    log.warning(
                        "dataset %s: %s did not answer latency probes; pacing uses the other servers' latencies for it",
                        feed.dataset,
                        path.link.name,
                    )
                    break
                self.pacer.tables[path.index].set(index, fastest)
                best_rate = max(best_rate, size / fastest)
        self.probed_rate = best_rate
        self.pacer.seed(best_rate)
        log.debug(
            "dataset %s: paced; probed latency %s, rate %.0f MB/s",
            feed.dataset,
            {k: f"{v * 1e3:.2f}ms" for k, v in self.pacer.stats()["latency"].items() if v is not None},
            best_rate / 1e6,
        )

    @staticmethod
    def _probe_once(feed: Feed, path: ServerPath, size: int, timeout: float) -> float | None:
        tag = feed.next_tag(path)
        started = time.monotonic()
        if path.conn is None:
            return None
        try:
            feed.receiver.send(path.conn, grants.encode_grants([grants.Grant(grants.PROBE_EPOCH, 0, 0, 0, size, tag)]))
        except PeerLostError as exc:
            raise UnavailableError(
                f"dataset {feed.dataset!r}: {path.link.name} left during latency probes: {exc}"
            ) from exc
        deadline = started + timeout
        while time.monotonic() < deadline:
            done = feed.receiver.poll(WAIT_TICK)
            now = time.monotonic()
            if tag in done.imm.tolist():
                return now - started
            for conn, message in feed.receiver.messages():
                decoded = grants.decode(message)
                if isinstance(decoded, grants.GrantError) and conn == path.conn and decoded.tag == tag:
                    return None
        return None

    # -- the feed's calls ------------------------------------------------------------------------

    def queue(self, feed: Feed, slot: GrantedBatch, owed: list[int]) -> None:
        """Split the batch into sub-batches and queue one grant per server and sub-batch it writes in."""
        plan, batch = slot.plan, slot.batch
        lo, hi = int(plan.layout.starts[batch]), int(plan.layout.starts[batch + 1])
        offsets, lengths, owner = plan.layout.offsets[lo:hi], plan.layout.lengths[lo:hi], plan.owner[lo:hi]
        cuts = self.pacer.split(offsets, lengths, len(owed))
        for first, end in itertools.pairwise(cuts):
            per_server = np.bincount(owner[first:end], weights=lengths[first:end], minlength=len(feed.paths))
            for index in owed:
                nbytes = int(per_server[index])
                if not nbytes and len(cuts) > 2:
                    continue  # a server writes nothing in this slice
                tag = feed.next_tag(feed.paths[index])
                self._order += 1
                grant = grants.Grant(plan.pass_of(batch), batch, slot.offset, first, end, tag)
                sub = SubGrant(index, self._order, grant, nbytes)
                feed.outstanding[tag] = Outstanding(slot, index, sub)
                slot.owed[index] = slot.owed.get(index, 0) + 1
                self.pacer.queue(sub)

    def flush(self) -> None:
        """Nothing to do: the pacing thread sends within a tick."""

    def wait_step(self, feed: Feed) -> None:
        feed.changed.wait(WAIT_TICK)

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        thread = self._thread
        if thread is not None and thread.is_alive() and threading.current_thread() is not thread:
            self._deferred.append((fn, args))
        else:
            with contextlib.suppress(KSpeedError):
                fn(*args)

    def completed(self, entry: Outstanding, now: float) -> None:
        if entry.sub is not None:
            self.pacer.complete(entry.sub, now)

    def held(self, held: grants.Held) -> None:
        self.pacer.held(held.tags, held.seconds)

    def dropped(self, path: int) -> None:
        self.pacer.drop(path)

    def stats(self) -> dict[str, Any]:
        return self.pacer.stats()

    def close(self) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    # -- the pacing thread -----------------------------------------------------------------------

    def _release(self, feed: Feed) -> None:
        """Send what the window and the credits allow now."""
        rows: dict[int, list[grants.Grant]] = {}
        for sub in self.pacer.release():
            rows.setdefault(sub.path, []).append(sub.grant)
            entry = feed.outstanding.get(sub.grant.tag)
            if entry is not None:  # the batch waited for the window until its last sub-batch left
                entry.slot.sent_at = max(entry.slot.sent_at, sub.sent_at)
        for index, batch in rows.items():
            feed.send_grants(feed.paths[index], batch)

    def _run(self, feed: Feed) -> None:
        """Take in completions, send the next sub-batches, wake waiters.

        It alone calls the receiver; it waits for completions without the lock, so the training
        thread can grant meanwhile, and waits longer once it has had nothing to do for a while.
        """
        active = time.monotonic()
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if self.pacer.backlog or self._deferred:
                    active = now
                lost: PeerLostError | None = None
                try:
                    done = feed.receiver.poll(PACE_TICK if now - active < 0.1 else IDLE_TICK)
                except PeerLostError as exc:
                    done, lost = Completions.empty(), exc
                with feed.lock:
                    while self._deferred:
                        fn, args = self._deferred.popleft()
                        with contextlib.suppress(KSpeedError):
                            fn(*args)
                    if lost is not None:
                        feed.lost(lost)
                    before = feed.progress
                    feed.accept(done)
                    feed.take_messages()
                    feed.tend()
                    self._release(feed)
                    if feed.progress != before:
                        feed.changed.notify_all()
        except Exception as exc:  # the thread's end: hand the failure to the training thread, named
            failure = exc if isinstance(exc, KSpeedError) else None
            if failure is None:
                log.exception("dataset %s: the pacing thread failed", feed.dataset)
                failure = TransportError(f"dataset {feed.dataset!r}: the pacing thread failed: {exc!r}")
            with feed.lock:
                self.failure = failure
                feed.changed.notify_all()
