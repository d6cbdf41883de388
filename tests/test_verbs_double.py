"""The strict double of pyverbs (``tests/verbs_double``) checked on its own: every rule it enforces fires
on a planted misuse, and a well-behaved pair of QPs moves bytes and immediates, in one process and
across two.

The rules, by section below (their sources are cited in the double's modules): 1 QP state machine
and masks, 2 posting, 3 MR access, 4 lkey/rkey/range checks and error flushing, 5 RNR, 6 CQ overrun
and creation limits, 7 ordering, 8 big-endian immediates, 9 dead peers, 10 closing.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import mmap
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from pyverbs.cq import WC
from pyverbs.pyverbs_error import PyverbsRDMAError

from kspeed.rdma.verbs.api import load_api
from tests.verbs_double import Knobs, VerbsDouble, api, live_threads
from tests.verbs_double.config import DeviceSpec

e = api.e
REPO = Path(__file__).resolve().parent.parent

LW, RW = e.IBV_ACCESS_LOCAL_WRITE, e.IBV_ACCESS_REMOTE_WRITE
SIGNALED = e.IBV_SEND_SIGNALED
INIT_MASK = e.IBV_QP_STATE | e.IBV_QP_PKEY_INDEX | e.IBV_QP_PORT | e.IBV_QP_ACCESS_FLAGS
RTR_MASK = (
    e.IBV_QP_STATE
    | e.IBV_QP_AV
    | e.IBV_QP_PATH_MTU
    | e.IBV_QP_DEST_QPN
    | e.IBV_QP_RQ_PSN
    | e.IBV_QP_MAX_DEST_RD_ATOMIC
    | e.IBV_QP_MIN_RNR_TIMER
)
RTS_MASK = (
    e.IBV_QP_STATE
    | e.IBV_QP_TIMEOUT
    | e.IBV_QP_RETRY_CNT
    | e.IBV_QP_RNR_RETRY
    | e.IBV_QP_SQ_PSN
    | e.IBV_QP_MAX_QP_RD_ATOMIC
)
ROCE_V2_INDEX = 1
TIMEOUT_EXP = 14  # 67 ms real, capped at the double's timer cap (50 ms by default)


# -- helpers ------------------------------------------------------------------------------------------


def errno_of(info: pytest.ExceptionInfo) -> int:
    return info.value.error_code


def true_state(qp) -> int:
    """The QP's real state (``ibv_query_qp``), not libibverbs' cached ``qp_state``."""
    return qp.query(e.IBV_QP_STATE)[0].qp_state


def init_attr(access: int = RW):
    attr = api.QPAttr(qp_state=e.IBV_QPS_INIT)
    attr.pkey_index = 0
    attr.port_num = 1
    attr.qp_access_flags = access
    return attr


def rtr_attr(dgid: str, dest_qpn: int, *, rq_psn: int = 0, min_rnr_timer: int = 1, sgid_index: int = ROCE_V2_INDEX):
    attr = api.QPAttr(qp_state=e.IBV_QPS_RTR)
    attr.path_mtu = e.IBV_MTU_4096
    attr.dest_qp_num = dest_qpn
    attr.rq_psn = rq_psn
    attr.max_dest_rd_atomic = 1
    attr.min_rnr_timer = min_rnr_timer
    attr.ah_attr = api.AHAttr(is_global=1, port_num=1, gr=api.GlobalRoute(dgid=api.GID(dgid), sgid_index=sgid_index))
    return attr


def rts_attr(*, sq_psn: int = 0, timeout: int = TIMEOUT_EXP, retry_cnt: int = 7, rnr_retry: int = 7):
    attr = api.QPAttr(qp_state=e.IBV_QPS_RTS)
    attr.timeout = timeout
    attr.retry_cnt = retry_cnt
    attr.rnr_retry = rnr_retry
    attr.sq_psn = sq_psn
    attr.max_rd_atomic = 1
    return attr


@dataclass
class End:
    """One side: a context's PD, CQ, SRQ, a registered buffer and a QP."""

    ctx: object
    pd: object
    cq: object
    srq: object
    buf: ctypes.Array
    mr: object
    qp: object

    @property
    def addr(self) -> int:
        return ctypes.addressof(self.buf)

    @property
    def gid(self) -> str:
        return self.ctx.query_gid(1, ROCE_V2_INDEX).gid

    def bytes(self, offset: int, length: int) -> bytes:
        return ctypes.string_at(self.addr + offset, length)

    def post_recv(self, count: int = 1, first_id: int = 100) -> None:
        for i in range(count):
            wr = api.RecvWR(wr_id=first_id + i, num_sge=1, sg=[api.SGE(0, 0, 0)])
            wr.num_sge = 0  # pyverbs 44 refuses num_sge=0 at construction; a WRITE_WITH_IMM needs no SGE
            self.srq.post_recv(wr)


def make_end(
    ctx,
    *,
    size: int = 1 << 20,
    mr_access: int = LW | RW,
    cqe: int = 1024,
    srq_wr: int = 256,
    max_send_wr: int = 512,
    with_srq: bool = True,
    fill: bytes = b"",
) -> End:
    pd = api.alloc_pd(ctx)
    cq = api.create_cq(ctx, cqe)
    srq = api.create_srq(pd, srq_wr, 1) if with_srq else None
    buf = ctypes.create_string_buffer(fill, size) if fill else ctypes.create_string_buffer(size)
    mr = api.reg_mr(pd, ctypes.addressof(buf), size, mr_access)
    qp = api.create_qp(ctx, pd, cq, cq, srq, api.QPCap(max_send_wr=max_send_wr, max_recv_wr=16, max_send_sge=4))
    return End(ctx, pd, cq, srq, buf, mr, qp)


def connect(a: End, b: End, *, access_a: int = RW, access_b: int = RW, rts_a: dict | None = None, **rtr_a) -> None:
    """Bring ``a.qp`` and ``b.qp`` to RTS, each aimed at the other."""
    for me, access in ((a, access_a), (b, access_b)):
        me.qp.modify(init_attr(access), INIT_MASK)
    a.qp.modify(rtr_attr(b.gid, b.qp.qp_num, **rtr_a), RTR_MASK)
    b.qp.modify(rtr_attr(a.gid, a.qp.qp_num), RTR_MASK)
    a.qp.modify(rts_attr(**(rts_a or {})), RTS_MASK)
    b.qp.modify(rts_attr(), RTS_MASK)


def post(qp, ops) -> None:
    """One ``wr_start``..``wr_complete`` batch of ``(wr_id, flags, rkey, raddr, lkey, addr, length, imm)``."""
    qp.wr_start()
    for wr_id, flags, rkey, raddr, lkey, addr, length, imm in ops:
        qp.wr_id = wr_id
        qp.wr_flags = flags
        if imm is None:
            qp.wr_rdma_write(rkey, raddr)
        else:
            qp.wr_rdma_write_imm(rkey, raddr, imm)
        qp.wr_set_sge(api.SGE(addr, length, lkey))
    qp.wr_complete()


def write(src: End, dst: End, wr_id: int, offset: int, length: int, *, dst_offset: int = 0, imm=None, flags=SIGNALED):
    """A one-WR batch writing ``src.buf[offset:+length]`` to ``dst.buf[dst_offset:]``."""
    post(src.qp, [(wr_id, flags, dst.mr.rkey, dst.addr + dst_offset, src.mr.lkey, src.addr + offset, length, imm)])


