"""``kspeed-server``: a KSpeedServer daemon.

It starts empty, registers with the manager and reports its inventory, heartbeats, serves
``kspeed.v1.Server`` and ``grpc.health.v1.Health`` over gRPC and ``/healthz``, ``/readyz`` and
``/metrics`` over HTTP. On SIGTERM or SIGINT it reports NOT_SERVING, finishes the calls in flight,
deregisters and exits, keeping its pool (``keep_pool_on_exit``) for a restart to re-adopt: the
manager waits ``restart_grace`` for it before moving its shares. Once drained (every share handed to
other servers) it is told to retire: it exits the same way, discarding its pool.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kspeed._version import __version__
from kspeed.config import ServerConfig, process_cpu_seconds
from kspeed.control import rpc
from kspeed.control.arrivals import ArrivalGuard
from kspeed.control.daemon import StopSignals, daemon_main, ensure_state_dir, write_ready_file
from kspeed.control.http import HttpEndpoint, HttpLimits, metrics_route, server_tls, text_response
from kspeed.control.logs import LogSettings
from kspeed.control.streams import StreamGuard
from kspeed.errors import KSpeedError
from kspeed.proto import kspeed_pb2
from kspeed.rdma.options import RailOptions
from kspeed.rdma.rails import use_verbs_api
from kspeed.server import inventory as inv
from kspeed.server.agent import ManagerAgent
from kspeed.server.announce import ADVERTISE, WILDCARDS, Announced, announce, http_address
from kspeed.server.backend.access import Backend
from kspeed.server.backend.allowlist import AllowList
from kspeed.server.feeder.supervisor import FeederSupervisor
from kspeed.server.hosting.datasets import DatasetHost
from kspeed.server.hosting.listings import Listings
from kspeed.server.local_state import StateLock, pool_dir, read_cluster_id, write_cluster_id
from kspeed.server.memory.pool import WINDOW_OWNER, MemoryPool, RegionState
from kspeed.server.memory.window import ProductionWindow
from kspeed.server.metrics import ServerMetrics
from kspeed.server.prep.workers import PrepWorkers, sandbox_policy
from kspeed.server.readiness import ProbedHealth, ReadinessWatch
from kspeed.server.service import ServerService

log = logging.getLogger(__name__)

UNARY_THREADS = 8  # gRPC threads no stream may take: health checks and info calls always find one
SERVICE = "kspeed.v1.Server"  # the name its grpc.health.v1 status is registered under


class Server:
    """One running KSpeedServer."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        use_verbs_api(config.verbs_api)
        self.state_dir = ensure_state_dir(config.state_dir, "server.state_dir")
        self._lock: StateLock | None = StateLock(self.state_dir)
        self.id = inv.server_id(config, self.state_dir)
        self._retiring = threading.Event()  # drained: exit discarding the pool
        self.host: DatasetHost | None = None
        self.feeders: FeederSupervisor | None = None
        self.prep: PrepWorkers | None = None
        self.streams: StreamGuard | None = None
        self.arrivals: ArrivalGuard | None = None
        self.metrics = ServerMetrics(lambda: self.host, lambda: self.feeders.production if self.feeders else None)
        self.readiness = ReadinessWatch(config.manager)
        self.health = ProbedHealth(self.readiness.probed)
        self._stopped = threading.Event()
        self.fatal: KSpeedError | None = None
        self._grpc: grpc.Server | None = None
        self._http: HttpEndpoint | None = None
        self._serving = False
        self.agent: ManagerAgent | None = None

    def inventory(self) -> kspeed_pb2.ServerInventory:
        """Current inventory, with the pool's region counts."""
        if self.host is None:
            return inv.inventory(self.config)
        counts = self.host.pool.counts()
        window = len(self.host.pool.regions(WINDOW_OWNER))
        report = inv.inventory(self.config, memory_used=self.host.memory_used())
        report.regions_total = self.host.pool.region_count
        report.regions_free = counts[RegionState.FREE]
        report.regions_window = window
        report.regions_allocated = counts[RegionState.ALLOCATED] - window
        report.regions_filling = counts[RegionState.FILLING]
        report.regions_sealed = counts[RegionState.SEALED]
        if self.prep is not None:
            report.preprocess_active, shares, weights = self.prep.scheduler.figures()
            report.preprocess_share.update(shares)
            report.preprocess_weights.update(weights)
        return report

    def pool_dir(self) -> str:
        """Where the pool's region files live (tmpfs by default, named by server id)."""
        return pool_dir(self.config, self.id, self.state_dir)

    def start(self) -> None:
        """Open the pool, bind gRPC and HTTP, then start registering with the manager."""
        cfg = self.config
        for address in (cfg.listen, cfg.http_listen):  # fail before carving memory, not after
            rpc.check_bindable(address)
        pool, window, host = self._open_hosting()
        feeders = self._start_feeders(host, window)
        bound, grpc_server = self._bind_grpc(host, feeders)
        announced = announce(bound, cfg.advertise, cfg.manager)
        self.address = announced.address
        self.readiness.announced = announced
        self._http = HttpEndpoint(
            cfg.http_listen,
            {
                "/healthz": lambda: text_response("ok"),
                "/readyz": self._readyz,
                "/metrics": metrics_route(self.metrics.registry),
            },
            token=cfg.http_token(),
            open_routes=cfg.http_open,
            limits=HttpLimits.of(cfg),
            tls=server_tls(cfg.security),
        )
        http_announced = http_address(self._http.address, announced)
        grpc_server.start()
        self.health.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
        self._serving = True
        self.metrics.info.info({"id": self.id, "version": __version__, "address": self.address})
        self.metrics.memory.set(cfg.memory)
        self.metrics.memory_used.set_function(host.memory_used)
        self._start_agent(host, http_announced)
        log.info(
            "kspeed-server %s listening: grpc %s (advertised %s), http %s; manager %s; pool %s: %d regions "
            "of %d bytes; backends allowed: %s",
            self.id,
            bound,
            self.address,
            self._http.address,
            cfg.manager,
            pool.directory,
            pool.region_count,
            cfg.region_size,
            ", ".join(cfg.backend_allow) or "none",
        )
        self._say_announced(announced)
        write_ready_file(cfg.ready_file, {"grpc": bound, "http": self._http.address, "id": self.id, "pid": os.getpid()})

    def _open_hosting(self) -> tuple[MemoryPool, ProductionWindow, DatasetHost]:
        """Open (or re-adopt) the pool, start the preprocessing workers and restore the hosted shares."""
        cfg = self.config
        backend = Backend(AllowList(cfg.backend_allow, name="--backend-allow"), cfg.backend_options)
        pool = MemoryPool.open(self.pool_dir(), cfg.memory, region_size=cfg.region_size)
        window = ProductionWindow(pool, cfg.window_bytes())
        sandbox = sandbox_policy(cfg, state_dir=self.state_dir, pool_dir=self.pool_dir(), region_file=str(pool.path(0)))
        self.prep = PrepWorkers(
            cfg.preprocess_workers or inv.usable_cores(cfg.cores),
            cfg.preprocess_allow,
            LogSettings(cfg.log_level, cfg.log_format),
            sandbox=sandbox,
            environment=cfg.preprocess_env,
            weights=cfg.weight_map(),
        )
        host = self.host = DatasetHost(
            pool,
            backend,
            self.state_dir,
            preload_threads=cfg.preload_threads,
            scrub_interval=cfg.scrub_interval,
            change_check_interval=cfg.change_check_interval,
            change_check_budget=cfg.change_check_budget,
            preprocess_allow=cfg.preprocess_allow,
            prep=self.prep,
            listings=Listings(backend, cfg.security),
        )
        host.restore()
        return pool, window, host

    def _start_feeders(self, host: DatasetHost, window: ProductionWindow) -> FeederSupervisor:
        """Start the feeder processes and production, and tie the host's events to them."""
        cfg = self.config
        options = RailOptions(
            token=cfg.security.data_plane_token(),
            io_timeout=cfg.data_io_timeout,
            dial_allow=cfg.data_networks,
            nic=cfg.nic or None,
            verbs_api=cfg.verbs_api,
        )
        feeders = self.feeders = FeederSupervisor(
            cfg.feeders or min(4, inv.usable_cores(cfg.cores)),
            self.id,
            options,
            host,
            window,
            production_timeout=cfg.production_timeout,
            production_depth=cfg.production_depth,
            production_threads=cfg.production_threads,
            prep=self.prep,
            logs=LogSettings(cfg.log_level, cfg.log_format),
            verify=cfg.verify_served,
        )
        host.on_drop = feeders.close_share
        host.figures = feeders.production.figures
        host.on_changed = lambda name, changes: feeders.mark_changed(
            name, {c.sample: f"{c.path}: {c.what}" for c in changes}
        )
        host.watch.start()
        return feeders

    def _bind_grpc(self, host: DatasetHost, feeders: FeederSupervisor) -> tuple[str, grpc.Server]:
        """Build the gRPC server, its guards and the Server service, and bind it; returns the bound
        address and the server (not started)."""
        cfg = self.config
        streams = max(cfg.rpc_threads - UNARY_THREADS, 1)
        self.streams = StreamGuard(streams, max(streams // 2, 1), cfg.stream_idle_timeout, watches=cfg.health_watches)
        self.arrivals = ArrivalGuard(cfg.handshake_timeout, max(cfg.rpc_threads // 4, 1))
        server = self._grpc = grpc.server(
            futures.ThreadPoolExecutor(streams + UNARY_THREADS, thread_name_prefix="kspeed-rpc"),
            interceptors=[*rpc.server_interceptors(cfg.security, aio=False), self.arrivals, self.streams],
            options=[*rpc.server_options(cfg.max_request_bytes), *rpc.listener_options(cfg)],
        )
        service = ServerService(
            self.id,
            cfg.manager,
            host,
            feeders,
            self.inventory,
            self._registration,
            max_plan_bytes=cfg.max_plan_bytes,
            prep_figures=self._prep_figures,
            production_figures=feeders.production.production_figures,
        )
        server.add_generic_rpc_handlers(
            (rpc.service_handler("Server", service, max_request_bytes=cfg.max_request_bytes),)
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        return rpc.bind(server, cfg.listen, cfg.security), server

    def _prep_figures(self, job: str = "") -> kspeed_pb2.PrepFigures | None:
        """The preprocessing workers' counters (``None`` before they exist); ``job``'s samples among them."""
        prep = self.prep
        if prep is None:
            return None
        return kspeed_pb2.PrepFigures(
            workers=prep.active,
            busy_seconds=prep.busy_seconds,
            samples=prep.samples,
            cpu_seconds=prep.cpu_seconds,
            daemon_cpu_seconds=self._daemon_cpu(),
            cores=inv.usable_cores(self.config.cores),
            cpu_group=inv.cpu_group(),
            job_samples=prep.scheduler.samples_of(job) if job else None,
        )

    def _daemon_cpu(self) -> float:
        """CPU seconds of this process and its feeder processes (the preprocessing workers count theirs)."""
        feeders = self.feeders.pids() if self.feeders is not None else []
        return time.process_time() + sum(process_cpu_seconds(pid) for pid in feeders)

    def _start_agent(self, host: DatasetHost, http_announced: str) -> None:
        """Start registering with the manager (and heartbeats, assignments, drops from it)."""
        cfg = self.config
        self.agent = agent = ManagerAgent(
            manager_address=cfg.manager,
            security=cfg.security,
            server_id=self.id,
            address=self.address,
            http_address=http_announced,
            inventory=self.inventory,
            metrics=self.metrics,
            on_fatal=self._fatal,
            shares=host.statuses,
            assignments=lambda: host.assignments,
            on_registered=lambda reply, mark: host.reconcile(list(reply.assignments), before=mark),
            on_drop=lambda name, first: host.drop(
                name, "the manager no longer assigns it here", final=False, first=first
            ),
            on_assign=host.retake,
            holding=host.held,
            cluster_id=read_cluster_id(self.state_dir),
            on_cluster_id=lambda cluster_id: write_cluster_id(self.state_dir, cluster_id),
            on_retire=self._retire,
            on_records=host.keep_records,
            on_state=lambda state: self.readiness.observe(state, agent.interval),
        )
        host.on_loaded = lambda name: agent.report_soon()
        agent.start()

    def _say_announced(self, announced: Announced) -> None:
        """Log what the manager and the clients are told to dial and why; loudly when it may not work."""
        cfg = self.config
        if announced.doubt:
            log.warning(
                "announcing %s to the manager and the clients (%s), but they may fail to reach it: %s. The manager "
                "keeps a server it cannot probe from becoming ready: set %s to an address they reach this host at",
                announced.address,
                announced.how,
                announced.doubt,
                ADVERTISE,
            )
        elif not cfg.advertise and cfg.listen.rpartition(":")[0] in WILDCARDS:
            log.info(
                "announcing %s to the manager and the clients (%s; listen %s is a wildcard address); if they reach "
                "this host at another address, set %s%s",
                announced.address,
                announced.how,
                cfg.listen,
                ADVERTISE,
                " (with TLS, the certificate must name the announced host)" if cfg.security.tls_cert else "",
            )

    def _registration(self) -> tuple[bool, int]:
        agent = self.agent
        return (agent is not None and agent.registered.is_set(), agent.incarnation if agent else 0)

    def _readyz(self) -> tuple[int, str, bytes]:
        if self._registration()[0] and not self._stopped.is_set():
            return text_response("ready")
        return text_response("not registered with the manager", 503)

    def _fatal(self, exc: KSpeedError) -> None:
        self.fatal = exc
        self._stopped.set()

    def _retire(self) -> None:
        self._retiring.set()
        self._stopped.set()

    def run_until_stopped(self) -> None:
        """Serve until SIGTERM/SIGINT (or a fatal refusal by the manager, seen within half a
        second), then shut down."""
        signals = StopSignals()
        while not signals.wait(0.5) and not self._stopped.is_set():
            pass
        self.stop()
        if self.fatal is not None:
            raise self.fatal

    def stop(self) -> None:
        """Report NOT_SERVING, finish the calls in flight, deregister (unless the manager refused
        us) and release everything; the pool is kept for a restart unless the server retires or
        ``keep_pool_on_exit`` is off."""
        self._stopped.set()
        retiring = self._retiring.is_set()
        keep_pool = self.config.keep_pool_on_exit and not retiring
        self.health.enter_graceful_shutdown()
        for name in ("", SERVICE):
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.streams is not None:
            self.streams.end_watches()  # they heard NOT_SERVING; open, they would hold the grace period
        if self.agent is not None:
            self.agent.stop(
                deregister=self.fatal is None, reason="drained" if retiring else "shutdown", keep_pool=keep_pool
            )
        if self._grpc is not None:
            self._grpc.stop(grace=self.config.drain_timeout).wait()
        if self.streams is not None:
            self.streams.close()
        if self.arrivals is not None:
            self.arrivals.close()
        if self._http is not None:
            self._http.close()
        if self.feeders is not None:
            self.feeders.stop()
        if self.prep is not None:
            self.prep.close()  # after the feeders' producers; a preload still caching samples then stops
        if self.host is not None:
            self.host.close()
            if keep_pool:
                self.host.pool.close()
            else:
                self.host.pool.destroy()
        if self.config.ready_file:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.config.ready_file)
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        if self._serving:
            log.info(
                "kspeed-server %s %s",
                self.id,
                "retired (drained; pool discarded)" if retiring else "stopped" + (" (pool kept)" if keep_pool else ""),
            )


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kspeed-server``."""

    def serve(config: ServerConfig) -> None:
        server = Server(config)
        try:
            server.start()
        except BaseException:
            server.stop()
            raise
        server.run_until_stopped()

    return daemon_main(
        argv, component="server", config_class=ServerConfig, description=__doc__.split("\n\n")[0], serve=serve
    )


if __name__ == "__main__":
    sys.exit(main())
