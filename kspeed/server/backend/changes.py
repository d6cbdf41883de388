"""Noticing backend files that changed or vanished after they were listed, so stale bytes are never served.

A share's samples were listed with a size and a stamp each (an mtime, or a hash of an etag;
:func:`kspeed.server.backend.listing.stamp`). Three things compare the backend with that listing again:
every read from the backend (preload, the re-read of a corrupt sample, a read of a sample not
loaded yet), an explicit ``CheckShare`` (the manager asks for one when a job attaches and the
fresh listing's fingerprint differs), and a :class:`ChangeWatch` thread that checks a bounded
number of files per interval, round robin over each share (on an object store every check is a
request, so the operator bounds the cost: ``change_check_budget`` files per
``change_check_interval``).

A changed sample is recorded in the share's :class:`ChangeLog`: from then on grants, plans and
reads that need it are refused with a :class:`~kspeed.errors.ChangedError` naming the sample, its
path and what changed, the share reports it (``ShareStatus.changes``) and the manager marks the
dataset ``changed``. The remedy is the operator's: remove the dataset and register it again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from kspeed.errors import ChangedError

__all__ = ["Change", "ChangeLog", "ChangeWatch"]

log = logging.getLogger(__name__)

REPORTED = 5  # changes named in a share's status


@dataclass(frozen=True)
class Change:
    """One sample whose backend file no longer matches the listing.

    Attributes:
        sample: the sample ID.
        path: its backend path.
        what: what differs, e.g. ``"deleted"`` or ``"size 1000 -> 1200"``.
    """

    sample: int
    path: str
    what: str

    def __str__(self) -> str:
        return f"sample {self.sample} ({self.path}): {self.what}"


class ChangeLog:
    """The changed samples of one share, and how far the periodic check has come.

    Args:
        dataset: the dataset's name.
        lo: first sample ID of the share.
        hi: one past its last sample ID.
        on_change: called with the newly changed samples (e.g. to tell the feeders), from the thread
            that noticed them.
    """

    def __init__(
        self, dataset: str, lo: int, hi: int, on_change: Callable[[list[Change]], None] = lambda changes: None
    ) -> None:
        self.dataset = dataset
        self.lo, self.hi = lo, hi
        self.on_change = on_change
        self.cursor = lo
        self.checked = 0
        self._lock = threading.Lock()
        self._changes: dict[int, Change] = {}

    def record(self, changes: Iterable[Change]) -> list[Change]:
        """Keep ``changes``; returns the new ones (and tells :attr:`on_change` about them)."""
        with self._lock:
            new = [c for c in changes if c.sample not in self._changes]
            for change in new:
                self._changes[change.sample] = change
        if new:
            for change in new[:REPORTED]:
                log.error("dataset %s: backend changed after listing: %s", self.dataset, change)
            if len(new) > REPORTED:
                log.error("dataset %s: ... and %d more changed samples", self.dataset, len(new) - REPORTED)
            self.on_change(new)
        return new

    def counted(self, n: int) -> None:
        """``n`` more files were compared with the listing."""
        with self._lock:
            self.checked += n

    @property
    def count(self) -> int:
        """Changed samples known."""
        return len(self._changes)

    def ids(self) -> np.ndarray:
        """The changed sample IDs, sorted."""
        with self._lock:
            return np.array(sorted(self._changes), dtype=np.int64)

    def first(self, n: int = REPORTED) -> list[Change]:
        """The ``n`` changes with the lowest sample IDs."""
        with self._lock:
            return [self._changes[k] for k in sorted(self._changes)[:n]]

    def refuse(self, ids: np.ndarray, what: str) -> None:
        """Raise if any of ``ids`` changed.

        Raises:
            ChangedError: naming the first changed sample among ``ids``, its path and what changed,
                and ``what`` was refused.
        """
        if not self._changes:
            return
        changed = self.ids()
        hit = np.flatnonzero(np.isin(ids, changed))
        if len(hit):
            change = self._changes[int(ids[hit[0]])]
            raise ChangedError(
                f"dataset {self.dataset!r}: {what}: {change} after it was listed ({len(hit)} such sample(s)); "
                "its cached bytes are stale and are not served: remove the dataset and register it again",
                dataset=self.dataset,
                sample=change.sample,
            )

    def next_batch(self, limit: int) -> np.ndarray:
        """The next ``limit`` sample IDs of the round-robin check (wrapping at the share's end)."""
        size = self.hi - self.lo
        if size <= 0 or limit <= 0:
            return np.zeros(0, dtype=np.int64)
        n = min(limit, size)
        with self._lock:
            start = self.cursor - self.lo
            self.cursor = self.lo + (start + n) % size
        return self.lo + (start + np.arange(n, dtype=np.int64)) % size


class ChangeWatch:
    """Checks a bounded number of each share's backend files every interval, in a daemon thread.

    Args:
        shares: returns ``(change log, check function)`` of every share now; the check function
            compares the given sample IDs with the backend and returns the changes.
        interval: seconds between rounds.
        budget: files compared per share and round.
    """

    def __init__(
        self,
        shares: Callable[[], list[tuple[ChangeLog, Callable[[np.ndarray], list[Change]]]]],
        *,
        interval: float,
        budget: int,
    ) -> None:
        self._shares = shares
        self._interval = interval
        self._budget = budget
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kspeed-change-watch", daemon=True)

    def start(self) -> None:
        """Start the rounds (nothing happens with a zero budget)."""
        if self._budget > 0:
            self._thread.start()

    def check_round(self) -> int:
        """One round over every share; returns the new changes found."""
        found = 0
        for changes, check in self._shares():
            ids = changes.next_batch(self._budget)
            try:
                found += len(changes.record(check(ids)))
            except Exception as exc:  # the backend may be away for a while: the next round tries again
                log.warning("dataset %s: backend check failed: %s", changes.dataset, exc)
                continue
            changes.counted(len(ids))
        return found

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.check_round()

    def stop(self) -> None:
        """Stop after the round in progress."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
