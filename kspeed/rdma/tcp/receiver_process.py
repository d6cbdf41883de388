"""The ``tcp`` receiver process: TCP payloads straight into consumers' shared rings.

Started by :class:`kspeed.rdma.tcp.TcpReceiver` as ``python -m kspeed.rdma.tcp.receiver_process
CONFIG_JSON``; this process runs :class:`TcpReceiverProcess`. Consumers, handshakes, messages and the
loop are the receiver processes' shared skeleton (:mod:`kspeed.rdma.receiver_process_base`); what is
``tcp``'s own is here. A writer dials twice, once for bulk data and once for messages (the message
connection names the bulk one it belongs to, so messages never wait behind bulk bytes). On a bulk
connection the loop ``recvmsg_into``s each payload at its offset in the ring together with the
header that follows it (one syscall per write), checks every header against the region before a
byte lands, and queues the write's immediate for its consumer.
"""

from __future__ import annotations

import json
import logging
import selectors
import socket
import sys
import time
from typing import Any

from kspeed.rdma import framing
from kspeed.rdma.memory import MemfdSegment
from kspeed.rdma.receiver_process_base import Consumer, ReceiverProcessBase, WriterLink

from . import wire

log = logging.getLogger(__name__)

_READ_BUDGET = 16 << 20  # bytes read from one connection before serving the others


class _Bulk(WriterLink[MemfdSegment]):
    """One writer: its bulk connection, where a write stands, and (once dialed) its message connection.

    Args:
        sock: the bulk connection (non-blocking).
        consumer: the consumer it writes for.
        conn: its connection id.
        origin: the dialer's address.
    """

    def __init__(self, sock: socket.socket, consumer: Consumer[MemfdSegment], conn: int, origin: str) -> None:
        super().__init__(consumer, conn, origin, None)
        self.sock = sock
        self.hdr = bytearray(wire.WRITE_HEADER.size)
        self.hdr_view = memoryview(self.hdr)
        self.hdr_got = 0
        self.dst: memoryview | None = None  # the rest of the write in progress, in its ring
        self.got = 0
        self.imm: int | None = None
        self.last = time.monotonic()


