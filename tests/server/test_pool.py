"""Memory pool: carving, lifecycle, manifest, adoption, destruction and capacity errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kspeed.errors import CapacityError, ConfigError, DatasetError, StateError
from kspeed.server.memory import statefile
from kspeed.server.memory.pool import MANIFEST_NAME, MemoryPool, RegionState, map_region
from tests.server.datasets import REGION
from tests.server.test_host import BlockedWrite, in_thread


def test_carve_creates_region_files_of_region_size(pool):
    assert pool.region_count == 8
    for info in pool.regions():
        assert info.state is RegionState.FREE
        assert info.path.stat().st_size == REGION
    assert pool.counts()[RegionState.FREE] == 8
    assert pool.array(0).ctypes.data % 4096 == 0


def test_region_size_must_be_page_multiple(tmp_path):
    with pytest.raises(ConfigError, match="multiple of the page size"):
        MemoryPool.create(tmp_path / "p", 4 << 20, region_size=REGION + 1)
    with pytest.raises(ConfigError, match="smaller than one region"):
        MemoryPool.create(tmp_path / "p", REGION - 4096, region_size=REGION)


def test_lifecycle_transitions_and_wrong_state(pool):
    infos = pool.allocate("ds", [3, 4])
    assert [i.vindex for i in pool.regions("ds")] == [3, 4]
    r = infos[0].index
    with pytest.raises(StateError, match="call begin_fill first"):
        pool.seal(r)
    pool.begin_fill(r)
    with pytest.raises(StateError, match="allocate it first"):
        pool.begin_fill(r)
    pool.seal(r)
    assert pool.region(r).state is RegionState.SEALED
    counts = pool.counts()
    assert (counts[RegionState.SEALED], counts[RegionState.ALLOCATED], counts[RegionState.FREE]) == (1, 1, 6)
    pool.unseal(r)
    assert pool.region(r).state is RegionState.ALLOCATED
    assert pool.release("ds") == 2
    assert pool.counts()[RegionState.FREE] == 8


def test_allocate_same_virtual_index_twice_is_refused(pool):
    pool.allocate("ds", [0])
    with pytest.raises(StateError, match="already holds virtual regions"):
        pool.allocate("ds", [0, 1])
    assert len(pool.regions("ds")) == 1


def test_capacity_error_names_requested_and_free_and_leaves_nothing(pool):
    pool.allocate("a", range(5))
    with pytest.raises(CapacityError, match=r"requested 4 regions.*3 free of 8"):
        pool.allocate("b", range(4))
    assert pool.regions("b") == []
    assert pool.counts()[RegionState.FREE] == 3


def test_capacity_error_when_backing_store_cannot_hold_pool(tmp_path, monkeypatch):
    import os

    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(CapacityError, match="cannot back"):
        MemoryPool.create(tmp_path / "p", 4 * REGION, region_size=REGION)
    assert not list((tmp_path / "p").glob("region-*"))


def test_bad_dataset_name(pool):
    with pytest.raises(DatasetError, match="invalid dataset name"):
        pool.allocate("../etc", [0])


def test_adopt_keeps_sealed_data_and_resets_filling(tmp_path):
    p = MemoryPool.create(tmp_path / "pool", 4 * REGION, region_size=REGION)
    a, b = (i.index for i in p.allocate("ds", [0, 1]))
    p.array(a)[:5] = np.frombuffer(b"hello", np.uint8)
    p.begin_fill(a)
    p.seal(a)
    p.begin_fill(b)
    p.close()
    q = MemoryPool.adopt(tmp_path / "pool", region_size=REGION)
    assert q.region(a).state is RegionState.SEALED and q.region(a).vindex == 0
    assert q.region(b).state is RegionState.ALLOCATED
    assert bytes(q.array(a)[:5]) == b"hello"
    m = map_region(q.region(a).path)
    assert m[:5] == b"hello"
    m.close()
    q.destroy()


def test_adopt_discards_inconsistent_files(tmp_path):
    p = MemoryPool.create(tmp_path / "pool", 4 * REGION, region_size=REGION)
    a, b = (i.index for i in p.allocate("ds", [0, 1]))
    p.close()
    with open(p.path(b), "r+b") as f:
        f.truncate(REGION // 2)
    (tmp_path / "pool" / "region-00099.bin").write_bytes(b"stray")
    q = MemoryPool.adopt(tmp_path / "pool", region_size=REGION)
    assert q.region(a).state is RegionState.ALLOCATED
    assert q.region(b).state is RegionState.FREE
    assert q.path(b).stat().st_size == REGION
    assert not (tmp_path / "pool" / "region-00099.bin").exists()
    with pytest.raises(StateError, match="region size"):
        MemoryPool.adopt(tmp_path / "pool", region_size=2 * REGION)
    q.destroy()


def test_open_with_corrupt_manifest_creates_fresh_pool(tmp_path):
    p = MemoryPool.create(tmp_path / "pool", 2 * REGION, region_size=REGION)
    p.allocate("ds", [0])
    p.close()
    (tmp_path / "pool" / MANIFEST_NAME).write_text("{not json")
    q = MemoryPool.open(tmp_path / "pool", 3 * REGION, region_size=REGION)
    assert q.region_count == 3 and q.counts()[RegionState.FREE] == 3
    q.destroy()


def test_manifest_is_written_atomically_and_tracks_state(pool):
    pool.allocate("ds", [7])
    doc = json.loads((pool.directory / MANIFEST_NAME).read_text())
    assert doc["region_size"] == REGION
    held = [r for r in doc["regions"] if r["dataset"] == "ds"]
    assert held == [{"state": "allocated", "dataset": "ds", "vindex": 7}]
    assert not list(pool.directory.glob(".*tmp"))


def test_adopt_grows_and_shrinks_free_regions(tmp_path):
    p = MemoryPool.create(tmp_path / "pool", 2 * REGION, region_size=REGION)
    p.allocate("ds", [0])
    p.close()
    q = MemoryPool.adopt(tmp_path / "pool", 4 * REGION, region_size=REGION)
    assert q.region_count == 4
    q.close()
    r = MemoryPool.adopt(tmp_path / "pool", 1 * REGION, region_size=REGION)
    assert r.region_count == 1 and r.regions("ds")
    assert len(list((tmp_path / "pool").glob("region-*.bin"))) == 1
    r.destroy()


def test_release_removes_side_files_and_destroy_removes_everything(tmp_path):
    p = MemoryPool.create(tmp_path / "pool", 2 * REGION, region_size=REGION)
    p.allocate("ds", [0])
    p.side_path("ds", "index.npz").write_bytes(b"x")
    p.release("ds")
    assert not p.side_path("ds", "index.npz").exists()
    p.destroy()
    assert not (tmp_path / "pool").exists()


def test_a_slow_manifest_write_leaves_the_pools_counts_answered(pool, monkeypatch):
    # A seal writes the manifest, which syncs it: seconds on a busy disk. A heartbeat's region
    # counts wait for the pool's lock, so the write happens after the lock is let go.
    (region,) = [info.index for info in pool.allocate("ds", [0])]
    pool.begin_fill(region)
    writing = BlockedWrite(pool.directory / MANIFEST_NAME)
    monkeypatch.setattr(statefile, "write_atomic", writing)
    sealing, sealed = in_thread(lambda: pool.seal(region))
    assert writing.started.wait(30)
    asking, answers = in_thread(lambda: (pool.counts(), pool.regions("ds"), pool.region(region)))
    asking.join(30)
    still_writing = not writing.go.is_set() and sealing.is_alive()
    writing.go.set()
    sealing.join(30)
    assert still_writing and answers, "the pool's counts waited for the manifest to be written"
    counts, _, info = answers[0]
    assert counts[RegionState.SEALED] == 1 and info.state is RegionState.SEALED  # the change, before its write
    assert sealed == [None] and writing.paths == [str(pool.directory / MANIFEST_NAME)]
    states = [entry["state"] for entry in json.loads((pool.directory / MANIFEST_NAME).read_text())["regions"]]
    assert states.count("sealed") == 1


def test_a_manifest_snapshot_taken_before_a_newer_one_was_written_is_not_written_over_it(tmp_path):
    manifest = statefile.OrderedFile(tmp_path / "state.json")
    older, newer = manifest.snapshot(b"older"), manifest.snapshot(b"newer")
    manifest.write(newer)
    manifest.write(older)  # the thread that took it was slower to the file: what it says is out of date
    assert (tmp_path / "state.json").read_bytes() == b"newer" and manifest.written == newer.number
    manifest.write(manifest.snapshot(b"newest"))
    assert (tmp_path / "state.json").read_bytes() == b"newest"
