"""The pacer's model (kspeed.client.feeding.pacing), driven in simulated time against a model link.

The link is a FIFO bottleneck of a given rate behind which each server's path adds its own
propagation delay, so the tests can change the rate mid-run or slow one server down and check what
the window and the credits do, deterministically and without timing anything real.
"""

from __future__ import annotations

import heapq
import itertools
import math

import numpy as np
import pytest

from kspeed import grants
from kspeed.client.feeding.pacing import HELD_GRACE, RATE_WINDOW, SIZE_CLASSES, DrainRate, LatencyTable, Pacer, SubGrant
from kspeed.grants import Grant

MiB = 1 << 20


# -- latency table ---------------------------------------------------------------------------------


def test_size_class_is_nearest_on_a_log_scale():
    assert [LatencyTable.size_class(n) for n in (1, 32 << 10, 90 << 10, 100 << 10, 3 * MiB, 64 * MiB)] == [
        0,
        0,
        0,
        1,
        3,
        3,
    ]


def test_estimate_interpolates_and_extends():
    table = LatencyTable()
    assert math.isnan(table.estimate(MiB))
    table.set(0, 0.001)
    assert table.estimate(10 * MiB) == 0.001  # one entry: that is all we know
    table.set(3, 0.009)
    assert table.estimate(16 << 10) == pytest.approx(0.001)
    halfway = (SIZE_CLASSES[0] + SIZE_CLASSES[3]) // 2
    assert table.estimate(halfway) == pytest.approx(0.005, rel=1e-3)
    slope = 0.008 / (SIZE_CLASSES[3] - SIZE_CLASSES[0])
    assert table.estimate(8 * MiB) == pytest.approx(0.009 + slope * 4 * MiB)


def test_live_samples_move_an_entry_but_only_clean_ones_raise_it():
    table = LatencyTable()
    table.set(2, 0.004)
    table.observe(MiB, 0.010, clean=False)  # queued behind others: says nothing about the path
    assert table.seconds[2] == pytest.approx(0.004)
    table.observe(MiB, 0.002, clean=False)  # faster, though queued: the entry was too high
    lowered = table.seconds[2]
    assert 0.002 < lowered < 0.004
    table.observe(MiB, 0.010, clean=True)
    assert lowered < table.seconds[2] < 0.010
    assert set(table.as_dict()) == {"32KiB", "256KiB", "1MiB", "4MiB"}


# -- drain rate ------------------------------------------------------------------------------------


def test_drain_rate_follows_a_slower_link_within_its_window():
    rate = DrainRate(initial=1e6)
    assert rate.value(0.0) == 1e6  # before any sample: the probed rate
    t = 0.0
    rate.on_send(True, t)
    for _ in range(200):  # 100 MB/s for 2 s
        t += 0.01
        rate.on_complete(1_000_000, False, t)
    assert rate.value(t) == pytest.approx(100e6, rel=0.02)
    for _ in range(int(RATE_WINDOW * 100) + 20):  # then 25 MB/s
        t += 0.01
        rate.on_complete(250_000, False, t)
    assert rate.value(t) == pytest.approx(25e6, rel=0.02)


def test_app_limited_samples_never_lower_the_rate():
    rate = DrainRate()
    t = 0.0
    rate.on_send(True, t)
    for _ in range(50):
        t += 0.01
        rate.on_complete(1_000_000, False, t)
    for _ in range(300):  # the loop stopped asking: little is delivered, but the link is as fast
        t += 0.01
        rate.on_complete(10_000, True, t)
    assert rate.value(t) == pytest.approx(100e6, rel=0.02)


# -- the pacer against a model link ---------------------------------------------------------------


class ModelLink:
    """A FIFO bottleneck of ``rate`` bytes/s; path ``p`` adds ``delay[p]`` seconds after it."""

    def __init__(self, rate: float, delay: list[float]) -> None:
        self.rate = rate
        self.delay = delay
        self.busy_until = 0.0

    def done_at(self, now: float, path: int, nbytes: int) -> float:
        self.busy_until = max(now, self.busy_until) + nbytes / self.rate
        return self.busy_until + self.delay[path]


def probe(pacer: Pacer, link: ModelLink) -> None:
    for path, table in enumerate(pacer.tables):
        for index, size in enumerate(SIZE_CLASSES):
            table.set(index, size / link.rate + link.delay[path])
    pacer.seed(SIZE_CLASSES[-1] / (SIZE_CLASSES[-1] / link.rate + min(link.delay)))


