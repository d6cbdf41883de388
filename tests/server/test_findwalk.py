"""GNU find's walk of a local tree: its processes split the folders and give the same tree."""

from __future__ import annotations

import numpy as np
import pytest

from kspeed.server.backend import findwalk, localtree


@pytest.mark.skipif(not findwalk.gnu_find(), reason="GNU find is not installed here")
def test_find_processes_split_the_folders_and_give_the_same_tree(tmp_path):
    root = tmp_path / "t"
    for i in range(60):
        (root / f"c{i % 7}" / f"f{i:03d}").parent.mkdir(parents=True, exist_ok=True)
        (root / f"c{i % 7}" / f"f{i:03d}").write_bytes(b"z" * (i % 5))
    one = localtree.walk_tree(str(root), lambda path, key: None, processes=1)
    three = localtree.walk_tree(str(root), lambda path, key: None, processes=3)
    assert one.blob == three.blob and (one.sizes == three.sizes).all() and (one.stamps == three.stamps).all()
    assert (one.labels == three.labels).all() and one.classes == three.classes == tuple(f"c{k}" for k in range(7))
    assert np.array_equal(one.unwatchable, three.unwatchable)
