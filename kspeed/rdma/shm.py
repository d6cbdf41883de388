"""The ``shm`` rail: writer and receiver on one host, writes are memcpy into a shared memfd ring.

The receiver listens on an abstract-namespace Unix socket (nothing on disk to leak), checks each
dialer's uid with SO_PEERCRED, authenticates it (``auth``), then passes its rings' memfds with
SCM_RIGHTS. The writer maps each ring once and copies source slices straight in (one copy per
slice); immediates follow as frames on the socket after the copies, so the ``send`` syscall orders
the bytes before the completion for the receiver on any CPU. ``write_many`` copies a whole batch
and sends all its immediates in one frame.

Fencing: :meth:`ShmReceiver.disconnect` stops a writer's completions and messages, but a mapping
cannot be revoked from another process; the owner must retire the ring (register a new one) before
granting its range to someone else.
"""

from __future__ import annotations

import array
import contextlib
import json
import logging
import os
import select
import selectors
import socket
import threading
import time
from collections import deque
from itertools import count

import numpy as np

from kspeed.errors import AuthError, KSpeedError, PeerLostError, RailUnavailableError, RangeError, TransportError

from . import _wire as w
from . import auth
from .base import (
    MAX_MESSAGE,
    Completions,
    Rail,
    Receiver,
    Region,
    RegionKey,
    Writer,
    as_bytes_view,
    check_imm,
    check_range,
)
from .memory import MemfdSegment
from .options import RailOptions

__all__ = ["ShmRail", "ShmReceiver", "ShmWriter"]

log = logging.getLogger(__name__)

_HELLO = b"KSPEED-SHM-v1\x00\x00\x00"


def _key_for(options: RailOptions, secret: bytes) -> bytes:
    return options.token if options.token is not None else secret


