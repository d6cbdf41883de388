"""Benchmark of the data-plane rails against the machine's own limits, measured in the same run.

    python bench/rails.py --json bench/results/rails.json [--quick] [--sizes 32K,1M] [--seconds 1]

Each case starts a receiver in this process, registers a ring of four batches per writer (8 MiB
for one writer of 32 KiB), and spawns 1 or 4 writer processes that write payloads drawn at random
from a shared 1 GiB pool (so copies come from RAM, not from cache) into consecutive slots, with one
immediate per write, a batch at a time with ``write_batch``. Throughput is measured at the
receiver: all completions of every write counted, from the start signal to the last completion.

Limits of the same run: one-core memcpy from the pool (1 MiB and 32 KiB slices); a raw loopback
socket stream with hot buffers; and, per tcp size, a raw stream carrying the same traffic as the
rail (random slices of the pool gathered like a batch, received into a ring of the same size),
against which tcp is rated.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import GIB, KIB, MIB, machine_info, memcpy_gbps, random_starts, socket_gbps, write_json

from kspeed.rdma.base import RegionKey
from kspeed.rdma.memory import MemfdSegment
from kspeed.rdma.options import RailOptions
from kspeed.rdma.rails import available_rails, get_rail

SIZES = [4 * KIB, 32 * KIB, 256 * KIB, MIB, 4 * MIB, 16 * MIB]
BATCH_BYTES = 4 * MIB  # a batch holds at most 64 writes and about this many bytes
RING_BATCHES = 4  # a realistic receive ring: a few batches per writer in flight
OPTIONS = RailOptions(io_timeout=30.0)


def _parse_size(text: str) -> int:
    text = text.strip().upper()
    for suffix, mult in (("K", KIB), ("M", MIB), ("G", GIB)):
        if text.endswith(suffix):
            return int(float(text[:-1]) * mult)
    return int(text)


def _batch(size: int) -> int:
    return max(1, min(64, BATCH_BYTES // size))


def _writer(rail_name, material, key_blob, pool_path, pool_bytes, size, seconds, seed, start, results):
    """One writer process: attach the pool, dial, write batches of random slices until time is up."""
    pool = MemfdSegment.attach(os.open(pool_path, os.O_RDWR), pool_bytes)
    source = pool.array()
    key = RegionKey.from_bytes(key_blob)
    writer = get_rail(rail_name).connect(material, OPTIONS)
    batch = _batch(size)
    starts = random_starts(pool_bytes, size, max(8192, batch) // batch * batch, seed=seed).reshape(-1, batch)
    slots = key.length // size // batch * batch
    dsts = [np.arange(k, k + batch, dtype=np.int64) * size for k in range(0, slots, batch)]
    steps = np.arange(batch, dtype=np.uint32)
    writes = 0
    start.wait()
    t0 = time.perf_counter()
    k = 0
    while time.perf_counter() - t0 < seconds:
        writer.write_batch(key, source, starts[k % len(starts)], size, dsts[k % len(dsts)], steps + writes)
        writes += batch
        k += 1
    results.put((writer.conn, writes))
    writer.close()
    del source
    pool.close()


def run_case(rail_name: str, pool: MemfdSegment, size: int, writers: int, seconds: float) -> dict:
    """Throughput of ``writers`` processes writing ``size``-byte payloads into one receiver."""
    ctx = mp.get_context("spawn")
    rail = get_rail(rail_name)
    receiver = rail.listen(OPTIONS)
    ring_bytes = writers * RING_BATCHES * _batch(size) * size
    ring = receiver.register(ring_bytes)
    start = ctx.Event()
    results = ctx.Queue()
    share = ring_bytes // writers // size * size
    procs = []
    for n in range(writers):
        key = ring.key.slice(n * share, share)
        procs.append(
            ctx.Process(
                target=_writer,
                args=(
                    rail_name,
                    receiver.material,
                    key.to_bytes(),
                    f"/proc/{os.getpid()}/fd/{pool.fd}",
                    pool.nbytes,
                    size,
                    seconds,
                    n + 7,
                    start,
                    results,
                ),
            )
        )
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + 60
    while len(receiver.connections) < writers and time.monotonic() < deadline:
        receiver.poll(0.05)
    counted = 0
    t0 = time.perf_counter()
    start.set()
    t_last = t0
    expected = None
    reported = []
    while expected is None or counted < expected:
        done = receiver.poll(0.2)
        if len(done):
            counted += len(done)
            t_last = time.perf_counter()
        while not results.empty():
            reported.append(results.get())
        if len(reported) == writers:
            expected = sum(n for _, n in reported)
        if time.perf_counter() - t0 > seconds + 120:
            raise SystemExit(f"{rail_name} {size} x{writers}: lost completions ({counted} of {expected})")
    for proc in procs:
        proc.join(30)
    receiver.close()
    elapsed = t_last - t0
    return {
        "rail": rail_name,
        "size": size,
        "writers": writers,
        "writes": counted,
        "seconds": round(elapsed, 4),
        "gbps": counted * size / elapsed / 1e9,
        "writes_per_s": counted / elapsed,
        "ring_bytes": ring_bytes,
    }


def _per_write(call, rounds: int, writes_per_round: int) -> tuple[float, float]:
    """(wall, writer-thread CPU) µs per write of ``rounds`` calls of ``call(i)``."""
    w0, c0 = time.perf_counter(), time.thread_time()
    for i in range(rounds):
        call(i)
    n = rounds * writes_per_round
    return (time.perf_counter() - w0) / n * 1e6, (time.thread_time() - c0) / n * 1e6


def seam_overhead_us(rail_name: str, n: int = 20480) -> dict:
    """Fixed cost per write (µs) of 64-byte writes from the calling thread, for each write call.

    Wall time includes waiting for the receiver (on tcp the receiver process, which handles each
    64-byte write apart, is the slower end); the writer thread's CPU time is the seam's own cost.
    """
    rail = get_rail(rail_name)
    receiver = rail.listen(OPTIONS)
    ring = receiver.register(16 * MIB)
    writer = rail.connect(receiver.material, OPTIONS)
    source = np.ones(MIB, np.uint8)
    srcs = [source[i * 64 : (i + 1) * 64] for i in range(256)]
    key = ring.key
    ops = [(srcs[i], i * 64, i) for i in range(256)]
    src_offsets = np.arange(256, dtype=np.int64) * 64
    dst_offsets = src_offsets * 3  # not adjacent: one remote write per op, nothing coalesced
    imms = np.arange(256, dtype=np.uint32)

    def many(_):
        writer.write_many(key, ops)
        receiver.poll(0)

    def batch(_):
        writer.write_batch(key, source, src_offsets, 64, dst_offsets, imms)
        receiver.poll(0)

    out = {}
    for name, call, rounds, per in (
        ("write", lambda i: writer.write(key, srcs[i % 256], (i % 1024) * 64), n, 1),
        ("write_many", many, n // 256, 256),
        ("write_batch", batch, n // 256, 256),
    ):
        wall, cpu = _per_write(call, rounds, per)
        out[f"{name}_us"], out[f"{name}_cpu_us"] = round(wall, 3), round(cpu, 3)
    writer.close()
    receiver.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", default=None, help="output path (stdout when omitted)")
    parser.add_argument("--quick", action="store_true", help="short runs (0.3 s per case)")
    parser.add_argument("--seconds", type=float, default=1.0, help="seconds per case")
    parser.add_argument("--sizes", default=None, help="comma list, e.g. 4K,32K,1M")
    parser.add_argument("--writers", default="1,4", help="comma list of writer counts")
    parser.add_argument("--rails", default=None, help="comma list (default: every available rail)")
    args = parser.parse_args()
    seconds = 0.3 if args.quick else args.seconds
    sizes = [_parse_size(s) for s in args.sizes.split(",")] if args.sizes else SIZES
    rails = args.rails.split(",") if args.rails else available_rails()
    writer_counts = [int(x) for x in args.writers.split(",")]

    pool = MemfdSegment.create(GIB, "bench-pool")
    arr = pool.array()
    arr[:] = 0x5A  # touch every page so the pool is resident
    span = max(seconds, 0.5)
    limits = {
        "memcpy_gbps": memcpy_gbps(arr, MIB, span),
        "memcpy_32k_gbps": memcpy_gbps(arr, 32 * KIB, span),
        "socket_hot_gbps": socket_gbps(span),
    }
    if "tcp" in rails:  # the raw stream carrying the traffic of each tcp case (one writer's ring)
        limits["socket_gbps_by_size"] = {
            size: socket_gbps(span, pool.view, size, RING_BATCHES * _batch(size) * size, _batch(size)) for size in sizes
        }
    print(f"limits: {limits}", file=sys.stderr)
    results = []
    for rail in rails:
        for size in sizes:
            for writers in writer_counts:
                res = run_case(rail, pool, size, writers, seconds)
                if rail == "tcp":
                    res["limit"], limit = "socket_gbps", limits["socket_gbps_by_size"][size]
                    res["vs_socket_hot"] = res["gbps"] / limits["socket_hot_gbps"]
                else:
                    res["limit"], limit = "memcpy_gbps", limits["memcpy_gbps"]
                res["vs_limit"] = res["gbps"] / limit
                print(
                    f"{rail:4s} {size:>9d} B x{writers}: {res['gbps']:.2f} GB/s "
                    f"{res['writes_per_s']:.0f} writes/s ({res['vs_limit']:.2f} of limit)",
                    file=sys.stderr,
                )
                results.append(res)
    overhead = {rail: seam_overhead_us(rail) for rail in rails}
    print(f"seam overhead: {overhead}", file=sys.stderr)
    del arr
    pool.close()
    doc = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "machine": machine_info(),
        "limits": limits,
        "results": results,
        "seam_overhead_us": overhead.get("shm", next(iter(overhead.values())))["write_batch_cpu_us"],
        "seam_overhead_detail_us": overhead,
    }
    write_json(args.json, doc)


if __name__ == "__main__":
    main()
