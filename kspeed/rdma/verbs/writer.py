"""Writer side of the ``verbs`` rail: RDMA writes from registered memory into a receiver's rings.

One RC queue pair per connection, on the NIC this process shares among its connections
(:mod:`kspeed.rdma.verbs.nic`). ``write_batch`` posts a batch as a chain of ``RDMA_WRITE``s through
the extended QP (``wr_start`` ... ``wr_complete``), the last one ``RDMA_WRITE_WITH_IMM`` with the
first immediate; each further immediate is a 1-byte ``RDMA_WRITE_WITH_IMM`` of the batch's last
byte (a zero-length write can be dropped on virtualised RDMA), so RC ordering puts every
completion after every byte. Only the last work request of each chain is signalled. A batch
returns once its completions are in: the source may then be reused, and an error is the batch's.
Immediates never exceed the receiver's credits. Writes from arbitrary buffers (``write``,
``write_many``) go through a registered staging buffer.
"""

from __future__ import annotations

import contextlib
import json
import logging
import select
import socket
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

import numpy as np

from kspeed.errors import KSpeedError, PeerLostError, RangeError, TransportError
from kspeed.rdma import auth, framing
from kspeed.rdma.base import RegionKey, Sources, WriteOp, Writer, as_bytes_view, check_imm, check_range
from kspeed.rdma.options import RailOptions
from kspeed.rdma.tcp import wire as tcp_wire
from kspeed.rdma.write_batch import WriteBatch, check_batch

from . import wire
from .api import VerbsApi
from .nic import QpMaterial, choose_nic, new_psn, open_nic, release_nic

__all__ = ["VerbsWriter", "wc_status"]

log = logging.getLogger(__name__)

#: Send queue depth of a writer's queue pair; a chain is at most half of it.
SQ_DEPTH = 1024
_CHAIN = SQ_DEPTH // 2
_STAGING = 1 << 20


def wc_status(e: Any, status: int) -> str:
    """``IBV_WC_REM_ACCESS_ERR`` for status 10: the name a completion's status has in verbs.h."""
    for name in dir(e):
        if name.startswith("IBV_WC_") and name.endswith("_ERR") and getattr(e, name) == status:
            return name
    return "IBV_WC_SUCCESS" if status == 0 else f"status {status}"


