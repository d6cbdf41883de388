"""The server's link to the manager: register, heartbeat, re-register, deregister.

The agent runs on its own thread. While the manager is unreachable the server keeps serving and
the agent retries with capped backoff; when the manager answers a heartbeat with NOT_FOUND (it
lost or failed this server) the agent registers again, telling the manager its cluster id and the
shares it holds (a manager that lost its registry rebuilds it from them). A version mismatch, a
refused token or a manager of another cluster is fatal: retrying cannot fix it, so the agent
reports it and the daemon stops. A heartbeat reply that says the server was drained retires it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from kspeed.config import SecurityConfig
from kspeed.control import rpc
from kspeed.errors import AuthError, ConflictError, KSpeedError, NotFoundError, ProtocolError, UnavailableError
from kspeed.proto import kspeed_pb2, kspeed_pb2_grpc
from kspeed.server.metrics import ServerMetrics

log = logging.getLogger(__name__)

CALL_TIMEOUT = 5.0
MAX_BACKOFF = 1.0  # a manager that comes back hears from every server within about a heartbeat
RETRY_FLOOR = 0.1  # the least wait between two calls to a manager that cannot be reached
STOP_POLL = 0.05  # how often a wait for the manager looks whether the agent is stopping
SOON_GAP = 0.05  # the least time between two heartbeats when news is reported soon


class ManagerAgent:
    """Keeps one server registered with the manager at ``manager_address``."""

    def __init__(
        self,
        *,
        manager_address: str,
        security: SecurityConfig,
        server_id: str,
        address: str,
        http_address: str,
        inventory: Callable[[], kspeed_pb2.ServerInventory],
        metrics: ServerMetrics,
        on_fatal: Callable[[KSpeedError], None],
        shares: Callable[[], list[kspeed_pb2.ShareStatus]] = list,
        assignments: Callable[[], int] = lambda: 0,
        on_registered: Callable[[kspeed_pb2.RegisterServerReply, int], None] = lambda reply, mark: None,
        on_drop: Callable[[str, int | None], None] = lambda name, first: None,
        on_assign: Callable[[list[kspeed_pb2.AssignShareRequest]], None] = lambda requests: None,
        holding: Callable[[], list[kspeed_pb2.AssignShareRequest]] = list,
        cluster_id: str = "",
        on_cluster_id: Callable[[str], None] = lambda cluster_id: None,
        on_retire: Callable[[], None] = lambda: None,
        on_records: Callable[[list[kspeed_pb2.DatasetInfo]], None] = lambda records: None,
        on_state: Callable[[kspeed_pb2.ServerState], None] = lambda state: None,
    ) -> None:
        self._manager = manager_address
        self._metadata = rpc.call_metadata(security)
        self._channel = rpc.open_channel(manager_address, security)
        self._stub = kspeed_pb2_grpc.ManagerStub(self._channel)
        self._id = server_id
        self._address = address
        self._http_address = http_address
        self._inventory = inventory
        self._metrics = metrics
        self._on_fatal = on_fatal
        self._shares = shares
        self._assignments = assignments
        self._on_registered = on_registered
        self._on_drop = on_drop
        self._on_assign = on_assign
        self._holding = holding
        self.cluster_id = cluster_id
        self._on_cluster_id = on_cluster_id
        self._on_retire = on_retire
        self._on_records = on_records
        self._on_state = on_state  # told the state each heartbeat reply gives this server
        self._stop = threading.Event()
        self._wake = threading.Event()  # set to end a pause: news to report, or the agent stops
        self._thread = threading.Thread(target=self._run, name="kspeed-agent", daemon=True)
        self.incarnation = 0
        self.interval = 1.0
        self.registered = threading.Event()

    def start(self) -> None:
        """Start registering and heartbeating in the background."""
        self._thread.start()

    def report_soon(self) -> None:
        """Heartbeat now rather than at the next interval (a preload ended: whoever follows it
        through the manager learns it without waiting up to a heartbeat interval)."""
        self._wake.set()

    def _pause(self) -> None:
        """Wait a heartbeat interval, or less when news is reported (at least :data:`SOON_GAP`
        after the last heartbeat), or until the agent stops."""
        last = time.monotonic()
        if self._wake.wait(self.interval) and not self._stop.is_set():
            self._wake.clear()
            self._stop.wait(max(0.0, last + SOON_GAP - time.monotonic()))

    def _call(self, method: str, request: object) -> Any:
        with rpc.map_rpc_errors(f"manager at {self._manager}"):
            return getattr(self._stub, method)(request, timeout=CALL_TIMEOUT, metadata=self._metadata)

    def _register(self) -> None:
        # Shares the manager assigns while the registration is under way are newer than its reply.
        mark = self._assignments()
        reply = self._call(
            "RegisterServer",
            kspeed_pb2.RegisterServerRequest(
                id=self._id,
                address=self._address,
                http_address=self._http_address,
                inventory=self._inventory(),
                version=rpc.peer_version(),
                cluster_id=self.cluster_id,
                holding=self._holding(),
            ),
        )
        if reply.cluster_id and reply.cluster_id != self.cluster_id:
            self.cluster_id = reply.cluster_id
            self._on_cluster_id(reply.cluster_id)
        self.incarnation = reply.incarnation
        self.interval = reply.heartbeat_interval_s or self.interval
        self._on_registered(reply, mark)
        self.registered.set()
        self._metrics.registered.set(1)
        self._metrics.registrations.inc()
        log.info(
            "registered with manager %s as %s (incarnation %d, protocol v%d)",
            self._manager,
            self._id,
            reply.incarnation,
            reply.protocol_version,
        )

    def _heartbeat(self) -> None:
        reply = self._call(
            "Heartbeat",
            kspeed_pb2.HeartbeatRequest(
                id=self._id, incarnation=self.incarnation, inventory=self._inventory(), shares=self._shares()
            ),
        )
        for name in reply.drop_datasets:
            log.info("the manager no longer assigns dataset %s here; dropping it", name)
            self._on_drop(name, None)
        for ref in reply.drop_shares:
            log.info(
                "the manager assigns share %d.. of dataset %s elsewhere now; dropping it", ref.first_id, ref.dataset
            )
            self._on_drop(ref.dataset, ref.first_id)
        if reply.records:
            self._on_records(list(reply.records))
        if reply.assign:
            self._on_assign(list(reply.assign))
        if reply.retire:
            log.warning("the manager handed every share of this server to others (drained); retiring")
            self._on_retire()
        self._on_state(reply.state)

    def _run(self) -> None:
        backoff = 0.2
        unreachable_logged = False
        while not self._stop.is_set():
            try:
                if not self.registered.is_set():
                    self._register()
                else:
                    self._heartbeat()
                    self._metrics.heartbeats.labels("ok").inc()
                backoff = 0.2
                if unreachable_logged:
                    log.info("manager %s reachable again", self._manager)
                    unreachable_logged = False
                self._pause()
            except NotFoundError as exc:
                log.warning("manager does not know this server (%s); registering again", exc)
                self._metrics.heartbeats.labels("not_found").inc()
                self.registered.clear()
                self._metrics.registered.set(0)
            except (AuthError, ProtocolError, ConflictError) as exc:
                log.error("manager refused this server: %s", exc)
                self._on_fatal(exc)
                return
            except KSpeedError as exc:
                self._metrics.heartbeats.labels("failed").inc()
                if not unreachable_logged:
                    log.warning("%s; retrying", exc)
                    unreachable_logged = True
                if isinstance(exc, UnavailableError):
                    self._await_manager(backoff)
                else:
                    self._stop.wait(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF)

    def _await_manager(self, timeout: float) -> None:
        """Wait at least :data:`RETRY_FLOOR` and until the channel to the manager is up again, at
        most ``timeout`` (or until the agent stops). A manager that comes back is heard from as soon
        as the channel has reconnected, not a backoff later: a restarted manager declares a server
        failed that it has not heard from within its ``fail_after``, and the channel's own
        reconnect backoff (up to :data:`~kspeed.control.rpc.MAX_RECONNECT_BACKOFF_MS`) added to a
        fixed wait here could exceed that."""
        deadline = time.monotonic() + timeout
        if self._stop.wait(RETRY_FLOOR):
            return
        ready = grpc.channel_ready_future(self._channel)
        try:
            while not self._stop.is_set() and (left := deadline - time.monotonic()) > 0:
                try:
                    ready.result(timeout=min(left, STOP_POLL))
                    return
                except grpc.FutureTimeoutError:
                    continue
        finally:
            ready.cancel()

    def stop(self, deregister: bool, reason: str = "shutdown", *, keep_pool: bool = False) -> None:
        """Stop the loop and, if asked and registered, deregister (best effort, bounded);
        ``keep_pool``: the pool stays for a restart, which the manager then waits for."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=CALL_TIMEOUT + 1)
        if deregister and self.registered.is_set():
            try:
                self._call(
                    "DeregisterServer",
                    kspeed_pb2.DeregisterServerRequest(
                        id=self._id, incarnation=self.incarnation, reason=reason, keep_pool=keep_pool
                    ),
                )
                log.info("deregistered from manager %s", self._manager)
            except KSpeedError as exc:
                log.warning("could not deregister: %s", exc)
        self.registered.clear()
        self._metrics.registered.set(0)
        self._channel.close()
