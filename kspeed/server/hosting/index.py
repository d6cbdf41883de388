"""The decentralized sample index: where each sample a server owns lives in its regions.

A server owns a contiguous range of sample IDs ``[lo, hi)`` of a dataset. For those it keeps numpy
arrays (never a Python object per sample): the virtual region index, the offset inside the region,
the length, the crc32c and a loaded flag. Region and offset are a pure function of the sizes and
the region size (:func:`layout`, by :func:`kspeed.layout.region_bounds`, the rule the manager
cuts ownership with), so the index answers lookups for samples that are not loaded yet.
It is saved beside the data, in the pool directory, and reloaded after a restart.
"""

from __future__ import annotations

import io
import json
import logging
import os

import numpy as np

from kspeed.errors import NotFoundError, StateError
from kspeed.layout import region_bounds
from kspeed.server.memory.statefile import write_atomic

__all__ = ["SampleIndex", "layout"]

log = logging.getLogger(__name__)

_FORMAT = 1


def layout(
    sizes: np.ndarray, region_size: int, *, dataset: str, first_region: int = 0, first_id: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Region index (int32) and offset (int64) of every sample, plus the region bounds.

    Region indices start at ``first_region`` (the server's first region in the dataset's virtual
    address space, where byte ``region x region_size + offset`` is the sample's first byte).
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    bounds = region_bounds(sizes, region_size, dataset=dataset, first_id=first_id)
    counts = np.diff(bounds)
    local = np.repeat(np.arange(len(counts), dtype=np.int32), counts)
    cum = np.concatenate(([0], np.cumsum(sizes)[:-1])) if len(sizes) else np.zeros(0, np.int64)
    offset = cum - np.repeat(cum[bounds[:-1]] if len(sizes) else np.zeros(0, np.int64), counts)
    return (local + first_region).astype(np.int32), offset.astype(np.int64), bounds


class SampleIndex:
    """Per-sample location and checksum for the ID range ``[lo, hi)`` a server owns.

    Args:
        dataset: the dataset's name.
        lo: first owned sample ID.
        sizes: int64 sizes of samples ``lo..hi-1`` (from the listing).
        region_size: bytes per region.
        first_region: virtual index of the server's first region of this dataset.
        fingerprint: the source's fingerprint digest; a saved index is reused only if it matches.

    Attributes:
        region, offset, length, crc, loaded: arrays indexed by ``id - lo``.
        bounds: absolute sample IDs at which each of the server's regions starts (and ``hi``).
    """

    def __init__(
        self,
        dataset: str,
        lo: int,
        sizes: np.ndarray,
        region_size: int,
        *,
        first_region: int = 0,
        fingerprint: str = "",
    ) -> None:
        self.dataset, self.lo, self.region_size = dataset, int(lo), int(region_size)
        self.first_region, self.fingerprint = int(first_region), fingerprint
        self.length = np.ascontiguousarray(sizes, dtype=np.int64)
        self.hi = self.lo + len(self.length)
        self.region, self.offset, local_bounds = layout(
            self.length, region_size, dataset=dataset, first_region=first_region, first_id=lo
        )
        self.bounds = local_bounds + self.lo
        self.crc = np.zeros(len(self.length), dtype=np.uint32)
        self.loaded = np.zeros(len(self.length), dtype=bool)

    @property
    def num_regions(self) -> int:
        """Number of regions the owned samples occupy."""
        return len(self.bounds) - 1

    def owns(self, ids: np.ndarray) -> np.ndarray:
        """Boolean mask: which of ``ids`` this server owns."""
        ids = np.asarray(ids, dtype=np.int64)
        return (ids >= self.lo) & (ids < self.hi)

    def lookup(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The broadcast-reply lookup: ``(mask of owned ids, their lengths in order)``.

        Works before the samples are loaded: lengths come from the listing.
        """
        ids = np.asarray(ids, dtype=np.int64)
        mask = self.owns(ids)
        return mask, self.length[ids[mask] - self.lo]

    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(region, offset, length, crc)`` of ``ids`` for feeding; every id must be owned.

        Raises:
            NotFoundError: an id is not owned by this server (the first one is named).
        """
        pos = self._positions(ids)
        return self.region[pos], self.offset[pos], self.length[pos], self.crc[pos]

    def mark_loaded(self, ids: np.ndarray, crcs: np.ndarray) -> None:
        """Record the crc32c of loaded samples and set their loaded flag."""
        pos = self._positions(ids)
        self.crc[pos] = crcs
        self.loaded[pos] = True

    def clear(self, lo: int, hi: int) -> None:
        """Mark samples ``[lo, hi)`` not loaded (e.g. a region whose content is not trusted)."""
        self.loaded[max(lo, self.lo) - self.lo : max(min(hi, self.hi) - self.lo, 0)] = False

    def _positions(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        bad = ~self.owns(ids)
        if bad.any():
            raise NotFoundError(
                f"dataset {self.dataset!r}: sample {int(ids[bad][0])} is not owned by this server "
                f"(owns {self.lo}..{self.hi - 1})"
            )
        return ids - self.lo

    # ------------------------------------------------------------------ persistence

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the index atomically (temporary file + rename) to ``path``.

        Raises:
            StateFileError: it cannot be written (the previous version stays).
        """
        meta = {
            "format": _FORMAT,
            "dataset": self.dataset,
            "lo": self.lo,
            "hi": self.hi,
            "region_size": self.region_size,
            "first_region": self.first_region,
            "fingerprint": self.fingerprint,
        }
        buf = io.BytesIO()
        np.savez(
            buf,
            meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
            length=self.length,
            crc=self.crc,
            loaded=self.loaded,
        )
        write_atomic(path, buf.getbuffer())

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        *,
        dataset: str,
        lo: int,
        sizes: np.ndarray,
        region_size: int,
        first_region: int = 0,
        fingerprint: str = "",
    ) -> SampleIndex:
        """Load a saved index, or build a fresh one if the file is missing or does not match.

        A saved index is reused only if it describes the same dataset, range, region layout,
        fingerprint and sizes; otherwise its loaded flags would be lies, so it is discarded.
        """
        fresh = cls(dataset, lo, sizes, region_size, first_region=first_region, fingerprint=fingerprint)
        try:
            with np.load(path, allow_pickle=False) as z:
                meta = json.loads(z["meta"].tobytes())
                length, crc, loaded = z["length"], z["crc"], z["loaded"]
        except FileNotFoundError:
            return fresh
        except (OSError, ValueError, KeyError) as exc:
            log.warning("dataset %s: discarding unreadable index %s: %s", dataset, path, exc)
            return fresh
        expected = {
            "format": _FORMAT,
            "dataset": dataset,
            "lo": fresh.lo,
            "hi": fresh.hi,
            "region_size": region_size,
            "first_region": first_region,
            "fingerprint": fingerprint,
        }
        if meta != expected or not np.array_equal(length, fresh.length):
            log.warning("dataset %s: index %s describes another layout or backend; discarding it", dataset, path)
            return fresh
        fresh.crc[:] = crc
        fresh.loaded[:] = loaded
        return fresh

    def check_loaded(self, sample_id: int) -> int:
        """Position of ``sample_id`` if owned and loaded.

        Raises:
            NotFoundError: not owned here.
            StateError: owned but not loaded yet.
        """
        pos = int(self._positions(np.asarray([sample_id]))[0])
        if not self.loaded[pos]:
            raise StateError(f"dataset {self.dataset!r}: sample {sample_id} is not loaded yet; preload first")
        return pos