class VerbsWriter(framing.OneSocket, Writer):
    """Writer side of the ``verbs`` rail."""

    rail = "verbs"

    def __init__(self, material: bytes, options: RailOptions, api: VerbsApi) -> None:
        info, key = auth.open_material(material, "verbs", ("host", "port", "consumer", "nic"), options.token)
        try:
            host, port, consumer = str(info["host"]), int(info["port"]), int(info["consumer"])
        except (ValueError, TypeError) as exc:
            raise TransportError(f"malformed verbs connection material: {exc}") from exc
        self._options = options
        self._api = api
        self._e = api.e
        self.conn = 0
        self._peer = f"{host}:{port} (NIC {info['nic']})"
        self._messages: deque[bytes] = deque()
        self._reader = framing.FrameReader(1 << 16)
        self._keys: dict[int, tuple[int, int, int]] = {}
        self._credits = 0
        self._dead: PeerLostError | None = None
        self._closed = False
        self._qp: Any = None
        self._cq: Any = None
        self._staging: np.ndarray | None = None
        self._head = 0
        # chains posted and not yet completed: (last wr_id, work requests, staging span or None)
        self._inflight: deque[tuple[int, int, tuple[int, int] | None]] = deque()
        self._outstanding = 0
        self._next_id = 0
        self._sge = api.SGE(0, 0, 0)  # one SGE, refilled per work request (wr_set_sge copies it)
        options.check_dial(host, port)
        self._nic = open_nic(api, choose_nic(api, options.nic))
        try:
            self._sock = self._dial(host, port, consumer, key)
        except BaseException:
            release_nic(self._nic)
            raise
        try:
            self._connect()
        except BaseException:
            self._release()
            raise
        log.info("verbs: writer %d -> %s over NIC %s", self.conn, self._peer, self._nic.name)

    # ----------------------------------------------------------------------------------- setup

    def _dial(self, host: str, port: int, consumer: int, key: bytes) -> socket.socket:
        hello = wire.HELLO.pack(wire.MAGIC, consumer)
        return tcp_wire.dial((host, port), self._options, hello, key, what=f"verbs receiver {self._peer}", nodelay=True)

    def _connect(self) -> None:
        nic = self._nic
        try:
            self._cq = self._api.create_cq(nic.context, SQ_DEPTH)
            self._qp = nic.create_qp(self._cq, self._cq, None, SQ_DEPTH)
            nic.to_init(self._qp, remote_write=False)
            psn = new_psn()
            setup = {"qp": nic.material(self._qp, psn).to_dict(), "nic": nic.name}
            self._sock.settimeout(self._options.connect_timeout)
            self._sock.sendall(framing.frame(wire.SETUP, json.dumps(setup).encode()))
            welcome = self._await_welcome()
            peer = QpMaterial.from_dict(welcome["qp"])
            nic.to_rtr(self._qp, peer, peer.psn)
            nic.to_rts(self._qp, psn)
        except KSpeedError:
            raise
        except OSError as exc:
            raise framing.lost(f"setting up verbs connection to {self._peer}", exc) from exc
        except Exception as exc:  # pyverbs' own errors from the device
            raise TransportError(f"setting up verbs connection to {self._peer}: {exc}") from exc
        self.conn = int(welcome["conn"])
        self._credits = int(welcome["credits"])
        self._add_keys(welcome["keys"])
        self._sock.settimeout(None)
        self._sock.setblocking(False)

    def _await_welcome(self) -> dict:
        while True:
            if self._reader.recv(self._sock) == 0:
                raise framing.lost(f"verbs receiver {self._peer} closed the connection during setup")
            for kind, payload in self._reader.frames():
                if kind == framing.WELCOME:
                    return json.loads(payload)
                if kind == framing.ERROR:
                    raise TransportError(f"verbs receiver {self._peer} refused the connection: {payload.decode()}")

    def _add_keys(self, keys: dict) -> None:
        for handle, k in keys.items():
            self._keys[int(handle)] = (int(k["rkey"]), int(k["addr"]), int(k["length"]))

    # ------------------------------------------------------------------------------ setup socket

    def _lost(self, what: str, exc: BaseException | None = None) -> PeerLostError:
        if self._dead is None:
            self._dead = framing.lost(f"verbs writer {self.conn} to {self._peer}: {what}", exc, self.conn)
        return self._dead

    def _drain(self, wait: float = 0.0) -> bool:
        """Take in what the receiver sent (messages, credits, keys); whether anything came."""
        if self._dead is not None:
            raise self._dead
        if wait > 0:
            poller = select.poll()
            poller.register(self._sock, select.POLLIN)
            if not poller.poll(wait * 1e3):
                return False
        try:
            n = self._reader.recv(self._sock)
        except BlockingIOError:
            return False
        except OSError as exc:
            raise self._lost("the setup connection failed", exc) from exc
        for kind, payload in self._reader.frames():
            if kind == framing.MSG:
                self._messages.append(payload)
            elif kind == wire.CREDIT:
                self._credits += int.from_bytes(payload[:4], "little")
            elif kind == wire.KEYS:
                self._add_keys(json.loads(payload))
            elif kind == framing.LOST:
                raise self._lost(payload.decode(errors="replace"))
        if n == 0:
            raise self._lost("the receiver closed the connection")
        return True

    def _send_frame(self, data: bytes) -> None:
        if self._dead is not None:
            raise self._dead
        try:
            framing.send_draining(self._sock, data, self._options.io_timeout, self._drain)
        except OSError as exc:
            raise self._lost("sending on the setup connection", exc) from exc

    # ------------------------------------------------------------------------------------ writes

    def _key(self, handle: int) -> tuple[int, int, int]:
        deadline = time.monotonic() + self._options.io_timeout
        while handle not in self._keys:
            if time.monotonic() > deadline:
                raise self._lost(f"no rkey for ring {handle} within the I/O timeout")
            self._drain(0.01)
        return self._keys[handle]

    def write(self, key: RegionKey, srcs: Sources, offset: int = 0, imm: int | None = None) -> None:
        self.write_many(key, [(srcs, offset, imm)])

    def write_many(self, key: RegionKey, ops: Iterable[WriteOp]) -> None:
        """Copy the ops' bytes into the staging ring and post them; returns without waiting for the
        NIC (the ring's bytes are not reused before their chain completed; errors surface on a later
        call, as a socket's do)."""
        views: list[memoryview] = []
        starts: list[int] = []
        lengths: list[int] = []
        dsts: list[int] = []
        imms: list[int] = []
        total = 0
        for srcs, offset, imm in ops:
            check_imm(imm)
            parts = [as_bytes_view(s) for s in srcs] if isinstance(srcs, (list, tuple)) else [as_bytes_view(srcs)]
            nbytes = sum(v.nbytes for v in parts)
            check_range(key, offset, nbytes)
            views.extend(parts)
            starts.append(total)
            lengths.append(nbytes)
            dsts.append(offset)
            total += nbytes
            if imm is not None:
                imms.append(imm)
        staging, at = self._stage(total)
        end = at
        for v in views:
            staging[end : end + v.nbytes] = np.frombuffer(v, np.uint8)
            end += v.nbytes
        batch = check_batch(key, staging.nbytes, np.asarray(starts) + at, lengths, dsts, np.asarray(imms, np.uint32))
        self._write(key, staging, batch, (at, end))

    def _stage(self, nbytes: int) -> tuple[np.ndarray, int]:
        """Room for ``nbytes`` in the registered staging ring: (the ring, the offset)."""
        if self._staging is None or self._staging.nbytes < nbytes:
            self._settle()
            if self._staging is not None:
                self._nic.forget_source(self._staging)
            self._staging = np.empty(max(_STAGING, 1 << max(0, nbytes - 1).bit_length()), np.uint8)
            self._head = 0
        at = self._head if self._head + nbytes <= self._staging.nbytes else 0
        self._reap_ready()
        while any(span is not None and span[0] < at + nbytes and at < span[1] for *_, span in self._inflight):
            self._reap_one()
        self._head = at + nbytes
        return self._staging, at

    def write_checked(self, key: RegionKey, source: np.ndarray, batch: WriteBatch) -> None:
        """Post the batch and wait for its completion: the caller may reuse the source at once."""
        self._write(key, source, batch, None)
        self._settle()

    def _write(self, key: RegionKey, source: np.ndarray, batch: WriteBatch, span: tuple[int, int] | None) -> None:
        if self._dead is not None:
            raise self._dead
        keep = batch.lengths > 0
        lengths = batch.lengths[keep]
        if not len(lengths) and not len(batch.imms):
            return
        rkey, base, size = self._key(key.handle)
        if key.addr + key.length > size:  # a forged key: the NIC would refuse it too (REM_ACCESS_ERR)
            raise RangeError(f"key [{key.addr}, {key.addr + key.length}) exceeds ring {key.handle} of {size} bytes")
        remote = base + key.addr
        laddr = (batch.src[keep] + source.ctypes.data).tolist()
        raddr = (batch.dst[keep] + remote).tolist()
        lens = lengths.tolist()
        lkey = self._nic.source_key(source) if lens else 0
        # (remote address, local address, length, immediate or None) per work request
        wrs: list[tuple[int, int, int, int | None]] = [(r, a, n, None) for r, a, n in zip(raddr, laddr, lens)]
        imms = batch.imms.tolist()
        if imms:
            if wrs:
                r, a, n, _ = wrs[-1]
                wrs[-1] = (r, a, n, imms[0])
                last = (r + n - 1, a + n - 1, 1)
            else:
                wrs.append((remote, 0, 0, imms[0]))
                last = (remote, 0, 0)
            wrs.extend((last[0], last[1], last[2], imm) for imm in imms[1:])
        self._post(wrs, rkey, lkey, span)

    def _post(
        self, wrs: list[tuple[int, int, int, int | None]], rkey: int, lkey: int, span: tuple[int, int] | None
    ) -> None:
        """Post ``wrs`` in chains of at most :data:`_CHAIN`, each within the immediate credits and
        the send queue's room; the last work request of each chain is signalled."""
        e = self._e
        qp = self._qp
        sge = self._sge
        sge.lkey = lkey
        signaled = e.IBV_SEND_SIGNALED
        at = 0
        while at < len(wrs):
            end = min(len(wrs), at + _CHAIN)
            if sum(1 for w in wrs[at:end] if w[3] is not None) > self._credits:
                self._await_credit()
                end = self._within_credit(wrs, at, end)
            while self._outstanding + (end - at) > SQ_DEPTH:
                self._reap_one()
            first = self._next_id
            try:
                qp.wr_start()
                for i in range(at, end):
                    r, a, n, imm = wrs[i]
                    qp.wr_id = first + i - at
                    qp.wr_flags = signaled if i == end - 1 else 0
                    if imm is None:
                        qp.wr_rdma_write(rkey, r)
                    else:
                        qp.wr_rdma_write_imm(rkey, r, imm)
                    sge.addr = a
                    sge.length = n
                    qp.wr_set_sge(sge)
                qp.wr_complete()
            except KSpeedError:
                raise
            except Exception as exc:  # pyverbs refused the chain (the send queue is full, or the QP failed)
                raise self._fail(f"posting RDMA writes failed: {exc}") from exc
            self._next_id = first + end - at
            self._credits -= sum(1 for w in wrs[at:end] if w[3] is not None)
            self._outstanding += end - at
            self._inflight.append((self._next_id - 1, end - at, span))
            at = end

    def _within_credit(self, wrs: list[tuple[int, int, int, int | None]], at: int, end: int) -> int:
        """The end of the longest chain from ``at`` whose immediates fit the credits (at least one)."""
        left = self._credits
        for i in range(at, end):
            if wrs[i][3] is not None:
                if left == 0:
                    return i  # > at: there is at least one credit
                left -= 1
        return end

    def _await_credit(self) -> None:
        deadline = time.monotonic() + self._options.io_timeout
        while self._credits <= 0:
            if time.monotonic() > deadline:
                raise self._lost("no immediate credit within the I/O timeout")
            self._drain(0.005)

    def _reap_ready(self) -> None:
        """Retire the chains that have completed, without waiting."""
        while self._inflight and self._poll_send() and self._inflight:
            pass

    def _poll_send(self) -> bool:
        """One poll of the send CQ: retire what completed; whether anything did. Raises on an error."""
        e = self._e
        try:
            n, wcs = self._cq.poll(16)
        except Exception as exc:
            raise self._fail(f"polling the send completion queue failed: {exc}") from exc
        for wc in wcs[:n]:
            if wc.status != e.IBV_WC_SUCCESS:
                raise self._fail(f"RDMA write failed with {wc_status(e, wc.status)} (vendor error {wc.vendor_err})")
            while self._inflight and self._inflight[0][0] <= wc.wr_id:
                _, count, _ = self._inflight.popleft()
                self._outstanding -= count
        return n > 0

    def _settle(self) -> None:
        """Wait until every posted chain has completed."""
        while self._inflight:
            self._reap_one()

    def _reap_one(self) -> None:
        """Poll the send CQ until the oldest chain in flight completed (RC completes in order)."""
        oldest = self._inflight[0]
        deadline = time.monotonic() + self._options.io_timeout
        spins = 0
        while self._inflight and self._inflight[0] is oldest:
            if self._poll_send():
                deadline = time.monotonic() + self._options.io_timeout
                continue
            if time.monotonic() > deadline:
                raise self._fail("RDMA writes did not complete within the I/O timeout")
            spins += 1
            if spins > 256:
                self._drain(0.0005)  # the setup socket tells a dead receiver; credits come meanwhile
            elif spins > 8:
                time.sleep(0)  # let other threads of this process run (pyverbs never releases the GIL)

    def _fail(self, what: str) -> PeerLostError:
        """The queue pair failed: move it to error (flushing the rest) and report the peer and status."""
        error = self._lost(what)
        with contextlib.suppress(Exception):
            self._nic.to_error(self._qp)
        log.warning("%s", error)
        return error

    # ---------------------------------------------------------------------------------- messages

    def send(self, message: bytes) -> None:
        framing.check_message(message)
        self._send_frame(framing.frame(framing.MSG, message))

    def recv(self, timeout: float | None = 0.0) -> bytes | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._messages:
            remaining = 3600.0 if deadline is None else max(0.0, deadline - time.monotonic())
            self._drain(remaining)
            if remaining == 0:
                break
        return self._messages.popleft() if self._messages else None

    def _release(self) -> None:
        for obj in (self._qp, self._cq):
            if obj is not None:
                with contextlib.suppress(Exception):
                    obj.close()
        self._qp = self._cq = None
        if self._staging is not None:
            self._nic.forget_source(self._staging)
            self._staging = None
        self._sock.close()
        release_nic(self._nic)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._dead is None and self._inflight:
            with contextlib.suppress(KSpeedError):
                self._settle()  # what was written lands before the bye
        if self._dead is None and self._sock.fileno() >= 0:
            with contextlib.suppress(OSError):
                self._sock.send(framing.frame(framing.BYE), socket.MSG_DONTWAIT)
        if self._qp is not None:
            with contextlib.suppress(Exception):
                self._nic.to_error(self._qp)
        self._release()
