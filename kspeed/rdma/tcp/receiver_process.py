"""The ``tcp`` receiver process: TCP payloads straight into consumers' shared rings.

It runs apart from the training process (a receive loop inside a busy Python process loses most
of its bandwidth to the GIL) and is started by :class:`kspeed.rdma.tcp.TcpReceiver` as
``python -m kspeed.rdma.tcp.receiver_process CONFIG_JSON``. Consumers attach over an abstract Unix socket
(uid checked), hand over their key and their rings' memfds; writers dial its TCP port. One
single-threaded selector loop ``recvmsg_into``s each payload at its offset in the ring together
with the header that follows it (one syscall per write), checks every header against the region
before a byte lands, and forwards completions (one frame per consumer
per loop turn), messages and losses to the consumer. Handshakes run in short-lived threads so a
slow dialer never stalls the data path; a :class:`~kspeed.admission.Gate` gives each handshake
``connect_timeout`` seconds in all (not per read) and caps them per dialing address and in total,
letting a newcomer in at a cap by closing the oldest: dialers that drip their hello cannot keep a
new holder's feeders out during a failover.

It exits when its consumer goes (parent-death signal and EOF on the control socket), or, when
shared by name, when the last consumer has gone.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import json
import logging
import os
import queue
import selectors
import signal
import socket
import struct
import sys
import threading
import time
from itertools import count

from kspeed.admission import Gate, Ticket, worth_telling
from kspeed.errors import KSpeedError, TransportError
from kspeed.rdma import auth, framing
from kspeed.rdma.memory import MemfdSegment
from kspeed.rdma.options import RailOptions

from . import wire

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_READ_BUDGET = 16 << 20  # bytes read from one connection before serving the others
_MESSAGE_BACKLOG = 64 << 20  # messages queued for one writer that is not reading them, at most
#: Dialers being authenticated at once (a thread each), and from one address; at a cap the oldest
#: handshake is closed to let the newcomer in, so idle or hostile connections cannot grow threads
#: without bound nor keep writers out.
MAX_HANDSHAKES = 64
MAX_HANDSHAKES_PER_PEER = 16
#: Admitted writer connections at most, and from one address (a server's feeders each hold one
#: per ring); more are closed at once.
MAX_WRITERS = 4096
MAX_WRITERS_PER_PEER = 1024
_U32 = struct.Struct("<I")


class _Consumer:
    def __init__(self, cid: int, sock: socket.socket) -> None:
        self.cid = cid
        self.sock = sock
        self.key: bytes | None = None
        self.reader = framing.FrameReader(1 << 16)
        self.regions: dict[int, MemfdSegment] = {}
        self.pending = array.array("I")
        self.out = bytearray()
        self.stalled_since: float | None = None


class _Bulk:
    def __init__(self, sock: socket.socket, consumer: _Consumer, conn: int, origin: str) -> None:
        self.sock = sock
        self.consumer = consumer
        self.conn = conn
        self.origin = origin  # the dialer's address
        self.hdr = bytearray(wire.WRITE_HEADER.size)
        self.hdr_view = memoryview(self.hdr)
        self.hdr_got = 0
        self.dst: memoryview | None = None
        self.got = 0
        self.imm: int | None = None
        self.last = time.monotonic()
        self.msg_sock: socket.socket | None = None
        self.msg_reader = framing.FrameReader(1 << 16)
        self.msg_out = bytearray()  # messages for the writer its socket has not taken yet
        self.msg_stalled_since: float | None = None


class ReceiverProcess:
    """The loop of the receiver process."""

    def __init__(self, config: dict) -> None:
        self.options = RailOptions(
            io_timeout=config["io_timeout"],
            connect_timeout=config["connect_timeout"],
            keepalive_idle=config["keepalive_idle"],
            keepalive_interval=config["keepalive_interval"],
            keepalive_count=config["keepalive_count"],
            bind_host=config["bind_host"],
            socket_buffer=config["socket_buffer"],
            allowed_uids=tuple(config["allowed_uids"]),
        )
        self.shared = config["shared"]
        self.sel = selectors.DefaultSelector()
        self.control = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.control.bind("\0" + config["control"])
        self.control.listen(64)
        family = socket.AF_INET6 if ":" in self.options.bind_host else socket.AF_INET
        self.listener = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind((self.options.bind_host, 0))
        self.listener.listen(128)
        self.port = self.listener.getsockname()[1]
        self.wake_r, self.wake_w = socket.socketpair()
        self.wake_r.setblocking(False)
        self.admitted: queue.SimpleQueue = queue.SimpleQueue()
        self.consumers: dict[int, _Consumer] = {}
        self.bulks: dict[int, _Bulk] = {}
        self.gate = Gate(
            "tcp handshake",
            total=MAX_HANDSHAKES,
            per_peer=MAX_HANDSHAKES_PER_PEER,
            deadline=self.options.connect_timeout,
        )
        self.refused = 0  # dialers closed at once: too many writers
        self.failed = 0  # dialers whose handshake failed (counted across threads: an estimate is enough)
        self.cids = count(1)
        self.conns = count(1)
        self.ever_attached = False
        self.started = time.monotonic()
        for sock, tag in ((self.control, "control"), (self.listener, "listen"), (self.wake_r, "wake")):
            self.sel.register(sock, selectors.EVENT_READ, tag)

    # ----------------------------------------------------------------------------------- consumers

    def _accept_consumer(self) -> None:
        sock, _ = self.control.accept()
        try:
            framing.check_peer_uid(sock, self.options.allowed_uids)
        except KSpeedError as exc:
            log.warning("refused consumer: %s", exc)
            sock.close()
            return
        sock.setblocking(False)
        consumer = _Consumer(next(self.cids), sock)
        self.consumers[consumer.cid] = consumer
        self.ever_attached = True
        self.sel.register(sock, selectors.EVENT_READ, consumer)

    def _consumer_readable(self, c: _Consumer) -> None:
        try:
            n = c.reader.recv_with_fds(c.sock, 4, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError:
            n = 0
        try:
            for kind, payload in c.reader.frames():
                self._consumer_frame(c, kind, payload)
        except (KSpeedError, ValueError, KeyError) as exc:
            log.warning("consumer %d broke the control protocol: %s", c.cid, exc)
            n = 0
        if n == 0:
            self._drop_consumer(c)

    def _consumer_frame(self, c: _Consumer, kind: int, payload: bytes) -> None:
        if kind == framing.CALL:
            call = json.loads(payload)
            if call["op"] == "attach":
                c.key = bytes.fromhex(call["key"])
                self._to_consumer(c, framing.REPLY, json.dumps({"consumer": c.cid, "port": self.port}).encode())
            elif call["op"] == "disconnect":
                bulk = self.bulks.get(int(call["conn"]))
                if bulk is not None and bulk.consumer is c:
                    self._drop_bulk(bulk, None)
        elif kind == framing.REGION:
            desc = json.loads(payload)
            if not c.reader.fds:
                raise TransportError("region announced without its descriptor")
            c.regions[int(desc["handle"])] = MemfdSegment.attach(c.reader.fds.popleft(), int(desc["length"]))
            self._to_consumer(c, framing.REPLY, payload)
        elif kind == framing.MSG:
            conn = _U32.unpack_from(payload)[0]
            bulk = self.bulks.get(conn)
            if bulk is None or bulk.consumer is not c or bulk.msg_sock is None:
                self._to_consumer(c, framing.LOST, _U32.pack(conn) + b"no such writer connected")
                return
            if len(bulk.msg_out) + len(payload) > _MESSAGE_BACKLOG:
                self._drop_bulk(bulk, f"it left more than {_MESSAGE_BACKLOG >> 20} MiB of messages unread")
                return
            bulk.msg_out += framing.frame(framing.MSG, payload[4:])
            self._flush_messages(bulk)
        else:
            raise TransportError(f"unknown control frame type {kind}")

    def _to_consumer(self, c: _Consumer, kind: int, payload: bytes) -> None:
        c.out += framing.frame(kind, payload)
        self._flush_consumer(c)

    def _flush_consumer(self, c: _Consumer) -> None:
        if c.pending:
            c.out += framing.frame(framing.IMMS, c.pending.tobytes())
            c.pending = array.array("I")
        if not c.out:
            c.stalled_since = None
            return
        try:
            sent = c.sock.send(c.out, socket.MSG_DONTWAIT)
        except BlockingIOError:
            sent = 0
        except OSError:
            self._drop_consumer(c)
            return
        del c.out[:sent]
        if not c.out:
            c.stalled_since = None
        elif sent or c.stalled_since is None:
            c.stalled_since = time.monotonic()

    def _drop_consumer(self, c: _Consumer) -> None:
        if self.consumers.pop(c.cid, None) is None:
            return
        log.debug("consumer %d left", c.cid)
        for bulk in [b for b in self.bulks.values() if b.consumer is c]:
            self._drop_bulk(bulk, None)
        self.sel.unregister(c.sock)
        c.sock.close()
        for seg in c.regions.values():
            seg.close()
        for fd in c.reader.fds:
            os.close(fd)

    # ------------------------------------------------------------------------------------- writers

    def _accept_writer(self) -> None:
        sock, addr = self.listener.accept()
        origin = str(addr[0])
        mine = sum(1 for b in self.bulks.values() if b.origin == origin)
        if len(self.bulks) >= MAX_WRITERS or mine >= MAX_WRITERS_PER_PEER:
            self.refused += 1
            if worth_telling(self.refused):
                log.warning(
                    "refused tcp dialer %s: %d writers at once at most, %d from one address (%d refused so far)",
                    addr,
                    MAX_WRITERS,
                    MAX_WRITERS_PER_PEER,
                    self.refused,
                )
            sock.close()
            return
        ticket = self.gate.enter(sock, origin)
        threading.Thread(target=self._handshake, args=(sock, addr, ticket), daemon=True).start()

    def _handshake(self, sock: socket.socket, addr: tuple, ticket: Ticket) -> None:
        """Authenticate a dialer (in its own thread, inside the gate); hand it to the loop through the queue."""
        try:
            admitted = self._authenticate(sock, addr)
        except (KSpeedError, OSError, struct.error, ValueError, KeyError) as exc:
            if not ticket.ended:  # (the gate counts and logs those it ended)
                self.failed += 1  # an unauthenticated dialer must not flood the job's stderr
                level = logging.WARNING if worth_telling(self.failed) else logging.DEBUG
                log.log(level, "refused dialer %s: %s (%d refused handshakes so far)", addr, exc, self.failed)
            admitted = None
        finally:
            self.gate.leave(ticket)
        if admitted is None or ticket.ended:
            sock.close()
            return
        self.admitted.put(admitted)
        self.wake_w.send(b"\0")

    def _authenticate(self, sock: socket.socket, addr: tuple) -> tuple:
        """Read the hello and authenticate the dialer; returns what :meth:`_admit` takes.

        Raises:
            KSpeedError, OSError, struct.error: the dialer is refused (the caller closes it).
        """
        sock.settimeout(self.options.connect_timeout)  # per read; the gate bounds the whole handshake
        hello = auth.recv_exact(sock, wire.HELLO.size, "tcp hello")
        magic, role, cid, conn = wire.HELLO.unpack(hello)
        consumer = self.consumers.get(cid)
        if magic != wire.MAGIC or role not in (wire.BULK, wire.MESSAGES):
            raise TransportError(f"unknown hello from {addr}")
        if consumer is None or consumer.key is None:
            raise TransportError(f"dialer {addr} asked for consumer {cid}, which is not attached")
        auth.accept(sock, consumer.key, hello)
        wire.tune(sock, self.options, nodelay=role == wire.MESSAGES)
        return sock, role, consumer, conn, str(addr[0])

    def _admit(self) -> None:
        with contextlib.suppress(BlockingIOError):
            self.wake_r.recv(4096)
        while not self.admitted.empty():
            sock, role, consumer, conn, origin = self.admitted.get()
            if consumer.cid not in self.consumers:
                sock.close()
                continue
            sock.setblocking(False)
            if role == wire.BULK:
                # Numbered and welcomed here, once it is known: its message connection names it.
                conn = next(self.conns)
                try:
                    sock.send(framing.frame(framing.WELCOME, json.dumps({"conn": conn}).encode()))
                except OSError as exc:  # (a fresh socket's buffer takes a few bytes: it left)
                    log.warning("tcp writer from %s left before its welcome: %s", origin, exc)
                    sock.close()
                    continue
                bulk = _Bulk(sock, consumer, conn, origin)
                self.bulks[conn] = bulk
                self.sel.register(sock, selectors.EVENT_READ, bulk)
                self._to_consumer(consumer, framing.WELCOME, _U32.pack(conn))
            else:
                owner = self.bulks.get(conn)
                if owner is None or owner.consumer is not consumer or owner.msg_sock is not None:
                    sock.close()
                    continue
                owner.msg_sock = sock
                self.sel.register(sock, selectors.EVENT_READ, ("msg", owner))

    def _flush_messages(self, bulk: _Bulk) -> None:
        """Send what the writer's message socket takes now; wait for it to be writable for the rest.

        Never a blocking send: this loop serves every writer, and a writer busy sending bulk data
        reads its messages only between writes.
        """
        sock = bulk.msg_sock
        if sock is None or not bulk.msg_out:
            return
        try:
            sent = sock.send(bulk.msg_out, socket.MSG_DONTWAIT)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            self._drop_bulk(bulk, f"sending a message failed: {exc}")
            return
        del bulk.msg_out[:sent]
        waiting = bool(bulk.msg_out)
        if not waiting:
            bulk.msg_stalled_since = None
        elif sent or bulk.msg_stalled_since is None:
            bulk.msg_stalled_since = time.monotonic()
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if waiting else 0)
        self.sel.modify(sock, events, ("msg", bulk))

    def _drop_bulk(self, bulk: _Bulk, reason: str | None) -> None:
        if self.bulks.pop(bulk.conn, None) is None:
            return
        for sock in (bulk.sock, bulk.msg_sock):
            if sock is not None:
                self.sel.unregister(sock)
                sock.close()
        if bulk.dst is not None:
            bulk.dst.release()
        c = bulk.consumer
        if c.cid in self.consumers:
            self._flush_consumer(c)
            if reason is None:
                self._to_consumer(c, framing.BYE, _U32.pack(bulk.conn))
            else:
                log.warning("writer %d of consumer %d lost: %s", bulk.conn, c.cid, reason)
                self._to_consumer(c, framing.LOST, _U32.pack(bulk.conn) + reason.encode())

    def _msg_readable(self, bulk: _Bulk) -> None:
        msg_sock = bulk.msg_sock
        if msg_sock is None:
            return
        try:
            n = bulk.msg_reader.recv(msg_sock, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError as exc:
            self._drop_bulk(bulk, f"message connection failed: {exc}")
            return
        try:
            for kind, payload in bulk.msg_reader.frames():
                if kind != framing.MSG:
                    raise TransportError(f"unknown message frame type {kind}")
                self._to_consumer(bulk.consumer, framing.MSG, _U32.pack(bulk.conn) + payload)
        except TransportError as exc:
            self._drop_bulk(bulk, str(exc))
            return
        if n == 0 and bulk.conn in self.bulks:
            # A closing writer's bulk bytes (and its bye) may still be queued behind this EOF: only
            # the bulk connection ends the writer, so its last completions are never lost.
            self.sel.unregister(msg_sock)
            msg_sock.close()
            bulk.msg_sock = None
            bulk.msg_out.clear()  # nobody left to read them
            bulk.msg_stalled_since = None

    def _bulk_readable(self, bulk: _Bulk) -> None:
        sock = bulk.sock
        budget = _READ_BUDGET
        try:
            while budget > 0:
                if bulk.dst is None:
                    n = sock.recv_into(bulk.hdr_view[bulk.hdr_got :])
                    if n == 0:
                        self._drop_bulk(bulk, "writer closed the connection without saying bye")
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
                        self._drop_bulk(bulk, "writer closed the connection in the middle of a write")
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
            self._drop_bulk(bulk, f"bulk connection failed: {exc}")

    def _start_write(self, bulk: _Bulk) -> bool:
        kind, flags, handle, imm, offset, length = wire.WRITE_HEADER.unpack(bulk.hdr)
        bulk.hdr_got = 0
        if kind == wire.DATA_BYE:
            self._drop_bulk(bulk, None)
            return False
        region = bulk.consumer.regions.get(handle)
        if kind != wire.DATA or region is None or offset + length > region.nbytes:
            size = None if region is None else region.nbytes
            self._drop_bulk(
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

    # ---------------------------------------------------------------------------------------- loop

    def _check_stalls(self, now: float) -> None:
        limit = self.options.io_timeout
        for bulk in list(self.bulks.values()):
            if (bulk.dst is not None or bulk.hdr_got) and now - bulk.last > limit:
                self._drop_bulk(bulk, f"writer stalled mid-write for more than {limit} s")
            elif bulk.msg_stalled_since is not None and now - bulk.msg_stalled_since > limit:
                self._drop_bulk(bulk, f"writer stopped reading its messages for more than {limit} s")
        for c in list(self.consumers.values()):
            if c.stalled_since is not None and now - c.stalled_since > limit:
                log.warning("consumer %d stopped reading completions for %.1f s; dropping it", c.cid, limit)
                self._drop_consumer(c)

    def _should_exit(self, now: float) -> bool:
        if self.consumers:
            return False
        return self.ever_attached or now - self.started > self.options.connect_timeout * 4

    def run(self) -> None:
        tick = min(0.5, self.options.io_timeout / 4)
        while True:
            for key, events in self.sel.select(tick):
                data = key.data
                if isinstance(data, _Bulk):
                    if data.conn in self.bulks:
                        self._bulk_readable(data)
                elif isinstance(data, _Consumer):
                    if data.cid in self.consumers:
                        self._consumer_readable(data)
                elif isinstance(data, tuple):
                    if events & selectors.EVENT_WRITE and data[1].conn in self.bulks:
                        self._flush_messages(data[1])
                    if events & selectors.EVENT_READ and data[1].conn in self.bulks and data[1].msg_sock is not None:
                        self._msg_readable(data[1])
                elif data == "listen":
                    self._accept_writer()
                elif data == "control":
                    self._accept_consumer()
                else:
                    self._admit()
            for c in list(self.consumers.values()):
                if c.pending or c.out:
                    self._flush_consumer(c)
            now = time.monotonic()
            self._check_stalls(now)
            if self._should_exit(now):
                return


def _die_with_parent(parent: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    if os.getppid() != parent:
        os._exit(0)  # the parent died before the signal was armed


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m kspeed.rdma.tcp.receiver_process CONFIG_JSON``; prints ``ready PORT``."""
    config = json.loads((argv if argv is not None else sys.argv[1:])[0])
    logging.basicConfig(level=config.get("log_level", "WARNING"), format="kspeed-tcp-receiver: %(message)s")
    if not config["shared"]:
        _die_with_parent(config["parent"])
    try:
        proc = ReceiverProcess(config)
    except OSError as exc:
        print(f"error {exc}", flush=True)
        return 3
    print(f"ready {proc.port}", flush=True)
    sys.stdout.close()
    proc.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
