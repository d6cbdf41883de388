"""The decentralized sample index: where each sample a server owns lives in its regions.

A server owns a contiguous range of sample IDs ``[lo, hi)`` of a dataset. For those it keeps numpy
arrays, never a Python object per sample, and only what cannot be computed: the offset of each
sample inside its region (4 bytes while a region is under 4 GiB), its crc32c (4 bytes) and a loaded
flag (one bit); the lengths are the listing's own array (a view), and a sample's region is found
from the region bounds. Region and offset are a pure function of the sizes and the region size
(:func:`layout`, by :func:`kspeed.layout.region_bounds`, the rule the manager cuts ownership
with), so the index answers lookups for samples that are not loaded yet. It is saved beside the
data, in the pool directory, and reloaded after a restart.
"""

from __future__ import annotations

import json
import logging
import os
from typing import IO, Any

import numpy as np

from kspeed.errors import NotFoundError, StateError
from kspeed.layout import region_bounds
from kspeed.server.memory.flags import CHUNK, Flags
from kspeed.server.memory.statefile import write_atomic

__all__ = ["RegionColumn", "SampleIndex", "layout", "offset_dtype"]

log = logging.getLogger(__name__)

#: 1: loaded flags as a bool per sample; 2: packed eight to a byte (both are read).
_FORMAT = 2
_FORMATS = (1, 2)


def offset_dtype(region_size: int) -> type[np.unsignedinteger[Any]] | type[np.signedinteger[Any]]:
    """The narrowest dtype for offsets inside a region of ``region_size`` bytes (and an offset
    plus the length of a sample that ends there)."""
    return np.uint32 if region_size < 1 << 32 else np.int64


