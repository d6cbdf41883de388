"""The skeleton of the receiver processes: consumers, dialers' handshakes, the loop, the entry point.

A receiver process receives writes for the consumers (training processes) of one node and runs
apart from them: a receive loop inside a busy Python process loses most of its bandwidth to the GIL.
Each rail's receiver (:class:`kspeed.rdma.tcp.receiver.TcpReceiver`,
:class:`kspeed.rdma.verbs.receiver.VerbsReceiver`) starts its own as ``python -m
kspeed.rdma.<rail>.receiver_process CONFIG_JSON``; the rail's module subclasses
:class:`ReceiverProcessBase`, which this module holds, and that process runs it. What every rail
shares lives here:

* the control socket: consumers attach over an abstract Unix socket (uid checked), hand over their
  key and their rings (memfds, or on ``verbs`` dma-bufs) and exchange messages with their writers
  through it;
* the writers' TCP listener: dialers are capped per address and in total; handshakes run in
  short-lived threads so a slow dialer never stalls the data path, and a
  :class:`~kspeed.admission.Gate` gives each ``connect_timeout`` seconds in all (not per read) and
  caps them per dialing address and in total, letting a newcomer in at a cap by closing the oldest:
  dialers that drip their hello cannot keep a new holder's feeders out during a failover.
  Authenticated dialers reach the loop through a queue and a wake socket;
* the single-threaded selector loop: control frames, messages both ways (never a blocking send),
  completions forwarded as one frame per consumer per loop turn, stalled peers dropped, and the exit
  rule: the process ends when its consumer goes (parent-death signal and EOF on the control socket),
  or, when shared by name, when the last consumer has gone;
* :meth:`ReceiverProcessBase.main`: config, logging, the parent-death signal, ``ready PORT``.

A rail adds what is its own: how a dialer's hello reads and what admitting it builds (bulk and
message sockets on ``tcp``; a queue pair and memory registrations on ``verbs``), what dropping a
writer releases, and any work between waits (``verbs`` polls its completion queue).
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
from abc import ABC, abstractmethod
from itertools import count
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from kspeed.admission import Gate, Ticket, worth_telling
from kspeed.errors import KSpeedError, TransportError
from kspeed.rdma import auth, framing
from kspeed.rdma.memory import MemfdSegment
from kspeed.rdma.options import RailOptions

__all__ = [
    "MAX_HANDSHAKES",
    "MAX_HANDSHAKES_PER_PEER",
    "MAX_WRITERS",
    "MAX_WRITERS_PER_PEER",
    "Consumer",
    "HeldRegion",
    "ReceiverProcessBase",
    "WriterLink",
]

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
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


class HeldRegion(Protocol):
    """A consumer's ring as a receiver process holds it (a mapped memfd, a dma-buf)."""

    def close(self) -> None:
        """Let the ring go (unmap it, close its descriptor)."""


RegionT = TypeVar("RegionT", bound=HeldRegion)


class Consumer(Generic[RegionT]):
    """A consumer attached over the control socket: its key, its rings and what it is owed.

    Args:
        cid: the consumer's id in this process (dialers name it in their hello).
        sock: its control connection (non-blocking).
    """

    def __init__(self, cid: int, sock: socket.socket) -> None:
        self.cid = cid
        self.sock = sock
        self.key: bytes | None = None  # set by its attach call; dialers authenticate against it
        self.reader = framing.FrameReader(1 << 16)
        self.regions: dict[int, RegionT] = {}
        self.pending = array.array("I")  # (conn, imm) pairs, sent as one frame per loop turn
        self.out = bytearray()  # frames its socket has not taken yet
        self.stalled_since: float | None = None


class WriterLink(Generic[RegionT]):
    """An admitted writer as the shared loop sees it: whose it is, its id and its message socket.

    Args:
        consumer: the consumer it writes for.
        conn: its connection id (completions and messages name it).
        origin: the dialer's address.
        msg_sock: the socket its messages travel on (``None`` until it is connected).
    """

    def __init__(self, consumer: Consumer[RegionT], conn: int, origin: str, msg_sock: socket.socket | None) -> None:
        self.consumer = consumer
        self.conn = conn
        self.origin = origin
        self.msg_sock = msg_sock
        self.msg_reader = framing.FrameReader(1 << 16)
        self.msg_out = bytearray()  # messages for the writer its socket has not taken yet
        self.msg_stalled_since: float | None = None


