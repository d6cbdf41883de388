"""The client library against real daemons: every rail, several ranks and epochs, resume, bad input."""

from __future__ import annotations

import os
import signal
import socket
import threading

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from torch.utils.data import DataLoader, DistributedSampler

from kspeed import DatasetSpec, KSpeedClient
from kspeed.cli.cluster import wait_for
from kspeed.client.feeding import links
from kspeed.client.stats import PrometheusCollector
from kspeed.config import ClientConfig, load_config
from kspeed.errors import (
    AccessDeniedError,
    CapacityError,
    ConfigError,
    NotFoundError,
    StateError,
    UnavailableError,
)
from kspeed.proto import kspeed_pb2_grpc
from kspeed.rdma.rails import available_rails
from tests.integration.test_datasets import make_tree

CLASSES = ("ant", "bee", "cat")


def config_for(cluster, **overrides) -> ClientConfig:
    return load_config(
        ClientConfig, environ={}, overrides={"manager": cluster.address, "security.auth": "none", **overrides}
    )


@pytest.fixture
def fed(cluster_factory, tmp_path):
    """A two-server cluster holding one labelled dataset split across both servers."""
    files = make_tree(tmp_path / "imgs", max_size=160 * 1024)
    cluster = cluster_factory(
        2, server_args=["--backend-allow", str(tmp_path), "--memory", "16MiB", "--region-size", "1MiB"]
    )
    client = KSpeedClient(config=config_for(cluster))
    wait_for(lambda: len([r for r in client.manager.servers() if r.state == 2]) == 2, 10, "two ready servers")
    yield cluster, client, files, DatasetSpec(name="imgs", uri=str(tmp_path / "imgs"), labels="dirname")
    client.close()


def check(batch, files, keys):
    for i, sid in enumerate(batch.ids.tolist()):
        assert batch.numpy(i).tobytes() == files[keys[sid]], f"sample {sid}"
        assert int(batch.labels[i]) == CLASSES.index(keys[sid].split("/")[0])


def loader_order(n, world, rank, shuffle, seed, drop_last, epoch, batch_size):
    sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=seed)
    sampler.set_epoch(epoch)
    return [b.tolist() for b in DataLoader(range(n), sampler=sampler, batch_size=batch_size, drop_last=drop_last)]


def test_a_plan_part_larger_than_one_message_is_streamed(fed, monkeypatch):
    # A server's part of a plan goes in one unary CommitPlan when it fits one message, in a
    # StreamPlan of chunks when it does not; both deliver the same epoch.
    _, client, files, spec = fed
    keys = list(files)
    streamed = []
    stream = kspeed_pb2_grpc.ServerStub.__init__

    def counting(self, channel):
        stream(self, channel)
        original = self.StreamPlan
        self.StreamPlan = lambda chunks, **kw: (streamed.append(1), original(chunks, **kw))[1]

    monkeypatch.setattr(kspeed_pb2_grpc.ServerStub, "__init__", counting)
    for chunk in (links.PLAN_CHUNK, 7):
        monkeypatch.setattr(links, "PLAN_CHUNK", chunk)
        ds = client.dataset(spec, batch_size=16, seed=1, ring_bytes=8 << 20, quiet=True)
        got = []
        for batch in ds:
            check(batch, files, keys)
            got.append(batch.ids.tolist())
        assert got == loader_order(len(files), 1, 0, True, 1, False, 0, 16)
        assert bool(streamed) == (chunk == 7)
        ds.close()


@pytest.mark.parametrize("rail", available_rails())
def test_ranks_epochs_resume_and_held_batches(fed, rail):
    _, client, files, spec = fed
    keys = list(files)
    n = len(files)
    for world, shuffle, drop_last in ((1, True, False), (2, False, True), (2, True, True)):
        for rank in range(world):
            ds = client.dataset(
                spec,
                batch_size=16,
                rank=rank,
                world_size=world,
                shuffle=shuffle,
                drop_last=drop_last,
                seed=3,
                rail=rail,
                ring_bytes=8 << 20,
                quiet=True,
            )
            assert ds.rail == rail
            ds.preload()
            for epoch in range(2):
                ds.set_epoch(epoch)
                held = []
                got = []
                for batch in ds:
                    check(batch, files, keys)
                    got.append(batch.ids.tolist())
                    held = [*held[-2:], batch]
                    for old in held:  # three batches held while iterating keep their bytes
                        check(old, files, keys)
                assert got == loader_order(n, world, rank, shuffle, 3, drop_last, epoch, 16)
            ds.close()
    # Resume mid-epoch: a new dataset continues with exactly the batches not yet consumed.
    ds = client.dataset(spec, batch_size=8, rank=1, world_size=2, seed=5, rail=rail, ring_bytes=8 << 20, quiet=True)
    ds.set_epoch(4)
    it = iter(ds)
    for _ in range(3):
        next(it)
    state = ds.state_dict()
    ds.close()
    resumed = client.dataset(
        spec, batch_size=8, rank=1, world_size=2, seed=5, rail=rail, ring_bytes=8 << 20, quiet=True
    )
    resumed.load_state_dict(state)
    resumed.set_epoch(4)
    rest = []
    for batch in resumed:
        check(batch, files, keys)
        rest.append(batch.ids.tolist())
    assert rest == loader_order(n, 2, 1, True, 5, False, 4, 8)[3:]
    stats = resumed.stats()
    assert stats["stale_completions"] == 0 and stats["server_errors"] == 0
    info = client.manager.dataset("imgs")
    assert len(info.shares) == 2 and info.leases >= 1


