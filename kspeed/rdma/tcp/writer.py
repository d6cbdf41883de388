"""Writer side of the ``tcp`` rail: header + gathered slices per write, messages on a second socket.

Each write is one ``sendmsg`` of a 32-byte header followed by the source slices as an iovec list
(no copy in Python); ``write_many`` and ``write_batch`` pack a whole batch into as few ``sendmsg``
calls as ``IOV_MAX`` allows. Small messages use a second connection with ``TCP_NODELAY``, so they
never wait behind bulk bytes (:mod:`kspeed.rdma.tcp.wire`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import socket
import time
from collections import deque
from collections.abc import Iterable

import numpy as np

from kspeed.errors import TransportError
from kspeed.rdma import auth, framing
from kspeed.rdma.base import RegionKey, Sources, WriteOp, Writer, as_bytes_view, check_imm, check_range
from kspeed.rdma.options import RailOptions
from kspeed.rdma.write_batch import WriteBatch

from . import wire

__all__ = ["TcpWriter"]

log = logging.getLogger(__name__)

_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


class TcpWriter(Writer):
    """Writer side of the ``tcp`` rail: header + gathered slices per write."""

    rail = "tcp"

    def __init__(self, material: bytes, options: RailOptions) -> None:
        info, key = auth.open_material(material, "tcp", ("host", "port", "consumer"), options.token)
        try:
            host, port, consumer = str(info["host"]), int(info["port"]), int(info["consumer"])
        except (ValueError, TypeError) as exc:
            raise TransportError(f"malformed tcp connection material: {exc}") from exc
        self._options = options
        options.check_dial(host, port)
        self._msg_reader = framing.FrameReader(1 << 16)
        self._messages: deque[bytes] = deque()
        self.conn = 0
        self._bulk = self._dial(host, port, key, wire.BULK, consumer, 0)
        self._msg: socket.socket | None = None
        with framing.connecting(f"tcp receiver {host}:{port}", self.close):
            reader = framing.FrameReader(4096)
            welcome = None
            while welcome is None:
                if reader.recv(self._bulk) == 0:
                    raise framing.lost("tcp receiver closed the connection during setup")
                for kind, payload in reader.frames():
                    if kind == framing.WELCOME:
                        welcome = json.loads(payload)
            self.conn = int(welcome["conn"])
            self._msg = self._dial(host, port, key, wire.MESSAGES, consumer, self.conn)
        wire.blocking_with_timeout(self._bulk, options.io_timeout)
        self._msg.settimeout(options.io_timeout)

    def _dial(self, host: str, port: int, key: bytes, role: int, consumer: int, conn: int) -> socket.socket:
        hello = wire.HELLO.pack(wire.MAGIC, role, consumer, conn)
        what = f"tcp receiver {host}:{port}"
        return wire.dial((host, port), self._options, hello, key, what=what, nodelay=role == wire.MESSAGES)

    def _sendmsg(self, bufs: list) -> None:
        """Send all of ``bufs`` (an iovec list), resuming after partial sends."""
        sock = self._bulk
        try:
            while bufs:
                chunk = bufs[:_IOV_MAX]
                sent = sock.sendmsg(chunk)
                total = sum(len(b) for b in chunk) if len(chunk) > 1 else len(chunk[0])
                if sent == total:
                    bufs = bufs[_IOV_MAX:]
                    continue
                rest = []
                for i, b in enumerate(chunk):
                    n = len(b)
                    if sent >= n:
                        sent -= n
                        continue
                    rest.append(memoryview(b)[sent:])
                    rest.extend(chunk[i + 1 :])
                    break
                bufs = rest + bufs[_IOV_MAX:]
        except OSError as exc:
            raise framing.lost("writing to tcp receiver", exc, self.conn) from exc

    def write(self, key: RegionKey, srcs: Sources, offset: int = 0, imm: int | None = None) -> None:
        self.write_many(key, [(srcs, offset, imm)])

    def write_many(self, key: RegionKey, ops: Iterable[WriteOp]) -> None:
        bufs: list = []
        pack = wire.WRITE_HEADER.pack
        for srcs, offset, imm in ops:
            check_imm(imm)
            if isinstance(srcs, (list, tuple)):
                views = [as_bytes_view(s) for s in srcs]
                nbytes = sum(v.nbytes for v in views)
            else:
                views = [as_bytes_view(srcs)]
                nbytes = views[0].nbytes
            check_range(key, offset, nbytes)
            flags = 0 if imm is None else wire.FLAG_IMM
            bufs.append(pack(wire.DATA, flags, key.handle, imm or 0, key.addr + offset, nbytes))
            bufs.extend(views)
        self._sendmsg(bufs)

    def write_checked(self, key: RegionKey, source: np.ndarray, batch: WriteBatch) -> None:
        bufs = wire.batch_buffers(key, source.data, batch)
        if bufs:
            self._sendmsg(bufs)

    def _message_socket(self) -> socket.socket:
        if self._msg is None:
            raise framing.lost("the tcp writer's message connection is closed", None, self.conn)
        return self._msg

    def send(self, message: bytes) -> None:
        framing.check_message(message)
        try:
            self._message_socket().sendall(framing.frame(framing.MSG, message))
        except OSError as exc:
            raise framing.lost("sending to tcp receiver", exc, self.conn) from exc

    def recv(self, timeout: float | None = 0.0) -> bytes | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        sock = self._message_socket()
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        while not self._messages:  # a part of a frame is not a message: wait on for the rest
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if poller.poll(None if remaining is None else remaining * 1e3):
                try:
                    n = self._msg_reader.recv(sock, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    n = -1
                except OSError as exc:
                    raise framing.lost("reading from tcp receiver", exc, self.conn) from exc
                for kind, payload in self._msg_reader.frames():
                    if kind == framing.MSG:
                        self._messages.append(payload)
                if n == 0:
                    raise framing.lost("tcp receiver closed the message connection", None, self.conn)
            if remaining == 0:
                break
        return self._messages.popleft() if self._messages else None

    def fileno(self) -> int:
        return self._message_socket().fileno()

    def interrupt(self) -> None:
        for sock in (getattr(self, "_bulk", None), self._msg):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        bulk = getattr(self, "_bulk", None)
        if bulk is not None and bulk.fileno() >= 0:
            with contextlib.suppress(OSError):
                bulk.send(wire.WRITE_HEADER.pack(wire.DATA_BYE, 0, 0, 0, 0, 0), socket.MSG_DONTWAIT)
            bulk.close()
        if self._msg is not None:
            self._msg.close()
