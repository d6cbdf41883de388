"""Several servers feeding clients over a shaped network: incast, pacing and per-server credit.

Every daemon and client runs in its own network namespace of a :class:`tests.netlab.NetLab`
(root only; skipped with the reason elsewhere), on the ``tcp`` rail across a Linux bridge:

* **incast** (:func:`test_incast_pacing`): four servers push one client whose switch port is
  shaped to :data:`INCAST_RATE` with a shallow queue. The same reads run with the client's pacing
  off and on (``KSPEED_PACING``): pacing must cut the p99 batch wait without costing throughput.
  A third run drops the port's rate mid-run; the traced pacing window must follow it down.
* **credit** (:func:`test_adaptive_credit`): four servers, one of them :data:`CREDIT_DELAY`
  away; rank 0 reads from all four, rank 1 only from the three fast ones. Adaptive per-server
  credit (``KSPEED_CREDIT``) must narrow the spread of the ranks' mean data wait compared with
  equal credit.

Figures are printed (``pytest -s``, ``make test-incast``) and written to ``bench/results/``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from kspeed.cli.cluster import LocalCluster
from tests.netlab import PORT_BUFFER, NetLab, netlab_unavailable, parse_rate

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
KSPEED = str(Path(sys.executable).with_name("kspeed"))

#: Incast: the client's port, the run length (bytes read at that rate in about this long) and the data.
INCAST_RATE = "300mbit"
INCAST_SECONDS = 10.0
INCAST_FILES = 3000  # 24-40 KiB (log-uniform), about 94 MiB over the four servers
INCAST_BATCH = 16
#: The third run: the rate before and after the change, when it changes, and how long it keeps going.
CHANGE_FROM, CHANGE_TO = "400mbit", "100mbit"
CHANGE_AFTER, CHANGE_THEN = 4.0, 6.0
#: From SETTLE seconds after the change on, the measured drain rate must be below RATE_SHRINK x its
#: median before and the window below SHRINK x. The window falls less than the rate: at these rates
#: a 32 KiB grant's own transfer time is most of its latency, and the window keeps about two grants.
SHRINK, RATE_SHRINK, SETTLE = 0.75, 0.5, 3.0

#: Credit: the slow server's egress delay, the files (fixed size, so the four servers own equal quarters),
#: each client's port rate (so the pacing window, not the CPU, bounds what is in flight) and the run.
CREDIT_DELAY = "20ms"
CREDIT_FILES = 1280  # 64 KiB each: 80 regions of 1 MiB, 20 per server
CREDIT_SIZE = 64 * 1024
CREDIT_RATE = "200mbit"
CREDIT_BATCH = 16
CREDIT_BATCHES = 200

SERVER_ARGS = ["--memory", "128MiB", "--region-size", "1MiB"]


@dataclasses.dataclass
class LabCluster:
    """A lab, a cluster in it and one registered, preloaded dataset."""

    lab: NetLab
    cluster: LocalCluster
    dataset: str
    tmp: Path

    @property
    def manager(self) -> str:
        return self.cluster.address

    def kspeed(self, host: str, *args: str) -> str:
        """Run the ``kspeed`` command in ``host`` against the cluster; returns its stdout."""
        done = self.lab.run(host, KSPEED, *args, "--manager", self.manager, "--auth", "none", check=False, timeout=300)
        if done.returncode != 0:
            raise AssertionError(f"kspeed {' '.join(args)} failed: {done.stderr.strip()[-2000:]}")
        return done.stdout

    def start_client(self, host: str, out: Path, env: dict[str, str], *args: str) -> subprocess.Popen:
        """Start the reading client (:mod:`tests.integration.netlab_client`) in ``host``."""
        clean = {k: v for k, v in os.environ.items() if not k.startswith("KSPEED_")}
        clean.update(env, PYTHONPATH=str(ROOT), KSPEED_JOB=f"netlab-{self.dataset}")
        stderr = open(out.with_suffix(".log"), "w", encoding="utf-8")  # noqa: SIM115 - closed by finish_client
        proc = subprocess.Popen(
            [
                *self.lab.prefix(host),
                sys.executable,
                "-m",
                "tests.integration.netlab_client",
                "--manager",
                self.manager,
                "--dataset",
                self.dataset,
                "--out",
                str(out),
                *args,
            ],
            cwd=ROOT,
            env=clean,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            start_new_session=True,
        )
        proc.log = stderr  # type: ignore[attr-defined]
        return proc

    @staticmethod
    def wait_iterating(proc: subprocess.Popen, timeout: float = 60.0) -> None:
        """Wait for the client's ``iterating`` line."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if line.strip() == "iterating":
                return
            if not line and proc.poll() is not None:
                break
        raise AssertionError(f"client did not start iterating (status {proc.poll()})")

    @staticmethod
    def finish_client(proc: subprocess.Popen, out: Path, timeout: float = 120.0) -> dict:
        """Wait for the client and return its record.

        Raises:
            AssertionError: it failed or timed out (with the end of its stderr).
        """
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        finally:
            proc.log.close()  # type: ignore[attr-defined]
            proc.stdout.close()
        if proc.returncode != 0:
            log = out.with_suffix(".log").read_text(encoding="utf-8", errors="replace")
            raise AssertionError(f"client exited with status {proc.returncode}: {log[-3000:]}")
        return json.loads(out.read_text(encoding="utf-8"))

    def run_client(self, host: str, name: str, env: dict[str, str], *args: str) -> dict:
        """Run the client in ``host`` to the end and return its record."""
        out = self.tmp / f"{name}.json"
        return self.finish_client(self.start_client(host, out, env, *args), out)


