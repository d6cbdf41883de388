"""The preload engine: read a server's ID range from the backend into its pool regions.

Samples are written in ID order into the dataset's regions at offsets computed up front from the
sizes (:func:`kspeed.server.hosting.index.layout`), so every read lands straight in the sample's final
place in the region, with no staging copy. The samples still to load are handed out as tasks of
consecutive samples of one region, sized to take about :data:`TASK_S` at the measured time per
sample (so a slow backend gets one sample per task and many tasks in flight, a warm page cache
few large tasks); each task reads its samples, checksums them (crc32c, while they are still in
the CPU cache) and records them in the index under one lock, with numpy, once per task. How
many threads read is tuned while loading (:class:`~kspeed.server.hosting.crew.ThreadTuner`): one from a
warm page cache, where more would only contend for the GIL, up to ``threads`` for a backend
whose reads mostly wait.

Concurrent :meth:`Preloader.preload` calls join the one running job; a sample whose loaded flag
is set is never read again; after a restart, regions the pool re-adopted as SEALED (and whose
samples the saved index records) are kept and only the rest is reloaded.

The preload shares the share's samples with the producers of :mod:`kspeed.server.production.core`
through :class:`~kspeed.server.memory.residency.Residency` claims, so no sample is read twice: what the
committed plans need soonest is pushed with :meth:`Preloader.prioritize` and read first, in plan
order (the producers take the next few of each plan into the window), then the rest in ID order;
samples the producers read into the window come home with :meth:`Preloader.adopt`, a copy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

import numpy as np

from kspeed.errors import ChangedError, DatasetError, StateError, StateFileError
from kspeed.layout import region_bounds
from kspeed.server.backend.changes import Change, ChangeLog
from kspeed.server.backend.sources import Source
from kspeed.server.hosting.crew import Crew, ThreadTuner
from kspeed.server.hosting.index import SampleIndex
from kspeed.server.memory import heap
from kspeed.server.memory.flags import CHUNK, Flags
from kspeed.server.memory.pool import MemoryPool, RegionState
from kspeed.server.memory.residency import HOME, Residency

__all__ = ["PreloadResult", "Preloader", "Progress"]

log = logging.getLogger(__name__)

INDEX_FILE = "index-{lo}.npz"  # per share: its first sample ID
SAVE_COST_SHARE = 20  # a seal saves the index unless that would spend over 1/20 of the time saving

#: A task takes about this long at the measured time per sample (long enough that the per-task
#: bookkeeping is a few percent of it, short enough that tasks spread over many threads).
TASK_S = 0.01

#: Tasks of one sample each at the start of a job.
_FIRST_SINGLE_TASKS = 2

#: An urgent task holds at most this many samples; the urgent IDs are looked at this many at a time.
_URGENT_TASK = 64
_URGENT_LOOK = 4 * _URGENT_TASK

#: The tuner weighs a task's work as samples + bytes / this: about the bytes a warm copy and
#: checksum move in the time a sample's open, read and close calls take.
_BYTES_PER_UNIT = 64 << 10


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
        threads: at most this many backend reads in flight (the job tunes how many it uses).
        batch_bytes: a task reads consecutive samples up to this many bytes (at least one sample).
        save_interval_s: while loading, save the index at most this often (and at the end).
        changes: where samples whose backend file changed since the listing are recorded (a new
            log when not given; :mod:`kspeed.server.backend.changes`).
        on_demand: the share holds no regions: nothing is ever loaded (its samples are produced
            into the production window as feeds need them and never come home).
        slot: a small dataset's slice of a shared region (pool index, offset, bytes;
            :mod:`kspeed.server.memory.slices`): its one virtual region is that slice, loaded afresh
            (never sealed, never re-adopted).

    Raises:
        StateError: the pool does not hold the regions the share needs.
    """

    def __init__(
        self,
        source: Source,
        pool: MemoryPool,
        *,
        lo: int = 0,
        hi: int | None = None,
        first_region: int = 0,
        threads: int = 16,
        batch_bytes: int = 1 << 20,
        save_interval_s: float = 5.0,
        changes: ChangeLog | None = None,
        on_demand: bool = False,
        slot: tuple[int, int, int] | None = None,
    ) -> None:
        self.source, self.pool, self.dataset = source, pool, source.dataset
        self.on_demand = on_demand
        self._slot = None if on_demand else slot
        hi = source.count if hi is None else hi
        if not 0 <= lo <= hi <= source.count:
            raise DatasetError(
                f"dataset {self.dataset!r}: share {lo}..{hi} outside 0..{source.count}", dataset=self.dataset
            )
        self.threads, self.batch_bytes, self.save_interval_s = max(threads, 1), batch_bytes, save_interval_s
        self.changes = changes if changes is not None else ChangeLog(self.dataset, lo, hi)
        self.index_path = pool.side_path(self.dataset, INDEX_FILE.format(lo=lo))
        sizes, fp = source.sizes[lo:hi], source.fingerprint.digest
        if on_demand or self._slot is not None:
            size = self._slot[2] if self._slot is not None else pool.region_size
            self.index = SampleIndex(self.dataset, lo, sizes, size, first_region=first_region, fingerprint=fp)
        else:
            self.index = SampleIndex.load(
                self.index_path,
                dataset=self.dataset,
                lo=lo,
                sizes=sizes,
                region_size=pool.region_size,
                first_region=first_region,
                fingerprint=fp,
            )
        held = {r.vindex: r for r in pool.regions(self.dataset)}
        homeless = on_demand or self._slot is not None
        wanted = range(first_region, first_region + (0 if homeless else self.index.num_regions))
        missing = [v for v in wanted if v not in held]
        if missing:
            raise StateError(
                f"dataset {self.dataset!r}: share {lo}..{hi} needs virtual regions {wanted.start}.."
                f"{wanted.stop - 1}, pool lacks {missing[:8]}; allocate them first"
            )
        self._pool_index = [held[v].index for v in wanted]
        self._arrays = [pool.array(i) for i in self._pool_index]
        self._bases = np.zeros(len(self._pool_index), dtype=np.int64)  # each region's offset in its pool region
        if self._slot is not None:
            index, base, size = self._slot
            self._pool_index, self._bases = [index], np.array([base], dtype=np.int64)
            self._arrays = [pool.array(index)[base : base + size]]
        self._pool_index_array = np.asarray(self._pool_index, dtype=np.int64)
        self._reconcile()
        self.residency = Residency(lo, self.index.loaded)
        #: called with the IDs that came home (loaded or adopted), and with failed IDs and their reasons
        self.on_home: Callable[[np.ndarray], None] = lambda ids: None
        self.on_failed: Callable[[np.ndarray, list[str]], None] = lambda ids, reasons: None
        #: called when a job ends (loaded, failed or stopped), once its outcome is in :meth:`progress`
        self.on_finished: Callable[[], None] = lambda: None
        self._urgent: deque[np.ndarray] = deque()  # IDs to read before the rest, in order (plans)
        self._lock = threading.Lock()
        self._seal_lock = threading.Lock()
        self._job: threading.Thread | None = None
        self._crew: Crew | None = None  # the running job's threads
        self._stopping = False
        self._done = threading.Event()
        self._done.set()
        self._job_start = self._job_end = 0.0
        self._read_samples = self._read_bytes = 0
        self._errors: list[DatasetError] = []
        self._last_save = time.monotonic()
        self._save_s = 0.0  # how long the last save of the index took
        #: why the index could not be saved last time (``None``: the saved index is up to date)
        self.save_error: StateFileError | None = None
        heap.trim_later()  # (the listing and the layout just freed their temporaries)

    @property
    def pool_indices(self) -> tuple[int, ...]:
        """The pool regions of the share, in virtual-region order (none when held on demand)."""
        return tuple(self._pool_index)

    @staticmethod
    def regions_needed(source: Source, region_size: int, lo: int = 0, hi: int | None = None) -> int:
        """Regions the share ``[lo, hi)`` occupies (to allocate from the pool before construction)."""
        hi = source.count if hi is None else hi
        return len(region_bounds(source.sizes[lo:hi], region_size, dataset=source.dataset, first_id=lo)) - 1

    def _reconcile(self) -> None:
        """Trust only regions that are SEALED in the pool and fully recorded in the index (a slice
        is never trusted: it loads afresh)."""
        if self._slot is not None:
            return
        for k, pool_index in enumerate(self._pool_index):
            a, b = int(self.index.bounds[k]), int(self.index.bounds[k + 1])
            state = self.pool.region(pool_index).state
            ok = self.index.loaded.all(a - self.index.lo, b - self.index.lo)
            if state is RegionState.SEALED and ok:
                continue
            if state is RegionState.SEALED:
                log.info(
                    "dataset %s: region %d was sealed after the index was last saved; reloading it", self.dataset, k
                )
                self.pool.unseal(pool_index)
            if state is not RegionState.FILLING:
                self.index.clear(a, b)

    # ------------------------------------------------------------------ the job

    def start(self) -> None:
        """Start loading what is not loaded yet; joins the running job if there is one (a share
        held on demand loads nothing)."""
        if self.on_demand:
            return
        with self._lock:
            if self._stopping or (self._job is not None and self._job.is_alive()):
                return
            if self.index.loaded.all() and (
                self._slot is not None or all(self.pool.region(i).state is RegionState.SEALED for i in self._pool_index)
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

    def stop(self) -> None:
        """End the running job once the reads in flight are done (what they loaded is kept and the
        index saved) and wait for it; no job starts after this (the share is being dropped, or the
        server stops)."""
        with self._lock:
            self._stopping = True
            if self._crew is not None:
                self._crew.stop()
        self._done.wait()

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
            return PreloadResult(
                self._read_samples,
                self._read_bytes,
                self.index.loaded_count,
                len(self.index.loaded),
                tuple(self._errors),
            )

    def progress(self) -> Progress:
        """Current progress; safe to call from any thread."""
        with self._lock:
            running = not self._done.is_set()
            end = time.monotonic() if running else self._job_end or self._job_start
            elapsed = max(end - self._job_start, 0.0) if self._job_start else 0.0
            done_bytes, total_bytes = self.index.loaded_bytes, self.index.total_bytes
            rate = self._read_bytes / elapsed if elapsed > 0 else 0.0
            srate = self._read_samples / elapsed if elapsed > 0 else 0.0
            left = total_bytes - done_bytes
            eta = 0.0 if left == 0 else (left / rate if rate > 0 else None)
            return Progress(
                running,
                self.index.loaded_count,
                len(self.index.loaded),
                done_bytes,
                total_bytes,
                len(self._errors),
                elapsed,
                rate,
                srate,
                eta,
            )

    def _run(self) -> None:
        try:
            pending = _Pending(self._prepare(), self.index, self.batch_bytes, self.threads, self._urgent)
            tuner = ThreadTuner(self.threads)
            crew = Crew(pending.claim, functools.partial(self._load, pending), tuner, name=f"preload-{self.dataset}")
            with self._lock:
                self._crew = crew
                if self._stopping:
                    crew.stop()
            crew.run(self._tick, tick_s=min(self.save_interval_s, 0.5))
            self._save_index()
            log.debug(
                "dataset %s: preload ran up to %d threads, settled on %d", self.dataset, crew.peak_threads, tuner.target
            )
        except Exception as exc:  # a bug or a pool failure: report it through the result
            log.exception("dataset %s: preload job failed", self.dataset)
            with self._lock:
                self._errors.append(
                    DatasetError(f"dataset {self.dataset!r}: preload failed: {exc}", dataset=self.dataset)
                )
        finally:
            with self._lock:
                self._crew = None
                self._job_end = time.monotonic()
                self._done.set()
            p = self.progress()
            log.info(
                "dataset %s: preload read %d samples, %d bytes in %.2f s, %d errors%s",
                self.dataset,
                self._read_samples,
                self._read_bytes,
                p.elapsed_s,
                p.errors,
                f" (stopped, {p.samples_total - p.samples_done} samples not loaded)"
                if self._stopping and p.samples_done < p.samples_total
                else "",
            )
            self.on_finished()

    def _prepare(self) -> list[int]:
        """Open the unsealed regions for filling; returns those with samples still to load, in order."""
        todo = []
        for k, pool_index in enumerate(self._pool_index):
            if self._slot is None and self.pool.region(pool_index).state is RegionState.SEALED:
                continue
            self._ensure_filling(k)
            a, b = int(self.index.bounds[k]), int(self.index.bounds[k + 1])
            if not self.index.loaded.all(a - self.index.lo, b - self.index.lo):
                todo.append(k)
            else:
                self._maybe_seal(k)
        return todo

    def _tick(self) -> None:
        if time.monotonic() - self._last_save > self.save_interval_s:
            self._save_index()

    def _load(self, pending: _Pending, task: tuple[int, np.ndarray]) -> float:
        """Read one task's samples into their region; returns its work units for the tuner."""
        k, wanted = task
        ids = self.residency.claim(wanted, retry_failed_after=0.0)  # a producer may have taken some
        if not len(ids):
            self._maybe_seal(k)
            return 0.0
        pos = ids - self.index.lo
        offsets, sizes = self.index.offset[pos], self.index.length[pos]
        t0 = time.perf_counter()
        crcs, errors = self.source.read_run(ids.tolist(), self._arrays[k], offsets.tolist(), sizes.tolist())
        pending.observe(len(ids), time.perf_counter() - t0)
        ok = np.ones(len(ids), dtype=bool)
        if errors:
            ok &= ~np.isin(ids, np.array([e.sample for e in errors], dtype=np.int64))
        with self._lock:
            self.index.mark_loaded(ids[ok], np.asarray(crcs, dtype=np.uint32)[ok])
            self._errors.extend(errors)
            self._read_samples += int(ok.sum())
            self._read_bytes += int(sizes[ok].sum())
        self.residency.settle(ids[ok], HOME)
        if errors:
            failed = [e for e in errors if e.sample is not None]
            self.residency.fail(np.array([e.sample for e in failed], dtype=np.int64), [str(e) for e in failed])
            self.on_failed(np.array([e.sample for e in failed], dtype=np.int64), [str(e) for e in failed])
        self.on_home(ids[ok])
        self.changed(errors)
        self._maybe_seal(k)
        return len(ids) + int(sizes.sum()) / _BYTES_PER_UNIT

    def prioritize(self, ids: np.ndarray) -> None:
        """Read these IDs (owned here, in this order) before the rest; starts the job if none runs.

        ``ids`` is kept as it is, not copied (a plan's IDs, which the plan keeps anyway): the job
        skips those loaded meanwhile as it reaches them.
        """
        if self.on_demand:
            return
        ids = np.asarray(ids)
        if any(not self.index.loaded[ids[a : a + CHUNK] - self.index.lo].all() for a in range(0, len(ids), CHUNK)):
            self._urgent.append(ids)
            self.start()

    def home(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(pool region index, offset)`` of each sample's home place (loaded or not).

        Raises:
            StateError: the share is held on demand (no home).
        """
        self._homeless()
        pos = np.asarray(ids, dtype=np.int64) - self.index.lo
        k = self.index.region.local(pos)
        return self._pool_index_array[k], self.index.offset[pos] + self._bases[k]

    def adopt(self, ids: np.ndarray, sources: list[np.ndarray], crcs: np.ndarray) -> None:
        """Bring samples home from elsewhere (the production window): copy, record, seal what is complete.

        Raises:
            StateError: the share is held on demand (no home).
        """
        self._homeless()
        ids = np.asarray(ids, dtype=np.int64)
        pos = ids - self.index.lo
        ks = self.index.region.local(pos)
        for j, k in enumerate(ks.tolist()):
            self._ensure_filling(k)
            offset = int(self.index.offset[pos[j]])
            self._arrays[k][offset : offset + len(sources[j])] = sources[j]
        with self._lock:
            self.index.mark_loaded(ids, crcs)
        self.residency.settle(ids, HOME)
        for k in np.unique(ks).tolist():
            self._maybe_seal(k)

    def _homeless(self) -> None:
        if self.on_demand:
            raise StateError(f"dataset {self.dataset!r}: share {self.index.lo}.. is held on demand; it has no home")

    def forget_index(self) -> None:
        """Delete the saved index (the share was dropped; the rest of the dataset stays here)."""
        with contextlib.suppress(OSError):
            os.unlink(self.index_path)

    def changed(self, errors: Iterable[DatasetError]) -> None:
        """Record the samples among ``errors`` whose backend file changed since the listing."""
        self.changes.record(
            Change(e.sample, e.path, e.what) for e in errors if isinstance(e, ChangedError) and e.sample is not None
        )

    def _ensure_filling(self, k: int) -> None:
        """Open region ``k`` for writing if it is still only allocated (a slice's shared region
        stays as it is: other datasets' slices are in it)."""
        if self._slot is not None:
            return
        with self._seal_lock:
            if self.pool.region(self._pool_index[k]).state is RegionState.ALLOCATED:
                self.pool.begin_fill(self._pool_index[k])

    def _maybe_seal(self, k: int) -> None:
        if self._slot is not None:  # (never sealed: a slice is not re-adopted)
            return
        a, b = int(self.index.bounds[k]), int(self.index.bounds[k + 1])
        pool_index = self._pool_index[k]
        complete = self.index.loaded.all(a - self.index.lo, b - self.index.lo)
        if complete and self.pool.region(pool_index).state is RegionState.FILLING:
            # A restart re-adopts a sealed region only if the saved index records every sample in
            # it, so a seal saves the index - unless the last save was so recent that saving again
            # would spend more than 1/SAVE_COST_SHARE of the time saving: saving at every seal made
            # a preload quadratic in the share (a 10^6-sample share has ~800 regions of 128 MiB
            # and a 13 MB index). A crash reloads the regions sealed after the last save; the
            # preload job also saves every save_interval_s and at its end.
            with self._seal_lock:
                if self.pool.region(pool_index).state is RegionState.FILLING:
                    if time.monotonic() - self._last_save >= SAVE_COST_SHARE * self._save_s:
                        self._save_index()
                    self.pool.seal(pool_index)

    def _save_index(self) -> None:
        """Save the index; one that cannot be saved (a full disk) costs a restart the reload of what
        was loaded since the last save, nothing now: it is logged, never counted as a sample failure."""
        with self._lock:
            started = time.monotonic()
            try:
                self.index.save(self.index_path)
            except StateFileError as exc:
                if self.save_error is None:
                    log.error(
                        "dataset %s: %s; the samples loaded are served, but a restart reloads those "
                        "loaded since the index was last saved",
                        self.dataset,
                        exc,
                    )
                self.save_error = exc
            else:
                if self.save_error is not None:
                    log.info("dataset %s: index %s saved again", self.dataset, self.index_path)
                self.save_error = None
            self._last_save = time.monotonic()
            self._save_s = self._last_save - started

    def region_array(self, vindex: int) -> np.ndarray:
        """The pool memory of virtual region ``vindex`` (for readers and feeders)."""
        k = vindex - self.index.first_region
        if not 0 <= k < len(self._arrays):
            raise StateError(f"dataset {self.dataset!r}: this server holds no virtual region {vindex}")
        return self._arrays[k]


class _Pending:
    """The samples a job still has to load, handed out as tasks ``(region k, IDs)``.

    IDs pushed to ``urgent`` (the plans' order) go first, a few of one region per task; then the
    rest in ID order, region by region: consecutive samples of one region not loaded yet, about
    :data:`TASK_S` worth at the measured time per sample or a quarter of a thread's share of what
    is left, whichever is more, at most ``batch_bytes`` (but at least one sample). The first tasks
    hold one sample each, so the thread tuner gets its first measurements quickly. A sample is
    handed out once per job.

    Nothing here is kept per sample but a bit (handed out or not): the rest is a cursor over the
    index, whose loaded flags say what is left, and the urgent arrays are looked at a bounded
    prefix at a time (never copied whole).
    """

    def __init__(
        self,
        regions: list[int],
        index: SampleIndex,
        batch_bytes: int,
        threads: int,
        urgent: deque[np.ndarray] | None = None,
    ) -> None:
        self._index = index
        self._bounds = index.bounds
        self._lo = index.lo
        self._regions = deque(regions)  # the regions the cursor still has to go through, in order
        self._cursor = int(self._bounds[regions[0]]) if regions else 0  # the next sample ID to look at
        self._left = sum(int(self._bounds[k + 1] - self._bounds[k]) for k in regions)  # samples ahead of the cursor
        self._handed = Flags(len(index.length))
        self._urgent: deque[np.ndarray] = urgent if urgent is not None else deque()
        self._batch_bytes = max(int(batch_bytes), 1)
        self._threads = max(int(threads), 1)
        self._observed = 0
        self._per_sample_s = 0.0
        self._lock = threading.Lock()

    def _count(self, left: int) -> int:
        if self._observed < _FIRST_SINGLE_TASKS:
            return 1
        # Long enough to amortize the bookkeeping, and no more tasks than a few per thread
        # (on a slow backend many small tasks only make the threads fight for the GIL).
        return max(int(TASK_S / self._per_sample_s) if self._per_sample_s > 0 else 1, left // (4 * self._threads), 1)

    def _open(self, pos: np.ndarray | slice) -> np.ndarray:
        """Which of positions ``pos`` (``id - lo``) are still to hand out: not loaded, not handed."""
        return ~self._index.loaded[pos] & ~self._handed[pos]

    def claim(self) -> tuple[int, np.ndarray] | None:
        """The next task, or ``None`` when every sample has been handed out."""
        with self._lock:
            task = self._claim_urgent()
            if task is not None:
                return task
            while self._regions:
                k = self._regions[0]
                end = int(self._bounds[k + 1])
                a = self._cursor
                if a >= end:
                    self._regions.popleft()
                    if self._regions:
                        self._cursor = int(self._bounds[self._regions[0]])
                    continue
                b = min(a + self._count(self._left), end)
                pos = np.flatnonzero(self._open(slice(a - self._lo, b - self._lo))) + (a - self._lo)
                if len(pos):  # at most batch_bytes (at least one sample)
                    fit = int(np.searchsorted(np.cumsum(self._index.length[pos]), self._batch_bytes, side="right"))
                    pos = pos[: max(fit, 1)]
                    b = int(pos[-1]) + self._lo + 1
                self._left -= b - a
                self._cursor = b
                if len(pos):
                    self._handed.set(pos)
                    return k, pos + self._lo
            return None

    def _claim_urgent(self) -> tuple[int, np.ndarray] | None:
        """Up to a task's worth of the urgent IDs, those of the first one's region, in order."""
        while self._urgent:
            head = self._urgent[0]
            # the first IDs still to hand out, looking at a bounded prefix at a time
            while len(head):
                view = np.asarray(head[:_URGENT_LOOK], dtype=np.int64)
                keep = self._open(view - self._lo)
                if keep.any():
                    break
                head = head[len(view) :]
            if not len(head):
                self._urgent.popleft()
                continue
            at = np.flatnonzero(keep)[:_URGENT_TASK]  # their places in the view
            ids = view[at]
            regions = np.searchsorted(self._bounds, ids, side="right") - 1
            same = int(np.argmin(regions == regions[0])) if not (regions == regions[0]).all() else len(regions)
            n = min(same, self._count(len(head)), _URGENT_TASK)
            rest = head[int(at[n - 1]) + 1 :]
            if len(rest):
                self._urgent[0] = rest
            else:
                self._urgent.popleft()
            self._handed.set(ids[:n] - self._lo)
            return int(regions[0]), ids[:n]
        return None

    def observe(self, samples: int, seconds: float) -> None:
        """Account a task's reading time (a moving average of the time per sample)."""
        per_sample = seconds / max(samples, 1)
        with self._lock:
            old = self._per_sample_s
            self._per_sample_s = per_sample if not old else 0.7 * old + 0.3 * per_sample
            self._observed += 1
