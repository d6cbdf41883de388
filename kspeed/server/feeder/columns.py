"""Compact columns of a plan part (:mod:`kspeed.server.feeder.plan_part`) that read and write like
the int64 arrays they replace: window tickets, zero but for the few samples in the window, kept in
blocks where some are not zero; and crc32c values with -1 for "nothing to check", kept as uint32
with a bit per position for the -1.

Indexing takes an int, a slice or an array of positions and gives int64 values; assignment takes
an array of positions (or a slice) and int64 values (or one value). Arithmetic and comparisons
(``column == 0``) work on the whole column as an int64 array (a copy: for checks, not hot paths).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.lib.mixins import NDArrayOperatorsMixin

from kspeed.server.memory.flags import Flags

__all__ = ["CrcColumn", "SparseColumn"]

#: Positions per block of a :class:`SparseColumn` (a power of two).
BLOCK = 4096
_SHIFT = BLOCK.bit_length() - 1


class _WholeColumn(NDArrayOperatorsMixin):
    """Operators and numpy functions see the column as its whole int64 array."""

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out: np.ndarray = self[:]  # type: ignore[index]
        return out if dtype is None else out.astype(dtype)

    def __array_ufunc__(self, ufunc: np.ufunc, method: str, *inputs: Any, **kwargs: Any) -> Any:
        inputs = tuple(np.asarray(x) if isinstance(x, _WholeColumn) else x for x in inputs)
        return getattr(ufunc, method)(*inputs, **kwargs)

    def tolist(self) -> list[int]:
        """Every value."""
        return np.asarray(self).tolist()


def _positions(key: Any, size: int) -> np.ndarray:
    """``key`` (an int, a slice or positions) as an array of positions in ``0..size-1``."""
    if isinstance(key, slice):
        return np.arange(*key.indices(size), dtype=np.int64)
    pos = np.asarray(key)
    if pos.dtype == bool:
        return np.flatnonzero(pos)
    pos = np.atleast_1d(pos).astype(np.int64, copy=False)
    if not len(pos):
        return pos
    low, high = int(pos.min()), int(pos.max())
    if low < -size or high >= size:
        raise IndexError(f"a position is out of range for {size} positions")
    return pos if low >= 0 else np.where(pos < 0, pos + size, pos)


class SparseColumn(_WholeColumn):
    """An int64 column of ``size`` values, all zero at first, stored as blocks of :data:`BLOCK`
    values only where some value is not zero (a block whose values all become zero again goes).

    Args:
        size: number of values.
    """

    def __init__(self, size: int) -> None:
        self.size = int(size)
        self._blocks: dict[int, np.ndarray] = {}  # block number -> its values

    @classmethod
    def of(cls, values: np.ndarray) -> SparseColumn:
        """A column holding ``values``."""
        values = np.asarray(values, dtype=np.int64)
        out = cls(len(values))
        at = np.flatnonzero(values)
        out[at] = values[at]
        return out

    @property
    def nbytes(self) -> int:
        """Bytes the blocks take."""
        return len(self._blocks) * BLOCK * 8

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, (int, np.integer)):
            (value,) = self[np.array([key])]
            return int(value)
        if isinstance(key, slice) and key.step in (None, 1):
            start, stop, _ = key.indices(self.size)
            out = np.zeros(max(stop - start, 0), dtype=np.int64)
            for block in range(start >> _SHIFT, ((stop - 1) >> _SHIFT) + 1 if stop > start else 0):
                values = self._blocks.get(block)
                if values is not None:
                    a, b = max(start, block << _SHIFT), min(stop, (block + 1) << _SHIFT)
                    out[a - start : b - start] = values[a - (block << _SHIFT) : b - (block << _SHIFT)]
            return out
        pos = _positions(key, self.size)
        out = np.zeros(len(pos), dtype=np.int64)
        for block, at in self._groups(pos, np.zeros(len(pos), dtype=bool)):
            values = self._blocks.get(block)
            if values is not None:
                out[at] = values[pos[at] & (BLOCK - 1)]
        return out

    def __setitem__(self, key: Any, value: Any) -> None:
        pos = _positions(key, self.size)
        values = np.broadcast_to(np.asarray(value, dtype=np.int64), pos.shape)
        for block, at in self._groups(pos, values != 0):
            stored = self._blocks.get(block)
            if stored is None:
                stored = self._blocks[block] = np.zeros(BLOCK, dtype=np.int64)
            # (a position named twice takes its last value, as numpy's assignment does)
            stored[pos[at] & (BLOCK - 1)] = values[at]
            if not stored.any():  # (a scan of the block costs less than counting what changed)
                del self._blocks[block]

    def _groups(self, pos: np.ndarray, needed: np.ndarray) -> list[tuple[int, np.ndarray | slice]]:
        """The blocks that positions ``pos`` touch and that exist or are ``needed``, with the
        indices into ``pos`` of each one's positions (only those few are looked at: the usual
        case is a column with a handful of blocks and positions outside them, or a grant's or a
        task's positions, all in one block)."""
        blocks = pos >> _SHIFT
        if len(blocks) and (blocks == blocks[0]).all():
            first = int(blocks[0])
            return [(first, slice(None))] if first in self._blocks or needed.any() else []
        wanted = np.unique(blocks[needed])
        if self._blocks:
            wanted = np.union1d(wanted, np.fromiter(self._blocks, dtype=np.int64, count=len(self._blocks)))
        at = np.flatnonzero(np.isin(blocks, wanted)) if len(wanted) else np.zeros(0, dtype=np.int64)
        if not len(at):
            return []
        at = at[np.argsort(blocks[at], kind="stable")]
        edges = np.flatnonzero(np.diff(blocks[at])) + 1
        return [(int(blocks[part[0]]), part) for part in np.split(at, edges)]


class CrcColumn(_WholeColumn):
    """A crc32c per position, or -1 where there is nothing to check: uint32 values and a flag
    per position for the -1 (4 bytes and a bit instead of an int64).

    Args:
        size: number of positions (all -1 at first).
    """

    def __init__(self, size: int) -> None:
        self.size = int(size)
        self.values = np.zeros(self.size, dtype=np.uint32)
        self.unchecked = Flags(self.size)
        self.unchecked.set(slice(None))

    @classmethod
    def of(cls, values: np.ndarray) -> CrcColumn:
        """A column holding ``values`` (int64, -1 for none)."""
        values = np.asarray(values, dtype=np.int64)
        out = cls(len(values))
        out[slice(None)] = values
        return out

    @property
    def nbytes(self) -> int:
        """Bytes the column takes."""
        return int(self.values.nbytes) + self.unchecked.nbytes

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, (int, np.integer)):
            return -1 if self.unchecked[key] else int(self.values[key])
        out = self.values[key].astype(np.int64)
        out[self.unchecked[key]] = -1
        return out

    def __setitem__(self, key: Any, value: Any) -> None:
        pos = _positions(key, self.size)
        values = np.broadcast_to(np.asarray(value, dtype=np.int64), pos.shape)
        repeated = not isinstance(key, slice) and len(pos) > 1 and not (pos[1:] > pos[:-1]).all()
        if repeated and len(np.unique(pos)) < len(pos):  # the last value of a position wins
            last = len(pos) - 1 - np.unique(pos[::-1], return_index=True)[1]
            pos, values = pos[last], values[last]
        none = values < 0
        self.values[pos] = np.where(none, 0, values)
        self.unchecked.set(pos[none])
        self.unchecked.set(pos[~none], False)
