"""Page-aligned host buffers and memfd segments shared by the rails.

Shared memory is always a ``memfd``: it has no name in ``/dev/shm``, so a crash cannot leak a
segment; the memory is freed when the last descriptor and mapping are gone. Segments get a
descriptive name from :func:`segment_name` (visible in ``/proc/<pid>/fd`` as
``/memfd:kspeed:<pid>:<purpose>:<n>``) so an operator can tell who holds what. Segments are sealed
against shrinking and growing, and an attaching process checks the seals, so a receiver can never
make a writer fault (SIGBUS) by truncating the ring under it.
"""

from __future__ import annotations

import fcntl
import itertools
import logging
import mmap
import os

import numpy as np

from kspeed.errors import CapacityError, ConfigError, TransportError

__all__ = ["PAGE_SIZE", "HostBuffer", "MemfdSegment", "round_up", "segment_name"]

log = logging.getLogger(__name__)

PAGE_SIZE = mmap.PAGESIZE
_REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_counter = itertools.count()
# Fill the page tables at map time so the first write of each page takes no fault on the hot path.
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def round_up(nbytes: int, align: int = PAGE_SIZE) -> int:
    """Round ``nbytes`` up to a multiple of ``align``."""
    return -(-nbytes // align) * align


def segment_name(purpose: str) -> str:
    """The one naming scheme for segments: ``kspeed:<pid>:<purpose>:<n>``."""
    return f"kspeed:{os.getpid()}:{purpose}:{next(_counter)}"


def _check_size(nbytes: int) -> None:
    if not isinstance(nbytes, int) or nbytes <= 0:
        raise ConfigError(f"buffer size must be a positive integer of bytes, got {nbytes!r}")


class _Mapped:
    """A mapping plus the memoryview we hand out; closing tolerates views the user still holds."""

    def __init__(self, mm: mmap.mmap, nbytes: int) -> None:
        self._mmap = mm
        self.nbytes = nbytes
        self.view = memoryview(mm)[:nbytes]

    def array(self) -> np.ndarray:
        """The whole buffer as a writable ``uint8`` array (no copy)."""
        return np.frombuffer(self.view, dtype=np.uint8)

    @property
    def closed(self) -> bool:
        return self._mmap.closed

    def _unmap(self) -> None:
        if self._mmap.closed:
            return
        try:
            self.view.release()
            self._mmap.close()
        except BufferError:
            # Someone still holds an array or view of the buffer; unmapping now would crash them.
            # The mapping (and its descriptor) goes when the last of those views is collected.
            log.debug("buffer of %d bytes still exported at close; unmapping on collection", self.nbytes)


class HostBuffer(_Mapped):
    """Anonymous, page-aligned host memory (the source pools of writers).

    Args:
        nbytes: size; rounded up to whole pages.
    """

    def __init__(self, nbytes: int) -> None:
        _check_size(nbytes)
        try:
            mm = mmap.mmap(-1, round_up(nbytes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except OSError as exc:
            raise CapacityError(f"cannot map {nbytes} bytes of host memory: {exc}") from exc
        super().__init__(mm, nbytes)

    def close(self) -> None:
        """Unmap the buffer (deferred while views of it are alive)."""
        self._unmap()

    def __enter__(self) -> HostBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MemfdSegment(_Mapped):
    """A sealed memfd mapped shared: a receive ring that other processes can map by descriptor.

    Create one with :meth:`create`; map one received from a peer with :meth:`attach`.
    """

    def __init__(self, fd: int, nbytes: int, mm: mmap.mmap) -> None:
        super().__init__(mm, nbytes)
        self.fd = fd

    @classmethod
    def create(cls, nbytes: int, purpose: str = "ring") -> MemfdSegment:
        """Create, size, seal and map a new segment of ``nbytes`` (rounded up to whole pages)."""
        _check_size(nbytes)
        size = round_up(nbytes)
        fd = os.memfd_create(segment_name(purpose), os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            # Allocate every page now: a shortage is an error here, not a SIGBUS in a writer later.
            os.posix_fallocate(fd, 0, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _REQUIRED_SEALS)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE)
        except OSError as exc:
            os.close(fd)
            raise CapacityError(f"cannot create a shared segment of {size} bytes: {exc}") from exc
        return cls(fd, nbytes, mm)

    @classmethod
    def attach(cls, fd: int, nbytes: int) -> MemfdSegment:
        """Map a segment received from a peer; takes ownership of ``fd``.

        Raises:
            TransportError: the descriptor is not a sealed segment of at least ``nbytes``.
        """
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            size = os.fstat(fd).st_size
            if seals & _REQUIRED_SEALS != _REQUIRED_SEALS:
                raise TransportError("peer's segment is not sealed against resizing; refusing to map it")
            if nbytes <= 0 or size < nbytes:
                raise TransportError(f"peer's segment holds {size} bytes, fewer than the {nbytes} announced")
            mm = mmap.mmap(fd, round_up(nbytes), flags=mmap.MAP_SHARED | _POPULATE)
        except OSError as exc:
            os.close(fd)
            raise TransportError(f"cannot map the peer's segment: {exc}") from exc
        except TransportError:
            os.close(fd)
            raise
        return cls(fd, nbytes, mm)

    def close(self) -> None:
        """Unmap and close the descriptor; the memory is freed once no process maps it."""
        self._unmap()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> MemfdSegment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
