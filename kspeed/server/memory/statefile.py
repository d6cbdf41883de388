"""Writing a server's state files (its assignments, its pool's manifest, the shares' sample indexes).

A state file is written whole or not at all: into a temporary file beside it, flushed to disk, then
renamed over the old one, so a crash or a full disk leaves the previous version intact (and no
half-written temporary file taking the space that is left). The operating system's errors are
turned into :class:`~kspeed.errors.StateFileError` here, in one place, naming the file and the space
left on its file system.

A write syncs the file, which takes seconds on a busy disk, so a state file that records what a
lock guards is written from an :class:`OrderedFile`: a numbered :class:`Snapshot` is taken under
the caller's lock (cheap) and written after it is let go, and snapshots reach the file in the
order they were taken (one older than the file's is skipped: the newer one says everything it
would). Whatever else needs that lock meanwhile (a heartbeat's counts) is not held up by the disk.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO

from kspeed.control.daemon import free_bytes
from kspeed.control.status import human_bytes
from kspeed.errors import StateFileError

__all__ = ["OrderedFile", "Snapshot", "state_file_errors", "write_atomic"]


@contextlib.contextmanager
def state_file_errors(path: str | os.PathLike[str]) -> Iterator[None]:
    """Turn an :class:`OSError` raised while writing ``path`` into :class:`~kspeed.errors.StateFileError`."""
    try:
        yield
    except OSError as exc:
        name = os.fspath(path)
        free = free_bytes(name)
        left = f"{human_bytes(free)} free there" if free is not None else "free space unknown"
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            hint = "free space there (the server keeps serving what it holds)"
        else:
            hint = "check that the directory exists and that the server may write there"
        reason = exc.strerror or str(exc)
        raise StateFileError(f"cannot write {name}: {reason} ({left}); {hint}", path=name, free_bytes=free) from exc


def write_atomic(path: str | os.PathLike[str], data: bytes | memoryview | Callable[[IO[bytes]], object]) -> None:
    """Replace ``path`` with ``data`` whole, durably (the old file stays if anything fails).

    ``data`` may be a function that writes the content into the file it is given (a large state
    file then never needs a copy in memory).

    Raises:
        StateFileError: the file cannot be written (the disk is full, the directory read-only...).
    """
    name = os.fspath(path)
    tmp = os.path.join(os.path.dirname(name), f".{os.path.basename(name)}.tmp")
    with state_file_errors(name):
        try:
            with open(tmp, "wb") as fh:
                if callable(data):
                    data(fh)
                else:
                    fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, name)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


@dataclass(frozen=True)
class Snapshot:
    """A state file's content at one moment, numbered in the order snapshots were taken."""

    number: int
    data: bytes


class OrderedFile:
    """A state file written from snapshots taken under the caller's lock and written after it.

    Args:
        path: the file.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._writing = threading.Lock()
        self._taken = 0  # snapshots taken (the caller's lock orders them)
        self._written = 0  # the newest snapshot in the file

    @property
    def written(self) -> int:
        """The number of the newest snapshot in the file (0: none written by this object)."""
        return self._written

    def snapshot(self, data: bytes) -> Snapshot:
        """The next snapshot, of ``data``; called under the lock that guards what it records."""
        self._taken += 1
        return Snapshot(self._taken, data)

    def write(self, snapshot: Snapshot) -> None:
        """Make ``snapshot`` (or a newer one) what the file says, durably; called without the
        caller's lock.

        Raises:
            StateFileError: it cannot be written (the previous version stays).
        """
        with self._writing:
            if snapshot.number <= self._written:
                return
            write_atomic(self.path, snapshot.data)
            self._written = snapshot.number
