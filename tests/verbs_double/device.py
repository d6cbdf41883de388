"""The double's devices and contexts, and :class:`VerbsDouble`, the ``VerbsApi`` implementation.

``device_names()`` lists the configured simulated NICs (``KSPEED_VERBS_DOUBLE_DEVICES``, default
``dbl0, dbl1``). ``open(name)`` returns a :class:`Context` on that device's port in this process
(unknown name: ``PyverbsRDMAError(ENODEV)``). A context offers what the rail needs and a little
more, with pyverbs' names:

* ``query_port(1)``: ``state`` ``IBV_PORT_ACTIVE``, ``active_mtu`` (``IBV_MTU_4096`` unless
  configured), ``max_mtu``, ``link_layer`` ``IBV_LINK_LAYER_ETHERNET``, ``gid_tbl_len`` (8),
  ``pkey_tbl_len`` (1), ``max_msg_sz``; any other port number raises ``EINVAL``;
* ``query_gid(1, i)``: a pyverbs ``GID``; entries 0..3 are populated (see ``config.gids_for``),
  4..7 are empty and read as the zero GID, as libibverbs reports empty entries;
* ``query_gid_type(1, i)``: ``IBV_GID_TYPE_SYSFS_IB_ROCE_V1`` (0) or ``IBV_GID_TYPE_SYSFS_ROCE_V2``
  (1) -- what rdma-core's ``ibv_query_gid_type`` returns -- 0 for empty entries;
* ``query_device()``: the limits (``config.LIMITS``) under ``ibv_device_attr``'s names;
* async events (``ibv_get_async_event(3)``): ``async_events()`` lists ``(event_type, element)``
  recorded so far (``IBV_EVENT_CQ_ERR`` with the CQ, ``IBV_EVENT_QP_FATAL``/``QP_ACCESS_ERR``/
  ``QP_REQ_ERR``/``QP_LAST_WQE_REACHED`` with the QP) without consuming them;
  ``get_async_event(timeout=None)`` pops the oldest (blocking, like pyverbs') as an object with
  ``event_type``, ``element`` and ``ack()``, and raises ``PyverbsRDMAError`` on timeout or close;
* ``close()``: like pyverbs' ``Context.close()``, closes what was created on it first (QPs, SRQs,
  MRs, CQs, PDs), then releases the port; the last context of a port stops its thread. Idempotent.
"""

from __future__ import annotations

import errno
import time
from collections import deque
from dataclasses import dataclass
from threading import Condition
from typing import Any

from pyverbs.addr import GID, AHAttr, GlobalRoute
from pyverbs.qp import QPAttr, QPCap
from pyverbs.wr import SGE, RecvWR, SendWR

from .base import c_uint, e, fail
from .config import LIMITS, Knobs, Limits
from .cq import CQ
from .memory import MR, PD, DmabufMR
from .nic import acquire_port, release_port
from .qp import QP
from .rq import SRQ

__all__ = ["AsyncEvent", "Context", "DeviceAttr", "PortAttr", "VerbsDouble"]

_ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"


@dataclass(frozen=True)
class PortAttr:
    """``ibv_port_attr`` of a simulated port (pyverbs ``PortAttr`` names)."""

    state: int
    max_mtu: int
    active_mtu: int
    gid_tbl_len: int
    pkey_tbl_len: int
    max_msg_sz: int
    link_layer: int
    port_cap_flags: int = 0
    lid: int = 0
    sm_lid: int = 0
    lmc: int = 0
    active_width: int = 2  # 4X
    active_speed: int = 32  # EDR
    phys_state: int = 5  # LinkUp


@dataclass(frozen=True)
class DeviceAttr:
    """``ibv_device_attr`` of a simulated device: the limits the double enforces."""

    max_qp: int
    max_qp_wr: int
    max_sge: int
    max_cqe: int
    max_mr_size: int
    max_srq_wr: int
    max_srq_sge: int
    max_qp_rd_atom: int
    max_qp_init_rd_atom: int
    phys_port_cnt: int


@dataclass
class AsyncEvent:
    """An affiliated or port event, as ``get_async_event()`` returns it."""

    event_type: int
    element: Any

    def ack(self) -> None:
        """``ibv_ack_async_event``: nothing to release in the double."""


