"""The real manager against light simulated servers, ranks and watchers: its CPU, memory and call latencies.

One ``kspeed-manager`` daemon runs as a child process (auth off, loopback, its default timers unless
``--heartbeat-interval``/``--probe-interval`` say otherwise). Every peer lives in this process on one
asyncio loop and speaks the real protocol over a gRPC channel of its own (its own TCP connection, as a
separate process would have):

- a simulated **server** registers with the inventory a real server sends (this host's, under a
  hostname of its own) and heartbeats as :class:`kspeed.server.agent.ManagerAgent` does: the call,
  then a pause of the interval the manager gave it (first beat at a random phase), registering again
  when told NOT_FOUND. Each advertises an address of its own, ``127.0.x.y:<port>`` (all of 127/8 is
  loopback), so the manager keeps one channel per server as in a cluster; one gRPC health endpoint
  listening on ``0.0.0.0:<port>`` answers the manager's ``grpc.health.v1`` probes for all of them.
- a simulated **rank** says Hello, then sends ``ReportStats`` (a
  :class:`~kspeed.client.stats.StatsReporter` message whose ``server_bytes`` names every server)
  every stats interval, first at a random phase.
- a simulated **watcher** follows ``WatchMembership`` from revision 0, as
  :class:`~kspeed.control.membership_watch.MembershipWatch` does.

Three curves, each from a manager of its own, each a ramp within that manager: a step adds peers,
waits until they are settled (servers READY, every new rank reported once), then measures a steady
window. CPU is ``utime + stime`` from ``/proc/<pid>/stat`` over the window, in cores; memory is RSS.

1. ``servers``: manager CPU and heartbeat round trip (p50/p99/max at the simulated servers) against
   servers; the health probes the manager sent per second; the states of the servers at the end of
   the window (``ListServers``) and every membership event a watcher saw during it (a server made
   ``suspect`` or ``failed`` under load is a finding, as is a heartbeat answered with another state;
   ``suspect_logged``/``failed_logged`` count such changes in the manager's log since it started).
2. ``stats``: ``ReportStats`` round trip and manager CPU against ranks, at the client's default
   stats interval and at a faster one (a fresh manager per interval: reports are kept for minutes),
   beside a fixed fleet of servers; a step with 0 ranks is the baseline the per-report CPU is
   counted from.
3. ``watch``: manager RSS and idle CPU against open watch streams; then, a change every half
   second, the time from a membership change (a server registering: its ``joining`` event;
   deregistering: its ``left`` event) to its arrival at each watcher (p50/p99 over every delivery)
   and at the last of them (``all_seen``, per change), and the manager's CPU above its idle CPU
   per spare server so registered and deregistered (its three events, ``joining``, ``ready`` after
   its probe and ``left``, sent to every watcher, and the registration's own work).

The harness runs on the same cores as the manager; its own CPU (``harness_cpu_cores``) is reported
beside the manager's. Latencies are measured in the harness and include its event loop's delays:
where its CPU nears one core they are the harness's as much as the manager's, and a delivery to N
watchers includes this one process reading N streams.

    python bench/scale.py --json /tmp/control.json --charts /tmp/charts control --quick
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import random
import resource
import shutil
import signal
import tempfile
import time
from collections.abc import Callable

import grpc
import numpy as np
from grpc_health.v1 import health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from kspeed.cli.cluster import LocalCluster
from kspeed.config import ClientConfig, ManagerConfig, ServerConfig, load_config
from kspeed.control import rpc
from kspeed.control.status import state_name
from kspeed.proto import kspeed_pb2, kspeed_pb2_grpc
from kspeed.server.agent import CALL_TIMEOUT
from kspeed.server.inventory import inventory

NO_AUTH = {"security.auth": "none"}
SERVERS, QUICK_SERVERS = "10,100,250,500,1000", "10,50,100"
RANKS, QUICK_RANKS = "64,256,512,1024", "16,64"
WATCHERS, QUICK_WATCHERS = "64,256,512", "16,64"
FLEET, QUICK_FLEET = 64, 16  # servers beside the ranks and the watchers
FAST_STATS_INTERVAL = 1.0
WINDOW, QUICK_WINDOW = 10.0, 5.0
CHANGES, QUICK_CHANGES = 5, 3
SETTLE = 3.0  # seconds between a step's servers being READY and its window: a probe round and more
REGISTER_CONCURRENCY = 64  # registrations in flight while a step adds servers
MAX_BACKOFF = 1.0  # as the agent: its retries after a failed heartbeat, from 0.2 s doubling to this
DELIVERY_TIMEOUT = 10.0  # longest wait for every watcher to see one change
CHANGE_PERIOD = 0.5  # seconds from one timed change to the next
JOB, DATASET = "scale-control", "scale-control-data"
_TICKS = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The control part's flags (sizes default to the full curves, or the ``--quick`` ones)."""
    parser.add_argument("--quick", action="store_true", help="small sizes only (about a minute and a half)")
    parser.add_argument("--servers", help=f"simulated servers per step (default {SERVERS}; quick {QUICK_SERVERS})")
    parser.add_argument("--ranks", help=f"simulated ranks per step (default {RANKS}; quick {QUICK_RANKS})")
    parser.add_argument("--watchers", help=f"watch streams per step (default {WATCHERS}; quick {QUICK_WATCHERS})")
    parser.add_argument(
        "--fleet", type=int, help=f"servers beside ranks and watchers (default {FLEET}; quick {QUICK_FLEET})"
    )
    parser.add_argument(
        "--stats-intervals",
        help=f"seconds between a rank's reports, one manager each (default: the client's, then {FAST_STATS_INTERVAL})",
    )
    parser.add_argument(
        "--window", type=float, help=f"seconds of each steady window (default {WINDOW}; quick {QUICK_WINDOW})"
    )
    parser.add_argument(
        "--changes", type=int, help=f"registrations (and as many departures) timed per watch step (default {CHANGES})"
    )
    parser.add_argument("--heartbeat-interval", type=float, help="the manager's heartbeat interval (default: its own)")
    parser.add_argument("--probe-interval", type=float, help="the manager's health-probe period (default: its own)")


