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

import numpy as np

from kspeed.rdma import auth, framing
from kspeed.rdma.base import RegionKey
from kspeed.rdma.options import RailOptions
from kspeed.rdma.write_batch import WriteBatch, runs

__all__ = [
    "BULK",
    "DATA",
    "DATA_BYE",
    "FLAG_IMM",
    "HEADER_DTYPE",
    "HELLO",
    "MAGIC",
    "MESSAGES",
    "WRITE_HEADER",
    "batch_buffers",
    "blocking_with_timeout",
    "tune",
]

MAGIC = b"KSPEEDTCP2"  # 2: the dialer proves itself first (kspeed.rdma.auth)
#: magic, role, consumer id, connection id (0 until the bulk connection was welcomed).
HELLO = struct.Struct("<10sBxII")
BULK = 1
MESSAGES = 2

#: kind, flags, region handle, immediate, offset in region, payload length.
WRITE_HEADER = struct.Struct("<HHIIQQ4x")
DATA = 1
DATA_BYE = 2
FLAG_IMM = 1
#: ``WRITE_HEADER`` as a numpy record, so a batch's headers are packed in one go.
HEADER_DTYPE = np.dtype(
    [
        ("kind", "<u2"),
        ("flags", "<u2"),
        ("handle", "<u4"),
        ("imm", "<u4"),
        ("offset", "<u8"),
        ("length", "<u8"),
        ("pad", "V4"),
    ]
)


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


def dial(
    address: tuple[str, int], options: RailOptions, hello: bytes, key: bytes, *, what: str, nodelay: bool
) -> socket.socket:
    """Connect to a receiver process, send ``hello`` and prove the key (tcp's and verbs' writers).

    Raises:
        PeerLostError: the connection failed (``what`` names the receiver).
        AuthError: the receiver refused the key.
    """
    try:
        sock = socket.create_connection(address, timeout=options.connect_timeout)
    except OSError as exc:
        raise framing.lost(f"connecting to {what}", exc) from exc
    with framing.connecting(what, sock.close):
        tune(sock, options, nodelay=nodelay)
        sock.sendall(hello)
        auth.dial(sock, key, hello)
    return sock


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


def batch_buffers(key: RegionKey, view: memoryview, batch: WriteBatch) -> list:
    """The iovec list of a checked batch: each run's header then its source slices, in order.

    One header per run of adjacent destinations, all packed by numpy at once. The first immediate
    rides on the last run; the others on zero-length writes after it, so every completion follows
    every byte of the batch.
    """
    first, dst, nbytes = runs(batch)
    nimm = len(batch.imms)
    with_imm = min(nimm, 1) if len(first) else 0
    headers = np.zeros(len(first) + nimm - with_imm, HEADER_DTYPE)
    headers["kind"] = DATA
    headers["handle"] = key.handle
    headers["offset"][: len(first)] = dst + key.addr
    headers["length"][: len(first)] = nbytes
    headers["offset"][len(first) :] = key.addr + (int(dst[-1] + nbytes[-1]) if len(first) else 0)
    if nimm:
        headers["flags"][len(first) - with_imm :] = FLAG_IMM
        headers["imm"][len(first) - with_imm :] = batch.imms
    hview = memoryview(headers.tobytes())
    size = WRITE_HEADER.size
    bufs: list = []
    append = bufs.append
    run_starts = [*first.tolist(), -1]
    r, next_start = 0, run_starts[0]
    for i, (a, b) in enumerate(zip(batch.src.tolist(), (batch.src + batch.lengths).tolist())):
        if i == next_start:
            append(hview[r * size : (r + 1) * size])
            r += 1
            next_start = run_starts[r]
        append(view[a:b])
    bufs.extend(hview[k * size : (k + 1) * size] for k in range(r, len(headers)))
    return bufs