def write_files(root: Path, sizes: Sequence[int], seed: int = 0) -> None:
    """One file per size, named in ID order (the servers sort the keys)."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True)
    block = rng.integers(0, 256, max(sizes) + 4096, dtype=np.uint8).tobytes()
    for i, size in enumerate(sizes):
        start = int(rng.integers(0, 4096))
        (root / f"{i:06d}.bin").write_bytes(block[start : start + size])


@contextlib.contextmanager
def lab_cluster(
    tmp: Path,
    *,
    servers: int,
    clients: Sequence[str],
    sizes: Sequence[int],
    tcp_congestion: str | None = None,
    spares: int = 0,
    manager_args: Sequence[str] = (),
) -> Iterator[LabCluster]:
    """A lab of ``mgr``, ``s0..`` and ``clients``, a cluster in it, and one preloaded dataset.

    The manager and every server live in their own namespace; the dataset (one file per entry of
    ``sizes``) is registered and preloaded from the first client's namespace. ``spares`` more
    server namespaces are made but nothing runs there: ``cluster.add_server()`` starts the next
    spare in its own. Everything is stopped and deleted on exit, also after errors.
    """
    reason = netlab_unavailable()
    if reason:
        pytest.skip(reason)
    hosts = ["mgr", *(f"s{i}" for i in range(servers + spares)), *clients]
    data = tmp / "data"
    write_files(data, sizes)
    with NetLab(hosts, tcp_congestion=tcp_congestion) as lab:
        where = {"manager": "mgr", **{f"server-{i}": f"s{i}" for i in range(servers + spares)}}
        cluster = LocalCluster(
            str(tmp / "cluster"),
            servers=servers,
            manager_host=lab.address("mgr"),
            server_hosts=[lab.address(f"s{i}") for i in range(servers)],
            launch_prefix=lambda name: lab.prefix(where[name]),
            manager_args=manager_args,
            server_args=[*SERVER_ARGS, "--backend-allow", str(tmp)],
        )
        # Servers added later bind the spares' addresses (the cluster starts only the first ``servers``).
        cluster.server_hosts += [lab.address(f"s{i}") for i in range(servers, servers + spares)]
        try:
            cluster.start(timeout=60)
            env = LabCluster(lab, cluster, "lab", tmp)
            deadline = time.monotonic() + 30
            while True:
                states = [s["state"] for s in json.loads(env.kspeed(clients[0], "status", "--json"))["servers"]]
                if states.count("ready") == servers:
                    break
                if time.monotonic() > deadline:
                    raise AssertionError(f"servers not ready after 30 s: {states}")
                time.sleep(0.5)
            env.kspeed(clients[0], "dataset", "add", env.dataset, str(data))
            env.kspeed(clients[0], "preload", env.dataset)
            yield env
        finally:
            cluster.stop()


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


TCP_KEYS = (
    "TcpRetransSegs",
    "TcpExtTCPTimeouts",
    "TcpExtTCPLossProbes",
    "TcpExtTCPLostRetransmit",
    "TcpExtTCPFastRetrans",
    "TcpExtTCPSlowStartRetrans",
    "TcpExtTCPSpuriousRTOs",
)


def _network(lab: NetLab, client: str, servers: Sequence[str]) -> dict[str, dict[str, int]]:
    """Counters of the client's switch port and the servers' TCP stacks (summed)."""
    tcp: dict[str, int] = {}
    for host in servers:
        for key, value in lab.tcp_counters(host).items():
            if key in TCP_KEYS:
                tcp[key] = tcp.get(key, 0) + value
    return {"port": lab.port_stats(client), "servers_tcp": tcp}


def _measured(lab: NetLab, client: str, servers: Sequence[str], run) -> tuple[dict, dict]:
    """``run()``'s record and what the network counted meanwhile (drops, retransmits)."""
    before = _network(lab, client, servers)
    record = run()
    after = _network(lab, client, servers)
    return record, {part: _delta(after[part], before[part]) for part in after}