BOARD_RANKS = (64, 256, 1024, 4096, 16384)


def _board_curve(rank_counts: tuple[int, ...], servers: int) -> list[dict]:
    """The manager's own work per statistics report (``JobBoard.report``, in this process, no gRPC)
    with ``n`` ranks' reports kept: its per-report cost must not grow with the ranks."""
    from kspeed.manager.jobs import JobBoard

    out = []
    names = {f"srv-{k:04d}": 1 << 20 for k in range(servers)}
    for n in rank_counts:
        board = JobBoard()
        for rank in range(n):  # every rank has reported once
            board.report(kspeed_pb2.RankStats(job="j", rank=rank, world_size=n, dataset="d", server_bytes=names))
        reports = min(n, 2000)
        started = time.process_time()
        for rank in range(reports):  # then reports again, as every stats interval
            board.report(kspeed_pb2.RankStats(job="j", rank=rank, world_size=n, dataset="d", server_bytes=names))
        us = (time.process_time() - started) / reports * 1e6
        out.append({"ranks": n, "servers_per_report": servers, "us_per_report": round(us, 1)})
        print(f"  board: {n} ranks kept: {us:.0f} us per report", flush=True)
    return out


def measure(args: argparse.Namespace) -> dict:
    """Run the three curves; returns their figures (JSON-serialisable)."""
    client = load_config(ClientConfig, environ={}, overrides=NO_AUTH)
    manager = load_config(ManagerConfig, environ={}, overrides=NO_AUTH)
    quick = getattr(args, "quick", False)
    sizes = argparse.Namespace(
        servers=_ints(args.servers or (QUICK_SERVERS if quick else SERVERS)),
        ranks=_ints(args.ranks or (QUICK_RANKS if quick else RANKS)),
        watchers=_ints(args.watchers or (QUICK_WATCHERS if quick else WATCHERS)),
        fleet=args.fleet or (QUICK_FLEET if quick else FLEET),
        intervals=[float(v) for v in args.stats_intervals.split(",")]
        if args.stats_intervals
        else [client.stats_interval, FAST_STATS_INTERVAL],
        window=args.window or (QUICK_WINDOW if quick else WINDOW),
        changes=args.changes or (QUICK_CHANGES if quick else CHANGES),
        call_timeout=client.timeout,
        manager_args=[
            *(["--heartbeat-interval", str(args.heartbeat_interval)] if args.heartbeat_interval else []),
            *(["--probe-interval", str(args.probe_interval)] if args.probe_interval else []),
        ],
    )
    _raise_file_limit()
    figures = asyncio.run(_measure(sizes))
    figures["board"] = _board_curve(BOARD_RANKS, sizes.fleet)
    return {
        "config": {
            "heartbeat_interval_s": args.heartbeat_interval or manager.heartbeat_interval,
            "probe_interval_s": args.probe_interval or manager.probe_interval,
            "probe_timeout_s": manager.probe_timeout,
            "suspect_after_s": manager.suspect_after,
            "stats_intervals_s": sizes.intervals,
            "fleet_servers": sizes.fleet,
            "window_s": sizes.window,
            "changes_per_step": sizes.changes,
            "cores": len(os.sched_getaffinity(0)),
        },
        **figures,
    }


