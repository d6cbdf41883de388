"""Giving the heap memory a burst of large temporaries freed back to the operating system.

glibc's malloc keeps what a process frees for reuse and returns to the system only the free
memory at the top of each heap; after a burst of temporaries a few megabytes each (a listing
parsed, a plan's chunks decoded, its places worked out), most of what they took stays resident
though nothing uses it: measured, 600 MB of a server's 1.3 GB after registering a dataset of 10
million samples, and as much again after its first plan. :func:`trim_later` asks glibc to return
it (``malloc_trim``) a moment later, once the call that made the burst has let go of it; with
another C library it does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable

__all__ = ["TRIM_DELAY_S", "Trimmer", "trim", "trim_later"]

#: A trim asked for waits this long (the caller's own temporaries are freed when it returns), and
#: the requests meanwhile share it.
TRIM_DELAY_S = 1.0


@functools.cache
def malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or ``None`` with another C library."""
    try:
        function = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_size_t]
    function.restype = ctypes.c_int
    return function


class Trimmer:
    """Calls ``function(0)`` (``malloc_trim``) now or a moment after it is asked to, once for the
    requests meanwhile.

    Args:
        function: what trims (nothing is done without one).
        delay: seconds a :meth:`later` waits.
    """

    def __init__(self, function: Callable[[int], object] | None, delay: float = TRIM_DELAY_S) -> None:
        self._function = function
        self._delay = delay
        self._lock = threading.Lock()
        self._pending: threading.Timer | None = None

    def now(self) -> None:
        """Trim now."""
        with self._lock:
            self._pending = None
        if self._function is not None:
            self._function(0)

    def later(self) -> None:
        """Trim in ``delay`` seconds, on a timer thread, unless a trim is pending already."""
        if self._function is None:
            return
        with self._lock:
            if self._pending is not None:
                return
            self._pending = threading.Timer(self._delay, self.now)
            self._pending.name = "kspeed-heap-trim"
            self._pending.daemon = True
            self._pending.start()


@functools.cache
def _trimmer() -> Trimmer:
    return Trimmer(malloc_trim())


def trim() -> None:
    """Return the free heap memory to the system now (nothing without glibc)."""
    _trimmer().now()


def trim_later() -> None:
    """:func:`trim` in :data:`TRIM_DELAY_S` seconds (one trim for the requests meanwhile)."""
    _trimmer().later()
