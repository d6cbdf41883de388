"""Datasets larger than their memory: the ``stream`` policy and the caching policies, end to end.

Real daemons on loopback: two servers of 8 MiB pools in 1 MiB regions, a dataset of about
6.5 MiB held in at most 2 MiB (its quota), so each server keeps a window of a third of its share
and reads the rest from the backend as the plans consume it. Two ranks read three epochs at once:
every sample arrives exactly once per epoch, in the sampler's order, bytes intact, and the servers'
figures say how many bytes each epoch cost the backend.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from kspeed import DatasetSpec, KSpeedClient
from kspeed.errors import DatasetError
from kspeed.proto import kspeed_pb2
from tests.integration.test_client import config_for, loader_order
from tests.integration.test_datasets import make_tree

BATCH = 8
SEED = 11
EPOCHS = 3
QUOTA = 4 << 20


def read_epochs(client_config, spec, files, rank: int, world: int, errors: list, *, ring=1 << 20) -> None:
    """One rank: ``EPOCHS`` epochs, each checked against the sampler's order and the files' bytes."""
    keys = list(files)
    try:
        with KSpeedClient(config=client_config) as client:
            ds = client.dataset(
                spec, batch_size=BATCH, seed=SEED, rank=rank, world_size=world, ring_bytes=ring, quiet=True
            )
            for epoch in range(EPOCHS):
                ds.set_epoch(epoch)
                got = []
                for batch in ds:
                    for i, sid in enumerate(batch.ids.tolist()):
                        assert batch.numpy(i).tobytes() == files[keys[sid]], f"rank {rank} epoch {epoch} sample {sid}"
                    got.append(batch.ids.tolist())
                want = loader_order(len(files), world, rank, True, SEED, False, epoch, BATCH)
                assert got == want, f"rank {rank} epoch {epoch}: not the sampler's order"
            ds.close()
    except BaseException as exc:
        errors.append(exc)


def run_ranks(cluster, spec, files, world: int) -> None:
    """Register ``spec`` as an operator's (so it outlives the ranks) and run ``world`` ranks at once."""
    with KSpeedClient(config=config_for(cluster)) as client:
        client.manager.create_dataset(spec.to_proto(), operator=True)
    errors: list[BaseException] = []
    threads = [
        threading.Thread(target=read_epochs, args=(config_for(cluster), spec, files, rank, world, errors))
        for rank in range(world)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=150)
    assert not any(t.is_alive() for t in threads), "a rank did not finish"
    if errors:
        raise errors[0]


def epoch_figures(client, name: str) -> dict[int, kspeed_pb2.EpochFigures]:
    """The servers' figures per plan epoch, summed over the shares."""
    total: dict[int, kspeed_pb2.EpochFigures] = {}
    for status in client.dataset(name).share_status:
        for f in status.epochs:
            t = total.setdefault(f.epoch, kspeed_pb2.EpochFigures(epoch=f.epoch))
            for field in ("planned", "written", "misses", "backend_bytes", "backend_requests"):
                setattr(t, field, getattr(t, field) + getattr(f, field))
            t.stall_s += f.stall_s
    return total


def settled(client, name: str, planned: int) -> dict[int, kspeed_pb2.EpochFigures]:
    """The figures once every epoch is reported written in full (heartbeats carry them)."""
    deadline = time.monotonic() + 20
    while True:
        figures = epoch_figures(client, name)
        if all(figures.get(e) and figures[e].written == planned for e in range(EPOCHS)):
            return figures
        assert time.monotonic() < deadline, f"the servers' figures never showed {planned} written per epoch: {figures}"
        time.sleep(0.1)


@pytest.mark.timeout(200)
def test_a_dataset_three_times_its_memory_streams_every_sample_once_per_epoch_on_two_ranks(cluster_factory, tmp_path):
    files = make_tree(tmp_path / "big", per_class=450, max_size=64 * 1024, seed=4)
    total = sum(len(b) for b in files.values())
    cluster = cluster_factory(2, server_args=["--backend-allow", str(tmp_path)])
    spec = DatasetSpec(name="big", uri=str(tmp_path / "big"), quota_bytes=QUOTA)
    run_ranks(cluster, spec, files, world=2)
    with KSpeedClient(config=config_for(cluster)) as client:
        info = client.manager.dataset("big")
        assert {s.policy for s in info.shares} == {"stream"}, info.shares  # "auto" and it did not fit
        held = sum(s.memory_regions for s in info.shares)
        need = sum(s.num_regions for s in info.shares)
        assert held * (1 << 20) <= QUOTA and need >= 3 * held, (held, need)
        assert info.state == kspeed_pb2.DatasetState.DATASET_STATE_READY
        padded = len(files) + len(files) % 2  # DistributedSampler pads to a multiple of the world
        figures = settled(client.manager, "big", padded)
        biggest = max(len(b) for b in files.values())
        for epoch in range(EPOCHS):
            f = figures[epoch]
            # Each sample read at most once for each epoch's plans: at most the dataset's bytes plus
            # the padding's. (A read is counted for the plan it was made for: a sample the next
            # epoch's plan had read already, while it was committed early, is a hit here.)
            assert f.backend_bytes <= total + (padded - len(files)) * biggest, (epoch, f)
            assert f.misses == f.backend_requests <= padded and f.written == padded, (epoch, f)
        assert sum(f.backend_bytes for f in figures.values()) >= total  # (nothing was there before)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("policy", ["minio", "reuse", "lru"])
