"""Preload throughput against a plain sequential single-threaded reader of the same files.

Four cases: small (4-64 KiB) and large (1-8 MiB) samples, each from a warm page cache (``file``)
and from the throttled local file system (``slowfile``, a fixed latency per open standing in for
remote storage). The figure of merit is the speed-up of the parallel preload (tuned threads, direct
reads into pool regions, crc32c per sample) over the sequential reader; from the throttled
backend it must be at least 8x. As a second reference, a sequential reader that does the
preload's own work (every byte into fresh pool memory, crc32c per sample) is timed too: the
plain reader's bytes land in one recycled, cache-hot buffer and are never checksummed.

    python bench/preload.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import google_crc32c
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import write_files

from kspeed.server.backend.access import Backend
from kspeed.server.backend.allowlist import AllowList
from kspeed.server.backend.sources import open_source
from kspeed.server.hosting.preload import Preloader
from kspeed.server.memory.pool import MemoryPool
from kspeed.testing.throttle import SlowFileSystem

TARGET_SPEEDUP = 8.0
KIB, MIB = 1 << 10, 1 << 20


def machine_info() -> dict:
    """Cores, kernel and Python of this machine (figures only compare on the same kind of box)."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cores": os.cpu_count(),
        "cores_usable": usable,
        "machine": platform.machine(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "numpy": np.__version__,
    }


def write_json(path: str | None, doc: dict) -> None:
    """Write ``doc`` as indented JSON to ``path`` (stdout when ``None``)."""
    text = json.dumps(doc, indent=2)
    if path is None:
        print(text)
        return
    Path(path).write_text(text + "\n")


def sequential(paths: list[str], latency: float) -> float:
    """Seconds for one thread to open and read every file (through the throttled fs if latency)."""
    fs = SlowFileSystem(latency=latency) if latency else None
    t0 = time.perf_counter()
    for p in paths:
        if fs is None:
            with open(p, "rb") as f:
                f.read()
        else:
            with fs.open(p, "rb") as f:
                f.read()
    return time.perf_counter() - t0