async def _measure(sizes: argparse.Namespace) -> dict:
    # SIGTERM cancels the run, so every manager is stopped and every directory removed on the way out.
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
    health = _Health()
    endpoint = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health, endpoint)
    port = endpoint.add_insecure_port("0.0.0.0:0")
    await endpoint.start()
    try:
        return {
            "servers": await _servers_curve(sizes, health, port),
            "stats": await _stats_curve(sizes, port),
            "watch": await _watch_curve(sizes, port),
        }
    finally:
        await endpoint.stop(grace=None)


# -- the curves --------------------------------------------------------------------------------


async def _servers_curve(sizes: argparse.Namespace, health: _Health, port: int) -> list[dict]:
    points = []
    async with _Run(sizes, port) as run:
        watch = _Watchers(run.manager.address)
        run.closing.append(watch.close)
        await watch.open(1)
        for count in sizes.servers:
            started = time.perf_counter()
            await run.fleet.grow(count)
            register_s = time.perf_counter() - started
            ready = await run.wait_ready(count)
            await asyncio.sleep(SETTLE)
            watch.events.clear()
            checks = health.checks
            window = await run.steady(sizes.window)
            beats = len(run.fleet.latencies)
            point = {
                "servers": count,
                "register_s": round(register_s, 2),
                "ready_s": ready,
                **window,
                "heartbeats_per_s": round(beats / window["window_s"], 1),
                "manager_cpu_us_per_heartbeat": _per(window["manager_cpu_cores"] * window["window_s"], beats),
                **_ms(run.fleet.latencies, "heartbeat"),
                "heartbeat_errors": dict(run.fleet.errors),
                "heartbeat_replies": dict(run.fleet.replies),
                "probes_per_s": round((health.checks - checks) / window["window_s"], 1),
                "events_in_window": dict(watch.events),
                "states": await run.states(),
                "suspect_logged": run.manager.logged("-> suspect"),
                "failed_logged": run.manager.logged("-> failed"),
            }
            _show("servers", point, "servers", "heartbeat")
            points.append(point)
    return points


async def _stats_curve(sizes: argparse.Namespace, port: int) -> list[dict]:
    points = []
    for interval in sizes.intervals:
        async with _Run(sizes, port) as run:
            await run.fleet.grow(sizes.fleet)
            await run.wait_ready(sizes.fleet)
            await asyncio.sleep(SETTLE)
            length = max(sizes.window, interval)  # every rank reports in it at least once
            baseline = await run.steady(length)
            points.append({"interval_s": interval, "ranks": 0, **baseline, **_ms(run.fleet.latencies, "heartbeat")})
            ranks = _Ranks(run.manager.address, [s.id for s in run.fleet.sims], max(sizes.ranks), interval, sizes)
            run.closing.append(ranks.close)
            for count in sizes.ranks:
                await ranks.grow(count)
                await asyncio.sleep(interval + 1.0)  # every new rank has reported once: the table is full
                ranks.reset()
                window = await run.steady(length)
                reports = len(ranks.latencies)
                extra = (window["manager_cpu_cores"] - baseline["manager_cpu_cores"]) * window["window_s"]
                point = {
                    "interval_s": interval,
                    "ranks": count,
                    **window,
                    "reports_per_s": round(reports / window["window_s"], 1),
                    "manager_cpu_us_per_report": _per(extra, reports),
                    **_ms(ranks.latencies, "report"),
                    "report_errors": dict(ranks.errors),
                    **_ms(run.fleet.latencies, "heartbeat"),
                    "states": await run.states(),
                }
                _show("stats", point, "ranks", "report")
                points.append(point)
    return points