def poll_until(cq, count: int, timeout: float = 5.0) -> list[WC]:
    """Poll ``cq`` until ``count`` completions arrived (fewer only on timeout)."""
    wcs: list[WC] = []
    deadline = time.monotonic() + timeout
    while len(wcs) < count and time.monotonic() < deadline:
        _, got = cq.poll(count - len(wcs))
        wcs += got
    return wcs


def statuses(wcs) -> list[tuple[int, int]]:
    return [(wc.wr_id, wc.status) for wc in wcs]


def _sockets() -> set[str]:
    """This process's open sockets (``socket:[inode]``)."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:"):
                found.add(target)
    return found


@pytest.fixture
def contexts():
    """``open(name)`` for the test; every context is closed after it, and no NIC thread or socket leaks."""
    sockets_before = _sockets()
    opened: list = []

    def open_(name: str, double=api):
        ctx = double.open(name)
        opened.append(ctx)
        return ctx

    yield open_
    for ctx in opened:
        ctx.close()
    assert live_threads() == []
    assert _sockets() <= sockets_before  # every socket of the simulated NICs is closed


@pytest.fixture
def pair(contexts):
    """A requester ``a`` on dbl0 and a responder ``b`` on dbl1, connected (RTS both)."""
    a = make_end(contexts("dbl0"), fill=bytes(range(256)) * 4096)
    b = make_end(contexts("dbl1"))
    connect(a, b)
    return a, b


# -- the API, devices, GIDs ---------------------------------------------------------------------------------


def test_load_api_returns_the_double_with_pyverbs_structs():
    import pyverbs.addr
    import pyverbs.qp
    import pyverbs.wr

    loaded = load_api("tests.verbs_double:api")
    assert loaded is api
    assert (loaded.SGE, loaded.RecvWR, loaded.SendWR) == (pyverbs.wr.SGE, pyverbs.wr.RecvWR, pyverbs.wr.SendWR)
    assert (loaded.QPAttr, loaded.QPCap) == (pyverbs.qp.QPAttr, pyverbs.qp.QPCap)
    assert (loaded.AHAttr, loaded.GlobalRoute, loaded.GID) == (
        pyverbs.addr.AHAttr,
        pyverbs.addr.GlobalRoute,
        pyverbs.addr.GID,
    )
    assert loaded.limits.max_qp_wr == 4096 and loaded.limits.max_sge == 4 and loaded.limits.max_cqe == 65536


def test_devices_ports_and_gid_tables(contexts):
    assert api.device_names() == ["dbl0", "dbl1"]
    a, b = contexts("dbl0"), contexts("dbl1")
    port = a.query_port(1)
    assert port.state == e.IBV_PORT_ACTIVE
    assert port.active_mtu == e.IBV_MTU_4096
    assert port.link_layer == e.IBV_LINK_LAYER_ETHERNET
    assert port.gid_tbl_len == 8
    # ibv_query_gid_type returns the sysfs enum: RoCEv1 is 0, RoCEv2 is 1 (not IBV_GID_TYPE_ROCE_V2 == 2)
    types = [a.query_gid_type(1, i) for i in range(port.gid_tbl_len)]
    assert types[:4] == [e.IBV_GID_TYPE_SYSFS_IB_ROCE_V1, e.IBV_GID_TYPE_SYSFS_ROCE_V2] * 2
    assert e.IBV_GID_TYPE_ROCE_V2 not in types
    gids = [a.query_gid(1, i).gid for i in range(port.gid_tbl_len)]
    assert gids[4:] == ["0000:0000:0000:0000:0000:0000:0000:0000"] * 4  # empty entries read as zero
    assert a.query_gid(1, 1).gid != b.query_gid(1, 1).gid  # one GID per (process, device)
    with pytest.raises(PyverbsRDMAError) as info:
        a.query_port(2)
    assert errno_of(info) == errno.EINVAL
    with pytest.raises(PyverbsRDMAError) as info:
        a.query_gid(1, 8)
    assert errno_of(info) == errno.EINVAL
    with pytest.raises(PyverbsRDMAError) as info:
        api.open("mlx5_0")
    assert errno_of(info) == errno.ENODEV


def test_child_processes_read_the_device_list_from_the_environment():
    code = (
        "import os\n"
        "from kspeed.rdma.verbs.api import load_api\n"
        "api = load_api('tests.verbs_double:api')\n"
        "ctx = api.open('x1')\n"
        "print(','.join(api.device_names()), ctx.query_port(1).active_mtu, ctx.query_gid(1, 1).gid, os.getpid())\n"
        "ctx.close()\n"
    )
    env = {**os.environ, "KSPEED_VERBS_DOUBLE_DEVICES": "x0,x1:1024"}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    names, mtu, gid, pid = out.stdout.split()
    assert names == "x0,x1"
    assert int(mtu) == e.IBV_MTU_1024
    assert gid.startswith("fe80:") and gid.split(":")[6] == f"{int(pid) & 0xFFFF:04x}"  # the child's own GID


# -- happy path (rules 7, 8 on a good rail) --------------------------------------------------------------


def test_chained_writes_and_an_immediate_arrive(pair):
    a, b = pair
    b.post_recv(1, first_id=42)
    lkey, rkey = a.mr.lkey, b.mr.rkey
    post(
        a.qp,
        [
            (1, 0, rkey, b.addr + 0, lkey, a.addr + 0, 1000, None),
            (2, 0, rkey, b.addr + 1000, lkey, a.addr + 5000, 3000, None),
            (3, 0, rkey, b.addr + 4000, lkey, a.addr + 9000, 100_000, None),
            (4, SIGNALED, rkey, b.addr + 104_000, lkey, a.addr + 200_000, 24, 0x11223344),
        ],
    )
    [recv] = poll_until(b.cq, 1)
    assert recv.status == e.IBV_WC_SUCCESS
    assert recv.opcode == e.IBV_WC_RECV_RDMA_WITH_IMM
    assert recv.wr_id == 42
    assert recv.qp_num == b.qp.qp_num
    assert recv.byte_len == 24
    assert recv.wc_flags & e.IBV_WC_WITH_IMM
    assert socket.ntohl(recv.imm_data) == 0x11223344
    # everything posted before the immediate landed before its completion (RC order, IBA 9.5)
    assert b.bytes(0, 1000) == a.bytes(0, 1000)
    assert b.bytes(1000, 3000) == a.bytes(5000, 3000)
    assert b.bytes(4000, 100_000) == a.bytes(9000, 100_000)
    assert b.bytes(104_000, 24) == a.bytes(200_000, 24)
    [sent] = poll_until(a.cq, 1)  # only the signaled WR completes
    assert (sent.wr_id, sent.status, sent.opcode, sent.qp_num) == (
        4,
        e.IBV_WC_SUCCESS,
        e.IBV_WC_RDMA_WRITE,
        a.qp.qp_num,
    )
    time.sleep(0.05)
    assert a.cq.poll(8) == (0, [])


def test_immediate_is_big_endian_on_the_wire(pair):
    a, b = pair
    b.post_recv(2)
    write(a, b, 1, 0, 0, imm=0x01020304)
    write(a, b, 2, 0, 0, imm=0xFFFF0000)
    wcs = poll_until(b.cq, 2)
    # ibv_wc.imm_data is the __be32 of the wire read as a host integer: a rail must ntohl it
    assert [wc.imm_data for wc in wcs] == [int.from_bytes(b"\x01\x02\x03\x04", sys.byteorder), 0x0000FFFF]
    assert [socket.ntohl(wc.imm_data) for wc in wcs] == [0x01020304, 0xFFFF0000]
    a.qp.wr_start()
    with pytest.raises(OverflowError):
        a.qp.wr_rdma_write_imm(b.mr.rkey, b.addr, 1 << 32)
    a.qp.wr_abort()


def test_source_bytes_are_read_when_the_nic_sends_them(contexts, monkeypatch):
    monkeypatch.setattr(api.knobs, "timer_cap_s", 2.0)  # let RNR timer code 0 wait its real 655 ms
    a = make_end(contexts("dbl0"))
    b = make_end(contexts("dbl1"))
    for end in (a, b):
        end.qp.modify(init_attr(), INIT_MASK)
    a.qp.modify(rtr_attr(b.gid, b.qp.qp_num), RTR_MASK)
    b.qp.modify(rtr_attr(a.gid, a.qp.qp_num, min_rnr_timer=0), RTR_MASK)
    for end in (a, b):
        end.qp.modify(rts_attr(), RTS_MASK)
    a.buf[0:4] = b"old!"
    write(a, b, 1, 0, 4, imm=7)  # no receive WR yet: sent, RNR-NAKed, retransmitted in 655 ms
    time.sleep(0.05)
    a.buf[0:4] = b"new!"  # changed after the post, before the retransmission
    b.post_recv(1)
    assert statuses(poll_until(a.cq, 1)) == [(1, e.IBV_WC_SUCCESS)]
    assert b.bytes(0, 4) == b"new!"  # what the NIC read when it sent the message, not at post time


# -- rule 1: the QP state machine ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stage", "mask_name"),
    [("init", name) for name in ("IBV_QP_PKEY_INDEX", "IBV_QP_PORT", "IBV_QP_ACCESS_FLAGS")]
    + [
        ("rtr", name)
        for name in (
            "IBV_QP_AV",
            "IBV_QP_PATH_MTU",
            "IBV_QP_DEST_QPN",
            "IBV_QP_RQ_PSN",
            "IBV_QP_MAX_DEST_RD_ATOMIC",
            "IBV_QP_MIN_RNR_TIMER",
        )
    ]
    + [
        ("rts", name)
        for name in (
            "IBV_QP_TIMEOUT",
            "IBV_QP_RETRY_CNT",
            "IBV_QP_RNR_RETRY",
            "IBV_QP_SQ_PSN",
            "IBV_QP_MAX_QP_RD_ATOMIC",
        )
    ],
)
def test_each_required_mask_bit_is_required(contexts, stage, mask_name):
    end = make_end(contexts("dbl0"))
    qp, bit = end.qp, getattr(e, mask_name)
    steps = [
        ("init", init_attr(), INIT_MASK),
        ("rtr", rtr_attr(end.gid, qp.qp_num), RTR_MASK),
        ("rts", rts_attr(), RTS_MASK),
    ]
    for name, attr, mask in steps:
        if name == stage:
            before = true_state(qp)
            with pytest.raises(PyverbsRDMAError, match=mask_name) as info:
                qp.modify(attr, mask & ~bit)
            assert errno_of(info) == errno.EINVAL
            assert true_state(qp) == before  # nothing changed
            qp.modify(attr, mask)  # the full mask works
            return
        qp.modify(attr, mask)


def test_bits_a_transition_does_not_allow_are_refused(contexts):
    end = make_end(contexts("dbl0"))
    qp = end.qp
    with pytest.raises(PyverbsRDMAError, match="IBV_QP_SQ_PSN") as info:
        qp.modify(init_attr(), INIT_MASK | e.IBV_QP_SQ_PSN)
    assert errno_of(info) == errno.EINVAL
    qp.modify(init_attr(), INIT_MASK)
    with pytest.raises(PyverbsRDMAError, match="IBV_QP_TIMEOUT"):
        qp.modify(rtr_attr(end.gid, qp.qp_num), RTR_MASK | e.IBV_QP_TIMEOUT)
    with pytest.raises(PyverbsRDMAError, match="IBV_QP_ALT_PATH"):
        qp.modify(rtr_attr(end.gid, qp.qp_num), RTR_MASK | e.IBV_QP_ALT_PATH)
    qp.modify(rtr_attr(end.gid, qp.qp_num), RTR_MASK | e.IBV_QP_ACCESS_FLAGS)  # optional on INIT->RTR
    assert true_state(qp) == e.IBV_QPS_RTR


def test_only_the_rc_transitions_are_allowed(contexts):
    end = make_end(contexts("dbl0"))
    qp = end.qp
    for attr, mask in ((rtr_attr(end.gid, 1), RTR_MASK), (rts_attr(), RTS_MASK)):  # RESET->RTR, RESET->RTS
        with pytest.raises(PyverbsRDMAError, match="not a transition") as info:
            qp.modify(attr, mask)
        assert errno_of(info) == errno.EINVAL
    qp.modify(init_attr(), INIT_MASK)
    with pytest.raises(PyverbsRDMAError, match="INIT->RTS"):
        qp.modify(rts_attr(), RTS_MASK)
    with pytest.raises(PyverbsRDMAError, match="INIT->INIT"):
        qp.modify(init_attr(), INIT_MASK)
    qp.modify(api.QPAttr(qp_state=e.IBV_QPS_ERR), e.IBV_QP_STATE)  # any -> ERR
    with pytest.raises(PyverbsRDMAError, match="ERR->INIT"):
        qp.modify(init_attr(), INIT_MASK)
    qp.modify(api.QPAttr(qp_state=e.IBV_QPS_RESET), e.IBV_QP_STATE)  # any -> RESET
    qp.modify(init_attr(), INIT_MASK)
    assert qp.qp_state == true_state(qp) == e.IBV_QPS_INIT


@pytest.mark.parametrize(
    ("stage", "field", "value", "match"),
    [
        ("init", "port_num", 2, "port 1 only"),
        ("init", "pkey_index", 1, "pkey_index"),
        ("init", "qp_access_flags", e.IBV_ACCESS_MW_BIND, "qp_access_flags"),
        ("rtr", "sgid_index", 5, "not a populated GID"),
        ("rtr", "sgid_index", 9, "not a populated GID"),
        ("rtr", "is_global", 0, "not global"),
        ("rtr", "ah_port", 2, "port 1 only"),
        ("rtr", "dest_qp_num", 1 << 24, "24-bit"),
        ("rtr", "min_rnr_timer", 32, "5-bit"),
        ("rtr", "max_dest_rd_atomic", 17, "max_dest_rd_atomic"),
        ("rts", "timeout", 32, "timeout"),
        ("rts", "retry_cnt", 8, "retry_cnt"),
        ("rts", "rnr_retry", 8, "rnr_retry"),
        ("rts", "sq_psn", 1 << 24, "24-bit"),
    ],
)
def test_attribute_values_are_validated(contexts, stage, field, value, match):
    end = make_end(contexts("dbl0"))
    qp = end.qp
    attrs = {"init": init_attr(), "rtr": rtr_attr(end.gid, qp.qp_num), "rts": rts_attr()}
    if field in ("sgid_index", "is_global", "ah_port"):
        gr = api.GlobalRoute(dgid=api.GID(end.gid), sgid_index=value if field == "sgid_index" else 1)
        ah = api.AHAttr(
            is_global=value if field == "is_global" else 1, port_num=value if field == "ah_port" else 1, gr=gr
        )
        attrs["rtr"].ah_attr = ah
    else:
        setattr(attrs[stage], field, value)
    for name, mask in (("init", INIT_MASK), ("rtr", RTR_MASK), ("rts", RTS_MASK)):
        if name == stage:
            with pytest.raises(PyverbsRDMAError, match=match) as info:
                qp.modify(attrs[name], mask)
            assert errno_of(info) == errno.EINVAL
            return
        qp.modify(attrs[name], mask)


def test_path_mtu_cannot_exceed_the_active_mtu(contexts):
    double = VerbsDouble(Knobs(devices=[DeviceSpec("small-mtu", 0, e.IBV_MTU_1024)]))
    end = make_end(contexts("small-mtu", double))
    assert end.ctx.query_port(1).active_mtu == e.IBV_MTU_1024
    end.qp.modify(init_attr(), INIT_MASK)
    with pytest.raises(PyverbsRDMAError, match="active_mtu") as info:
        end.qp.modify(rtr_attr(end.gid, end.qp.qp_num), RTR_MASK)  # asks for IBV_MTU_4096
    assert errno_of(info) == errno.EINVAL


# -- rule 2: posting ---------------------------------------------------------------------------------------


def test_posting_needs_rts(contexts):
    a = make_end(contexts("dbl0"))
    b = make_end(contexts("dbl1"))
    for attr, mask in ((None, 0), (init_attr(), INIT_MASK), (rtr_attr(b.gid, b.qp.qp_num), RTR_MASK)):
        if attr is not None:
            a.qp.modify(attr, mask)
        with pytest.raises(PyverbsRDMAError, match="posting needs RTS") as info:
            write(a, b, 1, 0, 8)
        assert errno_of(info) == errno.EINVAL
    a.qp.modify(rts_attr(), RTS_MASK)
    assert a.qp.req.posted == 0  # nothing of the refused batches was queued


@pytest.mark.parametrize(
    "misuse", ["no_data_setter", "two_data_setters", "setter_before_builder", "inline", "too_many_sges", "too_long"]
)
def test_a_malformed_batch_posts_nothing(pair, misuse):
    a, b = pair
    qp = a.qp
    sge = api.SGE(a.addr, 8, a.mr.lkey)
    qp.wr_start()
    if misuse == "setter_before_builder":
        qp.wr_set_sge(sge)
    qp.wr_id, qp.wr_flags = 1, SIGNALED
    qp.wr_rdma_write(b.mr.rkey, b.addr)
    qp.wr_set_sge(sge)  # a good WR: it must not be posted either
    qp.wr_id = 2
    if misuse == "inline":
        qp.wr_flags = SIGNALED | e.IBV_SEND_INLINE
    qp.wr_rdma_write(b.mr.rkey, b.addr + 8)
    if misuse == "two_data_setters":
        qp.wr_set_sge(sge)
        qp.wr_set_sge(sge)
    elif misuse == "too_many_sges":
        qp.wr_set_sge_list(5, [sge] * 5)  # cap.max_send_sge is 4
    elif misuse == "too_long":
        qp.wr_set_sge(api.SGE(a.addr, (1 << 31) + 1, a.mr.lkey))  # > max_msg_sz
    elif misuse != "no_data_setter":
        qp.wr_set_sge(sge)
    with pytest.raises(PyverbsRDMAError) as info:
        qp.wr_complete()
    assert errno_of(info) == errno.EINVAL
    time.sleep(0.05)
    assert a.cq.poll(4) == (0, [])
    assert b.bytes(0, 16) == bytes(16)
    write(a, b, 3, 0, 8)  # the QP still works
    assert statuses(poll_until(a.cq, 1)) == [(3, e.IBV_WC_SUCCESS)]


def test_wr_set_sge_takes_one_sge_object_like_pyverbs_44(pair):
    a, b = pair
    a.qp.wr_start()
    a.qp.wr_rdma_write(b.mr.rkey, b.addr)
    with pytest.raises(TypeError):
        a.qp.wr_set_sge(a.mr.lkey, a.addr, 8)
    a.qp.wr_abort()
    with pytest.raises(PyverbsRDMAError):  # outside wr_start()/wr_complete()
        a.qp.wr_rdma_write(b.mr.rkey, b.addr)


def test_threads_posting_to_one_qp_take_turns(pair):
    a, b = pair
    errors: list[BaseException] = []

    def poster(first: int) -> None:
        try:
            for i in range(first, first + 100):  # wr_start..wr_complete is a per-QP critical region
                write(a, b, i, i * 8, 8, dst_offset=i * 8, flags=SIGNALED if i % 10 == 9 else 0)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=poster, args=(first,)) for first in (0, 100)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors
    assert sorted(wc.wr_id for wc in poll_until(a.cq, 20)) == [i for i in range(200) if i % 10 == 9]
    assert b.bytes(0, 1600) == a.bytes(0, 1600)


def test_zero_length_writes_are_legal(pair):
    a, b = pair
    b.post_recv(1)
    post(a.qp, [(1, SIGNALED, 0, 0, 0, 0, 0, 5)])  # no rkey, no address, no lkey: nothing is checked (C9-88)
    assert statuses(poll_until(a.cq, 1)) == [(1, e.IBV_WC_SUCCESS)]
    [recv] = poll_until(b.cq, 1)
    assert (recv.byte_len, socket.ntohl(recv.imm_data)) == (0, 5)


def test_unsignaled_wrs_hold_their_slots_until_a_signaled_completion_is_polled(contexts):
    a = make_end(contexts("dbl0"), max_send_wr=4)
    b = make_end(contexts("dbl1"))
    connect(a, b)
    for i in range(4):
        write(a, b, i, 0, 8, dst_offset=8 * i, flags=0)
    deadline = time.monotonic() + 5
    while b.bytes(24, 8) != a.bytes(0, 8) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert b.bytes(24, 8) == a.bytes(0, 8)  # all four executed and acknowledged...
    with pytest.raises(PyverbsRDMAError) as info:
        write(a, b, 4, 0, 8, flags=SIGNALED)  # ...but their slots are not free: nothing signaled was polled
    assert errno_of(info) == errno.ENOMEM
    a.qp.modify(api.QPAttr(qp_state=e.IBV_QPS_RESET), e.IBV_QP_STATE)

    c = make_end(contexts("dbl0"), max_send_wr=4)
    d = make_end(contexts("dbl1"))
    connect(c, d)
    for i in range(3):
        write(c, d, i, 0, 8, flags=0)
    with pytest.raises(PyverbsRDMAError) as info:  # one slot left, a batch of two: refused whole
        post(c.qp, [(10 + i, SIGNALED, d.mr.rkey, d.addr + 512, c.mr.lkey, c.addr, 8, None) for i in range(2)])
    assert errno_of(info) == errno.ENOMEM
    write(c, d, 3, 0, 8, flags=SIGNALED)
    assert statuses(poll_until(c.cq, 1)) == [(3, e.IBV_WC_SUCCESS)]
    for i in range(4):  # polling the signaled completion freed all four slots
        write(c, d, 20 + i, 0, 8, flags=SIGNALED if i == 3 else 0)
    assert statuses(poll_until(c.cq, 1)) == [(23, e.IBV_WC_SUCCESS)]
    assert d.bytes(512, 8) == bytes(8)


def test_create_qp_checks_the_device_limits(contexts):
    ctx = contexts("dbl0")
    pd, cq = api.alloc_pd(ctx), api.create_cq(ctx, 16)
    for cap in (
        api.QPCap(max_send_wr=4097),
        api.QPCap(max_send_sge=5),
        api.QPCap(max_inline_data=65),
        api.QPCap(max_recv_wr=4097),
    ):
        with pytest.raises(PyverbsRDMAError) as info:
            api.create_qp(ctx, pd, cq, cq, None, cap)
        assert errno_of(info) == errno.EINVAL
    srq = api.create_srq(pd, 16, 1)
    api.create_qp(ctx, pd, cq, cq, srq, api.QPCap(max_recv_wr=1 << 20)).close()  # recv caps ignored with an SRQ


# -- rule 3: MR access ----------------------------------------------------------------------------------------


def test_remote_write_or_atomic_needs_local_write(contexts):
    pd = api.alloc_pd(contexts("dbl0"))
    buf = ctypes.create_string_buffer(4096)
    for access in (RW, e.IBV_ACCESS_REMOTE_ATOMIC):
        with pytest.raises(PyverbsRDMAError, match="LOCAL_WRITE") as info:
            api.reg_mr(pd, ctypes.addressof(buf), 4096, access)
        assert errno_of(info) == errno.EINVAL
    api.reg_mr(pd, ctypes.addressof(buf), 4096, LW | RW).close()


def test_registration_pins_real_memory(contexts):
    pd = api.alloc_pd(contexts("dbl0"))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    readonly = libc.mmap(None, 8192, mmap.PROT_READ, flags, -1, 0)
    try:
        api.reg_mr(pd, readonly, 8192, 0).close()  # a source may be read-only
        with pytest.raises(PyverbsRDMAError, match="read-only") as info:
            api.reg_mr(pd, readonly, 8192, LW)  # pinning for write needs a writable mapping
        assert errno_of(info) == errno.EFAULT
    finally:
        libc.munmap(readonly, 8192)
    with pytest.raises(PyverbsRDMAError, match="not mapped") as info:
        api.reg_mr(pd, readonly, 8192, 0)  # unmapped now
    assert errno_of(info) == errno.EFAULT


@pytest.mark.parametrize("where", ["qp_access_flags", "mr_access"])
def test_remote_write_needs_both_the_qp_and_the_mr_to_allow_it(contexts, where):
    a = make_end(contexts("dbl0"), fill=b"x" * 64)
    b = make_end(contexts("dbl1"), mr_access=LW if where == "mr_access" else LW | RW)
    connect(a, b, access_b=0 if where == "qp_access_flags" else RW)  # QPAttr.qp_access_flags defaults to 0
    write(a, b, 1, 0, 64, flags=0)  # unsignaled: the error is reported anyway
    assert statuses(poll_until(a.cq, 1)) == [(1, e.IBV_WC_REM_ACCESS_ERR)]
    assert b.bytes(0, 64) == bytes(64)
    assert true_state(a.qp) == true_state(b.qp) == e.IBV_QPS_ERR
    assert (e.IBV_EVENT_QP_ACCESS_ERR, b.qp) in b.ctx.async_events()


def test_a_dmabuf_mr_is_addressed_by_iova_from_zero_never_by_an_address_here(contexts):
    # ibv_reg_dmabuf_mr(3) with pyverbs' DmaBufMR (IOVA = offset = 0): a writer that addresses the
    # registering process's mapping, as a plain MR's, gets IBV_WC_REM_ACCESS_ERR.
    a = make_end(contexts("dbl0"), fill=bytes(range(64)))
    b = make_end(contexts("dbl1"))
    fd = os.memfd_create("double-dmabuf")  # the stand-in for a GPU allocation's dma-buf
    os.ftruncate(fd, 1 << 16)
    try:
        device = api.reg_dmabuf_mr(b.pd, fd, 1 << 16, LW | RW)
        connect(a, b)
        post(a.qp, [(1, SIGNALED, device.rkey, 100, a.mr.lkey, a.addr, 64, 7)])  # IOVA 100
        b.post_recv()
        assert statuses(poll_until(a.cq, 1)) == [(1, e.IBV_WC_SUCCESS)]
        assert socket.ntohl(poll_until(b.cq, 1)[0].imm_data) == 7
        assert os.pread(fd, 64, 100) == bytes(range(64))  # where the device would see them
        post(a.qp, [(2, SIGNALED, device.rkey, device.buf + 100, a.mr.lkey, a.addr, 64, None)])  # a VA: wrong
        assert statuses(poll_until(a.cq, 1)) == [(2, e.IBV_WC_REM_ACCESS_ERR)]
        device.close()
    finally:
        os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        with pytest.raises(PyverbsRDMAError, match="cannot be mapped") as info:
            api.reg_dmabuf_mr(b.pd, null, 4096, LW | RW)  # not a dma-buf
        assert errno_of(info) == errno.EINVAL
    finally:
        os.close(null)


# -- rule 4: keys, ranges, flushing -------------------------------------------------------------------------


def test_a_write_beyond_the_mr_fails_both_qps_and_flushes_the_rest(pair):
    a, b = pair
    size = b.mr.length
    post(
        a.qp,
        [
            (1, SIGNALED, b.mr.rkey, b.addr, a.mr.lkey, a.addr, 16, None),
            (2, 0, b.mr.rkey, b.addr + size - 8, a.mr.lkey, a.addr, 16, None),  # 8 bytes past the end
            (3, 0, b.mr.rkey, b.addr + 64, a.mr.lkey, a.addr, 16, None),
            (4, SIGNALED, b.mr.rkey, b.addr + 128, a.mr.lkey, a.addr, 16, None),
        ],
    )
    wcs = poll_until(a.cq, 4)
    assert a.qp.qp_state == e.IBV_QPS_RTS  # libibverbs' cached state: only modify/query update it
    assert statuses(wcs) == [
        (1, e.IBV_WC_SUCCESS),
        (2, e.IBV_WC_REM_ACCESS_ERR),  # unsignaled, reported: errors always complete
        (3, e.IBV_WC_WR_FLUSH_ERR),
        (4, e.IBV_WC_WR_FLUSH_ERR),
    ]
    assert b.bytes(0, 16) == a.bytes(0, 16)  # the WR before the bad one landed
    assert b.bytes(size - 8, 8) == bytes(8) and b.bytes(64, 80) == bytes(80)  # nothing after it
    assert true_state(a.qp) == true_state(b.qp) == e.IBV_QPS_ERR
    write(a, b, 5, 0, 16, flags=0)  # later WRs flush, signaled or not
    assert statuses(poll_until(a.cq, 1)) == [(5, e.IBV_WC_WR_FLUSH_ERR)]
    assert b.bytes(0, 16) == a.bytes(0, 16) and b.bytes(16, 16) == bytes(16)


@pytest.mark.parametrize("misuse", ["foreign_lkey", "beyond_source", "rkey_as_lkey", "lkey_as_rkey", "unknown_rkey"])
def test_keys_and_ranges_are_checked(contexts, misuse):
    a = make_end(contexts("dbl0"), fill=b"y" * 4096)
    b = make_end(contexts("dbl1"))
    connect(a, b)
    other_pd = api.alloc_pd(a.ctx)
    other = ctypes.create_string_buffer(4096)
    foreign = api.reg_mr(other_pd, ctypes.addressof(other), 4096, 0)
    lkey, laddr, rkey = a.mr.lkey, a.addr, b.mr.rkey
    expected = e.IBV_WC_LOC_PROT_ERR
    if misuse == "foreign_lkey":
        lkey, laddr = foreign.lkey, ctypes.addressof(other)  # an MR of another PD
    elif misuse == "beyond_source":
        laddr = a.addr + a.mr.length - 4
    elif misuse == "rkey_as_lkey":
        lkey = a.mr.rkey
    elif misuse == "lkey_as_rkey":
        rkey, expected = b.mr.lkey, e.IBV_WC_REM_ACCESS_ERR
    else:
        rkey, expected = b.mr.rkey ^ 0x100, e.IBV_WC_REM_ACCESS_ERR
    post(
        a.qp,
        [
            (1, 0, rkey, b.addr, lkey, laddr, 16, None),
            (2, SIGNALED, b.mr.rkey, b.addr + 32, a.mr.lkey, a.addr, 8, None),
        ],
    )
    assert statuses(poll_until(a.cq, 2)) == [(1, expected), (2, e.IBV_WC_WR_FLUSH_ERR)]
    assert b.bytes(0, 64) == bytes(64)
    assert true_state(a.qp) == e.IBV_QPS_ERR
    foreign.close()
    other_pd.close()


def test_deregistered_keys_stop_working_at_once(contexts):
    a = make_end(contexts("dbl0"), fill=b"z" * 64)
    b = make_end(contexts("dbl1"))
    connect(a, b)
    write(a, b, 1, 0, 8)
    assert statuses(poll_until(a.cq, 1)) == [(1, e.IBV_WC_SUCCESS)]
    b.mr.close()
    b.mr.close()  # idempotent
    write(a, b, 2, 0, 8, dst_offset=8)
    assert statuses(poll_until(a.cq, 1)) == [(2, e.IBV_WC_REM_ACCESS_ERR)]
    assert b.bytes(8, 8) == bytes(8)

    c = make_end(contexts("dbl0"), fill=b"z" * 64)
    d = make_end(contexts("dbl1"))
    connect(c, d)
    c.mr.close()
    write(c, d, 3, 0, 8)
    assert statuses(poll_until(c.cq, 1)) == [(3, e.IBV_WC_LOC_PROT_ERR)]
    assert d.bytes(0, 8) == bytes(8)


def test_a_failed_responder_flushes_its_own_receive_queue_but_not_an_srq(contexts):
    a = make_end(contexts("dbl0"))
    own = make_end(contexts("dbl1"), with_srq=False)
    connect(a, own)
    for i in range(2):
        wr = api.RecvWR(wr_id=500 + i, num_sge=1, sg=[api.SGE(0, 0, 0)])
        wr.num_sge = 0
        own.qp.post_recv(wr)
    own.qp.modify(api.QPAttr(qp_state=e.IBV_QPS_ERR), e.IBV_QP_STATE)
    assert statuses(poll_until(own.cq, 2)) == [(500, e.IBV_WC_WR_FLUSH_ERR), (501, e.IBV_WC_WR_FLUSH_ERR)]

    c = make_end(contexts("dbl0"))
    shared = make_end(contexts("dbl1"))
    connect(c, shared)
    shared.post_recv(2, first_id=600)
    shared.qp.modify(api.QPAttr(qp_state=e.IBV_QPS_ERR), e.IBV_QP_STATE)
    time.sleep(0.05)
    assert shared.cq.poll(4) == (0, [])  # the SRQ's WRs stay for other QPs
    assert (e.IBV_EVENT_QP_LAST_WQE_REACHED, shared.qp) in shared.ctx.async_events()
    other = api.create_qp(
        shared.ctx, shared.pd, shared.cq, shared.cq, shared.srq, api.QPCap(max_send_wr=1, max_recv_wr=1)
    )
    d = make_end(contexts("dbl0"))
    d.qp.modify(init_attr(), INIT_MASK)
    d.qp.modify(rtr_attr(shared.gid, other.qp_num), RTR_MASK)
    d.qp.modify(rts_attr(), RTS_MASK)
    other.modify(init_attr(), INIT_MASK)
    other.modify(rtr_attr(d.gid, d.qp.qp_num), RTR_MASK)
    write(d, shared, 1, 0, 0, imm=9)
    [recv] = poll_until(shared.cq, 1)
    assert (recv.wr_id, recv.status, recv.qp_num) == (600, e.IBV_WC_SUCCESS, other.qp_num)


def test_a_chain_of_receive_wrs_is_posted_whole(pair):
    a, b = pair
    wrs = [api.RecvWR(wr_id=700 + i, num_sge=1, sg=[api.SGE(0, 0, 0)]) for i in range(3)]
    for first, second in itertools.pairwise(wrs):
        first.next_wr = second
    for wr in wrs:
        wr.num_sge = 0
    b.srq.post_recv(wrs[0])
    for i in range(3):
        write(a, b, i, 0, 0, imm=i)
    assert [wc.wr_id for wc in poll_until(b.cq, 3)] == [700, 701, 702]
    too_many = api.RecvWR(wr_id=1, num_sge=1, sg=[api.SGE(0, 0, 0)])
    too_many.num_sge = 2  # the SRQ takes one SGE per WR
    with pytest.raises(PyverbsRDMAError) as info:
        b.srq.post_recv(too_many)
    assert errno_of(info) == errno.EINVAL


# -- rule 5: RNR -------------------------------------------------------------------------------------------------


def test_rnr_is_retried_until_a_receive_wr_is_posted(pair):
    a, b = pair
    write(a, b, 1, 0, 32)  # a plain write consumes no receive WR
    assert statuses(poll_until(a.cq, 1)) == [(1, e.IBV_WC_SUCCESS)]
    write(a, b, 2, 0, 32, dst_offset=64, imm=0xABC)
    time.sleep(0.1)  # RNR NAKs, retried forever (rnr_retry 7)
    assert a.cq.poll(1) == (0, []) and b.cq.poll(1) == (0, [])
    assert b.bytes(64, 32) == bytes(32)  # an RNR-NAKed write places nothing
    b.post_recv(1, first_id=9)
    assert statuses(poll_until(a.cq, 1)) == [(2, e.IBV_WC_SUCCESS)]
    [recv] = poll_until(b.cq, 1)
    assert (recv.wr_id, socket.ntohl(recv.imm_data)) == (9, 0xABC)
    assert b.bytes(64, 32) == a.bytes(0, 32)


def test_rnr_retries_are_counted(contexts):
    a = make_end(contexts("dbl0"))
    b = make_end(contexts("dbl1"))
    b.qp.modify(init_attr(), INIT_MASK)
    a.qp.modify(init_attr(), INIT_MASK)
    a.qp.modify(rtr_attr(b.gid, b.qp.qp_num), RTR_MASK)
    b.qp.modify(rtr_attr(a.gid, a.qp.qp_num, min_rnr_timer=22), RTR_MASK)  # 20.48 ms
    a.qp.modify(rts_attr(rnr_retry=2), RTS_MASK)
    b.qp.modify(rts_attr(), RTS_MASK)
    start = time.monotonic()
    write(a, b, 1, 0, 8, imm=1, flags=0)
    write(a, b, 2, 0, 8, imm=2, flags=0)
    assert statuses(poll_until(a.cq, 2)) == [(1, e.IBV_WC_RNR_RETRY_EXC_ERR), (2, e.IBV_WC_WR_FLUSH_ERR)]
    assert time.monotonic() - start >= 2 * 0.020  # two waits of the responder's RNR timer
    assert true_state(a.qp) == e.IBV_QPS_ERR
    # the responder only sent RNR NAKs; it cannot know the requester gave up
    assert true_state(b.qp) == e.IBV_QPS_RTS


# -- rule 6: CQ overrun, creation limits -------------------------------------------------------------------------


def test_a_cq_overrun_breaks_the_cq_and_its_qps(contexts):
    a = make_end(contexts("dbl0"))
    b = make_end(contexts("dbl1"), cqe=2)
    connect(a, b, rts_a={"retry_cnt": 1})
    b.post_recv(3)
    for i in range(3):
        write(a, b, i, 0, 0, imm=i, flags=0)  # three completions for a CQ of two, nobody polling
    deadline = time.monotonic() + 5
    while (e.IBV_EVENT_CQ_ERR, b.cq) not in b.ctx.async_events() and time.monotonic() < deadline:
        time.sleep(0.01)
    events = b.ctx.async_events()
    assert (e.IBV_EVENT_CQ_ERR, b.cq) in events
    assert (e.IBV_EVENT_QP_FATAL, b.qp) in events
    assert true_state(b.qp) == e.IBV_QPS_ERR
    with pytest.raises(PyverbsRDMAError, match="overrun"):
        b.cq.poll(1)
    event = b.ctx.get_async_event(timeout=1)
    assert (event.event_type, event.element) == (e.IBV_EVENT_CQ_ERR, b.cq)
    # the overflowing write was never acknowledged: the requester gives up after its retries
    assert statuses(poll_until(a.cq, 1)) == [(2, e.IBV_WC_RETRY_EXC_ERR)]


def test_an_unpolled_send_cq_overruns_too(contexts):
    a = make_end(contexts("dbl0"), cqe=2)
    b = make_end(contexts("dbl1"))
    connect(a, b)
    for i in range(3):
        write(a, b, i, 0, 8)
    deadline = time.monotonic() + 5
    while true_state(a.qp) != e.IBV_QPS_ERR and time.monotonic() < deadline:
        time.sleep(0.01)
    assert true_state(a.qp) == e.IBV_QPS_ERR
    assert (e.IBV_EVENT_CQ_ERR, a.cq) in a.ctx.async_events()


def test_creation_limits(contexts):
    ctx = contexts("dbl0")
    pd = api.alloc_pd(ctx)
    for cqe in (0, 65537):
        with pytest.raises(PyverbsRDMAError) as info:
            api.create_cq(ctx, cqe)
        assert errno_of(info) == errno.EINVAL
    api.create_cq(ctx, 65536).close()
    with pytest.raises(PyverbsRDMAError) as info:
        api.create_srq(pd, 16385, 1)
    assert errno_of(info) == errno.EINVAL
    with pytest.raises(PyverbsRDMAError) as info:
        api.create_srq(pd, 16, 5)
    assert errno_of(info) == errno.EINVAL
    srq = api.create_srq(pd, 2, 1)
    wr = api.RecvWR(wr_id=1, num_sge=1, sg=[api.SGE(0, 0, 0)])
    srq.post_recv(wr)
    srq.post_recv(wr)
    with pytest.raises(PyverbsRDMAError) as info:
        srq.post_recv(wr)  # max_wr WRs are posted already
    assert errno_of(info) == errno.ENOMEM


# -- rule 7: ordering -----------------------------------------------------------------------------------------------


def test_one_qp_is_ordered(pair):
    a, b = pair
    big = 1 << 20
    ops = [(i, 0, b.mr.rkey, b.addr, a.mr.lkey, a.addr + i, 4096, None) for i in range(50)]  # same target, in order
    ops.append((99, SIGNALED, b.mr.rkey, b.addr, a.mr.lkey, a.addr, big, None))
    ops.append((100, SIGNALED, b.mr.rkey, b.addr, a.mr.lkey, a.addr + 7, 100, 1))
    b.post_recv(1)
    post(a.qp, ops)
    [recv] = poll_until(b.cq, 1)
    assert recv.status == e.IBV_WC_SUCCESS
    # when the immediate completes, every earlier write of the QP landed, in post order
    assert b.bytes(0, 100) == a.bytes(7, 100)
    assert b.bytes(100, big - 100) == a.bytes(100, big - 100)
    assert statuses(poll_until(a.cq, 2)) == [(99, e.IBV_WC_SUCCESS), (100, e.IBV_WC_SUCCESS)]


def test_nothing_orders_two_qps(contexts, monkeypatch):
    # each QP's burst waits an independent random moment at the responder's NIC; make it long enough
    # that which QP goes first is visible to this test (by default it is at most 2 ms)
    monkeypatch.setattr(api.knobs, "reorder_jitter_s", 0.02)
    ctx_a, ctx_b = contexts("dbl0"), contexts("dbl1")
    a1, a2 = make_end(ctx_a, fill=b"\x01" * 4096), make_end(ctx_a)
    b1, b2 = make_end(ctx_b), make_end(ctx_b)
    connect(a1, b1)
    connect(a2, b2)
    overtaken = in_order = 0
    for attempt in range(30):
        time.sleep(0.003)  # quiet connections: each QP's next request starts a new burst
        b2.post_recv(1)
        write(a1, b1, attempt, 0, 4096)  # data on one QP...
        write(a2, b2, attempt, 0, 0, imm=attempt)  # ...then an immediate on another, to the same receiver
        [recv] = poll_until(b2.cq, 1)
        assert recv.status == e.IBV_WC_SUCCESS
        if b1.bytes(0, 4096) == a1.bytes(0, 4096):
            in_order += 1
        else:  # the later QP's immediate arrived before the earlier QP's bytes
            overtaken += 1
        assert statuses(poll_until(a1.cq, 1) + poll_until(a2.cq, 1)) == [(attempt, e.IBV_WC_SUCCESS)] * 2
        ctypes.memset(b1.addr, 0, 4096)
    assert overtaken >= 3 and in_order >= 3, (overtaken, in_order)  # either order happens (p ~ 1/2 each)


# -- rule 9: dead and unreachable peers -------------------------------------------------------------------------


def test_an_unreachable_peer_fails_after_the_retries(contexts):
    a = make_end(contexts("dbl0"))
    b = make_end(contexts("dbl1"))
    a.qp.modify(init_attr(), INIT_MASK)
    a.qp.modify(rtr_attr("fd6b:0000:0000:0000:0000:0000:0000:0001", 0x1234), RTR_MASK)  # nobody owns this GID
    a.qp.modify(rts_attr(retry_cnt=3), RTS_MASK)
    start = time.monotonic()
    write(a, b, 1, 0, 8, flags=0)
    write(a, b, 2, 0, 8)
    wcs = poll_until(a.cq, 2)
    elapsed = time.monotonic() - start
    assert statuses(wcs) == [(1, e.IBV_WC_RETRY_EXC_ERR), (2, e.IBV_WC_WR_FLUSH_ERR)]
    cap = api.knobs.timer_cap_s
    assert 4 * cap * 0.9 <= elapsed < 4 * cap + 2  # (retry_cnt + 1) transport timeouts
    assert true_state(a.qp) == e.IBV_QPS_ERR


@pytest.mark.parametrize("cause", ["context_closed", "qp_destroyed", "rocev1_source", "psn_ahead"])
def test_lost_requests_end_in_retry_exceeded(contexts, cause):
    a = make_end(contexts("dbl0"))
    ctx_b = api.open("dbl1")
    try:
        b = make_end(ctx_b)
        if cause == "rocev1_source":  # a RoCEv1 source GID: the routed fabric never delivers it
            connect(a, b, rts_a={"retry_cnt": 1}, sgid_index=0)
        elif cause == "psn_ahead":  # the requester starts ahead of what the responder expects
            connect(a, b, rts_a={"retry_cnt": 1, "sq_psn": 100})
        else:
            connect(a, b, rts_a={"retry_cnt": 1})
            write(a, b, 0, 0, 8)
            assert statuses(poll_until(a.cq, 1)) == [(0, e.IBV_WC_SUCCESS)]
            if cause == "qp_destroyed":
                b.qp.close()
            else:
                ctx_b.close()
        write(a, b, 1, 0, 8)
        assert statuses(poll_until(a.cq, 1)) == [(1, e.IBV_WC_RETRY_EXC_ERR)]
    finally:
        ctx_b.close()


def test_a_psn_behind_is_acknowledged_but_not_executed(contexts):
    a = make_end(contexts("dbl0"), fill=b"q" * 64)
    b = make_end(contexts("dbl1"))
    connect(a, b)  # a sends from PSN 0...
    b.qp.modify(api.QPAttr(qp_state=e.IBV_QPS_RESET), e.IBV_QP_STATE)
    b.qp.modify(init_attr(), INIT_MASK)
    b.qp.modify(rtr_attr(a.gid, a.qp.qp_num, rq_psn=1000), RTR_MASK)  # ...b now expects 1000: PSN 0 is "old"
    write(a, b, 1, 0, 8)
    assert statuses(poll_until(a.cq, 1)) == [(1, e.IBV_WC_SUCCESS)]  # a duplicate is acknowledged again...
    assert b.bytes(0, 8) == bytes(8)  # ...and not executed: mismatched PSNs lose data silently


def test_timeout_zero_never_gives_up(contexts):
    a = make_end(contexts("dbl0"))
    b = make_end(contexts("dbl1"))
    a.qp.modify(init_attr(), INIT_MASK)
    a.qp.modify(rtr_attr("fd6b:0000:0000:0000:0000:0000:0000:0002", 0x1234), RTR_MASK)
    a.qp.modify(rts_attr(timeout=0, retry_cnt=0), RTS_MASK)  # 0 = infinite (ibv_modify_qp(3))
    write(a, b, 1, 0, 8)
    time.sleep(4 * api.knobs.timer_cap_s)
    assert a.cq.poll(1) == (0, [])
    a.qp.modify(api.QPAttr(qp_state=e.IBV_QPS_ERR), e.IBV_QP_STATE)
    assert statuses(poll_until(a.cq, 1)) == [(1, e.IBV_WC_WR_FLUSH_ERR)]


def _responder_process(conn) -> None:
    """The responder end in another process: registers memory and an SRQ, reports what landed."""
    from tests.verbs_double import api as double

    ctx = double.open("dbl1")
    end = make_end(ctx)
    end.post_recv(4, first_id=1)
    conn.send((end.gid, end.qp.qp_num, end.mr.rkey, end.addr, os.getpid()))
    peer_gid, peer_qpn = conn.recv()
    end.qp.modify(init_attr(), INIT_MASK)
    end.qp.modify(rtr_attr(peer_gid, peer_qpn), RTR_MASK)
    end.qp.modify(rts_attr(), RTS_MASK)
    conn.send("ready")
    [recv] = poll_until(end.cq, 1, timeout=20)
    conn.send((recv.status, recv.wr_id, socket.ntohl(recv.imm_data), recv.byte_len, end.bytes(0, 4096)))
    conn.recv()  # wait to be killed or told to go
    ctx.close()


def test_two_processes(contexts):
    here, there = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_responder_process, args=(there,), daemon=True)
    proc.start()
    try:
        assert here.poll(30), "the responder process did not start"
        gid, qpn, rkey, raddr, pid = here.recv()
        a = make_end(contexts("dbl0"), fill=os.urandom(4096))
        assert pid != os.getpid() and gid != contexts("dbl1").query_gid(1, ROCE_V2_INDEX).gid  # its own GIDs
        a.qp.modify(init_attr(), INIT_MASK)
        a.qp.modify(rtr_attr(gid, qpn), RTR_MASK)
        a.qp.modify(rts_attr(retry_cnt=2), RTS_MASK)
        here.send((a.gid, a.qp.qp_num))
        assert here.recv() == "ready"
        post(
            a.qp,
            [
                (1, 0, rkey, raddr, a.mr.lkey, a.addr, 1000, None),
                (2, SIGNALED, rkey, raddr + 1000, a.mr.lkey, a.addr + 1000, 3096, 0xC0FFEE),
            ],
        )
        assert here.poll(20)
        status, wr_id, imm, byte_len, landed = here.recv()
        assert (status, wr_id, imm, byte_len) == (e.IBV_WC_SUCCESS, 1, 0xC0FFEE, 3096)
        assert landed == a.bytes(0, 4096)
        assert statuses(poll_until(a.cq, 1)) == [(2, e.IBV_WC_SUCCESS)]
        proc.kill()  # the responder dies: the requester's next write can only time out
        proc.join(10)
        post(a.qp, [(3, SIGNALED, rkey, raddr, a.mr.lkey, a.addr, 8, None)])
        assert statuses(poll_until(a.cq, 1)) == [(3, e.IBV_WC_RETRY_EXC_ERR)]
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(10)
        proc.close()
        here.close()
        there.close()


# -- rule 10: closing -------------------------------------------------------------------------------------------------


def test_closing_in_use_objects_is_refused_and_close_is_idempotent(contexts):
    end = make_end(contexts("dbl0"))
    for obj in (end.pd, end.cq, end.srq):
        with pytest.raises(PyverbsRDMAError) as info:
            obj.close()
        assert errno_of(info) == errno.EBUSY
    end.qp.close()
    end.qp.close()
    end.cq.close()
    end.cq.close()
    end.srq.close()
    end.srq.close()
    with pytest.raises(PyverbsRDMAError) as info:
        end.pd.close()  # the MR still uses it
    assert errno_of(info) == errno.EBUSY
    end.mr.close()
    end.pd.close()
    end.pd.close()
    end.ctx.close()
    end.ctx.close()
    assert live_threads() == []


def test_closing_a_context_closes_everything_and_stops_its_thread(contexts):
    ctx = api.open("dbl0")
    end = make_end(ctx)
    assert [t.name for t in live_threads()] == ["verbs-double-dbl0"]
    assert all(t.daemon for t in live_threads())
    ctx.close()  # like pyverbs' Context.close(): QPs, SRQs, CQs, MRs and PDs first
    assert live_threads() == []
    assert end.qp.closed and end.srq.closed and end.cq.closed and not end.mr.live and end.pd.closed
    with pytest.raises(PyverbsRDMAError):
        end.cq.poll(1)
