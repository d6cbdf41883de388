"""A strict software double of the pyverbs objects the ``verbs`` rail uses, on simulated NICs.

``api`` implements ``kspeed.rdma.verbs.api.VerbsApi``; ``load_api("tests.verbs_double:api")``
returns it. It simulates a fabric of RoCEv2 NICs that really moves bytes between processes of this
host: each ``open(name)`` starts (or joins) the process's simulated port of that device, whose
daemon thread listens on abstract Unix sockets named after its GIDs; a requester QP reaches the
responder's NIC through the destination GID and QPN of its address vector, writes the payload
straight into the responder's registered memory and returns ACKs and NAKs, all checked the way
the verbs man pages and the InfiniBand Architecture Specification vol. 1 say hardware checks them.

The device-independent structs are pyverbs' own: ``api.SGE``, ``RecvWR``, ``SendWR``,
``QPAttr``, ``QPCap``, ``AHAttr``, ``GlobalRoute``, ``GID``; ``api.e`` is ``pyverbs.enums``;
completions are pyverbs ``WC`` objects; errors are ``PyverbsRDMAError`` with an errno.

Modules (each says what it simulates and what it does not):

* ``config``: device limits (``api.limits``), knobs (``api.knobs``: devices, seed, timer cap)
  read once from ``KSPEED_VERBS_DOUBLE_*`` environment variables, timer scaling;
* ``device``: ``VerbsDouble`` (the API), ``Context`` (ports, GIDs, async events);
* ``memory``: PDs, MRs and dma-buf MRs; ``cq``: CQs; ``rq``: SRQs and receive WRs; ``qp``: the QP state machine
  and the ``ibv_wr_*`` posting calls;
* ``requester``/``responder``: the two halves of RC transport; ``conn``/``wire``/``nic``: the
  connections, frames and the NIC thread.

Knobs (documented in ``config``): ``KSPEED_VERBS_DOUBLE_DEVICES`` (``dbl0,dbl1``; ``name:MTU``
sets a port's active MTU; empty = no device), ``KSPEED_VERBS_DOUBLE_SEED`` (cross-QP reordering),
``KSPEED_VERBS_DOUBLE_TIMER_CAP`` (seconds; caps transport and RNR timers, default 0.05),
``KSPEED_VERBS_DOUBLE_JITTER`` (seconds; the most a QP's new burst of requests is held at the
responder, default 0.002; 0 = no deliberate reordering). In process they may be changed on
``api.knobs`` (a :class:`Knobs`; the ports read it live). ``live_threads()`` lists the NIC threads
still running (a leak check). There is no fault-injection API: faults are made the way they happen
-- a peer process killed, a context or QP closed, an MR deregistered, a CQ left unpolled.

Things a rail must get right to pass here (they are what hardware does):

* ``qp.wr_set_sge`` takes one pyverbs ``SGE`` (pyverbs 44), not ``(lkey, addr, length)``;
* ``query_gid_type`` returns ``IBV_GID_TYPE_SYSFS_ROCE_V2`` (1) for RoCEv2, not
  ``IBV_GID_TYPE_ROCE_V2`` (2); only RoCEv2 source GIDs get through the (routed) fabric;
* ``qp.qp_state`` is libibverbs' cached state (last modify/query); errors show in completions,
  async events and ``qp.query(...)``;
* ``wc.imm_data`` is network order: ``socket.ntohl(wc.imm_data)`` is what ``wr_rdma_write_imm`` got;
* a QP must signal now and then: unsignaled WRs hold their send-queue slots until a later signaled
  completion of that QP is polled;
* ``qp_access_flags`` must include ``IBV_ACCESS_REMOTE_WRITE`` on the responder QP (its default is 0);
* only one QP's writes are ordered; nothing orders two QPs, even to the same receiver;
* teardown in C order: QPs, then SRQs/MRs, then CQs/PDs (``EBUSY`` otherwise; ``Context.close()``
  does it all).
"""

from __future__ import annotations

from .config import LIMITS, Knobs, Limits
from .device import Context, VerbsDouble
from .nic import live_threads

__all__ = ["LIMITS", "Context", "Knobs", "Limits", "VerbsDouble", "api", "live_threads"]

#: The ``VerbsApi`` instance ``load_api("tests.verbs_double:api")`` returns.
api = VerbsDouble()
