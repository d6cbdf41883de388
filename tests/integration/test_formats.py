"""Formats end to end: an .npy array's samples come back with its dtype and row shape."""

from __future__ import annotations

import numpy as np
import pytest

from kspeed import DatasetSpec, KSpeedClient
from kspeed.errors import DatasetError
from tests.integration.test_client import config_for, loader_order
from tests.integration.test_datasets import make_tree

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
