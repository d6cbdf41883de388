"""Membership: the servers of the cluster and the lifecycle of each.

Lifecycle (``kspeed.v1.ServerState``)::

    JOINING --probe ok--> READY --silent suspect_after / probes failing--> SUSPECT
       |                  ^  |  ^                                             |
       |                  |  |  +------------- heard again -------------------+
       |                  |  +--drain--> DRAINING --its shares held elsewhere, it deregisters--> LEFT
       +--silent fail_after--> FAILED <--silent fail_after-- SUSPECT, DRAINING
    live --deregister, pool kept--> STOPPED --restart_grace passes--> LEFT
    live --deregister, pool discarded--> LEFT
    FAILED/STOPPED/LEFT --register--> JOINING (new incarnation; a draining server goes on draining)

A clean stop that keeps the pool is a **restart** in the making: the manager leaves the server's
shares where they are for ``restart_grace``; the server that comes back within it re-adopts its
pool and nothing moves. Past the grace period (or at once when the pool was discarded) the server
has left and the catalog moves its shares, as it does for a failed one. A **drain** retires a
server while it still serves: the catalog hands each share to another server and lets it go once
the new holder has loaded it; the heartbeat reply then tells the server to retire.

A server in FAILED, STOPPED or LEFT must register again: its heartbeats are refused with
NotFoundError so that it does. Membership is driven by the manager's event loop (RPCs, the ticker,
the prober); a lock lets the HTTP thread read snapshots. Every change bumps ``revision`` and is
announced to listeners (the membership watch streams).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kspeed.control.lifecycle import state_name
from kspeed.errors import NotFoundError, ProtocolError, StateError
from kspeed.manager.store import Store
from kspeed.proto import kspeed_pb2

log = logging.getLogger(__name__)

State = kspeed_pb2.ServerState
JOINING, READY, SUSPECT, FAILED, LEFT, STOPPED, DRAINING = (
    State.SERVER_STATE_JOINING,
    State.SERVER_STATE_READY,
    State.SERVER_STATE_SUSPECT,
    State.SERVER_STATE_FAILED,
    State.SERVER_STATE_LEFT,
    State.SERVER_STATE_STOPPED,
    State.SERVER_STATE_DRAINING,
)
LIVE = (JOINING, READY, SUSPECT, DRAINING)
ALL_STATES = (JOINING, READY, SUSPECT, DRAINING, STOPPED, FAILED, LEFT)
PROBE_FAILURES_SUSPECT = 2  # consecutive failed probes that make a server suspect
#: What a server registers with and a heartbeat may not change: where clients reach it (the
#: hostname decides ``shm`` against ``tcp``), how its memory is carved, what it offers.
IDENTITY = ("hostname", "memory_bytes", "region_size", "transports")


__all__ = ["DRAINING", "FAILED", "JOINING", "LEFT", "LIVE", "READY", "STOPPED", "SUSPECT", "Membership", "Timers"]


@dataclass
class Timers:
    """Liveness thresholds in seconds; ``restart_grace``: how long a server stopped cleanly with
    its pool kept is waited for before it counts as gone."""

    heartbeat_interval: float
    suspect_after: float
    fail_after: float
    restart_grace: float = 0.0


@dataclass
class _Entry:
    record: kspeed_pb2.ServerRecord
    heard_at: float  # monotonic time of the last heartbeat (or of the manager's start)
    heard: bool = True  # False for a record restored at the manager's start, until it heartbeats
    probe_failures: int = 0
    probed_ok: bool = False
    dirty: bool = field(default=False)
    draining: bool = False  # an operator asked to drain it: healthy is DRAINING, not READY
    stopped_at: float = 0.0  # monotonic time of a clean stop that kept the pool


Listener = Callable[[kspeed_pb2.ServerRecord, int], None]


class Membership:
    """Membership of the cluster, persisted through a :class:`Store`."""

    def __init__(
        self,
        store: Store,
        timers: Timers,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._timers = timers
        self._clock = clock
        self._wall = wall
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._listeners: list[Listener] = []
        self.revision = 0
        now = clock()
        for record in store.servers():
            entry = _Entry(record=record, heard_at=now, heard=False, draining=record.state == DRAINING)
            # A server stopped for a restart gets the whole grace period again: the manager was away.
            entry.stopped_at = now
            if record.state in LIVE:
                # Soft state is gone: the server must prove itself again; its heartbeats will.
                record.state = SUSPECT
                record.state_reason = "manager restarted; awaiting heartbeat"
            self._entries[record.id] = entry
        if self._entries:
            log.info("membership restored %d server(s) from %s", len(self._entries), store.path)

    # -- reading -------------------------------------------------------------------------------

    def snapshot(self, include_left: bool = False) -> list[kspeed_pb2.ServerRecord]:
        """Copies of the records, sorted by id."""
        with self._lock:
            out = []
            for entry in sorted(self._entries.values(), key=lambda e: e.record.id):
                if include_left or entry.record.state != LEFT:
                    copy = kspeed_pb2.ServerRecord()
                    copy.CopyFrom(entry.record)
                    out.append(copy)
            return out

    def known(self) -> set[str]:
        """Ids of every server on record, whatever its state."""
        with self._lock:
            return set(self._entries)

    def counts(self) -> dict[str, int]:
        """Number of servers per state name."""
        with self._lock:
            counts = {state_name(s): 0 for s in ALL_STATES}
            for entry in self._entries.values():
                counts[state_name(entry.record.state)] += 1
            return counts

    def get(self, server_id: str) -> kspeed_pb2.ServerRecord:
        """A copy of one record.

        Raises:
            NotFoundError: for an unknown id.
        """
        with self._lock:
            entry = self._entries.get(server_id)
            if entry is None:
                raise NotFoundError(f"unknown server {server_id!r}")
            copy = kspeed_pb2.ServerRecord()
            copy.CopyFrom(entry.record)
            return copy

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(record, revision)`` after every change; returns the unsubscribe function."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    # -- changes -------------------------------------------------------------------------------

    def register(self, request: kspeed_pb2.RegisterServerRequest, protocol_version: int) -> kspeed_pb2.ServerRecord:
        """Add a server, or re-admit one with a new incarnation."""
        with self._lock:
            previous = self._entries.get(request.id)
            record = kspeed_pb2.ServerRecord(
                id=request.id,
                address=request.address,
                http_address=request.http_address,
                state=JOINING,
                inventory=request.inventory,
                registered_unix=self._wall(),
                last_heartbeat_unix=self._wall(),
                incarnation=(previous.record.incarnation + 1) if previous else 1,
                protocol_version=protocol_version,
                software_version=request.version.software_version,
                state_reason="registered; awaiting health probe",
            )
            # A drain outlives a restart of the server being drained (its shares are still to hand off).
            draining = previous is not None and previous.draining and previous.record.state != LEFT
            self._entries[request.id] = _Entry(record=record, heard_at=self._clock(), draining=draining)
            self._commit(record)
        log.info("server %s registered at %s (incarnation %d)", request.id, request.address, record.incarnation)
        return record

    def heartbeat(self, request: kspeed_pb2.HeartbeatRequest) -> kspeed_pb2.ServerRecord:
        """Record a heartbeat.

        Raises:
            NotFoundError: the manager does not know this server (or this incarnation of it), or it
                was declared failed or left: the server must register again.
            ProtocolError: the inventory changes what the server registered with (:data:`IDENTITY`).
        """
        with self._lock:
            entry = self._entries.get(request.id)
            if entry is None or entry.record.state not in LIVE:
                why = "unknown" if entry is None else state_name(entry.record.state)
                raise NotFoundError(f"server {request.id!r} is {why} here; register again")
            if request.incarnation != entry.record.incarnation:  # 0 is no wildcard: incarnations start at 1
                raise NotFoundError(
                    f"server {request.id!r}: incarnation {request.incarnation} is stale "
                    f"(current {entry.record.incarnation}); register again"
                )
            record = entry.record
            if request.HasField("inventory"):
                moved = [f for f in IDENTITY if getattr(request.inventory, f) != getattr(record.inventory, f)]
                if moved:
                    raise ProtocolError(
                        f"server {request.id!r}: a heartbeat may not change its {', '.join(moved)} "
                        "(what it registered with); register again"
                    )
            entry.heard_at, entry.heard = self._clock(), True
            record.last_heartbeat_unix = self._wall()
            changed = False
            if request.HasField("inventory") and request.inventory != record.inventory:
                record.inventory.CopyFrom(request.inventory)
                changed = True
            changed |= self._evaluate(entry)
            if changed:
                self._commit(record)
            else:
                entry.dirty = True
            copy = kspeed_pb2.ServerRecord()
            copy.CopyFrom(record)
            return copy

    def deregister(self, request: kspeed_pb2.DeregisterServerRequest) -> None:
        """Mark a server as stopped cleanly: STOPPED, waited for ``restart_grace``, when it kept its
        pool for a restart (and was not being drained); else LEFT at once.

        Raises:
            NotFoundError: for an unknown id.
            ProtocolError: for an incarnation that is not the current one.
        """
        with self._lock:
            entry = self._entries.get(request.id)
            if entry is None:
                raise NotFoundError(f"unknown server {request.id!r}")
            if request.incarnation != entry.record.incarnation:  # 0 is no wildcard
                raise ProtocolError(
                    f"server {request.id!r}: incarnation {request.incarnation} is not the "
                    f"current one ({entry.record.incarnation})"
                )
            reason = request.reason or "deregistered"
            if request.keep_pool and self._timers.restart_grace > 0 and not entry.draining:
                entry.stopped_at = self._clock()
                self._set_state(
                    entry,
                    STOPPED,
                    f"stopped cleanly ({reason}); its shares wait {self._timers.restart_grace:g}s for it to restart",
                )
            else:
                entry.draining = False
                self._set_state(entry, LEFT, reason)

    def drain(self, server_id: str) -> kspeed_pb2.ServerRecord:
        """Mark a live server as draining: it serves on while its shares are handed to others, and
        is never chosen to hold anything new.

        Raises:
            NotFoundError: for an unknown id.
            StateError: the server is not live (stopped, failed or left: its shares move anyway).
        """
        with self._lock:
            entry = self._entries.get(server_id)
            if entry is None:
                raise NotFoundError(f"unknown server {server_id!r}")
            if entry.record.state not in LIVE:
                raise StateError(
                    f"server {server_id!r} is {state_name(entry.record.state)}, not live: there is nothing to "
                    "drain (the shares of a server that is gone move on their own)"
                )
            entry.draining = True
            if entry.record.state in (JOINING, READY):
                self._set_state(
                    entry, DRAINING, "an operator asked to drain it; its shares are being handed to other servers"
                )
            copy = kspeed_pb2.ServerRecord()
            copy.CopyFrom(entry.record)
            return copy

    def draining(self, server_id: str) -> bool:
        """Whether an operator asked to drain this server (and it has not left)."""
        with self._lock:
            entry = self._entries.get(server_id)
            return entry is not None and entry.draining

    def probe_result(self, server_id: str, incarnation: int, ok: bool, detail: str = "") -> None:
        """Record the outcome of an active health probe."""
        with self._lock:
            entry = self._entries.get(server_id)
            if entry is None or entry.record.incarnation != incarnation or entry.record.state not in LIVE:
                return
            if ok:
                entry.probe_failures = 0
                entry.probed_ok = True
            else:
                entry.probe_failures += 1
                entry.record.state_reason = f"health probe failed: {detail}" if detail else "health probe failed"
            self._evaluate(entry)

    def tick(self) -> None:
        """Apply the timers to every live server and the restart grace to stopped ones; persist
        heartbeat times in one transaction."""
        with self._lock:
            for entry in self._entries.values():
                if entry.record.state == STOPPED:
                    waited = self._clock() - entry.stopped_at
                    if waited >= self._timers.restart_grace:
                        self._set_state(
                            entry, LEFT, f"stopped and not back within restart_grace ({waited:.1f}s); its shares move"
                        )
                elif entry.record.state in LIVE:
                    self._evaluate(entry)
            dirty = [e.record for e in self._entries.values() if e.dirty]  # (a change is saved as it is made)
            if dirty and self._store.keep(lambda: self._store.save_servers(dirty)):
                for record in dirty:  # else written at the next tick that has room
                    self._entries[record.id].dirty = False

    def probe_targets(self) -> list[tuple[str, str, int]]:
        """``(id, address, incarnation)`` of every live server."""
        with self._lock:
            return [
                (e.record.id, e.record.address, e.record.incarnation)
                for e in self._entries.values()
                if e.record.state in LIVE
            ]

    # -- internals (lock held) -----------------------------------------------------------------

    def _evaluate(self, entry: _Entry) -> bool:
        """Move a live server to the state its timers and probes say; True when it changed."""
        record = entry.record
        silent = self._clock() - entry.heard_at
        if silent >= self._timers.fail_after:
            return self._set_state(entry, FAILED, f"no heartbeat for {silent:.1f}s")
        if silent >= self._timers.suspect_after:
            return self._set_state(entry, SUSPECT, f"no heartbeat for {silent:.1f}s")
        if entry.probe_failures >= PROBE_FAILURES_SUSPECT:
            return self._set_state(entry, SUSPECT, record.state_reason)
        if record.state == JOINING and not entry.probed_ok:
            return False
        if not entry.heard:  # restored: ready once its heartbeat says what it holds, not before
            return False
        if entry.draining:
            return self._set_state(
                entry, DRAINING, "an operator asked to drain it; its shares are being handed to other servers"
            )
        return self._set_state(entry, READY, "heartbeating and healthy")

    def _set_state(self, entry: _Entry, state: kspeed_pb2.ServerState, reason: str) -> bool:
        record = entry.record
        if record.state == state:
            return False
        log.log(
            logging.WARNING if state in (SUSPECT, FAILED) else logging.INFO,
            "server %s: %s -> %s (%s)",
            record.id,
            state_name(record.state),
            state_name(state),
            reason,
        )
        record.state = state
        record.state_reason = reason
        self._commit(record)
        return True

    def _commit(self, record: kspeed_pb2.ServerRecord) -> None:
        # Saved now; on a full disk the manager goes on from memory and the next tick writes it.
        self._entries[record.id].dirty = not self._store.keep(lambda: self._store.save_server(record))
        self.revision += 1
        copy = kspeed_pb2.ServerRecord()
        copy.CopyFrom(record)
        for listener in list(self._listeners):
            listener(copy, self.revision)