def _summary(record: dict, net: dict | None = None) -> dict:
    keys = (
        "batches",
        "bytes",
        "wall_s",
        "bytes_per_s",
        "batches_per_s",
        "first_wait_s",
        "wait_mean_ms",
        "wait_p50_ms",
        "wait_p90_ms",
        "wait_p99_ms",
        "wait_max_ms",
        "epochs",
        "rail",
        "env",
    )
    out = {k: record[k] for k in keys}
    out["pacing_traced"] = sum(1 for s in record["trace"] if s["pacing"] is not None)
    if net is not None:
        out["network"] = net
    return out


def _line(name: str, s: dict) -> str:
    net = s.get("network", {})
    port, tcp = net.get("port", {}), net.get("servers_tcp", {})
    return (
        f"{name:<12} p50 {s['wait_p50_ms']:7.1f} ms  p99 {s['wait_p99_ms']:7.1f} ms  max {s['wait_max_ms']:7.1f} ms"
        f"  {s['bytes_per_s'] / 1e6:6.1f} MB/s  {s['batches']} batches  port drops "
        f"{port.get('qdisc_dropped', 0)}  retrans {tcp.get('TcpRetransSegs', 0)}"
        f"  RTOs {tcp.get('TcpExtTCPTimeouts', 0)}"
    )


def _write(name: str, record: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(record, indent=1, default=str), encoding="utf-8")
    return path


def _windows(trace: list[dict], key: str = "window_bytes") -> list[tuple[float, float]]:
    """(wall time, pacing figure ``key``) of the trace samples that have it."""
    return [
        (s["time"], float(s["pacing"][key]))
        for s in trace
        if isinstance(s.get("pacing"), dict) and s["pacing"].get(key) is not None
    ]


@pytest.fixture
def incast(tmp_path) -> Iterator[LabCluster]:
    """Four servers and one client ``c0``, each in its own namespace, and a preloaded dataset."""
    rng = np.random.default_rng(7)
    sizes = np.exp(rng.uniform(np.log(24 * 1024), np.log(40 * 1024), INCAST_FILES)).astype(int).tolist()
    with lab_cluster(tmp_path, servers=4, clients=["c0"], sizes=sizes) as env:
        yield env


