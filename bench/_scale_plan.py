"""Epoch-boundary plan time, server CPU, connections, threads and memory against ranks and servers.

Real daemons: one manager and ``S`` servers (``kspeed.cli.cluster.LocalCluster``, auth off, one
feeder process each, pools under ``/dev/shm``, 32 KiB regions so that the dataset spreads over every
server). The dataset is one ``.npy`` file of
``--samples`` rows of 8 bytes (1.28M by default, ImageNet's count), so a whole epoch moves about
10 MB and what is measured is the control plane.

Simulated ranks: ``R`` ranks spread over ``--nodes`` node processes (as a job's ranks are spread
over its nodes; every process here connects from 127.0.0.1, so the servers see one caller where a
cluster has one per node). Each rank is the client library itself: its own ``KSpeedClient``
(manager channel, membership watch, lease, statistics reporter every 5 s), ``client.open()`` with
the built-in shuffled sampler split over the ``R`` ranks, the ``shm`` rail and a 4 MiB ring: it
opens a feed on every server (OpenFeed, a data-plane connection, a feeder thread there).

Per (S, R) point, in order:

1. **attach**: every rank opens the dataset at once; the servers' connections (sockets of the
   server and its feeder processes), threads and memory (RSS) are read from ``/proc`` after it.
2. **boundary**: every rank plans epoch 1 at once (the planner the pump runs at an epoch
   boundary: lookup on every server, then commit to every server), after a warm-up plan of epoch
   0. Per rank: lookup and commit seconds; per point: the slowest rank (the boundary's latency)
   and the CPU seconds the servers (with their feeder processes) and the node processes (the
   ranks' own side: sampler order, layout, calls) spent meanwhile. During it a probe calls one
   server's ``grpc.health.v1`` Check and ``GetInfo`` every 20 ms.
3. **feed**: every rank reads ``--feed-batches`` batches of epoch 1 (grants and completions),
   the servers' CPU per delivered batch.

Every daemon and process is stopped and every temporary file removed at the end of each cluster,
also on error.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing as mp
import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection

import numpy as np

from kspeed.errors import KSpeedError

RING_BYTES = 4 << 20
REGION = "32KiB"  # 10 MB of samples in 312 regions: every server of up to 64 holds a share
PROBE_EVERY = 0.02
IDLE_WINDOW = 3.0  # seconds the servers' idle CPU is measured over, before each boundary
# The ranks' control-plane deadline (the client's default is 5 s): at 512 ranks every rank, server
# and node process shares two cores, and a call may wait longer than 5 s for a CPU.
CALL_DEADLINE = "30s"
# Every daemon, node process and rank thread shares this machine's cores: failure detection is
# relaxed so that a starved heartbeat does not fail a server in the middle of a measurement (the
# manager's log is searched for suspect servers, and their count reported).
MANAGER_ARGS = ["--suspect-after", "30s", "--fail-after", "120s", "--probe-timeout", "10s", "--lease-ttl", "600s"]
CLOCK = os.sysconf("SC_CLK_TCK")


def add_arguments(parser) -> None:
    parser.add_argument("--samples", type=int, default=1_280_000, help="samples in the dataset")
    parser.add_argument("--ranks", default="", help="rank counts to sweep at --sweep-servers servers (0: none)")
    parser.add_argument("--servers", default="", help="server counts to sweep at --sweep-ranks ranks (0: none)")
    parser.add_argument("--sweep-servers", type=int, default=16, help="servers while ranks are swept")
    parser.add_argument("--sweep-ranks", type=int, default=128, help="ranks while servers are swept")
    parser.add_argument("--nodes", type=int, default=8, help="node processes the ranks are spread over")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument(
        "--attach-threads", type=int, default=4, help="ranks of one node process attaching at once (not measured)"
    )
    parser.add_argument("--feed-batches", type=int, default=4, help="batches each rank reads after the plan")
    parser.add_argument("--keep", action="store_true", help="keep the clusters' state and logs")
    parser.add_argument("--quick", action="store_true", help="128k samples, up to 64 ranks and 4 servers")


def _counts(text: str, default: tuple[int, ...]) -> list[int]:
    return [int(x) for x in text.split(",") if x] if text else list(default)


# -- /proc ------------------------------------------------------------------------------------------


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
    return out


def _cpu_s(pids: list[int]) -> float:
    total = 0
    for p in pids:
        with contextlib.suppress(OSError):
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / CLOCK


def _status(pid: int, key: str) -> int:
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _sockets(pid: int) -> int:
    n = 0
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                n += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
    return n


def _server_resources(cluster) -> dict:
    """Mean and max over the servers of sockets, threads and RSS (each server with its feeders)."""
    rows = []
    for daemon in cluster.servers:
        pids = _tree(daemon.process.pid)
        rows.append(
            (
                sum(_sockets(p) for p in pids),
                sum(_status(p, "Threads") for p in pids),
                sum(_status(p, "VmRSS") for p in pids) * 1024,
            )
        )
    a = np.array(rows, dtype=np.float64)
    return {
        "sockets_mean": float(a[:, 0].mean()),
        "sockets_max": int(a[:, 0].max()),
        "threads_mean": float(a[:, 1].mean()),
        "threads_max": int(a[:, 1].max()),
        "rss_mib_mean": round(float(a[:, 2].mean()) / 2**20, 1),
        "rss_mib_max": round(float(a[:, 2].max()) / 2**20, 1),
    }


def _log_count(daemons, needle: str) -> int:
    """Lines of the daemons' logs that contain ``needle``."""
    n = 0
    for daemon in daemons:
        with contextlib.suppress(OSError), open(daemon.log_file, errors="replace") as f:
            n += sum(needle in line for line in f)
    return n