async def _watch_curve(sizes: argparse.Namespace, port: int) -> list[dict]:
    points = []
    async with _Run(sizes, port) as run:
        await run.fleet.grow(sizes.fleet)
        await run.wait_ready(sizes.fleet)
        await asyncio.sleep(1.0)
        watchers = _Watchers(run.manager.address)
        run.closing.append(watchers.close)
        points.append({"watchers": 0, **await run.steady(2.0)})
        spare = 0
        for count in sizes.watchers:
            started = time.perf_counter()
            await watchers.open(count - len(watchers.tasks))
            synced = await _until(lambda count=count: watchers.synced >= count, DELIVERY_TIMEOUT + count / 50)
            open_s = time.perf_counter() - started
            idle = await run.steady(2.0)
            window = _Window(run.manager)
            timed = await _time_changes(run, watchers, count, range(spare, spare + sizes.changes))
            spare += sizes.changes
            busy = window.close()
            extra = (busy["manager_cpu_cores"] - idle["manager_cpu_cores"]) * busy["window_s"]
            point = {
                "watchers": count,
                "open_s": round(open_s, 2),
                "synced": synced,
                "manager_rss_bytes": idle["manager_rss_bytes"],
                "manager_rss_bytes_per_watcher": (idle["manager_rss_bytes"] - points[0]["manager_rss_bytes"]) // count,
                "manager_cpu_cores": idle["manager_cpu_cores"],  # watchers open, nothing changing
                "harness_cpu_cores": idle["harness_cpu_cores"],
                "manager_cpu_cores_changing": busy["manager_cpu_cores"],
                "harness_cpu_cores_changing": busy["harness_cpu_cores"],
                "manager_cpu_ms_per_spare": None if extra <= 0 else round(extra * 1e3 / sizes.changes, 2),
                **timed,
                "changes": 2 * sizes.changes,
            }
            _show("watch", point, "watchers", "delivery")
            points.append(point)
    return points


async def _time_changes(run: _Run, watchers: _Watchers, count: int, spares: range) -> dict:
    """Register, then deregister, one spare server per number in ``spares`` (one change every
    :data:`CHANGE_PERIOD`), timing each change's arrival at each of the ``count`` watchers."""
    deliveries: dict[str, list[float]] = {"register": [], "deregister": []}
    last: list[float] = []  # per change, its arrival at the last watcher
    missed = 0
    for number in spares:
        sim = run.fleet.spare(number)
        for change, state, call in (
            ("register", kspeed_pb2.SERVER_STATE_JOINING, run.fleet.register),
            ("deregister", kspeed_pb2.SERVER_STATE_LEFT, run.fleet.deregister),
        ):
            seen = watchers.track(sim.id, state)
            ready = watchers.track(sim.id, kspeed_pb2.SERVER_STATE_READY)
            started = time.perf_counter()
            await call(sim)
            await _until(lambda seen=seen: len(seen) >= count, DELIVERY_TIMEOUT)
            delays = [t - started for t in seen]
            deliveries[change] += delays
            missed += count - len(delays)
            if len(delays) >= count:
                last.append(max(delays))
            if change == "register":  # its probe makes it READY: a change of its own, let it pass
                await _until(lambda ready=ready: len(ready) >= count, DELIVERY_TIMEOUT)
            await asyncio.sleep(max(0.0, CHANGE_PERIOD - (time.perf_counter() - started)))
    return {
        **_ms(deliveries["register"] + deliveries["deregister"], "delivery"),
        **_ms(deliveries["register"], "register_delivery"),
        **_ms(deliveries["deregister"], "deregister_delivery"),
        **_ms(last, "all_seen"),
        "missed_deliveries": missed,
    }


# -- the manager and the window ----------------------------------------------------------------


class _Manager:
    """One ``kspeed-manager`` child process, its state in a temporary directory."""

    def __init__(self, args: list[str]) -> None:
        self.state_dir = tempfile.mkdtemp(prefix="kspeed-scale-control-")
        self.cluster = LocalCluster(self.state_dir, servers=0, manager_args=args)
        try:
            self.cluster.start_manager()
        except BaseException:
            self.stop()
            raise
        self.pid = int(self.cluster.manager.ready["pid"])
        self.address = self.cluster.address

    def cpu_s(self) -> float:
        return _cpu_s(self.pid)

    def rss(self) -> int:
        return _rss(self.pid)

    def logged(self, text: str) -> int:
        """Lines of the manager's log that contain ``text`` (state changes are logged)."""
        with open(self.cluster.manager.log_file, encoding="utf-8", errors="replace") as fh:
            return sum(text in line for line in fh)

    def stop(self) -> None:
        try:
            self.cluster.stop()
        finally:
            shutil.rmtree(self.state_dir, ignore_errors=True)


class _Window:
    """CPU of the manager and of this process from now until :meth:`close`."""

    def __init__(self, manager: _Manager) -> None:
        self._manager = manager
        self._started = time.perf_counter()
        self._manager_cpu = manager.cpu_s()
        self._harness_cpu = _cpu_s("self")

    def close(self) -> dict:
        seconds = time.perf_counter() - self._started
        return {
            "window_s": round(seconds, 2),
            "manager_cpu_cores": round((self._manager.cpu_s() - self._manager_cpu) / seconds, 4),
            "harness_cpu_cores": round((_cpu_s("self") - self._harness_cpu) / seconds, 4),
            "manager_rss_bytes": self._manager.rss(),
            "harness_rss_bytes": _rss("self"),
        }


