"""Serve while producing: training starts before the preload ends, exact, with a bounded window."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time

import pytest

from kspeed import DatasetSpec, KSpeedClient
from kspeed.cli.cluster import wait_for
from kspeed.errors import DatasetError
from kspeed.proto import kspeed_pb2
from tests.helpers import http_get
from tests.integration.test_client import config_for, loader_order
from tests.integration.test_datasets import make_tree

WINDOW = 1 << 20  # two regions of 512 KiB


def metric(text: str, name: str, labels: str = "") -> float:
    match = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, flags=re.M)
    assert match, f"{name}{labels} not exported"
    return float(match.group(1))


class WindowWatch:
    """Samples a server's window fill every 20 ms while a test runs."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.used: list[float] = []
        self.capacity = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            text = http_get(self.address, "/metrics")[1]
            self.capacity = metric(text, "kspeed_server_window_bytes", '{kind="capacity"}')
            self.used.append(metric(text, "kspeed_server_window_bytes", '{kind="used"}'))

    def stop(self) -> str:
        self._stop.set()
        self._thread.join(timeout=10)
        return http_get(self.address, "/metrics")[1]


@pytest.fixture
def slow(cluster_factory, tmp_path):
    """10,000 files behind a backend that takes 5 ms per file, on one server, not preloaded."""
    files = make_tree(tmp_path / "slow", classes=("a", "b"), per_class=5000, max_size=1500)
    cluster = cluster_factory(
        1,
        server_args=[
            "--backend-allow",
            f"slowfile://{tmp_path}",
            "--memory",
            "24MiB",
            "--region-size",
            "512KiB",
            "--production-window",
            str(WINDOW),
            "--production-depth",
            "512",
        ],
    )
    spec = DatasetSpec(name="slow", uri=f"slowfile://{tmp_path / 'slow'}", labels="dirname")
    return cluster, files, spec


def share_progress(client: KSpeedClient) -> kspeed_pb2.PreloadProgress:
    return client.manager.dataset("slow").progress


def test_first_batch_comes_before_the_preload_ends_and_the_epoch_is_exact(slow):
    cluster, files, spec = slow
    keys = list(files)
    server = cluster.servers[0]
    watch = WindowWatch(server.ready["http"])
    client = KSpeedClient(config=config_for(cluster))
    try:
        ds = client.dataset(spec, batch_size=64, seed=11, quiet=True)
        it = iter(ds)
        first = next(it)
        at_first = share_progress(client)
        # The first batch did not wait for the preload: most of the share is still to load.
        assert at_first.samples_loaded < at_first.samples_total // 2, at_first
        got = []
        for batch in [first, *it]:
            for i, sid in enumerate(batch.ids.tolist()):
                assert batch.numpy(i).tobytes() == files[keys[sid]], f"sample {sid}"
            got.append(batch.ids.tolist())
        assert got == loader_order(len(files), 1, 0, True, 11, False, 0, 64)  # every sample once, in order
        ds.close()
    finally:
        client.close()
        text = watch.stop()
    # The window stayed within its cap the whole time, measured while the epoch ran and as its peak.
    assert watch.capacity == WINDOW and len(watch.used) > 5
    assert max(watch.used) <= WINDOW and metric(text, "kspeed_server_window_bytes", '{kind="peak"}') <= WINDOW
    assert max(watch.used) > 0  # it was used: the samples came through it
    # The feeder waited on production, and it shows.
    assert metric(text, "kspeed_server_grant_wait_seconds_count") > 0
    assert metric(text, "kspeed_server_produced_samples_total") > 0


