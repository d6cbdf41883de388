"""Epoch plans: narrow per-sample arrays with the values the int64 ones had, widened where they must be."""

from __future__ import annotations

import mmap
import threading
from concurrent.futures import CancelledError, ThreadPoolExecutor

import numpy as np
import pytest

from kspeed.client.planning import compact, plans
from kspeed.client.planning.plans import PrepSplit, make_plan, remote_positions, server_plan
from kspeed.errors import DatasetError, ProtocolError
from kspeed.layout import batch_layout


class Share:
    """A server owning IDs ``[lo, hi)`` that answers lookups from ``sizes`` and ``labels`` (int64, as
    :meth:`ServerLink.lookup` returns them) and keeps what it is committed."""

    def __init__(
        self, k: int, lo: int, hi: int, sizes: np.ndarray, labels: np.ndarray | None, known: bool = True
    ) -> None:
        self.server_id = self.name = f"s{k}"
        self.address = "127.0.0.1:1"
        self.lo, self.hi = lo, hi
        self.first_id, self.end_id = (lo, hi) if known else (None, None)  # the range the client knows
        self.sizes, self.labels = sizes, labels
        self.base = 0  # the ID of sizes[0] and labels[0]
        self.asked: list[int] = []
        self.committed = None

    def lookup(self, dataset, ids):
        self.asked.append(len(ids))
        positions = np.flatnonzero((ids >= self.lo) & (ids < self.hi))
        owned = ids[positions] - self.base
        labels = self.labels[owned] if self.labels is not None else np.zeros(0, np.int64)
        return positions.astype(np.int64), self.sizes[owned].astype(np.int64), labels.astype(np.int64)

    def commit_plan(self, feed_id, plan):
        self.committed = plan


def own_mapping(array: np.ndarray) -> bool:
    """Whether ``array``'s memory is a mapping of its own (not the C heap)."""
    while isinstance(array.base, np.ndarray):
        array = array.base
    return isinstance(array.base, memoryview) and isinstance(array.base.obj, mmap.mmap)


def shares(n, servers, sizes, labels=None, ranges=True):
    cuts = np.linspace(0, n, servers + 1).astype(np.int64)
    return [Share(k, int(cuts[k]), int(cuts[k + 1]), sizes, labels, known=ranges) for k in range(servers)]


def plan_of(links, ids, batch_size=8, labelled=True, prep=None, ring_bytes=1 << 60, pool=None):
    return make_plan(
        links,
        dataset="d",
        feed_ids=[f"f{k}" for k in range(len(links))],
        epoch=3,
        feed_epoch=1,
        ids=ids,
        batch_size=batch_size,
        labelled=labelled,
        deterministic=True,
        ring_bytes=ring_bytes,
        prep=prep,
        pool=pool,
    )


@pytest.mark.parametrize("ranges", [True, False])
def test_a_plan_holds_narrow_arrays_with_the_values_of_wide_ones(ranges):
    rng = np.random.default_rng(0)
    n = 1000
    sizes = rng.integers(0, 5000, n)
    labels = rng.integers(0, 1000, n)
    links = shares(n, 3, sizes, labels, ranges)
    ids = rng.permutation(np.concatenate([np.arange(n), rng.integers(0, n, 37)]))  # duplicates too
    plan = plan_of(links, ids, batch_size=10)
    reference = batch_layout(sizes[ids], 10)
    assert plan.ids.dtype == np.int32 and plan.ids.tolist() == ids.tolist()
    assert plan.lengths.dtype == np.uint32 and plan.lengths.tolist() == sizes[ids].tolist()
    assert plan.labels.dtype == np.int16 and plan.labels.tolist() == labels[ids].tolist()
    owner = np.searchsorted([link.hi for link in links], ids, side="right")
    assert plan.owner.dtype == np.int8 and plan.owner.tolist() == owner.tolist()
    assert plan.layout.offsets.dtype == np.uint32
    assert plan.layout.offsets.tolist() == reference.offsets.tolist()
    assert plan.layout.starts.tolist() == reference.starts.tolist()
    assert plan.layout.batch_bytes.tolist() == reference.batch_bytes.tolist()
    assert plan.layout.lengths is plan.lengths
    batch_of = np.arange(len(ids)) // 10
    owed = np.zeros((3, plan.num_batches), dtype=bool)
    owed[owner, batch_of] = True
    assert np.array_equal(plan.owed, owed)
    for array in (plan.ids, plan.lengths, plan.labels, plan.owner, plan.layout.offsets, plan.owed):
        assert own_mapping(array)  # not the C heap


