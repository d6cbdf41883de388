"""Completion queues of the double (``ibv_create_cq(3)``, ``ibv_poll_cq(3)``).

``poll(n)`` returns ``(npolled, [WC])`` with pyverbs' own ``pyverbs.cq.WC`` objects, filled as
hardware fills ``struct ibv_wc``: ``imm_data`` is the raw ``__be32`` of the wire read as a host
integer (a rail must ``ntohl`` it), and for a completion in error only ``wr_id``, ``status``,
``qp_num`` and ``vendor_err`` are meaningful (``ibv_poll_cq(3)``); the double zeroes ``byte_len``,
``imm_data`` and ``wc_flags`` of those. Thread-safe.

Capacity and overrun (``ibv_poll_cq(3)`` NOTES, IBA 11.4.2.1 / 10.10.2.2): a CQ created with
``cqe`` entries holds exactly ``cqe`` unpolled completions (hardware may round up; the double does
not). One more is an overrun: the completion is lost, the CQ goes to error (every later ``poll``
raises ``PyverbsRDMAError``), the async event ``IBV_EVENT_CQ_ERR`` is recorded on the context and
every QP using the CQ goes to the error state (``IBV_EVENT_QP_FATAL``).

Send-queue slots: a completion polled from the CQ frees its QP's send-queue slots up to and
including its WR (``ibv_post_send(3)``: unsignaled WRs' entries are released only when a later
signaled completion of the same QP is polled).
"""

from __future__ import annotations

import errno
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from pyverbs.cq import WC

from .base import c_uint, e, fail
from .config import LIMITS

if TYPE_CHECKING:
    from .device import Context
    from .qp import QP

__all__ = ["CQ", "make_wc"]

#: An empty poll() sleeps this long outside the lock: a rail spinning on ``poll`` would otherwise
#: starve the NIC threads of the GIL (a hardware poll is ~50 ns; the double's empty one is ~this).
_EMPTY_POLL_PAUSE = 20e-6


def make_wc(
    wr_id: int,
    status: int,
    opcode: int,
    qp_num: int,
    *,
    byte_len: int = 0,
    imm_data: int = 0,
    wc_flags: int = 0,
    src_qp: int = 0,
    vendor_err: int = 0,
) -> WC:
    """A pyverbs ``WC`` as ``ibv_poll_cq`` would fill it."""
    return WC(
        wr_id=wr_id,
        status=status,
        opcode=opcode,
        vendor_err=vendor_err,
        byte_len=byte_len,
        qp_num=qp_num,
        src_qp=src_qp,
        imm_data=imm_data,
        wc_flags=wc_flags,
    )


class CQ:
    """A completion queue of ``cqe`` entries (``1 <= cqe <= max_cqe``, else ``EINVAL``)."""

    def __init__(self, context: Context, cqe: int) -> None:
        cqe = c_uint(cqe, 32, "cqe")
        if not 1 <= cqe <= LIMITS.max_cqe:
            fail(f"Failed to create CQ: cqe {cqe} not in 1..{LIMITS.max_cqe} (ibv_create_cq(3))", errno.EINVAL)
        self.context = context
        self.port = context.port
        self.cqe = cqe
        self._entries: deque[tuple[WC, QP | None, int]] = deque()
        self.qps: set[QP] = set()
        self.in_error = False
        self.closed = False
        with self.port.lock:
            context._adopt(self)

    # -- the NIC side (port lock held) ------------------------------------------------------------

    def push(self, wc: WC, qp: QP | None = None, seq: int = -1) -> bool:
        """Add a completion; ``False`` if it was lost (CQ closed, in error, or overrun now)."""
        if self.closed or self.in_error:
            return False
        if len(self._entries) >= self.cqe:
            self._overrun()
            return False
        self._entries.append((wc, qp, seq))
        return True

    def _overrun(self) -> None:
        self.in_error = True
        self.context._event(int(e.IBV_EVENT_CQ_ERR), self)
        for qp in list(self.qps):
            qp._fatal()

    # -- the application side ---------------------------------------------------------------------

    def poll(self, num_entries: int = 1) -> tuple[int, list[Any]]:
        """Up to ``num_entries`` completions: ``(npolled, [WC])``; raises when the CQ is in error."""
        with self.port.lock:
            if self.closed:
                fail("Failed to poll CQ: the CQ is destroyed", errno.EINVAL)
            if self.in_error:
                fail("Failed to poll CQ: CQ overrun, the CQ is in error (IBV_EVENT_CQ_ERR)", errno.EIO)
            wcs: list[Any] = []
            entries = self._entries
            while entries and len(wcs) < num_entries:
                wc, qp, seq = entries.popleft()
                if qp is not None:
                    qp._retire(seq)
                wcs.append(wc)
        if not wcs:
            time.sleep(_EMPTY_POLL_PAUSE)  # let the NIC threads have the GIL when a caller spins on poll()
        return len(wcs), wcs

    def close(self) -> None:
        """Destroy; ``EBUSY`` while a QP uses it (``ibv_destroy_cq(3)``); idempotent."""
        with self.port.lock:
            if self.closed:
                return
            if self.qps:
                fail(f"Failed to destroy CQ: {len(self.qps)} QP(s) still use it (ibv_destroy_cq(3))", errno.EBUSY)
            self.closed = True
            self._entries.clear()
            self.context._release(self)

    def __len__(self) -> int:
        return len(self._entries)
