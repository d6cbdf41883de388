"""Shared preparation on one server (no daemon): a group's members are placed at one output per
sample and epoch, a member beyond the lag bound is served alone, a member that leaves is waited for
no more, a member drawing another seed is refused; and feeds whose next batches of preprocessed
samples do not fit the window together take turns instead of waiting on each other for good.

Production runs against the feeders' stand-ins, a counting source of a streamed share
(:mod:`tests.server.test_policies`) and preprocessing workers that stand in for the real ones.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from kspeed.errors import ConflictError
from kspeed.server.feeder.protocol import FeedProgress
from kspeed.server.memory.window import ProductionWindow
from kspeed.server.production.core import Production
from kspeed.server.production.groups import GroupState, Membership, Output, plan_lookup
from kspeed.server.production.state import PrepSpec
from tests.server.datasets import REGION
from tests.server.test_policies import ORDERS, N, PolicyHost
from tests.server.test_processed_policies import OUT, Prep
from tests.server.test_production import Feeders, plan_of, wait

KEY = ("ds", 0)


def processed(order: np.ndarray, batch: int):
    part = plan_of(order, np.full(len(order), OUT), batch)
    part.processed = np.ones(len(order), dtype=bool)
    return part


def spec(epoch: int, seed: int = 0) -> PrepSpec:
    return PrepSpec(b"", 1, seed, epoch, OUT)


@pytest.fixture
def run(tmp_path, backend, pool):
    made = []

    def start(threads: int = 3):
        host = PolicyHost(tmp_path, backend, pool, "stream")
        feeders = Feeders()
        prep = Prep()
        production = Production(
            ProductionWindow(pool, REGION), host, feeders.tell, depth=64, threads=threads, prep=prep
        )
        made.append(production)
        return host, feeders, production, prep

    yield start
    for production in made:
        production.stop()


class Reader:
    """A client reading one feed's processed plan batch by batch, checking the bytes."""

    def __init__(self, production: Production, feeders: Feeders, feed: str, epoch: int, pool, files) -> None:
        self.production, self.feeders, self.feed, self.epoch = production, feeders, feed, epoch
        self.plan = feeders.plans[feed, epoch]
        self.pool, self.keys, self.files = pool, sorted(files), files
        self.batch = 0

    @property
    def done(self) -> bool:
        return self.batch >= len(self.plan.starts) - 1

    def next(self) -> None:
        lo, hi = int(self.plan.starts[self.batch]), int(self.plan.starts[self.batch + 1])
        wait(lambda: (self.plan.region[lo:hi] >= 0).all())
        with self.feeders.lock:
            for k in range(lo, hi):
                start = int(self.plan.src[k])
                got = self.pool.array(int(self.plan.region[k]))[start : start + OUT].tobytes()
                assert got == self.files[self.keys[int(self.plan.ids[k])]][:OUT][::-1], (self.feed, k)
        written = np.array([[self.epoch, self.batch, 0, 1 << 30]])
        self.production.progress(0, FeedProgress(self.feed, written, 0))
        self.batch += 1

    def all(self) -> None:
        while not self.done:
            self.next()


def together(*readers: Reader) -> None:
    """Read the feeds' batches in turn, each as far as the one furthest behind (by position)."""
    while not all(r.done for r in readers):
        behind = min((r for r in readers if not r.done), key=lambda r: int(r.plan.starts[r.batch]))
        behind.next()


def figures(production: Production):
    (group,) = production.group_figures("ds")
    return group


def test_a_group_makes_each_output_once_and_every_member_is_written_it(run, pool):
    host, feeders, production, prep = run()
    for feed, batch in (("a", 10), ("b", 16), ("c", 7)):
        production.install(
            feed, 0, KEY, 0, processed(ORDERS[0], batch), spec(0), user_epoch=0, membership=Membership("g", feed, lag=N)
        )
    together(*(Reader(production, feeders, f, 0, pool, host.files) for f in "abc"))
    got = figures(production)
    assert prep.samples == N, (
        got,
        production.preempted,
        production.window_full,
    )  # made once for three jobs at three batch sizes
    assert host.source.reads.tolist() == [1] * N  # streamed: read once for the group
    got = figures(production)
    assert (got.produced, got.shared, got.alone, got.evicted) == (N, 2 * N, 0, 0)
    assert sum(got.member_shared.values()) == 2 * N
    for feed in "abc":
        production.drop_feed(feed)
    wait(lambda: production.window.used == 0)
    assert not production._groups


def test_a_member_beyond_the_lag_bound_is_served_alone_and_counted(run, pool):
    host, feeders, production, prep = run()
    lag = 8  # samples of the dataset (one share of N here): kept outputs hold 8 samples at most
    for feed in "ab":
        production.install(
            feed, 0, KEY, 0, processed(ORDERS[0], 10), spec(0), user_epoch=0, membership=Membership("g", feed, lag=lag)
        )
    Reader(production, feeders, "a", 0, pool, host.files).all()
    got = figures(production)
    # kept for b: only what a made before it led b by the bound (beside what b's plan, produced
    # ahead, is placed at); from then on a made its outputs alone, and nothing was kept for b
    assert got.kept_bytes <= got.cap_bytes == lag * OUT
    assert got.member_alone["a"] > N // 2 and got.evicted < N // 4
    Reader(production, feeders, "b", 0, pool, host.files).all()  # the bytes are right either way
    got = figures(production)
    assert got.member_shared["b"] > 0 and got.member_alone["b"] > 0
    # every position of each counted once: made for the group, placed at another's, or alone
    for member in "ab":
        counted = got.member_produced.get(member, 0) + got.member_shared.get(member, 0)
        assert counted + got.member_alone.get(member, 0) == N
    assert prep.samples == got.produced + got.alone == 2 * N - got.shared  # made once per position not shared


