"""Reading local sample files straight into region memory with as few system calls as possible.

From a warm page cache a sample costs its system calls and the copy, so :class:`LocalReader`
issues three per file: ``openat`` relative to the file's directory, one ``readv`` that fills the
sample's place in the region and asks for one byte more (so a file that grew since listing is
noticed without another call) and ``close``. Files larger than :data:`PIECE` are read and
checksummed piece by piece, each piece while it is still in the CPU cache. ``npy`` sources open
their one file once per run and read rows with ``preadv``.

Security is checked on descriptors, never on names alone: a directory is opened, the path its
descriptor really names (``/proc/self/fd``) must be admitted by the allow-list, and its files are
then opened relative to that descriptor with ``O_NOFOLLOW``, so neither ``..`` nor a symlink
anywhere on the way can lead outside. A file that is itself a symlink, or whose directory is not
admitted as a whole, is opened by its full path and checked the same way on its own descriptor.
"""

from __future__ import annotations

import copy
import dataclasses
import errno
import logging
import os
from collections.abc import Sequence

import numpy as np

from kspeed.errors import ChangedError, DatasetError
from kspeed.server.backend.changes import Change
from kspeed.server.memory.checksum import crc32c_extend

__all__ = ["PIECE", "LocalReader", "fd_path"]

log = logging.getLogger(__name__)

#: Files larger than this are read and checksummed in pieces of this size (fits the L2 cache, so
#: the checksum reads the piece from cache rather than from memory).
PIECE = 512 << 10

_FILE_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
_DIR_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECTORY
_SPECIAL_NAMES = ("", ".", "..")


def fd_path(fd: int) -> str:
    """The path the open descriptor ``fd`` really names (symlinks and ``..`` resolved)."""
    return os.readlink(f"/proc/self/fd/{fd}")


@dataclasses.dataclass
class _Run:
    """One :meth:`LocalReader.read_run`: what it reads, where to, and what it found."""

    ids: Sequence[int]
    out: np.ndarray
    view: memoryview
    offsets: Sequence[int]
    sizes: Sequence[int]
    checksum: bool
    crcs: list[int]
    errors: list[DatasetError]