def test_caching_policies_deliver_exactly_and_keep_part_of_the_dataset(cluster_factory, tmp_path, policy):
    files = make_tree(tmp_path / "big", per_class=150, max_size=64 * 1024, seed=6)
    total = sum(len(b) for b in files.values())
    cluster = cluster_factory(2, server_args=["--backend-allow", str(tmp_path)])
    spec = DatasetSpec(name="big", uri=str(tmp_path / "big"), quota_bytes=QUOTA, policy=policy)
    run_ranks(cluster, spec, files, world=1)
    with KSpeedClient(config=config_for(cluster)) as client:
        info = client.manager.dataset("big")
        assert {s.policy for s in info.shares} == {policy}
        figures = settled(client.manager, "big", len(files))
        assert total <= figures[0].backend_bytes  # the first epoch reads everything
        for epoch in (1, 2):  # later ones find part of it kept
            assert figures[epoch].written - figures[epoch].misses > 0, (policy, epoch, figures[epoch])
            assert figures[epoch].backend_bytes < total, (policy, epoch, figures[epoch])


@pytest.mark.timeout(120)
def test_grants_that_wait_for_a_slow_backend_are_named_and_left_out_of_the_paths_latency(cluster_factory, tmp_path):
    files = make_tree(tmp_path / "slow", per_class=40, max_size=32 * 1024, seed=8)
    slow = ["--backend-allow", f"slowfile://{tmp_path}", "--backend-options", '{"slowfile": {"latency": 0.02}}']
    cluster = cluster_factory(2, server_args=slow)
    spec = DatasetSpec(name="slow", uri=f"slowfile://{tmp_path / 'slow'}", quota_bytes=QUOTA, policy="stream")
    keys = list(files)
    with KSpeedClient(config=config_for(cluster, pacing="on")) as client:
        ds = client.dataset(spec, batch_size=BATCH, seed=SEED, ring_bytes=1 << 20, quiet=True)
        for batch in ds:
            for i, sid in enumerate(batch.ids.tolist()):
                assert batch.numpy(i).tobytes() == files[keys[sid]]
        pacing = ds.stats()["pacing"]
        # Grants waited for 20 ms reads, 8 in a row per producer task (160 ms); the servers said so,
        # and the latencies left it out (what is left is the write and its completion).
        assert pacing["held_by_production_s"] > 0.02, pacing
        assert pacing["sub_batch_latency_p50_ms"] < 80, pacing
        ds.close()


@pytest.mark.timeout(120)
def test_a_file_changed_between_epochs_is_named_never_streamed_stale(cluster_factory, tmp_path):
    files = make_tree(tmp_path / "big", per_class=150, max_size=64 * 1024, seed=9)  # about 4 MiB
    cluster = cluster_factory(2, server_args=["--backend-allow", str(tmp_path)])
    # a window of 1 MiB: while epoch 0 ends it reads at most the first fifth of epoch 1 ahead
    spec = DatasetSpec(name="big", uri=str(tmp_path / "big"), quota_bytes=1 << 20, policy="stream")
    keys = list(files)
    with KSpeedClient(config=config_for(cluster)) as client:
        ds = client.dataset(spec, batch_size=BATCH, seed=SEED, ring_bytes=1 << 20, quiet=True)
        assert sum(len(b) for b in ds) == len(files)  # epoch 0, every sample read from the backend
        # One file rewritten (same size, new bytes), one deleted, among those epoch 1 uses last (a
        # sample is read at most a window ahead of its use; docs/policies.md).
        order = [sid for b in loader_order(len(files), 1, 0, True, SEED, False, 1, BATCH) for sid in b]
        late = [sid for sid in order[-len(order) // 4 :] if len(files[keys[sid]]) > 0]
        changed, gone = late[0], late[1]
        path = tmp_path / "big" / keys[changed]
        path.write_bytes(bytes(reversed(files[keys[changed]])))
        os.utime(path, (time.time() + 5, time.time() + 5))
        (tmp_path / "big" / keys[gone]).unlink()
        ds.set_epoch(1)
        delivered: dict[int, bytes] = {}
        with pytest.raises(DatasetError) as failed:
            for batch in ds:
                delivered.update({sid: batch.numpy(i).tobytes() for i, sid in enumerate(batch.ids.tolist())})
        text = str(failed.value)
        assert (f"sample {changed}" in text and keys[changed] in text) or (
            f"sample {gone}" in text and keys[gone] in text
        )
        assert all(data == files[keys[sid]] for sid, data in delivered.items())  # nothing stale came through
        assert changed not in delivered and gone not in delivered
        state = kspeed_pb2.DatasetState.DATASET_STATE_CHANGED
        deadline = time.monotonic() + 10  # (the servers' heartbeats carry the change)
        while client.manager.dataset("big").state != state:
            assert time.monotonic() < deadline, client.manager.dataset("big")
            time.sleep(0.1)
        assert any(keys[changed] in c or keys[gone] in c for c in client.manager.dataset("big").changes)
        ds.close()
