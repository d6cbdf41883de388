"""RC queue pairs of the double: the state machine (``ibv_modify_qp(3)``) and the extended posting calls
(``ibv_wr_post(3)``), with the checks of ``ibv_create_qp(3)``/``ibv_create_qp_ex(3)`` at creation.

State machine (IBA vol. 1, 10.3.1 and 11.2.4.2; the RC table of ``ibv_modify_qp(3)``): only
RESET->INIT->RTR->RTS, and any state -> ERR or -> RESET, with exactly the mask bits the man page
requires for RC; a missing required bit, a bit the transition does not allow, or any other
transition fails with ``EINVAL`` and changes nothing ("If any of the modify attributes or the modify
mask are invalid, none of the attributes will be modified"). Allowed optional bits are the kernel's
(``ib_modify_qp_is_ok``) for RC, minus alternate paths (the simulated device has no APM):
INIT->RTR may also set ``ACCESS_FLAGS``/``PKEY_INDEX``; RTR->RTS ``CUR_STATE``/``ACCESS_FLAGS``/
``MIN_RNR_TIMER``. Legal-but-unused transitions (INIT->INIT, RTS->RTS, SQD, SQE) are refused too.
Only the ``QPAttr`` fields the mask names are read, and they are validated: port 1 only, P_Key
index 0, access flags, a global AV on port 1 (RoCE needs a GRH) whose ``sgid_index`` is a populated
GID entry, ``path_mtu`` <= the port's ``active_mtu``, 24-bit QPN/PSNs, ``timeout`` 0..31,
``retry_cnt``/``rnr_retry`` 0..7, ``min_rnr_timer`` 0..31, RDMA-read depths <= the device's.

``qp_state`` is pyverbs' ``QP.qp_state``: libibverbs' cached ``ibv_qp.state``, updated only by
``modify`` and ``query`` (rdma-core ``ibv_modify_qp``/``ibv_query_qp``). When the NIC moves a QP to
ERR on its own (a completion error, a CQ overrun) ``qp_state`` still says what it said; ``query``
(``qp.query(IBV_QP_STATE)[0].qp_state``) tells the truth, as on hardware.

Posting (``ibv_wr_post(3)``): ``wr_start()``, then per WR: set ``wr_id``/``wr_flags`` (read when
the builder is called), a builder (``wr_rdma_write``/``wr_rdma_write_imm``), then exactly one data
setter (``wr_set_sge(SGE)`` -- pyverbs 44 takes one ``SGE`` object -- or ``wr_set_sge_list``);
``wr_complete()`` posts the batch or raises and posts nothing of it; ``wr_abort()`` drops it.
The region is a per-QP critical section (ibv_wr_post(3), CONCURRENCY): another thread's
``wr_start()`` waits for it; builders or setters outside one's own region raise ``EINVAL`` at once.
Every misuse inside the critical region is latched and reported by ``wr_complete`` (``EINVAL``),
as the man page says failures are: a setter without a builder or twice for one WR, a builder
without a data setter, more SGEs than ``cap.max_send_sge``, a message over ``max_msg_sz``,
``IBV_SEND_INLINE``/``IP_CSUM`` (inline is not simulated). ``wr_complete`` also refuses a QP in
RESET/INIT/RTR (``EINVAL``; posting needs RTS, IBA 10.3.1), and a batch that would hold more than
``cap.max_send_wr`` WRs outstanding (``ENOMEM``): a WR occupies its slot until its own completion,
or a later signaled completion of the QP, is polled (``ibv_post_send(3)``), so a QP that never
signals runs out. In ERR, posted WRs complete at once with ``IBV_WC_WR_FLUSH_ERR``. Only
``IBV_SEND_SIGNALED`` in ``wr_flags`` asks for a success completion (``sq_sig_all`` is 0, as pyverbs'
``QPInitAttrEx`` defaults it); errors always complete.
"""

from __future__ import annotations

import errno
import math
import threading
from typing import TYPE_CHECKING, Any

from pyverbs.qp import QPAttr, QPCap, QPInitAttr
from pyverbs.wr import SGE

from .base import PSN_MASK, c_uint, e, fail, state_name
from .config import LIMITS, MTU_BYTES
from .cq import CQ, make_wc
from .memory import PD
from .requester import Requester, WorkRequest
from .rq import SRQ, ReceiveQueue

if TYPE_CHECKING:
    from .device import Context