def layout(sizes: np.ndarray, region_size: int, *, dataset: str, first_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Offset of every sample inside its region (:func:`offset_dtype`) and the region bounds
    (positions in ``sizes`` where each region starts, then ``len(sizes)``).

    Computed a chunk of samples at a time, so its temporaries stay small whatever the share's size.
    """
    sizes = np.asarray(sizes)
    bounds = region_bounds(sizes, region_size, dataset=dataset, first_id=first_id)
    offset = np.zeros(len(sizes), dtype=offset_dtype(region_size))
    if not len(sizes):
        return offset, bounds
    # bytes before each region's first sample (bounds increase strictly: a sample fits a region)
    before = np.concatenate(([0], np.cumsum(np.add.reduceat(sizes.astype(np.int64, copy=False), bounds[:-1]))))
    done = 0  # bytes before the chunk
    for a in range(0, len(sizes), CHUNK):
        chunk = sizes[a : a + CHUNK].astype(np.int64)
        ends = np.cumsum(chunk) + done
        region = np.searchsorted(bounds, np.arange(a, a + len(chunk)), side="right") - 1
        offset[a : a + len(chunk)] = ends - chunk - before[region]
        done = int(ends[-1])
    return offset, bounds


class RegionColumn:
    """Each owned sample's virtual region, found from the region bounds (no array per sample).

    Indexed by position (``id - lo``) like the int32 array it stands for: an int gives an int, a
    slice or an array of positions an int32 array.
    """

    def __init__(self, bounds: np.ndarray, first_region: int) -> None:
        self._bounds = np.asarray(bounds, dtype=np.int64)  # positions where each region starts, then the size
        self._first = int(first_region)

    def __len__(self) -> int:
        return int(self._bounds[-1])

    def local(self, pos: Any) -> np.ndarray:
        """The share's region index ``k`` (0 for its first region) of positions ``pos`` (int64)."""
        return np.searchsorted(self._bounds, pos, side="right") - 1

    def __getitem__(self, key: Any) -> Any:
        size = len(self)
        if isinstance(key, (int, np.integer)):
            i = int(key) + (size if int(key) < 0 else 0)
            if not 0 <= i < size:
                raise IndexError(f"position {int(key)} out of range for {size} samples")
            return int(self.local(i)) + self._first
        if isinstance(key, slice):
            pos = np.arange(*key.indices(size), dtype=np.int64)
        else:
            pos = np.asarray(key)
            pos = np.flatnonzero(pos) if pos.dtype == bool else pos.astype(np.int64, copy=False)
            if len(pos) and (int(pos.min()) < -size or int(pos.max()) >= size):
                raise IndexError(f"a position is out of range for {size} samples")
            pos = np.where(pos < 0, pos + size, pos)
        return (self.local(pos) + self._first).astype(np.int32)

    def tolist(self) -> list[int]:
        """Every sample's region."""
        return self[:].tolist()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self[:]
        return out if dtype is None else out.astype(dtype)


class SampleIndex:
    """Per-sample location and checksum for the ID range ``[lo, hi)`` a server owns.

    Args:
        dataset: the dataset's name.
        lo: first owned sample ID.
        sizes: sizes of samples ``lo..hi-1`` (the listing's, kept as they are: a view, no copy).
        region_size: bytes per region.
        first_region: virtual index of the server's first region of this dataset.
        fingerprint: the source's fingerprint digest; a saved index is reused only if it matches.

    Attributes:
        length: per sample, its size (``sizes`` itself).
        offset: per sample, its offset inside its region (:func:`offset_dtype`).
        region: per sample, its virtual region (a :class:`RegionColumn`).
        crc: per sample, the crc32c recorded when it was loaded (uint32).
        loaded: per sample, whether it is loaded (:class:`~kspeed.server.memory.flags.Flags`;
            changed only through :meth:`mark_loaded` and :meth:`clear`, which keep
            :attr:`loaded_bytes`).
        loaded_bytes: bytes of the loaded samples.
        total_bytes: bytes of all owned samples.
        bounds: absolute sample IDs at which each of the server's regions starts (and ``hi``).
        All per-sample attributes are indexed by ``id - lo``.
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
        sizes = np.asarray(sizes)
        self.length = sizes if sizes.dtype.kind in "iu" else sizes.astype(np.int64)
        self.hi = self.lo + len(self.length)
        self.offset, local_bounds = layout(self.length, region_size, dataset=dataset, first_id=lo)
        self.region = RegionColumn(local_bounds, first_region)
        self.bounds = local_bounds + self.lo
        self.crc = np.zeros(len(self.length), dtype=np.uint32)
        self.loaded = Flags(len(self.length))
        self.loaded_bytes = 0
        self.total_bytes = int(self.length.sum(dtype=np.int64))

    @property
    def num_regions(self) -> int:
        """Number of regions the owned samples occupy."""
        return len(self.bounds) - 1

    @property
    def loaded_count(self) -> int:
        """Owned samples loaded."""
        return self.loaded.count()

    def owns(self, ids: np.ndarray) -> np.ndarray:
        """Boolean mask: which of ``ids`` this server owns."""
        ids = np.asarray(ids)
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
        fresh = np.unique(pos[~self.loaded[pos]])
        self.loaded_bytes += int(self.length[fresh].sum(dtype=np.int64))
        self.crc[pos] = crcs
        self.loaded.set(pos)

    def clear(self, lo: int, hi: int) -> None:
        """Mark samples ``[lo, hi)`` not loaded (e.g. a region whose content is not trusted)."""
        a, b = max(lo, self.lo) - self.lo, max(min(hi, self.hi) - self.lo, 0)
        self.loaded_bytes -= self._bytes_loaded(a, b)
        self.loaded.clear(a, b)

    def _bytes_loaded(self, a: int, b: int) -> int:
        """Bytes of the loaded samples among positions ``a..b-1`` (a chunk at a time)."""
        total = 0
        for c in range(a, b, CHUNK):
            e = min(c + CHUNK, b)
            total += int(self.length[c:e][self.loaded[c:e]].sum(dtype=np.int64))
        return total

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
        """Write the index atomically (temporary file + rename) to ``path``, straight to the file
        (no copy of it in memory).

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

        def write(fh: IO[bytes]) -> None:
            np.savez(
                fh,
                meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
                length=self.length,
                crc=self.crc,
                loaded_bits=self.loaded.bits,
            )

        write_atomic(path, write)

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
                same = meta.get("format") in _FORMATS and np.array_equal(z["length"], fresh.length)
                crc = z["crc"] if same else None
                loaded = (z["loaded_bits"] if meta.get("format") == 2 else z["loaded"]) if same else None
        except FileNotFoundError:
            return fresh
        except (OSError, ValueError, KeyError) as exc:
            log.warning("dataset %s: discarding unreadable index %s: %s", dataset, path, exc)
            return fresh
        expected = {
            "dataset": dataset,
            "lo": fresh.lo,
            "hi": fresh.hi,
            "region_size": region_size,
            "first_region": first_region,
            "fingerprint": fingerprint,
        }
        if crc is None or loaded is None or {k: v for k, v in meta.items() if k != "format"} != expected:
            log.warning("dataset %s: index %s describes another layout or backend; discarding it", dataset, path)
            return fresh
        fresh.crc[:] = crc
        if meta["format"] == 2:
            fresh.loaded.bits[:] = loaded
        else:
            fresh.loaded = Flags.of(loaded)
        fresh.loaded_bytes = fresh._bytes_loaded(0, len(fresh.length))
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
