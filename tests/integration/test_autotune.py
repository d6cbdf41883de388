"""``offload="auto"`` against real daemons: a split changed mid-epoch changes no byte the model
sees, and the decision follows the servers' capacity when one of them is killed."""

from __future__ import annotations

import math
import signal
import time

import numpy as np
import pytest
import torch

from kspeed import DatasetSpec, KSpeedClient
from kspeed.preprocess import Output, Pipeline, Stage
from kspeed.preprocess.runner import Runner
from tests.client.test_wrap import assert_same_batches
from tests.integration.test_client import config_for
from tests.integration.test_preprocess import BATCH, MEAN, SEED, SIDE, make_photos, shuffled

pytestmark = pytest.mark.timeout(180)


def augmenting() -> Pipeline:
    """Decode, a random crop and flip on the servers (uint8 CHW), then float and normalize here."""
    return Pipeline(
        [
            Stage("decode_image", {"mode": "RGB"}),
            Stage("random_resized_crop", {"size": [SIDE, SIDE]}),
            Stage("flip", {"p": 0.5}),
            Stage("to_chw", output=Output(shape=(3, SIDE, SIDE), dtype="uint8")),
            Stage("cast", {"dtype": "float32"}, place="client"),
            Stage("normalize", {"mean": MEAN, "std": [0.229, 0.224, 0.225]}, place="client"),
        ]
    )


def photo_cluster(cluster_factory, tmp_path, servers: int = 2, extra: tuple[str, ...] | list[str] = ()):
    photos = make_photos(tmp_path / "photos")
    cluster = cluster_factory(
        servers,
        server_args=["--backend-allow", str(tmp_path), "--preprocess-workers", "1", "--memory", "32MiB", *extra],
    )
    spec = DatasetSpec(name="photos", uri=str(photos.root), labels="dirname", pipeline=augmenting())
    return cluster, photos, spec