__all__ = ["QP"]

_RESET, _INIT, _RTR, _RTS, _ERR = (
    int(s) for s in (e.IBV_QPS_RESET, e.IBV_QPS_INIT, e.IBV_QPS_RTR, e.IBV_QPS_RTS, e.IBV_QPS_ERR)
)

_STATE = int(e.IBV_QP_STATE)
_CUR_STATE = int(e.IBV_QP_CUR_STATE)
_ACCESS = int(e.IBV_QP_ACCESS_FLAGS)
_PKEY = int(e.IBV_QP_PKEY_INDEX)
_PORT = int(e.IBV_QP_PORT)
_AV = int(e.IBV_QP_AV)
_MTU = int(e.IBV_QP_PATH_MTU)
_TIMEOUT = int(e.IBV_QP_TIMEOUT)
_RETRY = int(e.IBV_QP_RETRY_CNT)
_RNR_RETRY = int(e.IBV_QP_RNR_RETRY)
_RQ_PSN = int(e.IBV_QP_RQ_PSN)
_RD_ATOMIC = int(e.IBV_QP_MAX_QP_RD_ATOMIC)
_MIN_RNR = int(e.IBV_QP_MIN_RNR_TIMER)
_SQ_PSN = int(e.IBV_QP_SQ_PSN)
_DEST_RD_ATOMIC = int(e.IBV_QP_MAX_DEST_RD_ATOMIC)
_DEST_QPN = int(e.IBV_QP_DEST_QPN)

_MASK_NAMES = {
    int(getattr(e, name)): name
    for name in (
        "IBV_QP_STATE", "IBV_QP_CUR_STATE", "IBV_QP_EN_SQD_ASYNC_NOTIFY", "IBV_QP_ACCESS_FLAGS",
        "IBV_QP_PKEY_INDEX", "IBV_QP_PORT", "IBV_QP_QKEY", "IBV_QP_AV", "IBV_QP_PATH_MTU", "IBV_QP_TIMEOUT",
        "IBV_QP_RETRY_CNT", "IBV_QP_RNR_RETRY", "IBV_QP_RQ_PSN", "IBV_QP_MAX_QP_RD_ATOMIC", "IBV_QP_ALT_PATH",
        "IBV_QP_MIN_RNR_TIMER", "IBV_QP_SQ_PSN", "IBV_QP_MAX_DEST_RD_ATOMIC", "IBV_QP_PATH_MIG_STATE",
        "IBV_QP_CAP", "IBV_QP_DEST_QPN", "IBV_QP_RATE_LIMIT",
    )
    if hasattr(e, name)
}  # fmt: skip
_KNOWN_MASK = sum(_MASK_NAMES)

# ibv_modify_qp(3), "For QP Transport Service Type IBV_QPT_RC": (required, optional) per transition.
_TRANSITIONS: dict[tuple[int, int], tuple[int, int]] = {
    (_RESET, _INIT): (_STATE | _PKEY | _PORT | _ACCESS, 0),
    (_INIT, _RTR): (_STATE | _AV | _MTU | _DEST_QPN | _RQ_PSN | _DEST_RD_ATOMIC | _MIN_RNR, _ACCESS | _PKEY),
    (_RTR, _RTS): (_STATE | _TIMEOUT | _RETRY | _RNR_RETRY | _SQ_PSN | _RD_ATOMIC, _CUR_STATE | _ACCESS | _MIN_RNR),
}
_QP_ACCESS_BITS = int(
    e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_ATOMIC
)
_SIGNALED = int(e.IBV_SEND_SIGNALED)
_ALLOWED_FLAGS = int(e.IBV_SEND_SIGNALED | e.IBV_SEND_FENCE | e.IBV_SEND_SOLICITED)
_ROCE_V2 = int(e.IBV_GID_TYPE_SYSFS_ROCE_V2)


def _mask_names(mask: int) -> str:
    return "|".join(name for bit, name in sorted(_MASK_NAMES.items()) if mask & bit) or hex(mask)


