"""What checking served samples costs the ``shm`` rail: ``verify_served`` off, first (the default) and always.

Three local clusters run side by side, one per setting, each holding the same sample sets (loaded
once per size); the client reads each through the ``shm`` rail as ``bench/client.py`` does (whole
epochs, every sample's first byte touched and summed), the settings interleaved ``--repeat`` times
so that a drift of the machine falls on all three alike. Reported per size and setting: the first
epoch after a fresh attach (where ``first`` checks every sample once) and the steady rate after a
warm-up epoch, as GB/s and as a ratio to ``off`` measured in the same run. The target of the
security review: checking costs at most 5% of the rail's GB/s.

    python bench/verify.py --json bench/results/verify.json
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
import time

import numpy as np
from _cluster import BenchCluster, KSpeedSource
from _common import MIB, machine_info, write_json
from _datasets import batch_size_for, make_sample_set, parse_sizes, warm_page_cache
from _loop import measure

MODES = ("off", "first", "always")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="32K,256K,1M", help="sample sizes (bench/client.py's notation)")
    parser.add_argument("--dataset-mib", type=int, default=256, help="MiB of samples per size")
    parser.add_argument("--seconds", type=float, default=2.0, help="measured seconds of each steady run")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    specs = parse_sizes(args.sizes)
    rows = []
    data_root = tempfile.mkdtemp(prefix="kspeed-bench-verify-")
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: shutil.rmtree(data_root, ignore_errors=True))
        largest = args.dataset_mib * MIB * 2
        clusters = {
            mode: stack.enter_context(BenchCluster(data_root, largest, server_args=("--verify-served", mode)))
            for mode in MODES
        }
        for index, spec in enumerate(specs):
            samples = make_sample_set(data_root, f"verify-{index}", spec, args.dataset_mib * MIB, 4, seed=index)
            warm_page_cache(samples)
            for cluster in clusters.values():
                cluster.load(samples)
            batch = batch_size_for(spec)
            first: dict[str, list[float]] = {m: [] for m in MODES}
            steady: dict[str, list[float]] = {m: [] for m in MODES}
            for _ in range(args.repeat):
                for mode, cluster in clusters.items():
                    source = KSpeedSource(cluster.address, samples, batch, rail="shm")
                    try:
                        opening = measure(
                            source,
                            count=samples.count,
                            epoch_bytes=samples.total_bytes,
                            checksum=samples.checksum,
                            seconds=0.0,
                            warmup_epochs=0,
                        )
                        first[mode].append(opening.gbps)
                        rest = measure(
                            source,
                            count=samples.count,
                            epoch_bytes=samples.total_bytes,
                            checksum=samples.checksum,
                            seconds=args.seconds,
                        )
                        steady[mode].append(rest.gbps)
                    finally:
                        source.close()
            for mode in MODES:
                row = {
                    "size": spec.label,
                    "verify_served": mode,
                    "first_epoch_gbps": round(float(np.median(first[mode])), 3),
                    "steady_gbps": round(float(np.median(steady[mode])), 3),
                    "first_epoch_of_off": round(float(np.median(first[mode]) / np.median(first["off"])), 3),
                    "steady_of_off": round(float(np.median(steady[mode]) / np.median(steady["off"])), 3),
                    "runs": {"first_epoch": first[mode], "steady": steady[mode]},
                }
                rows.append(row)
                print(
                    f"[{spec.label}] verify_served {mode:<6} first epoch {row['first_epoch_gbps']:6.2f} GB/s "
                    f"({row['first_epoch_of_off']:.3f} of off)  steady {row['steady_gbps']:6.2f} GB/s "
                    f"({row['steady_of_off']:.3f} of off)",
                    file=sys.stderr,
                    flush=True,
                )
            for cluster in clusters.values():
                cluster.unload(samples.name)
            shutil.rmtree(samples.root, ignore_errors=True)
    write_json(
        args.json,
        {
            "machine": machine_info(),
            "settings": vars(args),
            "results": rows,
            "wall_seconds": round(time.perf_counter() - started, 1),
        },
    )


if __name__ == "__main__":
    main()