def run(
    pacer: Pacer,
    link: ModelLink,
    *,
    seconds: float,
    start: float = 0.0,
    grant_bytes: int = 64 << 10,
    trace: list | None = None,
    delivered: list | None = None,
) -> float:
    """Keep every path backlogged with equal demand for ``seconds``; return the end time."""
    order = itertools.count(int(start * 1e6))
    flying: list[tuple[float, int, SubGrant]] = []
    t = start
    while t < start + seconds:
        for path in range(len(pacer.tables)):
            while len(pacer.pending[path]) < 32:
                pacer.queue(SubGrant(path, next(order), (), grant_bytes))
        for grant in pacer.release(t):
            assert pacer.in_flight < pacer.window + grant_bytes  # over by less than one grant
            heapq.heappush(flying, (link.done_at(t, grant.path, grant.nbytes), grant.order, grant))
        t, _, grant = heapq.heappop(flying)
        pacer.complete(grant, t)
        if delivered is not None:
            delivered[grant.path] += grant.nbytes
        if trace is not None:
            trace.append((t, pacer.window, pacer.in_flight))
    for done, _, grant in flying:  # settle what is still in flight
        pacer.complete(grant, done)
    return t


def test_window_keeps_the_link_busy_and_its_queue_short():
    link = ModelLink(50e6, [0.0005] * 4)
    pacer = Pacer(4, round_s=0.002)
    probe(pacer, link)
    delivered = [0] * 4
    trace: list = []
    run(pacer, link, seconds=5.0, trace=trace, delivered=delivered)
    rate = sum(delivered) / 5.0
    assert rate > 0.9 * link.rate  # not lower than the link allows
    late = [f for t, _, f in trace if t > 2.0]
    queue_s = max(late) / link.rate
    assert queue_s < 0.02  # unpaced, the whole ring (hundreds of MB) would wait at the bottleneck
    assert max(delivered) / min(delivered) < 1.1


def test_window_follows_a_rate_change_within_seconds():
    link = ModelLink(100e6, [0.0005] * 4)
    pacer = Pacer(4, round_s=0.002)
    probe(pacer, link)
    trace: list = []
    t = run(pacer, link, seconds=4.0, trace=trace)
    before = float(np.median([w for s, w, _ in trace if 2.0 < s < t]))
    link.rate = 25e6
    trace.clear()
    run(pacer, link, seconds=4.0, start=t, trace=trace)
    after = float(np.median([w for s, w, _ in trace if s > t + 2.0]))
    assert after < 0.5 * before
    settled = next(s for s, w, _ in trace if w < 0.5 * before) - t
    assert settled < 2.0


@pytest.mark.parametrize("credit", ["adaptive", "equal"])
def test_a_slow_server_is_granted_further_ahead(credit):
    link = ModelLink(200e6, [0.0005, 0.0005, 0.0005, 0.020])  # the last server answers 20 ms later
    pacer = Pacer(4, credit=credit, round_s=0.002)
    probe(pacer, link)
    delivered = [0] * 4
    run(pacer, link, seconds=5.0, delivered=delivered)
    slow_share = delivered[3] / (sum(delivered) / 4)
    credits = pacer.stats()["credits"]
    if credit == "adaptive":
        assert credits[3] > 5 * credits[0]
        assert slow_share > 0.9  # keeps up with the others, so batches do not wait for it
    else:
        assert credits[3] == credits[0]
        assert slow_share < 0.8  # falls behind: every batch waits for its part


def test_release_respects_window_credit_and_grant_order():
    pacer = Pacer(2, credit="equal")
    pacer.tables[0].set(0, 0.001)
    pacer.tables[1].set(0, 0.001)
    pacer.seed(10e6)
    grants = [SubGrant(i % 2, i, (), 4000) for i in range(40)]
    for grant in grants:
        pacer.queue(grant)
    sent = pacer.release(0.0)
    credits = pacer.stats()["credits"]
    assert credits[0] == credits[1] and 0 < pacer.window < 40 * 4000
    assert [g.order for g in sent] == list(range(len(sent))) and 2 < len(sent) < 40  # a prefix, in grant order
    assert pacer.in_flight >= pacer.window or min(pacer.in_flight_bytes) >= credits[0]  # full: no more may go
    assert pacer.in_flight < pacer.window + 4000 and max(pacer.in_flight_bytes) < credits[0] + 4000
    pacer.complete(sent[0], 0.001)
    assert [g.order for g in pacer.release(0.001)] == [len(sent)]
    dropped = pacer.drop(1)
    assert all(g.path == 1 for g in dropped) and pacer.in_flight_bytes[1] == 0