def test_a_member_that_leaves_is_waited_for_no_more(run, pool):
    host, feeders, production, _ = run()
    for feed in "ab":
        production.install(
            feed, 0, KEY, 0, processed(ORDERS[0], 10), spec(0), user_epoch=0, membership=Membership("g", feed)
        )
    Reader(production, feeders, "a", 0, pool, host.files).all()
    assert figures(production).kept_bytes > 0  # kept for b, which has not read
    production.drop_feed("b")
    got = figures(production)
    assert got.kept_bytes == 0 and got.members == 1
    production.drop_feed("a")
    wait(lambda: production.window.used == 0)


def test_a_member_drawing_another_seed_is_refused_and_nothing_is_followed(run, pool):
    _, _, production, _ = run()
    production.install("a", 0, KEY, 0, processed(ORDERS[0], 10), spec(0, seed=1), membership=Membership("g", "a"))
    with pytest.raises(ConflictError, match=r"seed 1.*seed 2"):
        production.install("b", 0, KEY, 0, processed(ORDERS[0], 10), spec(0, seed=2), membership=Membership("g", "b"))
    assert "b" not in production._feeds
    # decoded members draw from seeds of their own: no output is shared with them, none refused
    production.install(
        "c", 0, KEY, 0, processed(ORDERS[0], 10), spec(0, seed=3), membership=Membership("g", "c", "decoded")
    )
    assert set(production._groups[KEY, "g"].members) == {"a"}


def test_feeds_whose_next_batches_do_not_fit_the_window_together_take_turns(run, pool):
    # Four feeds of 80-sample batches of 4 KiB outputs: 1.25 MiB of first grants in a 1 MiB window.
    # Each used to fill part of its first grant and wait for room another held, for good.
    host, feeders, production, prep = run()
    for feed in "abcd":
        production.install(feed, 0, KEY, 0, processed(ORDERS[int(feed, 16) % 3], 80), spec(0))
    # before anyone reads, the senior feed's grant takes the room of the others' (a wait, before,
    # that nothing ended)
    wait(lambda: production.preempted > 0)
    readers = [Reader(production, feeders, feed, 0, pool, host.files) for feed in "abcd"]
    with ThreadPoolExecutor(4) as clients:  # (each client reads its own feed)
        for done in [clients.submit(r.all) for r in readers]:
            done.result()
    assert prep.samples >= 4 * N


def test_kept_outputs_fit_the_cap_oldest_first():
    group = GroupState("g", share_size=100, dataset_size=400)
    group.join("a", "fa", lag=40)  # 40 samples of the dataset: 10 of this share's
    assert group.cap(capacity=1 << 20, nbytes=1000) == 10 * 1000
    assert group.cap(capacity=8000, nbytes=1000) == 4000  # never over half the window
    group.lags["a"] = 0
    assert group.cap(capacity=8000, nbytes=1000) == 2000  # none asked: a quarter
    group.lags["a"] = 40
    for sample in range(12):
        output = Output(((1, 0, False, 1000), 0, sample), 1000, {"b"})
        group.outputs[output.key] = output
        group.keep(output)
    assert [o.key[2] for o in group.over_cap(1 << 20)] == [0, 1]
    group.unkeep(group.outputs[((1, 0, False, 1000), 0, 0)])
    assert group.kept_bytes == 11000 and [o.key[2] for o in group.over_cap(1 << 20)] == [1]
    assert group.leave("a", "fa") and not group.members


def test_plan_lookup_finds_each_sample_or_says_none():
    ids = np.array([5, 3, 9, 3, 1], dtype=np.int32)
    order = np.argsort(ids, kind="stable")
    assert plan_lookup(ids, order, np.array([3, 9, 4, 1, 10], dtype=np.int32)).tolist() == [1, 2, -1, 4, -1]
    assert plan_lookup(ids[:0], order[:0], np.array([1])).tolist() == [-1]


def test_a_lag_bound_under_two_of_a_members_batches_is_warned_once(run, caplog):
    # outputs of 4 KiB in a 1 MiB window: a bound of 64 samples (a quarter of the window)
    _, _, production, _ = run()
    production.stop()  # (this test plays the producer)
    production.install("a", 0, KEY, 0, processed(ORDERS[0], 20), spec(0), membership=Membership("g", "a"))
    production.install("b", 0, KEY, 0, processed(ORDERS[0], 40), spec(0), membership=Membership("g", "b"))
    with caplog.at_level("WARNING", logger="kspeed.server.production.sharing"):
        for _ in range(4):  # (each feed's turn comes)
            with production._lock:
                assert production._next_work() is not None
        narrow = [r.getMessage() for r in caplog.records if "lag bound" in r.getMessage()]
        # b's batches of 40: two of them are 80 samples, more than the bound; a's 40 are not
        assert len(narrow) == 1 and "lag bound (64 samples" in narrow[0] and "member b's batches of 40" in narrow[0]
        assert "production_window" in narrow[0]
        with production._lock:
            production._next_work()
        assert len([r for r in caplog.records if "lag bound" in r.getMessage()]) == 1  # once per group
