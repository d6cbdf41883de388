"""Array-described batches of writes: validated once with numpy, then issued per op in C.

A batch is many writes from one source buffer into one region key, given as parallel ``int64``
arrays (source offset, length, destination offset per op) plus the immediates to raise once all of
the batch's bytes have landed. :func:`check_batch` range-checks the whole batch in one vectorized
pass, so a rail's hot loop only moves bytes: ``memmove`` over precomputed addresses on ``shm``, one
gathered ``sendmsg`` on ``tcp``, a chain of ``RDMA_WRITE`` work requests on ``verbs``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kspeed.errors import RangeError, TransportError

from .regions import Buffer, Ints, Memory, Region, RegionKey, as_bytes_view

__all__ = ["WriteBatch", "check_batch", "runs", "source_array"]

_U32_MAX = (1 << 32) - 1
_SANE = 1 << 62  # no offset or length is anywhere near this; sums below it cannot overflow int64


@dataclass(frozen=True)
class WriteBatch:
    """A validated batch; every range is known to lie inside its source and its key.

    Attributes:
        src: ``int64`` offsets into the source buffer.
        lengths: ``int64`` bytes per op.
        dst: ``int64`` offsets into the key's range (not yet shifted by ``key.addr``).
        imms: ``uint32`` immediates to notify, in order, after every op's bytes.
    """

    src: np.ndarray
    lengths: np.ndarray
    dst: np.ndarray
    imms: np.ndarray

    def __len__(self) -> int:
        return len(self.lengths)


def source_array(source: Region | Memory | Buffer) -> np.ndarray:
    """The source of a batch as a flat ``uint8`` array over the same memory (no copy).

    Accepts a :class:`~kspeed.rdma.regions.Region` or its memory, a ``uint8`` numpy array, or any
    C-contiguous buffer.
    """
    if isinstance(source, np.ndarray) and source.dtype == np.uint8 and source.ndim == 1:
        return source
    if isinstance(source, (np.ndarray, bytes, bytearray, memoryview)):
        return np.frombuffer(as_bytes_view(source), np.uint8)
    return np.frombuffer(source.view, np.uint8)


def _int64(name: str, values: Ints, count: int | None) -> np.ndarray:
    arr = values if type(values) is np.ndarray else np.asarray(values)
    if arr.dtype.kind not in "iu" and arr.size:
        raise TransportError(f"batch {name} must be integers, got dtype {arr.dtype}")
    if count is not None and arr.ndim == 0:
        return np.full(count, int(arr), np.int64)
    if arr.ndim != 1:
        raise TransportError(f"batch {name} must be one-dimensional, got shape {arr.shape}")
    if count is not None and len(arr) != count:
        raise TransportError(f"batch {name} holds {len(arr)} entries, expected {count}")
    if arr.dtype == np.uint64 and len(arr) and arr.max() > np.iinfo(np.int64).max:
        raise RangeError(f"batch {name} holds a value beyond 2**63")
    return arr if arr.dtype == np.int64 else arr.astype(np.int64)


def _imms(imms: Ints | None) -> np.ndarray:
    if imms is None:
        return np.empty(0, np.uint32)
    arr = np.asarray(imms)
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if arr.ndim != 1 or (arr.dtype.kind not in "iu" and arr.size):
        raise TransportError(f"batch immediates must be a 1-D integer array, got {arr.dtype} {arr.shape}")
    if arr.dtype != np.uint32 and len(arr) and (int(arr.min()) < 0 or int(arr.max()) > _U32_MAX):
        raise TransportError("a batch immediate does not fit in 32 bits")
    return arr.astype(np.uint32, copy=False)


def _refuse(key: RegionKey, source_nbytes: int, src: np.ndarray, lens: np.ndarray, dst: np.ndarray) -> None:
    """Raise a RangeError naming the first op of the batch that does not fit."""
    bad = (lens < 0) | (src < 0) | (dst < 0) | (src > source_nbytes) | (dst > key.length)
    bad |= (lens > source_nbytes - src) | (lens > key.length - dst)
    i = int(np.argmax(bad))
    raise RangeError(
        f"batch op {i}: {int(lens[i])} bytes from source offset {int(src[i])} (source of "
        f"{source_nbytes} bytes) to offset {int(dst[i])} outside the granted range of {key.length} "
        f"bytes (region {key.handle} on {key.node}); nothing was written"
    )


def check_batch(
    key: RegionKey,
    source_nbytes: int,
    src_offsets: Ints,
    lengths: Ints,
    dst_offsets: Ints,
    imms: Ints | None = None,
) -> WriteBatch:
    """Validate a batch as a whole before any byte moves.

    Args:
        key: the granted destination range.
        source_nbytes: size of the source buffer.
        src_offsets: per-op offsets into the source.
        lengths: per-op byte counts (or one count for every op).
        dst_offsets: per-op offsets into ``key``'s range.
        imms: immediates to notify after the whole batch (any number, ``None`` for none).

    Raises:
        RangeError: an op reads outside the source or writes outside the key; names the first one.
        TransportError: the arrays are malformed, or an immediate does not fit in 32 bits.
    """
    src = _int64("source offsets", src_offsets, None)
    lens = _int64("lengths", lengths, len(src))
    dst = _int64("destination offsets", dst_offsets, len(src))
    if len(src):
        # Whole-array extremes first; bounding every term by 2**62 keeps the sums from overflowing.
        every = np.concatenate((src, lens, dst))
        if (
            every.min() < 0
            or every.max() > _SANE
            or (src + lens).max() > source_nbytes
            or (dst + lens).max() > key.length
        ):
            _refuse(key, source_nbytes, src, lens, dst)
    return WriteBatch(src, lens, dst, _imms(imms))


def runs(batch: WriteBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Group ops whose destinations follow each other into runs (one remote write each).

    Returns:
        ``(first, dst, nbytes)``: index of each run's first op, its destination offset and its total
        length. Op ``first[r] .. first[r + 1] - 1`` are gathered, in order, into run ``r``.
    """
    n = len(batch)
    if n == 0:
        empty = np.empty(0, np.int64)
        return empty, empty, empty
    ends = batch.dst + batch.lengths
    starts = np.flatnonzero(np.concatenate(([True], batch.dst[1:] != ends[:-1])))
    csum = np.concatenate(([0], np.cumsum(batch.lengths)))
    bounds = np.append(starts, n)
    return starts, batch.dst[starts], csum[bounds[1:]] - csum[bounds[:-1]]
