"""Small datasets share regions: ten of them fit the default local cluster, and failover stays exact.

The cluster is ``kspeed up``'s default shape (two servers of 256 MiB in 128 MiB regions, one of
each server's regions its production window): one free region per server. Before slices, each
350 KiB dataset took a region of its own, so two fit; now each takes a 384 KiB slice of a region
it shares with the others.
"""

from __future__ import annotations

import signal

import pytest

from kspeed import DatasetSpec, KSpeedClient
from kspeed.cli.cluster import wait_for
from tests.integration.test_client import config_for, loader_order
from tests.integration.test_datasets import make_tree

DEFAULT_CLUSTER = ["--memory", "256MiB", "--region-size", "128MiB"]
BATCH = 8
SEED = 4


def read_epoch(client, spec, files, epoch: int = 0) -> None:
    keys = list(files)
    ds = client.dataset(spec, batch_size=BATCH, seed=SEED, ring_bytes=1 << 20, quiet=True)
    ds.set_epoch(epoch)
    got = []
    for batch in ds:
        for i, sid in enumerate(batch.ids.tolist()):
            assert batch.numpy(i).tobytes() == files[keys[sid]], (spec.name, sid)
        got.append(batch.ids.tolist())
    assert got == loader_order(len(files), 1, 0, True, SEED, False, epoch, BATCH), spec.name
    ds.close()


@pytest.mark.timeout(240)
def test_ten_small_datasets_fit_the_default_local_cluster_and_survive_a_server(cluster_factory, tmp_path):
    trees = {f"small{k}": make_tree(tmp_path / f"small{k}", per_class=12, max_size=40_000, seed=k) for k in range(10)}
    cluster = cluster_factory(2, server_args=["--backend-allow", str(tmp_path), *DEFAULT_CLUSTER])
    specs = {name: DatasetSpec(name=name, uri=str(tmp_path / name)) for name in trees}
    with KSpeedClient(config=config_for(cluster, failover_timeout="60s")) as client:
        for spec in specs.values():  # an operator's: they stay between the reads
            info = client.manager.create_dataset(spec.to_proto(), operator=True).dataset
            (share,) = info.shares
            assert share.slice_bytes and share.slice_bytes < 1 << 20 and not share.policy, share
        holders = {name: client.manager.dataset(name).shares[0].server_id for name in trees}
        assert len(set(holders.values())) == 2  # spread over the servers with the most room
        for name, files in trees.items():
            read_epoch(client, specs[name], files)
        # The holder of the first dataset dies: its small datasets move to the survivor's shared
        # region, exactly.
        victim_id = holders["small0"]
        victim = next(s for s in cluster.servers if s.ready["id"] == victim_id)
        victim.signal(signal.SIGKILL)
        moved = [name for name, sid in holders.items() if sid == victim_id]
        wait_for(
            lambda: all(client.manager.dataset(n).shares[0].server_id != victim_id for n in moved) or None,
            60,
            "the victim's small datasets to move",
        )
        for name in moved:
            share = client.manager.dataset(name).shares[0]
            assert share.slice_bytes and not share.on_demand, share
            read_epoch(client, specs[name], trees[name], epoch=1)
