"""The narrowest dtypes that hold an epoch plan's per-sample arrays, widened where values do not fit.

A rank holds two plans of its share of every epoch (the current one and the next, planned ahead),
so each byte per sample counts twice: at 10^7 samples an ``int64`` array is 80 MB where an
``int32`` one is 40 MB. Sample IDs and plan positions are ``int32`` below ``2**31``, lengths and
offsets within a batch ``uint32`` (what the wire carries; a batch of 4 GiB or more falls back to
``int64``), labels ``int16`` until a label needs more, the owning server's index ``int8`` up to
127 servers. Every narrowing is checked: a value that does not fit widens the array, never wraps.
"""

from __future__ import annotations

import numpy as np

__all__ = ["SCAN_BLOCK", "U32_MAX", "id_dtype", "index_dtype", "narrowed", "owned_positions", "store"]

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
    """``array[where] = values``, in a wider copy of ``array`` first when a value does not fit its
    dtype; returns the array that holds them (``array`` itself, or the copy)."""
    values = np.asarray(values)
    if not _fits(values.reshape(-1), array.dtype):
        array = array.astype(_wider(array, values.reshape(-1)))
    array[where] = values
    return array


def narrowed(ids: np.ndarray) -> np.ndarray:
    """Integer ``ids`` as :func:`id_dtype` of their largest value would hold them (``int32`` when
    they fit, checked), ``ids`` itself when they already are that narrow."""
    ids = np.asarray(ids)
    if ids.dtype.itemsize <= 4 or not len(ids) or not _fits(ids, np.dtype(np.int32)):
        return ids
    return ids.astype(np.int32)


def owned_positions(owner: np.ndarray, index: int) -> np.ndarray:
    """Positions ``p`` with ``owner[p] == index``, increasing, as :func:`id_dtype` of the plan's
    length, scanned :data:`SCAN_BLOCK` positions at a time (no boolean mask as long as the plan)."""
    dtype = id_dtype(len(owner))
    pieces = [
        np.flatnonzero(owner[lo : lo + SCAN_BLOCK] == index).astype(dtype) + dtype.type(lo)
        for lo in range(0, len(owner), SCAN_BLOCK)
    ]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype)
