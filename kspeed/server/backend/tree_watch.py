"""Which samples of a share of a local tree may have changed: inotify events on their folders.

A job's attach compares a share's files with the listing (:meth:`~kspeed.server.backend.sources.Source.verify`);
for a local tree that is one ``stat`` per file, seconds for a million files. A :class:`ShareWatch`,
started when the share is taken and before any of its files is read, watches the folders that hold
the share's files. From then on every change to a listed file (written, rewritten in place,
touched, replaced, removed) arrives as an event naming it, and the comparison needs a ``stat``
only of the files named since the last one (:meth:`ShareWatch.touched`).

Why that is enough: a file changed before the watch started is noticed when it is read (every read
from the backend compares the file with its listing, and every read of the share comes after the
watch started); a file changed after it is named by an event. Where that does not hold the watch
is not used and every file is compared, as without it:

* the tree is not on a local file system (:func:`~kspeed.server.backend.inotify.local_file_system`:
  a network file system changed from another host, a FUSE or overlay mount, send no events);
* a folder could not be watched (the user's ``fs.inotify.max_user_watches`` is reached);
* events were lost (the kernel's queue overflowed, a watched folder was removed or moved), or
  more names are pending than :data:`MAX_PENDING`.

A sample that is a symbolic link, or a file with several hard links, can change through a folder
that is not watched: those are compared at every attach whatever the events say. Not noticed, by
events or by a ``stat``: a file changed through a shared writable mapping that never updates its
mtime.
"""

from __future__ import annotations

import bisect
import logging
import os

import numpy as np

from kspeed.server.backend.inotify import DirectoryEvents, local_file_system
from kspeed.server.backend.listing import Keys

__all__ = ["MAX_PENDING", "ShareWatch"]

log = logging.getLogger(__name__)

MAX_PENDING = 1 << 17  # names pending between two looks beyond which the watch gives up (memory)


class _SortedKeys:
    """``keys[lo:hi]`` as a sorted sequence of bytes, for :func:`bisect.bisect_left`."""

    def __init__(self, keys: Keys, lo: int, hi: int) -> None:
        self._keys, self._lo, self._hi = keys, lo, hi

    def __len__(self) -> int:
        return self._hi - self._lo

    def __getitem__(self, i: int) -> bytes:
        j = self._lo + i
        return self._keys.blob[int(self._keys.starts[j]) : int(self._keys.ends[j])]


class ShareWatch:
    """inotify watches on the folders of samples ``lo..hi-1`` of a local ``dir`` listing under ``root``.

    Use :meth:`start`, which returns ``None`` (and logs why) where events cannot be trusted.
    """

    def __init__(
        self, dataset: str, root: str, keys: Keys, lo: int, hi: int, events: DirectoryEvents, unwatchable: np.ndarray
    ) -> None:
        self.dataset = dataset
        self._unwatchable = unwatchable[(unwatchable >= lo) & (unwatchable < hi)]
        self._root = os.fsencode(root.rstrip("/")) + b"/"
        self._sorted = _SortedKeys(keys, lo, hi)
        self._lo = lo
        self._events = events
        self._gave_up = ""

    @classmethod
    def start(cls, dataset: str, root: str, keys: Keys, lo: int, hi: int, unwatchable: np.ndarray) -> ShareWatch | None:
        """Watch the folders of the share's files, or ``None`` where events would not tell every change.

        ``unwatchable``: sample IDs whose changes may not show as events on their folders (symbolic
        links, files with several hard links): :meth:`touched` always names those of the share.
        """
        kind = local_file_system(root)
        if not kind:
            log.info("dataset %s: %s is not on a local file system: an attach compares every file", dataset, root)
            return None
        try:
            events = DirectoryEvents()
        except OSError as exc:
            log.warning("dataset %s: no inotify (%s): an attach compares every file", dataset, exc)
            return None
        watch = cls(dataset, root, keys, lo, hi, events, unwatchable)
        try:
            for folder in watch._folders(keys, lo, hi):
                events.watch(folder)
        except OSError as exc:
            events.close()
            log.warning("dataset %s: cannot watch its folders (%s): an attach compares every file", dataset, exc)
            return None
        return watch

    def _folders(self, keys: Keys, lo: int, hi: int) -> set[bytes]:
        """The absolute folders holding samples ``lo..hi-1``."""
        blob = np.frombuffer(keys.blob, dtype=np.uint8)
        slashes = np.flatnonzero(blob == ord("/"))
        starts, ends = keys.starts[lo:hi], keys.ends[lo:hi]
        at = np.searchsorted(slashes, ends) - 1  # the last slash before each key's end
        last = np.where(at >= 0, slashes[np.maximum(at, 0)] if len(slashes) else 0, -1)
        last = np.where(last >= starts, last, starts)  # a key without a slash lies in the root itself
        root = self._root[:-1]
        raw = keys.blob
        found = {raw[a:b] for a, b in zip(starts.tolist(), last.tolist(), strict=True)}
        return {root + b"/" + folder if folder else root for folder in found}

    @property
    def intact(self) -> bool:
        """Whether every change since the watch started is among the events (see the module docstring)."""
        return self._events.intact and not self._gave_up

    @property
    def why(self) -> str:
        """Why the watch is not :attr:`intact` (``""`` while it is)."""
        return self._gave_up or self._events.why

    def touched(self, *, always: bool) -> np.ndarray | None:
        """The sample IDs of the share that events named since the last call (sorted), and with
        ``always`` those whose changes may not show as events; ``None`` when the watch is not
        :attr:`intact` (then every file must be compared)."""
        named = self._events.drain()
        if not self.intact:
            return None
        if sum(len(names) for names in named.values()) > MAX_PENDING:
            self._gave_up = f"more than {MAX_PENDING} names changed at once"
            return None
        ids = []
        for folder, names in named.items():
            relative = (folder + b"/")[len(self._root) :]  # b"" for the root itself
            for name in names:
                key = relative + name
                at = bisect.bisect_left(self._sorted, key)
                if at < len(self._sorted) and self._sorted[at] == key:
                    ids.append(self._lo + at)
        found = np.unique(np.array(ids, dtype=np.int64))
        return np.union1d(found, self._unwatchable).astype(np.int64) if always else found

    def close(self) -> None:
        """Stop watching."""
        self._events.close()
