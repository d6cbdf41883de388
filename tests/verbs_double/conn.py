"""Non-blocking stream connections between simulated NICs, and the requester's end of one.

A :class:`Connection` owns a socket registered with its port's selector and a queue of buffers to
send; ``flush()`` sends as much as the socket takes in one ``sendmsg`` per up to ``IOV_LIMIT``
buffers and asks for write readiness when it could not send everything. Buffers may be views of
registered memory (a requester's payload, read when the kernel copies it, i.e. at transmit time);
when an MR is deregistered while some of its bytes wait in the queue, they are replaced with zeros
and their WR is marked ``IBV_WC_LOC_PROT_ERR`` (the NIC never touches deregistered memory).

:class:`OutboundConn` is a requester QP's connection to the responder's NIC: it reads the
responses (ACK/NAK/DROP) and hands them to the QP's :class:`~.requester.Requester`. All methods
run in the NIC thread with the port's lock held.
"""

from __future__ import annotations

import selectors
import socket
import time
from typing import TYPE_CHECKING, Any

from .base import e
from .requester import IOV_LIMIT
from .wire import RESPONSE

if TYPE_CHECKING:
    from .nic import Port
    from .requester import Requester

__all__ = ["Connection", "OutboundConn"]

_LOC_PROT = int(e.IBV_WC_LOC_PROT_ERR)
SOCKET_BUFFER = 4 << 20


def configure(sock: socket.socket) -> None:
    """Non-blocking, with socket buffers large enough for MiB-sized writes to stream."""
    sock.setblocking(False)
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)


class Connection:
    """A socket of the fabric with a send queue (see the module's docstring)."""

    def __init__(self, port: Port, sock: socket.socket) -> None:
        self.port = port
        self.sock = sock
        self.out: list[Any] = []
        self.refs: list[Any] = []  # per buffer: None, or (MR, WorkRequest) for registered memory
        self.dead = False
        self.reading = True
        self.writing = False
        self.checked_generation = port.mr_generation
        port.selector.register(sock, selectors.EVENT_READ, self.on_event)
        self.registered = True

    def on_event(self, mask: int) -> None:
        raise NotImplementedError

    def queue(self, bufs: list[Any], refs: list[Any] | None = None) -> None:
        self.out.extend(bufs)
        self.refs.extend(refs if refs is not None else [None] * len(bufs))

    def flush(self) -> bool:
        """Send what the socket takes now; ``True`` when nothing is left to send."""
        out, refs = self.out, self.refs
        while out and not self.dead:
            if self.checked_generation != self.port.mr_generation:
                self._scrub()
            chunk = out[:IOV_LIMIT]
            try:
                sent = self.sock.sendmsg(chunk)
            except (BlockingIOError, InterruptedError):
                self._want_write(True)
                return False
            except OSError:
                self.port.connection_failed(self)
                return False
            done = 0
            for buf in chunk:
                size = len(buf)
                if sent < size:
                    break
                sent -= size
                done += 1
            if sent:
                out[done] = memoryview(out[done])[sent:]
            del out[:done]
            del refs[:done]
        self._want_write(False)
        return not out

    def _scrub(self) -> None:
        """Replace queued bytes of deregistered MRs with zeros; their WRs fail ``IBV_WC_LOC_PROT_ERR``."""
        self.checked_generation = self.port.mr_generation
        for i, ref in enumerate(self.refs):
            if ref is not None and not ref[0].live:
                self.out[i] = bytes(len(self.out[i]))
                self.refs[i] = None
                ref[1].error = _LOC_PROT

    def _want_write(self, flag: bool) -> None:
        if flag != self.writing:
            self.writing = flag
            self._apply_interest()

    def set_reading(self, flag: bool) -> None:
        """Watch the socket for input, or leave it alone (a held connection)."""
        if flag != self.reading:
            self.reading = flag
            self._apply_interest()

    def _apply_interest(self) -> None:
        if self.dead:
            return
        events = (selectors.EVENT_READ if self.reading else 0) | (selectors.EVENT_WRITE if self.writing else 0)
        selector = self.port.selector
        if not events:
            if self.registered:
                selector.unregister(self.sock)
                self.registered = False
        elif self.registered:
            selector.modify(self.sock, events, self.on_event)
        else:
            selector.register(self.sock, events, self.on_event)
            self.registered = True

    def discard(self) -> None:
        """Forget the queue; the port closes the socket in its thread."""
        self.out.clear()
        self.refs.clear()
        self.dead = True


class OutboundConn(Connection):
    """A requester QP's connection to the NIC of its destination GID."""

    def __init__(self, port: Port, sock: socket.socket, requester: Requester) -> None:
        super().__init__(port, sock)
        self.requester: Requester | None = requester
        self.pending = b""

    def on_event(self, mask: int) -> None:
        if mask & selectors.EVENT_READ:
            self._read_responses()
        if mask & selectors.EVENT_WRITE and not self.dead and self.flush() and self.requester is not None:
            self.requester.transmit(time.monotonic())

    def _read_responses(self) -> None:
        try:
            data = self.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self.port.connection_failed(self)
            return
        data = self.pending + data
        whole = len(data) - len(data) % RESPONSE.size
        self.pending = data[whole:]
        now = time.monotonic()
        for kind, rnr_code, _qpn, psn, gen in RESPONSE.iter_unpack(data[:whole]):
            if self.requester is None or self.dead:
                return
            self.requester.on_response(kind, rnr_code, psn, gen, now)
