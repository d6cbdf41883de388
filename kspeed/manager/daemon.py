"""``kspeed-manager``: the daemon that owns membership (and later allocation) of a KSpeed cluster.

It serves ``kspeed.v1.Manager`` and ``grpc.health.v1.Health`` on one asyncio gRPC server, probes
every live server's health, applies the liveness timers, keeps its membership in SQLite and answers
``/healthz``, ``/readyz``, ``/metrics`` and ``/v1/status`` over HTTP. SIGTERM or SIGINT stops it
cleanly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Coroutine
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from kspeed.config import ManagerConfig
from kspeed.control import rpc
from kspeed.control.daemon import daemon_main, ensure_state_dir, write_ready_file
from kspeed.control.http import HttpEndpoint, HttpLimits, json_response, metrics_route, server_tls, text_response
from kspeed.control.status import status_dict
from kspeed.control.streams import AioStreamGuard
from kspeed.manager.calls import ServerCalls
from kspeed.manager.datasets import DatasetCatalog
from kspeed.manager.membership import DRAINING, FAILED, JOINING, LEFT, READY, Membership, Timers
from kspeed.manager.metrics import ManagerMetrics
from kspeed.manager.service import ManagerService
from kspeed.manager.store import Store
from kspeed.proto import kspeed_pb2

log = logging.getLogger(__name__)

SERVICE = "kspeed.v1.Manager"  # the name its grpc.health.v1 status is registered under
TICK_FRACTION = 0.25  # the timers are evaluated at this fraction of the heartbeat interval
REHOME_EVERY = 10.0  # seconds between attempts to give shares served on demand (or being drained) a server with room


class Manager:
    """One running manager: its membership, gRPC server, HTTP endpoint and background tasks."""

    def __init__(self, config: ManagerConfig) -> None:
        self.config = config
        state_dir = ensure_state_dir(config.state_dir, "manager.state_dir")
        self.store = Store(state_dir, rebuild=config.rebuild_state)
        self.membership = Membership(
            self.store,
            Timers(config.heartbeat_interval, config.suspect_after, config.fail_after, config.restart_grace),
        )
        self.calls = ServerCalls(config.security, config.server_call_timeout)
        self.catalog = DatasetCatalog(
            self.store,
            self.membership,
            self.calls,
            lease_ttl=config.lease_ttl,
            join_wait=config.join_wait,
            verify_on_attach=config.verify_on_attach,
        )
        self.service = ManagerService(
            self.membership,
            self.catalog,
            self.store,
            config.heartbeat_interval,
            probe=lambda address: self.calls.probe(address, config.probe_timeout),
        )
        self.metrics = ManagerMetrics(self.membership, self.catalog, self.service.jobs)
        self.health = HealthServicer()
        self._stopping = asyncio.Event()
        self._ready = False
        self._server: grpc.aio.Server | None = None
        self.streams: AioStreamGuard | None = None
        self._http: HttpEndpoint | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._probes: set[asyncio.Task[Any]] = set()  # probes and failovers under way
        self._started = time.monotonic()
        self._orphans: set[str] = set()  # holders never heard since the start whose shares were moved

    async def start(self) -> None:
        """Bind gRPC and HTTP, start the timers and the prober."""
        cfg = self.config
        self.streams = AioStreamGuard(
            cfg.max_streams, max(cfg.max_streams // 2, 1), cfg.stream_idle_timeout, watches=cfg.health_watches
        )
        self._server = grpc.aio.server(
            interceptors=[*rpc.server_interceptors(cfg.security, aio=True), self.streams],
            options=[*rpc.server_options(cfg.max_request_bytes), *rpc.listener_options(cfg)],
        )
        self._server.add_generic_rpc_handlers(
            (rpc.service_handler("Manager", self.service, max_request_bytes=cfg.max_request_bytes),)
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        grpc_address = rpc.bind(self._server, cfg.listen, cfg.security)
        self._http = HttpEndpoint(
            cfg.http_listen,
            {
                "/healthz": lambda: text_response("ok"),
                "/readyz": self._readyz,
                "/metrics": metrics_route(self.metrics.registry),
                "/v1/status": lambda: json_response(status_dict(self.service.status())),
            },
            token=cfg.http_token(),
            open_routes=cfg.http_open,
            limits=HttpLimits.of(cfg),
            tls=server_tls(cfg.security),
        )
        await self._server.start()
        await self.health.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
        self._loop = asyncio.get_running_loop()
        self.membership.subscribe(self._on_membership)
        self._tasks = [
            asyncio.create_task(self._tick_loop(), name="tick"),
            asyncio.create_task(self._probe_loop(), name="probe"),
        ]
        self._ready = True
        self.grpc_address, self.http_address = grpc_address, self._http.address
        log.info(
            "kspeed-manager %s listening: grpc %s, http %s, state %s, auth %s, tls %s",
            self.store.cluster_id,
            grpc_address,
            self._http.address,
            self.store.path,
            cfg.security.auth,
            "on" if cfg.security.tls_cert else "off",
        )
        write_ready_file(cfg.ready_file, {"grpc": grpc_address, "http": self._http.address, "pid": os.getpid()})

    def _readyz(self) -> tuple[int, str, bytes]:
        if self._ready and not self._stopping.is_set():
            return text_response("ready")
        return text_response("not ready", 503)

    async def _tick_loop(self) -> None:
        period = self.config.heartbeat_interval * TICK_FRACTION
        rehomed = time.monotonic()
        while not self._stopping.is_set():
            self.membership.tick()
            await self.catalog.expire()
            self._move_orphans()
            if time.monotonic() - rehomed > REHOME_EVERY:  # a move that failed when a server became ready
                rehomed = time.monotonic()
                self._background(self.catalog.rehome(), "rehome")
                self._continue_drains()
            self.metrics.watchers.set(self.service.watchers)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), timeout=period)

    async def _probe_loop(self) -> None:
        """Check ``grpc.health.v1`` of every live server once per probe interval, the probes spread
        evenly over it (one burst of a thousand probes delayed the heartbeats behind it and could
        time probes out)."""
        while not self._stopping.is_set():
            started = time.monotonic()
            targets = self.membership.probe_targets()
            await self.calls.forget({address for _, address, _ in targets})
            spacing = self.config.probe_interval / max(len(targets), 1)
            await asyncio.gather(*(self._probe_at(started + k * spacing, *target) for k, target in enumerate(targets)))
            with contextlib.suppress(asyncio.TimeoutError):
                left = self.config.probe_interval - (time.monotonic() - started)
                await asyncio.wait_for(self._stopping.wait(), timeout=max(left, 0.0))

    async def _probe_at(self, when: float, server_id: str, address: str, incarnation: int) -> None:
        """Probe one server at ``when`` (monotonic), unless the daemon stops first."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), timeout=max(when - time.monotonic(), 0.0))
        if not self._stopping.is_set():
            await self._probe(server_id, address, incarnation)

    def _on_membership(self, record: kspeed_pb2.ServerRecord, revision: int) -> None:
        """Probe a server that just registered at once, so it is READY without waiting for the next
        round; move the shares of one that failed or left (stopped past its restart grace, or
        without its pool); hand off those of one draining; give shares served on demand, or
        waiting to be handed off, a server that has room, once one is ready."""
        if self._loop is None:
            return
        if record.state == JOINING:
            self._loop.call_soon_threadsafe(self._probe_soon, record.id, record.address, record.incarnation)
        if record.state in (FAILED, LEFT):
            self._loop.call_soon_threadsafe(
                self._background, self.catalog.fail_over(record.id), f"failover-{record.id}"
            )
        if record.state == DRAINING:
            self._loop.call_soon_threadsafe(
                self._background, self.catalog.continue_drain(record.id), f"drain-{record.id}"
            )
        if record.state == READY:
            self._loop.call_soon_threadsafe(self._background, self.catalog.rehome(), f"rehome-{record.id}")
            self._loop.call_soon_threadsafe(self._continue_drains)

    def _continue_drains(self) -> None:
        for server in self.membership.snapshot():
            if server.state == DRAINING:
                self._background(self.catalog.continue_drain(server.id), f"drain-{server.id}")

    def _move_orphans(self) -> None:
        """Move the shares of servers the registry names but that have not registered since this
        manager started (a registry rebuilt from the servers' copies names holders that may be
        gone), once ``fail_after`` has passed: as for a failed server."""
        if time.monotonic() - self._started < self.config.fail_after:
            return
        for server_id in sorted(self.catalog.holders() - self.membership.known() - self._orphans):
            self._orphans.add(server_id)
            log.warning(
                "server %s holds shares in the registry but has not registered within %gs of the manager's start; "
                "moving them",
                server_id,
                self.config.fail_after,
            )
            self._background(self.catalog.fail_over(server_id), f"failover-{server_id}")

    def _background(self, work: Coroutine[Any, Any, Any], name: str) -> None:
        task = asyncio.create_task(work, name=name)
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    def _probe_soon(self, server_id: str, address: str, incarnation: int) -> None:
        task = asyncio.create_task(self._probe(server_id, address, incarnation), name=f"probe-{server_id}")
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    async def _probe(self, server_id: str, address: str, incarnation: int) -> None:
        ok, detail = await self.calls.probe(address, self.config.probe_timeout)
        self.metrics.probes.labels("ok" if ok else "failed").inc()
        self.membership.probe_result(server_id, incarnation, ok, detail)

    async def run_until_stopped(self) -> None:
        """Serve until SIGTERM/SIGINT, then shut down cleanly."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopping.set)
        await self._stopping.wait()
        log.info("kspeed-manager stopping")
        await self.stop()

    async def stop(self) -> None:
        """Stop serving, finish background tasks, close the store."""
        self._stopping.set()
        await self.health.enter_graceful_shutdown()
        if self.streams is not None:
            await self.streams.end_watches()  # once they heard NOT_SERVING; open, they would hold the grace period
        for task in getattr(self, "_tasks", []):
            await task
        if self._server is not None:
            await self._server.stop(grace=1.0)
        if self.streams is not None:
            await self.streams.close()
        await self.calls.close()
        if self._http is not None:
            self._http.close()
        self.store.close()
        if self.config.ready_file:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.config.ready_file)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kspeed-manager``."""

    async def serve(config: ManagerConfig) -> None:
        manager = Manager(config)
        try:
            await manager.start()
        except BaseException:
            await manager.stop()
            raise
        await manager.run_until_stopped()

    return daemon_main(
        argv,
        component="manager",
        config_class=ManagerConfig,
        description=__doc__.split("\n\n")[0],
        serve=lambda config: asyncio.run(serve(config)),
    )


if __name__ == "__main__":
    sys.exit(main())
