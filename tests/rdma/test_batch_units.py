"""Unit tests of batch planning: whole-batch range checks and grouping of adjacent destinations."""

from __future__ import annotations

import numpy as np
import pytest

from kspeed.errors import RangeError, TransportError
from kspeed.rdma.base import RegionKey
from kspeed.rdma.memory import HostBuffer
from kspeed.rdma.write_batch import check_batch, runs, source_array

KEY = RegionKey("shm", "host", 1, 4096, 1000)


def test_plan_accepts_exact_fit_and_broadcasts_lengths():
    batch = check_batch(KEY, 100, [0, 90], 10, [0, 990], None)
    assert batch.lengths.tolist() == [10, 10]
    assert batch.dst.dtype == np.int64
    assert batch.imms.dtype == np.uint32 and len(batch.imms) == 0


def test_plan_names_first_bad_op_and_its_numbers():
    with pytest.raises(RangeError) as err:
        check_batch(KEY, 100, [0, 0, 95, 0], 10, [0, 10, 20, 995], [1])
    assert "op 2:" in str(err.value)
    assert "source offset 95" in str(err.value)


@pytest.mark.parametrize("dtype", [np.int32, np.uint16, np.int64])
def test_plan_takes_any_integer_dtype(dtype):
    batch = check_batch(KEY, 100, np.array([1, 2], dtype), np.array([3, 4], dtype), np.array([5, 6], dtype), 7)
    assert batch.src.tolist() == [1, 2] and batch.imms.tolist() == [7]


def test_plan_refuses_huge_unsigned_and_wide_immediates():
    with pytest.raises(RangeError):
        check_batch(KEY, 100, np.array([1 << 63], np.uint64), 1, [0], None)
    with pytest.raises(TransportError):
        check_batch(KEY, 100, [0], 1, [0], [-1])
    with pytest.raises(TransportError):
        check_batch(KEY, 100, [[0]], 1, [0], None)


def test_runs_group_adjacent_destinations():
    batch = check_batch(KEY, 1000, [0, 50, 7, 9, 0], [10, 20, 5, 5, 0], [0, 10, 100, 105, 30], None)
    first, dst, nbytes = runs(batch)
    assert first.tolist() == [0, 2, 4]
    assert dst.tolist() == [0, 100, 30]
    assert nbytes.tolist() == [30, 10, 0]
    empty = runs(check_batch(KEY, 10, [], [], [], [1]))
    assert [len(a) for a in empty] == [0, 0, 0]


def test_source_array_shares_memory():
    buf = HostBuffer(4096)
    arr = source_array(buf)  # anything with a memoryview ``view``, e.g. a Region's memory
    arr[:4] = 9
    assert bytes(buf.view[:4]) == b"\t" * 4
    floats = np.zeros(4, np.float32)
    assert source_array(floats).nbytes == 16
    del arr
    buf.close()


def test_tcp_batch_headers_match_the_wire_struct():
    from kspeed.rdma.tcp import wire

    batch = check_batch(KEY, 64, [0, 8, 40], [8, 8, 4], [0, 8, 100], [5, 6])
    bufs = wire.batch_buffers(KEY, memoryview(bytes(range(64))), batch)
    sizes = [len(b) for b in bufs]
    assert sizes == [32, 8, 8, 32, 4, 32]  # run 1 (two ops), run 2 with imm 5, imm 6 alone
    assert bytes(bufs[0]) == wire.WRITE_HEADER.pack(wire.DATA, 0, 1, 0, 4096, 16)
    assert bytes(bufs[3]) == wire.WRITE_HEADER.pack(wire.DATA, wire.FLAG_IMM, 1, 5, 4196, 4)
    assert bytes(bufs[5]) == wire.WRITE_HEADER.pack(wire.DATA, wire.FLAG_IMM, 1, 6, 4200, 0)
    assert bytes(bufs[2]) == bytes(range(8, 16))