def test_values_that_do_not_fit_widen_the_array_never_wrap():
    n = 6
    sizes = np.array([1, 2, 3, 2**32 + 5, 4, 5])  # a length past uint32 (a double of a server, say)
    labels = np.array([0, 70000, 2, 3, 4, 5])  # past int16
    plan = plan_of(shares(n, 2, sizes, labels), np.arange(n), batch_size=2)
    assert plan.lengths.dtype == np.int64 and plan.lengths.tolist() == sizes.tolist()
    assert plan.labels.dtype == np.int32 and plan.labels.tolist() == labels.tolist()
    assert plan.layout.offsets.dtype == np.int64  # batch 1 is over 4 GiB
    assert plan.layout.offsets.tolist() == batch_layout(sizes, 2).offsets.tolist()
    big = plan_of(shares(n, 1, np.ones(n, np.int64), labels - 2**40), np.arange(n))
    assert big.labels.dtype == np.int64 and big.labels.tolist() == (labels - 2**40).tolist()
    far = Share(0, 2**33 - n, 2**33, np.ones(n, np.int64), None)
    far.base = 2**33 - n  # its sizes start at its first ID
    huge = plan_of([far], np.arange(n) + 2**33 - n)
    assert huge.ids.dtype == np.int64  # IDs past int32 stay as they are
    nearly = plan_of(shares(4, 2, np.array([2**31, 2**31, 5, 5])), np.arange(4), batch_size=2)
    assert nearly.layout.offsets.dtype == np.int64  # every offset fits, but not offset + length
    assert nearly.layout.offsets.tolist() == [0, 2**31, 0, 8]


def test_an_unlabelled_plan_holds_no_label_per_sample():
    plan = plan_of(shares(100, 2, np.ones(100, np.int64)), np.arange(100), labelled=False)
    assert plan.labels.strides == (0,) and plan.labels.tolist() == [-1] * 100
    assert plan.labels[5:9].astype(np.int64).tolist() == [-1] * 4


def test_ownership_is_checked_as_the_answers_come():
    sizes = np.ones(10, np.int64)
    links = shares(10, 2, sizes)
    links[1].lo = 3  # claims samples 3, 4 as well
    links[1].first_id = 3
    with pytest.raises(ProtocolError, match=r"sample [34] is claimed by s0 and s1"):
        plan_of(links, np.arange(10))
    links = shares(10, 2, sizes)
    links[1].hi = 9  # sample 9: nobody's
    with pytest.raises(DatasetError, match=r"sample 9 is owned by no server \(1 sample"):
        plan_of(links, np.arange(10))


def test_lookups_are_asked_a_message_at_a_time(monkeypatch):
    # What a server is asked arrives in Lookup-sized pieces, so the answers in flight stay a few
    # messages whatever the plan's length; every piece is full but the last.
    monkeypatch.setattr(plans, "LOOKUP_CHUNK", 5)
    monkeypatch.setattr(plans, "SCAN_BLOCK", 7)
    n = 200
    sizes = np.arange(n)
    links = shares(n, 3, sizes)
    ids = np.random.default_rng(1).permutation(n)
    plan = plan_of(links, ids)
    for link in links:
        mine = int(((ids >= link.lo) & (ids < link.hi)).sum())
        assert sum(link.asked) == mine
        assert all(a == 5 for a in link.asked[:-1]) and 0 < link.asked[-1] <= 5
    assert plan.lengths.tolist() == sizes[ids].tolist()
    idle = shares(n, 2, sizes)
    plan_of(idle, np.arange(10))  # nothing of s1's: it still hears one (empty) lookup
    assert idle[1].asked == [0]


