"""One feed: the receive ring, a data-plane path per server, grants, completions and fencing.

Implements the client side of docs/feeding.md. The ring is registered with one rail; each server
gets ``OpenFeed`` with the ring's key and the path's generation and answers with ``HELLO`` on the
message channel. A granted batch (a :class:`GrantedBatch`) owes one completion per grant: one per server
that writes something in it, or one per sub-batch when paced; the completion's immediate is the
grant's tag (generation | sequence number).

How grants reach the servers is the feed's :class:`~kspeed.client.feeding.granting.Granting`: all at
once (:class:`~kspeed.client.feeding.granting.Unpaced`, where nothing here runs a thread and the owner
calls :meth:`Feed.poll` from the training loop) or within a window by a pacing thread
(:class:`~kspeed.client.feeding.granting.Paced`). Every receiver call and all feed state are under one
lock.

Fencing (:meth:`Feed.fence`) cuts a server's path, bumps its generation and quarantines the ring
ranges of its outstanding grants until the rail says the cut writer can write no more (revoked, or
its process gone or no longer mapping the ring); completions that still arrive under the old
generation are ignored and counted. :meth:`Feed.replace` gives a fenced path a new server (the one
its share moved to) and connects it under the new generation.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from kspeed import grants
from kspeed.client.delivery.ring import RingAllocator
from kspeed.client.feeding.feed_state import GrantedBatch, ServerPath
from kspeed.client.feeding.granting import Granting, Outstanding
from kspeed.client.feeding.links import Link
from kspeed.client.planning.plans import EpochPlan
from kspeed.errors import (
    DatasetError,
    KSpeedError,
    PeerLostError,
    ProtocolError,
    StateError,
    UnavailableError,
)
from kspeed.proto import kspeed_pb2
from kspeed.rdma.base import MAX_MESSAGE, Completions, Receiver
from kspeed.rdma.device_memory import DeviceMemory
from kspeed.rdma.options import RailOptions
from kspeed.rdma.rails import get_rail

__all__ = ["POLL_TICK", "Feed", "GrantedBatch", "ServerPath"]

log = logging.getLogger(__name__)

POLL_TICK = 0.05  # longest single wait for completions, so timeouts and top-ups are checked often
REVOKED_CHECK_S = 0.5  # how often quarantined ranges are checked for writers that are gone
_SEQ_LIMIT = 1 << 24
_GRANTS_PER_MESSAGE = (MAX_MESSAGE - 1) // grants.GRANT_DTYPE.itemsize


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
        granting: how grants reach the servers (paced or not); started once every server connected.
        ranks: the job's ranks (0: not known), told to the servers so a streamed share keeps each
            rank's part of its window before that rank's feed opens.
        device_memory: GPU memory to receive into (a device ring, GPUDirect RDMA) instead of a host
            ring of ``ring_bytes``; the receiver frees it when it closes. :attr:`ring` is then ``None``.
        job: the job's name, told to the servers (their preprocessing workers are shared by job).

    Raises:
        RailUnavailableError, CapacityError: the ring cannot be set up.
        UnavailableError: a server is unreachable or its feeder did not connect (named).
    """

    def __init__(
        self,
        *,
        dataset: str,
        feed_id: str,
        links: Sequence[Link],
        rail: str,
        reasons: dict[str, str],
        ring_bytes: int,
        options: RailOptions,
        completion_timeout: float,
        holder: str,
        granting: Granting,
        ranks: int = 0,
        device_memory: DeviceMemory | None = None,
        job: str = "",
        group: Mapping[str, object] | None = None,
    ) -> None:
        self.dataset = dataset
        self.group = dict(group or {})  # OpenFeedRequest fields naming the job's group (feeding/membership.py)
        self.feed_id = feed_id
        self.rail = rail
        self.completion_timeout = completion_timeout
        self._holder = holder
        self._ranks = ranks
        self._job = job
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.progress = 0  # bumped by every completion, error and fence (waiters wake on a change)
        self.ended = ""  # why a server ended the feed for good (e.g. the dataset was removed)
        self.granting = granting
        self.receiver: Receiver = get_rail(rail).listen(options)
        try:
            if device_memory is not None:
                self._region = self.receiver.register_device(device_memory)
            else:
                self._region = self.receiver.register(ring_bytes)
        except KSpeedError:
            self.receiver.close()
            raise
        #: the host ring's bytes (``None`` for a device ring: the delivery views it on the device)
        self.ring: np.ndarray | None = self._region.array() if device_memory is None else None
        self.allocator = RingAllocator(ring_bytes)
        self.paths: list[ServerPath] = []
        for i, link in enumerate(links):
            self.paths.append(ServerPath(i, link, reasons.get(link.server_id, "")))
            self.paths[i].feed_id = self.feed_id_for(i, link.server_id)
        self._by_conn: dict[int, ServerPath] = {}
        #: per path: seconds its grants waited at the server for production (its HELDs), and seconds
        #: from grant to completion, since the feed opened (the attribution's production/link split)
        self.held_s = [0.0] * len(self.paths)
        self.latency_s = [0.0] * len(self.paths)
        self.outstanding: dict[int, Outstanding] = {}
        self._seq = 0
        self._fenced: list[tuple[GrantedBatch, int | None]] = []  # quarantined slots and the connection cut from them
        self._revoked_at = 0.0
        self.counters = {
            "grants": 0,
            "completions": 0,
            "stale_completions": 0,
            "fenced_grants": 0,
            "server_errors": 0,
            "replaced_servers": 0,
        }
        for path in self.paths:
            log.debug("dataset %s: %s fed over %s: %s", dataset, path.link.name, rail, path.reason)
        try:
            self._open_all(max(options.connect_timeout, 5.0) * 2)
            granting.start(self, max(options.connect_timeout, 5.0))
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

    def feed_id_for(self, index: int, server_id: str) -> str:
        """The feed's id for path ``index`` on ``server_id``: the feed's own, unless another path
        of it leads there (a server holding two of the dataset's shares after a failover)."""
        shared = any(p.index != index and p.link.server_id == server_id for p in self.paths)
        return f"{self.feed_id}.p{index}" if shared else self.feed_id

    def _open(self, path: ServerPath) -> None:
        request = kspeed_pb2.OpenFeedRequest(
            dataset=self.dataset,
            feed_id=path.feed_id,
            rail=self.rail,
            material=self.receiver.material,
            ring_key=self._region.key.to_bytes(),
            generation=path.generation,
            holder=self._holder,
            ranks=self._ranks,
            job=self._job,
            **self.group,  # type: ignore[arg-type]
        )
        path.link.open_feed(request)
        path.last_heard = time.monotonic()

    # -- grants ----------------------------------------------------------------------------------

    def next_tag(self, path: ServerPath) -> int:
        """A fresh tag for a grant on ``path`` (its generation and the next sequence number)."""
        self._seq = self._seq % (_SEQ_LIMIT - 1) + 1
        return grants.make_tag(path.generation, self._seq)

    def grant(self, plan: EpochPlan, batch: int) -> GrantedBatch | None:
        """Reserve ring room for ``batch`` of ``plan`` and queue its grants; ``None`` when the ring is full.

        Call :meth:`flush` to send the queued grants (paced: the pacing thread sends them).

        Raises:
            DatasetError: a server ended the feed for good (its dataset was removed, named).
            PeerLostError: a server that owes part of the batch was fenced (named, with why).
        """
        with self.lock:
            if self.ended:
                raise DatasetError(self._ended_text(), dataset=self.dataset)
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
            slot = GrantedBatch(plan, batch, offset, {}, now, now)
            self.granting.queue(self, slot, owed)
            for index in owed:
                path = self.paths[index]
                if path.last_heard < now - self.completion_timeout:
                    path.last_heard = now  # an idle path's silence started with this grant
            plan.slots += 1
            self.counters["grants"] += sum(slot.owed.values())
            return slot

    def flush(self) -> None:
        """Send the queued grants (paced: the pacing thread sends within a tick)."""
        self.granting.flush()

    def send_grants(self, path: ServerPath, rows: Sequence[grants.Grant]) -> None:
        """Send grants to one server, several per message; a failed send fences it."""
        if path.lost or path.conn is None:
            return
        try:
            for start in range(0, len(rows), _GRANTS_PER_MESSAGE):
                self.receiver.send(path.conn, grants.encode_grants(rows[start : start + _GRANTS_PER_MESSAGE]))
        except PeerLostError as exc:
            self.take_messages()  # a server that ends the feed says why before it goes
            self.fence_path(path, f"sending grants failed: {exc}")

    def discard(self, slot: GrantedBatch) -> None:
        """The batch will not be delivered; its range is released once every owed completion is in."""
        with self.lock:
            slot.discarded = True
            self._settle(slot)

    def drop_plan(self, feed_epoch: int) -> None:
        """Tell every server the plan of pass ``feed_epoch`` will not be granted again."""
        message = grants.encode_drop_plan(feed_epoch)
        with self.lock:
            for path in self.paths:
                if path.conn is not None and not path.lost:
                    self.granting.call(self.receiver.send, path.conn, message)

    def truncate_plan(self, feed_epoch: int, batch: int) -> None:
        """Tell every server the plan of pass ``feed_epoch`` will not be granted from ``batch`` on
        (its rest was committed as a new pass); the batches before it that were granted are still
        served."""
        message = grants.encode_truncate_plan(feed_epoch, batch)
        with self.lock:
            for path in self.paths:
                if path.conn is not None and not path.lost:
                    self.granting.call(self.receiver.send, path.conn, message)

    # -- completions -----------------------------------------------------------------------------

    def poll(self, timeout: float = 0.0) -> None:
        """Take in completions and messages; a lost path is fenced (its batches then fail, named)."""
        with self.lock:
            try:
                done = self.receiver.poll(timeout)
            except PeerLostError as exc:
                self.lost(exc)
                done = Completions.empty()
            self.take_messages()  # first: a HELD sent before its grant's write is counted with its completion
            self.accept(done)
            self.tend()

    def tend(self) -> None:
        """At most every :data:`REVOKED_CHECK_S`: fence the paths whose server closed the feed,
        and lift the quarantines whose writer is gone. Called by the receiver's user (lock held)."""
        if time.monotonic() - self._revoked_at > REVOKED_CHECK_S:
            self._check_closed()
            self.release_revoked()

    def _check_closed(self) -> None:
        """Fence the paths whose server closed the connection on purpose (it said bye: its share
        is served elsewhere now, or it dropped the feed): they will write nothing more."""
        live = self.receiver.connections
        for path in self.paths:
            if path.conn is not None and not path.lost and path.conn not in live:
                self.fence_path(path, "its server closed the feed (the share is served elsewhere now?)")

    def release_revoked(self) -> int:
        """Lift the quarantine of fenced ranges whose writer can write no more; returns how many."""
        with self.lock:
            self._revoked_at = time.monotonic()
            keep: list[tuple[GrantedBatch, int | None]] = []
            for slot, conn in self._fenced:
                if conn is not None and not self.receiver.writer_gone(conn):
                    keep.append((slot, conn))
                    continue
                self.allocator.unquarantine(slot.offset)
                if slot.settled:
                    self.allocator.release(slot.offset)
            lifted = len(self._fenced) - len(keep)
            self._fenced = keep
            return lifted

    def lost(self, exc: PeerLostError) -> None:
        """A connection failed: fence its server (a connection already cut is ignored)."""
        conn = exc.conn
        path = self._by_conn.get(conn) if conn is not None else None
        if path is None:
            if conn is not None:
                return
            raise PeerLostError(f"dataset {self.dataset!r}: the {self.rail} receiver failed: {exc}") from exc
        self.take_messages()  # a server that ends the feed says why before it goes
        if not path.lost:
            self.fence_path(path, str(exc))

    def accept(self, done: Completions) -> None:
        """Count completions against their grants; old generations and unknown tags are ignored."""
        if not len(done):
            return
        with self.lock:
            now = time.monotonic()
            for imm, conn in zip(done.imm.tolist(), done.conn.tolist()):
                path = self._by_conn.get(conn)
                entry = self.outstanding.get(imm) if path is not None else None
                if (
                    path is None
                    or entry is None
                    or grants.tag_generation(imm) != path.generation
                    or entry.path != path.index
                ):
                    self.counters["stale_completions"] += 1
                    continue
                del self.outstanding[imm]
                self.granting.completed(entry, now)
                path.last_heard = now
                self.counters["completions"] += 1
                self.progress += 1
                self.latency_s[path.index] += now - (
                    entry.sub.sent_at if entry.sub is not None else entry.slot.granted_at
                )
                self._owed_one(entry.slot, entry.path, now)
                self._settle(entry.slot)  # a batch given up is released with its last completion

    @staticmethod
    def _owed_one(slot: GrantedBatch, index: int, now: float) -> None:
        left = slot.owed.get(index, 0) - 1
        if left > 0:
            slot.owed[index] = left
        else:
            slot.owed.pop(index, None)
            slot.finished[index] = now

    def take_messages(self) -> None:
        """Handle the HELLOs, ERRORs, CLOSINGs and HELDs that arrived."""
        for conn, message in self.receiver.messages():
            try:
                decoded = grants.decode(message)
            except ProtocolError as exc:
                log.warning("dataset %s: ignoring a malformed feed message: %s", self.dataset, exc)
                continue
            if isinstance(decoded, grants.Hello):
                self._hello(conn, decoded)
            elif isinstance(decoded, grants.GrantError):
                self._error(conn, decoded)
            elif isinstance(decoded, grants.Closing):
                self._closing(conn, decoded.reason)
            elif isinstance(decoded, grants.Held):
                path = self._by_conn.get(conn)
                if path is not None:
                    self.held_s[path.index] += float(decoded.seconds.sum())
                self.granting.held(decoded)

    def _hello(self, conn: int, hello: grants.Hello) -> None:
        path = next((p for p in self.paths if p.link.server_id == hello.server and p.feed_id == hello.feed), None)
        if path is None or hello.generation != path.generation:
            log.warning("dataset %s: ignoring %s on connection %d (stale or not ours)", self.dataset, hello, conn)
            self.granting.call(self.receiver.disconnect, conn)
            return
        path.conn = conn
        path.last_heard = time.monotonic()
        self._by_conn[conn] = path

    def _ended_text(self) -> str:
        return self.ended if repr(self.dataset) in self.ended else f"dataset {self.dataset!r}: {self.ended}"

    def _closing(self, conn: int, reason: str) -> None:
        """A server ends the feed for good (its dataset was removed): every later batch fails, naming why.

        Taken even when the connection was already cut: the reason says more than the cut did.
        """
        self.ended = self.ended or reason
        path = self._by_conn.get(conn)
        log.error("dataset %s: %s ended the feed: %s", self.dataset, path.link.name if path else "a server", reason)
        if path is not None:
            self.fence_path(path, reason)

    def _error(self, conn: int, error: grants.GrantError) -> None:
        path = self._by_conn.get(conn)
        entry = self.outstanding.pop(error.tag, None) if path is not None else None
        if path is None or entry is None:
            self.counters["stale_completions"] += 1
            return
        now = time.monotonic()
        self.granting.completed(entry, now)
        self.counters["server_errors"] += 1
        self.progress += 1
        slot = entry.slot
        if not slot.error:
            slot.error = error.text
            slot.error_sample = error.sample if error.sample >= 0 else None
        slot.errors_from.append(path.link.name)
        self._owed_one(slot, entry.path, now)
        self._settle(slot)

    def _settle(self, slot: GrantedBatch) -> None:
        """Release a discarded slot's range once no server still owes a write in it (a fenced
        server owes none: its range waits in quarantine until its writer is gone)."""
        if slot.discarded and not slot.settled and slot.done:
            if not self.allocator.is_quarantined(slot.offset):  # else once its writer is gone
                self.allocator.release(slot.offset)
            slot.plan.slots -= 1
            slot.settled = True

    def wait(self, slot: GrantedBatch, tick: Callable[[], None]) -> None:
        """Wait until ``slot`` is complete, calling ``tick`` between checks (to top up grants).

        Raises:
            DatasetError: a server answered a grant of the batch with ERROR (batch and reason named).
            PeerLostError: a server that owes the batch was cut off, or stayed silent beyond
                ``completion_timeout`` (naming it in ``server_id``).
            TransportError: the pacing thread failed.
        """
        while True:
            with self.lock:
                self._check(slot)
                if slot.done:
                    return
                self.granting.wait_step(self)
                self._check(slot)
                if slot.done:
                    return
            tick()

    def _check(self, slot: GrantedBatch) -> None:
        """Raise what keeps ``slot`` from completing: a server's error, a cut path or a silent server."""
        failure = self.granting.failure
        if failure is not None:
            raise failure
        if self.ended:
            raise DatasetError(self._ended_text(), dataset=self.dataset)
        if slot.error:
            self.discard(slot)
            raise DatasetError(
                f"dataset {self.dataset!r}: batch {slot.batch} of epoch {slot.plan.epoch} failed "
                f"on {', '.join(slot.errors_from)}: {slot.error}",
                dataset=self.dataset,
                sample=slot.error_sample,
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
            if silent > self.completion_timeout:  # lost to us, whatever the manager says: failover reconnects
                why = (
                    f"dataset {self.dataset!r}: {path.link.name} sent no completion for batch "
                    f"{slot.batch} of epoch {slot.plan.epoch} in {silent:.1f}s "
                    f"(completion_timeout {self.completion_timeout:g}s)"
                )
                self.fence_path(path, why)  # only this path: another share on that server may be fine
                raise PeerLostError(why)

    # -- fencing ---------------------------------------------------------------------------------

    def fence(self, server_id: str, reason: str = "fenced by the client") -> int:
        """Fence every path to ``server_id`` (see :meth:`fence_path`); returns the grants cut.

        Raises:
            KeyError: no such server in this feed.
        """
        with self.lock:
            paths = [p for p in self.paths if p.link.server_id == server_id]
            if not paths:
                raise KeyError(server_id)
            return sum(self.fence_path(path, reason) for path in paths)

    def fence_path(self, path: ServerPath, reason: str = "fenced by the client") -> int:
        """Cut ``path``, bump its generation and quarantine its outstanding ranges.

        Returns:
            the number of grants that were outstanding (sent or queued) on the path.
        """
        with self.lock:
            cut_conn = path.conn
            if path.conn is not None:
                self._by_conn.pop(path.conn, None)
                self.granting.call(self.receiver.disconnect, path.conn)
            path.conn = None
            path.generation = path.generation % grants.MAX_GENERATION + 1
            path.lost = reason
            self.granting.dropped(path.index)
            cut = [tag for tag, entry in self.outstanding.items() if entry.path == path.index]
            for tag in cut:
                slot = self.outstanding.pop(tag).slot
                if not slot.fenced:
                    self.allocator.quarantine(slot.offset)
                    self._fenced.append((slot, cut_conn))
                slot.fenced = True
                slot.owed.pop(path.index, None)  # it owes nothing now; the others still may write
                self._settle(slot)
            self.counters["fenced_grants"] += len(cut)
            self.progress += 1
            self.changed.notify_all()
        log.warning(
            "dataset %s: fenced %s (%s): generation now %d, %d grant(s) quarantined",
            self.dataset,
            path.link.name,
            reason,
            path.generation,
            len(cut),
        )
        return len(cut)

    def replace(self, index: int, link: Link, hello_timeout: float) -> None:
        """Give fenced path ``index`` a new server (its share moved there, or its old server is
        back) and connect it under the path's new generation. On failure the path stays fenced,
        with its old server, under yet another generation (a late HELLO of the attempt is ignored).

        Raises:
            StateError: the path was not fenced.
            UnavailableError: the server cannot be asked, or its feeder did not connect in time.
        """
        with self.lock:
            path = self.paths[index]
            if not path.lost:
                raise StateError(f"dataset {self.dataset!r}: {path.link.name} was not fenced; nothing to replace")
            old, why, reason, feed_id = path.link, path.lost, path.reason, path.feed_id
            path.link, path.lost, path.conn = link, "", None
            path.reason = f"took over from {old.name}"
            path.feed_id = self.feed_id_for(index, link.server_id)
        try:
            self._open(path)
            deadline = time.monotonic() + hello_timeout
            with self.lock:
                while path.conn is None:  # its HELLO, taken in by whoever polls the receiver
                    if time.monotonic() > deadline:
                        raise UnavailableError(
                            f"dataset {self.dataset!r}: the feeder of {link.name} did not connect to the "
                            f"{self.rail} ring within {hello_timeout:.0f}s"
                        )
                    self.granting.wait_step(self)
        except KSpeedError:
            with self.lock:
                path.link, path.lost, path.reason, path.feed_id = old, why, reason, feed_id
                path.generation = path.generation % grants.MAX_GENERATION + 1
            raise
        with self.lock:
            self.counters["replaced_servers"] += 1
        if old is not link:
            old.close()
        log.warning("dataset %s: %s serves the share of %s now", self.dataset, link.name, old.name)

    # -- teardown --------------------------------------------------------------------------------

    @property
    def helper_pids(self) -> tuple[int, ...]:
        """Processes doing the ring's I/O (the tcp receiver process), for pinning."""
        return self.receiver.helper_pids

    def stats(self) -> dict[str, Any]:
        """Counters of grants, completions, stale completions, fencing and ring use; ``pacing`` when paced."""
        with self.lock:
            out: dict[str, Any] = {
                **self.counters,
                "ring_bytes": self.allocator.capacity,
                "ring_used": self.allocator.used,
                "ring_quarantined": self.allocator.quarantined,
                "outstanding": len(self.outstanding),
            }
            out["pacing"] = self.granting.stats()
            return out

    def close(self) -> None:
        """Stop the granting, release the ring, then close the feed on every server (best effort).

        Cutting the data-plane connections first lets each feeder notice at once instead of at
        its next receive timeout, so ``CloseFeed`` returns without waiting.
        """
        self.granting.close()
        with self.lock:
            self.receiver.close()
        for path in self.paths:
            try:
                path.link.close_feed(path.feed_id)
            except KSpeedError as exc:
                log.debug("dataset %s: closing the feed on %s: %s", self.dataset, path.link.name, exc)
