"""A job resumed at another world size (and batch size) delivers the rest of the epoch exactly
once over its new ranks, then whole epochs; also with a server killed during the resumed part.

Each rank is a dataset of its own in this process (the ranks of a job share nothing but the
state saved: rank 0's, as a checkpoint of a synchronous job holds it)."""

from __future__ import annotations

import json
import signal
from collections import Counter
from pathlib import Path

import pytest

from kspeed import DatasetSpec, KSpeedClient
from kspeed.client.dataset import KSpeedDataset
from kspeed.errors import ConfigError
from tests.integration.test_client import config_for, loader_order
from tests.integration.test_datasets import make_tree
from tests.integration.test_torchrun import torchrun

EPOCH, SEED = 3, 7
DCP_JOB = Path(__file__).with_name("dcp_resize_job.py")
LIVE_JOB = Path(__file__).with_name("live_job.py")


def read(ds, files, keys, batches=None) -> list[int]:
    """The IDs of the next ``batches`` batches (all: the epoch's rest), their bytes checked."""
    got: list[int] = []
    for k, batch in enumerate(ds):
        for i, sid in enumerate(batch.ids.tolist()):
            assert batch.numpy(i).tobytes() == files[keys[sid]], f"sample {sid}"
        got += batch.ids.tolist()
        if batches is not None and k + 1 == batches:
            break
    return got


def run_before(client, spec, files, world: int, batch: int) -> tuple[list[int], list[dict]]:
    """Every rank of ``world`` reads 37% of its batches of the epoch; what they read, and their states."""
    keys = list(files)
    seen, states = [], []
    for rank in range(world):
        ds = client.dataset(spec, batch_size=batch, rank=rank, world_size=world, seed=SEED, quiet=True)
        ds.set_epoch(EPOCH)
        seen += read(ds, files, keys, round(0.37 * len(ds)))
        states.append(ds.state_dict())
        ds.close()
    return seen, states


@pytest.mark.timeout(180)
@pytest.mark.parametrize("classes", [("a", "b", "c", "d"), ("a", "b", "c", "d", "e")], ids=["36", "35"])
def test_resumed_at_another_world_size_every_sample_is_delivered_once(cluster_factory, tmp_path, classes):
    files = make_tree(tmp_path / "imgs", classes=classes, per_class=9 if len(classes) == 4 else 7, max_size=4096)
    n, keys = len(files), list(files)
    cluster = cluster_factory(2, server_args=["--backend-allow", str(tmp_path)])
    spec = DatasetSpec(name="imgs", uri=str(tmp_path / "imgs"))
    with KSpeedClient(config=config_for(cluster)) as client:
        for before, after in [(4, 2), (2, 3), (3, 1)]:
            seen, states = run_before(client, spec, files, before, batch=3)
            assert 0 < len(seen) < n
            for rank in range(after):
                ds = client.dataset(spec, batch_size=4, rank=rank, world_size=after, seed=SEED, quiet=True)
                ds.load_state_dict(states[0])
                ds.set_epoch(EPOCH)  # (the usual loop's call keeps the loaded position)
                rest = read(ds, files, keys)
                assert len(ds) == -(-len(rest) // 4)
                seen += rest
                ds.set_epoch(EPOCH + 1)  # the next epoch is whole again, this rank's usual part
                whole = loader_order(n, after, rank, True, SEED, False, EPOCH + 1, 4)
                assert read(ds, files, keys) == [i for batch in whole for i in batch]
                ds.close()
            counts = Counter(seen)
            assert set(counts) == set(range(n)), (before, after)
            assert sum(c - 1 for c in counts.values()) < after, (before, after)  # the new pass's pads only


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("before", "after"), [(4, 2), (2, 3), (3, 1)])
def test_a_server_killed_during_the_resumed_part_loses_no_sample(cluster_factory, tmp_path, before, after):
    files = make_tree(tmp_path / "imgs", max_size=128 * 1024)
    n, keys = len(files), list(files)  # 120, more than one server holds
    cluster = cluster_factory(2, server_args=["--backend-allow", str(tmp_path)])
    spec = DatasetSpec(name="imgs", uri=str(tmp_path / "imgs"))
    with KSpeedClient(config=config_for(cluster, failover_timeout="60s")) as client:
        seen, states = run_before(client, spec, files, before, batch=3)
        shares = client.manager.dataset("imgs").shares
        assert len({s.server_id for s in shares}) == 2
        victim = next(s for s in cluster.servers if s.ready["id"] == shares[0].server_id)
        for rank in range(after):
            ds = client.dataset(spec, batch_size=4, rank=rank, world_size=after, seed=SEED, quiet=True)
            ds.load_state_dict(states[0])
            last = rank == after - 1
            if last:  # its feeds are open on both servers: one dies before it writes this rank a sample
                victim.signal(signal.SIGKILL)
            seen += read(ds, files, keys)
            assert ds.stats()["replaced_servers"] == last
            ds.close()
    counts = Counter(seen)
    assert set(counts) == set(range(n))
    assert sum(c - 1 for c in counts.values()) < after