WriterT = TypeVar("WriterT", bound="WriterLink[Any]")


class ReceiverProcessBase(ABC, Generic[RegionT, WriterT]):
    """The loop of a receiver process, less what its rail does with writers.

    Args:
        config: the receiver's settings (the JSON of the command line; see :meth:`main`).
    """

    #: The rail, as the log lines' prefix names it.
    rail: ClassVar[str]
    #: What a lost writer is called in the warning about it.
    writer_noun: ClassVar[str] = "writer"
    #: What a writer's message socket is called in the reason it was lost.
    message_link: ClassVar[str] = "message connection"
    #: Errors of start-up that :meth:`main` reports as ``error ...`` rather than raising.
    startup_errors: ClassVar[tuple[type[Exception], ...]] = (OSError,)

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
        # Handshake threads hand authenticated dialers over through the queue and wake the loop.
        self.wake_r, self.wake_w = socket.socketpair()
        self.wake_r.setblocking(False)
        self.admitted: queue.SimpleQueue[tuple[socket.socket, Consumer[RegionT], str, tuple]] = queue.SimpleQueue()
        self.consumers: dict[int, Consumer[RegionT]] = {}
        self.writers: dict[int, WriterT] = {}
        # (every rail's dialers speak TCP until they are authenticated, hence the gate's name)
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
        consumer: Consumer[RegionT] = Consumer(next(self.cids), sock)
        self.consumers[consumer.cid] = consumer
        self.ever_attached = True
        self.sel.register(sock, selectors.EVENT_READ, consumer)

    def _consumer_readable(self, c: Consumer[RegionT]) -> None:
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

    def _consumer_frame(self, c: Consumer[RegionT], kind: int, payload: bytes) -> None:
        """Serve one control frame of a consumer.

        Raises:
            KSpeedError, ValueError, KeyError: the consumer broke the control protocol (it is dropped).
        """
        if kind == framing.CALL:
            call = json.loads(payload)
            if call["op"] == "attach":
                c.key = bytes.fromhex(call["key"])
                self._to_consumer(c, framing.REPLY, json.dumps(self._attach_reply(c)).encode())
            elif call["op"] == "disconnect":
                writer = self.writers.get(int(call["conn"]))
                if writer is not None and writer.consumer is c:
                    self._drop_writer(writer, None)
        elif kind == framing.REGION:
            desc = json.loads(payload)
            handle = int(desc["handle"])
            c.regions[handle] = self._open_region(c, desc)
            self._to_consumer(c, framing.REPLY, payload)
            self._region_added(c, handle)
        elif kind == framing.MSG:
            conn = _U32.unpack_from(payload)[0]
            writer = self.writers.get(conn)
            if writer is None or writer.consumer is not c or writer.msg_sock is None:
                self._to_consumer(c, framing.LOST, _U32.pack(conn) + b"no such writer connected")
                return
            if len(writer.msg_out) + len(payload) > _MESSAGE_BACKLOG:
                self._drop_writer(writer, f"it left more than {_MESSAGE_BACKLOG >> 20} MiB of messages unread")
                return
            self._to_writer(writer, framing.MSG, payload[4:])
        else:
            raise TransportError(f"unknown control frame type {kind}")

    def _attach_reply(self, c: Consumer[RegionT]) -> dict[str, Any]:
        """What an attaching consumer is told: its id and the port its writers dial."""
        return {"consumer": c.cid, "port": self.port}

    @abstractmethod
    def _open_region(self, c: Consumer[RegionT], desc: dict[str, Any]) -> RegionT:
        """Take hold of the ring a consumer announced (its descriptor came with the frame).

        Args:
            c: the consumer.
            desc: the announcement (``handle``, ``length`` and what the rail adds).

        Raises:
            TransportError: the announcement came without its descriptor.
        """

    def _region_added(self, c: Consumer[RegionT], handle: int) -> None:
        """Called once ring ``handle`` of ``c`` is held and the consumer told; nothing to do by default."""

    @staticmethod
    def _attach_memfd(c: Consumer[Any], desc: dict[str, Any]) -> MemfdSegment:
        """Map the memfd ring that came with ``desc``.

        Raises:
            TransportError: no descriptor came with the announcement.
        """
        if not c.reader.fds:
            raise TransportError("region announced without its descriptor")
        return MemfdSegment.attach(c.reader.fds.popleft(), int(desc["length"]))

    def _to_consumer(self, c: Consumer[RegionT], kind: int, payload: bytes) -> None:
        c.out += framing.frame(kind, payload)
        self._flush_consumer(c)

    def _flush_consumer(self, c: Consumer[RegionT]) -> None:
        """Send the consumer its pending completions and what its socket takes now, never blocking."""
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

    def _drop_consumer(self, c: Consumer[RegionT]) -> None:
        if self.consumers.pop(c.cid, None) is None:
            return
        log.debug("consumer %d left", c.cid)
        for writer in [w for w in self.writers.values() if w.consumer is c]:
            self._drop_writer(writer, None)
        self.sel.unregister(c.sock)
        c.sock.close()
        for region in c.regions.values():
            region.close()
        for fd in c.reader.fds:
            os.close(fd)

    # ------------------------------------------------------------------------------------- writers

    def _accept_writer(self) -> None:
        sock, addr = self.listener.accept()
        origin = str(addr[0])
        mine = sum(1 for w in self.writers.values() if w.origin == origin)
        if len(self.writers) >= MAX_WRITERS or mine >= MAX_WRITERS_PER_PEER:
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
        # (waits, in this loop, only while a flood's shut handshakes outnumber WIND_DOWN: a second at most)
        ticket = self.gate.enter(sock, origin)
        if ticket is None:  # (the gate logged it)
            sock.close()
            return
        threading.Thread(target=self._handshake, args=(sock, addr, ticket), daemon=True).start()

    def _handshake(self, sock: socket.socket, addr: tuple, ticket: Ticket) -> None:
        """Authenticate a dialer (in its own thread, inside the gate); hand it to the loop through the queue."""
        admitted: tuple[socket.socket, Consumer[RegionT], str, tuple] | None
        try:
            consumer, details = self._authenticate(sock, addr)
        except (KSpeedError, OSError, struct.error, ValueError, KeyError) as exc:
            if not ticket.ended:  # (the gate counts and logs those it ended)
                self.failed += 1  # an unauthenticated dialer must not flood the job's stderr
                level = logging.WARNING if worth_telling(self.failed) else logging.DEBUG
                log.log(level, "refused dialer %s: %s (%d refused handshakes so far)", addr, exc, self.failed)
            admitted = None
        else:
            admitted = (sock, consumer, str(addr[0]), details)
        finally:
            self.gate.leave(ticket)
        if admitted is None or ticket.ended:
            sock.close()
            return
        self.admitted.put(admitted)
        self.wake_w.send(b"\0")

    @abstractmethod
    def _authenticate(self, sock: socket.socket, addr: tuple) -> tuple[Consumer[RegionT], tuple]:
        """Read a dialer's hello and authenticate it (in its handshake thread, inside the gate).

        Rails build it from :meth:`_read_hello` and :meth:`_accept_hello`.

        Returns:
            The consumer it writes for, and what :meth:`_admit_writer` takes besides.

        Raises:
            KSpeedError, OSError, struct.error, ValueError, KeyError: the dialer is refused (the
                caller closes it).
        """

    def _read_hello(self, sock: socket.socket, size: int, what: str) -> bytes:
        """The first ``size`` bytes a dialer sends, each read within ``connect_timeout``.

        Raises:
            KSpeedError, OSError: the dialer left or was too slow.
        """
        sock.settimeout(self.options.connect_timeout)  # per read; the gate bounds the whole handshake
        return auth.recv_exact(sock, size, what)

    def _accept_hello(self, sock: socket.socket, addr: tuple, hello: bytes, cid: int, known: bool) -> Consumer[RegionT]:
        """Check a parsed hello and run the key exchange with the consumer it names.

        Args:
            sock: the dialer.
            addr: its address (for the errors).
            hello: the hello's bytes (the exchange authenticates them).
            cid: the consumer it asked for.
            known: whether its magic (and anything else the rail checks) was right.

        Raises:
            TransportError: the hello is foreign, or names no attached consumer.
            KSpeedError, OSError: the key exchange failed.
        """
        consumer = self.consumers.get(cid)
        if not known:
            raise TransportError(f"unknown hello from {addr}")
        if consumer is None or consumer.key is None:
            raise TransportError(f"dialer {addr} asked for consumer {cid}, which is not attached")
        auth.accept(sock, consumer.key, hello)
        return consumer

    def _admit(self) -> None:
        """Take in the dialers the handshake threads authenticated (the wake socket said so)."""
        with contextlib.suppress(BlockingIOError):
            self.wake_r.recv(4096)
        while not self.admitted.empty():
            sock, consumer, origin, details = self.admitted.get()
            if consumer.cid not in self.consumers:  # it left during the handshake
                sock.close()
                continue
            self._admit_writer(sock, consumer, origin, details)

    @abstractmethod
    def _admit_writer(self, sock: socket.socket, consumer: Consumer[RegionT], origin: str, details: tuple) -> None:
        """Set up an authenticated dialer of a consumer still attached (in the loop).

        A new writer is announced with :meth:`_add_writer`; a dialer refused here is closed.

        Args:
            sock: the dialer's socket (blocking, with the handshake's timeout).
            consumer: the consumer it writes for.
            origin: the dialer's address.
            details: the rest of what :meth:`_authenticate` returned.
        """

    def _add_writer(self, writer: WriterT) -> None:
        """Count a new writer in and tell its consumer (a ``WELCOME`` frame naming its connection).

        The rail registers its sockets with the selector first: telling the consumer may drop it,
        and with it every writer of its.
        """
        self.writers[writer.conn] = writer
        self._to_consumer(writer.consumer, framing.WELCOME, _U32.pack(writer.conn))

    def _to_writer(self, writer: WriterT, kind: int, payload: bytes) -> None:
        writer.msg_out += framing.frame(kind, payload)
        self._flush_messages(writer)

    def _flush_messages(self, writer: WriterT) -> None:
        """Send what the writer's message socket takes now; wait for it to be writable for the rest.

        Never a blocking send: this loop serves every writer, and a writer busy sending bulk data
        reads its messages only between writes.
        """
        sock = writer.msg_sock
        if sock is None or not writer.msg_out:
            return
        try:
            sent = sock.send(writer.msg_out, socket.MSG_DONTWAIT)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            self._drop_writer(writer, f"sending a message failed: {exc}")
            return
        del writer.msg_out[:sent]
        waiting = bool(writer.msg_out)
        if not waiting:
            writer.msg_stalled_since = None
        elif sent or writer.msg_stalled_since is None:
            writer.msg_stalled_since = time.monotonic()
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if waiting else 0)
        self.sel.modify(sock, events, ("msg", writer))

    def _msg_readable(self, writer: WriterT) -> None:
        sock = writer.msg_sock
        if sock is None:
            return
        try:
            n = writer.msg_reader.recv(sock, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError as exc:
            self._drop_writer(writer, f"{self.message_link} failed: {exc}")
            return
        try:
            for kind, payload in writer.msg_reader.frames():
                if not self._writer_frame(writer, kind, payload):
                    return
        except TransportError as exc:
            self._drop_writer(writer, str(exc))
            return
        if n == 0:
            self._messages_ended(writer)

    def _writer_frame(self, writer: WriterT, kind: int, payload: bytes) -> bool:
        """Serve one frame from a writer's message socket: a message goes to its consumer.

        Returns:
            Whether to go on reading the writer's frames (``False`` once it is dropped).

        Raises:
            TransportError: the frame is foreign (the writer is dropped with this reason).
        """
        if kind != framing.MSG:
            raise TransportError(f"unknown message frame type {kind}")
        self._to_consumer(writer.consumer, framing.MSG, _U32.pack(writer.conn) + payload)
        return True

    @abstractmethod
    def _messages_ended(self, writer: WriterT) -> None:
        """The writer closed its message socket (it may have been dropped meanwhile)."""

    def _drop_writer(self, writer: WriterT, reason: str | None) -> None:
        """Let a writer go and tell its consumer: ``BYE`` (``reason`` ``None``) or ``LOST`` and why."""
        if self.writers.pop(writer.conn, None) is None:
            return
        self._release_writer(writer)
        c = writer.consumer
        if c.cid in self.consumers:
            self._flush_consumer(c)  # (its completions before its end)
            if reason is None:
                self._to_consumer(c, framing.BYE, _U32.pack(writer.conn))
            else:
                log.warning("%s %d of consumer %d lost: %s", self.writer_noun, writer.conn, c.cid, reason)
                self._to_consumer(c, framing.LOST, _U32.pack(writer.conn) + reason.encode())

    @abstractmethod
    def _release_writer(self, writer: WriterT) -> None:
        """Close what a writer holds (sockets, selector registrations, device objects); it is out of :attr:`writers`."""

    # ---------------------------------------------------------------------------------------- loop

    def _stall(self, writer: WriterT, now: float, limit: float) -> str | None:
        """Why ``writer`` is to be dropped as stalled for more than ``limit`` seconds, or ``None``."""
        if writer.msg_stalled_since is not None and now - writer.msg_stalled_since > limit:
            return f"writer stopped reading its messages for more than {limit} s"
        return None

    def _check_stalls(self, now: float) -> None:
        limit = self.options.io_timeout
        for writer in list(self.writers.values()):
            reason = self._stall(writer, now, limit)
            if reason is not None:
                self._drop_writer(writer, reason)
        for c in list(self.consumers.values()):
            if c.stalled_since is not None and now - c.stalled_since > limit:
                log.warning("consumer %d stopped reading completions for %.1f s; dropping it", c.cid, limit)
                self._drop_consumer(c)

    def _should_exit(self, now: float) -> bool:
        if self.consumers:
            return False
        return self.ever_attached or now - self.started > self.options.connect_timeout * 4

    def _wait(self, tick: float) -> float:
        """Seconds the loop waits for its sockets each turn."""
        return tick

    def _readable(self, data: object) -> None:
        """Serve a selector key the rail registered itself (the base registers none of its own kind).

        Raises:
            TypeError: no rail registered it.
        """
        raise TypeError(f"unexpected selector key {data!r}")

    def _between_waits(self) -> None:
        """The rail's work after each wait, before completions are forwarded; none by default."""

    def run(self) -> None:
        """Serve until :meth:`_should_exit` says so."""
        tick = min(0.5, self.options.io_timeout / 4)
        while True:
            for key, events in self.sel.select(self._wait(tick)):
                data = key.data
                if isinstance(data, Consumer):
                    if data.cid in self.consumers:
                        self._consumer_readable(data)
                elif isinstance(data, tuple):  # ("msg", writer): a writer's message socket
                    writer = data[1]
                    if events & selectors.EVENT_WRITE and writer.conn in self.writers:
                        self._flush_messages(writer)
                    if events & selectors.EVENT_READ and writer.conn in self.writers and writer.msg_sock is not None:
                        self._msg_readable(writer)
                elif data == "listen":
                    self._accept_writer()
                elif data == "control":
                    self._accept_consumer()
                elif data == "wake":
                    self._admit()
                else:
                    self._readable(data)
            self._between_waits()
            for c in list(self.consumers.values()):
                if c.pending or c.out:
                    self._flush_consumer(c)
            now = time.monotonic()
            self._check_stalls(now)
            if self._should_exit(now):
                return

    # ---------------------------------------------------------------------------------- entry point

    @classmethod
    def main(cls, argv: list[str] | None = None) -> int:
        """Run the process: ``python -m kspeed.rdma.<rail>.receiver_process CONFIG_JSON``.

        Prints ``ready PORT`` once it listens (or ``error ...`` and returns 3), then serves.

        Args:
            argv: the arguments (``sys.argv[1:]`` when ``None``): the config as JSON.
        """
        config = json.loads((argv if argv is not None else sys.argv[1:])[0])
        logging.basicConfig(level=config.get("log_level", "WARNING"), format=f"kspeed-{cls.rail}-receiver: %(message)s")
        if not config["shared"]:
            _die_with_parent(config["parent"])
        try:
            proc = cls(config)
        except cls.startup_errors as exc:
            print(f"error {exc}", flush=True)
            return 3
        print(f"ready {proc.port}", flush=True)
        sys.stdout.close()
        proc.run()
        return 0


def _die_with_parent(parent: int) -> None:
    """Have the kernel kill this process when its parent (the one consumer) dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    if os.getppid() != parent:
        os._exit(0)  # the parent died before the signal was armed
