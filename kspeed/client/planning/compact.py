"""The narrowest dtypes that hold an epoch plan's per-sample arrays, widened where values do not fit.

A rank holds two plans of its share of every epoch (the current one and the next, planned ahead),
so each byte per sample counts twice: at 10^7 samples an ``int64`` array is 80 MB where an
``int32`` one is 40 MB. Sample IDs and plan positions are ``int32`` below ``2**31``, lengths and
offsets within a batch ``uint32`` (what the wire carries; a batch of 4 GiB or more falls back to
``int64``), labels ``int16`` until a label needs more, the owning server's index ``int8`` up to
127 servers. Every narrowing is checked: a value that does not fit widens the array, never wraps.

A plan's arrays live each in its own anonymous mapping (:func:`mapped`), not on the C heap: glibc
raises its mmap threshold to the size of the largest block freed (up to 32 MB), so after the first
plan, arrays of a few MB to 32 MB would be put on a heap, where one that lives on (the next epoch's
plan) keeps the temporaries freed below it in the process's memory. Measured at 10^7 samples (four
servers, two plans held), the process then kept 16 bytes per sample beyond the plans' arrays, and
9 with them mapped (the planning threads' own arenas, about 90 MB whatever the plan's length); a
mapped plan's pages go back to the system when it is dropped.
"""

from __future__ import annotations

import mmap

import numpy as np

__all__ = [
    "SCAN_BLOCK",
    "U32_MAX",
    "held",
    "id_dtype",
    "index_dtype",
    "mapped",
    "narrow_dtype",
    "owned_positions",
    "store",
]

U32_MAX = int(np.iinfo(np.uint32).max)
#: positions handled at once when a pass over a whole plan would otherwise make ``int64`` or
#: boolean temporaries as long as the plan (a few MB per step, whatever the plan's length)
SCAN_BLOCK = 1 << 18

_SIGNED = (np.dtype(np.int8), np.dtype(np.int16), np.dtype(np.int32), np.dtype(np.int64))


def id_dtype(count: int) -> np.dtype:
    """Sample IDs (or plan positions) ``0..count-1``: ``int32`` while they fit, else ``int64``."""
    return np.dtype(np.int32) if count <= np.iinfo(np.int32).max + 1 else np.dtype(np.int64)


def index_dtype(servers: int) -> np.dtype:
    """A server's index ``0..servers-1``, or -1 for none: the narrowest signed type."""
    return next(t for t in _SIGNED if servers - 1 <= np.iinfo(t).max)


def mapped(shape: int | tuple[int, ...], dtype: np.dtype | type, fill: int = 0) -> np.ndarray:
    """A new array of ``shape`` filled with ``fill``, in its own anonymous memory mapping
    (unmapped when the array and its views are gone)."""
    dtype = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, int) else shape
    count = int(np.prod(shape))
    memory = mmap.mmap(-1, max(count * dtype.itemsize, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    array = np.frombuffer(memory, dtype=dtype, count=count).reshape(shape)
    if fill:
        array.fill(fill)
    return array


def held(values: np.ndarray, dtype: np.dtype | type | None = None) -> np.ndarray:
    """``values`` copied into a :func:`mapped` array (of ``dtype``, default theirs)."""
    out = mapped(values.shape, values.dtype if dtype is None else dtype)
    out[...] = values
    return out


def _fits(values: np.ndarray, dtype: np.dtype) -> bool:
    if not len(values) or np.can_cast(values.dtype, dtype, casting="safe"):
        return True
    if not np.issubdtype(values.dtype, np.integer):
        return False
    info = np.iinfo(dtype)
    return info.min <= int(values.min()) and int(values.max()) <= info.max


def _wider(array: np.ndarray, values: np.ndarray) -> np.dtype:
    """The narrowest type at least as wide as ``array``'s that holds ``values`` (``int64`` at most)."""
    candidates = [t for t in _SIGNED if t.itemsize >= array.dtype.itemsize and np.can_cast(array.dtype, t)]
    return next((t for t in candidates if _fits(values, t)), np.dtype(np.int64))


def store(array: np.ndarray, where: np.ndarray | slice, values: np.ndarray | int) -> np.ndarray:
    """``array[where] = values``, in a wider (:func:`held`) copy of ``array`` first when a value
    does not fit its dtype; returns the array that holds them (``array`` itself, or the copy)."""
    values = np.asarray(values)
    if not _fits(values.reshape(-1), array.dtype):
        array = held(array, _wider(array, values.reshape(-1)))
    array[where] = values
    return array


def narrow_dtype(ids: np.ndarray) -> np.dtype:
    """``int32`` for integer ``ids`` that fit it (checked), else their own dtype."""
    if ids.dtype.itemsize > 4 and len(ids) and _fits(ids, np.dtype(np.int32)):
        return np.dtype(np.int32)
    return ids.dtype


def owned_positions(owner: np.ndarray, index: int) -> np.ndarray:
    """Positions ``p`` with ``owner[p] == index``, increasing, as :func:`id_dtype` of the plan's
    length in a :func:`mapped` array, found :data:`SCAN_BLOCK` positions at a time (no boolean
    mask as long as the plan)."""
    blocks = range(0, len(owner), SCAN_BLOCK)
    counts = [int(np.count_nonzero(owner[lo : lo + SCAN_BLOCK] == index)) for lo in blocks]
    out = mapped(sum(counts), id_dtype(len(owner)))
    at = 0
    for lo, count in zip(blocks, counts, strict=True):
        out[at : at + count] = np.flatnonzero(owner[lo : lo + SCAN_BLOCK] == index) + lo
        at += count
    return out