def test_bad_input_is_named(fed):
    cluster, client, files, spec = fed
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{probe.getsockname()[1]}"
    with pytest.raises(UnavailableError, match=f"manager at {dead} is unreachable"):
        KSpeedClient(dead, config=config_for(cluster, timeout="2s"))
    with pytest.raises(NotFoundError, match="nope"):
        client.dataset("nope", batch_size=4)
    with pytest.raises(AccessDeniedError):
        client.dataset(DatasetSpec(name="etc", uri="/etc"), batch_size=4)
    with pytest.raises(ConfigError, match="batch_size"):
        client.dataset(spec, batch_size=0)
    small = client.dataset(spec, batch_size=64, ring_bytes=64 << 10, quiet=True)
    with pytest.raises(CapacityError, match="more than the receive ring's 65536"):
        iter(small)
    # A batch larger than the epoch is the epoch's samples in one batch, as DataLoader gives; it needs
    # no more ring than they take.
    whole = client.dataset(spec, batch_size=10**6, ring_bytes=8 << 20, quiet=True)
    # Preloaded first: a grant of a share's every sample while its preload still runs can wait on a
    # window too small for it (a production edge case of its own, apart from the ring's size).
    whole.preload()
    assert len(whole) == 1 and [len(batch) for batch in whole] == [len(files)]
    whole.close()
    # A ring larger than the cap (default a quarter of the available memory) is refused before
    # anything is allocated: no descriptor, mapping or thread is left behind.
    fds, threads = set(os.listdir("/proc/self/fd")), threading.active_count()
    with KSpeedClient(config=config_for(cluster, ring_max_bytes="256KiB")) as capped:
        for batch_size in (64, 10**6, 2**50):  # the larger two count the epoch's samples: still over 256 KiB
            with pytest.raises(CapacityError, match="more than the largest receive ring allowed"):
                capped.dataset(spec, batch_size=batch_size, quiet=True)
        with pytest.raises(CapacityError, match="larger than the largest allowed"):
            capped.dataset(spec, 4, ring_bytes=2 << 20)
    assert set(os.listdir("/proc/self/fd")) <= fds
    # (the closed client's threads end soon after its close, on a busy machine not at once; a leaked one never does)
    wait_for(lambda: threading.active_count() <= threads, 10, f"no more than the {threads} threads from before")
    ds = client.dataset(spec, batch_size=16, ring_bytes=8 << 20, quiet=True)
    with pytest.raises(StateError, match="num_workers"):
        next(iter(DataLoader(ds, batch_size=None, num_workers=1, multiprocessing_context="spawn")))
    ds.close()
    with pytest.raises(StateError, match="closed"):
        iter(ds)
    # A server that is down when the job starts is named.
    victim = cluster.servers[1]
    victim.signal(signal.SIGKILL)
    victim.stop()
    with pytest.raises(UnavailableError, match=f"server {victim.ready['id']} at {victim.ready['grpc']}"):
        client.dataset(spec, batch_size=16, ring_bytes=8 << 20, quiet=True)


@pytest.mark.parametrize("rail", available_rails())
def test_paced_feed_delivers_sub_batches_exactly(fed, rail):
    cluster, _, files, spec = fed
    keys = list(files)
    # A 1 us round makes sub-batches of one sample at any drain rate, so every batch is many grants per server.
    client = KSpeedClient(config=config_for(cluster, pacing="on", pace_round=1e-6))
    try:
        ds = client.dataset(spec, batch_size=16, seed=7, rail=rail, ring_bytes=8 << 20, quiet=True)
        ds.preload()
        for epoch in range(2):
            ds.set_epoch(epoch)
            got = []
            for batch in ds:
                check(batch, files, keys)
                got.append(batch.ids.tolist())
            assert got == loader_order(len(files), 1, 0, True, 7, False, epoch, 16)
        stats = ds.stats()
        pacing = stats["pacing"]
        assert stats["grants"] > 2 * 2 * len(got)  # more than one grant per server and batch
        # The next epoch is already being granted: sent grants may wait for completions, queued ones for the window.
        assert stats["completions"] == pacing["sub_batches_completed"] <= pacing["sub_batches_sent"] <= stats["grants"]
        assert pacing["window_bytes"] > 0 and pacing["drain_rate"] > 0
        assert all(v is not None and v > 0 for v in pacing["latency"].values())  # probed at connect
        assert stats["stale_completions"] == 0 and stats["server_errors"] == 0
        registry = CollectorRegistry()
        registry.register(PrometheusCollector(ds))
        exported = generate_latest(registry).decode()
        for metric in (
            "kspeed_client_pacing_window_bytes",
            "kspeed_client_pacing_drain_rate_bytes_per_second",
            'kspeed_client_pacing_latency_seconds{dataset="imgs",size_class="32KiB"}',
            'kspeed_client_pacing_sub_batch_latency_seconds_bucket{dataset="imgs",le="+Inf"}',
            "kspeed_client_batches_total",
        ):
            assert metric in exported
        ds.close()
    finally:
        client.close()
    default = KSpeedClient(config=config_for(cluster))
    try:
        ds = default.dataset(spec, batch_size=16, rail=rail, ring_bytes=8 << 20, quiet=True)
        assert ds.stats()["pacing"] is None  # auto: every server is on this host, no link to congest
        ds.close()
    finally:
        default.close()