@pytest.mark.timeout(300)
def test_incast_pacing(incast):
    lab, servers = incast.lab, [f"s{i}" for i in range(4)]
    info = json.loads(incast.kspeed("c0", "dataset", "show", incast.dataset))
    batch_bytes = INCAST_BATCH * int(info["bytes"]) / int(info["samples"])
    batches = int(INCAST_SECONDS * parse_rate(INCAST_RATE) / 8 / batch_bytes)
    args = ("--batch-size", str(INCAST_BATCH), "--batches", str(batches), "--seed", "1")

    lab.limit_rate("c0", INCAST_RATE)
    runs, figures = {}, {}
    for pacing in ("off", "on"):
        record, net = _measured(
            lab, "c0", servers, lambda p=pacing: incast.run_client("c0", f"pacing-{p}", {"KSPEED_PACING": p}, *args)
        )
        runs[pacing] = record
        figures[f"pacing_{pacing}"] = _summary(record, net)

    # Third run: the port's rate drops mid-run; the pacing window must follow.
    lab.change_rate("c0", CHANGE_FROM)
    change_batches = int(
        (CHANGE_AFTER * parse_rate(CHANGE_FROM) + CHANGE_THEN * parse_rate(CHANGE_TO)) / 8 / batch_bytes
    )
    out = incast.tmp / "rate-change.json"

    def change_run() -> dict:
        proc = incast.start_client(
            "c0",
            out,
            {"KSPEED_PACING": "on"},
            "--batch-size",
            str(INCAST_BATCH),
            "--batches",
            str(change_batches),
            "--seed",
            "2",
            "--trace-interval",
            "0.1",
        )
        try:
            incast.wait_iterating(proc)
            time.sleep(CHANGE_AFTER)
            figures["changed_at"] = time.time()
            lab.change_rate("c0", CHANGE_TO)
        finally:
            record = incast.finish_client(proc, out)
        return record

    record, net = _measured(lab, "c0", servers, change_run)
    runs["change"] = record
    figures["rate_change"] = _summary(record, net)
    changed_at = figures["changed_at"]
    windows = _windows(record["trace"])
    before = [w for t, w in windows if t < changed_at]
    after = [w for t, w in windows if changed_at + SETTLE <= t]
    rates = _windows(record["trace"], "drain_rate")
    rate_before = [r for t, r in rates if t < changed_at]
    rate_after = [r for t, r in rates if changed_at + SETTLE <= t]
    figures["rate_change"].update(
        rate_before=CHANGE_FROM,
        rate_after=CHANGE_TO,
        window_median_before=statistics.median(before) if before else None,
        window_median_after=statistics.median(after) if after else None,
        drain_rate_median_before=statistics.median(rate_before) if rate_before else None,
        drain_rate_median_after=statistics.median(rate_after) if rate_after else None,
        window_trace=[(round(t - changed_at, 2), w) for t, w in windows],
    )
    figures.update(
        rate=INCAST_RATE,
        batch_size=INCAST_BATCH,
        files=INCAST_FILES,
        dataset_bytes=int(info["bytes"]),
        port_limit_bytes=PORT_BUFFER,
    )
    path = _write("incast", figures)

    print()
    print(
        f"incast: 4 servers -> 1 client at {INCAST_RATE}, batch {INCAST_BATCH} (~{batch_bytes / 1e6:.2f} MB), "
        f"{batches} batches per run; results in {path}"
    )
    print(_line("pacing off", figures["pacing_off"]))
    print(_line("pacing on", figures["pacing_on"]))
    print(_line("rate change", figures["rate_change"]))
    change = figures["rate_change"]
    print(
        f"window before/after the change: {change['window_median_before']} / {change['window_median_after']} "
        f"bytes; drain rate {change['drain_rate_median_before']} / {change['drain_rate_median_after']} B/s"
    )

    for name, record in runs.items():
        assert record["rail"] == "tcp", f"{name}: the client used {record['rail']}, not tcp"
    off, on = figures["pacing_off"], figures["pacing_on"]
    problems = []
    if not on["pacing_traced"]:
        problems.append("ds.stats() has no 'pacing' figures: the client does not pace yet")
    if not on["wait_p99_ms"] < off["wait_p99_ms"]:
        problems.append(
            f"p99 wait with pacing {on['wait_p99_ms']:.1f} ms is not below {off['wait_p99_ms']:.1f} ms without"
        )
    if not on["bytes_per_s"] >= 0.9 * off["bytes_per_s"]:
        problems.append(
            f"throughput with pacing {on['bytes_per_s'] / 1e6:.1f} MB/s is below 0.9x "
            f"{off['bytes_per_s'] / 1e6:.1f} MB/s without"
        )
    if not before or not after:
        problems.append(f"no pacing window traced before and {SETTLE:.0f} s after the rate change")
    elif not statistics.median(after) < SHRINK * statistics.median(before):
        problems.append(
            f"pacing window {statistics.median(after):.0f} bytes {SETTLE:.0f} s after the rate fell "
            f"{CHANGE_FROM} -> {CHANGE_TO} is not below {SHRINK}x {statistics.median(before):.0f} "
            "bytes before"
        )
    if rate_before and rate_after and not statistics.median(rate_after) < RATE_SHRINK * statistics.median(rate_before):
        problems.append(
            f"measured drain rate {statistics.median(rate_after):.0f} B/s {SETTLE:.0f} s after the rate "
            f"fell is not below {RATE_SHRINK}x {statistics.median(rate_before):.0f} B/s before"
        )
    assert not problems, "; ".join(problems)