class _Run:
    """A manager, its simulated servers and whatever else a curve adds to ``closing``; all torn
    down on exit, peers first."""

    def __init__(self, sizes: argparse.Namespace, port: int) -> None:
        self._sizes = sizes
        self._port = port
        self.closing: list[Callable] = []

    async def __aenter__(self) -> _Run:
        # Started from the loop's own thread: the daemon dies with the thread that started it
        # (PR_SET_PDEATHSIG), and an executor's thread may go first.
        self.manager = _Manager(self._sizes.manager_args)
        try:
            self.fleet = _Fleet(self.manager.address, self._port)
        except BaseException:
            self.manager.stop()
            raise
        self._admin = _channel(self.manager.address)
        self._stub = kspeed_pb2_grpc.ManagerStub(self._admin)
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            for close in reversed(self.closing):
                await close()
            await self.fleet.close()
            await self._admin.close()
        finally:
            self.manager.stop()

    async def steady(self, seconds: float) -> dict:
        """Figures of a window of ``seconds`` (latencies gathered from its start)."""
        self.fleet.reset()
        window = _Window(self.manager)
        await asyncio.sleep(seconds)
        return window.close()

    async def states(self) -> dict[str, int]:
        """Servers per state, as the manager lists them."""
        reply = await self._stub.ListServers(kspeed_pb2.ListServersRequest(), timeout=self._sizes.call_timeout)
        return dict(collections.Counter(state_name(r.state) for r in reply.servers))

    async def wait_ready(self, count: int) -> float | None:
        """Seconds until the manager lists ``count`` servers READY (``None``: not within its time)."""
        started = time.perf_counter()

        async def ready() -> bool:
            return (await self.states()).get("ready", 0) >= count

        deadline = started + 30 + count / 20
        while not await ready():
            if time.perf_counter() > deadline:
                return None
            await asyncio.sleep(0.25)
        return round(time.perf_counter() - started, 2)


# -- the simulated peers -----------------------------------------------------------------------


class _Sim:
    """One simulated server: its identity, its channel to the manager and the incarnation it was given."""

    def __init__(self, manager: str, sim_id: str, address: str, inventory: kspeed_pb2.ServerInventory) -> None:
        self.id = sim_id
        self.address = address
        self.inventory = inventory
        self.channel = _channel(manager)
        self.stub = kspeed_pb2_grpc.ManagerStub(self.channel)
        self.incarnation = 0
        self.interval = 1.0
        self.task: asyncio.Task | None = None