def sequential_into_pool(paths: list[str], pool_dir: Path, region_size: int) -> float:
    """Seconds for one thread to read every file into fresh pool memory and checksum it.

    The least work a preload must do, sequentially: unlike :func:`sequential`, whose reads land
    in one recycled, cache-hot buffer, every byte is written to its own place in a region and
    its crc32c computed. Not throttled (it is the warm-cache reference).
    """
    sizes = [os.path.getsize(p) for p in paths]
    pool = MemoryPool.create(pool_dir, (sum(sizes) // region_size + 2) * region_size, region_size=region_size)
    try:
        pool.allocate("seq", range(pool.region_count))
        arrays = [pool.array(i) for i in range(pool.region_count)]
        t0 = time.perf_counter()
        k, off = 0, 0
        for p, n in zip(paths, sizes, strict=True):
            if off + n > region_size:
                k, off = k + 1, 0
            dst = arrays[k][off : off + n]
            with open(p, "rb", buffering=0) as f:
                f.readinto(dst)
            google_crc32c.value(dst)
            off += n
        return time.perf_counter() - t0
    finally:
        pool.destroy()


def preload(uri: str, backend: Backend, pool_dir: Path, region_size: int, threads: int) -> tuple[float, int]:
    """Seconds for a full preload of ``uri`` into a fresh pool, and the samples it read."""
    src = open_source(backend, "bench", uri)
    n = Preloader.regions_needed(src, region_size)
    pool = MemoryPool.create(pool_dir, n * region_size, region_size=region_size)
    try:
        pool.allocate("bench", range(n))
        pre = Preloader(src, pool, threads=threads)
        t0 = time.perf_counter()
        result = pre.preload()
        elapsed = time.perf_counter() - t0
        if not result.complete:
            raise SystemExit(f"preload incomplete: {result.errors[:3]}")
        return elapsed, result.read_samples
    finally:
        pool.destroy()


def run_case(
    name: str, root: Path, total: int, backend: Backend, protocol: str, latency: float, args: argparse.Namespace
) -> dict:
    src = open_source(backend, "bench", str(root))
    paths = [src.path(i) for i in range(src.count)]
    sequential(paths, 0.0)  # warm the page cache
    seq = min(sequential(paths, latency) for _ in range(args.repeat))
    into_pool = min(
        sequential_into_pool(paths, args.pool_dir / f"{name}-seq", args.region_size) for _ in range(args.repeat)
    )
    runs = [
        preload(f"{protocol}://{root}", backend, args.pool_dir / name, args.region_size, args.threads)
        for _ in range(args.repeat)
    ]
    par = min(t for t, _ in runs)
    row = {
        "case": name,
        "protocol": protocol,
        "latency_ms": latency * 1e3,
        "samples": src.count,
        "bytes": total,
        "threads": args.threads,
        "sequential_MBps": total / seq / 1e6,
        "sequential_samples_per_s": src.count / seq,
        "preload_MBps": total / par / 1e6,
        "preload_samples_per_s": src.count / par,
        "speedup": seq / par,
        "sequential_into_pool_MBps": total / into_pool / 1e6,
        "speedup_vs_into_pool": into_pool / par,
    }
    if latency:
        row["target_speedup"] = TARGET_SPEEDUP
        row["meets_target"] = row["speedup"] >= TARGET_SPEEDUP
    print(
        f"{name:14s} seq {row['sequential_MBps']:8.1f} MB/s {row['sequential_samples_per_s']:8.0f}/s   "
        f"preload {row['preload_MBps']:8.1f} MB/s {row['preload_samples_per_s']:8.0f}/s   "
        f"x{row['speedup']:.2f}   (seq into pool {row['sequential_into_pool_MBps']:8.1f} MB/s: "
        f"x{row['speedup_vs_into_pool']:.2f})",
        file=sys.stderr,
    )
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write results to this file (default stdout)")
    ap.add_argument("--small", type=int, default=3000, help="small-sample files (warm cache)")
    ap.add_argument("--large", type=int, default=60, help="large-sample files (warm cache)")
    ap.add_argument("--throttled-small", type=int, default=1000, help="small files for the throttled case")
    ap.add_argument("--throttled-large", type=int, default=40, help="large files for the throttled case")
    ap.add_argument("--latency-ms", type=float, default=4.0, help="added latency per open (slowfile)")
    ap.add_argument("--threads", type=int, default=32, help="preload threads")
    ap.add_argument("--region-size", type=int, default=32 * MIB, help="pool region size in bytes")
    ap.add_argument("--repeat", type=int, default=2, help="runs per case (best is kept)")
    ap.add_argument("--data-dir", help="where to write the files (default: a temporary directory)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    work = Path(args.data_dir or tempfile.mkdtemp(prefix="kspeed-bench-preload-"))
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else work
    args.pool_dir = Path(tempfile.mkdtemp(prefix="kspeed-bench-pool-", dir=shm))
    latency = args.latency_ms / 1e3
    backend = Backend(AllowList([str(work), f"slowfile://{work}"]), {"slowfile": {"latency": latency}})
    cases = [
        ("small-warm", args.small, 4 * KIB, 64 * KIB, "file", 0.0),
        ("large-warm", args.large, 1 * MIB, 8 * MIB, "file", 0.0),
        ("small-slow", args.throttled_small, 4 * KIB, 64 * KIB, "slowfile", latency),
        ("large-slow", args.throttled_large, 1 * MIB, 8 * MIB, "slowfile", latency),
    ]
    rows = []
    t0 = time.perf_counter()
    try:
        for i, (name, count, lo, hi, protocol, lat) in enumerate(cases):
            root = work / name
            total = write_files(root, count, lo, hi, seed=i)
            rows.append(run_case(name, root, total, backend, protocol, lat, args))
    finally:
        shutil.rmtree(args.pool_dir, ignore_errors=True)
        if not args.data_dir:
            shutil.rmtree(work, ignore_errors=True)
    write_json(
        args.json,
        {
            "benchmark": "preload",
            "machine": machine_info(),
            "seconds": time.perf_counter() - t0,
            "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "results": rows,
        },
    )


if __name__ == "__main__":
    main()
