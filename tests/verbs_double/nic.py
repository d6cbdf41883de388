"""A simulated NIC port: its GIDs, keys and QP numbers, and the thread that moves the bytes.

One :class:`Port` exists per (process, device) that has an open context (contexts of the same
device in one process share it, as they share a port on hardware); it is started by the first
``open()`` and stopped, its thread joined and its sockets closed, by the last context's ``close()``.

The port's thread (a daemon named ``verbs-double-<device>``) runs a selector loop over: a
listening abstract Unix socket per RoCEv2 GID (``wire.socket_name``), the inbound connections of
requesters (:class:`~.responder.InboundConn`), the outbound connections of its own requester QPs
(:class:`~.conn.OutboundConn`), a wake-up socket pair rung by posts (the doorbell), and the
requesters' timers. Each turn the ready connections are served in an order shuffled by a seeded
RNG, each inbound connection moves at most ``knobs.service_quantum`` bytes per turn, and each new
burst of requests on a connection (input after it was idle for ``responder.QUIET_S``, 1 ms; a
stream that keeps coming is not held again) is first held for a random
(seeded) delay of up to ``knobs.reorder_jitter_s``: there is no ordering between QPs (IBA 9.5
orders one QP's requests only), and a rail that assumes some (e.g. that a later QP's immediate
implies an earlier QP's bytes landed) sees it broken about half of the time, as it would on a
fabric with several paths.

Everything -- MRs, CQs, QPs, queues -- is guarded by one lock per port (``port.lock``); the
thread holds it while it touches registered memory, which is what lets ``mr.close()`` and
``qp.close()`` guarantee that the NIC is done with the memory when they return.
"""

from __future__ import annotations

import contextlib
import os
import random
import selectors
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from .config import DeviceSpec, Knobs, gids_for
from .conn import Connection, OutboundConn, configure
from .responder import InboundConn
from .wire import socket_name

if TYPE_CHECKING:
    from .memory import MR
    from .qp import QP
    from .requester import Requester

__all__ = ["Port", "acquire_port", "live_threads", "release_port"]

_ROCE_V2 = 1  # IBV_GID_TYPE_SYSFS_ROCE_V2


