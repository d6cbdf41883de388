"""Framing shared by the rails' Unix and TCP control sockets, and conversion of socket errors.

A frame is ``<type: u32><length: u32><payload>``. Readers pull whatever the socket has into one
buffer and split all complete frames at once, so many completions cost one syscall.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import struct
import time
from collections import deque
from collections.abc import Callable, Iterator

from kspeed.errors import KSpeedError, PeerLostError, TransportError

from .base import MAX_MESSAGE

__all__ = ["HEADER", "FrameReader", "check_peer_uid", "frame", "lost", "peer_uid", "readable", "send_draining"]

HEADER = struct.Struct("<II")
#: Largest frame accepted: a message, or a batch of completions.
MAX_FRAME = max(MAX_MESSAGE + 64, 8 << 20)

# Frame types.
IMMS = 1  # payload: u32 immediates (shm writer -> receiver) or (u32 conn, u32 imm) pairs (tcp)
MSG = 2  # payload: message bytes (prefixed with a u32 conn where several writers share a socket)
BYE = 3  # orderly close
REGION = 4  # payload: json region description; one descriptor attached where the rail passes fds
WELCOME = 5  # payload: json with the connection id and limits
LOST = 6  # payload: u32 conn + utf-8 reason
ERROR = 7  # payload: utf-8 reason
CALL = 8  # payload: json request on a control socket
REPLY = 9  # payload: json reply on a control socket


def frame(kind: int, payload: bytes = b"") -> bytes:
    """Encode one frame."""
    return HEADER.pack(kind, len(payload)) + payload


def readable(sock: socket.socket, timeout: float | None = 0.0) -> bool:
    """Whether ``sock`` has bytes (or an end) to read, waiting up to ``timeout`` seconds for them
    (``None``: until it has; poll: any descriptor number)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(None if timeout is None else timeout * 1e3))


class OneSocket:
    """``fileno`` and ``interrupt`` of a writer whose one socket carries its messages (shm, verbs)."""

    _sock: socket.socket

    def fileno(self) -> int:
        return self._sock.fileno()

    def interrupt(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)


def check_message(message: bytes) -> None:
    """Refuse a message larger than :data:`~kspeed.rdma.base.MAX_MESSAGE` (every rail's ``send``).

    Raises:
        TransportError: the message is too large (nothing was sent).
    """
    if len(message) > MAX_MESSAGE:
        raise TransportError(f"message of {len(message)} bytes exceeds {MAX_MESSAGE}")


def send_draining(sock: socket.socket, data: bytes, timeout: float, drain: Callable[[], object]) -> None:
    """Send all of ``data``, taking in what the peer sends (``drain``) while its buffer is full.

    Both ends of a rail's socket send (grants one way, completions the other) and each has one
    thread that both sends and reads. A plain ``sendall`` on each side could wait for the other
    forever once both buffers fill; a sender that keeps reading while it waits cannot.

    The timeout is the peer's: it is over only when a poll made after the deadline still finds
    the socket full. A pause of this process (a long ``drain``, a garbage collection that joins a
    DataLoader's workers, a starved thread) is not taken for a peer that stopped reading.

    Raises:
        TimeoutError: no byte could be sent for ``timeout`` seconds.
        OSError: the socket failed (the caller names it with :func:`lost`).
    """
    view = memoryview(data)
    deadline = time.monotonic() + timeout
    poller = select.poll()  # (not select(): descriptors above 1023 are common on a busy server)
    poller.register(sock, select.POLLIN | select.POLLOUT)
    while view.nbytes:
        remaining = max(0.0, deadline - time.monotonic())
        events = 0
        for _, mask in poller.poll(remaining * 1e3):
            events |= mask
        if events & select.POLLIN:  # take in what came, even while sending goes on (a long send
            drain()  # must not look, to the other end, like a peer that stopped reading)
            if sock.fileno() < 0:
                raise ConnectionResetError("the connection was closed while sending")
        if events & (select.POLLOUT | select.POLLERR | select.POLLHUP):
            sent = sock.send(view)  # writable: some bytes go at once (an error is raised here)
            view = view[sent:]
            deadline = time.monotonic() + timeout
        elif remaining == 0:
            raise TimeoutError("no progress sending")


@contextlib.contextmanager
def connecting(what: str, close: Callable[[], object]) -> Iterator[None]:
    """Set up a connection to ``what``: on a failure, ``close`` what was opened, and an OS error
    becomes :class:`PeerLostError` naming ``what`` (our own errors pass as they are)."""
    try:
        yield
    except OSError as exc:
        close()
        raise lost(f"connecting to {what}", exc) from exc
    except KSpeedError:
        close()
        raise


def lost(what: str, exc: BaseException | None = None, conn: int | None = None) -> PeerLostError:
    """A PeerLostError naming the operation and the cause, with the connection id attached."""
    if isinstance(exc, TimeoutError):
        return PeerLostError(f"{what}: peer made no progress within the I/O timeout", conn=conn)
    if exc is not None:
        return PeerLostError(f"{what}: {exc}", conn=conn)
    return PeerLostError(what, conn=conn)


def peer_uid(sock: socket.socket) -> tuple[int, int]:
    """``(pid, uid)`` of the process at the other end of a Unix socket (SO_PEERCRED)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    return pid, uid


def check_peer_uid(sock: socket.socket, allowed: tuple[int, ...]) -> int:
    """Refuse a Unix-socket peer run by a user other than ours or ``allowed``; returns its pid."""
    from kspeed.errors import AuthError

    pid, uid = peer_uid(sock)
    if uid != os.getuid() and uid not in allowed:
        raise AuthError(f"Unix-socket peer pid {pid} runs as uid {uid}, not an allowed user")
    return pid


class FrameReader:
    """Accumulates bytes from a socket and yields complete frames."""

    def __init__(self, size: int = 1 << 20) -> None:
        self._buf = bytearray(size)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0
        self.fds: deque[int] = deque()

    def _make_room(self) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):
            pending = self._end - self._start
            if self._start > 0:
                self._buf[:pending] = self._buf[self._start : self._end]
                self._start, self._end = 0, pending
            if self._end == len(self._buf):
                self._view.release()
                self._buf.extend(bytes(len(self._buf)))
                self._view = memoryview(self._buf)

    def recv(self, sock: socket.socket, flags: int = 0) -> int:
        """One ``recv_into``; returns the bytes read (0 means the peer closed)."""
        self._make_room()
        n = sock.recv_into(self._view[self._end :], 0, flags)
        self._end += n
        return n

    def recv_with_fds(self, sock: socket.socket, maxfds: int = 4, flags: int = 0) -> int:
        """Like :meth:`recv`, keeping descriptors passed with SCM_RIGHTS in :attr:`fds`."""
        self._make_room()
        room = len(self._buf) - self._end
        data, fds, _flags, _addr = socket.recv_fds(sock, room, maxfds, flags)
        self._buf[self._end : self._end + len(data)] = data
        self._end += len(data)
        self.fds.extend(fds)
        return len(data)

    def frames(self) -> Iterator[tuple[int, bytes]]:
        """Complete frames read so far, as ``(type, payload)``."""
        buf = self._buf
        while self._end - self._start >= HEADER.size:
            kind, length = HEADER.unpack_from(buf, self._start)
            if length > MAX_FRAME:
                raise TransportError(f"peer sent a frame of {length} bytes, more than the {MAX_FRAME} allowed")
            begin = self._start + HEADER.size
            if self._end - begin < length:
                return
            self._start = begin + length
            yield kind, bytes(self._view[begin : begin + length])
