"""Packed flags: one bit per sample for the yes/no state a server keeps about millions of samples
(loaded at home, handed out to a preload task, checked since placed), eight to a byte instead of a
``bool`` byte each."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["Flags"]

#: Set bits of each byte value (numpy before 2.0 has no ``bitwise_count``).
_POPCOUNT = np.array([bin(i).count("1") for i in range(256)], dtype=np.uint8)

#: Flags a bulk operation unpacks at a time (its temporaries stay this small, whatever the size).
CHUNK = 1 << 20


class Flags:
    """``size`` flags, all clear at first, packed in :attr:`bits` (flag ``i`` is bit ``i % 8`` of
    byte ``i // 8``, numpy's ``little`` bit order).

    Reads take what indexes a numpy array (an int, a slice, an array of positions) and give
    ``bool`` values, like the ``bool`` array it replaces; writes are :meth:`set` and :meth:`clear`.

    Args:
        size: number of flags.
    """

    def __init__(self, size: int) -> None:
        self.size = int(size)
        self.bits = np.zeros((self.size + 7) // 8, dtype=np.uint8)

    @classmethod
    def of(cls, values: np.ndarray | Flags) -> Flags:
        """Flags set where ``values`` (``bool`` per flag) is true."""
        if isinstance(values, Flags):
            out = cls(values.size)
            out.bits[:] = values.bits
            return out
        values = np.asarray(values, dtype=bool)
        out = cls(len(values))
        out.bits[:] = np.packbits(values, bitorder="little")
        return out

    @property
    def nbytes(self) -> int:
        """Bytes the flags take."""
        return int(self.bits.nbytes)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, (int, np.integer)):
            i = int(key) + (self.size if int(key) < 0 else 0)
            if not 0 <= i < self.size:
                raise IndexError(f"flag {int(key)} out of range for {self.size} flags")
            return bool((int(self.bits[i >> 3]) >> (i & 7)) & 1)
        if isinstance(key, slice):
            start, stop, step = key.indices(self.size)
            if step == 1:
                return self._range(start, stop)
            return self._gather(np.arange(start, stop, step, dtype=np.int64))
        pos = np.asarray(key)
        if pos.dtype == bool:
            pos = np.flatnonzero(pos)
        return self._gather(pos.astype(np.int64, copy=False))

    def _gather(self, pos: np.ndarray) -> np.ndarray:
        if len(pos) and (int(pos.min()) < -self.size or int(pos.max()) >= self.size):
            raise IndexError(f"a flag position is out of range for {self.size} flags")
        pos = np.where(pos < 0, pos + self.size, pos)
        return ((self.bits[pos >> 3] >> (pos & 7).astype(np.uint8)) & 1).astype(bool)

    def _range(self, start: int, stop: int) -> np.ndarray:
        """The flags ``start..stop-1`` as ``bool`` values."""
        if stop <= start:
            return np.zeros(0, dtype=bool)
        first = start >> 3
        unpacked = np.unpackbits(self.bits[first : (stop + 7) >> 3], bitorder="little")
        return unpacked[start - 8 * first : stop - 8 * first].view(bool)

    def set(self, pos: Any, value: bool = True) -> None:
        """Set (or with ``value`` False, clear) the flags at ``pos`` (an int, a slice or positions)."""
        if isinstance(pos, slice):
            start, stop, step = pos.indices(self.size)
            if step == 1:
                self._fill(start, stop, value)
                return
            pos = np.arange(start, stop, step, dtype=np.int64)
        pos = np.atleast_1d(np.asarray(pos))
        if pos.dtype == bool:
            pos = np.flatnonzero(pos)
        pos = pos.astype(np.int64, copy=False)
        if not len(pos):
            return
        if int(pos.min()) < -self.size or int(pos.max()) >= self.size:
            raise IndexError(f"a flag position is out of range for {self.size} flags")
        pos = np.where(pos < 0, pos + self.size, pos)
        masks = np.left_shift(np.uint8(1), (pos & 7).astype(np.uint8))
        if value:
            np.bitwise_or.at(self.bits, pos >> 3, masks)
        else:
            np.bitwise_and.at(self.bits, pos >> 3, ~masks)

    def clear(self, start: int = 0, stop: int | None = None) -> None:
        """Clear the flags ``start..stop-1`` (all of them by default)."""
        self._fill(start, self.size if stop is None else stop, False)

    def _fill(self, start: int, stop: int, value: bool) -> None:
        start, stop = max(start, 0), min(stop, self.size)
        if stop <= start:
            return
        head, tail = (start + 7) >> 3, stop >> 3  # whole bytes head..tail-1
        if head >= tail:  # within one byte, or two partial ones
            self.set(np.arange(start, stop, dtype=np.int64), value)
            return
        self.bits[head:tail] = 0xFF if value else 0
        if start < 8 * head:
            self.set(np.arange(start, 8 * head, dtype=np.int64), value)
        if 8 * tail < stop:
            self.set(np.arange(8 * tail, stop, dtype=np.int64), value)

    def count(self, start: int = 0, stop: int | None = None) -> int:
        """Set flags among ``start..stop-1`` (all of them by default)."""
        stop = self.size if stop is None else min(stop, self.size)
        start = max(start, 0)
        if stop <= start:
            return 0
        head, tail = (start + 7) >> 3, stop >> 3
        if head >= tail:
            return int(self._range(start, stop).sum())
        total = int(_POPCOUNT[self.bits[head:tail]].sum(dtype=np.int64))
        if start < 8 * head:
            total += int(self._range(start, 8 * head).sum())
        if 8 * tail < stop:
            total += int(self._range(8 * tail, stop).sum())
        return total

    def all(self, start: int = 0, stop: int | None = None) -> bool:
        """Whether every flag of ``start..stop-1`` is set (all of them by default)."""
        return self._every(start, stop, 0xFF, True)

    def any(self, start: int = 0, stop: int | None = None) -> bool:
        """Whether some flag of ``start..stop-1`` is set (all of them by default)."""
        return not self._every(start, stop, 0, False)

    def _every(self, start: int, stop: int | None, byte: int, value: bool) -> bool:
        """Whether every flag of ``start..stop-1`` is ``value`` (whole bytes compared with ``byte``)."""
        stop = self.size if stop is None else min(stop, self.size)
        start = max(start, 0)
        if stop <= start:
            return True
        head, tail = (start + 7) >> 3, stop >> 3
        if head >= tail:
            return bool((self._range(start, stop) == value).all())
        return (
            bool((self.bits[head:tail] == byte).all())
            and bool((self._range(start, 8 * head) == value).all())
            and bool((self._range(8 * tail, stop) == value).all())
        )

    def sum(self) -> int:
        """Set flags (as ``bool_array.sum()`` counts them)."""
        return self.count()

    def positions(self, start: int = 0, stop: int | None = None, *, value: bool = True) -> np.ndarray:
        """Positions among ``start..stop-1`` whose flag is ``value``, increasing (int64)."""
        stop = self.size if stop is None else min(stop, self.size)
        start = max(start, 0)
        parts = [np.zeros(0, dtype=np.int64)]
        for a in range(start, stop, CHUNK):
            chunk = self._range(a, min(a + CHUNK, stop))
            parts.append(np.flatnonzero(chunk if value else ~chunk) + a)
        return np.concatenate(parts)

    def first(self, start: int = 0, value: bool = False) -> int:
        """The first position from ``start`` on whose flag is ``value`` (:attr:`size` if none);
        looks a few flags ahead first, then further and further."""
        a, width = max(start, 0), 64
        while a < self.size:
            b = min(a + width, self.size)
            hit = np.flatnonzero(self._range(a, b) == value)
            if len(hit):
                return a + int(hit[0])
            a, width = b, min(2 * width, CHUNK)
        return self.size

    def tolist(self) -> list[bool]:
        """Every flag, as Python ``bool`` values."""
        return self._range(0, self.size).tolist()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self._range(0, self.size).copy()
        return out if dtype is None else out.astype(dtype)

    def __repr__(self) -> str:
        return f"Flags({self.count()} of {self.size} set)"