class TcpReceiverProcess(ReceiverProcessBase[MemfdSegment, _Bulk]):
    """The loop of the ``tcp`` receiver process."""

    rail = "tcp"

    # ----------------------------------------------------------------------------------- consumers

    def _open_region(self, c: Consumer[MemfdSegment], desc: dict[str, Any]) -> MemfdSegment:
        return self._attach_memfd(c, desc)

    # ------------------------------------------------------------------------------------- writers

    def _authenticate(self, sock: socket.socket, addr: tuple) -> tuple[Consumer[MemfdSegment], tuple]:
        """Read the hello and authenticate the dialer.

        Returns:
            The consumer, and the connection's role and (for a message connection) the bulk
            connection it belongs to.

        Raises:
            KSpeedError, OSError, struct.error: the dialer is refused (the caller closes it).
        """
        hello = self._read_hello(sock, wire.HELLO.size, "tcp hello")
        magic, role, cid, conn = wire.HELLO.unpack(hello)
        known = magic == wire.MAGIC and role in (wire.BULK, wire.MESSAGES)
        consumer = self._accept_hello(sock, addr, hello, cid, known)
        wire.tune(sock, self.options, nodelay=role == wire.MESSAGES)
        return consumer, (role, conn)

    def _admit_writer(self, sock: socket.socket, consumer: Consumer[MemfdSegment], origin: str, details: tuple) -> None:
        role, conn = details
        sock.setblocking(False)
        if role == wire.BULK:
            # Numbered and welcomed here, once it is known: its message connection names it.
            conn = next(self.conns)
            try:
                sock.send(framing.frame(framing.WELCOME, json.dumps({"conn": conn}).encode()))
            except OSError as exc:  # (a fresh socket's buffer takes a few bytes: it left)
                log.warning("tcp writer from %s left before its welcome: %s", origin, exc)
                sock.close()
                return
            bulk = _Bulk(sock, consumer, conn, origin)
            self.sel.register(sock, selectors.EVENT_READ, bulk)
            self._add_writer(bulk)
        else:
            owner = self.writers.get(conn)
            if owner is None or owner.consumer is not consumer or owner.msg_sock is not None:
                sock.close()
                return
            owner.msg_sock = sock
            self.sel.register(sock, selectors.EVENT_READ, ("msg", owner))

    def _messages_ended(self, bulk: _Bulk) -> None:
        msg_sock = bulk.msg_sock
        if msg_sock is None or bulk.conn not in self.writers:
            return
        # A closing writer's bulk bytes (and its bye) may still be queued behind this EOF: only
        # the bulk connection ends the writer, so its last completions are never lost.
        self.sel.unregister(msg_sock)
        msg_sock.close()
        bulk.msg_sock = None
        bulk.msg_out.clear()  # nobody left to read them
        bulk.msg_stalled_since = None

    def _release_writer(self, bulk: _Bulk) -> None:
        for sock in (bulk.sock, bulk.msg_sock):
            if sock is not None:
                self.sel.unregister(sock)
                sock.close()
        if bulk.dst is not None:
            bulk.dst.release()

    # ------------------------------------------------------------------------------------ bulk data

    def _readable(self, data: object) -> None:
        if not isinstance(data, _Bulk):
            super()._readable(data)
        elif data.conn in self.writers:
            self._bulk_readable(data)

    def _bulk_readable(self, bulk: _Bulk) -> None:
        sock = bulk.sock
        budget = _READ_BUDGET
        try:
            while budget > 0:
                if bulk.dst is None:
                    n = sock.recv_into(bulk.hdr_view[bulk.hdr_got :])
                    if n == 0:
                        self._drop_writer(bulk, "writer closed the connection without saying bye")
                        return
                    bulk.hdr_got += n
                    bulk.last = time.monotonic()
                    if bulk.hdr_got < wire.WRITE_HEADER.size:
                        continue
                    if not self._start_write(bulk):
                        return
                else:
                    # The rest of the payload and the next header in one syscall.
                    remaining = len(bulk.dst) - bulk.got
                    n = sock.recvmsg_into([bulk.dst[bulk.got :], bulk.hdr_view])[0]
                    if n == 0:
                        self._drop_writer(bulk, "writer closed the connection in the middle of a write")
                        return
                    budget -= n
                    bulk.last = time.monotonic()
                    if n < remaining:
                        bulk.got += n
                        continue
                    bulk.got += remaining
                    bulk.hdr_got = n - remaining
                    self._finish_write(bulk)
                    if bulk.hdr_got == wire.WRITE_HEADER.size and not self._start_write(bulk):
                        return
        except BlockingIOError:
            return
        except OSError as exc:
            self._drop_writer(bulk, f"bulk connection failed: {exc}")

    def _start_write(self, bulk: _Bulk) -> bool:
        kind, flags, handle, imm, offset, length = wire.WRITE_HEADER.unpack(bulk.hdr)
        bulk.hdr_got = 0
        if kind == wire.DATA_BYE:
            self._drop_writer(bulk, None)
            return False
        region = bulk.consumer.regions.get(handle)
        if kind != wire.DATA or region is None or offset + length > region.nbytes:
            size = None if region is None else region.nbytes
            self._drop_writer(
                bulk, f"refused write of {length} bytes at offset {offset} of region {handle} (size {size})"
            )
            return False
        bulk.imm = imm if flags & wire.FLAG_IMM else None
        bulk.got = 0
        bulk.dst = region.view[offset : offset + length]
        if length == 0:
            self._finish_write(bulk)
        return True

    def _finish_write(self, bulk: _Bulk) -> None:
        if bulk.dst is not None:
            bulk.dst.release()
        bulk.dst = None
        if bulk.imm is not None:
            bulk.consumer.pending.append(bulk.conn)
            bulk.consumer.pending.append(bulk.imm)

    def _stall(self, bulk: _Bulk, now: float, limit: float) -> str | None:
        if (bulk.dst is not None or bulk.hdr_got) and now - bulk.last > limit:
            return f"writer stalled mid-write for more than {limit} s"
        return super()._stall(bulk, now, limit)


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m kspeed.rdma.tcp.receiver_process CONFIG_JSON``; prints ``ready PORT``."""
    return TcpReceiverProcess.main(argv)


if __name__ == "__main__":
    sys.exit(main())
