"""The thin interface the ``verbs`` rail uses: the pyverbs calls it makes, and nothing else.

Everything the rail does with an RDMA device goes through one :class:`VerbsApi` object, so the
same rail code runs on pyverbs (:class:`Pyverbs`, the only implementation shipped) and, in the
tests, on a strict software double of the same objects (``tests/verbs_double``). The structs that
pyverbs builds without a device (``SGE``, ``RecvWR``, ``SendWR``, ``QPAttr``, ``QPCap``,
``AHAttr``, ``GlobalRoute``, ``GID``) are always pyverbs' own, so byte order, ``num_sge`` and
attribute masks are exercised on the real struct layer by both.

What each object must offer (pyverbs' names and meanings):

* context (:meth:`VerbsApi.open`): ``query_port(port)`` (``state``, ``active_mtu``,
  ``gid_tbl_len``, ``link_layer``), ``query_gid(port, index)`` (a ``GID``; ``.gid`` its text),
  ``query_gid_type(port, index)``, ``close()``;
* protection domain (:meth:`VerbsApi.alloc_pd`): ``close()``;
* memory region (:meth:`VerbsApi.reg_mr`, and :meth:`VerbsApi.reg_dmabuf_mr` for a device ring's
  dma-buf, addressed by IOVA from 0): ``lkey``, ``rkey``, ``close()`` (deregistration: the keys
  stop working at once);
* completion queue (:meth:`VerbsApi.create_cq`): ``poll(n) -> (npolled, [WC])`` where a ``WC``
  has ``wr_id``, ``status``, ``opcode``, ``byte_len``, ``qp_num``, ``imm_data`` (network byte
  order, as ``ibv_wc.imm_data``), ``wc_flags``; raises when the CQ is in error; ``close()``;
* shared receive queue (:meth:`VerbsApi.create_srq`): ``post_recv(RecvWR)``, ``close()``;
* queue pair (:meth:`VerbsApi.create_qp`, an RC ``QPEx``): ``qp_num``, ``qp_state``,
  ``modify(QPAttr, mask)``, and the extended posting calls ``wr_start()``, ``wr_id``,
  ``wr_flags``, ``wr_rdma_write(rkey, addr)``, ``wr_rdma_write_imm(rkey, addr, imm)`` (``imm``
  in host order; the call stores it big-endian), ``wr_set_sge(SGE)`` (one pyverbs ``SGE``, as in pyverbs 44),
  ``wr_complete()`` (raises when the batch is refused), ``wr_abort()``, ``close()``.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

from kspeed.errors import RailUnavailableError

__all__ = ["Pyverbs", "VerbsApi", "load_api"]


class VerbsApi(Protocol):
    """The calls the ``verbs`` rail makes (see the module's docstring for the objects' members)."""

    #: ``ibv_*`` enums (``IBV_ACCESS_*``, ``IBV_QPS_*``, ``IBV_QP_*`` masks, ``IBV_WC_*``, ...).
    e: Any
    SGE: Any
    RecvWR: Any
    SendWR: Any
    QPAttr: Any
    QPCap: Any
    AHAttr: Any
    GlobalRoute: Any
    GID: Any

    def device_names(self) -> list[str]:
        """The RDMA devices of this host (``[]`` when there are none)."""

    def open(self, name: str) -> Any:
        """Open device ``name`` (``ibv_open_device``)."""

    def alloc_pd(self, context: Any) -> Any:
        """A protection domain (``ibv_alloc_pd``)."""

    def reg_mr(self, pd: Any, address: int, length: int, access: int) -> Any:
        """Register ``[address, address + length)`` with ``access`` flags (``ibv_reg_mr``)."""

    def reg_dmabuf_mr(self, pd: Any, fd: int, length: int, access: int) -> Any:
        """Register ``length`` bytes of dma-buf ``fd`` from its start, at IOVA 0 (``ibv_reg_dmabuf_mr``)."""

    def create_cq(self, context: Any, cqe: int) -> Any:
        """A completion queue of at least ``cqe`` entries (``ibv_create_cq``)."""

    def create_srq(self, pd: Any, max_wr: int, max_sge: int) -> Any:
        """A shared receive queue (``ibv_create_srq``)."""

    def create_qp(self, context: Any, pd: Any, send_cq: Any, recv_cq: Any, srq: Any | None, cap: Any) -> Any:
        """An RC extended QP posting ``RDMA_WRITE`` and ``RDMA_WRITE_WITH_IMM`` (``ibv_create_qp_ex``)."""


def _enums() -> Any:
    """pyverbs' enums: ``pyverbs.enums`` up to rdma-core 49, ``pyverbs.libibverbs_enums`` from 50."""
    try:
        return importlib.import_module("pyverbs.libibverbs_enums")
    except ImportError:
        return importlib.import_module("pyverbs.enums")


