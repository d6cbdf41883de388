"""Wire constants of the ``tcp`` rail, shared by the writer and the receiver process.

A writer opens two TCP connections to the receiver process: a **bulk** one carrying write frames
(a 32-byte header then the payload) and a **message** one (``TCP_NODELAY``) carrying small
messages both ways, so a grant never waits behind megabytes of bulk data. Each connection starts
with a hello naming the consumer (the ring owner) it wants, then the mutual challenge-response.
"""

from __future__ import annotations

import math
import socket
import struct

from .options import RailOptions

__all__ = [
    "BULK", "DATA", "DATA_BYE", "FLAG_IMM", "HELLO", "MAGIC", "MESSAGES", "WRITE_HEADER",
    "blocking_with_timeout", "tune",
]

MAGIC = b"KSPEEDTCP1"
#: magic, role, consumer id, connection id (0 until the bulk connection was welcomed).
HELLO = struct.Struct("<10sBxII")
BULK = 1
MESSAGES = 2

#: kind, flags, region handle, immediate, offset in region, payload length.
WRITE_HEADER = struct.Struct("<HHIIQQ4x")
DATA = 1
DATA_BYE = 2
FLAG_IMM = 1


def tune(sock: socket.socket, options: RailOptions, nodelay: bool) -> None:
    """Apply keepalive, user timeout, buffer sizes and (for messages) TCP_NODELAY to a TCP socket.

    ``TCP_USER_TIMEOUT`` makes the kernel abort a connection whose sent data stays unacknowledged
    for ``io_timeout`` (a cut link), keepalive does the same for an idle one.
    """
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, max(1, math.ceil(options.keepalive_idle)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, max(1, math.ceil(options.keepalive_interval)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, options.keepalive_count)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1, int(options.io_timeout * 1000)))
    if nodelay:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if options.socket_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, options.socket_buffer)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, options.socket_buffer)


def blocking_with_timeout(sock: socket.socket, timeout: float) -> None:
    """Make ``sock`` blocking, with the kernel (not Python) enforcing ``timeout`` on each call.

    A Python socket timeout makes every ``sendmsg`` a ``poll`` plus a non-blocking send that stops
    whenever the send buffer is full, so a multi-MiB write becomes many partial sends and wake-ups.
    A blocking send with ``SO_SNDTIMEO`` stays in the kernel until the whole iovec is queued, and
    still returns (a short count, or ``EAGAIN``) after ``timeout`` seconds without progress.
    """
    sock.settimeout(None)
    tv = struct.pack("ll", int(timeout), int((timeout % 1) * 1_000_000))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