def _suspects(cluster) -> int:
    return _log_count([cluster.manager], "-> suspect")


def _servers_cpu(cluster) -> float:
    return sum(_cpu_s(_tree(d.process.pid)) for d in cluster.servers)


# -- a node process: some of the job's ranks --------------------------------------------------------


def _node(
    conn: Connection, address: str, dataset: str, ranks: list[int], world: int, batch_size: int, attach_threads: int
) -> None:
    """Serve the parent's commands for ``ranks`` until told to close (runs in a spawned process)."""
    import logging

    from kspeed.client import KSpeedClient
    from kspeed.client.options import FeedOptions
    from kspeed.config import ClientConfig, load_config

    logging.basicConfig(level=logging.WARNING)
    config = load_config(
        ClientConfig, environ={}, overrides={"manager": address, "security.auth": "none", "timeout": CALL_DEADLINE}
    )
    clients: list = []
    sets: list = []
    pool = ThreadPoolExecutor(max(len(ranks), 1))
    attaching = ThreadPoolExecutor(attach_threads)

    def attach(rank: int) -> float:
        started = time.perf_counter()
        client = KSpeedClient(address, config=config)
        options = FeedOptions(
            batch_size=batch_size, rank=rank, world_size=world, rail="shm", ring_bytes=RING_BYTES, quiet=True
        )
        clients.append(client)
        sets.append(client.open(dataset, options))
        return time.perf_counter() - started

    def plan(ds, epoch: int, start: float) -> tuple[float, float, float]:
        time.sleep(max(0.0, start - time.time()))
        began = time.perf_counter()
        p = ds._parts.planner(epoch)
        return p.lookup_s, p.commit_s, time.perf_counter() - began

    def feed(ds, epoch: int, batches: int) -> tuple[int, float]:
        began = time.perf_counter()
        ds.set_epoch(epoch)
        got = 0
        for batch in ds:
            batch.release()
            got += 1
            if got == batches:
                break
        return got, time.perf_counter() - began

    try:
        while True:
            command, *args = conn.recv()
            try:
                if command == "attach":
                    conn.send(("ok", list(attaching.map(attach, ranks))))
                elif command == "plan":
                    conn.send(("ok", list(pool.map(functools.partial(_call, plan, args), sets))))
                elif command == "feed":
                    conn.send(("ok", list(pool.map(functools.partial(_call, feed, args), sets))))
                elif command == "close":
                    break
            except Exception as exc:  # reported to the parent, which stops the run
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        for ds in sets:
            with contextlib.suppress(Exception):
                ds.close()
        for client in clients:
            with contextlib.suppress(Exception):
                client.close()
        pool.shutdown(wait=False)
        attaching.shutdown(wait=False)
        conn.send(("closed", None))


def _call(step, args: list, ds):
    return step(ds, *args)


class _Job:
    """``ranks`` simulated ranks over ``nodes`` node processes."""

    def __init__(
        self, address: str, dataset: str, ranks: int, nodes: int, batch_size: int, attach_threads: int
    ) -> None:
        ctx = mp.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs = []
        per = np.array_split(np.arange(ranks), min(nodes, ranks))
        for members in per:
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=_node,
                args=(theirs, address, dataset, [int(r) for r in members], ranks, batch_size, attach_threads),
                daemon=True,
            )
            proc.start()
            theirs.close()
            self.conns.append(ours)
            self.procs.append(proc)

    def ask(self, *command, timeout: float = 900.0) -> list:
        for conn in self.conns:
            conn.send(command)
        out = []
        for conn in self.conns:
            if not conn.poll(timeout):
                raise TimeoutError(f"node process did not answer {command[0]!r} in {timeout:.0f} s")
            status, value = conn.recv()
            if status != "ok":
                raise RuntimeError(f"{command[0]}: {value}")
            out.extend(value)
        return out

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(("close",))
        for conn, proc in zip(self.conns, self.procs, strict=True):
            with contextlib.suppress(OSError, EOFError):
                if conn.poll(60):
                    conn.recv()
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()
            conn.close()