class Port:
    """Port 1 of one simulated device in this process (see the module's docstring)."""

    def __init__(self, spec: DeviceSpec, knobs: Knobs) -> None:
        self.spec = spec
        self.knobs = knobs
        self.pid = os.getpid()
        self.lock = threading.RLock()
        self.gids = gids_for(self.pid, spec)
        self.qps: dict[int, QP] = {}
        self.mrs_by_lkey: dict[int, MR] = {}
        self.mrs_by_rkey: dict[int, MR] = {}
        self.mr_generation = 0
        ids = random.Random(f"{self.pid}/{spec.name}")
        self._next_key = ids.randrange(1 << 24, 1 << 31) & ~0xFF
        self._next_qpn = ids.randrange(0x100, 0x800000)
        self._rng = random.Random(f"{knobs.seed}/{spec.name}")
        self.refs = 0
        self.selector = selectors.DefaultSelector()
        self._active: set[Requester] = set()
        self._timed: set[Requester] = set()
        self._to_close: list[Connection] = []
        self._held: dict[InboundConn, float] = {}  # connections whose new burst waits (reordering)
        self._again: set[InboundConn] = set()  # connections with input left after their quantum
        self._connections: set[Connection] = set()
        self._stopping = False
        self._rung = False
        self._listeners: list[socket.socket] = []
        self._bell_r, self._bell_w = socket.socketpair()
        self._bell_r.setblocking(False)
        self._bell_w.setblocking(False)
        try:
            for gid, kind in self.gids:
                if kind != _ROCE_V2:
                    continue
                listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self._listeners.append(listener)
                listener.bind(socket_name(gid))
                listener.listen(512)
                listener.setblocking(False)
                self.selector.register(listener, selectors.EVENT_READ, self._accept_from(listener))
        except OSError:
            self._close_sockets()
            raise
        self.selector.register(self._bell_r, selectors.EVENT_READ, self._drain_bell)
        self.thread = threading.Thread(target=self._run, name=f"verbs-double-{spec.name}", daemon=True)
        self.thread.start()

    # -- identifiers --------------------------------------------------------------------------------

    def new_keys(self) -> tuple[int, int]:
        """A fresh (lkey, rkey) pair: distinct from each other and from every earlier key of the port."""
        base = self._next_key
        self._next_key = (self._next_key + 0x100) & 0xFFFFFFFF
        return (base | 0x11), (base | 0x22)

    def new_qpn(self) -> int:
        qpn = self._next_qpn
        self._next_qpn = (self._next_qpn + 1) & 0xFFFFFF or 0x100
        return qpn

    # -- called with the lock held, from any thread -------------------------------------------------

    def kick(self, requester: Requester) -> None:
        """Ring the doorbell: the NIC thread will let ``requester`` transmit."""
        self._active.add(requester)
        self._ring()

    def schedule(self, requester: Requester) -> None:
        """``requester`` has a timer; the loop wakes up for it."""
        self._timed.add(requester)
        self._ring()

    def drop_conn(self, conn: Connection) -> None:
        """Forget a connection's queue now; its socket is closed by the NIC thread."""
        conn.discard()
        if isinstance(conn, OutboundConn):
            conn.requester = None
        self._to_close.append(conn)
        self._ring()

    def hold(self, conn: InboundConn) -> bool:
        """Maybe hold a connection's new burst of requests for a random (seeded) moment; ``True`` if held.

        Independent random delays per connection, i.e. per requester QP, are what make two QPs'
        requests arrive in either order, however close together they were posted.
        """
        jitter = self.knobs.reorder_jitter_s
        if jitter <= 0:
            return False
        conn.set_reading(False)
        self._held[conn] = time.monotonic() + self._rng.uniform(0, jitter)
        return True

    def again(self, conn: InboundConn) -> None:
        """``conn`` has input it did not get to in its turn: serve it in the next turn."""
        self._again.add(conn)

    def _ring(self) -> None:
        if not self._rung and threading.current_thread() is not self.thread:
            self._rung = True
            with contextlib.suppress(OSError):
                self._bell_w.send(b"!")

    # -- called in the NIC thread -------------------------------------------------------------------

    def connect(self, gid: str, requester: Requester) -> OutboundConn | None:
        """A connection to the NIC owning RoCEv2 GID ``gid``, or ``None`` when none answers there."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            configure(sock)
            sock.connect(socket_name(gid))
        except OSError:  # nobody listens there (or its backlog is full): the packets are lost
            sock.close()
            return None
        conn = OutboundConn(self, sock, requester)
        self._connections.add(conn)
        return conn

    def connection_failed(self, conn: Connection) -> None:
        """The peer end of ``conn`` is gone."""
        if isinstance(conn, OutboundConn) and conn.requester is not None:
            requester = conn.requester
            self.drop_conn(conn)
            requester.link_lost(time.monotonic())
        else:
            if isinstance(conn, InboundConn):
                conn.abandon_all()
            self.drop_conn(conn)

    close_connection = connection_failed

    def _accept_from(self, listener: socket.socket) -> Any:
        def accept(_mask: int) -> None:
            while True:
                try:
                    sock, _ = listener.accept()
                except (BlockingIOError, InterruptedError):
                    return
                except OSError:
                    return
                configure(sock)
                self._connections.add(InboundConn(self, sock))

        return accept

    def _drain_bell(self, _mask: int) -> None:
        try:
            while self._bell_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        self._rung = False

    def _run(self) -> None:
        selector = self.selector
        timeout: float | None = 0.0
        while True:
            events = selector.select(timeout)
            with self.lock:
                if self._stopping:
                    return
                self._rng.shuffle(events)
                for key, mask in events:
                    conn = key.fileobj
                    if isinstance(conn, socket.socket) and conn.fileno() < 0:
                        continue
                    key.data(mask)
                now = time.monotonic()
                again, self._again = self._again, set()
                for conn in self._rng.sample(sorted(again, key=id), len(again)):
                    if not conn.dead and conn.reading:
                        conn.service()
                self._release_held(now)
                for requester in list(self._timed):
                    due = requester.due()
                    if due is None:
                        self._timed.discard(requester)
                    elif due <= now:
                        requester.on_timer(now)
                active, self._active = self._active, set()
                for requester in self._rng.sample(sorted(active, key=id), len(active)):
                    requester.transmit(now)
                self._close_dropped()
                timeout = self._next_timeout(time.monotonic())

    def _release_held(self, now: float) -> None:
        """Serve the held connection that is due first (one per turn: the lock is let go in between)."""
        for conn in [conn for conn in self._held if conn.dead]:
            del self._held[conn]
        due = [(when, id(conn), conn) for conn, when in self._held.items() if when <= now]
        if due:
            _, _, conn = min(due)
            del self._held[conn]
            conn.set_reading(True)
            conn.service()

    def _next_timeout(self, now: float) -> float | None:
        if self._active or self._again or any(when <= now for when in self._held.values()):
            return 0.0
        dues = [due for due in (r.due() for r in self._timed) if due is not None]
        dues += self._held.values()
        return max(0.0, min(dues) - now) if dues else None

    def _close_dropped(self) -> None:
        for conn in self._to_close:
            if conn in self._connections:
                self._connections.discard(conn)
                with contextlib.suppress(KeyError, ValueError):
                    self.selector.unregister(conn.sock)
                conn.sock.close()
        self._to_close.clear()

    # -- lifetime -----------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop the thread (joined) and close every socket; called by the last context's close()."""
        with self.lock:
            self._stopping = True
            self._rung = False
            with contextlib.suppress(OSError):
                self._bell_w.send(b"!")
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout=10)
        with self.lock:
            for conn in list(self._connections):
                if isinstance(conn, InboundConn):
                    conn.abandon_all()
                conn.discard()
            self._close_sockets()

    def _close_sockets(self) -> None:
        for conn in list(self._connections):
            conn.sock.close()
        self._connections.clear()
        for sock in (*self._listeners, self._bell_r, self._bell_w):
            sock.close()
        self._listeners.clear()
        self.selector.close()


_ports: dict[str, Port] = {}
_ports_pid = os.getpid()
_registry_lock = threading.Lock()


def acquire_port(spec: DeviceSpec, knobs: Knobs) -> Port:
    """The port of device ``spec`` in this process, started if it is not running."""
    global _ports_pid
    with _registry_lock:
        if _ports_pid != os.getpid():  # a forked child: the parent's ports (and threads) are not ours
            _ports.clear()
            _ports_pid = os.getpid()
        port = _ports.get(spec.name)
        if port is None:
            port = _ports[spec.name] = Port(spec, knobs)
        port.refs += 1
        return port


def release_port(port: Port) -> None:
    """One context of ``port`` closed; the last one stops it."""
    with _registry_lock:
        port.refs -= 1
        if port.refs > 0:
            return
        if _ports.get(port.spec.name) is port:
            del _ports[port.spec.name]
    port.stop()


def live_threads() -> list[threading.Thread]:
    """The double's NIC threads still running in this process (for leak checks)."""
    return [t for t in threading.enumerate() if t.name.startswith("verbs-double-") and t.is_alive()]
