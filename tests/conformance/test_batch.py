"""Conformance of ``Writer.write_batch`` (array-described batches) on every rail."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kspeed.errors import RangeError, TransportError
from kspeed.rdma.rails import get_rail
from tests.conformance.rail_workers import pattern, write_pattern_batches
from tests.conformance.test_rails import _poll_until


def test_batch_lands_byte_exact(rail, options):
    rng = np.random.default_rng(3)
    source = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    with get_rail(rail).listen(options) as rx:
        ring = rx.register(1 << 20)
        arr = ring.array()
        arr[:] = 0xEE
        grant = ring.key.slice(8192, 256 << 10)
        # Adjacent runs (coalescible), a gap, a backwards jump, a zero-length op and uneven sizes.
        dst = np.array([0, 100, 350, 5000, 1000, 1000, 70000], np.int64)
        lengths = np.array([100, 250, 7, 3000, 4000, 0, (256 << 10) - 70000], np.int64)
        src = rng.integers(0, (1 << 20) - (256 << 10), len(dst))
        with get_rail(rail).connect(rx.material, options) as wr:
            wr.write_batch(grant, source, src, lengths, dst, np.array([11, 12, 13], np.uint32))
            imms, conns = _poll_until(rx, 3)
            assert imms == [11, 12, 13]
            assert set(conns) == {wr.conn}
        expect = np.full(1 << 20, 0xEE, np.uint8)
        for s, n, d in zip(src, lengths, dst):
            expect[8192 + d : 8192 + d + n] = source[s : s + n]
        assert np.array_equal(arr, expect)
        del arr


def test_batch_accepts_regions_buffers_and_scalar_lengths(rail, options):
    with get_rail(rail).listen(options) as rx:
        ring = rx.register(1 << 16)
        arr = ring.array()
        local = get_rail(rail).register(4096)  # a registered source region
        local.array()[:] = np.arange(4096) % 251
        with get_rail(rail).connect(rx.material, options) as wr:
            wr.write_batch(ring.key, local, [0, 10], 5, [0, 5], [1])
            wr.write_batch(ring.key, b"abcdefgh", [4], [4], [64])  # any buffer, no immediate
            wr.write_batch(ring.key, b"", [], [], [], [2, 3])  # immediates only
            assert _poll_until(rx, 3)[0] == [1, 2, 3]
        assert arr[:10].tolist() == [0, 1, 2, 3, 4, 10, 11, 12, 13, 14]
        assert bytes(arr[64:68]) == b"efgh"
        del arr
        local.close()


def test_batch_larger_than_iov_max(rail, options):
    count, size = 3000, 16  # ops far apart: one remote write each, more than IOV_MAX iovecs
    source = np.arange(count * size, dtype=np.uint32).view(np.uint8)
    with get_rail(rail).listen(options) as rx:
        ring = rx.register(count * 64)
        arr = ring.array()
        with get_rail(rail).connect(rx.material, options) as wr:
            ops = np.arange(count, dtype=np.int64)
            wr.write_batch(ring.key, source, ops * size, size, ops * 64, np.arange(count, dtype=np.uint32))
            imms, _ = _poll_until(rx, count)
        assert imms == list(range(count))
        got = arr.reshape(count, 64)[:, :size].reshape(-1)
        assert np.array_equal(got, source[: count * size])
        del arr


@pytest.mark.parametrize(
    ("src", "lengths", "dst", "bad_op"),
    [
        ([0, 0, 0], [8, 8, 8], [0, 8, 4090], 2),  # past the end of the key
        ([0, 0, 0], [8, 8, 8], [0, -8, 16], 1),  # before the key
        ([0, 4096, 0], [8, 8, 8], [0, 8, 16], 1),  # past the end of the source
        ([0, 0, -1], [8, 8, 8], [0, 8, 16], 2),  # before the source
        ([0, 0, 0], [8, -8, 8], [0, 8, 16], 1),  # negative length
        ([0, 0, 0], [8, 1 << 62, 8], [0, 8, 16], 1),  # a length that would overflow the sums
    ],
)
def test_batch_out_of_range_refused_whole(rail, options, src, lengths, dst, bad_op):
    source = np.ones(4096, np.uint8)
    with get_rail(rail).listen(options) as rx:
        ring = rx.register(1 << 16)
        arr = ring.array()
        arr[:] = 0
        with get_rail(rail).connect(rx.material, options) as wr:
            grant = ring.key.slice(4096, 4096)
            with pytest.raises(RangeError, match=f"op {bad_op}:"):
                wr.write_batch(grant, source, src, lengths, dst, [7])
            wr.write_batch(grant, source, [0], [1], [0], [8])  # the connection is still good
            assert _poll_until(rx, 1)[0] == [8]
            assert len(rx.poll(0.2)) == 0  # the refused batch's immediate never came
        assert int(arr.sum()) == 1  # only the byte of the good batch landed
        del arr


def test_batch_malformed_arrays_refused(rail, options):
    with get_rail(rail).listen(options) as rx:
        ring = rx.register(1 << 16)
        with get_rail(rail).connect(rx.material, options) as wr:
            source = np.ones(64, np.uint8)
            with pytest.raises(TransportError):
                wr.write_batch(ring.key, source, [0, 1], [1, 1], [0], None)  # lengths differ
            with pytest.raises(TransportError):
                wr.write_batch(ring.key, source, [0.5], [1], [0], None)  # not integers
            with pytest.raises(TransportError):
                wr.write_batch(ring.key, source, [0], [1], [0], [1 << 32])  # immediate too wide
        assert len(rx.poll(0.2)) == 0


def test_batch_immediate_once_after_all_its_bytes(rail, options, spawn):
    batches, per_batch, size = 60, 16, 4096
    with get_rail(rail).listen(options) as rx:
        ring = rx.register(batches * per_batch * size)
        arr = ring.array()
        spawn(write_pattern_batches, rail, rx.material, ring.key.to_bytes(), options, batches, per_batch, size)
        seen = []
        deadline = time.monotonic() + 20
        while len(seen) < batches and time.monotonic() < deadline:
            for b in rx.poll(0.2).imm.tolist():
                for slot in range(b * per_batch, (b + 1) * per_batch):
                    assert np.array_equal(arr[slot * size : (slot + 1) * size], pattern(slot, size))
                seen.append(b)
        assert seen == list(range(batches))  # each exactly once, in order
        assert len(rx.poll(0.3)) == 0
        del arr


def test_close_right_after_a_batch_loses_nothing(rail, options):
    source = np.ones(8 << 20, np.uint8)
    with get_rail(rail).listen(options) as rx:
        ring = rx.register(32 << 20)
        wr = get_rail(rail).connect(rx.material, options)
        offsets = np.arange(4, dtype=np.int64) << 23
        wr.write_batch(ring.key, source, [0] * 4, 8 << 20, offsets, np.arange(4, dtype=np.uint32))
        wr.close()  # bytes may still be in flight; the orderly close must not cut them off
        imms, _ = _poll_until(rx, 4)
        assert imms == [0, 1, 2, 3]
        time.sleep(0.3)
        assert len(rx.poll(0.2)) == 0  # and no PeerLostError: the writer said bye
        assert int(ring.array()[(32 << 20) - 1]) == 1
