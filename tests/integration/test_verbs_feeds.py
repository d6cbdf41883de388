"""Feeds over the ``verbs`` rail, end to end, on the strict double of pyverbs (``tests/verbs_double``).

Real daemons on loopback whose servers (and their feeder processes) drive the double
(``KSPEED_VERBS_API``), and clients forced onto ``verbs``: every sample exactly once in the
sampler's order when a holder dies mid-epoch, when a dataset three times its memory streams over
two ranks, and when the servers preprocess. Nothing here touches an RDMA device; the tests marked
``rdma`` do (``tests/rdma/test_verbs_device.py``).
"""

from __future__ import annotations

import signal
import threading

import pytest
import torch

import kspeed.client.feeding.builder as builder
from kspeed import DatasetSpec, KSpeedClient
from kspeed.client.delivery.device import CudaDelivery
from kspeed.client.delivery.device_ring import DeviceRingDelivery, device_ring
from kspeed.preprocess import Output, Pipeline, Stage
from tests.client.device_ring_standin import HostDriver, HostRingViews
from tests.client.test_device import FakeCuda
from tests.integration.test_client import config_for
from tests.integration.test_datasets import make_tree
from tests.integration.test_failover import BATCH, SEED, check_epoch, slow_cluster
from tests.integration.test_policies import EPOCHS, QUOTA, read_epochs
from tests.integration.test_preprocess import BATCH as PREP_BATCH
from tests.integration.test_preprocess import REPO, expected, make_photos, shuffled
from tests.integration.test_preprocess import SEED as PREP_SEED

DOUBLE = "tests.verbs_double:api"
#: The daemons drive the double; they import it from the repository.
ENV = {"KSPEED_VERBS_API": DOUBLE, "PYTHONPATH": str(REPO)}


def verbs_config(cluster, **overrides):
    """A client of ``cluster`` forced onto the ``verbs`` rail, driving the double."""
    return config_for(cluster, rail="verbs", verbs_api=DOUBLE, **overrides)


@pytest.mark.timeout(150)
def test_a_holder_killed_mid_epoch_over_verbs_is_a_pause(cluster_factory, tmp_path):
    cluster, files, spec = slow_cluster(cluster_factory, tmp_path, env=ENV)
    with KSpeedClient(config=verbs_config(cluster, failover_timeout="60s")) as client:
        ds = client.dataset(spec, batch_size=BATCH, seed=SEED, ring_bytes=2 << 20, quiet=True)
        assert ds.stats()["rail"] == "verbs"
        spare = cluster.add_server()
        shares = client.manager.dataset("imgs").shares
        biggest = max(shares, key=lambda share: share.end_id - share.first_id)
        victim = next(s for s in cluster.servers if s.ready["id"] == biggest.server_id)
        check_epoch(ds, files, 0, lambda k: k == 0 and victim.signal(signal.SIGKILL))
        stats = ds.stats()
        assert stats["replaced_servers"] == 1, stats  # (grants in flight then, if any, were fenced and granted again)
        assert spare.ready["id"] in {s.server_id for s in client.manager.dataset("imgs").shares}
        check_epoch(ds, files, 1)
        ds.close()


@pytest.mark.timeout(200)
def test_a_dataset_three_times_its_memory_streams_over_verbs_on_two_ranks(cluster_factory, tmp_path):
    files = make_tree(tmp_path / "big", per_class=150, max_size=64 * 1024, seed=4)
    cluster = cluster_factory(2, server_args=["--backend-allow", str(tmp_path)], env=ENV)
    spec = DatasetSpec(name="big", uri=str(tmp_path / "big"), quota_bytes=QUOTA // 2)
    with KSpeedClient(config=config_for(cluster)) as client:
        client.manager.create_dataset(spec.to_proto(), operator=True)
        assert {s.policy for s in client.manager.dataset("big").shares} == {"stream"}
    errors: list[BaseException] = []
    ranks = [
        threading.Thread(target=read_epochs, args=(verbs_config(cluster), spec, files, rank, 2, errors))
        for rank in range(2)
    ]
    for t in ranks:
        t.start()
    for t in ranks:
        t.join(timeout=180)
    assert not any(t.is_alive() for t in ranks), "a rank did not finish"
    if errors:
        raise errors[0]
    assert EPOCHS >= 2


@pytest.mark.timeout(200)
def test_servers_preprocess_into_verbs_rings(cluster_factory, tmp_path):
    photos = make_photos(tmp_path / "photos")
    server_args = ["--backend-allow", str(tmp_path), "--memory", "32MiB", "--preprocess-workers", "1"]
    cluster = cluster_factory(1, server_args=server_args, env=ENV)
    side = 48
    pipeline = Pipeline(
        [
            Stage("decode_image", {"mode": "RGB"}),
            Stage("random_resized_crop", {"size": [side, side]}),
            Stage("to_chw", output=Output(shape=(3, side, side), dtype="uint8")),
        ]
    )
    spec = DatasetSpec(name="photos", uri=str(photos.root), labels="dirname", pipeline=pipeline)
    with KSpeedClient(config=verbs_config(cluster)) as client:
        ds = client.dataset(spec, PREP_BATCH, offload=1.0, ring_bytes=8 << 20, shuffle=True, seed=PREP_SEED, quiet=True)
        assert ds.stats()["rail"] == "verbs"
        got = list(ds)
        ds.close()
    want = expected(pipeline, photos, shuffled(len(photos.keys), 0), 0)
    assert len(got) == len(want)
    for (images, labels), (ref_images, ref_labels) in zip(got, want, strict=True):
        assert torch.equal(images, ref_images) and torch.equal(labels, ref_labels)


@pytest.mark.timeout(120)
def test_a_feed_into_a_device_ring_over_verbs_is_exact_and_frees_the_ring(cluster_factory, tmp_path, monkeypatch):
    # device="cuda" with GPUDirect: the servers' feeders write each batch into the device ring (here
    # the host stand-in of a GPU: a memfd plays its dma-buf, which the double maps as a NIC would
    # reach GPU memory), and batches are views of it: no host ring, no copy.
    driver = HostDriver()
    events = FakeCuda(not_ready=1)
    monkeypatch.setattr(builder, "make_delivery", lambda device: CudaDelivery(torch.device("cuda", 0), backend=events))
    monkeypatch.setattr(builder, "device_ring", lambda *args: device_ring(*args, driver=driver))
    monkeypatch.setattr(builder, "CupyRingViews", lambda memory: HostRingViews(driver, memory))
    monkeypatch.setattr(
        builder, "DeviceRingDelivery", lambda device, views: DeviceRingDelivery(device, views, backend=events)
    )
    cluster, files, spec = slow_cluster(cluster_factory, tmp_path, env=ENV)
    with KSpeedClient(config=verbs_config(cluster)) as client:
        ds = client.dataset(spec, batch_size=BATCH, seed=SEED, ring_bytes=2 << 20, quiet=True, device="cuda")
        assert ds.stats()["rail"] == "verbs" and ds._feed.ring is None  # no host ring
        check_epoch(ds, files, 0)
        assert driver.flushes == len(ds) and events.copies == []  # a flush per batch, never a copy
        check_epoch(ds, files, 1)
        ds.close()
    assert len(driver.freed) == 1 and not driver.maps