def test_two_ranks_over_epochs_with_resume_are_exact_while_producing(slow):
    cluster, files, spec = slow
    keys = list(files)
    client = KSpeedClient(config=config_for(cluster))
    try:
        ranks = [
            client.dataset(spec, batch_size=100, rank=r, world_size=2, seed=3, drop_last=True, quiet=True)
            for r in range(2)
        ]
        for epoch in range(2):
            for rank, ds in enumerate(ranks):
                ds.set_epoch(epoch)
                got = []
                it = iter(ds)
                for _ in range(3):
                    got.append(next(it).ids.tolist())
                state = ds.state_dict()  # resume mid-epoch from a fresh handle on the same feed
                ds.load_state_dict(state)
                ds.set_epoch(epoch)
                for batch in ds:
                    for i, sid in enumerate(batch.ids.tolist()):
                        assert batch.numpy(i).tobytes() == files[keys[sid]]
                    got.append(batch.ids.tolist())
                assert got == loader_order(len(files), 2, rank, True, 3, True, epoch, 100)
        for ds in ranks:
            ds.close()
    finally:
        client.close()


def test_a_sample_that_cannot_be_produced_is_named_at_once(slow, tmp_path):
    cluster, files, spec = slow
    keys = list(files)
    victim = 9876  # near the end of the plan: neither the producers nor the preload reach it at once
    client = KSpeedClient(config=config_for(cluster))
    try:
        ds = client.dataset(spec, batch_size=64, shuffle=False, quiet=True)
        (tmp_path / "slow" / keys[victim]).unlink()  # deleted after listing, before anything read it
        started = time.monotonic()
        with pytest.raises(DatasetError, match=rf"sample {victim}\b.*(could not be produced|deleted)"):
            for batch in ds:
                assert victim not in batch.ids.tolist()
        assert time.monotonic() - started < 55  # named, not left to the production timeout (60 s)
        ds.close()
    finally:
        client.close()


def test_a_grant_waits_boundedly_then_names_the_sample(cluster_factory, tmp_path):
    make_tree(tmp_path / "glacial", classes=("a",), per_class=6, max_size=512)
    cluster = cluster_factory(
        1,
        server_args=[
            "--backend-allow",
            f"slowfile://{tmp_path}",
            "--backend-options",
            '{"slowfile": {"latency": 4.0}}',
            "--production-timeout",
            "1s",
            "--production-threads",
            "1",
            "--preload-threads",
            "1",
        ],
    )
    client = KSpeedClient(config=config_for(cluster))
    try:
        spec = DatasetSpec(name="glacial", uri=f"slowfile://{tmp_path / 'glacial'}")
        ds = client.dataset(spec, batch_size=6, shuffle=False, quiet=True)
        with pytest.raises(DatasetError, match=r"sample \d+ was not produced within 1s"):
            next(iter(ds))
        ds.close()
    finally:
        client.close()


RANK = """
import sys, time
from kspeed import DatasetSpec, KSpeedClient
from kspeed.config import ClientConfig, load_config
config = load_config(ClientConfig, environ={}, overrides={"manager": sys.argv[1], "security.auth": "none"})
client = KSpeedClient(config=config)
ds = client.dataset(DatasetSpec(name="slow", uri=sys.argv[2], labels="dirname"), batch_size=64, quiet=True)
it = iter(ds)
next(it)
print("fed", flush=True)
time.sleep(600)
"""


def test_a_vanished_clients_feed_and_window_slots_are_reclaimed(slow):
    cluster, _, spec = slow
    server = cluster.servers[0]
    rank = subprocess.Popen([sys.executable, "-c", RANK, cluster.address, spec.uri], stdout=subprocess.PIPE, text=True)
    try:
        assert rank.stdout is not None and rank.stdout.readline().strip() == "fed"
        text = http_get(server.ready["http"], "/metrics")[1]
        assert metric(text, "kspeed_server_feeds") == 1
        assert metric(text, "kspeed_server_window_bytes", '{kind="used"}') > 0  # producing for it
    finally:
        rank.kill()
        rank.wait()

    def reclaimed() -> bool:
        text = http_get(server.ready["http"], "/metrics")[1]
        return (
            metric(text, "kspeed_server_feeds") == 0
            and metric(text, "kspeed_server_window_bytes", '{kind="used"}') == 0
        )

    # The killed rank's connection ends at once; its feed, plans and window slots follow.
    wait_for(reclaimed, 15, "the vanished client's feed and window slots reclaimed")
