"""Consumer side of the ``tcp`` rail: the rings live in the training process, the TCP I/O in a helper.

:class:`TcpReceiver` owns memfd rings but does no TCP I/O itself: a receiver process
(:mod:`kspeed.rdma.tcp.receiver_process`, started as a subprocess, never forked) maps the rings,
receives payloads straight into them and forwards completions over a Unix socket. Several consuming
processes on one node can share a receiver process by naming it (``RailOptions.receiver_name``).
"""

from __future__ import annotations

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

from kspeed.errors import KSpeedError, PeerLostError, RailUnavailableError, TransportError
from kspeed.rdma import framing
from kspeed.rdma.base import (
    Completions,
    Receiver,
    Region,
    RegionKey,
)
from kspeed.rdma.memory import MemfdSegment
from kspeed.rdma.options import RailOptions

__all__ = ["TcpReceiver"]

log = logging.getLogger(__name__)


class TcpReceiver(Receiver):
    """Consumer side of the ``tcp`` rail: rings here, TCP in a receiver process."""

    rail = "tcp"
    #: The module run as the receiver process.
    process = "kspeed.rdma.tcp.receiver_process"

    def __init__(self, options: RailOptions) -> None:
        self._options = options
        self._secret = os.urandom(32)
        self._proc: subprocess.Popen | None = None
        self._regions: dict[int, Region] = {}
        self._handles = count(1)
        self._reader = framing.FrameReader()
        self._errors: deque[KSpeedError] = deque()
        self._messages: list[tuple[int, bytes]] = []
        self._conns: set[int] = set()
        self._parts: list[Completions] = []
        self._dead: PeerLostError | None = None
        if options.receiver_name is not None:
            control = f"kspeed-{self.rail}rx-{os.getuid()}-{options.receiver_name}"
            self._sock = self._dial_control(control) or self._start(control)
        else:
            control = f"kspeed-{self.rail}rx-{os.getpid()}-{os.urandom(8).hex()}"
            self._sock = self._start(control)
        key = options.token if options.token is not None else self._secret
        reply = self._call({"op": "attach", "key": key.hex()})
        self._attached = reply
        self._consumer = int(reply["consumer"])
        self._port = int(reply["port"])

    def _dial_control(self, control: str) -> socket.socket | None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.connect("\0" + control)
        except OSError:
            sock.close()
            return None
        framing.check_peer_uid(sock, self._options.allowed_uids)
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
            **self._process_config(),
        }
        proc = subprocess.Popen(
            [sys.executable, "-m", self.process, json.dumps(config)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            close_fds=True,
        )
        stdout = proc.stdout
        if stdout is None:  # Popen always opens it with stdout=PIPE
            raise RailUnavailableError(f"{self.rail} receiver process started without its stdout pipe")
        ready, _, _ = select.select([stdout], [], [], o.connect_timeout + 10)
        line = stdout.readline().decode().strip() if ready else ""
        stdout.close()
        if not line.startswith("ready"):
            proc.kill()
            proc.wait()
            if o.receiver_name is not None:  # lost a race to start the shared receiver
                sock = self._dial_control(control)
                if sock is not None:
                    return sock
            raise RailUnavailableError(f"{self.rail} receiver process failed to start: {line or 'no answer'}")
        if o.receiver_name is None:
            self._proc = proc
        sock = self._dial_control(control)
        if sock is None:
            raise RailUnavailableError(f"{self.rail} receiver process started but its control socket is not reachable")
        return sock

    def _process_config(self) -> dict:
        """What the receiver process needs besides the rail options (none for ``tcp``)."""
        return {}

    def _material(self) -> dict:
        secret = None if self._options.token is not None else self._secret.hex()
        return {
            "rail": self.rail,
            "host": self._options.public_host,
            "port": self._port,
            "consumer": self._consumer,
            "node": socket.gethostname(),
            "secret": secret,
        }

    @property
    def material(self) -> bytes:
        return json.dumps(self._material()).encode()

    # ----------------------------------------------------------------------------- control socket

    def _send_control(self, data: bytes, fds: list[int] | None = None) -> None:
        try:
            if fds:
                socket.send_fds(self._sock, [data], fds)
            else:  # taking completions in while the process is slow to read, so it never sees us stall
                framing.send_draining(self._sock, data, self._options.io_timeout, lambda: self._pump(0))
        except OSError as exc:
            raise self._lost_receiver(exc) from exc

    def _lost_receiver(self, exc: BaseException | None) -> PeerLostError:
        if self._dead is None:
            self._dead = framing.lost("tcp receiver process is gone", exc)
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
        if kind == framing.IMMS:
            pairs = np.frombuffer(payload, np.uint32).reshape(-1, 2)
            self._parts.append(Completions(pairs[:, 1].copy(), pairs[:, 0].copy()))
        elif kind == framing.MSG:
            self._messages.append((int.from_bytes(payload[:4], "little"), payload[4:]))
        elif kind == framing.WELCOME:
            self._conns.add(int.from_bytes(payload[:4], "little"))
        elif kind == framing.BYE:
            self._conns.discard(int.from_bytes(payload[:4], "little"))
        elif kind == framing.LOST:
            conn = int.from_bytes(payload[:4], "little")
            self._conns.discard(conn)
            self._errors.append(framing.lost(f"tcp writer {conn}: {payload[4:].decode(errors='replace')}", None, conn))
        elif kind == framing.REPLY:
            self._replies.append(json.loads(payload))
        else:
            raise TransportError(f"tcp receiver process sent unknown frame type {kind}")

    _replies: deque

    def _call(self, request: dict, fds: list[int] | None = None, kind: int = framing.CALL) -> dict:
        self._replies = getattr(self, "_replies", deque())
        self._send_control(framing.frame(kind, json.dumps(request).encode()), fds)
        deadline = time.monotonic() + self._options.io_timeout
        while not self._replies:
            if time.monotonic() > deadline:
                raise framing.lost("tcp receiver process did not answer within the I/O timeout")
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
            self._call({"handle": handle, "length": nbytes}, [segment.fd], kind=framing.REGION)
        except KSpeedError:
            segment.close()
            raise
        region = Region(RegionKey(self.rail, self._options.public_host, handle, 0, nbytes), segment)
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
        framing.check_message(message)
        if conn not in self._conns:
            self._pump(0)
            if conn not in self._conns:
                raise framing.lost(f"no tcp writer {conn} connected", None, conn)
        self._send_control(framing.frame(framing.MSG, conn.to_bytes(4, "little") + message))

    @property
    def connections(self) -> frozenset[int]:
        if self._dead is None:
            self._pump(0)
        return frozenset(self._conns)

    def disconnect(self, conn: int) -> None:
        self._conns.discard(conn)
        self._send_control(framing.frame(framing.CALL, json.dumps({"op": "disconnect", "conn": conn}).encode()))

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
