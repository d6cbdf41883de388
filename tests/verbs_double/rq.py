"""Receive queues: shared receive queues (``ibv_create_srq(3)``, ``ibv_post_srq_recv(3)``) and a QP's own RQ.

A receive WR is read from pyverbs' own ``RecvWR`` as the C library reads ``struct ibv_recv_wr``:
its ``wr_id``, its ``num_sge`` and its ``next`` pointer, so a chain built with ``next_wr`` is
posted whole (pyverbs 44's ``RecvWR.next_wr`` getter cannot be used for that: it builds a
``RecvWR()`` with no SGE, which raises). The struct is found inside the pyverbs object once, at
import, by probing a ``RecvWR`` with known values; if that ever fails, only the first WR of a chain
can be read and a chain raises ``PyverbsRDMAError(EINVAL)`` rather than being half-posted.

``num_sge`` may be 0 (callers build a ``RecvWR`` with one SGE, then set ``num_sge = 0``): a
receive WR consumed by ``RDMA_WRITE_WITH_IMM`` places no data (IBA 9.4.3: the payload goes where the
RETH says; the receive WQE only supplies the completion), so the double never reads the WR's SGEs.

``ibv_post_srq_recv(3)``: posting stops at the first WR that fails (``num_sge`` over the queue's
``max_sge``: ``EINVAL``; queue full: ``ENOMEM``); the WRs before it stay posted.

Errors (IBA 10.3.1, 11.6.2): when a QP with its own RQ goes to the error state its posted receive
WRs complete with ``IBV_WC_WR_FLUSH_ERR``; an SRQ's WRs stay in the SRQ (other QPs may use them).
"""

from __future__ import annotations

import ctypes
import errno
import struct
from collections import deque
from typing import TYPE_CHECKING, Any

from pyverbs.wr import SGE, RecvWR

from .base import c_uint, fail
from .config import LIMITS

if TYPE_CHECKING:
    from .memory import PD

__all__ = ["SRQ", "ReceiveQueue", "read_recv_chain"]

_RECV_WR = struct.Struct("<QQQi")  # wr_id, next, sg_list, num_sge (struct ibv_recv_wr)


def _find_recv_wr_offset() -> int | None:
    """Offset of ``struct ibv_recv_wr`` inside a pyverbs ``RecvWR`` object, or ``None``."""
    probe_sge = SGE(0x1122334455667788, 0x0BADCAFE, 0x600DD00D)
    probe = RecvWR(wr_id=0x5EED5EED5EED5EED, num_sge=1, sg=[probe_sge])
    size = type(probe).__basicsize__
    raw = ctypes.string_at(id(probe), size)
    for offset in range(0, size - _RECV_WR.size + 1, 8):
        wr_id, nxt, sg_list, num_sge = _RECV_WR.unpack_from(raw, offset)
        if wr_id != probe.wr_id or num_sge != 1 or nxt != 0 or not sg_list:
            continue
        if ctypes.string_at(sg_list, 16) == struct.pack("<QII", 0x1122334455667788, 0x0BADCAFE, 0x600DD00D):
            return offset
    return None


_OFFSET = _find_recv_wr_offset()


def read_recv_chain(wr: Any, limit: int) -> list[tuple[int, int]]:
    """``(wr_id, num_sge)`` of ``wr`` and of every WR linked after it (at most ``limit`` + 1)."""
    if not isinstance(wr, RecvWR):
        raise TypeError(f"Argument 'wr' has incorrect type (expected pyverbs.wr.RecvWR, got {type(wr).__name__})")
    if _OFFSET is None:
        return [(wr.wr_id, wr.num_sge)]
    chain: list[tuple[int, int]] = []
    address = id(wr) + _OFFSET
    while address and len(chain) <= limit:
        wr_id, address, _sg_list, num_sge = _RECV_WR.unpack(ctypes.string_at(address, _RECV_WR.size))
        chain.append((wr_id, num_sge))
    return chain


class ReceiveQueue:
    """Posted receive WRs (``wr_id`` each), at most ``max_wr`` of them, of at most ``max_sge`` SGEs."""

    def __init__(self, max_wr: int, max_sge: int) -> None:
        self.max_wr = max_wr
        self.max_sge = max_sge
        self.wrs: deque[int] = deque()

    def post(self, wr: Any, what: str) -> list[int]:
        """Append the chain starting at ``wr``; returns the ``wr_id``s posted. Raises at the first bad WR."""
        chain = read_recv_chain(wr, self.max_wr)
        posted: list[int] = []
        for wr_id, num_sge in chain:
            if not 0 <= num_sge <= self.max_sge:
                fail(f"Failed to post receive to {what}: num_sge {num_sge} > max_sge {self.max_sge}", errno.EINVAL)
            if len(self.wrs) >= self.max_wr:
                fail(f"Failed to post receive to {what}: it holds max_wr={self.max_wr} WRs", errno.ENOMEM)
            self.wrs.append(wr_id)
            posted.append(wr_id)
        if _OFFSET is None and wr.next_wr is not None:  # pragma: no cover - only if the probe failed
            fail("the double cannot read a chained RecvWR in this pyverbs build", errno.EINVAL)
        return posted

    def take(self) -> int | None:
        """The oldest posted WR's ``wr_id`` (removed), or ``None`` when empty."""
        return self.wrs.popleft() if self.wrs else None

    def give_back(self, wr_id: int) -> None:
        """Return a WR taken for a message that was then abandoned (it goes back to the front)."""
        self.wrs.appendleft(wr_id)


class SRQ:
    """A shared receive queue; ``post_recv(RecvWR)``; ``close()`` refuses (``EBUSY``) while QPs use it."""

    def __init__(self, pd: PD, max_wr: int, max_sge: int) -> None:
        max_wr = c_uint(max_wr, 32, "max_wr")
        max_sge = c_uint(max_sge, 32, "max_sge")
        if not 1 <= max_wr <= LIMITS.max_srq_wr:
            fail(
                f"Failed to create SRQ: max_wr {max_wr} not in 1..{LIMITS.max_srq_wr} (ibv_create_srq(3))", errno.EINVAL
            )
        if max_sge > LIMITS.max_srq_sge:
            fail(f"Failed to create SRQ: max_sge {max_sge} > {LIMITS.max_srq_sge} (ibv_create_srq(3))", errno.EINVAL)
        self.pd = pd
        self.context = pd.context
        self.port = pd.port
        self.queue = ReceiveQueue(max_wr, max_sge)
        self.qps: set[Any] = set()
        self.closed = False
        with self.port.lock:
            if pd.closed:
                fail("Failed to create SRQ: the PD is closed", errno.EINVAL)
            pd.srqs.add(self)
            self.context._adopt(self)

    def post_recv(self, wr: Any, bad_wr: Any = None) -> None:
        """Post the receive WR ``wr`` (and those chained after it); ``bad_wr`` is accepted, not filled."""
        with self.port.lock:
            if self.closed:
                fail("Failed to post receive to SRQ: the SRQ is destroyed", errno.EINVAL)
            self.queue.post(wr, "SRQ")

    def close(self) -> None:
        """Destroy; ``EBUSY`` while a QP uses it (``ibv_destroy_srq(3)``); idempotent."""
        with self.port.lock:
            if self.closed:
                return
            if self.qps:
                fail(f"Failed to destroy SRQ: {len(self.qps)} QP(s) still use it (ibv_destroy_srq(3))", errno.EBUSY)
            self.closed = True
            self.queue.wrs.clear()
            self.pd.srqs.discard(self)
            self.context._release(self)
