"""The responder side of the simulated NIC: one inbound connection, its requests executed in order.

Runs in the NIC thread with the port's lock held. For each request (IBA vol. 1, 9.7.4 and 9.7.5):

1. The destination QP must exist and be in RTR or RTS, else the request is silently dropped (the
   requester's timer will expire; the double sends its fabric-level ``DROP`` hint, see ``wire``).
2. PSN: the expected PSN executes; an earlier one is a duplicate, acknowledged again but not
   executed (IBA 9.7.5.1); a later one is a sequence error: one NAK, then silence until the expected
   PSN arrives (9.7.5.2.1). After an RNR NAK the same silence holds.
3. Validation: a message longer than the responder's path MTU sent with a larger MTU is an invalid
   request (NAK, ``IBV_WC_REM_INV_REQ_ERR`` at the requester, responder QP to ERR with
   ``IBV_EVENT_QP_REQ_ERR``). An RDMA write needs ``IBV_ACCESS_REMOTE_WRITE`` in the QP's
   ``qp_access_flags`` and, when it carries data, an rkey of a live MR of the QP's PD registered
   with ``IBV_ACCESS_REMOTE_WRITE`` whose range holds ``[raddr, raddr + length)``; a zero-length
   write checks neither rkey nor address (IBA C9-88). A violation is a remote access error: NAK,
   ``IBV_WC_REM_ACCESS_ERR`` at the requester, responder QP to ERR (``IBV_EVENT_QP_ACCESS_ERR``),
   and no byte lands.
4. ``RDMA_WRITE_WITH_IMM`` consumes one receive WR (the SRQ's or the QP's own); with none posted the
   responder answers RNR NAK with its ``min_rnr_timer`` (9.7.5.2.8) and places nothing.
5. Execution: the payload is written into the MR (``recv_into`` straight into it for large
   messages, ``ctypes.memmove`` from the staging buffer otherwise); then the PSN advances and, for
   ``_IMM``, a ``IBV_WC_RECV_RDMA_WITH_IMM`` completion (``byte_len`` the write's length,
   ``imm_data`` the wire's big-endian ImmDt read as a host ``uint32``, ``IBV_WC_WITH_IMM``,
   ``src_qp`` the requester's QPN as mlx5 reports it, though ``ibv_poll_cq(3)`` only promises it for UD) is
   added to the recv CQ -- only after every byte of this and every earlier request of the
   connection landed (RC ordering, IBA 9.5). ACKs are coalesced per turn.

A connection that closes (the requester's process died) is simply forgotten: a passive RC side
never learns that its requester is gone.
"""

from __future__ import annotations

import ctypes
import sys
import time
from typing import TYPE_CHECKING, Any

from .base import e, memory, psn_add, psn_before
from .config import MTU_BYTES
from .conn import Connection
from .cq import make_wc
from .wire import (
    ACK,
    DROP,
    KIND_REQUEST,
    NAK_INV_REQ,
    NAK_PSN_SEQ,
    NAK_REM_ACCESS,
    NAK_RNR,
    OP_WRITE,
    OP_WRITE_IMM,
    REQUEST,
    RESPONSE,
)

if TYPE_CHECKING:
    import socket

    from .memory import MR
    from .nic import Port
    from .qp import QP

__all__ = ["InboundConn"]

_RTR, _RTS = int(e.IBV_QPS_RTR), int(e.IBV_QPS_RTS)
_REMOTE_WRITE = int(e.IBV_ACCESS_REMOTE_WRITE)
_SUCCESS = int(e.IBV_WC_SUCCESS)
_RECV_IMM = int(e.IBV_WC_RECV_RDMA_WITH_IMM)
_WITH_IMM = int(e.IBV_WC_WITH_IMM)
_FLUSH = int(e.IBV_WC_WR_FLUSH_ERR)
_EV_ACCESS = int(e.IBV_EVENT_QP_ACCESS_ERR)
_EV_REQ = int(e.IBV_EVENT_QP_REQ_ERR)
_STAGING = 256 << 10
_DIRECT = 64 << 10  # payload left at least this large is received straight into the MR
#: A connection silent this long starts a new burst when input comes (a burst may be held, see Port.hold).
QUIET_S = 0.001


class _PeerClosed(Exception):
    pass


class _Message:
    """The request being received: where its payload goes, or that it is discarded."""

    __slots__ = (
        "addr",
        "broken",
        "execute",
        "gen",
        "imm",
        "length",
        "mr",
        "npsn",
        "psn",
        "qp",
        "recv",
        "remaining",
        "src_qpn",
    )

    def __init__(self, length: int, psn: int, npsn: int, src_qpn: int, gen: int) -> None:
        self.length = self.remaining = length
        self.psn, self.npsn, self.src_qpn, self.gen = psn, npsn, src_qpn, gen
        self.execute = False
        self.broken = False
        self.qp: QP | None = None
        self.mr: MR | None = None
        self.addr = 0
        self.imm: bytes | None = None
        self.recv: int | None = None