def test_a_wait_for_production_is_not_taken_for_the_paths_latency():
    pacer = Pacer(2, credit="adaptive")
    for path in (0, 1):
        pacer.tables[path].set(0, 0.001)
    pacer.seed(10e6)
    # each answered 50 ms after it was sent into an idle pipe; server 0 says its grant waited 49 ms
    # for the backend
    pacer.held(np.array([100], np.uint32), np.array([0.049]))
    for order, path in enumerate((0, 1)):
        pacer.queue(SubGrant(path, order, Grant(0, order, 0, 0, 1, tag=100 + order), 4000))
        (grant,) = pacer.release(float(order))
        pacer.complete(grant, grant.sent_at + 0.050)
    pacer.held(np.zeros(0, np.uint32), np.zeros(0), now=grant.sent_at + 0.05 + 2 * HELD_GRACE)  # none for 101
    assert pacer.tables[0].seconds[0] == pytest.approx(0.001)  # (clean: moved by the 1 ms it really took)
    assert pacer.tables[1].seconds[0] > 0.010  # the other path was really slow
    assert pacer.stats()["held_by_production_s"] == pytest.approx(0.049)
    # a HELD that comes just after its completion still counts: the slow completion waits for it
    pacer.queue(SubGrant(0, 2, Grant(0, 2, 0, 0, 1, tag=102), 4000))
    (late,) = pacer.release(1.0)
    pacer.complete(late, late.sent_at + 0.080)
    assert pacer.tables[0].seconds[0] == pytest.approx(0.001)  # not observed yet
    pacer.held(np.array([102], np.uint32), np.array([0.079]), now=late.sent_at + 0.081)
    assert pacer.tables[0].seconds[0] == pytest.approx(0.001)  # observed as the 1 ms it took
    # one that never comes leaves the completion observed as it was, a moment later
    pacer.queue(SubGrant(1, 3, Grant(0, 3, 0, 0, 1, tag=103), 4000))
    (slow,) = pacer.release(2.0)
    before = pacer.tables[1].seconds[0]
    pacer.complete(slow, slow.sent_at + 0.2)
    pacer.held(np.zeros(0, np.uint32), np.zeros(0), now=slow.sent_at + 0.2 + 2 * HELD_GRACE)
    assert pacer.tables[1].seconds[0] > before
    message = grants.decode(grants.encode_held([100, 7], [0.049, 1.5]))
    assert message.tags.tolist() == [100, 7] and message.seconds.tolist() == [0.049, 1.5]


def test_one_grant_may_always_be_in_flight_and_none_starves():
    pacer = Pacer(3)
    pacer.seed(1.0)  # a window far below one grant
    for order in range(6):
        pacer.queue(SubGrant(order % 3, order, (), 1 << 20))
    sent = []
    for step in range(6):
        released = pacer.release(float(step))
        assert len(released) == 1 and pacer.in_flight == 1 << 20
        sent += released
        pacer.complete(released[0], step + 0.5)
    assert [g.order for g in sent] == list(range(6))


def test_split_cuts_batches_into_sub_batches_per_server():
    pacer = Pacer(2)
    pacer.sub_batch = 100_000
    lengths = np.full(64, 32768, dtype=np.int64)
    offsets = np.arange(64, dtype=np.int64) * 32768
    cuts = pacer.split(offsets, lengths, owners=2)
    assert cuts[0] == 0 and cuts[-1] == 64 and all(a < b for a, b in itertools.pairwise(cuts))
    sizes = [int(lengths[a:b].sum()) for a, b in itertools.pairwise(cuts)]
    assert len(sizes) == 11 and max(sizes) <= 2 * 100_000 + 32768
    pacer.sub_batch = 10 * MiB
    assert pacer.split(offsets, lengths, owners=2) == [0, 64]
    pacer.sub_batch = 1
    assert len(pacer.split(offsets, lengths, owners=2)) == 65  # never less than one sample
