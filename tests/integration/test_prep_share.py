"""Two jobs on one server's preprocessing workers: each gets its weight's share, and ``kspeed
status`` says so."""

from __future__ import annotations

import os
import threading
import time

import pytest

from kspeed import KSpeedClient
from kspeed.cli.cluster import wait_for
from kspeed.client.feeding.links import ServerLink
from tests.integration.test_autotune import photo_cluster
from tests.integration.test_client import config_for

pytestmark = pytest.mark.timeout(180)


def test_two_jobs_share_the_workers_by_their_weights(cluster_factory, tmp_path):
    cluster, _, spec = photo_cluster(cluster_factory, tmp_path, servers=1, extra=["--preprocess-weights", "heavy=3"])
    stop = threading.Event()
    errors: list[BaseException] = []

    def train(job: str) -> None:
        try:
            client = KSpeedClient(config=config_for(cluster, job=job))
            with client, client.dataset(spec, 8, seed=1, offload=1.0, num_workers=0, quiet=True) as ds:
                epoch = 0
                while not stop.is_set():
                    ds.set_epoch(epoch)
                    for _ in ds:
                        if stop.is_set():
                            break
                    epoch += 1
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=train, args=(job,)) for job in ("heavy", "light")]
    for thread in threads:
        thread.start()
    try:
        with KSpeedClient(config=config_for(cluster)) as watcher:

            def shares() -> dict[str, float] | None:
                inv = watcher.manager.call("GetStatus", _status_request()).servers[0].inventory
                got = dict(inv.preprocess_share)
                return got if {"heavy", "light"} <= set(got) and sum(got.values()) > 0.9 else None

            time.sleep(8.0)  # both jobs at work for a while
            got = wait_for(shares, 60, "both jobs in the server's preprocessing share")
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    assert not errors, errors
    # weights 3:1 while both want every worker: about three quarters for "heavy"
    assert got["heavy"] > got["light"], got
    assert got["heavy"] >= 0.6, got
    # what a job's tuner reads of the server: its workers' busy and CPU seconds, that job's samples, its own CPU
    # and CPUs (the group that tells servers sharing CPUs apart), from the server's own process
    server = cluster.servers[0]
    link = ServerLink(server.ready["id"], server.ready["grpc"], config_for(cluster))
    try:
        figures = link.prep_figures("heavy")
    finally:
        link.close()
    assert figures is not None and figures.samples > 0 and figures.busy_seconds > 0, figures
    assert 0 < figures.job_samples < figures.samples, figures  # "heavy"'s, the rest "light"'s
    assert figures.cpu_seconds > 0 and figures.daemon_cpu_seconds > 0, figures
    cpus = ",".join(str(c) for c in sorted(os.sched_getaffinity(server.process.pid)))
    assert figures.cores == len(os.sched_getaffinity(server.process.pid)), figures
    assert figures.cpu_group.endswith(f"/{cpus}") and len(figures.cpu_group) > len(cpus) + 1, figures


def _status_request():
    from kspeed.proto import kspeed_pb2

    return kspeed_pb2.GetStatusRequest()
