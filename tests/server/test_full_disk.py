"""A full disk under a server's state files: the pool manifest, a share's index, the assignments.

Each test fills a real file system (a small tmpfs; skipped where it cannot be mounted): what the
server holds is still served, only what would not survive a restart unrecorded is refused, with
:class:`~kspeed.errors.StateFileError` naming the file and the space left.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from kspeed.errors import StateFileError
from kspeed.server.backend.sources import open_source
from kspeed.server.hosting.datasets import DatasetHost
from kspeed.server.hosting.preload import Preloader
from kspeed.server.hosting.records import ASSIGNMENTS_FILE
from kspeed.server.memory.pool import MANIFEST_NAME, WINDOW_OWNER, MemoryPool, RegionState
from tests.fulldisk import fill, small_disk
from tests.server.datasets import REGION, write_tree
from tests.server.test_host import SIZES, held, request

POOL_DISK = 8 * REGION + (256 << 10)  # eight regions and a little room for the manifest and indexes
NO_SPACE = r"No space left on device \(0 B free there\); free space there"


def test_a_pool_on_a_full_disk_goes_on_and_refuses_only_a_datasets_allocation(tmp_path):
    with small_disk(tmp_path / "disk", POOL_DISK) as disk:
        pool = MemoryPool.create(disk / "pool", 8 * REGION, region_size=REGION)
        try:
            (region,) = [info.index for info in pool.allocate("ds", [0])]
            filler = fill(disk)

            manifest = disk / "pool" / MANIFEST_NAME
            with pytest.raises(StateFileError, match=rf"cannot write {manifest}: {NO_SPACE}") as raised:
                pool.allocate("other", [0, 1])  # a restart would not know whose they are: refused
            assert raised.value.path == str(manifest) and raised.value.free_bytes == 0
            assert pool.regions("other") == [] and pool.counts()[RegionState.FREE] == 7  # nothing allocated

            pool.allocate(WINDOW_OWNER, [0])  # the window never outlives the process: no record needed
            pool.begin_fill(region)
            pool.seal(region)  # a restart would reload it: the manifest may lag
            assert pool.region(region).state is RegionState.SEALED and pool.counts()[RegionState.FREE] == 6
            assert isinstance(pool.unsaved, StateFileError)
            assert not list((disk / "pool").glob(".*.tmp"))  # no half-written file keeps the space

            filler.unlink()
            pool.release(WINDOW_OWNER)  # the next change writes the whole manifest again
            assert pool.unsaved is None
            states = [entry["state"] for entry in json.loads(manifest.read_text())["regions"]]
            assert states.count("sealed") == 1 and states.count("free") == 7
        finally:
            pool.destroy()


def test_an_index_that_cannot_be_saved_is_not_a_failed_sample(tmp_path, backend, caplog):
    files = write_tree(tmp_path / "ds", [300_000] * 6)
    with small_disk(tmp_path / "disk", POOL_DISK) as disk:
        pool = MemoryPool.create(disk / "pool", 8 * REGION, region_size=REGION)
        try:
            source = open_source(backend, "ds", str(tmp_path / "ds"))
            pool.allocate("ds", range(Preloader.regions_needed(source, REGION)))
            preloader = Preloader(source, pool, threads=2)
            fill(disk)
            with caplog.at_level(logging.ERROR, logger="kspeed.server.hosting.preload"):
                result = preloader.preload(timeout=60)
            assert result.complete and result.errors == () and preloader.progress().errors == 0
            assert isinstance(preloader.save_error, StateFileError)
            assert preloader.save_error.path == str(preloader.index_path)
            assert f"cannot write {preloader.index_path}: No space left on device" in caplog.text
            keys = sorted(files)
            for sample in range(6):  # loaded and served all the same
                offset, length = int(preloader.index.offset[sample]), int(preloader.index.length[sample])
                region = preloader.region_array(int(preloader.index.region[sample]))
                assert region[offset : offset + length].tobytes() == files[keys[sample]]
        finally:
            pool.destroy()


def test_a_full_state_disk_refuses_a_new_share_cleanly_and_a_restart_readopts_the_rest(tmp_path, backend):
    files = write_tree(tmp_path / "ds", SIZES)
    keys = sorted(files)
    first, second = request(backend, tmp_path, 0, 6), request(backend, tmp_path, 6, 12)
    with small_disk(tmp_path / "state", 64 << 10) as state:
        pool = MemoryPool.create(tmp_path / "pool", 8 * REGION, region_size=REGION)
        try:
            host = DatasetHost(pool, backend, str(state))
            host.assign(first)
            host.start_preload("ds", 0)
            host.get("ds", 0).preloader.wait()
            filler = fill(state)

            assignments = state / ASSIGNMENTS_FILE
            with pytest.raises(StateFileError, match=rf"cannot write {assignments}: {NO_SPACE}"):
                host.assign(second)
            assert host.keys() == [("ds", 0)] and held(pool) == [0, 1]  # nothing of it kept or allocated
            assert [s.first_id for s in host.statuses()] == [0]  # what it holds, it still serves
            assert host.read("ds", np.array([1])).data == files[keys[1]]
            host.close()
            pool.close()

            pool = MemoryPool.adopt(tmp_path / "pool", region_size=REGION)  # a restart, the disk still full
            restarted = DatasetHost(pool, backend, str(state))
            restarted.restore()
            assert restarted.keys() == [("ds", 0)] and restarted.status("ds", 0).progress.samples_loaded == 6

            filler.unlink()  # room again: the share refused before is taken
            restarted.assign(second)
            assert restarted.keys() == [("ds", 0), ("ds", 6)]
            assert sorted(json.loads(assignments.read_text())) == ["ds@0", "ds@6"]
            restarted.close()
        finally:
            pool.destroy()
