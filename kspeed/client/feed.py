"""One feed: the receive ring, a data-plane path per server, grants, completions and fencing.

Implements the client side of docs/feeding.md. The ring is registered with one rail; each server
gets ``OpenFeed`` with the ring's key and the path's generation and answers with ``HELLO`` on the
message channel. A granted batch (a :class:`Slot`) owes one completion per grant: one per server
that writes something in it, or one per sub-batch when paced; the completion's immediate is the
grant's tag (generation | sequence number).

Fencing (:meth:`Feed.fence`) cuts a server's path, bumps its generation and quarantines the ring
ranges of its outstanding grants, since an ``shm`` writer keeps its mapping; completions that
still arrive under the old generation are ignored and counted.

Unpaced, nothing here runs a thread: the owner calls :meth:`Feed.poll` from the training loop (the
servers keep writing meanwhile, since the whole ring is granted). Paced
(:mod:`kspeed.client.pacing`), only a window is granted at a time, so a pacing thread takes in
completions and sends the next sub-batches while the training loop computes; it is then the only
thread that polls the receiver, and every receiver call and all feed state are under one lock.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kspeed import grants
from kspeed.errors import (
    DatasetError,
    KSpeedError,
    PeerLostError,
    ProtocolError,
    TransportError,
    UnavailableError,
)
from kspeed.proto import kspeed_pb2
from kspeed.rdma.base import MAX_MESSAGE, Completions
from kspeed.rdma.options import RailOptions
from kspeed.rdma.rails import get_rail

from .pacing import SIZE_CLASSES, Pacer, SubGrant
from .plans import EpochPlan
from .ring import RingAllocator

__all__ = ["Feed", "Path", "Slot"]

log = logging.getLogger(__name__)

POLL_TICK = 0.05  # longest single wait for completions, so timeouts and top-ups are checked often
PACE_TICK = 0.001  # longest wait of the pacing thread for completions while it has work (or had it lately)
IDLE_TICK = 0.01  # longest wait of the pacing thread after a while without work
PROBE_REPEAT = 2  # probes per size class and server; the fastest counts
_SEQ_LIMIT = 1 << 24
_GRANTS_PER_MESSAGE = (MAX_MESSAGE - 1) // grants.GRANT_DTYPE.itemsize


@dataclass(eq=False)
class Path:
    """One server's data-plane path into the ring.

    Attributes:
        index: the server's position in the feed's server list (the plan's owner index).
        link: its control-plane link.
        reason: why this rail serves it (logged).
        generation: stamped into every tag; bumped by fencing.
        conn: the receiver's connection id of its feeder, once it said HELLO.
        lost: why the path was fenced ("" while healthy).
        last_heard: monotonic time of its last completion or message.
    """

    index: int
    link: Any
    reason: str
    generation: int = 1
    conn: int | None = None
    lost: str = ""
    last_heard: float = 0.0


@dataclass(eq=False)
class Slot:
    """A granted batch: where it lies in the ring and which completions it still waits for."""

    plan: EpochPlan
    batch: int
    offset: int
    owed: dict[int, int]  # server index -> completions still owed (one per sub-batch it writes in)
    granted_at: float
    discarded: bool = False
    fenced: bool = False
    error: str = ""
    errors_from: list[str] = field(default_factory=list)
    settled: bool = False

    @property
    def done(self) -> bool:
        return not self.owed


class Feed:
    """The receive ring of one dataset and its paths to every server.

    Args:
        dataset: the dataset's name.
        feed_id: this feed's id (unique per rank and dataset).
        links: the dataset's servers, in plan-owner order.
        rail: the ring's rail.
        reasons: per server id, why that rail (logged once here).
        ring_bytes: ring size.
        options: rail options (token, timeouts, tcp bind address).
        completion_timeout: longest silence of a server that owes a completion.
        holder: names the job and rank in the servers' logs.
        pacer: paces the grants (probed here, then driven by a pacing thread); ``None``: unpaced.

    Raises:
        RailUnavailableError, CapacityError: the ring cannot be set up.
        UnavailableError: a server is unreachable or its feeder did not connect (named).
    """

    def __init__(
        self,
        *,
        dataset: str,
        feed_id: str,
        links: Sequence[Any],
        rail: str,
        reasons: dict[str, str],
        ring_bytes: int,
        options: RailOptions,
        completion_timeout: float,
        holder: str,
        pacer: Pacer | None = None,
    ) -> None:
        self.dataset = dataset
        self.feed_id = feed_id
        self.rail = rail
        self.completion_timeout = completion_timeout
        self._holder = holder
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._deferred: collections.deque[tuple[Callable, tuple]] = collections.deque()
        self._failure: KSpeedError | None = None
        self._progress = 0  # bumped by every completion, error and fence (waiters wake on a change)
        self.pacer = pacer
        self._receiver = get_rail(rail).listen(options)
        try:
            self._region = self._receiver.register(ring_bytes)
        except KSpeedError:
            self._receiver.close()
            raise
        self.ring = self._region.array()
        self.allocator = RingAllocator(ring_bytes)
        self.paths = [Path(i, link, reasons.get(link.server_id, "")) for i, link in enumerate(links)]
        self._by_conn: dict[int, Path] = {}
        self._outstanding: dict[int, tuple[Slot, int, SubGrant | None]] = {}
        self._queued: dict[int, list[tuple]] = {}
        self._seq = 0
        self._order = 0
        self.counters = {"grants": 0, "completions": 0, "stale_completions": 0, "fenced_grants": 0, "server_errors": 0}
        for path in self.paths:
            log.info("dataset %s: %s fed over %s: %s", dataset, path.link.name, rail, path.reason)
        try:
            self._open_all(max(options.connect_timeout, 5.0) * 2)
            if pacer is not None:
                self._probe(max(options.connect_timeout, 5.0))
                self._thread = threading.Thread(target=self._pace, name=f"kspeed-pace-{dataset}", daemon=True)
                self._thread.start()
        except KSpeedError:
            self.close()
            raise

    # -- setup -----------------------------------------------------------------------------------

    def _open_all(self, hello_timeout: float) -> None:
        for path in self.paths:
            self._open(path)
        deadline = time.monotonic() + hello_timeout
        while any(p.conn is None for p in self.paths):
            if time.monotonic() > deadline:
                silent = ", ".join(p.link.name for p in self.paths if p.conn is None)
                raise UnavailableError(
                    f"dataset {self.dataset!r}: the feeder of {silent} did not connect to the "
                    f"{self.rail} ring within {hello_timeout:.0f}s"
                )
            self.poll(POLL_TICK)

    def _open(self, path: Path) -> None:
        request = kspeed_pb2.OpenFeedRequest(
            dataset=self.dataset,
            feed_id=self.feed_id,
            rail=self.rail,
            material=self._receiver.material,
            ring_key=self._region.key.to_bytes(),
            generation=path.generation,
            holder=self._holder,
        )
        path.link.open_feed(request)
        path.last_heard = time.monotonic()

    def _probe(self, timeout: float) -> None:
        """Fill the pacer's latency tables: probe grants of each size class, one server at a time.

        A probe writes filler at the start of the still empty ring. A server that answers a probe
        with ERROR (one that predates probes) or not at all keeps no table; pacing then borrows the
        other servers' entries.
        """
        best_rate = 0.0
        sizes = [size for size in SIZE_CLASSES if size <= self.allocator.capacity]
        for path in self.paths:
            for index, size in enumerate(sizes):
                fastest = None
                for _ in range(PROBE_REPEAT):
                    seconds = self._probe_once(path, size, timeout)
                    if seconds is None:
                        break
                    fastest = seconds if fastest is None else min(fastest, seconds)
                if fastest is None:
                    log.warning(
                        "dataset %s: %s did not answer latency probes; pacing uses the other servers' latencies for it",
                        self.dataset,
                        path.link.name,
                    )
                    break
                self.pacer.tables[path.index].set(index, fastest)
                best_rate = max(best_rate, size / fastest)
        self.pacer.seed(best_rate)
        log.info(
            "dataset %s: paced; probed latency %s, rate %.0f MB/s",
            self.dataset,
            {k: f"{v * 1e3:.2f}ms" for k, v in self.pacer.stats()["latency"].items() if v is not None},
            best_rate / 1e6,
        )

    def _probe_once(self, path: Path, size: int, timeout: float) -> float | None:
        self._seq = self._seq % (_SEQ_LIMIT - 1) + 1
        tag = grants.make_tag(path.generation, self._seq)
        row = np.array([(grants.PROBE_EPOCH, 0, 0, 0, size, tag)], dtype=grants.GRANT_DTYPE)
        started = time.monotonic()
        try:
            self._receiver.send(path.conn, grants.encode_grants(row))
        except PeerLostError as exc:
            raise UnavailableError(
                f"dataset {self.dataset!r}: {path.link.name} left during latency probes: {exc}"
            ) from exc
        deadline = started + timeout
        while time.monotonic() < deadline:
            done = self._receiver.poll(POLL_TICK)
            now = time.monotonic()
            if tag in done.imm.tolist():
                return now - started
            for conn, message in self._receiver.messages():
                kind, payload = grants.decode(message)
                if kind == grants.ERROR and conn == path.conn and payload[2] == tag:
                    return None
        return None

    # -- grants ----------------------------------------------------------------------------------

    def _next_tag(self, path: Path) -> int:
        self._seq = self._seq % (_SEQ_LIMIT - 1) + 1
        return grants.make_tag(path.generation, self._seq)

    def grant(self, plan: EpochPlan, batch: int) -> Slot | None:
        """Reserve ring room for ``batch`` of ``plan`` and queue its grants; ``None`` when the ring is full.

        Call :meth:`flush` to send the queued grants (paced: to let the pacing thread send them).

        Raises:
            PeerLostError: a server that owes part of the batch was fenced (named, with why).
        """
        with self._lock:
            owed = np.flatnonzero(plan.owed[:, batch]).tolist()
            for index in owed:
                if self.paths[index].lost:
                    path = self.paths[index]
                    raise PeerLostError(
                        f"dataset {self.dataset!r}: batch {batch} of epoch {plan.epoch} needs "
                        f"{path.link.name}, whose path was cut ({path.lost}); reattach the dataset"
                    )
            offset = self.allocator.reserve(int(plan.layout.batch_bytes[batch]))
            if offset is None:
                return None
            now = time.monotonic()
            slot = Slot(plan, batch, offset, {}, now)
            if self.pacer is None:
                size = int(plan.layout.starts[batch + 1] - plan.layout.starts[batch])
                for index in owed:
                    tag = self._next_tag(self.paths[index])
                    self._outstanding[tag] = (slot, index, None)
                    self._queued.setdefault(index, []).append((plan.feed_epoch, batch, offset, 0, size, tag))
                    slot.owed[index] = 1
            else:
                self._queue_paced(slot, owed)
            for index in owed:
                path = self.paths[index]
                if path.last_heard < now - self.completion_timeout:
                    path.last_heard = now  # an idle path's silence started with this grant
            plan.slots += 1
            self.counters["grants"] += sum(slot.owed.values())
            return slot

    def _queue_paced(self, slot: Slot, owed: list[int]) -> None:
        """Split the batch into sub-batches and queue one grant per server and sub-batch it writes in."""
        plan, batch = slot.plan, slot.batch
        lo, hi = int(plan.layout.starts[batch]), int(plan.layout.starts[batch + 1])
        offsets, lengths, owner = plan.layout.offsets[lo:hi], plan.layout.lengths[lo:hi], plan.owner[lo:hi]
        cuts = self.pacer.split(offsets, lengths, len(owed))
        for first, end in itertools.pairwise(cuts):
            per_server = np.bincount(owner[first:end], weights=lengths[first:end], minlength=len(self.paths))
            for index in owed:
                nbytes = int(per_server[index])
                if not nbytes and len(cuts) > 2:
                    continue  # a server writes nothing in this slice
                tag = self._next_tag(self.paths[index])
                self._order += 1
                sub = SubGrant(index, self._order, (plan.feed_epoch, batch, slot.offset, first, end, tag), nbytes)
                self._outstanding[tag] = (slot, index, sub)
                slot.owed[index] = slot.owed.get(index, 0) + 1
                self.pacer.queue(sub)

    def flush(self) -> None:
        """Send the queued grants, several per message (paced: wake the pacing thread)."""
        if self.pacer is not None:
            return  # the pacing thread sends within a tick
        with self._lock:
            queued, self._queued = self._queued, {}
            for index, rows in queued.items():
                self._send_rows(self.paths[index], rows)

    def _send_rows(self, path: Path, rows: list[tuple]) -> None:
        if path.lost or path.conn is None:
            return
        array = np.array(rows, dtype=grants.GRANT_DTYPE)
        try:
            for start in range(0, len(array), _GRANTS_PER_MESSAGE):
                self._receiver.send(path.conn, grants.encode_grants(array[start : start + _GRANTS_PER_MESSAGE]))
        except PeerLostError as exc:
            self.fence(path.link.server_id, f"sending grants failed: {exc}")

    def _release(self) -> None:
        """Paced: send what the window and the credits allow now."""
        rows: dict[int, list[tuple]] = {}
        for sub in self.pacer.release():
            rows.setdefault(sub.path, []).append(sub.row)
        for index, batch in rows.items():
            self._send_rows(self.paths[index], batch)

    def discard(self, slot: Slot) -> None:
        """The batch will not be delivered; its range is released once every owed completion is in."""
        with self._lock:
            slot.discarded = True
            self._settle(slot)

    def drop_plan(self, plan: EpochPlan) -> None:
        """Tell every server the plan will not be granted again."""
        message = grants.encode_drop_plan(plan.feed_epoch)
        with self._lock:
            for path in self.paths:
                if path.conn is not None and not path.lost:
                    self._io(self._receiver.send, path.conn, message)

    def _io(self, fn: Callable, *args: Any) -> None:
        """Call the receiver, or have the pacing thread call it (paced, it is the receiver's only user)."""
        if self._thread is not None and self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._deferred.append((fn, args))
        else:
            with contextlib.suppress(KSpeedError):
                fn(*args)

    # -- completions -----------------------------------------------------------------------------

    def poll(self, timeout: float = 0.0) -> None:
        """Take in completions and messages; a lost path is fenced (its batches then fail, named)."""
        with self._lock:
            try:
                done = self._receiver.poll(timeout)
            except PeerLostError as exc:
                self._lost(exc)
                done = Completions.empty()
            self.accept(done)
            self._messages()

    def _lost(self, exc: PeerLostError) -> None:
        """A connection failed: fence its server (a connection already cut is ignored)."""
        conn = getattr(exc, "conn", None)
        path = self._by_conn.get(conn) if conn is not None else None
        if path is None:
            if conn is not None:
                return
            raise PeerLostError(f"dataset {self.dataset!r}: the {self.rail} receiver failed: {exc}") from exc
        self.fence(path.link.server_id, str(exc))

    def _pace(self) -> None:
        """The pacing thread: take in completions, send the next sub-batches, wake waiters.

        It alone calls the receiver; it waits for completions without the lock, so the training
        thread can grant meanwhile, and waits longer once it has had nothing to do for a while.
        """
        active = time.monotonic()
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if self.pacer.backlog or self._deferred:
                    active = now
                try:
                    done, lost = self._receiver.poll(PACE_TICK if now - active < 0.1 else IDLE_TICK), None
                except PeerLostError as exc:
                    done, lost = Completions.empty(), exc
                with self._lock:
                    while self._deferred:
                        fn, args = self._deferred.popleft()
                        with contextlib.suppress(KSpeedError):
                            fn(*args)
                    if lost is not None:
                        self._lost(lost)
                    before = self._progress
                    self.accept(done)
                    self._messages()
                    self._release()
                    if self._progress != before:
                        self._changed.notify_all()
        except Exception as exc:  # the thread's end: hand the failure to the training thread, named
            if not isinstance(exc, KSpeedError):
                log.exception("dataset %s: the pacing thread failed", self.dataset)
                exc = TransportError(f"dataset {self.dataset!r}: the pacing thread failed: {exc!r}")
            with self._lock:
                self._failure = exc
                self._changed.notify_all()

    def accept(self, done: Completions) -> None:
        """Count completions against their grants; old generations and unknown tags are ignored."""
        if not len(done):
            return
        with self._lock:
            now = time.monotonic()
            for imm, conn in zip(done.imm.tolist(), done.conn.tolist()):
                path = self._by_conn.get(conn)
                entry = self._outstanding.get(imm) if path is not None else None
                if entry is None or grants.tag_generation(imm) != path.generation or entry[1] != path.index:
                    self.counters["stale_completions"] += 1
                    continue
                del self._outstanding[imm]
                slot, index, sub = entry
                if sub is not None:
                    self.pacer.complete(sub, now)
                path.last_heard = now
                self.counters["completions"] += 1
                self._progress += 1
                self._owed_one(slot, index)

    @staticmethod
    def _owed_one(slot: Slot, index: int) -> None:
        left = slot.owed.get(index, 0) - 1
        if left > 0:
            slot.owed[index] = left
        else:
            slot.owed.pop(index, None)

    def _messages(self) -> None:
        for conn, message in self._receiver.messages():
            try:
                kind, payload = grants.decode(message)
            except ProtocolError as exc:
                log.warning("dataset %s: ignoring a malformed feed message: %s", self.dataset, exc)
                continue
            if kind == grants.HELLO:
                self._hello(conn, payload)
            elif kind == grants.ERROR:
                self._error(conn, *payload)

    def _hello(self, conn: int, hello: dict) -> None:
        path = next((p for p in self.paths if p.link.server_id == hello.get("server")), None)
        if path is None or hello.get("feed") != self.feed_id or hello.get("generation") != path.generation:
            log.warning("dataset %s: ignoring HELLO %s on connection %d (stale or not ours)", self.dataset, hello, conn)
            with contextlib.suppress(KSpeedError):
                self._receiver.disconnect(conn)
            return
        path.conn = conn
        path.last_heard = time.monotonic()
        self._by_conn[conn] = path

    def _error(self, conn: int, epoch: int, batch: int, tag: int, text: str) -> None:
        path = self._by_conn.get(conn)
        entry = self._outstanding.pop(tag, None) if path is not None else None
        if entry is None:
            self.counters["stale_completions"] += 1
            return
        slot, index, sub = entry
        if sub is not None:
            self.pacer.complete(sub)
        self.counters["server_errors"] += 1
        self._progress += 1
        slot.error = slot.error or text
        slot.errors_from.append(path.link.name)
        self._owed_one(slot, index)
        self._settle(slot)

    def _settle(self, slot: Slot) -> None:
        if slot.discarded and not slot.settled and (slot.done or slot.fenced):
            if not slot.fenced:  # a fenced range stays quarantined
                self.allocator.release(slot.offset)
            slot.plan.slots -= 1
            slot.settled = True

    def wait(self, slot: Slot, tick: Callable[[], None]) -> None:
        """Wait until ``slot`` is complete, calling ``tick`` between checks (to top up grants).

        Unpaced this thread polls the receiver; paced it waits for the pacing thread.

        Raises:
            DatasetError: a server answered a grant of the batch with ERROR (batch and reason named).
            PeerLostError: a server that owes the batch was cut off.
            TransportError: a server that owes the batch stayed silent beyond ``completion_timeout``.
        """
        while True:
            with self._lock:
                self._check(slot)
                if slot.done:
                    return
                if self._thread is not None:
                    self._changed.wait(POLL_TICK)
                    self._check(slot)
                    if slot.done:
                        return
                else:
                    self.poll(POLL_TICK)
            tick()

    def _check(self, slot: Slot) -> None:
        """Raise what keeps ``slot`` from completing: a server's error, a cut path or a silent server."""
        if self._failure is not None:
            raise self._failure
        if slot.error:
            self.discard(slot)
            raise DatasetError(
                f"dataset {self.dataset!r}: batch {slot.batch} of epoch {slot.plan.epoch} failed "
                f"on {', '.join(slot.errors_from)}: {slot.error}",
                dataset=self.dataset,
            )
        if slot.fenced:
            lost = [p for p in self.paths if p.lost and slot.plan.owed[p.index, slot.batch]]
            names = "; ".join(f"{p.link.name} ({p.lost})" for p in lost) or "a fenced server"
            raise PeerLostError(
                f"dataset {self.dataset!r}: batch {slot.batch} of epoch {slot.plan.epoch} was cut off: {names}"
            )
        now = time.monotonic()
        for index in slot.owed:
            path = self.paths[index]
            silent = now - max(slot.granted_at, path.last_heard)
            if silent > self.completion_timeout:
                raise TransportError(
                    f"dataset {self.dataset!r}: {path.link.name} sent no completion for batch "
                    f"{slot.batch} of epoch {slot.plan.epoch} in {silent:.1f}s "
                    f"(completion_timeout {self.completion_timeout:g}s)"
                )

    # -- fencing ---------------------------------------------------------------------------------

    def fence(self, server_id: str, reason: str = "fenced by the client") -> int:
        """Cut ``server_id``'s path, bump its generation and quarantine its outstanding ranges.

        Returns:
            the number of grants that were outstanding (sent or queued) on the path.

        Raises:
            KeyError: no such server in this feed.
        """
        with self._lock:
            path = next(p for p in self.paths if p.link.server_id == server_id)
            if path.conn is not None:
                self._by_conn.pop(path.conn, None)
                self._io(self._receiver.disconnect, path.conn)
            path.conn = None
            path.generation = path.generation % grants.MAX_GENERATION + 1
            path.lost = reason
            if self.pacer is not None:
                self.pacer.drop(path.index)
            cut = [tag for tag, (_, index, _) in self._outstanding.items() if index == path.index]
            for tag in cut:
                slot, _, _ = self._outstanding.pop(tag)
                if not slot.fenced:
                    self.allocator.quarantine(slot.offset)
                slot.fenced = True
                self._settle(slot)
            self.counters["fenced_grants"] += len(cut)
            self._progress += 1
            self._changed.notify_all()
        log.warning(
            "dataset %s: fenced %s (%s): generation now %d, %d grant(s) quarantined",
            self.dataset,
            path.link.name,
            reason,
            path.generation,
            len(cut),
        )
        return len(cut)

    # -- teardown --------------------------------------------------------------------------------

    @property
    def helper_pids(self) -> tuple[int, ...]:
        """Processes doing the ring's I/O (the tcp receiver process), for pinning."""
        return self._receiver.helper_pids

    def stats(self) -> dict[str, Any]:
        """Counters of grants, completions, stale completions, fencing and ring use; ``pacing`` when paced."""
        with self._lock:
            out: dict[str, Any] = {
                **self.counters,
                "ring_bytes": self.allocator.capacity,
                "ring_used": self.allocator.used,
                "ring_quarantined": self.allocator.quarantined,
                "outstanding": len(self._outstanding),
            }
            out["pacing"] = self.pacer.stats() if self.pacer is not None else None
            return out

    def close(self) -> None:
        """Stop the pacing thread, release the ring, then close the feed on every server (best effort).

        Cutting the data-plane connections first lets each feeder notice at once instead of at
        its next receive timeout, so ``CloseFeed`` returns without waiting.
        """
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        with self._lock:
            self._receiver.close()
        for path in self.paths:
            try:
                path.link.close_feed(self.feed_id)
            except KSpeedError as exc:
                log.debug("dataset %s: closing the feed on %s: %s", self.dataset, path.link.name, exc)
