"""Formats end to end: an .npy array's samples come back with its dtype and row shape; tar shards
in WebDataset's order (shards shuffled and split over the ranks, a shuffle buffer)."""

from __future__ import annotations

import numpy as np
import pytest

from kspeed import DatasetSpec, KSpeedClient
from kspeed.errors import DatasetError
from tests.integration.test_client import config_for, loader_order
from tests.integration.test_datasets import make_tree, write_shards

BATCH = 8
SEED = 6


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", ["auto", "stream"])
def test_npy_rows_keep_their_dtype_and_shape(cluster_factory, tmp_path, policy):
    rows = np.random.default_rng(1).standard_normal((200, 3, 5)).astype(np.float32)
    np.save(tmp_path / "rows.npy", rows)
    make_tree(tmp_path / "files", per_class=2, max_size=100)
    cluster = cluster_factory(2, server_args=["--backend-allow", str(tmp_path)])
    quota = (1 << 20) if policy == "stream" else 0
    spec = DatasetSpec(name="rows", uri=str(tmp_path / "rows.npy"), quota_bytes=quota, policy=policy)
    with KSpeedClient(config=config_for(cluster)) as client:
        ds = client.dataset(spec, batch_size=BATCH, seed=SEED, ring_bytes=1 << 20, quiet=True)
        got = []
        for batch in ds:
            for i, sid in enumerate(batch.ids.tolist()):
                row = batch.array(i)
                assert row.dtype == np.float32 and row.shape == (3, 5)
                np.testing.assert_array_equal(row, rows[sid])
            got.append(batch.ids.tolist())
        assert got == loader_order(len(rows), 1, 0, True, SEED, False, 0, BATCH)
        ds.close()
        files = client.dataset(DatasetSpec(name="files", uri=str(tmp_path / "files")), batch_size=4, quiet=True)
        with pytest.raises(DatasetError, match="declares no dtype"):
            next(iter(files)).array(0)  # (files have no dtype: their bytes are numpy(i))
        files.close()


@pytest.mark.timeout(120)
def test_tar_shards_in_webdatasets_order_give_each_sample_once_per_epoch_over_two_ranks(cluster_factory, tmp_path):
    files = make_tree(tmp_path / "imgs", per_class=30, max_size=8 * 1024, seed=3)
    write_shards(tmp_path / "shards", files, 6)
    cluster = cluster_factory(2, server_args=["--backend-allow", str(tmp_path)])
    spec = DatasetSpec(name="shards", uri=str(tmp_path / "shards" / "train-{000..005}.tar"), labels="cls")
    keys = list(files)
    with KSpeedClient(config=config_for(cluster)) as client:
        client.manager.create_dataset(spec.to_proto(), operator=True)
        info = client.manager.dataset("shards")
        starts = np.frombuffer(info.shard_starts, "<i8")
        assert starts[0] == 0 and starts[-1] == len(files) and len(starts) == 7
        ranks = [
            client.dataset(spec, batch_size=BATCH, seed=SEED, rank=r, world_size=2, shuffle_buffer=16, quiet=True)
            for r in range(2)
        ]
        for epoch in range(2):
            seen: list[int] = []
            for ds in ranks:
                ds.set_epoch(epoch)
                for batch in ds:
                    for i, sid in enumerate(batch.ids.tolist()):
                        assert batch.numpy(i).tobytes() == files[keys[sid]]
                    seen += batch.ids.tolist()
            assert sorted(set(seen)) == list(range(len(files))) and len(seen) == len(files) + len(files) % 2
        for ds in ranks:
            ds.close()