def test_a_plan_whose_lookups_are_cancelled_ends_at_once():
    # The dataset closed while a plan's lookups wait in the pool's queue: the pool shut down with
    # cancel_futures. concurrent.futures.wait never wakes for a future cancelled so, and the
    # planner thread waiting in it (non-daemon) held the interpreter's exit for good.
    links = shares(10, 2, np.ones(10, np.int64))
    pool = ThreadPoolExecutor(1)
    busy = threading.Event()
    pool.submit(busy.wait, 30)  # the pool's one thread busy: the lookups wait in its queue
    errors = []

    def plan() -> None:
        with pytest.raises(CancelledError) as raised:
            plan_of(links, np.arange(10), pool=pool)
        errors.append(raised.value)

    planner = threading.Thread(target=plan, daemon=True)  # (daemon: left waiting when the test fails)
    planner.start()
    try:
        while pool._work_queue.qsize() < 2:
            planner.join(0.01)
        pool.shutdown(wait=False, cancel_futures=True)
        planner.join(5)
        assert not planner.is_alive(), "the plan still waits for lookups cancelled in the queue"
        assert errors
    finally:
        busy.set()
        pool.shutdown(wait=True)


def test_a_server_part_reads_its_samples_from_the_plan():
    rng = np.random.default_rng(2)
    n = 300
    sizes = rng.integers(0, 100, n)
    links = shares(n, 3, sizes)
    ids = rng.permutation(n)
    prep = PrepSplit(server_stages=1, fraction=0.5, seed=0, nbytes=64)
    plan = plan_of(links, ids, prep=prep)
    for index, link in enumerate(links):
        part = server_plan(plan, index, 8, prep)
        assert link.committed is not None and link.committed.positions.tolist() == part.positions.tolist()
        mine = np.flatnonzero(plan.owner == index)
        assert part.positions.dtype == np.int32 and part.positions.tolist() == mine.tolist()
        assert len(part) == len(mine) and part.count == n
        assert part.ids.tolist() == ids[mine].tolist()
        assert part.lengths.tolist() == plan.lengths[mine].tolist()
        assert part.offsets.tolist() == plan.layout.offsets[mine].tolist()
        assert part.remote.tolist() == plan.remote[mine].tolist()
        piece = part.part(3, 11)
        assert [a.tolist() for a in piece] == [
            a[3:11].tolist() for a in (part.ids, part.lengths, part.offsets, part.remote)
        ]
    assert server_plan(plan, 0, 8, None).remote is None  # no split: no sample preprocessed there


@pytest.mark.parametrize(("count", "batch_size", "fraction"), [(0, 8, 0.5), (7, 8, 0.3), (100, 16, 0.25), (99, 7, 1.0)])
def test_remote_positions_repeat_one_batch_pattern(count, batch_size, fraction):
    k = np.arange(count, dtype=np.int64) % batch_size
    expected = np.floor((k + 1) * fraction + 1e-9) > np.floor(k * fraction + 1e-9)
    got = remote_positions(count, batch_size, fraction)
    assert got.dtype == bool and got.tolist() == expected.tolist()


def test_a_plan_at_ten_million_samples_holds_15_bytes_per_sample():
    # The figure: a rank holds two plans at once, so each must stay well under 25 bytes.
    n = 10_000_000
    links = [Share(0, 0, n, np.broadcast_to(np.int64(1000), (n,)), np.broadcast_to(np.int64(7), (n,)))]
    plan = plan_of(links, np.random.default_rng(0).permutation(n).astype(np.int32), batch_size=64)
    arrays = [plan.ids, plan.lengths, plan.labels, plan.owner, plan.layout.offsets, plan.layout.starts]
    arrays += [plan.layout.batch_bytes, plan.owed]
    assert sum(a.nbytes for a in arrays) / n < 15.5


def test_compact_helpers():
    assert compact.index_dtype(1) == np.int8 and compact.index_dtype(128) == np.int8
    assert compact.index_dtype(129) == np.int16 and compact.index_dtype(40000) == np.int32
    a = compact.mapped(4, np.uint32)
    assert a.tolist() == [0] * 4 and own_mapping(a)
    assert compact.mapped((2, 3), np.int8, fill=-1).tolist() == [[-1] * 3] * 2
    assert compact.store(a, np.array([1]), np.array([7])) is a and a.tolist() == [0, 7, 0, 0]
    wider = compact.store(a, slice(2, 3), np.array([-1]))
    assert wider.dtype == np.int64 and wider.tolist() == [0, 7, -1, 0]
    owner = np.array([0, 1, 0, 2, 1, 0] * 3, np.int8)
    assert compact.owned_positions(owner, 0).tolist() == np.flatnonzero(owner == 0).tolist()
    assert compact.owned_positions(owner[:0], 0).tolist() == []
