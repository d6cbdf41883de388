"""One training rank that only reads: run inside a lab namespace, it records what the loop waited.

::

    python -m tests.integration.netlab_client --manager 10.231.9.10:7070 --dataset imgs \\
        --batch-size 16 --batches 400 --out result.json [--rank 0 --world 2 --sampler sharded]

It attaches to a registered dataset through the public API (``KSpeedClient``, ``client.dataset``),
iterates ``--batches`` batches as fast as it can (touching one byte of every sample, then releasing
the batch), and writes one JSON file with the wait of every batch (the time spent getting it from
the iterator; the first batch of an epoch includes starting the epoch), the wall time and
throughput, every ``--trace-interval`` seconds a sample of ``ds.stats().get("pacing")`` (``None``
while the client has no pacing), and the final ``ds.stats()``. With ``--verify DIR`` it also records
the IDs of every batch and compares every sample with the file of its ID in ``DIR`` (the files'
names sorted are in ID order), recording the IDs whose bytes differ. It prints ``iterating`` on stdout
when the loop starts, so a test can act on the network while it runs. On failure it prints the
error on stderr and exits with status 1.

Samplers: ``shuffle`` is the built-in seeded shuffle (``DistributedSampler`` for ``--world`` > 1);
``sharded`` gives rank R the contiguous R-th 1/W of the sample IDs in order, so when every server
owns a contiguous range of IDs of the same size, each rank reads from one server.

Inside a namespace every server reports the same hostname as the client, so ``--rail`` defaults
to ``tcp`` (``auto`` would pick ``shm``, which never touches the network), and the receiver binds
``--data-host`` (default: this namespace's address towards the manager).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["main", "run"]


def address_towards(address: str) -> str:
    """The local IP address the kernel would use to reach ``host:port`` (no packet is sent)."""
    host, _, port = address.rpartition(":")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, int(port)))
        return probe.getsockname()[0]


def _jsonable(value: Any) -> Any:
    """``json.dump`` fallback for numpy scalars and arrays; anything else becomes its ``str``."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


