"""Checked reads from the pool, verification and scrubbing (crc32c per sample).

Every byte handed out is first compared with the crc32c recorded at preload. On a mismatch the
sample is re-read from the backend (the source of truth; there is no replica), written back into
the region and counted; if the backend's bytes do not match the recorded checksum either, the
backend changed and :class:`~kspeed.errors.IntegrityError` is raised. Corrupt bytes are never
returned.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Iterator

import google_crc32c
import numpy as np

from kspeed.errors import ChangedError, IntegrityError
from kspeed.server.hosting.preload import Preloader

__all__ = ["SampleStore", "ScrubReport"]

log = logging.getLogger(__name__)

#: A scrub lists this many samples' loaded flags at a time (a Python int each: about 2 MB).
SCRUB_CHUNK = 1 << 16


@dataclasses.dataclass(frozen=True)
class ScrubReport:
    """Outcome of one scrub pass: samples checked, repaired, and those whose repair failed."""

    checked: int
    repaired: int
    failed: tuple[int, ...]


class SampleStore:
    """Serves one dataset's loaded samples from the pool with checksum verification.

    Samples owned but not loaded (not preloaded yet, or failed) are read from the backend.

    Args:
        preloader: the dataset's preloader (index, regions, source).

    Attributes:
        counters: ``crc_mismatches`` found, samples ``repaired``, ``backend_reads`` served
            directly from the backend; for metrics.
    """

    def __init__(self, preloader: Preloader) -> None:
        self.preloader = preloader
        self.index = preloader.index
        self.dataset = preloader.dataset
        self.counters = {"crc_mismatches": 0, "repaired": 0, "backend_reads": 0}
        self._lock = threading.Lock()
        self._scrub_thread: threading.Thread | None = None
        self._scrub_stop = threading.Event()

    def count(self, name: str) -> None:
        """Count one event (``crc_mismatches``, ``repaired``, ``backend_reads``), e.g. a sample
        found corrupt where production keeps it outside its home and produced again."""
        with self._lock:
            self.counters[name] += 1

    def read_into(self, sample_id: int, out: np.ndarray | memoryview | bytearray) -> int:
        """Copy the verified sample into the start of ``out``; returns its length.

        Raises:
            NotFoundError: the sample is not owned by this server.
            IntegrityError: the pool copy is corrupt and the backend no longer matches its checksum.
            BackendError, DatasetError: a backend read (fallback or repair) failed.
        """
        (region,), (offset,), (length,), (crc,) = self.index.locate(np.asarray([sample_id]))
        dst = np.frombuffer(out, dtype=np.uint8, count=int(length))
        pos = int(sample_id) - self.index.lo
        if not self.index.loaded[pos]:
            self._backend_read(int(sample_id), dst)
            self.count("backend_reads")
            return int(length)
        src = self.preloader.region_array(int(region))[int(offset) : int(offset) + int(length)]
        dst[:] = src
        if google_crc32c.value(dst) != int(crc):
            self.count("crc_mismatches")
            dst[:] = self._repair(int(sample_id))
        return int(length)

    def read(self, sample_id: int) -> bytes:
        """The verified bytes of one sample."""
        (length,) = self.index.locate(np.asarray([sample_id]))[2]
        buf = bytearray(int(length))
        self.read_into(sample_id, buf)
        return bytes(buf)

    def read_many(self, ids: np.ndarray) -> tuple[bytearray, np.ndarray]:
        """Pull helper for the ``Read`` RPC: samples packed back to back, and their lengths.

        Raises:
            NotFoundError: an id is not owned by this server (the first one is named).
        """
        ids = np.asarray(ids, dtype=np.int64)
        _, _, lengths, _ = self.index.locate(ids)
        starts = np.concatenate(([0], np.cumsum(lengths)))
        out = bytearray(int(starts[-1]))
        view = memoryview(out)
        for j, sid in enumerate(ids.tolist()):
            self.read_into(sid, view[int(starts[j]) : int(starts[j + 1])])
        return out, lengths.astype(np.int64)

    def verify(self, sample_id: int) -> bool:
        """Check one loaded sample in place; True if intact, False if it was corrupt and repaired.

        Raises:
            StateError: the sample is not loaded.
            IntegrityError: corrupt, and the backend no longer matches the recorded checksum.
        """
        pos = self.index.check_loaded(sample_id)
        off, n = int(self.index.offset[pos]), int(self.index.length[pos])
        src = self.preloader.region_array(int(self.index.region[pos]))[off : off + n]
        if google_crc32c.value(src) == int(self.index.crc[pos]):
            return True
        self.count("crc_mismatches")
        self._repair(int(sample_id))
        return False

    def scrub(self, stop: threading.Event | None = None) -> ScrubReport:
        """Verify every loaded sample once (stops early when ``stop`` is set)."""
        checked = repaired = 0
        failed = []
        for sid in self._loaded_ids():
            if stop is not None and stop.is_set():
                break
            try:
                repaired += not self.verify(sid)
            except IntegrityError as exc:
                log.error("%s", exc)
                failed.append(sid)
            checked += 1
        if repaired or failed:
            log.warning(
                "dataset %s: scrub checked %d samples, repaired %d, failed %d",
                self.dataset,
                checked,
                repaired,
                len(failed),
            )
        return ScrubReport(checked, repaired, tuple(failed))

    def _loaded_ids(self) -> Iterator[int]:
        """The loaded samples' IDs, in order (listed :data:`SCRUB_CHUNK` at a time, never all at once)."""
        loaded = self.index.loaded
        for start in range(0, len(loaded), SCRUB_CHUNK):
            yield from (loaded.positions(start, start + SCRUB_CHUNK) + self.index.lo).tolist()

    def start_scrub(self, interval_s: float) -> None:
        """Scrub in a background thread every ``interval_s`` seconds until :meth:`stop_scrub`."""
        if self._scrub_thread is not None and self._scrub_thread.is_alive():
            return
        self._scrub_stop.clear()

        def loop() -> None:
            while not self._scrub_stop.wait(interval_s):
                self.scrub(self._scrub_stop)

        self._scrub_thread = threading.Thread(target=loop, name=f"scrub-{self.dataset}", daemon=True)
        self._scrub_thread.start()

    def stop_scrub(self) -> None:
        """Stop the background scrub and wait for it."""
        self._scrub_stop.set()
        if self._scrub_thread is not None:
            self._scrub_thread.join()
            self._scrub_thread = None

    def _backend_read(self, sample_id: int, out: np.ndarray) -> None:
        """Read a sample from the backend; a file that changed since the listing is recorded, then raised."""
        try:
            self.preloader.source.read_into(sample_id, out)
        except ChangedError as exc:
            self.preloader.changed([exc])
            raise

    def _repair(self, sample_id: int) -> np.ndarray:
        """Re-read a corrupt sample from the backend into its place; returns the good bytes."""
        pos = sample_id - self.index.lo
        off, n = int(self.index.offset[pos]), int(self.index.length[pos])
        fresh = np.empty(n, dtype=np.uint8)
        self._backend_read(sample_id, fresh)
        if google_crc32c.value(fresh) != int(self.index.crc[pos]):
            raise IntegrityError(
                f"dataset {self.dataset!r} sample {sample_id}: pool copy is corrupt and the backend's bytes "
                "do not match the checksum recorded at preload either; the backend changed: register "
                "the dataset again",
                dataset=self.dataset,
                sample=sample_id,
            )
        self.preloader.region_array(int(self.index.region[pos]))[off : off + n] = fresh
        self.count("repaired")
        log.warning("dataset %s sample %d: crc32c mismatch repaired from the backend", self.dataset, sample_id)
        return fresh