class InboundConn(Connection):
    """A connection from a requester QP, served in bounded turns by the NIC loop."""

    def __init__(self, port: Port, sock: socket.socket) -> None:
        super().__init__(port, sock)
        self._staging = (ctypes.c_char * _STAGING)()
        self._base = ctypes.addressof(self._staging)
        self._view = memoryview(self._staging).cast("B")
        self._start = self._end = 0
        self._msg: _Message | None = None
        self._acks: dict[int, int] = {}
        # Input after a quiet spell (nothing half-read, nothing for QUIET_S) starts a burst,
        # which the port may hold (see Port.hold); input that keeps a stream going is not held.
        self._idle = True
        self._quiet_since = 0.0

    def on_event(self, mask: int) -> None:
        if mask & 1:  # selectors.EVENT_READ
            quiet = self._idle and time.monotonic() - self._quiet_since >= QUIET_S
            if quiet and self.port.hold(self):
                self._idle = False
            else:
                self.service()
        if mask & 2 and not self.dead:  # selectors.EVENT_WRITE
            self.flush()

    # -- receiving ------------------------------------------------------------------------------------

    def service(self) -> None:
        quantum = self.port.knobs.service_quantum
        moved = 0
        try:
            while moved < quantum and not self.dead:
                msg = self._msg
                if msg is None:
                    if self._end - self._start < REQUEST.size:
                        if not self._fill():
                            break
                        continue
                    header = REQUEST.unpack_from(self._view, self._start)
                    self._start += REQUEST.size
                    self._begin(*header)
                    continue
                if not msg.remaining:
                    self._msg = None
                    self._finish(msg)
                    continue
                available = self._end - self._start
                if available:
                    count = min(available, msg.remaining)
                    self._place(msg, self._base + self._start, count)
                    self._start += count
                    moved += count
                elif msg.execute and msg.remaining >= _DIRECT and msg.mr is not None and msg.mr.live:
                    count = self._recv_direct(msg, min(msg.remaining, max(quantum - moved, _DIRECT)))
                    if not count:
                        break
                    moved += count
                elif not self._fill():
                    break
            else:
                self._send_acks()
                self.port.again(self)  # the quantum is used up: the rest waits for the next turn
                return
            idle = self._msg is None and self._start == self._end
            if idle and not self._idle:
                self._quiet_since = time.monotonic()
            self._idle = idle
        except _PeerClosed:
            self._abandon()
            self.port.close_connection(self)
            return
        self._send_acks()

    def _fill(self) -> bool:
        """Read more into the staging buffer; ``False`` when nothing is there now."""
        if self._start:
            leftover = self._end - self._start
            if leftover:
                ctypes.memmove(self._base, self._base + self._start, leftover)
            self._start, self._end = 0, leftover
        try:
            count = self.sock.recv_into(self._view[self._end :])
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            raise _PeerClosed from None
        if not count:
            raise _PeerClosed
        self._end += count
        return True

    def _recv_direct(self, msg: _Message, size: int) -> int:
        try:
            count = self.sock.recv_into(memory(msg.addr, size))
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError:
            raise _PeerClosed from None
        if not count:
            raise _PeerClosed
        msg.addr += count
        msg.remaining -= count
        return count

    def _place(self, msg: _Message, source: int, count: int) -> None:
        if msg.execute:
            if msg.mr is not None and msg.mr.live:
                ctypes.memmove(msg.addr, source, count)
            else:
                msg.broken = True  # deregistered while the message was arriving
        msg.addr += count
        msg.remaining -= count

    # -- one request ----------------------------------------------------------------------------------

    def _begin(
        self,
        kind: int,
        op: int,
        mtu_code: int,
        src_qpn: int,
        dst_qpn: int,
        psn: int,
        npsn: int,
        rkey: int,
        raddr: int,
        length: int,
        imm: bytes,
        _sgid: bytes,
        gen: int,
    ) -> None:
        if kind != KIND_REQUEST or op not in (OP_WRITE, OP_WRITE_IMM):
            raise _PeerClosed  # not a frame of this fabric: drop the connection
        msg = self._msg = _Message(length, psn, npsn, src_qpn, gen)
        qp = self.port.qps.get(dst_qpn)
        if qp is None or qp._state not in (_RTR, _RTS):
            self._respond(DROP, src_qpn, psn, gen)
            return
        if psn != qp.epsn:
            if qp.nak_pending:
                self._respond(DROP, src_qpn, psn, gen)
            elif psn_before(psn, qp.epsn):  # a duplicate: acknowledged, not executed again
                self._acks[src_qpn] = psn_add(psn, npsn)
            else:
                qp.nak_pending = True
                self._respond(NAK_PSN_SEQ, src_qpn, qp.epsn, gen)
            return
        qp.nak_pending = False
        own_mtu = MTU_BYTES[qp.path_mtu]
        if length > own_mtu and MTU_BYTES.get(mtu_code, 0) > own_mtu:
            self._fail(qp, NAK_INV_REQ, _EV_REQ, msg)
            return
        if not qp.access_flags & _REMOTE_WRITE:
            self._fail(qp, NAK_REM_ACCESS, _EV_ACCESS, msg)
            return
        mr = None
        if length:  # IBA C9-88: a zero-length RDMA WRITE validates neither R_Key nor VA
            mr = self.port.mrs_by_rkey.get(rkey)
            if mr is None or mr.pd is not qp.pd or not mr.access & _REMOTE_WRITE or not mr.contains(raddr, length):
                self._fail(qp, NAK_REM_ACCESS, _EV_ACCESS, msg)
                return
        if op == OP_WRITE_IMM:
            queue = qp.srq.queue if qp.srq is not None else qp.rq
            recv = queue.take() if queue is not None else None
            if recv is None:
                qp.nak_pending = True
                self._respond(NAK_RNR, src_qpn, psn, gen, qp.min_rnr_timer)
                return
            msg.recv = recv
            msg.imm = imm
        msg.execute = True
        msg.qp = qp
        msg.mr = mr
        msg.addr = mr.host(raddr) if mr is not None else raddr  # an rkey names IOVAs

    def _finish(self, msg: _Message) -> None:
        qp = msg.qp
        if not msg.execute or qp is None:
            return
        if qp.closed or qp._state not in (_RTR, _RTS):  # the QP left service while the data arrived
            self._give_back(msg)
            self._respond(DROP, msg.src_qpn, msg.psn, msg.gen)
            return
        if msg.broken:
            self._give_back(msg)
            self._fail(qp, NAK_REM_ACCESS, _EV_ACCESS, msg)
            return
        qp.epsn = psn_add(msg.psn, msg.npsn)
        if msg.imm is not None and msg.recv is not None:
            wc = make_wc(
                msg.recv,
                _SUCCESS,
                _RECV_IMM,
                qp.qp_num,
                byte_len=msg.length,
                imm_data=int.from_bytes(msg.imm, sys.byteorder),  # the raw __be32, as ibv_wc.imm_data holds it
                wc_flags=_WITH_IMM,
                src_qp=msg.src_qpn,
            )
            if not qp.recv_cq.push(wc):  # the CQ overran: the QP is in ERR now and acknowledges nothing
                self._respond(DROP, msg.src_qpn, msg.psn, msg.gen)
                return
        self._acks[msg.src_qpn] = qp.epsn

    def _fail(self, qp: QP, nak: int, event: int, msg: _Message) -> None:
        """A responder-detected error: NAK, async event, QP to ERR; the payload is discarded."""
        self._respond(nak, msg.src_qpn, msg.psn, msg.gen)
        qp.context._event(event, qp)
        qp._to_error()

    def _give_back(self, msg: _Message) -> None:
        """A receive WR taken for a message that did not complete returns to its queue (or flushes)."""
        qp, recv = msg.qp, msg.recv
        msg.recv = None
        if qp is None or recv is None or qp.closed:
            return
        if qp.srq is not None:
            qp.srq.queue.give_back(recv)
        elif qp._state in (_RTR, _RTS) and qp.rq is not None:
            qp.rq.give_back(recv)
        else:
            qp.recv_cq.push(make_wc(recv, _FLUSH, int(e.IBV_WC_RECV), qp.qp_num, vendor_err=0x05))

    def _abandon(self) -> None:
        if self._msg is not None:
            self._give_back(self._msg)
            self._msg = None

    # -- responses --------------------------------------------------------------------------------------

    def _respond(self, kind: int, qpn: int, psn: int, gen: int, rnr_code: int = 0) -> None:
        self._send_acks(flush=False)  # ACKs of earlier requests go first
        self.queue([RESPONSE.pack(kind, rnr_code, qpn, psn, gen)])
        self.flush()

    def _send_acks(self, flush: bool = True) -> None:
        if self._acks:
            self.queue([RESPONSE.pack(ACK, 0, qpn, psn, 0) for qpn, psn in self._acks.items()])
            self._acks.clear()
        if flush and self.out:
            self.flush()

    def abandon_all(self) -> Any:
        """The port is closing: give back a half-received message's receive WR."""
        self._abandon()
