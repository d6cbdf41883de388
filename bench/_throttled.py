"""A local cluster whose servers read a throttled store, with the ranks and the daemons on their own cores.

Shared by the benchmarks that stand the ``throttled`` file system in for object storage
(``bench/policies.py``, ``bench/analyze.py``): the servers may read ``throttled://<root>`` only, every
server process throttled by the same settings, and with ``pin`` the usable cores split in two halves,
the ranks on one and the daemons on the other, as training nodes and spare nodes are apart in a cluster.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from kspeed.cli.cluster import LocalCluster

__all__ = ["split_cores", "throttled_cluster"]


def split_cores(pin: bool) -> tuple[set[int], set[int]]:
    """``(the ranks' cores, the daemons' cores)``: with ``pin``, the usable cores split in two halves
    (the servers' reads and preprocessing then cost the ranks no CPU); without it, all of them for both."""
    usable = sorted(os.sched_getaffinity(0))
    if not pin or len(usable) < 2:
        return set(usable), set(usable)
    half = len(usable) // 2
    return set(usable[:half]), set(usable[half:])


def throttled_cluster(
    state: Path,
    root: Path,
    *,
    servers: int,
    store: Mapping[str, float],
    memory: int,
    region: int,
    pin: bool,
    extra: Sequence[str] = (),
) -> LocalCluster:
    """Start ``servers`` servers (and a manager) on the daemons' cores, reading ``root`` through the
    throttled store ``store`` (its options per server process: latency, bandwidth, pauses)."""
    options = {"throttled": {**store, "target_protocol": "file"}}
    daemons = ",".join(str(c) for c in sorted(split_cores(pin)[1]))
    cluster = LocalCluster(
        str(state),
        servers=servers,
        launch_prefix=lambda name: ["taskset", "-c", daemons],
        server_args=[
            "--backend-allow",
            f"throttled://{root}",
            "--backend-options",
            json.dumps(options),
            "--memory",
            str(memory),
            "--region-size",
            str(region),
            "--keep-pool-on-exit",
            "false",
            *extra,
        ],
    )
    cluster.start()
    return cluster
