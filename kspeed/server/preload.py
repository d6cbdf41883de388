"""The preload engine: read a server's ID range from the backend into its pool regions.

Samples are written in ID order into the dataset's regions at offsets computed up front from the
sizes (:func:`kspeed.server.index.layout`), so every worker thread reads its files straight into
the final place in the region (``readinto`` at a precomputed offset): the region layout itself
packs many small samples per region, and no staging copy is made (a staging buffer copied
into the region in one go would add a memcpy per byte and save no system call, since each file
is opened and read separately either way). Reads release the GIL, so a bounded pool of threads
overlaps backend latency; crc32c (google-crc32c) is computed on the region bytes per sample.

Concurrent :meth:`Preloader.preload` calls join the one running job; a sample whose loaded flag
is set is never read again; after a restart, regions the pool re-adopted as SEALED (and whose
samples the saved index records) are kept and only the rest is reloaded.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time

import google_crc32c
import numpy as np

from kspeed.errors import DatasetError, StateError
from kspeed.server.index import SampleIndex
from kspeed.server.pool import MemoryPool, RegionState
from kspeed.server.sources import Source

__all__ = ["PreloadResult", "Preloader", "Progress"]

log = logging.getLogger(__name__)

INDEX_FILE = "index.npz"


@dataclasses.dataclass(frozen=True)
class Progress:
    """A consistent snapshot of preload progress (readable from any thread).

    Attributes:
        running: a job is in progress.
        samples_done: owned samples loaded so far (including those loaded before this job).
        samples_total: owned samples.
        bytes_done: bytes of the loaded samples.
        bytes_total: bytes of all owned samples.
        errors: samples that failed in the last job.
        elapsed_s: seconds since the current or last job started.
        rate_bytes_s: bytes per second read by the current or last job.
        rate_samples_s: samples per second read by the current or last job.
        eta_s: estimated seconds left (0 when done, ``None`` before any rate is known).
    """

    running: bool
    samples_done: int
    samples_total: int
    bytes_done: int
    bytes_total: int
    errors: int
    elapsed_s: float
    rate_bytes_s: float
    rate_samples_s: float
    eta_s: float | None


@dataclasses.dataclass(frozen=True)
class PreloadResult:
    """Outcome of the last preload job.

    Attributes:
        read_samples: samples the last job read from the backend; 0 when a call found everything
            loaded already (so nothing was read twice).
        read_bytes: their bytes.
        loaded: owned samples now loaded.
        total: owned samples.
        errors: one error per failed sample, each naming the dataset and the sample; those samples
            stay unloaded (reads fall back to the backend) and the next preload retries them.
    """

    read_samples: int
    read_bytes: int
    loaded: int
    total: int
    errors: tuple[DatasetError, ...]

    @property
    def complete(self) -> bool:
        """Every owned sample is loaded."""
        return self.loaded == self.total


class Preloader:
    """Loads and serves one dataset's share on this server.

    Args:
        source: the dataset's listing (sizes, reads).
        pool: the server's pool; the dataset must already hold regions at virtual indices
            ``first_region..first_region+n-1`` (see :meth:`regions_needed`).
        lo: first owned sample ID.
        hi: one past the last owned sample ID.
        first_region: virtual index of the first region of this share.
        threads: backend reads in flight.
        batch_bytes: a worker task reads consecutive samples up to this many bytes.
        save_interval_s: while loading, save the index at most this often (and at the end).

    Raises:
        StateError: the pool does not hold the regions the share needs.
    """

    def __init__(
        self, source: Source, pool: MemoryPool, *, lo: int = 0, hi: int | None = None, first_region: int = 0,
        threads: int = 16, batch_bytes: int = 1 << 20, save_interval_s: float = 5.0,
    ) -> None:
        self.source, self.pool, self.dataset = source, pool, source.dataset
        hi = source.count if hi is None else hi
        if not 0 <= lo <= hi <= source.count:
            raise DatasetError(
                f"dataset {self.dataset!r}: share {lo}..{hi} outside 0..{source.count}", dataset=self.dataset
            )
        self.threads, self.batch_bytes, self.save_interval_s = max(threads, 1), batch_bytes, save_interval_s
        self.index_path = pool.side_path(self.dataset, INDEX_FILE)
        self.index = SampleIndex.load(
            self.index_path, dataset=self.dataset, lo=lo, sizes=source.sizes[lo:hi],
            region_size=pool.region_size, first_region=first_region, fingerprint=source.fingerprint.digest,
        )
        held = {r.vindex: r for r in pool.regions(self.dataset)}
        wanted = range(first_region, first_region + self.index.num_regions)
        missing = [v for v in wanted if v not in held]
        if missing:
            raise StateError(
                f"dataset {self.dataset!r}: share {lo}..{hi} needs virtual regions {wanted.start}.."
                f"{wanted.stop - 1}, pool lacks {missing[:8]}; allocate them first"
            )
        self._pool_index = [held[v].index for v in wanted]
        self._arrays = [pool.array(i) for i in self._pool_index]
        self._reconcile()
        self._lock = threading.Lock()
        self._job: threading.Thread | None = None
        self._done = threading.Event()
        self._done.set()
        self._job_start = self._job_end = 0.0
        self._read_samples = self._read_bytes = 0
        self._errors: list[DatasetError] = []
        self._last_save = time.monotonic()

    @staticmethod
    def regions_needed(source: Source, region_size: int, lo: int = 0, hi: int | None = None) -> int:
        """Regions the share ``[lo, hi)`` occupies (to allocate from the pool before construction)."""
        hi = source.count if hi is None else hi
        return SampleIndex(source.dataset, lo, source.sizes[lo:hi], region_size).num_regions

    def _reconcile(self) -> None:
        """Trust only regions that are SEALED in the pool and fully recorded in the index."""
        for k, pool_index in enumerate(self._pool_index):
            a, b = int(self.index.bounds[k]), int(self.index.bounds[k + 1])
            state = self.pool.region(pool_index).state
            ok = bool(self.index.loaded[a - self.index.lo : b - self.index.lo].all())
            if state is RegionState.SEALED and ok:
                continue
            if state is RegionState.SEALED:
                log.warning("dataset %s: sealed region %d lacks index entries; reloading it", self.dataset, k)
                self.pool.unseal(pool_index)
            if state is not RegionState.FILLING:
                self.index.clear(a, b)

    # ------------------------------------------------------------------ the job

    def start(self) -> None:
        """Start loading what is not loaded yet; joins the running job if there is one."""
        with self._lock:
            if self._job is not None and self._job.is_alive():
                return
            if self.index.loaded.all() and all(
                self.pool.region(i).state is RegionState.SEALED for i in self._pool_index
            ):
                self._read_samples = self._read_bytes = 0
                self._errors = []
                return
            self._done.clear()
            self._job_start, self._job_end = time.monotonic(), 0.0
            self._read_samples = self._read_bytes = 0
            self._errors = []
            self._job = threading.Thread(target=self._run, name=f"preload-{self.dataset}", daemon=True)
            self._job.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the running job; True if none is running any more."""
        return self._done.wait(timeout)

    def preload(self, timeout: float | None = None) -> PreloadResult:
        """Load the share (or join the running load) and return the outcome.

        Raises:
            StateError: still loading after ``timeout`` seconds; call again to keep waiting.
        """
        self.start()
        if not self.wait(timeout):
            raise StateError(f"dataset {self.dataset!r}: still preloading after {timeout} s; wait again")
        return self.result()

    def result(self) -> PreloadResult:
        """Outcome of the last job (or of nothing, if no job ran)."""
        with self._lock:
            return PreloadResult(self._read_samples, self._read_bytes, int(self.index.loaded.sum()),
                                 len(self.index.loaded), tuple(self._errors))

    def progress(self) -> Progress:
        """Current progress; safe to call from any thread."""
        with self._lock:
            running = not self._done.is_set()
            end = time.monotonic() if running else self._job_end or self._job_start
            elapsed = max(end - self._job_start, 0.0) if self._job_start else 0.0
            loaded = self.index.loaded
            done_bytes = int(self.index.length[loaded].sum())
            total_bytes = int(self.index.length.sum())
            rate = self._read_bytes / elapsed if elapsed > 0 else 0.0
            srate = self._read_samples / elapsed if elapsed > 0 else 0.0
            left = total_bytes - done_bytes
            eta = 0.0 if left == 0 else (left / rate if rate > 0 else None)
            return Progress(running, int(loaded.sum()), len(loaded), done_bytes, total_bytes,
                            len(self._errors), elapsed, rate, srate, eta)

    def _run(self) -> None:
        try:
            with concurrent.futures.ThreadPoolExecutor(self.threads, thread_name_prefix="preload") as ex:
                plan = [(k, self._submit(ex, k)) for k in range(len(self._pool_index))]
                for k, futures in plan:
                    for fut in futures:
                        ids, crcs = fut.result()
                        with self._lock:
                            self.index.mark_loaded(ids, crcs)
                    self._maybe_seal(k)
                    if time.monotonic() - self._last_save > self.save_interval_s:
                        self._save_index()
            self._save_index()
        except Exception as exc:  # a bug or a pool failure: report it through the result
            log.exception("dataset %s: preload job failed", self.dataset)
            with self._lock:
                self._errors.append(DatasetError(f"dataset {self.dataset!r}: preload failed: {exc}",
                                                 dataset=self.dataset))
        finally:
            with self._lock:
                self._job_end = time.monotonic()
                self._done.set()
            p = self.progress()
            log.info("dataset %s: preload read %d samples, %d bytes in %.2f s, %d errors",
                     self.dataset, self._read_samples, self._read_bytes, p.elapsed_s, p.errors)

    def _submit(self, ex: concurrent.futures.Executor, k: int) -> list[concurrent.futures.Future]:
        pool_index = self._pool_index[k]
        if self.pool.region(pool_index).state is RegionState.SEALED:
            return []
        if self.pool.region(pool_index).state is RegionState.ALLOCATED:
            self.pool.begin_fill(pool_index)
        a, b = int(self.index.bounds[k]), int(self.index.bounds[k + 1])
        todo = np.flatnonzero(~self.index.loaded[a - self.index.lo : b - self.index.lo]) + a
        if not len(todo):
            return []
        # Cut the region's pending samples into tasks of about batch_bytes (at least one sample each).
        cum = np.cumsum(self.index.length[todo - self.index.lo])
        cuts = np.searchsorted(cum, np.arange(self.batch_bytes, int(cum[-1]) + 1, self.batch_bytes), "right")
        cuts = np.unique(np.clip(cuts, 1, len(todo)))
        return [ex.submit(self._load, k, chunk) for chunk in np.split(todo, cuts) if len(chunk)]

    def _load(self, k: int, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Read ``ids`` into region ``k``; returns the ids that loaded and their crc32c."""
        arr = self._arrays[k]
        ok, crcs = [], []
        for sid in ids.tolist():
            pos = sid - self.index.lo
            off, n = int(self.index.offset[pos]), int(self.index.length[pos])
            dst = arr[off : off + n]
            try:
                self.source.read_into(sid, dst)
            except DatasetError as exc:
                with self._lock:
                    self._errors.append(exc)
                continue
            ok.append(sid)
            crcs.append(google_crc32c.value(dst))
            with self._lock:
                self._read_samples += 1
                self._read_bytes += n
        return np.asarray(ok, dtype=np.int64), np.asarray(crcs, dtype=np.uint32)

    def _maybe_seal(self, k: int) -> None:
        a, b = int(self.index.bounds[k]), int(self.index.bounds[k + 1])
        pool_index = self._pool_index[k]
        complete = bool(self.index.loaded[a - self.index.lo : b - self.index.lo].all())
        if complete and self.pool.region(pool_index).state is RegionState.FILLING:
            self.pool.seal(pool_index)

    def _save_index(self) -> None:
        with self._lock:
            self.index.save(self.index_path)
            self._last_save = time.monotonic()

    def region_array(self, vindex: int) -> np.ndarray:
        """The pool memory of virtual region ``vindex`` (for readers and feeders)."""
        k = vindex - self.index.first_region
        if not 0 <= k < len(self._arrays):
            raise StateError(f"dataset {self.dataset!r}: this server holds no virtual region {vindex}")
        return self._arrays[k]