class Pyverbs:
    """:class:`VerbsApi` on pyverbs (Debian's ``python3-pyverbs``, linked into the venv by ``make``).

    Raises:
        RailUnavailableError: pyverbs is not installed.
    """

    def __init__(self) -> None:
        try:
            from pyverbs import addr, cq, device, mr, pd, qp, srq, wr
        except ImportError as exc:
            raise RailUnavailableError(
                f"pyverbs is not installed ({exc}); install rdma-core's python3-pyverbs"
            ) from exc
        self._device, self._pd, self._mr, self._cq, self._srq, self._qp = device, pd, mr, cq, srq, qp
        self.e = _enums()
        self.SGE, self.RecvWR, self.SendWR = wr.SGE, wr.RecvWR, wr.SendWR
        self.QPAttr, self.QPCap = qp.QPAttr, qp.QPCap
        self.AHAttr, self.GlobalRoute, self.GID = addr.AHAttr, addr.GlobalRoute, addr.GID

    def device_names(self) -> list[str]:
        from pyverbs.pyverbs_error import PyverbsError

        try:
            devices = self._device.get_device_list()
        except PyverbsError:  # rdma-core 44 raises, instead of returning [], when there is none
            return []
        return sorted(d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devices)

    def open(self, name: str) -> Any:
        return self._device.Context(name=name)

    def alloc_pd(self, context: Any) -> Any:
        return self._pd.PD(context)

    def reg_mr(self, pd: Any, address: int, length: int, access: int) -> Any:
        return self._mr.MR(pd, length, access, address=address)

    def reg_dmabuf_mr(self, pd: Any, fd: int, length: int, access: int) -> Any:
        # pyverbs passes its offset as the IOVA too (ibv_reg_dmabuf_mr(pd, offset, length, offset, fd, access))
        return self._mr.DmaBufMR(pd, length, access, dmabuf=fd, offset=0)

    def create_cq(self, context: Any, cqe: int) -> Any:
        return self._cq.CQ(context, cqe, None, None, 0)

    def create_srq(self, pd: Any, max_wr: int, max_sge: int) -> Any:
        attr = self._srq.SrqInitAttr(self._srq.SrqAttr(max_wr=max_wr, max_sge=max_sge))
        return self._srq.SRQ(pd, attr)

    def create_qp(self, context: Any, pd: Any, send_cq: Any, recv_cq: Any, srq: Any | None, cap: Any) -> Any:
        e = self.e
        init = self._qp.QPInitAttrEx(
            qp_type=e.IBV_QPT_RC,
            scq=send_cq,
            rcq=recv_cq,
            srq=srq,
            cap=cap,
            pd=pd,
            comp_mask=e.IBV_QP_INIT_ATTR_PD | e.IBV_QP_INIT_ATTR_SEND_OPS_FLAGS,
            send_ops_flags=e.IBV_QP_EX_WITH_RDMA_WRITE | e.IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM,
        )
        return self._qp.QPEx(context, init)


def load_api(spec: str | None) -> VerbsApi:
    """The :class:`VerbsApi` named by ``spec``: ``None`` or ``"pyverbs"`` for :class:`Pyverbs`, or
    ``"module:attribute"`` for another implementation (the tests' double).

    Raises:
        RailUnavailableError: it cannot be loaded.
    """
    if spec in (None, "", "pyverbs"):
        return Pyverbs()
    module, _, attribute = spec.partition(":")
    try:
        api = getattr(importlib.import_module(module), attribute or "api")
    except (ImportError, AttributeError) as exc:
        raise RailUnavailableError(f"verbs API {spec!r} cannot be loaded: {exc}") from exc
    return api() if isinstance(api, type) else api