class _Fleet:
    """The simulated servers of one manager, heartbeating until :meth:`close`."""

    SPARE_BASE = 60000  # address index of the first spare (a server registered only to be watched)

    def __init__(self, manager: str, health_port: int) -> None:
        self._manager = manager
        self._port = health_port
        self._inventory = inventory(load_config(ServerConfig, environ={}, overrides=NO_AUTH))
        self.sims: list[_Sim] = []
        self._spares: list[_Sim] = []
        self.latencies: list[float] = []
        self.errors: collections.Counter[str] = collections.Counter()  # failed heartbeats by status
        self.replies: collections.Counter[str] = collections.Counter()  # heartbeat replies by state

    def _sim(self, index: int, sim_id: str) -> _Sim:
        # 127.0.x.y, x and y in 1..250: a distinct loopback address per server, one listening port.
        address = f"127.0.{1 + index // 250}.{1 + index % 250}:{self._port}"
        mine = kspeed_pb2.ServerInventory()
        mine.CopyFrom(self._inventory)
        mine.hostname = f"sim-host-{index}"
        return _Sim(self._manager, sim_id, address, mine)

    def spare(self, number: int) -> _Sim:
        """A server that is not registered yet and will not heartbeat."""
        sim = self._sim(self.SPARE_BASE + number, f"spare-{number:05d}")
        self._spares.append(sim)
        return sim

    def reset(self) -> None:
        self.latencies.clear()
        self.errors.clear()
        self.replies.clear()

    async def grow(self, count: int) -> None:
        """Register servers (at most :data:`REGISTER_CONCURRENCY` at once) up to ``count``; each
        then heartbeats."""
        new = [self._sim(i, f"sim-{i:05d}") for i in range(len(self.sims), count)]
        self.sims += new
        gate = asyncio.Semaphore(REGISTER_CONCURRENCY)

        async def one(sim: _Sim) -> None:
            async with gate:
                await self.register(sim)
            sim.task = asyncio.create_task(self._heartbeats(sim))

        await asyncio.gather(*(one(sim) for sim in new))

    async def register(self, sim: _Sim) -> None:
        reply = await sim.stub.RegisterServer(
            kspeed_pb2.RegisterServerRequest(
                id=sim.id,
                address=sim.address,
                http_address=sim.address,
                inventory=sim.inventory,
                version=rpc.peer_version(),
            ),
            timeout=CALL_TIMEOUT,
        )
        sim.incarnation = reply.incarnation
        sim.interval = reply.heartbeat_interval_s or sim.interval

    async def deregister(self, sim: _Sim) -> None:
        await sim.stub.DeregisterServer(
            kspeed_pb2.DeregisterServerRequest(id=sim.id, incarnation=sim.incarnation, reason="benchmark"),
            timeout=CALL_TIMEOUT,
        )

    async def _heartbeats(self, sim: _Sim) -> None:
        await asyncio.sleep(random.uniform(0, sim.interval))  # servers start at different times
        backoff = 0.2
        while True:
            request = kspeed_pb2.HeartbeatRequest(id=sim.id, incarnation=sim.incarnation, inventory=sim.inventory)
            started = time.perf_counter()
            try:
                reply = await sim.stub.Heartbeat(request, timeout=CALL_TIMEOUT)
            except grpc.aio.AioRpcError as exc:
                self.errors[exc.code().name.lower()] += 1
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        await self.register(sim)
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, MAX_BACKOFF)
                continue
            backoff = 0.2
            self.latencies.append(time.perf_counter() - started)
            self.replies[state_name(reply.state)] += 1
            await asyncio.sleep(sim.interval)

    async def close(self) -> None:
        tasks = [s.task for s in self.sims if s.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for sim in self.sims + self._spares:
            await sim.channel.close()


class _Ranks:
    """Simulated ranks of one job, each reporting its statistics every ``interval``."""

    def __init__(
        self, manager: str, servers: list[str], world_size: int, interval: float, sizes: argparse.Namespace
    ) -> None:
        self._manager = manager
        self._servers = servers
        self._world_size = world_size
        self._interval = interval
        self._timeout = sizes.call_timeout
        self.tasks: list[asyncio.Task] = []
        self._channels: list[grpc.aio.Channel] = []
        self.latencies: list[float] = []
        self.errors: collections.Counter[str] = collections.Counter()

    def reset(self) -> None:
        self.latencies.clear()
        self.errors.clear()

    async def grow(self, count: int) -> None:
        for rank in range(len(self.tasks), count):
            channel = _channel(self._manager)
            self._channels.append(channel)
            self.tasks.append(asyncio.create_task(self._report(rank, kspeed_pb2_grpc.ManagerStub(channel))))

    def _message(self, rank: int) -> kspeed_pb2.RankStats:
        """What a :class:`~kspeed.client.stats.StatsReporter` sends, with plausible figures."""
        return kspeed_pb2.RankStats(
            job=JOB,
            rank=rank,
            world_size=self._world_size,
            dataset=DATASET,
            host=f"node-{rank // 8}",
            pid=100000 + rank,
            wait_mean_ms=1.5,
            wait_p50_ms=1.0,
            wait_p99_ms=9.0,
            wait_max_ms=20.0,
            server_bytes=dict.fromkeys(self._servers, 0),
        )

    async def _report(self, rank: int, stub: kspeed_pb2_grpc.ManagerStub) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):  # a refused Hello shows in the reports' errors
            await stub.Hello(
                kspeed_pb2.HelloRequest(version=rpc.peer_version(), peer_name=f"rank-{rank}"), timeout=self._timeout
            )
        message = self._message(rank)
        await asyncio.sleep(random.uniform(0, self._interval))  # ranks started at different times
        while True:
            message.batches += 100
            message.samples += 6400
            message.bytes += 6400 << 16
            message.elapsed_s += self._interval
            message.wait_total_s += 0.15
            for server in self._servers:
                message.server_bytes[server] += (6400 << 16) // len(self._servers)
            started = time.perf_counter()
            try:
                await stub.ReportStats(message, timeout=self._timeout)
            except grpc.aio.AioRpcError as exc:
                self.errors[exc.code().name.lower()] += 1
            else:
                self.latencies.append(time.perf_counter() - started)
            await asyncio.sleep(self._interval)

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for channel in self._channels:
            await channel.close()