class LocalReader:
    """Reads samples of a local source into memory, checking every descriptor against the allow-list.

    Args:
        source: the dataset's :class:`~kspeed.server.backend.sources.Source`; its protocol is local.
    """

    def __init__(self, source) -> None:
        self.source = source
        self.dataset = source.dataset
        self.protocol = source.protocol
        self.allow = source.backend.allow
        self.backend = source.backend

    def read_run(
        self,
        ids: Sequence[int],
        out: np.ndarray,
        offsets: Sequence[int],
        sizes: Sequence[int],
        *,
        checksum: bool = True,
    ) -> tuple[list[int], list[DatasetError]]:
        """Read samples ``ids`` into ``out[offsets[j] : offsets[j] + sizes[j]]``.

        Args:
            ids: sample IDs, usually consecutive (files of one directory share its check).
            out: a contiguous, writable uint8 array (a region).
            offsets: where each sample goes in ``out``.
            sizes: each sample's listed size.
            checksum: compute the crc32c of each sample.

        Returns:
            The crc32c of each sample (0 for failed ones or without ``checksum``) and one error per
            failed sample, naming the dataset and the sample.
        """
        view = out.data.cast("B")
        crcs = [0] * len(ids)
        errors: list[DatasetError] = []
        if self.source.kind == "npy":
            self._read_rows(_Run(ids, out, view, offsets, sizes, checksum, crcs, errors))
            return crcs, errors
        if self.source.kind == "tar":
            self._read_members(_Run(ids, out, view, offsets, sizes, checksum, crcs, errors))
            return crcs, errors
        dirs: dict[str, int | None] = {}
        scratch = bytearray(1)
        readv, close, fstat = os.readv, os.close, os.fstat
        stamps = self.source.stamps
        listed = stamps[np.asarray(ids, dtype=np.int64)].tolist() if stamps is not None else None
        try:
            for j, (i, path) in enumerate(zip(ids, self.source.paths(ids), strict=True)):
                off, size = offsets[j], sizes[j]
                try:
                    fd = self._open(path, i, dirs)
                    try:
                        # The file must be the one listed: same size, and its mtime is the stamp.
                        if listed is not None:
                            st = fstat(fd)
                            if st.st_size != size:
                                errors.append(self.source.size_changed(i, size, st.st_size))
                                continue
                            if st.st_mtime != listed[j]:
                                errors.append(self.source.changed_error(Change(i, path, "modified (a new mtime)")))
                                continue
                        if size < PIECE:  # the common case, one call: the sample and a byte beyond
                            got = readv(fd, [view[off : off + size], scratch])
                            if 0 < got < size:
                                more, _ = _read(fd, out, view, off + got, size - got, scratch, False)
                                got += more
                            crc = crc32c_extend(0, out[off : off + size]) if checksum and got == size else 0
                        else:
                            got, crc = _read(fd, out, view, off, size, scratch, checksum)
                    finally:
                        close(fd)
                except FileNotFoundError:
                    errors.append(self.source.changed_error(Change(i, path, "deleted")))
                    continue
                except OSError as exc:
                    errors.append(
                        self.backend.error(exc, f"read {self.protocol}://{path}", dataset=self.dataset, sample=i)
                    )
                    continue
                except DatasetError as exc:
                    errors.append(exc)
                    continue
                if got != size:
                    errors.append(self.source.size_changed(i, size, got))
                    continue
                crcs[j] = crc
        finally:
            for dir_fd in dirs.values():
                if dir_fd is not None:
                    os.close(dir_fd)
        return crcs, errors

    def _open(self, path: str, sample: int, dirs: dict[str, int | None]) -> int:
        """Open ``path`` for reading; its directory's descriptor is checked once and cached in ``dirs``."""
        parent, _, name = path.rpartition("/")
        if parent not in dirs:
            dirs[parent] = self._open_dir(parent)
        dfd: int | None = dirs[parent]
        if dfd is not None and name not in _SPECIAL_NAMES:
            try:
                return os.open(name, _FILE_FLAGS, dir_fd=dfd)
            except OSError as exc:
                if exc.errno != errno.ELOOP:  # ELOOP: the file is a symlink, checked below
                    raise
        return self._open_checked(path, sample)

    def _open_dir(self, path: str) -> int | None:
        """A descriptor of directory ``path`` if the allow-list admits where it really is, else ``None``."""
        try:
            fd = os.open(path or "/", _DIR_FLAGS)
        except OSError:
            return None  # each file's own open reports the error
        try:
            if self.allow.admits_resolved(self.protocol, fd_path(fd)):
                return fd
        except OSError:
            pass
        os.close(fd)
        return None

    def _open_checked(self, path: str, sample: int) -> int:
        """Open ``path`` (following symlinks) and check where its descriptor really leads."""
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self.allow.check_resolved(self.protocol, fd_path(fd), dataset=self.dataset, sample=sample)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _read_rows(self, run: _Run) -> None:
        """``npy`` rows: the one file opened once per run, each row one ``preadv``."""
        ids, out, view, offsets, sizes = run.ids, run.out, run.view, run.offsets, run.sizes
        checksum, crcs, errors = run.checksum, run.crcs, run.errors
        path, first = self.source.root, self.source.row_offset
        what = f"read {self.protocol}://{path}"
        try:
            shared = self._open_checked(path, ids[0])
        except (OSError, DatasetError):
            shared = None  # each sample opens on its own below and reports its own error
        try:
            for j, i in enumerate(ids):
                off, size = offsets[j], sizes[j]
                try:
                    fd = shared if shared is not None else self._open_checked(path, i)
                    try:
                        got, crc = _read(fd, out, view, off, size, None, checksum, position=first + i * size)
                    finally:
                        if fd is not shared:
                            os.close(fd)
                except OSError as exc:
                    errors.append(self.backend.error(exc, what, dataset=self.dataset, sample=i))
                    continue
                except DatasetError as exc:
                    errors.append(exc)
                    continue
                if got != size:
                    errors.append(self.source.size_changed(i, size, got))
                    continue
                crcs[j] = crc
        finally:
            if shared is not None:
                os.close(shared)

    def _read_members(self, run: _Run) -> None:
        """Tar members: each shard opened (and checked against its listed mtime) once per run,
        each sample one ``preadv`` at its member's offset."""
        ids, out, view, offsets, sizes = run.ids, run.out, run.view, run.offsets, run.sizes
        checksum, crcs, errors = run.checksum, run.crcs, run.errors
        source = self.source
        opened: dict[int, int | DatasetError] = {}
        try:
            for j, i in enumerate(ids):
                shard = int(source.shard_of[i])
                path = source.shards[shard]
                if shard not in opened:
                    opened[shard] = self._open_shard(path, i)
                fd = opened[shard]
                if isinstance(fd, DatasetError):  # the shard's error, told for each of its samples
                    if isinstance(fd, ChangedError):
                        errors.append(source.changed_error(Change(i, path, fd.what)))
                    else:
                        mine = copy.copy(fd)
                        mine.sample = i
                        errors.append(mine)
                    continue
                size = sizes[j]
                try:
                    got, crc = _read(fd, out, view, offsets[j], size, None, checksum, position=int(source.offsets[i]))
                except OSError as exc:
                    errors.append(
                        self.backend.error(exc, f"read {self.protocol}://{path}", dataset=self.dataset, sample=i)
                    )
                    continue
                if got != size:
                    errors.append(source.size_changed(i, size, got))
                    continue
                crcs[j] = crc
        finally:
            for fd in opened.values():
                if isinstance(fd, int):
                    os.close(fd)

    def _open_shard(self, path: str, sample: int) -> int | DatasetError:
        """A descriptor of a shard that is still the one listed, or the error to report instead."""
        try:
            fd = self._open_checked(path, sample)
        except FileNotFoundError:
            return self.source.changed_error(Change(sample, path, "deleted"))
        except OSError as exc:
            return self.backend.error(exc, f"open {self.protocol}://{path}", dataset=self.dataset, sample=sample)
        except DatasetError as exc:
            return exc
        if self.source.stamps is not None and os.fstat(fd).st_mtime != float(self.source.stamps[sample]):
            os.close(fd)
            return self.source.changed_error(Change(sample, path, "modified (a new mtime)"))
        return fd


def _read(
    fd: int,
    out: np.ndarray,
    view: memoryview,
    off: int,
    size: int,
    scratch: bytearray | None,
    checksum: bool,
    position: int | None = None,
) -> tuple[int, int]:
    """Read ``size`` bytes from ``fd`` into ``out[off:]``; returns (bytes found, crc32c of them).

    With ``scratch`` (one byte), one byte more is asked for on the last read and "bytes found"
    exceeds ``size`` if the file is longer than listed. With ``position``, reads use ``preadv``
    from that file offset.
    """
    got, crc, end = 0, 0, off + size
    while True:
        stop = min(off + got + PIECE, end)
        bufs: list[memoryview | bytearray] = [view[off + got : stop]]
        if stop == end and scratch is not None:
            bufs.append(scratch)
        n = os.readv(fd, bufs) if position is None else os.preadv(fd, bufs, position + got)
        if checksum and n:
            crc = crc32c_extend(crc, out[off + got : min(off + got + n, end)])
        got += n
        if n == 0 or got >= size:
            return got, crc