class _Probe:
    """Calls one server's health Check and GetInfo every :data:`PROBE_EVERY` seconds on a thread."""

    def __init__(self, address: str) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        from kspeed.proto import kspeed_pb2, kspeed_pb2_grpc

        self._channel = grpc.insecure_channel(address)
        health_stub = health_pb2_grpc.HealthStub(self._channel)
        server_stub = kspeed_pb2_grpc.ServerStub(self._channel)
        self._calls = {
            "health": lambda: health_stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10),
            "info": lambda: server_stub.GetInfo(kspeed_pb2.GetInfoRequest(), timeout=10),
        }
        self.ms: dict[str, list[float]] = {k: [] for k in self._calls}
        self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(PROBE_EVERY):
            for name, call in self._calls.items():
                began = time.perf_counter()
                try:
                    call()
                except Exception:
                    self.failed += 1
                    continue
                self.ms[name].append((time.perf_counter() - began) * 1e3)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        self._channel.close()
        out: dict = {"failed": self.failed}
        for name, ms in self.ms.items():
            a = np.array(ms or [np.nan])
            out[name] = {
                "calls": len(ms),
                "p50_ms": round(float(np.percentile(a, 50)), 2),
                "p99_ms": round(float(np.percentile(a, 99)), 2),
                "max_ms": round(float(a.max()), 2),
            }
        return out


# -- one cluster ------------------------------------------------------------------------------------


def _dataset(root: str, samples: int) -> str:
    path = os.path.join(root, "tiny.npy")
    rng = np.random.default_rng(0)
    np.save(path, rng.integers(0, 255, size=(samples, 8), dtype=np.uint8))
    return path


