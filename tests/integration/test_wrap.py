"""``KSpeedClient.wrap`` against real daemons: a folder of JPEGs served like a DataLoader over it, in
the order of any sampler, whose next epoch is planned ahead when its order can be predicted."""

from __future__ import annotations

import multiprocessing

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, SequentialSampler, default_collate
from torchvision.datasets import ImageFolder

from kspeed import KSpeedClient
from kspeed.cli.cluster import wait_for
from tests.client.test_wrap import alive, assert_same_batches, jpeg_loader, make_jpegs, to_normalized_tensor
from tests.integration.test_client import config_for


def test_wrap_caches_the_files_and_yields_what_a_dataloader_would(cluster_factory, tmp_path):
    root = make_jpegs(tmp_path / "imgs")
    folder = ImageFolder(str(root), transform=to_normalized_tensor, loader=jpeg_loader)
    cluster = cluster_factory(
        2, server_args=["--backend-allow", str(tmp_path), "--memory", "16MiB", "--region-size", "1MiB"]
    )
    client = KSpeedClient(config=config_for(cluster))
    pids = []
    try:
        wait_for(lambda: len([r for r in client.manager.servers() if r.state == 2]) == 2, 10, "two ready servers")
        wrapped = client.wrap(
            folder, batch_size=8, sampler=SequentialSampler(folder), num_workers=2, ring_bytes=8 << 20, quiet=True
        )
        info = client.manager.dataset(wrapped.name)
        assert (info.spec.kind, info.spec.uri) == ("dir", str(root))  # the samples are the tree, sorted
        # What a script reads of a DataLoader: the dataset it was given, and the sampler's length.
        assert wrapped.dataset is folder and len(wrapped.sampler) == wrapped.num_samples == len(folder)
        assert wrapped.kspeed_dataset.num_samples == len(folder)
        assert info.fingerprint.count == len(folder) and info.leases >= 1
        want = list(DataLoader(folder, batch_size=8, sampler=SequentialSampler(folder)))
        for epoch in range(2):
            wrapped.set_epoch(epoch)
            assert_same_batches(list(wrapped), want)
        pids += wrapped.worker_pids()
        assert len(pids) == 2

        # Wrapping the same files again attaches to the cached dataset (nothing is preloaded twice).
        again = client.wrap(folder, batch_size=4, preload=False, ring_bytes=8 << 20, quiet=True)
        assert again.name == wrapped.name and len(again) == 8

        # Another order and a subset of the files: registered as a list, served with the built-in shuffle.
        subset = ImageFolder(str(root), transform=to_normalized_tensor, loader=jpeg_loader)
        subset.samples = subset.samples[::-1][:-3]
        subset.targets = [t for _, t in subset.samples]
        shuffled = client.wrap(subset, batch_size=8, seed=3, num_workers=1, ring_bytes=8 << 20, quiet=True)
        assert client.manager.dataset(shuffled.name).spec.kind == "list"
        for epoch in range(2):
            shuffled.set_epoch(epoch)
            sampler = DistributedSampler(subset, num_replicas=1, rank=0, shuffle=True, seed=3)
            sampler.set_epoch(epoch)
            assert_same_batches(list(shuffled), list(DataLoader(subset, batch_size=8, sampler=sampler)))
        pids += shuffled.worker_pids()
        assert len(pids) == 3
    finally:
        client.close()  # closes every wrapped dataset and its workers
    assert not any(alive(pid) for pid in pids)
    assert multiprocessing.active_children() == []


@pytest.fixture
def served_folder(cluster_factory, tmp_path):
    """``(client, folder)``: a folder of JPEGs and a client of two servers allowed to read it."""
    root = make_jpegs(tmp_path / "imgs")
    folder = ImageFolder(str(root), transform=to_normalized_tensor, loader=jpeg_loader)
    cluster = cluster_factory(
        2, server_args=["--backend-allow", str(tmp_path), "--memory", "16MiB", "--region-size", "1MiB"]
    )
    client = KSpeedClient(config=config_for(cluster))
    try:
        wait_for(lambda: len([r for r in client.manager.servers() if r.state == 2]) == 2, 10, "two ready servers")
        yield client, folder
    finally:
        client.close()


def random_sampler_epochs(client, folder, epochs, between):
    """What wrapping ``folder`` with ``RandomSampler(folder)`` (no generator: it draws a seed from
    torch's global generator each epoch) delivers epoch after epoch, ``between`` run after each, and
    what a DataLoader over the folder with such a sampler gives, the global generator seeded alike."""
    wrapped = client.wrap(folder, 8, sampler=RandomSampler(folder), num_workers=0, ring_bytes=8 << 20, quiet=True)
    torch.manual_seed(11)
    got = []
    for epoch in range(epochs):
        wrapped.set_epoch(epoch)
        got.append(list(wrapped))
        between()
    torch.manual_seed(11)
    twin = RandomSampler(folder)
    want = []
    for _ in range(epochs):
        order = list(twin)  # (a DataLoader would also draw its workers' seed: the sampler's draw alone)
        want.append([default_collate([folder[i] for i in order[k : k + 8]]) for k in range(0, len(order), 8)])
        between()
    return wrapped, got, want


def test_a_random_samplers_next_epoch_is_planned_ahead(served_folder):
    client, folder = served_folder
    wrapped, got, want = random_sampler_epochs(client, folder, 3, lambda: None)
    for epoch in range(3):
        assert_same_batches(got[epoch], want[epoch])
    stats = wrapped.stats()
    # epochs 1 and 2 were planned while the one before was consumed, and their plans used
    assert (stats["predictions_used"], stats["predictions_missed"]) == (2, 0)


def test_a_loop_drawing_from_torchs_global_rng_gets_the_samplers_order(served_folder):
    client, folder = served_folder
    wrapped, got, want = random_sampler_epochs(client, folder, 3, lambda: torch.rand(1000))  # noise, say
    for epoch in range(3):
        assert_same_batches(got[epoch], want[epoch])
    stats = wrapped.stats()
    # each prediction failed (the loop drew between epochs): dropped, the real order planned at the start
    assert (stats["predictions_used"], stats["predictions_missed"]) == (0, 2)