class _Watchers:
    """``WatchMembership`` streams, each on a channel of its own; notes when each sees a tracked
    server reach a state."""

    def __init__(self, manager: str) -> None:
        self._manager = manager
        self.tasks: list[asyncio.Task] = []
        self._calls: list = []
        self._channels: list[grpc.aio.Channel] = []
        self.synced = 0  # streams whose snapshot arrived
        self.broken = 0
        self.events: collections.Counter[str] = collections.Counter()  # changes seen, by state
        self._tracked: dict[tuple[str, int], list[float]] = {}

    async def open(self, count: int) -> None:
        for _ in range(count):
            channel = _channel(self._manager)
            call = kspeed_pb2_grpc.ManagerStub(channel).WatchMembership(kspeed_pb2.WatchMembershipRequest())
            self._channels.append(channel)
            self._calls.append(call)
            self.tasks.append(asyncio.create_task(self._follow(call)))

    def track(self, server_id: str, state: int) -> list[float]:
        """The list the arrival times of ``server_id`` reaching ``state`` will be appended to."""
        return self._tracked.setdefault((server_id, state), [])

    async def _follow(self, call) -> None:
        synced = False
        try:
            async for event in call:
                now = time.perf_counter()
                if event.snapshot:
                    if not synced:
                        synced = True
                        self.synced += 1
                    continue
                for record in event.servers:
                    self.events[state_name(record.state)] += 1
                    seen = self._tracked.get((record.id, record.state))
                    if seen is not None:
                        seen.append(now)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                self.broken += 1

    async def close(self) -> None:
        for call in self._calls:
            call.cancel()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for channel in self._channels:
            await channel.close()


class _Health(HealthServicer):
    """The ``grpc.health.v1`` endpoint every simulated server advertises; counts the probes."""

    def __init__(self) -> None:
        super().__init__()
        self.checks = 0

    async def Check(self, request, context):
        self.checks += 1
        return await super().Check(request, context)


# -- helpers -----------------------------------------------------------------------------------


def _channel(address: str) -> grpc.aio.Channel:
    """A channel with a connection of its own, as a peer in another process would have (gRPC
    otherwise shares one connection between channels to the same address)."""
    return grpc.aio.insecure_channel(address, options=[*rpc.channel_options(), ("grpc.use_local_subchannel_pool", 1)])


def _cpu_s(pid: int | str) -> float:
    """User and system CPU seconds of a process, all its threads."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
        fields = fh.read().rpartition(")")[2].split()  # fields[0] is field 3 (state): utime is 14, stime 15
    return (int(fields[11]) + int(fields[12])) / _TICKS


def _rss(pid: int | str) -> int:
    with open(f"/proc/{pid}/statm", encoding="ascii") as fh:
        return int(fh.read().split()[1]) * _PAGE


def _raise_file_limit() -> None:
    """Allow a descriptor per connection: the manager (a child) inherits the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 65536, hard))