class Context:
    """An open simulated device (see the module's docstring)."""

    def __init__(self, api: VerbsDouble, name: str) -> None:
        spec = api.knobs.device(name)
        if spec is None:
            fail(f"Failed to open device {name!r}: no such device (devices: {api.device_names()})", errno.ENODEV)
        self.name = name
        self.api = api
        self.port = acquire_port(spec, api.knobs)
        self._objects: list[Any] = []
        self._events: deque[AsyncEvent] = deque()
        self._history: list[tuple[int, Any]] = []
        self._event_ready = Condition(self.port.lock)
        self.closed = False

    # -- queries ---------------------------------------------------------------------------------------

    def _check_port(self, port_num: int) -> None:
        self._check_open()
        if port_num != 1:
            fail(f"Failed to query port {port_num}: the device has port 1 only", errno.EINVAL)

    def _check_open(self) -> None:
        if self.closed:
            fail(f"context of {self.name} is closed", errno.EINVAL)

    def query_port(self, port_num: int) -> PortAttr:
        self._check_port(port_num)
        mtu = self.port.spec.active_mtu
        return PortAttr(
            state=int(e.IBV_PORT_ACTIVE),
            max_mtu=mtu,
            active_mtu=mtu,
            gid_tbl_len=LIMITS.gid_tbl_len,
            pkey_tbl_len=LIMITS.pkey_tbl_len,
            max_msg_sz=LIMITS.max_msg_sz,
            link_layer=int(getattr(e, "IBV_LINK_LAYER_ETHERNET", 2)),
        )

    def _gid_entry(self, port_num: int, index: int) -> tuple[str, int]:
        self._check_port(port_num)
        index = c_uint(index, 32, "index")
        if index >= LIMITS.gid_tbl_len:
            fail(f"Failed to query gid {index} of port {port_num}", errno.EINVAL)
        gids = self.port.gids
        return gids[index] if index < len(gids) else (_ZERO_GID, int(e.IBV_GID_TYPE_SYSFS_IB_ROCE_V1))

    def query_gid(self, port_num: int, index: int) -> GID:
        return GID(self._gid_entry(port_num, index)[0])

    def query_gid_type(self, port_num: int, index: int) -> int:
        return self._gid_entry(port_num, index)[1]

    def query_device(self) -> DeviceAttr:
        self._check_open()
        limits = LIMITS
        return DeviceAttr(
            max_qp=limits.max_qp,
            max_qp_wr=limits.max_qp_wr,
            max_sge=limits.max_sge,
            max_cqe=limits.max_cqe,
            max_mr_size=limits.max_mr_size,
            max_srq_wr=limits.max_srq_wr,
            max_srq_sge=limits.max_srq_sge,
            max_qp_rd_atom=limits.max_qp_rd_atom,
            max_qp_init_rd_atom=limits.max_qp_init_rd_atom,
            phys_port_cnt=limits.phys_port_cnt,
        )

    # -- async events ----------------------------------------------------------------------------------

    def _event(self, event_type: int, element: Any) -> None:
        """Record an event (port lock held)."""
        self._events.append(AsyncEvent(event_type, element))
        self._history.append((event_type, element))
        self._event_ready.notify_all()

    def async_events(self) -> list[tuple[int, Any]]:
        """Every ``(event_type, element)`` recorded on this context so far, oldest first."""
        with self.port.lock:
            return list(self._history)

    def get_async_event(self, timeout: float | None = None) -> AsyncEvent:
        """The oldest event not yet returned, waiting for one (at most ``timeout`` seconds if given)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._event_ready:
            while not self._events:
                if self.closed:
                    fail("Failed to get async event: the context is closed", errno.EBADF)
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    fail("Failed to get async event: none within the timeout", errno.EAGAIN)
                self._event_ready.wait(left if left is not None else 0.5)
            return self._events.popleft()

    # -- object bookkeeping ----------------------------------------------------------------------------

    def _adopt(self, obj: Any) -> None:
        self._check_open()
        self._objects.append(obj)

    def _release(self, obj: Any) -> None:
        if obj in self._objects:
            self._objects.remove(obj)

    def close(self) -> None:
        with self.port.lock:
            if self.closed:
                return
            for kind in (QP, SRQ, CQ, PD):  # pyverbs' Context.close() order: dependents first
                for obj in [o for o in self._objects if isinstance(o, kind)]:
                    if isinstance(obj, PD):
                        for mr in list(obj.mrs):
                            mr.close()
                    obj.close()
            self.closed = True
            self._event_ready.notify_all()
        release_port(self.port)

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


class VerbsDouble:
    """``VerbsApi`` on simulated NICs (see the package's docstring)."""

    def __init__(self, knobs: Knobs | None = None) -> None:
        self.knobs = knobs if knobs is not None else Knobs.from_env()
        self.limits: Limits = LIMITS
        self.e = e
        self.SGE, self.RecvWR, self.SendWR = SGE, RecvWR, SendWR
        self.QPAttr, self.QPCap = QPAttr, QPCap
        self.AHAttr, self.GlobalRoute, self.GID = AHAttr, GlobalRoute, GID

    def device_names(self) -> list[str]:
        return sorted(spec.name for spec in self.knobs.devices)

    def open(self, name: str) -> Context:
        return Context(self, name)

    def alloc_pd(self, context: Context) -> PD:
        _expect(context, Context, "context")
        with context.port.lock:
            context._check_open()
            return PD(context)

    def reg_mr(self, pd: PD, address: int, length: int, access: int) -> MR:
        _expect(pd, PD, "pd")
        return MR(pd, address, length, access)

    def reg_dmabuf_mr(self, pd: PD, fd: int, length: int, access: int) -> MR:
        _expect(pd, PD, "pd")
        return DmabufMR(pd, fd, 0, length, access)

    def create_cq(self, context: Context, cqe: int) -> CQ:
        _expect(context, Context, "context")
        return CQ(context, cqe)

    def create_srq(self, pd: PD, max_wr: int, max_sge: int) -> SRQ:
        _expect(pd, PD, "pd")
        return SRQ(pd, max_wr, max_sge)

    def create_qp(self, context: Context, pd: PD, send_cq: CQ, recv_cq: CQ, srq: SRQ | None, cap: Any) -> QP:
        _expect(context, Context, "context")
        return QP(context, pd, send_cq, recv_cq, srq, cap)


def _expect(obj: Any, kind: type, what: str) -> None:
    if not isinstance(obj, kind):
        raise TypeError(f"{what} must be a double {kind.__name__}, got {type(obj).__name__}")