def test_a_split_changed_mid_epoch_changes_no_byte(cluster_factory, tmp_path):
    cluster, photos, spec = photo_cluster(cluster_factory, tmp_path)
    n, batch_size = len(photos.keys), 2
    changes = {(0, 1): 0.25, (0, 8): 0.0, (1, 2): 0.75, (1, 12): 0.5}
    # a ring of about two batches of raw photographs: each change lands while the epoch is granted
    with KSpeedClient(config=config_for(cluster)) as client:
        ds = client.dataset(spec, batch_size, shuffle=True, seed=SEED, num_workers=1, ring_bytes=400_000, quiet=True)
        with ds:
            assert ds.stats()["offload"]["mode"] == "auto" and ds.stats()["offload"]["ratio"] == 1.0
            pump = ds.kspeed_dataset._pump
            got = []
            for epoch in range(2):
                ds.set_epoch(epoch)
                batches = []
                for k, batch in enumerate(ds):
                    batches.append(batch)
                    if (epoch, k) in changes:
                        pump.resplit(changes[(epoch, k)])
                got.append(batches)
            assert pump.resplits >= 3, pump.resplits  # most of them mid-epoch, each a pass of its own
    runner = Runner(augmenting())
    for epoch in range(2):
        order = shuffled(n, epoch)
        assert [len(b[1]) for b in got[epoch]] == [batch_size] * (n // batch_size)
        for k, (images, labels) in enumerate(got[epoch]):
            ids = order[k * batch_size : (k + 1) * batch_size]
            want = np.stack([runner.run(photos.data(i), seed=SEED, epoch=epoch, sample=i) for i in ids])
            assert torch.equal(labels, torch.tensor([photos.label(i) for i in ids])), (epoch, k)
            np.testing.assert_array_max_ulp(images.numpy(), want, maxulp=1)


def test_the_same_batches_with_auto_as_with_a_fixed_split(cluster_factory, tmp_path):
    cluster, _, spec = photo_cluster(cluster_factory, tmp_path)
    got = {}
    with KSpeedClient(config=config_for(cluster)) as client:
        for offload in ("auto", 0.5):
            with client.dataset(spec, BATCH, shuffle=True, seed=SEED, num_workers=1, offload=offload, quiet=True) as ds:
                ds.set_epoch(3)
                got[offload] = list(ds)
    assert_same_batches(got["auto"], got[0.5])


def _decided(ds, after: float) -> dict | None:
    """The latest decision's inputs, once one was made after ``after`` with the servers measured."""
    offload = ds.stats()["offload"]
    inputs = offload["inputs"]
    if not inputs or not math.isfinite(inputs.get("remote_rate", math.inf)) or offload["decided_at"] <= after:
        return None
    return {**inputs, "ratio": offload["last_ratio"]}


def test_the_decision_follows_the_servers_when_one_is_killed(cluster_factory, tmp_path):
    cluster, _, spec = photo_cluster(cluster_factory, tmp_path)
    client = KSpeedClient(config=config_for(cluster, failover_timeout="60s"))
    with client, client.dataset(spec, BATCH, shuffle=True, seed=SEED, num_workers=1, quiet=True) as ds:
        ds.preload()
        epoch = [0]

        def run_until(check, give_up: float):
            # a loop with no training step: preprocessing is all it waits for
            while time.monotonic() < give_up:
                ds.set_epoch(epoch[0])
                epoch[0] += 1
                for _ in ds:
                    found = check()
                    if found is not None:
                        return found
            raise AssertionError(f"no such decision in time: {ds.stats()['offload']}")

        settled = time.monotonic() + 5.0  # past the first decisions, made while the servers start producing
        before = run_until(lambda: _decided(ds, settled), time.monotonic() + 60)
        # a decision measured with both servers, at their steady rate
        assert before["remote_rate"] > 0 and 0.0 < before["ratio"] <= 1.0, before
        holders = {s.server_id for s in client.manager.dataset("photos").shares}
        victim = next(s for s in cluster.servers if s.ready["id"] in holders)
        victim.signal(signal.SIGKILL)
        killed = time.monotonic()

        def measured_without(d: dict | None) -> dict | None:
            # the survivor shares the host's CPUs with what the lost one left free, so its capacity
            # is less than both servers' but by how much depends on the machine's load: a decision
            # that measured less and offloads less is the one that followed the kill
            lower = d is not None and d["remote_rate"] < before["remote_rate"] and d["ratio"] < before["ratio"]
            return d if lower else None

        after = run_until(lambda: measured_without(_decided(ds, killed + 3.0)), time.monotonic() + 90)
        # one server's capacity left: less is offloaded
        assert after["ratio"] < before["ratio"], (before, after)
        assert ds.stats()["replaced_servers"] == 1


def test_a_repeated_job_starts_from_the_decision_its_last_run_kept(cluster_factory, tmp_path):
    from kspeed.client.tuning.store import record_of

    cluster, _, spec = photo_cluster(cluster_factory, tmp_path)
    with KSpeedClient(config=config_for(cluster)) as client:
        with client.dataset(spec, BATCH, shuffle=True, seed=SEED, num_workers=1, model="tiny", quiet=True) as ds:
            assert ds.stats()["offload"]["ratio"] == 1.0  # nothing kept yet: everything on the servers
            stages = ds.kspeed_dataset.prep.server_stages
            next(iter(ds))
        # what a run that settled on 0.4 keeps (the tuner keeps its split this way after a change)
        client.manager.save_tuning(record_of("photos", "name:tiny/batch8", 0.4, stages, None))
        with client.dataset(spec, BATCH, shuffle=True, seed=SEED, num_workers=1, model="tiny", quiet=True) as ds:
            assert ds.stats()["offload"]["ratio"] == 0.4
            first = next(iter(ds))
            assert first[0].shape[0] == BATCH
            assert ds.kspeed_dataset._pump._current.fraction == 0.4  # the first plan was made with it
        # another model starts from scratch
        with client.dataset(spec, BATCH, shuffle=True, seed=SEED, num_workers=1, model="other", quiet=True) as ds:
            assert ds.stats()["offload"]["ratio"] == 1.0


@pytest.mark.parametrize("sampler", ["built-in", "RandomSampler"])
def test_a_split_changed_while_the_ring_holds_the_whole_epoch_takes_the_next_epoch(cluster_factory, tmp_path, sampler):
    from torch.utils.data import RandomSampler

    cluster, photos, spec = photo_cluster(cluster_factory, tmp_path)
    n = len(photos.keys)
    options = {"shuffle": False} if sampler == "built-in" else {"sampler": RandomSampler(range(n))}
    client = KSpeedClient(config=config_for(cluster))
    # the default ring, which holds the whole epoch
    with client, client.dataset(spec, BATCH, seed=SEED, num_workers=1, quiet=True, **options) as ds:
        pump = ds.kspeed_dataset._pump
        order = []
        for epoch in range(3):
            ds.set_epoch(epoch)
            batches = []
            for k, batch in enumerate(ds):
                batches.append(batch)
                if (epoch, k) == (0, 0):
                    pump.resplit(0.5)  # everything of epoch 0 is granted already
            got = pump._current
            order.append((got.epoch, got.fraction, batches, got.ids.tolist()))
    assert [fraction for _, fraction, _, _ in order][1:] == [0.5, 0.5]  # the next epoch took it, whole
    runner = Runner(augmenting())
    for epoch, _, batches, ids in order:
        for k, (images, labels) in enumerate(batches):
            chunk = ids[k * BATCH : (k + 1) * BATCH]
            want = np.stack([runner.run(photos.data(i), seed=SEED, epoch=epoch, sample=i) for i in chunk])
            assert torch.equal(labels, torch.tensor([photos.label(i) for i in chunk])), (epoch, k)
            np.testing.assert_array_max_ulp(images.numpy(), want, maxulp=1)
