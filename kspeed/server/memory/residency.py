"""Where each owned sample of a share is now, apart from who owns it.

Ownership is a function of the dataset's allocation (the manager's contiguous ID ranges);
residency is the server's own, changing state. A sample is **absent** (nowhere yet), being
**read** by a producer or the preload (claimed, so nobody reads it twice), in the production
**window**, at **home** (its place in the share's pool regions, :mod:`kspeed.server.hosting.index`), or
**failed** (its last read failed; the reason is kept). Claims make the preload and the producers
share the work without reading a sample twice.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from kspeed.server.memory.flags import CHUNK, Flags

__all__ = ["ABSENT", "FAILED", "HOME", "READING", "WINDOW", "Residency"]

ABSENT, READING, WINDOW, HOME, FAILED = range(5)
NAMES = ("absent", "reading", "window", "home", "failed")


class Residency:
    """The residency of the samples ``lo..lo+len(loaded)-1`` of one share (thread-safe).

    Args:
        lo: the share's first sample ID.
        loaded: which samples are at home already (the index's loaded flags, or a ``bool`` array).
    """

    def __init__(self, lo: int, loaded: np.ndarray | Flags) -> None:
        self.lo = int(lo)
        self.state = np.full(len(loaded), ABSENT, dtype=np.uint8)
        for a in range(0, len(loaded), CHUNK):  # (a chunk at a time: no temporary per sample)
            self.state[a : a + CHUNK][np.asarray(loaded[a : a + CHUNK], dtype=bool)] = HOME
        self.reasons: dict[int, str] = {}
        self._failed_at: dict[int, float] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.state)

    def of(self, ids: np.ndarray) -> np.ndarray:
        """The states of ``ids`` (a copy)."""
        return self.state[np.asarray(ids, dtype=np.int64) - self.lo]

    def claim(self, ids: np.ndarray, *, retry_failed_after: float | None = None) -> np.ndarray:
        """Claim the absent ones of ``ids`` for reading (in order, each once); returns them.

        Args:
            retry_failed_after: also claim samples that failed at least this many seconds ago.
        """
        ids = np.asarray(ids, dtype=np.int64)
        with self._lock:
            state = self.state[ids - self.lo]
            ok = state == ABSENT
            if retry_failed_after is not None and (state == FAILED).any():
                now = time.monotonic()
                ok |= (state == FAILED) & np.array(
                    [now - self._failed_at.get(int(i), 0.0) >= retry_failed_after for i in ids]
                )
            taken = ids[ok]
            if len(taken) > 1:  # a plan may name a sample twice (DistributedSampler pads so)
                _, first = np.unique(taken, return_index=True)
                taken = taken[np.sort(first)]
            self.state[taken - self.lo] = READING
            return taken

    def settle(self, ids: np.ndarray, state: int) -> None:
        """Record where claimed (or moved) samples are now: :data:`WINDOW`, :data:`HOME` or :data:`ABSENT`."""
        ids = np.asarray(ids, dtype=np.int64)
        with self._lock:
            self.state[ids - self.lo] = state
            for i in ids.tolist():
                self.reasons.pop(i, None)
                self._failed_at.pop(i, None)

    def fail(self, ids: np.ndarray, reasons: list[str]) -> None:
        """Record samples whose read failed, with why."""
        ids = np.asarray(ids, dtype=np.int64)
        now = time.monotonic()
        with self._lock:
            self.state[ids - self.lo] = FAILED
            for i, why in zip(ids.tolist(), reasons, strict=True):
                self.reasons[i] = why
                self._failed_at[i] = now

    def count(self, state: int) -> int:
        """Samples in ``state`` now."""
        return int((self.state == state).sum())
