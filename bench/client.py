"""Samples per second into a training loop: KSpeed against its peers, all measured in the same run.

    python bench/client.py --json bench/results/client.json [--quick] [--sizes 32K,24-40K,1M]
                           [--systems kspeed-shm,redis] [--seconds 3] [--dataset-mib 512] [--keep]

For every sample size (those of Fig. 9 of the KSpeed paper, plus a variable 24-40 KiB set) the
benchmark writes class folders of random files, warms the page cache, registers and preloads them
on a private local cluster (one manager, two servers on loopback, auth off, pools under /dev/shm)
and loads them into a private ``redis-server``. Then each system feeds the same loop: whole
shuffled epochs, one warm-up epoch, the first byte of every sample read (and checked against the
set's checksum), batch waits timed around ``next()``. Systems:

- ``kspeed-shm``, ``kspeed-tcp``: the KSpeed client; servers write batches into its receive ring.
- ``dataloader-w0/1/2``: ``torch.utils.data.DataLoader`` over the files with 0, 1, 2 workers.
- ``redis``: a Redis pull cache, pipelined GETs per batch (the Alluxio-like baseline).
- ``grpc-pull``: KSpeed's own ``Read`` RPC, packed, several batches in flight.

and, delivering into GPU memory (the samples arrive as CUDA tensors, whose first bytes the loop
gathers on the device and sums with one ``.item()``, which waits for the copy):

- ``kspeed-shm-cuda``: the KSpeed client on ``shm`` with ``device="cuda"``.
- ``dataloader-pin-w0/2/4/8/16``: the DataLoader with 0, 2, 4, 8, 16 workers, ``pin_memory=True`` and each
  batch moved with ``.to("cuda", non_blocking=True)`` (``_peers.DataLoaderSource``).

The CUDA systems are left out of the default set where no CUDA device is available; asked for
there, each records an error row. The JSON holds the machine, its limits (one-core memcpy, raw
loopback TCP and, with a CUDA system, the GPU's host-to-device bandwidth from pinned memory, all
measured first), one result per system and size, and the ratios the targets are stated in.
Everything started is stopped and every temporary file removed, also on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _cluster import BenchCluster, KSpeedSource
from _common import GIB, MIB, h2d_gbps, machine_info, memcpy_gbps, socket_gbps, stop_on_sigterm, write_json
from _datasets import SampleSet, SizeSpec, batch_size_for, make_sample_set, parse_sizes, sample_count, warm_page_cache
from _loop import measure
from _peers import DataLoaderSource, GrpcPullSource, RedisServer, RedisSource
from _report import print_table, target_ratios

CUDA_SYSTEMS = ["kspeed-shm-cuda", *(f"dataloader-pin-w{n}" for n in (0, 2, 4, 8, 16))]
SYSTEMS = [
    "kspeed-shm",
    "kspeed-tcp",
    "dataloader-w0",
    "dataloader-w1",
    "dataloader-w2",
    "redis",
    "grpc-pull",
    *CUDA_SYSTEMS,
]
NO_CUDA = "not available: no CUDA device"
SIZES = "32K,24-40K,256K,1M,4M,16M"
FULL = {"dataset_bytes": 512 * MIB, "seconds": 3.0, "min_batches": 4}
QUICK = {"dataset_bytes": 64 * MIB, "seconds": 0.5, "min_batches": 2}


def open_source(
    system: str,
    samples: SampleSet,
    batch_size: int,
    cluster: BenchCluster | None,
    redis_server: RedisServer | None,
    info,
):
    """The source of ``system`` for one sample set."""
    if system.startswith("kspeed-"):
        rail, _, device = system.removeprefix("kspeed-").partition("-")  # "shm", "tcp" or "shm-cuda"
        return KSpeedSource(cluster.address, samples, batch_size, rail=rail, device=device or "cpu")
    if system.startswith("dataloader-w"):
        return DataLoaderSource(samples, batch_size, num_workers=int(system.removeprefix("dataloader-w")))
    if system.startswith("dataloader-pin-w"):
        workers = int(system.removeprefix("dataloader-pin-w"))
        return DataLoaderSource(samples, batch_size, num_workers=workers, device="cuda")
    if system == "redis":
        return RedisSource(redis_server, samples, batch_size)
    if system == "grpc-pull":
        return GrpcPullSource(info, samples, batch_size)
    raise ValueError(f"unknown system {system!r}; known: {', '.join(SYSTEMS)}")


def run_system(system: str, samples: SampleSet, batch_size: int, seconds: float, **peers) -> dict:
    """Measure one system on one sample set; a failure is recorded, not raised."""
    row = {"system": system, "size": samples.spec.label, "batch_size": batch_size}
    if system in CUDA_SYSTEMS and not torch.cuda.is_available():
        return {**row, "error": NO_CUDA}
    try:
        source = open_source(system, samples, batch_size, **peers)
    except ImportError as exc:
        return {**row, "error": f"not available: {exc}"}
    except Exception as exc:  # one system's failure must not end the run
        return {**row, "error": f"{type(exc).__name__}: {exc}"}
    try:
        m = measure(
            source, count=samples.count, epoch_bytes=samples.total_bytes, checksum=samples.checksum, seconds=seconds
        )
    except Exception as exc:
        return {**row, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        source.close()
    return {
        **row,
        "samples_per_s": round(m.samples_per_s, 1),
        "gbps": round(m.gbps, 4),
        "batch_wait_p50_ms": round(m.wait_ms(50), 4),
        "batch_wait_p99_ms": round(m.wait_ms(99), 4),
        "epochs": m.epochs,
        "samples": m.samples,
        "seconds": round(m.seconds, 3),
    }


def measure_limits(seconds: float, cuda: bool = False) -> dict:
    """One-core memcpy (1 MiB slices from a 1 GiB pool) and raw loopback TCP, before any daemon starts.

    With ``cuda`` (a CUDA system is measured and a device is available) also the device's name and
    its host-to-device bandwidth from a 1 GiB pinned pool in 64 MiB copies (``h2d_gbps``) and in
    1 MiB copies (``h2d_1mib_gbps``); a failure there is recorded as ``h2d_error``.
    """
    pool = np.full(GIB, 0x5A, dtype=np.uint8)
    try:
        memcpy = memcpy_gbps(pool, MIB, seconds)
    finally:
        del pool
    limits = {"memcpy_gbps": round(memcpy, 3), "socket_gbps": round(socket_gbps(seconds), 3)}
    if cuda:
        try:
            limits["device_name"] = torch.cuda.get_device_name()
            limits["h2d_gbps"] = round(h2d_gbps(64 * MIB, seconds), 3)
            limits["h2d_1mib_gbps"] = round(h2d_gbps(MIB, seconds), 3)
        except Exception as exc:  # the CPU limits and the other systems still count
            limits["h2d_error"] = f"{type(exc).__name__}: {exc}"
    return limits


def run_size(spec: SizeSpec, index: int, args, data_root: str, systems: list[str], cluster, redis_server) -> list:
    """Write, load, measure and remove the sample set of one size."""
    name = f"bench-{index}"
    print(f"[{spec.label}] writing ~{args.dataset_bytes / MIB:.0f} MiB ...", file=sys.stderr, flush=True)
    samples = make_sample_set(data_root, name, spec, args.dataset_bytes, args.min_batches, seed=index)
    info = None
    try:
        warm_page_cache(samples)
        if cluster is not None:
            t0 = time.perf_counter()
            info = cluster.load(samples)
            print(
                f"[{spec.label}] {samples.count} samples preloaded in {time.perf_counter() - t0:.1f} s",
                file=sys.stderr,
                flush=True,
            )
        if redis_server is not None:
            redis_server.load(samples)
        batch_size = batch_size_for(spec)
        rows = []
        for system in systems:
            row = run_system(
                system, samples, batch_size, args.seconds, cluster=cluster, redis_server=redis_server, info=info
            )
            rows.append(row)
            if "error" in row:
                print(f"[{spec.label}] {system:17s} {row['error']}", file=sys.stderr, flush=True)
            else:
                print(
                    f"[{spec.label}] {system:17s} {row['samples_per_s']:>11,.0f} samples/s {row['gbps']:7.3f} GB/s"
                    f"  wait p50 {row['batch_wait_p50_ms']:.3f} ms p99 {row['batch_wait_p99_ms']:.3f} ms",
                    file=sys.stderr,
                    flush=True,
                )
        return rows
    finally:
        if info is not None:
            cluster.unload(name)
        shutil.rmtree(samples.root, ignore_errors=True)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", default=None, help="output path (stdout when omitted)")
    parser.add_argument("--quick", action="store_true", help="64 MiB per size and 0.5 s per system")
    parser.add_argument("--sizes", default=SIZES, help=f"comma list; a lo-hi item is a variable set (default {SIZES})")
    parser.add_argument(
        "--systems",
        default=None,
        help=f"comma list of {', '.join(SYSTEMS)} (default: all; the CUDA ones only where CUDA is available)",
    )
    parser.add_argument("--seconds", type=float, default=None, help="measured seconds per system, whole epochs")
    parser.add_argument("--dataset-mib", type=int, default=None, help="MiB of samples per size")
    parser.add_argument("--keep", action="store_true", help="keep the sample files and cluster logs (printed)")
    args = parser.parse_args(argv)
    preset = QUICK if args.quick else FULL
    args.seconds = args.seconds if args.seconds is not None else preset["seconds"]
    args.dataset_bytes = args.dataset_mib * MIB if args.dataset_mib else preset["dataset_bytes"]
    args.min_batches = preset["min_batches"]
    unknown = sorted(set(args.systems.split(",")) - set(SYSTEMS)) if args.systems is not None else []
    if unknown:
        parser.error(f"unknown system(s) {', '.join(unknown)}; known: {', '.join(SYSTEMS)}")
    return args


def default_systems() -> list[str]:
    """Every system, less the CUDA ones where no CUDA device is available."""
    cuda = torch.cuda.is_available()
    return [s for s in SYSTEMS if cuda or s not in CUDA_SYSTEMS]


def main(argv=None) -> None:
    args = parse_args(argv)
    stop_on_sigterm()
    requested = args.systems.split(",") if args.systems is not None else default_systems()
    systems = [s for s in SYSTEMS if s in requested]
    specs = parse_sizes(args.sizes)
    started = time.perf_counter()
    cuda_available = torch.cuda.is_available()
    cuda = cuda_available and any(s in CUDA_SYSTEMS for s in systems)
    runnable = [s for s in systems if cuda_available or s not in CUDA_SYSTEMS]  # the others record an error row
    limits = measure_limits(max(0.5, min(args.seconds, 1.0)), cuda=cuda)
    print(f"limits: {limits}", file=sys.stderr, flush=True)
    results = []
    data_root = tempfile.mkdtemp(prefix="kspeed-bench-data-")
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: args.keep or shutil.rmtree(data_root, ignore_errors=True))
        cluster = redis_server = None
        if any(s.startswith("kspeed-") or s == "grpc-pull" for s in runnable):
            largest = max(sample_count(s, args.dataset_bytes, args.min_batches) * s.hi for s in specs)
            cluster = stack.enter_context(BenchCluster(data_root, largest, keep=args.keep))
        if "redis" in runnable:
            redis_server = RedisServer()
            stack.callback(redis_server.stop)
            redis_server.start()
        for index, spec in enumerate(specs):
            results.extend(run_size(spec, index, args, data_root, systems, cluster, redis_server))
        if args.keep:
            print(f"kept: {data_root}" + (f" and {cluster.state_dir}" if cluster else ""), file=sys.stderr)
    doc = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "machine": machine_info(),
        "limits": limits,
        "config": {
            "servers": 2,
            "dataset_bytes_per_size": args.dataset_bytes,
            "min_batches": args.min_batches,
            "seconds_per_system": args.seconds,
            "warmup_epochs": 1,
            "touch": "first byte of every sample, summed and checked per epoch (CUDA samples: gathered on the "
            "device and summed there, one .item() per batch)",
            "batch_sizes": {str(s.label): batch_size_for(s) for s in specs},
        },
        "results": results,
        "targets": target_ratios(results, limits),
        "wall_seconds": round(time.perf_counter() - started, 1),
    }
    print_table(doc, file=sys.stderr)
    write_json(args.json, doc)


if __name__ == "__main__":
    main()
