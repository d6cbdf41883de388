"""One RDMA NIC as the ``verbs`` rail uses it: device, port, RoCEv2 GID, protection domain,
registered source memory, and the RC queue pairs' transitions.

A process opens each NIC once (:func:`open_nic`) and shares it among its connections: one context
and protection domain per NIC, and the memory a writer sends from registered once per NIC, local
access only (a server's pool regions; a writer's staging buffer). Each user gives it back with
:func:`release_nic`; the last one closes it, so a process whose connections are all closed holds no
device, protection domain or registration. Every verbs call goes through a
:class:`~kspeed.rdma.verbs.api.VerbsApi`.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from kspeed.errors import RailUnavailableError, TransportError

from .api import VerbsApi

__all__ = ["PORT", "Nic", "QpMaterial", "choose_nic", "close_nics", "open_nic", "release_nic"]

log = logging.getLogger(__name__)

PORT = 1
#: Transport timeout exponent: 4.096 us * 2**14 = 67 ms per try.
TIMEOUT = 14
#: Finite retries (7 would mean "forever" for RNR): a dead peer becomes an error, never a hang.
RETRY_CNT = 6
RNR_RETRY = 6
#: Minimum RNR NAK timer code 12: 0.64 ms between a receiver-not-ready and the retry.
MIN_RNR_TIMER = 12
_MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}


@dataclass(frozen=True)
class QpMaterial:
    """What the other end needs to connect to one queue pair (exchanged over the setup socket)."""

    qpn: int
    gid: str
    psn: int
    mtu: int

    def to_dict(self) -> dict[str, Any]:
        return {"qpn": self.qpn, "gid": self.gid, "psn": self.psn, "mtu": self.mtu}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> QpMaterial:
        """Raises: TransportError: a field is missing or malformed."""
        try:
            material = cls(int(data["qpn"]), str(data["gid"]), int(data["psn"]) & 0xFFFFFF, int(data["mtu"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise TransportError(f"malformed verbs queue pair material {data!r}: {exc}") from exc
        if material.mtu not in _MTU_BYTES:
            raise TransportError(f"malformed verbs queue pair material: MTU code {material.mtu}")
        return material


def choose_nic(api: VerbsApi, wanted: str | None) -> str:
    """The device to use: ``wanted`` (the placement's or the operator's NIC) or the first one.

    Raises:
        RailUnavailableError: no RDMA device here, or ``wanted`` is not one of them (never a
            silent fallback to another NIC or rail).
    """
    names = api.device_names()
    if not names:
        raise RailUnavailableError("no RDMA device on this host")
    if wanted is None:
        return names[0]
    if wanted not in names:
        raise RailUnavailableError(f"RDMA device {wanted!r} is not on this host (devices: {', '.join(names)})")
    return wanted


class Nic:
    """An opened device: its port, its RoCEv2 GID, a protection domain, and registered sources."""

    def __init__(self, api: VerbsApi, name: str) -> None:
        self.api = api
        self.name = name
        e = api.e
        self.context = api.open(name)
        try:
            port = self.context.query_port(PORT)
            if port.state != e.IBV_PORT_ACTIVE:
                raise RailUnavailableError(f"RDMA device {name} port {PORT} is not active")
            self.mtu = int(port.active_mtu)
            self.gid_index, self.gid = self._rocev2_gid(port.gid_tbl_len)
            self.pd = api.alloc_pd(self.context)
        except BaseException:
            self.context.close()
            raise
        self._sources: dict[tuple[int, int], Any] = {}
        self._lock = threading.Lock()
        #: connections using this NIC (:func:`open_nic` counts them up, :func:`release_nic` down)
        self.users = 0

    def _rocev2_gid(self, entries: int) -> tuple[int, str]:
        """The first RoCEv2 entry of the port's GID table (RoCEv1 and link-local-only entries do not
        route; peers that picked those failed to connect across subnets)."""
        e = self.api.e
        for index in range(entries):
            try:
                kind = self.context.query_gid_type(PORT, index)
                gid = self.context.query_gid(PORT, index).gid
            except Exception:  # an empty table slot raises on most providers
                continue
            # ibv_query_gid_type() answers in the sysfs enum (IBV_GID_TYPE_SYSFS_*), not ibv_gid_type
            if kind == e.IBV_GID_TYPE_SYSFS_ROCE_V2 and gid.strip("0:"):
                return index, gid
        raise RailUnavailableError(f"RDMA device {self.name} port {PORT} has no RoCEv2 GID")

    def material(self, qp: Any, psn: int) -> QpMaterial:
        return QpMaterial(int(qp.qp_num), self.gid, psn, self.mtu)

    # -------------------------------------------------------------------------------- registration

    def source_key(self, array: np.ndarray) -> int:
        """The lkey of memory holding ``array`` (registered once per NIC, for local reads only).

        Arrays over one mapping share its registration: the whole mapping a view belongs to is
        registered (a server's pool region; a staging buffer), not each view.
        """
        base = array
        while isinstance(base.base, np.ndarray):
            base = base.base
        start = base.ctypes.data
        span = (start, base.nbytes)
        addr = array.ctypes.data
        with self._lock:
            for (lo, n), mr in self._sources.items():
                if lo <= addr and addr + array.nbytes <= lo + n:
                    return int(mr.lkey)
            if not start <= addr or addr + array.nbytes > start + base.nbytes:
                span = (addr, array.nbytes)
            try:  # the NIC only reads a source: no access flag (a feeder maps its pool read-only)
                mr = self.api.reg_mr(self.pd, span[0], span[1], 0)
            except Exception as exc:  # pyverbs' own errors
                raise TransportError(f"registering {span[1]} bytes with RDMA device {self.name}: {exc}") from exc
            self._sources[span] = mr
            return int(mr.lkey)

    def forget_source(self, array: np.ndarray) -> None:
        """Deregister the registration covering ``array`` (before its memory is unmapped)."""
        addr = array.ctypes.data
        with self._lock:
            for span, mr in list(self._sources.items()):
                if span[0] <= addr < span[0] + span[1]:
                    mr.close()
                    del self._sources[span]

    # -------------------------------------------------------------------------------- queue pairs

    def create_qp(self, send_cq: Any, recv_cq: Any, srq: Any | None, max_send_wr: int) -> Any:
        cap = self.api.QPCap(max_send_wr=max_send_wr, max_recv_wr=0 if srq else 1, max_send_sge=1, max_recv_sge=1)
        return self.api.create_qp(self.context, self.pd, send_cq, recv_cq, srq, cap)

    def to_init(self, qp: Any, remote_write: bool) -> None:
        """RESET -> INIT; a responder grants remote writes here (``qp_access_flags`` is 0 by default)."""
        e = self.api.e
        attr = self.api.QPAttr(qp_state=e.IBV_QPS_INIT)
        attr.pkey_index = 0
        attr.port_num = PORT
        attr.qp_access_flags = e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_LOCAL_WRITE if remote_write else 0
        qp.modify(attr, e.IBV_QP_STATE | e.IBV_QP_PKEY_INDEX | e.IBV_QP_PORT | e.IBV_QP_ACCESS_FLAGS)

    def to_rtr(self, qp: Any, peer: QpMaterial, rq_psn: int) -> None:
        """INIT -> RTR towards ``peer``: a global route (RoCE needs a GRH) from our RoCEv2 GID."""
        api, e = self.api, self.api.e
        route = api.GlobalRoute(dgid=api.GID(peer.gid), sgid_index=self.gid_index)
        route.hop_limit = 64
        attr = api.QPAttr(qp_state=e.IBV_QPS_RTR)
        attr.ah_attr = api.AHAttr(gr=route, is_global=1, port_num=PORT)
        attr.path_mtu = min(self.mtu, peer.mtu)
        attr.dest_qp_num = peer.qpn
        attr.rq_psn = rq_psn
        attr.max_dest_rd_atomic = 1
        attr.min_rnr_timer = MIN_RNR_TIMER
        qp.modify(
            attr,
            e.IBV_QP_STATE
            | e.IBV_QP_AV
            | e.IBV_QP_PATH_MTU
            | e.IBV_QP_DEST_QPN
            | e.IBV_QP_RQ_PSN
            | e.IBV_QP_MAX_DEST_RD_ATOMIC
            | e.IBV_QP_MIN_RNR_TIMER,
        )

    def to_rts(self, qp: Any, sq_psn: int) -> None:
        """RTR -> RTS with finite retries, so a dead peer fails the QP instead of hanging it."""
        e = self.api.e
        attr = self.api.QPAttr(qp_state=e.IBV_QPS_RTS)
        attr.timeout = TIMEOUT
        attr.retry_cnt = RETRY_CNT
        attr.rnr_retry = RNR_RETRY
        attr.sq_psn = sq_psn
        attr.max_rd_atomic = 1
        qp.modify(
            attr,
            e.IBV_QP_STATE
            | e.IBV_QP_TIMEOUT
            | e.IBV_QP_RETRY_CNT
            | e.IBV_QP_RNR_RETRY
            | e.IBV_QP_SQ_PSN
            | e.IBV_QP_MAX_QP_RD_ATOMIC,
        )

    def to_error(self, qp: Any) -> None:
        """Any state -> ERR: outstanding work requests are flushed, no more bytes move."""
        e = self.api.e
        qp.modify(self.api.QPAttr(qp_state=e.IBV_QPS_ERR), e.IBV_QP_STATE)

    def close(self) -> None:
        with self._lock:
            for mr in self._sources.values():
                mr.close()
            self._sources.clear()
        self.pd.close()
        self.context.close()


def new_psn() -> int:
    """A random 24-bit packet sequence number."""
    return int.from_bytes(os.urandom(3), "little")


_NICS: dict[tuple[int, str], Nic] = {}
_NICS_LOCK = threading.Lock()


def open_nic(api: VerbsApi, name: str) -> Nic:
    """This process's :class:`Nic` for ``name`` through ``api`` (opened on first use, then shared);
    each call is one more user, to be given back with :func:`release_nic`."""
    key = (id(api), name)
    with _NICS_LOCK:
        nic = _NICS.get(key)
        if nic is None:
            try:
                nic = Nic(api, name)
            except RailUnavailableError:
                raise
            except Exception as exc:  # pyverbs raises its own errors for device failures
                raise RailUnavailableError(f"cannot open RDMA device {name}: {exc}") from exc
            _NICS[key] = nic
            log.info("verbs: opened %s (GID %s, index %d)", name, nic.gid, nic.gid_index)
        nic.users += 1
        return nic


def release_nic(nic: Nic) -> None:
    """One user of ``nic`` is done with it; the last one closes it (its registrations with it)."""
    with _NICS_LOCK:
        nic.users -= 1
        if nic.users > 0:
            return
        key = (id(nic.api), nic.name)
        if _NICS.get(key) is nic:
            del _NICS[key]
        _close(nic)


def close_nics(api: VerbsApi) -> None:
    """Close this process's NICs opened through ``api``, whoever still uses them (the rail's API is
    being replaced)."""
    with _NICS_LOCK:
        for key in [k for k in _NICS if k[0] == id(api)]:
            nic = _NICS.pop(key)
            nic.users = 0
            _close(nic)


def _close(nic: Nic) -> None:
    try:
        nic.close()
    except Exception as exc:  # a queue pair still open keeps its device busy
        log.warning("verbs: closing %s: %s", nic.name, exc)
