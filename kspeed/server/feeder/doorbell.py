"""One poller for the idle feeds of a feeder process: a feed waiting for grants costs no CPU.

An idle feed thread would otherwise wake every fraction of a second to look at its connection (and
to notice it was closed): with 512 ranks on a server that is a thousand wake-ups a second, most of
a core on a small machine. Instead the feed asks the doorbell to watch its connection's descriptor
(:meth:`Writer.fileno <kspeed.rdma.base.Writer.fileno>`) and sleeps on an event; one thread per
feeder process waits on every watched descriptor with ``epoll`` and sets the event of each that
turns readable (a message, or the client's end). A watch fires once (``EPOLLONESHOT``): the feed
reads its connection itself and asks again when it is idle again. Whoever closes a feed sets its
event too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading

__all__ = ["Doorbell"]

log = logging.getLogger(__name__)

_ONCE = select.EPOLLIN | select.EPOLLONESHOT


class Doorbell:
    """Sets a feed's event when its descriptor turns readable; one thread, started at the first watch."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bells: dict[int, threading.Event] = {}
        self._epoll: select.epoll | None = None
        self._wake = -1  # an eventfd that ends the thread's wait at close
        self._thread: threading.Thread | None = None
        self._closed = False

    def watch(self, fd: int, bell: threading.Event) -> None:
        """Set ``bell`` once ``fd`` is readable (at once if it is already); one time per call."""
        with self._lock:
            if self._closed:
                bell.set()  # nothing watches any more: the feed looks for itself
                return
            if self._epoll is None:
                self._start()
            assert self._epoll is not None
            known = self._bells.get(fd)
            self._bells[fd] = bell
            try:
                if known is None:
                    try:
                        self._epoll.register(fd, _ONCE)
                    except FileExistsError:  # (a descriptor closed unforgotten, its number reused)
                        self._epoll.modify(fd, _ONCE)
                else:
                    self._epoll.modify(fd, _ONCE)
            except OSError as exc:  # (a descriptor already closed): the feed finds out by reading it
                log.debug("doorbell: cannot watch descriptor %d: %s", fd, exc)
                self._bells.pop(fd, None)
                bell.set()

    def forget(self, fd: int) -> None:
        """Stop watching ``fd``; call before the descriptor is closed (its number may be reused)."""
        with self._lock:
            if self._bells.pop(fd, None) is not None and self._epoll is not None:
                with contextlib.suppress(OSError):
                    self._epoll.unregister(fd)

    @property
    def watched(self) -> int:
        return len(self._bells)

    def close(self) -> None:
        """Stop the thread; every feed still waiting is woken (and later watches ring at once)."""
        with self._lock:
            self._closed = True
            thread, bells = self._thread, list(self._bells.values())
            if self._wake >= 0:
                os.eventfd_write(self._wake, 1)
        if thread is not None:
            thread.join()
        with self._lock:
            if self._epoll is not None:
                self._epoll.close()
                os.close(self._wake)
                self._epoll, self._wake = None, -1
            self._bells.clear()
        for bell in bells:
            bell.set()

    def _start(self) -> None:
        self._epoll = select.epoll()
        self._wake = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._epoll.register(self._wake, select.EPOLLIN)
        self._thread = threading.Thread(target=self._run, args=(self._epoll, self._wake), name="doorbell", daemon=True)
        self._thread.start()

    def _run(self, epoll: select.epoll, wake: int) -> None:
        while True:
            try:
                ready = epoll.poll()
            except InterruptedError:
                continue
            with self._lock:
                if self._closed:
                    return
                for fd, _events in ready:
                    bell = self._bells.get(fd)
                    if bell is not None:
                        bell.set()
