"""crc32c of pool memory, computed without holding the GIL for large buffers.

google-crc32c's extension releases the GIL only for ``bytes`` of at least 1 MiB, never for a
numpy view of a region, so with it the checksums of many preload threads run one at a time.
The library it bundles (``libcrc32c``) is called here through :mod:`ctypes` instead, which
releases the GIL for the call, for buffers of :data:`GIL_FREE_MIN` bytes or more; smaller ones
go through the extension (a ctypes call costs more than the checksum of a few KiB). If the
bundled library cannot be found, or disagrees with the extension on a test vector, everything
goes through the extension.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from pathlib import Path

import google_crc32c
import numpy as np

__all__ = ["GIL_FREE_MIN", "crc32c", "crc32c_extend"]

log = logging.getLogger(__name__)

#: Buffers at least this large are checksummed with the GIL released (measured crossover: below
#: it, the ctypes call and GIL hand-over cost more than they let other threads do).
GIL_FREE_MIN = 128 << 10


def _bundled_extend() -> Callable[..., int] | None:
    """``crc32c_extend`` of the library bundled with google-crc32c, or ``None``."""
    package = Path(google_crc32c.__file__).resolve().parent
    candidates = sorted(package.parent.glob("google_crc32c.libs/libcrc32c*.so*")) + sorted(
        package.glob("libcrc32c*.so*")
    )
    probe = np.frombuffer(bytes(range(256)) * 5, dtype=np.uint8)
    for path in candidates:
        try:
            fn = ctypes.CDLL(str(path)).crc32c_extend
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
        fn.restype = ctypes.c_uint32
        if fn(0, probe.ctypes.data, len(probe)) == google_crc32c.value(probe):
            return fn
    log.debug("no usable bundled libcrc32c next to %s; checksums hold the GIL", package)
    return None


_extend_nogil = _bundled_extend()


def crc32c_extend(crc: int, buf: np.ndarray) -> int:
    """crc32c of ``crc``'s data followed by the contiguous uint8 array ``buf``."""
    if _extend_nogil is not None and len(buf) >= GIL_FREE_MIN:
        return int(_extend_nogil(crc, buf.ctypes.data, len(buf)))
    return google_crc32c.extend(crc, buf)


def crc32c(buf: np.ndarray) -> int:
    """crc32c of the contiguous uint8 array ``buf`` (e.g. a slice of a region)."""
    if _extend_nogil is not None and len(buf) >= GIL_FREE_MIN:
        return int(_extend_nogil(0, buf.ctypes.data, len(buf)))
    return google_crc32c.value(buf)