@pytest.fixture
def credit(tmp_path) -> Iterator[LabCluster]:
    """Four servers (``s3`` delayed), two client namespaces with shaped ports, an evenly split dataset."""
    with lab_cluster(tmp_path, servers=4, clients=["c0", "c1"], sizes=[CREDIT_SIZE] * CREDIT_FILES) as env:
        env.lab.add_delay("s3", CREDIT_DELAY)
        for host in ("c0", "c1"):
            env.lab.limit_rate(host, CREDIT_RATE)
        yield env


@pytest.mark.timeout(300)
def test_adaptive_credit(credit):
    """Rank 0 reads from all four servers, one of them slow; rank 1 reads only from the three fast ones.

    With equal credit the slow server gets a quarter of rank 0's window, less than its latency needs
    for its quarter of the data, so every batch of rank 0 waits for it and rank 0 straggles; with
    adaptive credit it is granted further ahead and rank 0 keeps up with rank 1.
    """
    lab = credit.lab
    slow = lab.address("s3")
    figures: dict = {"delay": CREDIT_DELAY, "rate": CREDIT_RATE, "delay_method": None}
    for mode in ("equal", "adaptive"):
        start_at = time.time() + 8.0  # both ranks attach first, then start together
        procs = {}
        for rank, host in enumerate(("c0", "c1")):
            out = credit.tmp / f"credit-{mode}-r{rank}.json"
            avoid = ("--exclude", slow) if rank == 1 else ()
            procs[rank] = (
                credit.start_client(
                    host,
                    out,
                    {"KSPEED_CREDIT": mode, "KSPEED_PACING": "on"},
                    "--batch-size",
                    str(CREDIT_BATCH),
                    "--batches",
                    str(CREDIT_BATCHES),
                    "--seed",
                    str(rank),
                    *avoid,
                    "--start-at",
                    str(start_at),
                ),
                out,
            )
        records = {rank: credit.finish_client(proc, out) for rank, (proc, out) in procs.items()}
        for record in records.values():
            assert record["rail"] == "tcp"
        means = [records[r]["wait_mean_ms"] for r in (0, 1)]
        figures[mode] = {
            "ranks": {r: _summary(records[r]) for r in (0, 1)},
            "spread_ms": max(means) - min(means),
            "ratio": max(means) / min(means) if min(means) > 0 else float("inf"),
            "credits_rank0": next((s["pacing"]["credits"] for s in reversed(records[0]["trace"]) if s["pacing"]), None),
        }
    figures["delay_method"] = lab.delay_method("s3")
    path = _write("credit", figures)
    print()
    print(
        f"credit: rank 0 <- s0..s3, rank 1 <- s0..s2; s3 {CREDIT_DELAY} late ({figures['delay_method']}); ports "
        f"{CREDIT_RATE}; batch {CREDIT_BATCH} x {CREDIT_SIZE // 1024} KiB, {CREDIT_BATCHES} batches per rank; "
        f"results in {path}"
    )
    for mode in ("equal", "adaptive"):
        ranks = figures[mode]["ranks"]
        print(
            f"{mode:<9} mean wait r0 {ranks[0]['wait_mean_ms']:6.2f} ms  r1 {ranks[1]['wait_mean_ms']:6.2f} ms"
            f"  spread {figures[mode]['spread_ms']:6.2f} ms  ratio {figures[mode]['ratio']:5.2f}"
            f"  p99 r0 {ranks[0]['wait_p99_ms']:6.1f}  r1 {ranks[1]['wait_p99_ms']:6.1f} ms"
            f"  MB/s r0 {ranks[0]['bytes_per_s'] / 1e6:6.1f}  r1 {ranks[1]['bytes_per_s'] / 1e6:6.1f}"
            f"  rank 0 credits {figures[mode]['credits_rank0']}"
        )
    equal, adaptive = figures["equal"], figures["adaptive"]
    assert adaptive["spread_ms"] < equal["spread_ms"], (
        f"spread of the ranks' mean data wait with adaptive credit {adaptive['spread_ms']:.2f} ms (ratio "
        f"{adaptive['ratio']:.2f}) is not below {equal['spread_ms']:.2f} ms (ratio {equal['ratio']:.2f}) with equal "
        "credit"
    )
