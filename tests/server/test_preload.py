"""Preload: byte-exact loading, packing, joining, restart re-adoption, errors, integrity."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from kspeed.cli.cluster import wait_for
from kspeed.errors import ChangedError, DatasetError, IntegrityError, NotFoundError, StateError
from kspeed.server.backend.access import Backend
from kspeed.server.backend.allowlist import AllowList
from kspeed.server.backend.sources import open_source
from kspeed.server.hosting.integrity import SampleStore
from kspeed.server.hosting.preload import SAVE_COST_SHARE, Preloader
from kspeed.server.memory.pool import MemoryPool, RegionState
from tests.server.datasets import REGION, write_tree


class CountingSource:
    """Wraps a source and counts backend reads per sample."""

    def __init__(self, src):
        self._src = src
        self.reads = np.zeros(src.count, dtype=np.int64)
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self._src, name)

    def read_into(self, sample_id, buf):
        with self._lock:
            self.reads[sample_id] += 1
        return self._src.read_into(sample_id, buf)

    def read_run(self, ids, out, offsets, sizes):
        with self._lock:
            np.add.at(self.reads, ids, 1)
        return self._src.read_run(ids, out, offsets, sizes)


def make(tmp_path, backend, pool, sizes, *, lo=0, hi=None, first_region=0, uri=None, **kw):
    files = write_tree(tmp_path / "d", sizes)
    src = CountingSource(open_source(backend, "ds", uri or str(tmp_path / "d")))
    hi = src.count if hi is None else hi
    n = Preloader.regions_needed(src, pool.region_size, lo, hi)
    pool.allocate("ds", range(first_region, first_region + n))
    return files, src, Preloader(src, pool, lo=lo, hi=hi, first_region=first_region, **kw)


def test_preload_is_byte_exact_and_packed(tmp_path, backend, pool):
    sizes = np.random.default_rng(0).integers(0, 100_000, 120)
    files, _src, pre = make(tmp_path, backend, pool, sizes, threads=4, batch_bytes=64 << 10)
    result = pre.preload(timeout=30)
    assert result.complete and not result.errors and result.read_samples == 120
    keys = sorted(files)
    for i, k in enumerate(keys):
        r, off, n = int(pre.index.region[i]), int(pre.index.offset[i]), int(pre.index.length[i])
        assert bytes(pre.region_array(r)[off : off + n]) == files[k]
    # Packed: within a region each sample starts where the previous one ends; a new region starts
    # only when the next sample would not fit.
    same = pre.index.region[1:] == pre.index.region[:-1]
    ends = pre.index.offset + pre.index.length
    assert np.array_equal(pre.index.offset[1:][same], ends[:-1][same])
    assert (pre.index.offset[1:][~same] == 0).all() and (ends[:-1][~same] + pre.index.length[1:][~same] > REGION).all()
    assert all(r.state is RegionState.SEALED for r in pool.regions("ds"))
    p = pre.progress()
    assert (p.samples_done, p.bytes_done, p.eta_s, p.running) == (120, int(sizes.sum()), 0.0, False)
    assert p.rate_bytes_s > 0


def test_share_of_a_range_and_store_reads(tmp_path, backend, pool):
    sizes = [1000] * 50
    files, src, pre = make(tmp_path, backend, pool, sizes, lo=10, hi=30, first_region=4)
    pre.preload(timeout=30)
    assert src.reads[:10].sum() == 0 and src.reads[30:].sum() == 0 and (src.reads[10:30] == 1).all()
    store = SampleStore(pre)
    keys = sorted(files)
    ids = np.array([29, 10, 15])
    packed, lengths = store.read_many(ids)
    assert bytes(packed) == b"".join(files[keys[i]] for i in ids) and lengths.tolist() == [1000] * 3
    with pytest.raises(NotFoundError, match="sample 30 is not owned"):
        store.read_many(np.array([10, 30]))


def test_concurrent_preload_joins_one_job_and_never_reloads(tmp_path, backend, pool):
    _files, src, pre = make(tmp_path, backend, pool, [5000] * 60, uri=f"slowfile://{tmp_path}/d", threads=4)
    results = []
    threads = [threading.Thread(target=lambda: results.append(pre.preload(timeout=30))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r.complete for r in results)
    assert (src.reads == 1).all()
    assert pre.preload().read_samples == 0
    assert (src.reads == 1).all()


def test_stop_ends_a_running_preload_after_the_reads_in_flight_and_keeps_what_they_loaded(tmp_path):
    # A server that stops (or drops the share) must not wait for the whole preload: at 50 ms a
    # sample on one thread this one would take 3 s; stop() ends it after the read in flight.
    pool = MemoryPool.create(tmp_path / "pool", 24 * REGION, region_size=REGION)
    slow = Backend(AllowList([f"slowfile://{tmp_path}"]), {"slowfile": {"latency": 0.05}})
    sizes = [REGION // 3] * 60  # three samples a region: regions seal as the preload goes
    _files, src, pre = make(tmp_path, slow, pool, sizes, uri=f"slowfile://{tmp_path}/d", threads=1, batch_bytes=1)
    pre.start()
    wait_until = time.monotonic() + 10
    while src.reads.sum() < 3 and time.monotonic() < wait_until:
        time.sleep(0.01)
    pre.stop()
    assert not pre.progress().running
    loaded = int(pre.index.loaded.sum())
    assert 3 <= loaded < 60 and src.reads.sum() == loaded  # every read finished and was recorded
    pre.start()  # nothing starts once stopped
    assert not pre.progress().running and src.reads.sum() == loaded
    pool.close()
    # the index was saved: a restart re-adopts what was loaded (in sealed regions) and reads the rest
    pool2 = MemoryPool.adopt(tmp_path / "pool", region_size=REGION)
    src2 = CountingSource(src._src)
    result = Preloader(src2, pool2).preload(timeout=30)
    assert result.complete and src2.reads.sum() < 60 and (src2.reads + src.reads >= 1).all()
    pool2.destroy()


def test_the_end_of_each_job_is_announced_once_its_outcome_shows(tmp_path, backend, pool):
    _files, _src, pre = make(tmp_path, backend, pool, [3000] * 40, threads=4)
    seen = []
    pre.on_finished = lambda: seen.append(pre.progress())
    pre.preload(timeout=30)
    wait_for(lambda: len(seen) == 1, 10, "the end of the job announced")
    assert not seen[0].running and seen[0].samples_done == 40
    pre.preload(timeout=30)  # everything is loaded: no job runs, nothing to announce
    time.sleep(0.1)
    assert len(seen) == 1


def test_restart_readopts_sealed_regions_and_loads_only_the_rest(tmp_path, backend):
    pool = MemoryPool.create(tmp_path / "pool", 8 * REGION, region_size=REGION)
    sizes = [300_000] * 12  # three per region, four regions
    files, src, pre = make(tmp_path, backend, pool, sizes)
    pre.preload(timeout=30)
    unsealed = pool.regions("ds")[2].index
    pool.unseal(unsealed)
    pool.close()
    pool2 = MemoryPool.adopt(tmp_path / "pool", region_size=REGION)
    src2 = CountingSource(src._src)
    pre2 = Preloader(src2, pool2)
    assert pre2.index.loaded.sum() == 9
    result = pre2.preload(timeout=30)
    assert result.complete and result.read_samples == 3
    assert src2.reads[6:9].tolist() == [1, 1, 1] and src2.reads.sum() == 3
    store = SampleStore(pre2)
    keys = sorted(files)
    assert all(store.read(i) == files[keys[i]] for i in range(12))
    pool2.destroy()


def test_a_preload_saves_its_index_a_bounded_number_of_times(tmp_path, backend, monkeypatch):
    # Saving the whole index at every seal made a preload quadratic in the share's size: a seal
    # saves it only if that keeps saving under 1/SAVE_COST_SHARE of the time. An index whose save
    # takes 0.2 s is saved at most every 4 s (and at the end of the job), not at each of 32 seals.
    pool = MemoryPool.create(tmp_path / "pool", 40 * REGION, region_size=REGION)
    _files, _src, pre = make(tmp_path, backend, pool, [REGION // 2] * 64, threads=2, save_interval_s=60.0)
    saves = []
    original = type(pre.index).save

    def slow_save(index, path):
        saves.append(path)
        time.sleep(0.2)
        original(index, path)

    monkeypatch.setattr(type(pre.index), "save", slow_save)
    started = time.monotonic()
    assert pre.preload(timeout=60).complete
    took = time.monotonic() - started
    assert len(pool.regions("ds")) == 32 and all(r.state is RegionState.SEALED for r in pool.regions("ds"))
    assert 1 <= len(saves) <= 2 + took / (SAVE_COST_SHARE * 0.2) < 32
    pool.close()
    # A restart re-adopts every region: the final save recorded every sample.
    pool2 = MemoryPool.adopt(tmp_path / "pool", region_size=REGION)
    pre2 = Preloader(_src._src, pool2)
    assert pre2.index.loaded.all() and pre2.preload(timeout=30).read_samples == 0
    pool2.destroy()


def test_per_sample_errors_are_reported_and_the_rest_stays_usable(tmp_path, backend, pool):
    files, _src, pre = make(tmp_path, backend, pool, [100] * 10)
    keys = sorted(files)
    stats = {k: os.stat(tmp_path / "d" / k) for k in (keys[3], keys[7])}
    (tmp_path / "d" / keys[3]).unlink()
    (tmp_path / "d" / keys[7]).write_bytes(b"x" * 5)
    result = pre.preload(timeout=30)
    assert not result.complete and result.loaded == 8
    assert sorted(e.sample for e in result.errors) == [3, 7]
    assert all(isinstance(e, DatasetError) and e.dataset == "ds" for e in result.errors)
    assert pool.regions("ds")[0].state is RegionState.FILLING
    store = SampleStore(pre)
    assert store.read(2) == files[keys[2]]
    for key in (keys[3], keys[7]):  # the files come back as listed (same bytes, same mtime): a passing outage
        (tmp_path / "d" / key).write_bytes(files[key])
        os.utime(tmp_path / "d" / key, ns=(stats[key].st_atime_ns, stats[key].st_mtime_ns))
    assert store.read(3) == files[keys[3]] and store.counters["backend_reads"] == 1
    retry = pre.preload(timeout=30)
    assert retry.complete and retry.read_samples == 2
    assert pool.regions("ds")[0].state is RegionState.SEALED


def test_corrupt_byte_is_detected_and_repaired(tmp_path, backend, pool):
    files, _src, pre = make(tmp_path, backend, pool, [4096] * 20)
    pre.preload(timeout=30)
    keys = sorted(files)
    store = SampleStore(pre)
    r, off = int(pre.index.region[5]), int(pre.index.offset[5])
    pre.region_array(r)[off + 17] ^= 0xFF
    assert store.read(5) == files[keys[5]]
    assert store.counters == {"crc_mismatches": 1, "repaired": 1, "backend_reads": 0}
    assert store.verify(5) is True
    pre.region_array(int(pre.index.region[9]))[int(pre.index.offset[9])] ^= 1
    report = store.scrub()
    assert (report.checked, report.repaired, report.failed) == (20, 1, ())
    assert store.read(9) == files[keys[9]]


def test_corruption_with_changed_backend_raises_instead_of_returning_bad_bytes(tmp_path, backend, pool):
    files, _src, pre = make(tmp_path, backend, pool, [64] * 4)
    pre.preload(timeout=30)
    keys = sorted(files)
    listed = os.stat(tmp_path / "d" / keys[1])
    (tmp_path / "d" / keys[1]).write_bytes(b"\0" * 64)
    pre.region_array(int(pre.index.region[1]))[int(pre.index.offset[1])] ^= 1
    with pytest.raises(ChangedError, match=r"'ds' sample 1 .*modified"):  # the repair's read sees a new mtime
        SampleStore(pre).read(1)
    os.utime(tmp_path / "d" / keys[1], ns=(listed.st_atime_ns, listed.st_mtime_ns))
    with pytest.raises(IntegrityError, match="'ds' sample 1"):  # same mtime, other bytes: the checksum tells
        SampleStore(pre).read(1)


def test_missing_regions_are_refused(tmp_path, backend, pool):
    write_tree(tmp_path / "d", [10])
    src = open_source(backend, "ds", str(tmp_path / "d"))
    with pytest.raises(StateError, match="allocate them first"):
        Preloader(src, pool)


def test_a_scrub_walks_the_loaded_samples_a_chunk_at_a_time(tmp_path, backend, pool, monkeypatch):
    monkeypatch.setattr("kspeed.server.hosting.integrity.SCRUB_CHUNK", 3)
    files, _src, pre = make(tmp_path, backend, pool, [256] * 20, lo=2, hi=19)
    pre.preload(timeout=30)
    pre.index.clear(7, 9)  # (not loaded: not scrubbed)
    store = SampleStore(pre)
    for sample in (2, 10, 18):
        pre.region_array(int(pre.index.region[sample - 2]))[int(pre.index.offset[sample - 2])] ^= 1
    report = store.scrub()
    assert (report.checked, report.repaired, report.failed) == (15, 3, ())
    assert store.read(18) == files[sorted(files)[18]]
