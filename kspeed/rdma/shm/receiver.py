"""The ``shm`` rail: writer and receiver on one host, writes are memcpy into a shared memfd ring.

The receiver listens on an abstract-namespace Unix socket (nothing on disk to leak), checks each
dialer's uid with SO_PEERCRED, authenticates it (``auth``), then passes its rings' memfds with
SCM_RIGHTS. Each handshake runs in a thread of its own inside a :class:`~kspeed.admission.Gate`:
``connect_timeout`` seconds in all, capped per dialing process and in total, so a dialer that
stalls keeps no other writer waiting. The writer (``shm_writer``) maps each ring once and copies
source slices straight in (one copy per slice); immediates follow as frames on the socket after
the copies, so the ``send`` syscall orders the bytes before the completion for the receiver on any
CPU.

Fencing: :meth:`ShmReceiver.disconnect` stops a writer's completions and messages, but a mapping
cannot be revoked from another process; the owner must retire the ring (register a new one) before
granting its range to someone else.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import selectors
import socket
import threading
import time
from collections import deque
from itertools import count

import numpy as np

from kspeed.admission import Gate, Ticket, worth_telling
from kspeed.errors import KSpeedError, TransportError
from kspeed.rdma import auth, framing
from kspeed.rdma.base import (
    Completions,
    Receiver,
    Region,
    RegionKey,
)
from kspeed.rdma.memory import MemfdSegment
from kspeed.rdma.options import RailOptions

from .writer import HELLO as _HELLO
from .writer import socket_name

__all__ = ["ShmReceiver"]

log = logging.getLogger(__name__)

#: Dialers being authenticated at once, and from one process; at a cap the oldest handshake is
#: closed to let the newcomer in.
MAX_HANDSHAKES = 32
MAX_HANDSHAKES_PER_PEER = 8
#: Connected writers at most, and from one process (a feeder holds one per ring); more are refused.
MAX_WRITERS = 1024
MAX_WRITERS_PER_PEER = 256


def _key_for(options: RailOptions, secret: bytes) -> bytes:
    return options.token if options.token is not None else secret


class ShmReceiver(Receiver):
    """Owns memfd rings and collects completions from writers on this host."""

    rail = "shm"

    def __init__(self, options: RailOptions) -> None:
        self._options = options
        self._node = socket.gethostname()
        self._secret = os.urandom(32)
        self._name = socket_name()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self._listener.bind("\0" + self._name)
        self._listener.listen(64)
        self._lock = threading.Lock()
        self._regions: dict[int, tuple[Region, MemfdSegment]] = {}
        self._handles = count(1)
        self._conn_ids = count(1)
        self._conns: dict[int, socket.socket] = {}
        self._writers: dict[int, int] = {}  # conn -> the writer's pid (SO_PEERCRED), until it is gone
        self._readers: dict[int, framing.FrameReader] = {}
        self._new: deque[tuple[int, socket.socket]] = deque()
        self._errors: deque[KSpeedError] = deque()
        self._messages: list[tuple[int, bytes]] = []
        self._early: list[Completions] = []  # completions read outside poll(), returned by the next one
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._closed = False
        self._failed = 0  # dialers refused (counted across threads: an estimate is enough)
        self._gate = Gate(
            "shm handshake", total=MAX_HANDSHAKES, per_peer=MAX_HANDSHAKES_PER_PEER, deadline=options.connect_timeout
        )
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
            self._regions[handle] = (region, segment)
            conns = list(self._conns.items())
        for conn, sock in conns:
            try:
                self._send_region(sock, region, segment)
            except OSError as exc:
                self._drop(conn, framing.lost(f"announcing region {handle} to writer {conn}", exc, conn))
        return region

    @staticmethod
    def _send_region(sock: socket.socket, region: Region, segment: MemfdSegment) -> None:
        payload = json.dumps({"handle": region.key.handle, "length": region.key.length}).encode()
        socket.send_fds(sock, [framing.frame(framing.REGION, payload)], [segment.fd])

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # listener shut down by close()
            try:
                pid = framing.check_peer_uid(sock, self._options.allowed_uids)
                with self._lock:
                    mine = sum(1 for c in self._conns if self._writers.get(c) == pid)
                    if len(self._conns) >= MAX_WRITERS or mine >= MAX_WRITERS_PER_PEER:
                        raise TransportError(
                            f"{len(self._conns)} writers are connected ({mine} from pid {pid}), at most {MAX_WRITERS} "
                            f"({MAX_WRITERS_PER_PEER} from one process)"
                        )
            except (KSpeedError, OSError) as exc:
                self._failed += 1  # a local peer must not flood the job's log
                log.log(
                    logging.WARNING if worth_telling(self._failed) else logging.DEBUG, "refused shm writer: %s", exc
                )
                sock.close()
                continue
            ticket = self._gate.enter(sock, f"pid {pid}")
            if ticket is None:  # (the gate logged it)
                sock.close()
                continue
            threading.Thread(
                target=self._handshake, args=(sock, pid, ticket), name="kspeed-shm-handshake", daemon=True
            ).start()

    def _handshake(self, sock: socket.socket, pid: int, ticket: Ticket) -> None:
        """Authenticate and admit one dialer (in its own thread, inside the gate)."""
        try:
            self._admit(sock, pid)
        except (KSpeedError, OSError) as exc:
            if not ticket.ended:  # (the gate counts and logs those it ended)
                self._failed += 1
                level = logging.WARNING if worth_telling(self._failed) else logging.DEBUG
                log.log(level, "refused shm writer pid %d: %s (%d refused so far)", pid, exc, self._failed)
            self._gate.leave(ticket)
            sock.close()
        else:
            self._gate.leave(ticket)

    def _admit(self, sock: socket.socket, pid: int) -> None:
        sock.settimeout(self._options.connect_timeout)  # per read; the gate bounds the whole handshake
        hello = auth.recv_exact(sock, len(_HELLO), "shm hello")
        if hello != _HELLO:
            raise TransportError(f"shm dialer pid {pid} sent an unknown hello {hello!r}")
        auth.accept(sock, _key_for(self._options, self._secret), hello)
        with self._lock:
            if self._closed:
                raise TransportError("receiver is closing")
            conn = next(self._conn_ids)
            for region, segment in self._regions.values():
                self._send_region(sock, region, segment)
            welcome = {"conn": conn, "node": self._node}
            sock.sendall(framing.frame(framing.WELCOME, json.dumps(welcome).encode()))
            sock.settimeout(self._options.io_timeout)
            self._conns[conn] = sock
            self._writers[conn] = pid
            self._readers[conn] = framing.FrameReader()
            self._new.append((conn, sock))
        self._wake_w.send(b"\0")
        log.debug("shm writer %d connected (pid %d)", conn, pid)

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
            # The text, not the error: it is raised later, and a log record that kept it (a test's
            # log capture) would keep the raiser's frames alive, and the batches they hold.
            log.warning("shm writer %d lost: %s", conn, str(error))
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
            self._drop(conn, framing.lost(f"shm writer {conn}", exc, conn))
            return
        try:
            for kind, payload in reader.frames():
                if kind == framing.IMMS:
                    imm = np.frombuffer(payload, np.uint32)
                    parts.append(Completions(imm, np.full(len(imm), conn, np.uint32)))
                elif kind == framing.MSG:
                    self._messages.append((conn, payload))
                elif kind == framing.BYE:
                    self._drop(conn, None)
                    return
                else:
                    raise TransportError(f"shm writer {conn} sent unknown frame type {kind}")
        except TransportError as exc:
            self._drop(conn, framing.lost(f"shm writer {conn} broke the protocol", exc, conn))
            return
        if n == 0:
            self._drop(conn, framing.lost(f"shm writer {conn} closed the connection without saying bye", None, conn))

    def poll(self, timeout: float | None = 0.0) -> Completions:
        if self._errors:
            raise self._errors.popleft()
        parts, self._early = self._early, []
        had_messages = len(self._messages)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            for key, _ in self._sel.select(remaining):
                if key.data is None:
                    self._register_new()
                elif isinstance(key.fileobj, socket.socket):
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
        framing.check_message(message)
        sock = self._conns.get(conn)
        if sock is None:
            raise framing.lost(f"no shm writer {conn} connected", None, conn)
        try:
            framing.send_draining(
                sock,
                framing.frame(framing.MSG, message),
                self._options.io_timeout,
                lambda: self._read(conn, sock, self._early),  # its completions, while it waits for us
            )
        except OSError as exc:
            err = framing.lost(f"sending to shm writer {conn}", exc, conn)
            # What the writer sent before it went (its last completions, a message saying why it
            # ends) is still in the socket: take it in before the socket goes.
            self._read(conn, sock, self._early)
            self._drop(conn, None)
            raise err from exc

    @property
    def connections(self) -> frozenset[int]:
        return frozenset(self._conns)

    def disconnect(self, conn: int) -> None:
        self._drop(conn, None)

    def writer_gone(self, conn: int) -> bool:
        """Once disconnected: its process has exited, or maps none of this receiver's regions any
        more (a feed it closed unmapped them; :file:`/proc/<pid>/maps` names each memfd's inode)."""
        if conn in self._conns:
            return False
        pid = self._writers.get(conn)
        if pid is None:
            return True
        try:
            with open(f"/proc/{pid}/maps") as maps:
                mapped = {line.split()[4] for line in maps if "memfd:" in line}
        except (FileNotFoundError, ProcessLookupError):
            mapped = set()
        except OSError:
            return False  # cannot tell (another user's process): keep the range away
        with self._lock:
            ours = {str(os.fstat(segment.fd).st_ino) for _, segment in self._regions.values()}
        if ours & mapped:
            return False
        self._writers.pop(conn, None)
        return True

    def close(self) -> None:
        if self._closed:
            return
        with self._lock:
            self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._acceptor.join(self._options.connect_timeout + 1)
        self._listener.close()
        self._gate.close()
        for conn in list(self._conns):
            self._drop(conn, None)
        for region, _ in self._regions.values():
            region.close()
        self._regions.clear()
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()