@pytest.mark.timeout(180)
def test_resumed_twice_with_ranks_apart_and_a_server_killed_during_the_resumed_part(cluster_factory, tmp_path):
    files = make_tree(tmp_path / "imgs", max_size=128 * 1024)
    n, keys = len(files), list(files)  # 120, more than one server holds
    cluster = cluster_factory(2, server_args=["--backend-allow", str(tmp_path)])
    spec = DatasetSpec(name="imgs", uri=str(tmp_path / "imgs"))
    with KSpeedClient(config=config_for(cluster, failover_timeout="60s")) as client:
        # Four ranks stop at different batches; their states merged keep each one's own position.
        seen, states = [], []
        for rank, batches in enumerate([2, 3, 1, 2]):
            ds = client.dataset(spec, batch_size=2, rank=rank, world_size=4, seed=SEED, quiet=True)
            ds.set_epoch(EPOCH)
            seen += read(ds, files, keys, batches)
            states.append(ds.state_dict())
            ds.close()
        merged = KSpeedDataset.merge_states(list(reversed(states)))
        assert merged["passes"] == [[4, [4, 6, 2, 4]]]
        # Two ranks take over and stop part way; then three finish the epoch while a server dies.
        middle = []
        for rank in range(2):
            ds = client.dataset(spec, batch_size=3, rank=rank, world_size=2, seed=SEED, quiet=True)
            ds.load_state_dict(merged)
            seen += read(ds, files, keys, 2)
            middle.append(ds.state_dict())
            ds.close()
        assert middle[0]["passes"] == [[4, [4, 6, 2, 4]], [2, [6, 6]]]
        shares = client.manager.dataset("imgs").shares
        assert len({s.server_id for s in shares}) == 2
        victim = next(s for s in cluster.servers if s.ready["id"] == shares[0].server_id)
        for rank in range(3):
            ds = client.dataset(spec, batch_size=2, rank=rank, world_size=3, seed=SEED, quiet=True)
            ds.load_state_dict(middle[1])
            if rank == 2:  # its feeds are open on both servers: one dies before it writes this rank a sample
                victim.signal(signal.SIGKILL)
            seen += read(ds, files, keys)
            assert ds.stats()["replaced_servers"] == (rank == 2)
            ds.close()
        counts = Counter(seen)
        assert set(counts) == set(range(n))
        assert sum(c - 1 for c in counts.values()) < 3


def test_a_sampler_that_cannot_resize_is_refused_by_name(cluster_factory, tmp_path):
    import torch
    from torch.utils.data import RandomSampler

    make_tree(tmp_path / "imgs", classes=("a", "b"), per_class=6, max_size=1024)
    cluster = cluster_factory(1, server_args=["--backend-allow", str(tmp_path)])
    spec = DatasetSpec(name="imgs", uri=str(tmp_path / "imgs"))
    with KSpeedClient(config=config_for(cluster)) as client:
        with client.dataset(spec, batch_size=2, rank=0, world_size=2, seed=SEED, quiet=True) as ds:
            state = ds.state_dict()
        sampler = RandomSampler(range(12), generator=torch.Generator().manual_seed(1))
        with client.dataset(spec, batch_size=2, sampler=sampler, seed=SEED, quiet=True) as other:
            with pytest.raises(ConfigError, match="sampler"):
                other.load_state_dict(state)
            own = other.state_dict()
        larger = client.dataset(spec, batch_size=3, sampler=sampler, seed=SEED, quiet=True)
        with larger, pytest.raises(ConfigError, match="batch_size"):
            larger.load_state_dict(own)


@pytest.mark.timeout(400)
def test_a_torchrun_job_checkpointed_with_dcp_resumes_at_another_world_size(cluster_factory, tmp_path):
    files = make_tree(tmp_path / "imgs", per_class=17, max_size=2000)  # 51 samples
    cluster = cluster_factory(1, server_args=["--backend-allow", str(tmp_path)])
    out, checkpoint = tmp_path / "out", tmp_path / "checkpoint"
    out.mkdir()
    seen = []
    for mode, world in (("save", 2), ("load", 3)):
        torchrun(cluster, DCP_JOB, str(tmp_path / "imgs"), str(out), str(checkpoint), mode, processes=world)
        parts = [json.loads((out / f"{mode}-rank-{r}.json").read_text())["ids"] for r in range(world)]
        assert len({len(p) for p in parts}) == 1  # the ranks' parts are equal
        seen += [i for p in parts for i in p]
    counts = Counter(seen)
    assert set(counts) == set(range(len(files)))
    assert sum(c - 1 for c in counts.values()) < 3


@pytest.mark.timeout(400)
def test_a_rank_killed_mid_epoch_under_torchrun_restarts_and_the_job_finishes_the_epoch_live(cluster_factory, tmp_path):
    files = make_tree(tmp_path / "imgs", per_class=15, max_size=2000)  # 45 samples
    cluster = cluster_factory(2, server_args=["--backend-allow", str(tmp_path)])
    out = tmp_path / "out"
    out.mkdir()
    # (one node of at most two, a restart allowed; the rendezvous does not wait for a second node)
    elastic = ("--nnodes", "1:2", "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0")
    elastic += ("--rdzv-conf", "last_call_timeout=1", "--monitor-interval", "0.2")
    torchrun(cluster, LIVE_JOB, str(tmp_path / "imgs"), str(out), "3", launcher=elastic)
    first = [json.loads((out / f"try0-rank-{r}.json").read_text()) for r in range(2)]
    second = [json.loads((out / f"try1-rank-{r}.json").read_text()) for r in range(2)]
    assert [len(r["ids"]) for r in first] == [9, 9]  # three batches each, then the kill
    assert [r["epoch"] for r in second] == [2, 2]  # the restart took up the killed epoch
    seen = Counter(i for r in first + second for i in r["ids"])
    assert set(seen) == set(range(len(files)))  # every sample of the epoch once
    assert sum(c - 1 for c in seen.values()) < 2  # (apart from a pad of the new pass)
    assert not list(tmp_path.rglob("*.distcp"))  # no checkpoint anywhere