def _cluster(servers: int, samples: int, root: str, keep: bool):
    from kspeed.cli.cluster import LocalCluster

    state = tempfile.mkdtemp(prefix="kspeed-scale-")
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    pools = tempfile.mkdtemp(prefix="kspeed-scale-pool-", dir=shm)
    memory = max(8 << 20, (samples * 8) // servers * 2 + (8 << 20))
    cluster = LocalCluster(
        state,
        servers=servers,
        pool_root=pools,
        manager_args=MANAGER_ARGS,
        server_args=[
            "--backend-allow",
            root,
            "--memory",
            str(memory),
            "--region-size",
            REGION,
            "--feeders",
            "1",
            "--production-threads",
            "2",
            "--keep-pool-on-exit",
            "false",
        ],
    )
    return cluster, state, pools


def _point(cluster, address: str, name: str, servers: int, ranks: int, args) -> dict:
    """Attach ``ranks``, plan twice, feed, detach; the figures of this (servers, ranks) point."""
    row: dict = {"servers": servers, "ranks": ranks, "samples": args.samples, "batch_size": args.batch_size}
    idle = _server_resources(cluster)
    suspects = {"before": _suspects(cluster)}  # servers turned suspect, counted after each phase
    job = _Job(address, name, ranks, args.nodes, args.batch_size, args.attach_threads)
    try:
        began = time.perf_counter()
        attach = job.ask("attach")
        suspects["attach"] = _suspects(cluster)
        row["attach_s_max"] = round(max(attach), 3)
        row["attach_wall_s"] = round(time.perf_counter() - began, 3)
        row["idle"] = idle
        row["attached"] = _server_resources(cluster)
        job.ask("plan", 0, time.time() + 0.5)  # warm-up: channels, first commit
        # What the servers spend with nothing to do (heartbeats, idle feed threads...), taken off the
        # boundary's CPU below so that what remains is the boundary's own work.
        cpu0, began = _servers_cpu(cluster), time.perf_counter()
        time.sleep(IDLE_WINDOW)
        idle_cores = (_servers_cpu(cluster) - cpu0) / (time.perf_counter() - began)
        row["servers_idle_cores"] = round(idle_cores, 4)
        cpu0, ranks_cpu0 = _servers_cpu(cluster), _cpu_s([p.pid for p in job.procs])
        probe = _Probe(cluster.servers[0].ready["grpc"])
        began = time.perf_counter()
        timings = np.array(job.ask("plan", 1, time.time() + 0.5))
        wall = time.perf_counter() - began - 0.5
        row["probe"] = probe.stop()
        cpu = _servers_cpu(cluster) - cpu0
        row["ranks_cpu_s"] = round(_cpu_s([p.pid for p in job.procs]) - ranks_cpu0, 3)  # the client side, all ranks
        suspects["boundary"] = _suspects(cluster)
        row["plan_s_max"] = round(float(timings[:, 2].max()), 3)
        row["plan_s_p50"] = round(float(np.median(timings[:, 2])), 3)
        row["lookup_s_max"] = round(float(timings[:, 0].max()), 3)
        row["commit_s_max"] = round(float(timings[:, 1].max()), 3)
        row["plan_wall_s"] = round(wall, 3)
        row["servers_cpu_raw_s"] = round(cpu, 3)
        cpu = max(cpu - idle_cores * (wall + 0.5), 0.0)  # the 0.5 s start delay included
        row["servers_cpu_s"] = round(cpu, 3)
        row["server_cpu_s_mean"] = round(cpu / servers, 4)
        if args.feed_batches:
            cpu0 = _servers_cpu(cluster)
            try:
                fed = np.array(job.ask("feed", 1, args.feed_batches))
            except (RuntimeError, TimeoutError) as exc:  # kept with the figures: what broke, at what size
                row["feed"] = {"error": str(exc)}
            else:
                cpu = _servers_cpu(cluster) - cpu0
                batches = int(fed[:, 0].sum())
                row["feed"] = {
                    "batches": batches,
                    "s_max": round(float(fed[:, 1].max()), 3),
                    "servers_cpu_s": round(cpu, 3),
                    "server_cpu_ms_per_batch": round(cpu / max(batches, 1) * 1e3, 3),
                }
            suspects["feed"] = _suspects(cluster)
    finally:
        job.close()
    marks = list(suspects.values())
    row["suspect_by_phase"] = {k: b - a for k, a, b in zip(list(suspects)[1:], marks, marks[1:], strict=False)}
    return row


def _run_cluster(servers: int, rank_counts: list[int], args, root: str, path: str) -> list[dict]:
    from kspeed.config import ClientConfig, load_config
    from kspeed.control.manager_client import ManagerClient
    from kspeed.control.progress import follow_preload
    from kspeed.proto import kspeed_pb2

    cluster, state, pools = _cluster(servers, args.samples, root, args.keep)
    rows = []
    try:
        cluster.start(timeout=120)
        manager = ManagerClient(
            load_config(ClientConfig, environ={}, overrides={"manager": cluster.address, "security.auth": "none"})
        )
        try:
            name = "tiny"
            manager.create_dataset(kspeed_pb2.DatasetSpec(name=name, uri=path), operator=True)
            follow_preload(manager, name, out=None, timeout=600)
            for ranks in rank_counts:
                print(f"   servers {servers}, ranks {ranks}", flush=True)
                suspect = _suspects(cluster)
                refused = _log_count(cluster.servers, "refused stream")
                try:
                    row = _point(cluster, cluster.address, name, servers, ranks, args)
                except (RuntimeError, TimeoutError) as exc:  # a point that broke is a finding, not the end
                    print(f"     failed: {exc}", flush=True)
                    rows.append({"servers": servers, "ranks": ranks, "error": str(exc)})
                    continue
                row["suspect_servers"] = _suspects(cluster) - suspect
                row["refused_streams"] = _log_count(cluster.servers, "refused stream") - refused
                print(
                    f"     plan {row['plan_s_max']:.2f} s (lookup {row['lookup_s_max']:.2f}, commit "
                    f"{row['commit_s_max']:.2f}), servers' CPU {row['servers_cpu_s']:.2f} s, sockets/server "
                    f"{row['attached']['sockets_mean']:.0f}, threads/server {row['attached']['threads_mean']:.0f}, "
                    f"refused streams {row['refused_streams']}, suspect servers {row['suspect_servers']}",
                    flush=True,
                )
                rows.append(row)
        finally:
            manager.close()
    finally:
        cluster.stop()
        shutil.rmtree(pools, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(state, ignore_errors=True)
        else:
            print(f"   state kept in {state}", flush=True)
    return rows


def measure(args) -> dict:
    if args.quick:
        args.samples = min(args.samples, 128_000)
    rank_counts = [n for n in _counts(args.ranks, (8, 16) if args.quick else (8, 32, 128, 512)) if n > 0]
    server_counts = [n for n in _counts(args.servers, (2, 4) if args.quick else (2, 4, 8, 16, 32)) if n > 0]
    sweep_servers = 4 if args.quick else args.sweep_servers
    sweep_ranks = 16 if args.quick else args.sweep_ranks
    root = tempfile.mkdtemp(prefix="kspeed-scale-data-")

    def cluster(servers: int, ranks: list[int]) -> list[dict]:
        try:
            return _run_cluster(servers, ranks, args, root, path)
        except (KSpeedError, RuntimeError, TimeoutError) as exc:  # e.g. more servers than fit: a finding
            print(f"   {servers} servers: failed: {exc}", flush=True)
            return [{"servers": servers, "ranks": r, "error": str(exc)} for r in ranks]

    try:
        path = _dataset(root, args.samples)
        by_ranks = cluster(sweep_servers, rank_counts) if rank_counts else []
        by_servers = [
            row
            for servers in server_counts
            for row in (
                [r for r in by_ranks if r["ranks"] == sweep_ranks]
                if servers == sweep_servers and sweep_ranks in rank_counts
                else cluster(servers, [sweep_ranks])
            )
        ]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {
        "samples": args.samples,
        "batch_size": args.batch_size,
        "nodes": args.nodes,
        "cores": os.cpu_count(),
        "by_ranks": by_ranks,
        "by_servers": by_servers,
    }


def merge(old: dict, new: dict) -> dict:
    """``new`` with the points of ``old`` it did not measure again (runs of a few points at a time
    build one document)."""
    out = dict(new)
    for key in ("by_ranks", "by_servers"):
        fresh = {(r["servers"], r["ranks"]) for r in new.get(key, [])}
        kept = [r for r in old.get(key, []) if (r["servers"], r["ranks"]) not in fresh]
        out[key] = sorted(kept + new.get(key, []), key=lambda r: (r["servers"], r["ranks"]))
    return out


def charts(result: dict, outdir: str, before: dict | None = None) -> list[str]:
    """``plan_ranks.png``, ``plan_servers.png`` (boundary latency and the servers' CPU; a run of
    the code before the plan changes, when given, dashed beside) and ``plan_resources.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for key, axis in (("by_ranks", "ranks"), ("by_servers", "servers")):
        rows = [r for r in result.get(key) or [] if "error" not in r]
        if not rows:
            continue
        old = [r for r in (before or {}).get(key) or [] if "error" not in r]
        x = [r[axis] for r in rows]
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
        left.plot(x, [r["plan_s_max"] for r in rows], "o-", label="plan, slowest rank")
        left.plot(x, [r["lookup_s_max"] for r in rows], "s:", label="lookup, slowest rank")
        left.plot(x, [r["commit_s_max"] for r in rows], "^:", label="commit, slowest rank")
        right.plot(x, [r["server_cpu_s_mean"] for r in rows], "o-", label="servers: CPU s per server")
        spent = [r for r in rows if "ranks_cpu_s" in r]
        if spent:  # what every process spent over the boundary, spread over the machine's cores
            cores = result.get("cores") or os.cpu_count() or 1
            left.plot(
                [r[axis] for r in spent],
                [(r["servers_cpu_raw_s"] + r["ranks_cpu_s"]) / cores for r in spent],
                "d--",
                label=f"all CPU spent / {cores} cores",
            )
            right.plot(
                [r[axis] for r in spent],
                [r["ranks_cpu_s"] / r["ranks"] for r in spent],
                "d--",
                label="ranks: CPU s per rank",
            )
        if old:
            ox = [r[axis] for r in old]
            left.plot(ox, [r["plan_s_max"] for r in old], "x--", color="grey", label="plan, before")
            right.plot(ox, [r["server_cpu_s_mean"] for r in old], "x--", color="grey", label="per server, before")
        left.set_xlabel(axis)
        left.set_ylabel("seconds")
        left.set_title(f"epoch-boundary plan, {result['samples']:,} samples")
        left.legend(fontsize=8)
        right.set_xlabel(axis)
        right.set_ylabel("CPU seconds per boundary")
        right.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(outdir, f"plan_{axis}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    rows = [r for r in result.get("by_ranks") or [] if "error" not in r]
    if rows:
        x = [r["ranks"] for r in rows]
        fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
        for ax, what, label in zip(
            axes,
            ("sockets_mean", "threads_mean", "rss_mib_mean"),
            ("sockets per server", "threads per server", "RSS per server (MiB)"),
            strict=True,
        ):
            ax.plot(x, [r["attached"][what] for r in rows], "o-")
            ax.set_xlabel("ranks")
            ax.set_ylabel(label)
        fig.suptitle(f"per server, {rows[0]['servers']} servers, every rank attached")
        fig.tight_layout()
        path = os.path.join(outdir, "plan_resources.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