class ShmReceiver(Receiver):
    """Owns memfd rings and collects completions from writers on this host."""

    rail = "shm"

    def __init__(self, options: RailOptions) -> None:
        self._options = options
        self._node = socket.gethostname()
        self._secret = os.urandom(32)
        self._name = f"kspeed-shm-{os.getpid()}-{os.urandom(8).hex()}"
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self._listener.bind("\0" + self._name)
        self._listener.listen(64)
        self._lock = threading.Lock()
        self._regions: dict[int, Region] = {}
        self._handles = count(1)
        self._conn_ids = count(1)
        self._conns: dict[int, socket.socket] = {}
        self._readers: dict[int, w.FrameReader] = {}
        self._new: deque[tuple[int, socket.socket]] = deque()
        self._errors: deque[KSpeedError] = deque()
        self._messages: list[tuple[int, bytes]] = []
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._closed = False
        self._acceptor = threading.Thread(target=self._accept_loop, name="kspeed-shm-accept", daemon=True)
        self._acceptor.start()

    @property
    def material(self) -> bytes:
        secret = None if self._options.token is not None else self._secret.hex()
        return json.dumps({"rail": "shm", "node": self._node, "socket": self._name, "secret": secret}).encode()

    def register(self, nbytes: int) -> Region:
        segment = MemfdSegment.create(nbytes, "shm-ring")
        with self._lock:
            handle = next(self._handles)
            region = Region(RegionKey("shm", self._node, handle, 0, nbytes), segment)
            self._regions[handle] = region
            conns = list(self._conns.items())
        for conn, sock in conns:
            try:
                self._send_region(sock, region)
            except OSError as exc:
                self._drop(conn, w.lost(f"announcing region {handle} to writer {conn}", exc, conn))
        return region

    @staticmethod
    def _send_region(sock: socket.socket, region: Region) -> None:
        payload = json.dumps({"handle": region.key.handle, "length": region.key.length}).encode()
        socket.send_fds(sock, [w.frame(w.REGION, payload)], [region.memory.fd])

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # listener shut down by close()
            try:
                self._admit(sock)
            except (KSpeedError, OSError) as exc:
                log.warning("refused shm writer: %s", exc)
                sock.close()

    def _admit(self, sock: socket.socket) -> None:
        sock.settimeout(self._options.connect_timeout)
        pid = w.check_peer_uid(sock, self._options.allowed_uids)
        hello = auth.recv_exact(sock, len(_HELLO), "shm hello")
        if hello != _HELLO:
            raise TransportError(f"shm dialer pid {pid} sent an unknown hello {hello!r}")
        auth.accept(sock, _key_for(self._options, self._secret), hello)
        with self._lock:
            if self._closed:
                raise TransportError("receiver is closing")
            conn = next(self._conn_ids)
            for region in self._regions.values():
                self._send_region(sock, region)
            welcome = {"conn": conn, "node": self._node}
            sock.sendall(w.frame(w.WELCOME, json.dumps(welcome).encode()))
            sock.settimeout(self._options.io_timeout)
            self._conns[conn] = sock
            self._readers[conn] = w.FrameReader()
            self._new.append((conn, sock))
        self._wake_w.send(b"\0")
        log.info("shm writer %d connected (pid %d)", conn, pid)

    def _drop(self, conn: int, error: KSpeedError | None) -> None:
        with self._lock:
            sock = self._conns.pop(conn, None)
            self._readers.pop(conn, None)
        if sock is None:
            return
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(sock)
        sock.close()
        if error is not None:
            log.warning("shm writer %d lost: %s", conn, error)
            self._errors.append(error)

    def _read(self, conn: int, sock: socket.socket, parts: list[Completions]) -> None:
        reader = self._readers.get(conn)
        if reader is None:
            return
        try:
            n = reader.recv(sock, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError as exc:
            self._drop(conn, w.lost(f"shm writer {conn}", exc, conn))
            return
        try:
            for kind, payload in reader.frames():
                if kind == w.IMMS:
                    imm = np.frombuffer(payload, np.uint32)
                    parts.append(Completions(imm, np.full(len(imm), conn, np.uint32)))
                elif kind == w.MSG:
                    self._messages.append((conn, payload))
                elif kind == w.BYE:
                    self._drop(conn, None)
                    return
                else:
                    raise TransportError(f"shm writer {conn} sent unknown frame type {kind}")
        except TransportError as exc:
            self._drop(conn, w.lost(f"shm writer {conn} broke the protocol", exc, conn))
            return
        if n == 0:
            self._drop(conn, w.lost(f"shm writer {conn} closed the connection without saying bye", None, conn))

    def poll(self, timeout: float | None = 0.0) -> Completions:
        if self._errors:
            raise self._errors.popleft()
        parts: list[Completions] = []
        had_messages = len(self._messages)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            for key, _ in self._sel.select(remaining):
                if key.data is None:
                    self._register_new()
                else:
                    self._read(key.data, key.fileobj, parts)
            if parts or self._errors or len(self._messages) != had_messages or remaining == 0:
                break
        if not parts and self._errors:
            raise self._errors.popleft()
        return Completions.concat(parts)

    def _register_new(self) -> None:
        with contextlib.suppress(BlockingIOError):
            self._wake_r.recv(4096)
        while self._new:
            conn, sock = self._new.popleft()
            if conn in self._conns:
                self._sel.register(sock, selectors.EVENT_READ, conn)

    def messages(self) -> list[tuple[int, bytes]]:
        out, self._messages = self._messages, []
        return out

    def send(self, conn: int, message: bytes) -> None:
        if len(message) > MAX_MESSAGE:
            raise TransportError(f"message of {len(message)} bytes exceeds {MAX_MESSAGE}")
        sock = self._conns.get(conn)
        if sock is None:
            raise w.lost(f"no shm writer {conn} connected", None, conn)
        try:
            sock.sendall(w.frame(w.MSG, message))
        except OSError as exc:
            err = w.lost(f"sending to shm writer {conn}", exc, conn)
            self._drop(conn, None)
            raise err from exc

    @property
    def connections(self) -> frozenset[int]:
        return frozenset(self._conns)

    def disconnect(self, conn: int) -> None:
        self._drop(conn, None)

    def close(self) -> None:
        if self._closed:
            return
        with self._lock:
            self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._acceptor.join(self._options.connect_timeout + 1)
        self._listener.close()
        for conn in list(self._conns):
            self._drop(conn, None)
        for region in self._regions.values():
            region.close()
        self._regions.clear()
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()


class ShmWriter(Writer):
    """Maps a receiver's rings and copies into them; notifies immediates on the socket."""

    rail = "shm"

    def __init__(self, material: bytes, options: RailOptions) -> None:
        try:
            info = json.loads(material)
            name, node, secret = info["socket"], info["node"], info["secret"]
        except (ValueError, KeyError, TypeError) as exc:
            raise TransportError(f"malformed shm connection material: {exc}") from exc
        if info.get("rail") != "shm":
            raise TransportError(f"connection material is for rail {info.get('rail')!r}, not 'shm'")
        if node != socket.gethostname():
            raise RailUnavailableError(f"shm receiver lives on host {node!r}, not this one; use tcp or verbs")
        if options.token is not None:
            key = options.token
        elif secret is not None:
            key = bytes.fromhex(secret)
        else:
            raise AuthError("shm receiver expects the cluster token, but no token was configured")
        self._options = options
        self._maps: dict[int, MemfdSegment] = {}
        self._dst: dict[int, memoryview] = {}
        self._reader = w.FrameReader(1 << 16)
        self._messages: deque[bytes] = deque()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self._sock.settimeout(options.connect_timeout)
        try:
            self._sock.connect("\0" + name)
            w.check_peer_uid(self._sock, options.allowed_uids)
            self._sock.sendall(_HELLO)
            auth.dial(self._sock, key, _HELLO)
            welcome = None
            while welcome is None:
                welcome = self._pump(blocking=True, until_welcome=True)
        except OSError as exc:
            self._sock.close()
            raise w.lost(f"connecting to shm receiver {name}", exc) from exc
        except KSpeedError:
            self.close()
            raise
        self.conn = int(welcome["conn"])
        self._sock.settimeout(options.io_timeout)

    def _pump(self, blocking: bool, until_welcome: bool = False) -> dict | None:
        """Read what the receiver sent (regions, messages); returns the welcome when it comes."""
        if not blocking and not select.select([self._sock], [], [], 0)[0]:
            return None  # (a socket with a timeout ignores MSG_DONTWAIT, so ask select)
        try:
            n = self._reader.recv_with_fds(self._sock, 4)
        except BlockingIOError:
            return None
        except OSError as exc:
            raise w.lost("reading from shm receiver", exc, getattr(self, "conn", None)) from exc
        welcome = None
        for kind, payload in self._reader.frames():
            if kind == w.REGION:
                desc = json.loads(payload)
                if not self._reader.fds:
                    raise TransportError("shm receiver announced a region without its descriptor")
                segment = MemfdSegment.attach(self._reader.fds.popleft(), int(desc["length"]))
                self._maps[int(desc["handle"])] = segment
                self._dst[int(desc["handle"])] = segment.view
            elif kind == w.MSG:
                self._messages.append(payload)
            elif kind == w.WELCOME:
                welcome = json.loads(payload)
            else:
                raise TransportError(f"shm receiver sent unknown frame type {kind}")
        if n == 0 and welcome is None:
            raise w.lost("shm receiver closed the connection", None, getattr(self, "conn", None))
        return welcome if until_welcome else None

    def _target(self, key: RegionKey) -> memoryview:
        dst = self._dst.get(key.handle)
        if dst is None:
            self._pump(blocking=False)
            dst = self._dst.get(key.handle)
            if dst is None:
                raise RangeError(f"region {key.handle} is not exposed by this shm receiver")
        if key.addr + key.length > len(dst):
            raise RangeError(
                f"region key [{key.addr}, {key.addr + key.length}) exceeds region {key.handle} "
                f"of {len(dst)} bytes"
            )
        return dst

    def _notify(self, imms: bytes) -> None:
        try:
            self._sock.sendall(w.frame(w.IMMS, imms))
        except OSError as exc:
            raise w.lost("notifying shm receiver", exc, self.conn) from exc

    def write(self, key, srcs, offset=0, imm=None) -> None:
        dst = self._target(key)
        check_imm(imm)
        if isinstance(srcs, (list, tuple)):
            views = [as_bytes_view(s) for s in srcs]
            check_range(key, offset, sum(v.nbytes for v in views))
            pos = key.addr + offset
            for v in views:
                end = pos + v.nbytes
                dst[pos:end] = v
                pos = end
        else:
            v = as_bytes_view(srcs)
            check_range(key, offset, v.nbytes)
            pos = key.addr + offset
            dst[pos : pos + v.nbytes] = v
        if imm is not None:
            self._notify(imm.to_bytes(4, "little"))

    def write_many(self, key, ops) -> None:
        dst = self._target(key)
        base = key.addr
        limit = key.length
        copies: list[tuple[int, memoryview]] = []
        imms = array.array("I")
        try:
            for srcs, offset, imm in ops:
                kind = type(srcs)
                if kind is list or kind is tuple:
                    pos = base + offset
                    start = pos
                    for s in srcs:
                        v = as_bytes_view(s)
                        copies.append((pos, v))
                        pos += v.nbytes
                    nbytes = pos - start
                else:
                    v = srcs if kind is memoryview else memoryview(srcs)
                    if v.ndim != 1 or v.format != "B":
                        v = as_bytes_view(v)
                    nbytes = v.nbytes
                    copies.append((base + offset, v))
                if offset < 0 or offset + nbytes > limit:
                    check_range(key, offset, nbytes)
                if imm is not None:
                    imms.append(imm)
        except OverflowError as exc:
            raise TransportError(f"an immediate does not fit in 32 bits: {exc}") from exc
        for pos, v in copies:
            dst[pos : pos + len(v)] = v
        for i in range(0, len(imms), 1 << 20):  # frames stay under the reader's limit
            self._notify(imms[i : i + (1 << 20)].tobytes())

    def send(self, message: bytes) -> None:
        if len(message) > MAX_MESSAGE:
            raise TransportError(f"message of {len(message)} bytes exceeds {MAX_MESSAGE}")
        try:
            self._sock.sendall(w.frame(w.MSG, message))
        except OSError as exc:
            raise w.lost("sending to shm receiver", exc, self.conn) from exc

    def recv(self, timeout: float | None = 0.0) -> bytes | None:
        if not self._messages:
            self._pump(blocking=False)
        if not self._messages and timeout != 0:
            self._sock.settimeout(timeout)
            try:
                self._pump(blocking=True)
            except PeerLostError as exc:
                if not isinstance(exc.__cause__, TimeoutError):
                    raise
            finally:
                self._sock.settimeout(self._options.io_timeout)
        return self._messages.popleft() if self._messages else None

    def close(self) -> None:
        if self._sock.fileno() >= 0:
            with contextlib.suppress(OSError):
                self._sock.send(w.frame(w.BYE), socket.MSG_DONTWAIT)
            self._sock.close()
        for v in self._dst.values():
            v.release()
        self._dst.clear()
        for segment in self._maps.values():
            segment.close()
        self._maps.clear()
        for fd in self._reader.fds:
            os.close(fd)
        self._reader.fds.clear()


class ShmRail(Rail):
    """Same-host rail over memfd rings."""

    name = "shm"

    def unavailable_reason(self) -> str | None:
        if not hasattr(os, "memfd_create"):
            return "os.memfd_create is missing (Linux >= 3.17 with Python >= 3.8 needed)"
        if not hasattr(socket, "send_fds") or not hasattr(socket, "SO_PEERCRED"):
            return "Unix sockets with SCM_RIGHTS and SO_PEERCRED are missing on this platform"
        return None

    def listen(self, options: RailOptions) -> ShmReceiver:
        return ShmReceiver(options)

    def connect(self, material: bytes, options: RailOptions) -> ShmWriter:
        return ShmWriter(material, options)
