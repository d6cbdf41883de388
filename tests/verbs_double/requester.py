"""The requester side of an RC QP in the simulated NIC: transmission, ACK/NAK handling, retries, completions.

Runs in the NIC's thread with the port's lock held. What it simulates (IBA vol. 1, chapter 9):

* **Transmission** reads the source bytes when the NIC sends them (the NIC thread, after the post;
  ``sendmsg`` copies straight from the registered memory), as a NIC's DMA does: changing a source
  buffer before its WR completed changes what lands. Each SGE is checked then: its lkey must be a
  live MR of the QP's PD and ``[addr, addr + length)`` inside it, else the WR completes
  ``IBV_WC_LOC_PROT_ERR`` (once every WR before it completed) and the QP goes to ERR. Zero-length
  SGEs are not checked. WRs of one QP go in post order on one connection (RC ordering, IBA 9.5).
* **Completions** are in post order. A success completion only for ``IBV_SEND_SIGNALED`` WRs; any
  error completion always (``IBV_WC_REM_ACCESS_ERR`` for a remote access NAK, ``IBV_WC_REM_INV_REQ_ERR``
  for an invalid-request NAK, ``IBV_WC_RNR_RETRY_EXC_ERR``, ``IBV_WC_RETRY_EXC_ERR``,
  ``IBV_WC_LOC_PROT_ERR``), then the QP goes to ERR and every later WR completes
  ``IBV_WC_WR_FLUSH_ERR`` without being sent. The responder QP goes to ERR too on the errors it
  detects (access, invalid request); on an RNR or transport retry exhaustion it cannot know, and
  does not (the passive side of RC never learns that the requester gave up).
* **RNR** (IBA 9.7.5.2.8): after an RNR NAK the requester waits the RNR timer the NAK carries (the
  responder's ``min_rnr_timer``, see ``config.rnr_delay_s``) and retransmits from the NAKed WR, at
  most ``rnr_retry`` times per message (7 = forever); then ``IBV_WC_RNR_RETRY_EXC_ERR``.
* **Loss and dead peers** (IBA 9.7.6.1): when a request is lost -- the peer's NIC cannot be reached,
  its connection died (its process exited), the responder dropped it (unknown or not-ready QP,
  NAK-sequence state), or the path is RoCEv1 (the simulated fabric is routed: only RoCEv2 gets
  through) -- the transport timer (``config.transport_timeout_s``) runs; at each expiry the
  requester retransmits from the oldest unacknowledged WR (reconnecting if needed), ``retry_cnt``
  times, then completes that WR ``IBV_WC_RETRY_EXC_ERR``: ``(retry_cnt + 1)`` timeouts after the
  loss. A PSN sequence NAK counts as a retry too. ``timeout`` 0 is infinite: such a QP never
  gives up.
* PSNs (24-bit) advance by the number of path-MTU packets a message spans; a responder expecting
  another PSN NAKs (ahead) or silently acknowledges without executing (behind: a duplicate, IBA
  9.7.5.1.x) -- so mismatched ``sq_psn``/``rq_psn`` lose data or fail, as on hardware.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

from .base import e, memory, psn_add, psn_before
from .config import rnr_delay_s, transport_timeout_s
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
    gid_bytes,
)

if TYPE_CHECKING:
    from .nic import OutboundConn
    from .qp import QP

__all__ = ["Requester", "WorkRequest"]

_SUCCESS = int(e.IBV_WC_SUCCESS)
_WC_RDMA_WRITE = int(e.IBV_WC_RDMA_WRITE)
_FLUSH = int(e.IBV_WC_WR_FLUSH_ERR)
_LOC_PROT = int(e.IBV_WC_LOC_PROT_ERR)
_REM_ACCESS = int(e.IBV_WC_REM_ACCESS_ERR)
_REM_INV_REQ = int(e.IBV_WC_REM_INV_REQ_ERR)
_RETRY_EXC = int(e.IBV_WC_RETRY_EXC_ERR)
_RNR_RETRY_EXC = int(e.IBV_WC_RNR_RETRY_EXC_ERR)
_RTS = int(e.IBV_QPS_RTS)
_NO_IMM = bytes(4)
#: ``vendor_err`` of error completions (mlx5's CQE syndromes; only a hint, as on hardware).
VENDOR_ERR = {
    _FLUSH: 0x05,
    _LOC_PROT: 0x04,
    _REM_ACCESS: 0x13,
    _REM_INV_REQ: 0x12,
    _RETRY_EXC: 0x15,
    _RNR_RETRY_EXC: 0x16,
}
#: At most this many buffers go to one ``sendmsg`` (Linux's IOV_MAX is 1024).
IOV_LIMIT = 1000


class WorkRequest:
    """One posted send WR as the NIC keeps it."""

    __slots__ = ("error", "imm", "length", "npsn", "psn", "raddr", "rkey", "seq", "sges", "signaled", "wr_id")

    def __init__(self, wr_id: int, signaled: bool, rkey: int, raddr: int, imm: bytes | None) -> None:
        self.wr_id = wr_id
        self.signaled = signaled
        self.rkey = rkey
        self.raddr = raddr
        self.imm = imm
        self.sges: tuple[tuple[int, int, int], ...] | None = None
        self.length = 0
        self.seq = 0
        self.psn = 0
        self.npsn = 1
        self.error: int | None = None  # a local error found when transmitting it

    def set_data(self, sges: tuple[tuple[int, int, int], ...]) -> None:
        self.sges = sges
        self.length = sum(length for _, _, length in sges)


class Requester:
    """The send queue of one QP and its transport state (see the module's docstring)."""

    def __init__(self, qp: QP) -> None:
        self.qp = qp
        self.port = qp.port
        self.sq: deque[WorkRequest] = deque()  # posted and not yet completed, in post order
        self.conn: OutboundConn | None = None
        self.reset()

    def reset(self) -> None:
        """Forget everything (QP to RESET, or destroyed): no completions."""
        self.sq.clear()
        self.posted = 0  # seq of the next WR posted
        self.retired = 0  # WRs before this seq have their send-queue slot back (a completion was polled)
        self.next_seq = 0  # seq of the next WR to transmit
        self.sent_hi = 0  # 1 + the highest seq ever transmitted
        self.next_psn = 0
        self.gen = 0  # transmission generation: +1 at every rewind, echoed by DROP/NAK responses
        self.lost = False
        self.deadline: float | None = None  # transport timer
        self.resume_at: float | None = None  # end of an RNR wait
        self.rewind_seq: int | None = None
        self.retries_left = 0
        self.rnr_left = 0
        self._drop_conn()

    def start(self, sq_psn: int) -> None:
        """The QP reached RTS."""
        self.next_psn = sq_psn
        self.retries_left = self.qp.retry_cnt
        self.rnr_left = self.qp.rnr_retry

    # -- from the application (port lock held) ----------------------------------------------------

    def post(self, batch: list[WorkRequest]) -> None:
        for wr in batch:
            wr.seq = self.posted
            self.posted += 1
            wr.psn = self.next_psn
            self.next_psn = psn_add(self.next_psn, wr.npsn)
            self.sq.append(wr)
        if self.qp._state == _RTS:
            self.port.kick(self)
        else:  # ERR: flushed at once
            self.flush()

    # -- completions ------------------------------------------------------------------------------

    def _complete(self, wr: WorkRequest, status: int) -> None:
        if status == _SUCCESS and not wr.signaled:
            return
        wc = make_wc(wr.wr_id, status, _WC_RDMA_WRITE, self.qp.qp_num, vendor_err=VENDOR_ERR.get(status, 0))
        self.qp.send_cq.push(wc, self.qp, wr.seq)

    def flush(self) -> None:
        """The QP is in ERR: every WR not completed yet completes ``IBV_WC_WR_FLUSH_ERR``."""
        sq = self.sq
        while sq:
            self._complete(sq.popleft(), _FLUSH)
        self.next_seq = self.sent_hi = self.posted
        self.deadline = self.resume_at = self.rewind_seq = None
        self.lost = False
        self._drop_conn()

    def _fail_head(self, status: int) -> None:
        """The oldest WR completes with ``status`` (always reported); the QP goes to ERR."""
        if self.sq:
            self._complete(self.sq.popleft(), status)
        self.qp._to_error()

    # -- transmission (NIC thread) ------------------------------------------------------------------

    def transmit(self, now: float) -> None:
        """Send what can be sent now (called on doorbells, writable sockets and timers)."""
        qp = self.qp
        if qp.closed or qp._state != _RTS:
            return
        if self.resume_at is not None:
            if now < self.resume_at:
                return
            self.resume_at = None
        conn = self.conn
        if conn is not None and conn.out and not conn.flush():
            return
        if self.rewind_seq is not None:
            self.next_seq, self.rewind_seq = self.rewind_seq, None
        sq = self.sq
        if not sq:
            return
        head_seq = sq[0].seq
        index = max(0, self.next_seq - head_seq)
        if sq[0].error is not None and index == 0:
            self._fail_head(sq[0].error)
            return
        if index >= len(sq):
            return
        if conn is None or conn.dead:
            conn = self.conn = self._connect()
            if conn is None:  # unreachable: what is sent now is lost
                self.next_seq = self.sent_hi = head_seq + len(sq)
                self._mark_lost(now)
                return
        bufs: list[Any] = []
        refs: list[Any] = []
        budget = self.port.knobs.transmit_batch
        lkeys = self.port.mrs_by_lkey
        pd = qp.pd
        pack = REQUEST.pack
        mtu_code, src_qpn, dst_qpn, gen, sgid = qp.path_mtu, qp.qp_num, qp.dest_qp_num, self.gen, gid_bytes(qp.sgid)
        limit = IOV_LIMIT - qp.max_send_sge - 1
        while index < len(sq) and budget > 0 and len(bufs) < limit:
            wr = sq[index]
            if wr.error is not None:
                break
            views = []
            for lkey, addr, length in wr.sges or ():
                if not length:
                    continue
                mr = lkeys.get(lkey)
                if mr is None or mr.pd is not pd or not mr.contains(addr, length):
                    wr.error = _LOC_PROT
                    break
                views.append((memory(mr.host(addr), length), mr))
            if wr.error is not None:
                break
            op = OP_WRITE if wr.imm is None else OP_WRITE_IMM
            bufs.append(
                pack(KIND_REQUEST, op, mtu_code, src_qpn, dst_qpn, wr.psn, wr.npsn, wr.rkey, wr.raddr, wr.length,
                     wr.imm or _NO_IMM, sgid, gen)
            )  # fmt: skip
            refs.append(None)
            for view, mr in views:
                bufs.append(view)
                refs.append((mr, wr))
            budget -= wr.length
            index += 1
        self.next_seq = head_seq + index
        self.sent_hi = max(self.sent_hi, self.next_seq)
        if bufs:
            if not qp.sends_rocev2:  # a RoCEv1 frame never crosses the (routed) simulated fabric
                self._mark_lost(now)
            else:
                conn.queue(bufs, refs)
                conn.flush()
        if index < len(sq) and sq[index].error is None:
            self.port.kick(self)  # more to send: come back on the next turn
        elif index == 0 and sq[0].error is not None:
            self._fail_head(sq[0].error)

    def _connect(self) -> OutboundConn | None:
        if not self.qp.sends_rocev2:
            return None
        return self.port.connect(self.qp.dgid, self)

    def _drop_conn(self) -> None:
        if self.conn is not None:
            self.port.drop_conn(self.conn)
            self.conn = None

    def _mark_lost(self, now: float) -> None:
        self.lost = True
        if self.deadline is None:
            timeout = transport_timeout_s(self.qp.timeout, self.port.knobs)
            if timeout is not None:
                self.deadline = now + timeout
                self.port.schedule(self)

    def link_lost(self, now: float) -> None:
        """The connection to the peer's NIC died (its process exited or its context closed)."""
        self.conn = None
        if self.sq and self.qp._state == _RTS:
            self._mark_lost(now)

    # -- timers ---------------------------------------------------------------------------------------

    def due(self) -> float | None:
        times = [t for t in (self.deadline, self.resume_at) if t is not None]
        return min(times) if times else None

    def on_timer(self, now: float) -> None:
        if self.resume_at is not None and now >= self.resume_at:
            self.port.kick(self)
        if self.deadline is None or now < self.deadline:
            return
        self.deadline = None
        if not self.lost or not self.sq or self.qp._state != _RTS:
            return
        if self.retries_left == 0:
            self._fail_head(_RETRY_EXC)
            return
        self.retries_left -= 1
        self._rewind()
        if self.conn is not None and self.conn.dead:
            self.conn = None
        self.transmit(now)

    def _rewind(self) -> None:
        """Retransmit from the oldest WR not completed (go-back-N), in a new generation."""
        self.gen = (self.gen + 1) & 0xFFFFFFFF
        self.rewind_seq = self.sq[0].seq
        self.port.kick(self)

    # -- responses ------------------------------------------------------------------------------------

    def on_response(self, kind: int, rnr_code: int, psn: int, gen: int, now: float) -> None:
        if self.qp.closed or self.qp._state != _RTS:
            return
        if kind == ACK:
            self._acknowledge(psn)
            return
        if gen != self.gen:  # about a transmission that a rewind already superseded
            return
        if kind == DROP:
            if self.sq and self.resume_at is None and self.rewind_seq is None:
                self._mark_lost(now)
            return
        self._acknowledge(psn)  # a NAK acknowledges every PSN before its own (IBA 9.7.5.2)
        if not self.sq or self.qp._state != _RTS:
            return
        if kind == NAK_RNR:
            if self.qp.rnr_retry != 7:  # 7: retry forever (IBA 9.7.5.2.8)
                if self.rnr_left == 0:
                    self._fail_head(_RNR_RETRY_EXC)
                    return
                self.rnr_left -= 1
            self.resume_at = now + rnr_delay_s(rnr_code, self.port.knobs)
            self.port.schedule(self)
            self._rewind()
        elif kind == NAK_PSN_SEQ:
            if self.retries_left == 0:
                self._fail_head(_RETRY_EXC)
                return
            self.retries_left -= 1
            self._rewind()
        elif kind == NAK_REM_ACCESS:
            self._fail_head(_REM_ACCESS)
        elif kind == NAK_INV_REQ:
            self._fail_head(_REM_INV_REQ)

    def _acknowledge(self, psn: int) -> None:
        """Complete every transmitted WR whose PSNs all come before ``psn``."""
        sq = self.sq
        progress = False
        while sq:
            wr = sq[0]
            if wr.seq >= self.sent_hi:
                break
            end = psn_add(wr.psn, wr.npsn)
            if end != psn and not psn_before(end, psn):
                break
            if wr.error is not None:  # its memory was deregistered while it was on the wire
                self._fail_head(wr.error)
                return
            sq.popleft()
            self._complete(wr, _SUCCESS)
            progress = True
            if self.qp._state != _RTS:  # the send CQ overran
                return
        if progress:
            self.lost = False
            self.deadline = None
            self.retries_left = self.qp.retry_cnt
            self.rnr_left = self.qp.rnr_retry
            oldest = sq[0].seq if sq else self.posted
            self.next_seq = max(self.next_seq, oldest)
            if self.rewind_seq is not None:
                self.rewind_seq = max(self.rewind_seq, oldest)
        if sq and sq[0].error is not None and self.next_seq == sq[0].seq:
            self._fail_head(sq[0].error)