async def _until(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.perf_counter() + timeout
    while not predicate():
        if time.perf_counter() > deadline:
            return False
        await asyncio.sleep(0.005)
    return True


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def _per(cpu_s: float, count: int) -> float | None:
    """Microseconds of CPU per event."""
    return round(cpu_s * 1e6 / count, 1) if count else None


def _ms(seconds: list[float], name: str) -> dict:
    """p50, p99 and max of ``seconds`` in milliseconds, as ``<name>_p50_ms`` and so on."""
    if not seconds:
        return {f"{name}_p50_ms": None, f"{name}_p99_ms": None, f"{name}_max_ms": None, f"{name}_count": 0}
    values = np.asarray(seconds) * 1e3
    return {
        f"{name}_p50_ms": round(float(np.percentile(values, 50)), 3),
        f"{name}_p99_ms": round(float(np.percentile(values, 99)), 3),
        f"{name}_max_ms": round(float(values.max()), 3),
        f"{name}_count": len(values),
    }


def _show(curve: str, point: dict, size: str, latency: str) -> None:
    print(
        f"  {curve}: {point[size]} {size}: manager {point['manager_cpu_cores']} cores, "
        f"harness {point['harness_cpu_cores']} cores, "
        f"{latency} p50 {point[f'{latency}_p50_ms']} ms p99 {point[f'{latency}_p99_ms']} ms, "
        f"manager RSS {point['manager_rss_bytes'] >> 20} MiB"
        + (f", states {point['states']}" if "states" in point else ""),
        flush=True,
    )


# -- charts ------------------------------------------------------------------------------------


def charts(result: dict, outdir: str, before: dict | None = None) -> list[str]:
    """One PNG per curve in ``outdir``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    mib = 1 << 20
    servers = result.get("servers") or []
    if servers:
        x = [p["servers"] for p in servers]
        fig, (cpu, lat, mem) = plt.subplots(1, 3, figsize=(15, 4.2))
        cpu.plot(x, [p["manager_cpu_cores"] for p in servers], "o-", label="manager")
        cpu.plot(x, [p["harness_cpu_cores"] for p in servers], "s--", label="harness (simulated servers)")
        cpu.set(xlabel="servers", ylabel="CPU (cores)", title="CPU in the steady window")
        cpu.legend()
        lat.plot(x, [p["heartbeat_p50_ms"] for p in servers], "o-", label="p50")
        lat.plot(x, [p["heartbeat_p99_ms"] for p in servers], "s-", label="p99")
        lat.set(xlabel="servers", ylabel="heartbeat round trip (ms)", yscale="log", title="Heartbeat latency")
        lat.legend()
        mem.plot(x, [p["manager_rss_bytes"] / mib for p in servers], "o-")
        mem.set(xlabel="servers", ylabel="manager RSS (MiB)", title="Manager memory")
        for point in servers:
            late = sum(n for state, n in point["states"].items() if state != "ready")
            if late:
                lat.annotate(f"{late} not ready", (point["servers"], point["heartbeat_p99_ms"]), fontsize=8)
        fig.suptitle("Manager against simulated servers (heartbeat and probes every interval)")
        paths.append(_save(fig, plt, outdir, "control_servers.png"))
    stats = result.get("stats") or []
    if stats:
        fig, (lat, cpu, per) = plt.subplots(1, 3, figsize=(15, 4.2))
        for number, interval in enumerate(sorted({p["interval_s"] for p in stats}, reverse=True)):
            color, every = f"C{number}", f"every {interval:g} s"
            series = [p for p in stats if p["interval_s"] == interval]
            ranked = [p for p in series if p["ranks"]]
            x = [p["ranks"] for p in ranked]
            lat.plot(x, [p["report_p50_ms"] for p in ranked], "o-", color=color, label=f"p50, {every}")
            lat.plot(x, [p["report_p99_ms"] for p in ranked], "s--", color=color, label=f"p99, {every}")
            everyone = [p["ranks"] for p in series]
            cpu.plot(everyone, [p["manager_cpu_cores"] for p in series], "o-", color=color, label=f"manager, {every}")
            cpu.plot(everyone, [p["harness_cpu_cores"] for p in series], "s--", color=color, label=f"harness, {every}")
            per.plot(x, [p["manager_cpu_us_per_report"] for p in ranked], "o-", color=color, label=every)
        lat.set(xlabel="ranks reporting", ylabel="ReportStats round trip (ms)", yscale="log", title="Report latency")
        cpu.set(xlabel="ranks reporting", ylabel="CPU (cores)", title="CPU (0 ranks: the servers alone)")
        per.set(xlabel="ranks reporting", ylabel="manager CPU per report (µs)", title="Manager CPU per report")
        for ax in (lat, cpu, per):
            ax.legend(fontsize=8)
        fig.suptitle(f"Manager against ranks reporting statistics ({result['config']['fleet_servers']} servers beside)")
        paths.append(_save(fig, plt, outdir, "control_stats.png"))
    watch = [p for p in result.get("watch") or [] if p["watchers"]]
    if watch:
        fig, (lat, mem) = plt.subplots(1, 2, figsize=(11, 4.2))
        x = [p["watchers"] for p in watch]
        lat.plot(x, [p["delivery_p50_ms"] for p in watch], "o-", label="each watcher, p50")
        lat.plot(x, [p["delivery_p99_ms"] for p in watch], "s-", label="each watcher, p99")
        lat.plot(x, [p["all_seen_max_ms"] for p in watch], "^--", label="every watcher (worst change)")
        lat.set(xlabel="open watch streams", ylabel="change to arrival (ms)", title="Membership change delivery")
        lat.legend(fontsize=8)
        everything = result["watch"]
        mem.plot([p["watchers"] for p in everything], [p["manager_rss_bytes"] / mib for p in everything], "o-")
        mem.set(xlabel="open watch streams", ylabel="manager RSS (MiB)", title="Manager memory")
        fig.suptitle("Manager against membership watchers")
        paths.append(_save(fig, plt, outdir, "control_watch.png"))
    board = result.get("board") or []
    if board:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([p["ranks"] for p in board], [p["us_per_report"] for p in board], "o-", label="now")
        old = (before or {}).get("board") or []
        if old:
            ax.plot([p["ranks"] for p in old], [p["us_per_report"] for p in old], "x--", color="grey", label="before")
        ax.set(xlabel="ranks whose reports are kept", ylabel="manager CPU per report (us)", xscale="log")
        ax.set_title(f"JobBoard.report, {board[0]['servers_per_report']} servers per report (no gRPC)", fontsize=10)
        ax.legend()
        paths.append(_save(fig, plt, outdir, "control_board.png"))
    return paths


def _save(fig, plt, outdir: str, name: str) -> str:
    path = os.path.join(outdir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
