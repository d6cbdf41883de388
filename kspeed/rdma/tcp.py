"""The ``tcp`` rail: writers on other hosts, no RDMA.

Writer side (:class:`TcpWriter`): each write is one ``sendmsg`` of a 32-byte header followed by the
source slices as an iovec list (no copy in Python); ``write_many`` packs a whole batch into as few
``sendmsg`` calls as ``IOV_MAX`` allows. Small messages use a second connection with
``TCP_NODELAY``.

Receiver side (:class:`TcpReceiver`): the consuming process owns memfd rings but does no TCP I/O;
a receiver process (``kspeed.rdma.tcp_receiver``, started as a subprocess, never forked) maps the
rings, receives payloads straight into them and forwards completions over a Unix socket. Several
consuming processes on one node can share a receiver process by naming it
(``RailOptions.receiver_name``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import socket
import subprocess
import sys
import time
from collections import deque
from itertools import count

import numpy as np

from kspeed.errors import AuthError, KSpeedError, PeerLostError, RailUnavailableError, TransportError

from . import _wire as w
from . import auth
from . import tcp_proto as p
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
from .batch import plan_batch, source_array
from .memory import MemfdSegment
from .options import RailOptions

__all__ = ["TcpRail", "TcpReceiver", "TcpWriter"]

log = logging.getLogger(__name__)

_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


class TcpReceiver(Receiver):
    """Consumer side of the ``tcp`` rail: rings here, TCP in a receiver process."""

    rail = "tcp"

    def __init__(self, options: RailOptions) -> None:
        self._options = options
        self._secret = os.urandom(32)
        self._proc: subprocess.Popen | None = None
        self._regions: dict[int, Region] = {}
        self._handles = count(1)
        self._reader = w.FrameReader()
        self._errors: deque[KSpeedError] = deque()
        self._messages: list[tuple[int, bytes]] = []
        self._conns: set[int] = set()
        self._parts: list[Completions] = []
        self._dead: PeerLostError | None = None
        if options.receiver_name is not None:
            control = f"kspeed-tcprx-{os.getuid()}-{options.receiver_name}"
            self._sock = self._dial_control(control) or self._start(control)
        else:
            control = f"kspeed-tcprx-{os.getpid()}-{os.urandom(8).hex()}"
            self._sock = self._start(control)
        key = options.token if options.token is not None else self._secret
        reply = self._call({"op": "attach", "key": key.hex()})
        self._consumer = int(reply["consumer"])
        self._port = int(reply["port"])

    def _dial_control(self, control: str) -> socket.socket | None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.connect("\0" + control)
        except OSError:
            sock.close()
            return None
        w.check_peer_uid(sock, self._options.allowed_uids)
        sock.settimeout(self._options.io_timeout)
        return sock

    def _start(self, control: str) -> socket.socket:
        o = self._options
        config = {
            "control": control,
            "bind_host": o.bind_host,
            "io_timeout": o.io_timeout,
            "connect_timeout": o.connect_timeout,
            "keepalive_idle": o.keepalive_idle,
            "keepalive_interval": o.keepalive_interval,
            "keepalive_count": o.keepalive_count,
            "socket_buffer": o.socket_buffer,
            "allowed_uids": list(o.allowed_uids),
            "shared": o.receiver_name is not None,
            "parent": os.getpid(),
            "log_level": logging.getLevelName(logging.getLogger("kspeed").getEffectiveLevel()),
        }
        proc = subprocess.Popen(
            [sys.executable, "-m", "kspeed.rdma.tcp_receiver", json.dumps(config)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            close_fds=True,
        )
        ready, _, _ = select.select([proc.stdout], [], [], o.connect_timeout + 10)
        line = proc.stdout.readline().decode().strip() if ready else ""
        proc.stdout.close()
        if not line.startswith("ready"):
            proc.kill()
            proc.wait()
            if o.receiver_name is not None:  # lost a race to start the shared receiver
                sock = self._dial_control(control)
                if sock is not None:
                    return sock
            raise RailUnavailableError(f"tcp receiver process failed to start: {line or 'no answer'}")
        if o.receiver_name is None:
            self._proc = proc
        sock = self._dial_control(control)
        if sock is None:
            raise RailUnavailableError("tcp receiver process started but its control socket is not reachable")
        return sock

    @property
    def material(self) -> bytes:
        secret = None if self._options.token is not None else self._secret.hex()
        return json.dumps(
            {
                "rail": "tcp",
                "host": self._options.public_host,
                "port": self._port,
                "consumer": self._consumer,
                "node": socket.gethostname(),
                "secret": secret,
            }
        ).encode()

    # ----------------------------------------------------------------------------- control socket

    def _send_control(self, data: bytes, fds: list[int] | None = None) -> None:
        try:
            if fds:
                socket.send_fds(self._sock, [data], fds)
            else:
                self._sock.sendall(data)
        except OSError as exc:
            raise self._lost_receiver(exc) from exc

    def _lost_receiver(self, exc: BaseException | None) -> PeerLostError:
        if self._dead is None:
            self._dead = w.lost("tcp receiver process is gone", exc)
        return self._dead

    def _pump(self, timeout: float | None) -> bool:
        """Read and dispatch control frames; returns whether anything arrived."""
        if self._dead is not None:
            raise self._dead
        if timeout is not None and timeout <= 0:
            ready = select.select([self._sock], [], [], 0)[0]
        else:
            ready = select.select([self._sock], [], [], timeout)[0]
        if not ready:
            return False
        try:
            n = self._reader.recv(self._sock, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except OSError as exc:
            raise self._lost_receiver(exc) from exc
        for kind, payload in self._reader.frames():
            self._dispatch(kind, payload)
        if n == 0:
            raise self._lost_receiver(None)
        return True

    def _dispatch(self, kind: int, payload: bytes) -> None:
        if kind == w.IMMS:
            pairs = np.frombuffer(payload, np.uint32).reshape(-1, 2)
            self._parts.append(Completions(pairs[:, 1].copy(), pairs[:, 0].copy()))
        elif kind == w.MSG:
            self._messages.append((int.from_bytes(payload[:4], "little"), payload[4:]))
        elif kind == w.WELCOME:
            self._conns.add(int.from_bytes(payload[:4], "little"))
        elif kind == w.BYE:
            self._conns.discard(int.from_bytes(payload[:4], "little"))
        elif kind == w.LOST:
            conn = int.from_bytes(payload[:4], "little")
            self._conns.discard(conn)
            self._errors.append(w.lost(f"tcp writer {conn}: {payload[4:].decode(errors='replace')}", None, conn))
        elif kind == w.REPLY:
            self._replies.append(json.loads(payload))
        else:
            raise TransportError(f"tcp receiver process sent unknown frame type {kind}")

    _replies: deque

    def _call(self, request: dict, fds: list[int] | None = None, kind: int = w.CALL) -> dict:
        self._replies = getattr(self, "_replies", deque())
        self._send_control(w.frame(kind, json.dumps(request).encode()), fds)
        deadline = time.monotonic() + self._options.io_timeout
        while not self._replies:
            if time.monotonic() > deadline:
                raise w.lost("tcp receiver process did not answer within the I/O timeout")
            self._pump(deadline - time.monotonic())
        return self._replies.popleft()

    # ------------------------------------------------------------------------------------ the seam

    @property
    def helper_pids(self) -> tuple[int, ...]:
        proc = self._proc
        return (proc.pid,) if proc is not None and proc.poll() is None else ()

    def register(self, nbytes: int) -> Region:
        segment = MemfdSegment.create(nbytes, "tcp-ring")
        handle = next(self._handles)
        try:
            self._call({"handle": handle, "length": nbytes}, [segment.fd], kind=w.REGION)
        except KSpeedError:
            segment.close()
            raise
        region = Region(RegionKey("tcp", self._options.public_host, handle, 0, nbytes), segment)
        self._regions[handle] = region
        return region

    def poll(self, timeout: float | None = 0.0) -> Completions:
        if self._errors:
            raise self._errors.popleft()
        had = len(self._messages)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._pump(remaining)
            if self._parts or self._errors or len(self._messages) != had or remaining == 0:
                break
        parts, self._parts = self._parts, []
        if not parts and self._errors:
            raise self._errors.popleft()
        return Completions.concat(parts)

    def messages(self) -> list[tuple[int, bytes]]:
        out, self._messages = self._messages, []
        return out

    def send(self, conn: int, message: bytes) -> None:
        if len(message) > MAX_MESSAGE:
            raise TransportError(f"message of {len(message)} bytes exceeds {MAX_MESSAGE}")
        if conn not in self._conns:
            self._pump(0)
            if conn not in self._conns:
                raise w.lost(f"no tcp writer {conn} connected", None, conn)
        self._send_control(w.frame(w.MSG, conn.to_bytes(4, "little") + message))

    @property
    def connections(self) -> frozenset[int]:
        if self._dead is None:
            self._pump(0)
        return frozenset(self._conns)

    def disconnect(self, conn: int) -> None:
        self._conns.discard(conn)
        self._send_control(w.frame(w.CALL, json.dumps({"op": "disconnect", "conn": conn}).encode()))

    def close(self) -> None:
        if self._sock.fileno() >= 0:
            self._sock.close()
        if self._proc is not None:
            try:
                self._proc.wait(self._options.io_timeout)
            except subprocess.TimeoutExpired:
                log.warning("tcp receiver process %d did not exit; killing it", self._proc.pid)
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        for region in self._regions.values():
            region.close()
        self._regions.clear()


class TcpWriter(Writer):
    """Writer side of the ``tcp`` rail: header + gathered slices per write."""

    rail = "tcp"

    def __init__(self, material: bytes, options: RailOptions) -> None:
        try:
            info = json.loads(material)
            host, port, consumer, secret = info["host"], int(info["port"]), int(info["consumer"]), info["secret"]
        except (ValueError, KeyError, TypeError) as exc:
            raise TransportError(f"malformed tcp connection material: {exc}") from exc
        if info.get("rail") != "tcp":
            raise TransportError(f"connection material is for rail {info.get('rail')!r}, not 'tcp'")
        if options.token is not None:
            key = options.token
        elif secret is not None:
            key = bytes.fromhex(secret)
        else:
            raise AuthError("tcp receiver expects the cluster token, but no token was configured")
        self._options = options
        self._msg_reader = w.FrameReader(1 << 16)
        self._messages: deque[bytes] = deque()
        self.conn = 0
        self._bulk = self._dial(host, port, key, p.BULK, consumer, 0)
        self._msg: socket.socket | None = None
        try:
            reader = w.FrameReader(4096)
            welcome = None
            while welcome is None:
                if reader.recv(self._bulk) == 0:
                    raise w.lost("tcp receiver closed the connection during setup")
                for kind, payload in reader.frames():
                    if kind == w.WELCOME:
                        welcome = json.loads(payload)
            self.conn = int(welcome["conn"])
            self._msg = self._dial(host, port, key, p.MESSAGES, consumer, self.conn)
        except OSError as exc:
            self.close()
            raise w.lost(f"connecting to tcp receiver {host}:{port}", exc) from exc
        except KSpeedError:
            self.close()
            raise
        p.blocking_with_timeout(self._bulk, options.io_timeout)
        self._msg.settimeout(options.io_timeout)

    def _dial(self, host: str, port: int, key: bytes, role: int, consumer: int, conn: int) -> socket.socket:
        try:
            sock = socket.create_connection((host, port), timeout=self._options.connect_timeout)
        except OSError as exc:
            raise w.lost(f"connecting to tcp receiver {host}:{port}", exc) from exc
        try:
            p.tune(sock, self._options, nodelay=role == p.MESSAGES)
            hello = p.HELLO.pack(p.MAGIC, role, consumer, conn)
            sock.sendall(hello)
            auth.dial(sock, key, hello)
        except OSError as exc:
            sock.close()
            raise w.lost(f"connecting to tcp receiver {host}:{port}", exc) from exc
        except KSpeedError:
            sock.close()
            raise
        return sock

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
            raise w.lost("writing to tcp receiver", exc, self.conn) from exc

    def write(self, key, srcs, offset=0, imm=None) -> None:
        self.write_many(key, [(srcs, offset, imm)])

    def write_many(self, key, ops) -> None:
        bufs: list = []
        pack = p.WRITE_HEADER.pack
        for srcs, offset, imm in ops:
            check_imm(imm)
            if isinstance(srcs, (list, tuple)):
                views = [as_bytes_view(s) for s in srcs]
                nbytes = sum(v.nbytes for v in views)
            else:
                views = [as_bytes_view(srcs)]
                nbytes = views[0].nbytes
            check_range(key, offset, nbytes)
            flags = 0 if imm is None else p.FLAG_IMM
            bufs.append(pack(p.DATA, flags, key.handle, imm or 0, key.addr + offset, nbytes))
            bufs.extend(views)
        self._sendmsg(bufs)

    def write_batch(self, key, source, src_offsets, lengths, dst_offsets, imms=None) -> None:
        src = source_array(source)
        batch = plan_batch(key, src.nbytes, src_offsets, lengths, dst_offsets, imms)
        bufs = p.batch_buffers(key, memoryview(src), batch)
        if bufs:
            self._sendmsg(bufs)

    def send(self, message: bytes) -> None:
        if len(message) > MAX_MESSAGE:
            raise TransportError(f"message of {len(message)} bytes exceeds {MAX_MESSAGE}")
        try:
            self._msg.sendall(w.frame(w.MSG, message))
        except OSError as exc:
            raise w.lost("sending to tcp receiver", exc, self.conn) from exc

    def recv(self, timeout: float | None = 0.0) -> bytes | None:
        if self._messages:
            return self._messages.popleft()
        ready = select.select([self._msg], [], [], timeout)[0]
        if ready:
            try:
                n = self._msg_reader.recv(self._msg, socket.MSG_DONTWAIT)
            except BlockingIOError:
                n = -1
            except OSError as exc:
                raise w.lost("reading from tcp receiver", exc, self.conn) from exc
            for kind, payload in self._msg_reader.frames():
                if kind == w.MSG:
                    self._messages.append(payload)
            if n == 0:
                raise w.lost("tcp receiver closed the message connection", None, self.conn)
        return self._messages.popleft() if self._messages else None

    def close(self) -> None:
        bulk = getattr(self, "_bulk", None)
        if bulk is not None and bulk.fileno() >= 0:
            with contextlib.suppress(OSError):
                bulk.send(p.WRITE_HEADER.pack(p.DATA_BYE, 0, 0, 0, 0, 0), socket.MSG_DONTWAIT)
            bulk.close()
        if self._msg is not None:
            self._msg.close()


class TcpRail(Rail):
    """Cross-host rail over TCP with a receiver process."""

    name = "tcp"

    def unavailable_reason(self) -> str | None:
        if not hasattr(os, "memfd_create") or not hasattr(socket, "send_fds"):
            return "memfd rings and SCM_RIGHTS are needed for the receiver process (Linux only)"
        if not hasattr(socket, "TCP_USER_TIMEOUT"):
            return "TCP_USER_TIMEOUT is missing, so a cut link could not be detected in bounded time"
        return None

    def listen(self, options: RailOptions) -> TcpReceiver:
        return TcpReceiver(options)

    def connect(self, material: bytes, options: RailOptions) -> TcpWriter:
        return TcpWriter(material, options)