class QP:
    """An RC extended QP (``QPEx``) posting ``RDMA_WRITE`` and ``RDMA_WRITE_WITH_IMM``."""

    def __init__(self, context: Context, pd: PD, send_cq: CQ, recv_cq: CQ, srq: SRQ | None, cap: Any) -> None:
        for what, obj, kind in (("pd", pd, PD), ("send_cq", send_cq, CQ), ("recv_cq", recv_cq, CQ)):
            if not isinstance(obj, kind):
                raise TypeError(f"create_qp: {what} must be a double {kind.__name__}, got {type(obj).__name__}")
        if srq is not None and not isinstance(srq, SRQ):
            raise TypeError(f"create_qp: srq must be a double SRQ or None, got {type(srq).__name__}")
        if not isinstance(cap, QPCap):
            raise TypeError(f"create_qp: cap must be a pyverbs QPCap, got {type(cap).__name__}")
        self.context = context
        self.port = port = context.port
        for what, obj in (("pd", pd), ("send_cq", send_cq), ("recv_cq", recv_cq), ("srq", srq)):
            if obj is not None and obj.context.port is not port:
                fail(f"Failed to create QP: {what} belongs to another device", errno.EINVAL)
        max_send_wr, max_recv_wr = cap.max_send_wr, cap.max_recv_wr
        max_send_sge, max_recv_sge, max_inline = cap.max_send_sge, cap.max_recv_sge, cap.max_inline_data
        limits = LIMITS
        problems = []
        if max_send_wr > limits.max_qp_wr:
            problems.append(f"max_send_wr {max_send_wr} > {limits.max_qp_wr}")
        if max_send_sge > limits.max_sge:
            problems.append(f"max_send_sge {max_send_sge} > {limits.max_sge}")
        if max_inline > limits.max_inline_data:
            problems.append(f"max_inline_data {max_inline} > {limits.max_inline_data}")
        if srq is None:  # ibv_create_qp(3): recv caps are ignored with an SRQ
            if max_recv_wr > limits.max_qp_wr:
                problems.append(f"max_recv_wr {max_recv_wr} > {limits.max_qp_wr}")
            if max_recv_sge > limits.max_sge:
                problems.append(f"max_recv_sge {max_recv_sge} > {limits.max_sge}")
        if problems:
            fail("Failed to create QP: " + ", ".join(problems) + " (device limits, ibv_create_qp(3))", errno.EINVAL)
        self.pd, self.send_cq, self.recv_cq, self.srq = pd, send_cq, recv_cq, srq
        self.max_send_wr, self.max_send_sge, self.max_inline_data = max_send_wr, max_send_sge, max_inline
        self.rq = ReceiveQueue(max_recv_wr, max_recv_sge) if srq is None else None
        self.closed = False
        self._set_defaults()
        self._state = self._cached_state = _RESET
        # ibv_wr_* state
        self._wr_id = 0
        self._wr_flags = 0
        self._open = False
        self._region = threading.Lock()  # the provider's per-QP lock around wr_start()..wr_complete()
        self._region_owner: int | None = None
        self._batch: list[WorkRequest] = []
        self._building: WorkRequest | None = None
        self._latched: str | None = None
        self.req = Requester(self)
        with port.lock:
            if pd.closed or send_cq.closed or recv_cq.closed or (srq is not None and srq.closed):
                fail("Failed to create QP: a PD, CQ or SRQ it needs is closed", errno.EINVAL)
            self.qp_num = port.new_qpn()
            port.qps[self.qp_num] = self
            pd.qps.add(self)
            send_cq.qps.add(self)
            recv_cq.qps.add(self)
            if srq is not None:
                srq.qps.add(self)
            context._adopt(self)

    def _set_defaults(self) -> None:
        self.port_num = 0
        self.pkey_index = 0
        self.access_flags = 0
        self.path_mtu = int(e.IBV_MTU_1024)
        self.dest_qp_num = 0
        self.rq_psn = 0
        self.sq_psn = 0
        self.dgid = ""
        self.sgid_index = 0
        self.sgid_type = -1
        self.sgid = ""
        self.hop_limit = 0
        self.max_dest_rd_atomic = 0
        self.max_rd_atomic = 0
        self.min_rnr_timer = 0
        self.timeout = 0
        self.retry_cnt = 0
        self.rnr_retry = 0
        # responder side: the expected PSN and whether a NAK is outstanding (IBA 9.7.5.2: a responder
        # NAKs a sequence error or RNR once and drops what follows until the expected PSN comes again)
        self.epsn = 0
        self.nak_pending = False

    # -- state ------------------------------------------------------------------------------------

    @property
    def qp_state(self) -> int:
        """libibverbs' cached state: what the last ``modify``/``query`` set (not errors the NIC found)."""
        return self._cached_state

    @property
    def qp_type(self) -> int:
        return int(e.IBV_QPT_RC)

    def modify(self, attr: Any, mask: int) -> None:
        """``ibv_modify_qp``: validate everything, then apply (see the module's docstring)."""
        if not isinstance(attr, QPAttr):
            raise TypeError(
                f"Argument 'qp_attr' has incorrect type (expected pyverbs.qp.QPAttr, got {type(attr).__name__})"
            )
        mask = c_uint(mask, 32, "attr_mask")
        with self.port.lock:
            self._check_open()
            current = self._state
            if mask & ~_KNOWN_MASK:
                fail(f"Failed to modify QP: unknown mask bits {mask & ~_KNOWN_MASK:#x}", errno.EINVAL)
            target = int(attr.qp_state) if mask & _STATE else current
            if target in (_RESET, _ERR):
                required, optional = _STATE, 0
            elif (current, target) in _TRANSITIONS:
                required, optional = _TRANSITIONS[(current, target)]
            else:
                fail(
                    f"Failed to modify QP: {state_name(current)}->{state_name(target)} is not a transition the "
                    "double allows (RESET->INIT->RTR->RTS, any->ERR, any->RESET; IBA 10.3.1)",
                    errno.EINVAL,
                )
            missing = required & ~mask
            if missing:
                fail(
                    f"Failed to modify QP: {state_name(current)}->{state_name(target)} needs {_mask_names(missing)} "
                    "(ibv_modify_qp(3), RC)",
                    errno.EINVAL,
                )
            extra = mask & ~(required | optional)
            if extra:
                fail(
                    f"Failed to modify QP: {_mask_names(extra)} not allowed on {state_name(current)}->"
                    f"{state_name(target)} (ibv_modify_qp(3), RC)",
                    errno.EINVAL,
                )
            values = self._validated(attr, mask, current)
            for name, value in values.items():
                setattr(self, name, value)
            if target == _ERR:
                self._to_error()
            elif target == _RESET:
                self._reset()
            elif target == _RTR:
                self.epsn = self.rq_psn
                self.nak_pending = False
                self._state = _RTR
            elif target == _RTS:
                self.req.start(self.sq_psn)
                self._state = _RTS
            else:
                self._state = target
            if mask & _STATE:
                self._cached_state = target

    def _validated(self, attr: Any, mask: int, current: int) -> dict[str, Any]:
        """The attributes ``mask`` names, read from ``attr`` and checked; raises ``EINVAL`` on a bad one."""
        values: dict[str, Any] = {}
        port = self.port

        def bad(what: str) -> None:
            fail(f"Failed to modify QP: {what} (ibv_modify_qp(3))", errno.EINVAL)

        if mask & _CUR_STATE and int(attr.cur_qp_state) != current:
            bad(f"cur_qp_state {state_name(attr.cur_qp_state)} but the QP is {state_name(current)}")
        if mask & _PORT:
            if attr.port_num != 1:
                bad(f"port_num {attr.port_num}: the device has port 1 only")
            values["port_num"] = 1
        if mask & _PKEY:
            if attr.pkey_index >= LIMITS.pkey_tbl_len:
                bad(f"pkey_index {attr.pkey_index} >= pkey_tbl_len {LIMITS.pkey_tbl_len}")
            values["pkey_index"] = attr.pkey_index
        if mask & _ACCESS:
            if attr.qp_access_flags & ~_QP_ACCESS_BITS:
                bad(f"qp_access_flags {attr.qp_access_flags:#x} has bits a QP does not take")
            values["access_flags"] = attr.qp_access_flags
        if mask & _AV:
            ah = attr.ah_attr
            if not ah.is_global:
                bad("the AV is not global (is_global=0): RoCE needs a GRH")
            if ah.port_num != 1:
                bad(f"ah_attr.port_num {ah.port_num}: the device has port 1 only")
            if not 0 <= ah.sgid_index < LIMITS.gid_tbl_len or ah.sgid_index >= len(port.gids):
                bad(f"sgid_index {ah.sgid_index} is not a populated GID table entry")
            values["dgid"] = ah.dgid
            values["sgid_index"] = ah.sgid_index
            values["sgid"], values["sgid_type"] = port.gids[ah.sgid_index]
            values["hop_limit"] = ah.hop_limit
        if mask & _MTU:
            if int(attr.path_mtu) not in MTU_BYTES:
                bad(f"path_mtu {attr.path_mtu} is not an IBV_MTU_* value")
            if int(attr.path_mtu) > port.spec.active_mtu:
                bad(f"path_mtu {attr.path_mtu} > the port's active_mtu {port.spec.active_mtu}")
            values["path_mtu"] = int(attr.path_mtu)
        if mask & _DEST_QPN:
            if attr.dest_qp_num > PSN_MASK:
                bad(f"dest_qp_num {attr.dest_qp_num:#x} is not 24-bit")
            values["dest_qp_num"] = attr.dest_qp_num
        if mask & _RQ_PSN:
            if attr.rq_psn > PSN_MASK:
                bad(f"rq_psn {attr.rq_psn:#x} is not 24-bit")
            values["rq_psn"] = attr.rq_psn
        if mask & _SQ_PSN:
            if attr.sq_psn > PSN_MASK:
                bad(f"sq_psn {attr.sq_psn:#x} is not 24-bit")
            values["sq_psn"] = attr.sq_psn
        if mask & _DEST_RD_ATOMIC:
            if attr.max_dest_rd_atomic > LIMITS.max_qp_rd_atom:
                bad(f"max_dest_rd_atomic {attr.max_dest_rd_atomic} > {LIMITS.max_qp_rd_atom}")
            values["max_dest_rd_atomic"] = attr.max_dest_rd_atomic
        if mask & _RD_ATOMIC:
            if attr.max_rd_atomic > LIMITS.max_qp_init_rd_atom:
                bad(f"max_rd_atomic {attr.max_rd_atomic} > {LIMITS.max_qp_init_rd_atom}")
            values["max_rd_atomic"] = attr.max_rd_atomic
        if mask & _MIN_RNR:
            if attr.min_rnr_timer > 31:
                bad(f"min_rnr_timer {attr.min_rnr_timer} is not a 5-bit code")
            values["min_rnr_timer"] = attr.min_rnr_timer
        if mask & _TIMEOUT:
            if attr.timeout > 31:
                bad(f"timeout {attr.timeout} is not 0..31")
            values["timeout"] = attr.timeout
        if mask & _RETRY:
            if attr.retry_cnt > 7:
                bad(f"retry_cnt {attr.retry_cnt} is not 0..7")
            values["retry_cnt"] = attr.retry_cnt
        if mask & _RNR_RETRY:
            if attr.rnr_retry > 7:
                bad(f"rnr_retry {attr.rnr_retry} is not 0..7")
            values["rnr_retry"] = attr.rnr_retry
        return values

    def query(self, attr_mask: int = 0) -> tuple[Any, Any]:
        """``ibv_query_qp``: ``(QPAttr, QPInitAttr)`` of the QP's real state; refreshes ``qp_state``."""
        with self.port.lock:
            self._check_open()
            attr = QPAttr(qp_state=self._state, cur_qp_state=self._state, port_num=self.port_num or 1)
            attr.path_mtu = self.path_mtu
            attr.qp_access_flags = self.access_flags
            attr.pkey_index = self.pkey_index
            attr.dest_qp_num = self.dest_qp_num
            attr.rq_psn = self.rq_psn
            attr.sq_psn = self.sq_psn
            attr.timeout = self.timeout
            attr.retry_cnt = self.retry_cnt
            attr.rnr_retry = self.rnr_retry
            attr.min_rnr_timer = self.min_rnr_timer
            attr.max_rd_atomic = self.max_rd_atomic
            attr.max_dest_rd_atomic = self.max_dest_rd_atomic
            cap = QPCap(
                max_send_wr=self.max_send_wr,
                max_recv_wr=self.rq.max_wr if self.rq else 0,
                max_send_sge=self.max_send_sge,
                max_recv_sge=self.rq.max_sge if self.rq else 0,
                max_inline_data=self.max_inline_data,
            )
            self._cached_state = self._state
            return attr, QPInitAttr(qp_type=int(e.IBV_QPT_RC), cap=cap, sq_sig_all=0)

    def _check_open(self) -> None:
        if self.closed:
            fail(f"QP {self.qp_num:#x} is destroyed", errno.EINVAL)

    # -- errors and reset (port lock held) --------------------------------------------------------

    def _to_error(self) -> None:
        """Move to ERR (IBA 10.3.1): outstanding send WRs and own-RQ receive WRs flush; SRQ WRs stay."""
        if self._state == _ERR or self.closed:
            return
        self._state = _ERR
        self.req.flush()
        self._flush_rq()
        if self.srq is not None:  # IBA 11.6.3.1: Last WQE Reached for a QP on an SRQ that leaves service
            self.context._event(int(e.IBV_EVENT_QP_LAST_WQE_REACHED), self)

    def _fatal(self) -> None:
        """A catastrophic error of this QP (its CQ overran): ``IBV_EVENT_QP_FATAL`` and ERR."""
        if self._state != _ERR and not self.closed:
            self.context._event(int(e.IBV_EVENT_QP_FATAL), self)
        self._to_error()

    def _flush_rq(self) -> None:
        if self.rq is None:
            return
        while self.rq.wrs:
            wr_id = self.rq.wrs.popleft()
            wc = make_wc(wr_id, int(e.IBV_WC_WR_FLUSH_ERR), int(e.IBV_WC_RECV), self.qp_num, vendor_err=0xF9)
            self.recv_cq.push(wc)

    def _reset(self) -> None:
        """To RESET: every WR is dropped without a completion; attributes back to their defaults."""
        self.req.reset()
        if self.rq is not None:
            self.rq.wrs.clear()
        self._set_defaults()
        self._state = _RESET

    def _retire(self, seq: int) -> None:
        """A completion of WR ``seq`` was polled: its send-queue slot and every earlier one are free."""
        req = self.req
        if seq >= req.retired:
            req.retired = seq + 1

    # -- receive --------------------------------------------------------------------------------------

    def post_recv(self, wr: Any, bad_wr: Any = None) -> None:
        """``ibv_post_recv`` to the QP's own receive queue (``EINVAL`` on a QP created with an SRQ)."""
        with self.port.lock:
            self._check_open()
            if self.rq is None:
                fail("Failed to post receive: the QP uses an SRQ (ibv_post_recv(3))", errno.EINVAL)
            if self._state == _RESET:
                fail("Failed to post receive: the QP is in RESET (IBA 10.3.1)", errno.EINVAL)
            self.rq.post(wr, "QP")
            if self._state == _ERR:
                self._flush_rq()

    # -- ibv_wr_* ---------------------------------------------------------------------------------------

    @property
    def wr_id(self) -> int:
        return self._wr_id

    @wr_id.setter
    def wr_id(self, value: int) -> None:
        self._wr_id = c_uint(value, 64, "wr_id")

    @property
    def wr_flags(self) -> int:
        return self._wr_flags

    @wr_flags.setter
    def wr_flags(self, value: int) -> None:
        self._wr_flags = c_uint(value, 32, "wr_flags")

    def wr_start(self) -> None:
        """Open the critical region; another thread's region on this QP is waited for (ibv_wr_post(3))."""
        me = threading.get_ident()
        if self._region_owner == me:
            self._latch("wr_start() inside this thread's open wr_start()/wr_complete() region")
            return
        self._region.acquire()
        self._region_owner = me
        self._open = True
        self._batch = []
        self._building = None
        self._latched = None

    def _leave_region(self) -> None:
        self._open = False
        self._batch = []
        self._building = None
        self._latched = None
        self._region_owner = None
        self._region.release()

    def wr_rdma_write(self, rkey: int, remote_addr: int) -> None:
        self._builder(c_uint(rkey, 32, "rkey"), c_uint(remote_addr, 64, "remote_addr"), None)

    def wr_rdma_write_imm(self, rkey: int, remote_addr: int, data: int) -> None:
        """``imm`` in host order; stored big-endian, as pyverbs does (``htobe32``) and IBA puts ImmDt on the wire."""
        imm = c_uint(data, 32, "imm_data").to_bytes(4, "big")
        self._builder(c_uint(rkey, 32, "rkey"), c_uint(remote_addr, 64, "remote_addr"), imm)

    def _builder(self, rkey: int, remote_addr: int, imm: bytes | None) -> None:
        self._require_region("a WR builder")
        if self._building is not None and self._building.sges is None:
            self._latch("the previous WR got no wr_set_sge()/wr_set_sge_list() before the next builder")
        flags = self._wr_flags
        if flags & ~_ALLOWED_FLAGS:
            self._latch(f"wr_flags {flags:#x}: only SIGNALED, FENCE and SOLICITED are simulated (no inline)")
        wr = WorkRequest(self._wr_id, bool(flags & _SIGNALED), rkey, remote_addr, imm)
        self._building = wr
        self._batch.append(wr)

    def wr_set_sge(self, sge: Any) -> None:
        """pyverbs 44: ``wr_set_sge(SGE sge not None)``, one ``pyverbs.wr.SGE`` object."""
        if not isinstance(sge, SGE):
            raise TypeError(f"Argument 'sge' has incorrect type (expected pyverbs.wr.SGE, got {type(sge).__name__})")
        self._set_data([(sge.lkey, sge.addr, sge.length)], "wr_set_sge")

    def wr_set_sge_list(self, num_sge: int, sg_list: Any) -> None:
        """``ibv_wr_set_sge_list``: the first ``num_sge`` elements of ``sg_list`` (each with lkey/addr/length)."""
        sges = [(sg_list[i].lkey, sg_list[i].addr, sg_list[i].length) for i in range(num_sge)]
        self._set_data(sges, "wr_set_sge_list")

    def _set_data(self, sges: list[tuple[int, int, int]], what: str) -> None:
        self._require_region(what)
        wr = self._building
        if wr is None:
            self._latch(f"{what}() before any WR builder")
            return
        if wr.sges is not None:
            self._latch(f"{what}(): this WR already has its data (one data setter per WR, ibv_wr_post(3))")
            return
        checked = tuple(
            (c_uint(lkey, 32, "lkey"), c_uint(addr, 64, "addr"), c_uint(length, 32, "length"))
            for lkey, addr, length in sges
        )
        wr.set_data(checked)

    def _require_region(self, what: str) -> None:
        if not self._open or self._region_owner != threading.get_ident():
            fail(f"{what} outside wr_start()/wr_complete() (ibv_wr_post(3))", errno.EINVAL)

    def _latch(self, problem: str) -> None:
        if self._latched is None:
            self._latched = problem

    def wr_abort(self) -> None:
        if self._open and self._region_owner == threading.get_ident():
            self._leave_region()

    def wr_complete(self) -> None:
        """Post the batch, or raise and post none of it."""
        if not self._open or self._region_owner != threading.get_ident():
            fail("ibv_wr_complete failed: no wr_start() in this thread", errno.EINVAL)
        batch, latched = self._batch, self._latched
        self._leave_region()
        with self.port.lock:
            self._check_open()
            if latched is None:
                for wr in batch:
                    if wr.sges is None:
                        latched = "a WR got no wr_set_sge()/wr_set_sge_list()"
                    elif len(wr.sges) > self.max_send_sge:
                        latched = f"a WR has {len(wr.sges)} SGEs > cap.max_send_sge {self.max_send_sge}"
                    elif wr.length > LIMITS.max_msg_sz:
                        latched = f"a WR of {wr.length} bytes > max_msg_sz {LIMITS.max_msg_sz}"
                    if latched:
                        break
            if latched is not None:
                fail(f"ibv_wr_complete failed: {latched}", errno.EINVAL)
            if self._state in (_RESET, _INIT, _RTR):
                fail(f"ibv_wr_complete failed: the QP is in {state_name(self._state)}, posting needs RTS", errno.EINVAL)
            req = self.req
            if req.posted - req.retired + len(batch) > self.max_send_wr:
                fail(
                    f"ibv_wr_complete failed: {req.posted - req.retired} WRs outstanding + {len(batch)} > "
                    f"max_send_wr {self.max_send_wr} (slots free only when a signaled completion is polled)",
                    errno.ENOMEM,
                )
            if not batch:
                return
            mtu = MTU_BYTES[self.path_mtu]
            for wr in batch:
                wr.npsn = max(1, math.ceil(wr.length / mtu))
            req.post(batch)

    # -- teardown -------------------------------------------------------------------------------------

    def close(self) -> None:
        """``ibv_destroy_qp``: no completions for what was outstanding; idempotent."""
        with self.port.lock:
            if self.closed:
                return
            self.req.reset()
            self.closed = True
            self.port.qps.pop(self.qp_num, None)
            self.pd.qps.discard(self)
            self.send_cq.qps.discard(self)
            self.recv_cq.qps.discard(self)
            if self.srq is not None:
                self.srq.qps.discard(self)
            self.context._release(self)

    def __repr__(self) -> str:
        return f"<double QP {self.qp_num:#x} {state_name(self._state)}>"

    @property
    def sends_rocev2(self) -> bool:
        return self.sgid_type == _ROCE_V2