class Tracer:
    """Samples ``ds.stats()`` every ``interval`` seconds on a background thread until :meth:`stop`.

    Each sample is ``{"time": wall-clock seconds, "bytes": delivered so far, "ring_used": bytes,
    "pacing": ds.stats().get("pacing")}``.
    """

    def __init__(self, ds: Any, interval: float) -> None:
        self.samples: list[dict[str, Any]] = []
        self.errors = 0
        self._ds = ds
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="netlab-trace", daemon=True)

    def start(self) -> None:
        """Take the first sample now, then every interval."""
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                stats = self._ds.stats()
                pacing = stats.get("pacing")
                self.samples.append(
                    {
                        "time": time.time(),
                        "bytes": stats.get("bytes"),
                        "ring_used": stats.get("ring_used"),
                        "pacing": json.loads(json.dumps(pacing, default=_jsonable)),
                    }
                )
            except Exception:  # a failed sample must not end the run; it is counted instead
                self.errors += 1
            if self._stop.wait(self._interval):
                return

    def stop(self) -> None:
        """Stop sampling and join the thread."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)


def _percentile_ms(waits: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(waits) * 1e3, q)) if waits else 0.0


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Attach, iterate ``args.batches`` batches and return the record written to ``--out``.

    Raises:
        KSpeedError: the cluster refused or failed (named by the client library).
        ValueError: bad arguments.
    """
    from kspeed import KSpeedClient
    from kspeed.config import ClientConfig, load_config

    if not 0 <= args.rank < args.world:
        raise ValueError(f"--rank must be in 0..{args.world - 1}, got {args.rank}")
    data_host = args.data_host or address_towards(args.manager)
    config = load_config(ClientConfig, overrides={"data_host": data_host})
    client = KSpeedClient(args.manager, config=config)
    expected = [path.read_bytes() for path in sorted(Path(args.verify).iterdir())] if args.verify else None
    batch_ids: list[list[int]] = []
    mismatched: list[int] = []
    tracer = None
    try:
        info = client.manager.dataset(args.dataset)
        n = int(info.fingerprint.count)
        shares = [
            {
                "server_id": s.server_id,
                "first_id": int(s.first_id),
                "end_id": int(s.end_id),
                "address": info.server_addresses.get(s.server_id, ""),
            }
            for s in info.shares
        ]
        if args.sampler == "sharded":
            lo, hi = n * args.rank // args.world, n * (args.rank + 1) // args.world
            ds = client.dataset(
                args.dataset,
                batch_size=args.batch_size,
                sampler=range(lo, hi),
                rail=args.rail,
                ring_bytes=args.ring_bytes or None,
                quiet=True,
            )
            ids = [lo, hi]
        elif args.exclude:
            skip = [(s["first_id"], s["end_id"]) for s in shares if s["address"].rsplit(":", 1)[0] in args.exclude]
            keep = np.ones(n, dtype=bool)
            for lo, hi in skip:
                keep[lo:hi] = False
            order = np.random.default_rng(args.seed).permutation(np.flatnonzero(keep)).tolist()
            ds = client.dataset(
                args.dataset,
                batch_size=args.batch_size,
                sampler=order,
                rail=args.rail,
                ring_bytes=args.ring_bytes or None,
                quiet=True,
            )
            ids = [0, n]
        else:
            distributed = {"rank": args.rank, "world_size": args.world} if args.world > 1 else {}
            ds = client.dataset(
                args.dataset,
                batch_size=args.batch_size,
                seed=args.seed,
                rail=args.rail,
                ring_bytes=args.ring_bytes or None,
                quiet=True,
                **distributed,
            )
            ids = [0, n]
        if args.start_at:
            time.sleep(max(args.start_at - time.time(), 0.0))
        tracer = Tracer(ds, args.trace_interval)
        tracer.start()
        print("iterating", flush=True)
        waits: list[float] = []
        sizes: list[int] = []
        done_at: list[float] = []
        epochs: list[int] = []
        touched = 0
        epoch = 0
        t0 = time.time()
        start = time.perf_counter()
        while len(waits) < args.batches:
            ds.set_epoch(epoch)
            before = len(waits)
            t = time.perf_counter()
            it = iter(ds)
            while len(waits) < args.batches:
                try:
                    batch = next(it)
                except StopIteration:
                    break
                now = time.perf_counter()
                waits.append(now - t)
                done_at.append(now - start)
                epochs.append(epoch)
                for sample in batch.samples:
                    if sample.numel():
                        touched += int(sample[0])
                if expected is not None:
                    batch_ids.append(batch.ids.tolist())
                    mismatched += [s for i, s in enumerate(batch_ids[-1]) if batch.numpy(i).tobytes() != expected[s]]
                sizes.append(int(batch.lengths.sum()))
                batch.release()
                del batch
                t = time.perf_counter()
            if len(waits) == before:
                raise RuntimeError(f"dataset {args.dataset!r} delivered no batch in epoch {epoch}")
            epoch += 1
        wall = time.perf_counter() - start
        tracer.stop()
        stats = json.loads(json.dumps(ds.stats(), default=_jsonable))
        steady = waits[1:] if len(waits) > 1 else waits
        total = sum(sizes)
        return {
            "args": vars(args),
            "env": {k: v for k, v in os.environ.items() if k.startswith("KSPEED_")},
            "data_host": data_host,
            "rail": ds.rail,
            "samples": n,
            "ids": ids,
            "shares": shares,
            "batches": len(waits),
            "epochs": epoch,
            "bytes": total,
            "wall_s": wall,
            "t0": t0,
            "bytes_per_s": total / wall if wall > 0 else 0.0,
            "batches_per_s": len(waits) / wall if wall > 0 else 0.0,
            "first_wait_s": waits[0] if waits else 0.0,
            "wait_mean_ms": float(np.mean(steady)) * 1e3 if steady else 0.0,
            "wait_p50_ms": _percentile_ms(steady, 50),
            "wait_p90_ms": _percentile_ms(steady, 90),
            "wait_p99_ms": _percentile_ms(steady, 99),
            "wait_max_ms": max(steady) * 1e3 if steady else 0.0,
            "waits_s": waits,
            "batch_bytes": sizes,
            "batch_done_s": done_at,
            "batch_epoch": epochs,
            "trace": tracer.samples,
            "trace_errors": tracer.errors,
            "stats": stats,
            "touched": touched,
            "batch_ids": batch_ids,
            "mismatched": mismatched,
        }
    finally:
        if tracer is not None:
            tracer.stop()
        client.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module's docstring)."""
    parser = argparse.ArgumentParser(prog="netlab_client", description=__doc__.split("\n\n")[0])
    parser.add_argument("--manager", required=True, help="the manager's gRPC address host:port")
    parser.add_argument("--dataset", required=True, help="name of a registered dataset")
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--batches", type=int, required=True, help="batches to read (over as many epochs as needed)")
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--sampler", choices=("shuffle", "sharded"), default="shuffle")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--exclude",
        action="append",
        default=[],
        help="with --sampler shuffle: read only the IDs of servers at other addresses than this host (repeatable)",
    )
    parser.add_argument("--trace-interval", type=float, default=0.2, help="seconds between samples of the pacing")
    parser.add_argument("--rail", choices=("auto", "shm", "tcp"), default="tcp")
    parser.add_argument("--data-host", default="", help="address the tcp receiver binds (default: towards the manager)")
    parser.add_argument("--ring-bytes", type=int, default=0, help="receive ring size (0: the client's default)")
    parser.add_argument(
        "--verify",
        default="",
        metavar="DIR",
        help="record every batch's IDs and compare every sample with the file of its ID in DIR",
    )
    parser.add_argument(
        "--start-at",
        type=float,
        default=0.0,
        help="wall-clock time (time.time()) to start iterating at, to start several ranks together",
    )
    args = parser.parse_args(argv)
    if args.batch_size <= 0 or args.batches <= 0 or args.world <= 0 or args.trace_interval <= 0:
        parser.error("--batch-size, --batches, --world and --trace-interval must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run and write ``--out``; 0 on success, 1 (with the error on stderr) on failure."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        record = run(args)
    except Exception as exc:  # reported on stderr; the exit status says the run failed
        traceback.print_exc()
        print(f"netlab_client: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    tmp = f"{args.out}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(record, fh, default=_jsonable)
    os.replace(tmp, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
