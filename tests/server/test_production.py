"""Production: samples made resident in plan order, a depth ahead, through a bounded window."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kspeed.layout import batch_layout
from kspeed.server.backend.sources import open_source
from kspeed.server.feeder.plan_part import PlanPart
from kspeed.server.feeder.protocol import Failed, FeedProgress, InstallPlan, Locate, Place, Reply
from kspeed.server.feeder.writer import FeederShared
from kspeed.server.hosting.integrity import SampleStore
from kspeed.server.hosting.preload import Preloader
from kspeed.server.memory.checksum import crc32c
from kspeed.server.memory.residency import ABSENT, HOME, READING, WINDOW
from kspeed.server.memory.window import ProductionWindow
from kspeed.server.production.core import Production
from kspeed.server.production.policies import ON_DEMAND, WHOLE, policy_for
from kspeed.server.production.state import PlanState, PrepSpec
from tests.server.datasets import REGION, write_tree
from tests.server.test_preload import CountingSource, make


class Feeders:
    """Stands in for the feeder processes: applies what production tells them to their plans."""

    def __init__(self) -> None:
        self.plans: dict[tuple[str, int], PlanPart] = {}
        self.log: list[object] = []
        self.lock = threading.Lock()

    def tell(self, index: int, command) -> Reply:
        with self.lock:
            self.log.append(command)
            if isinstance(command, InstallPlan):
                self.plans[command.feed_id, command.epoch] = command.plan
            elif isinstance(command, Locate):
                for plan in self.plans.values():
                    plan.locate(command.ids, command.region, command.src, command.ticket, command.crc)
            elif isinstance(command, Place) and not command.reasons and (command.feed_id, command.epoch) in self.plans:
                self.plans[command.feed_id, command.epoch].place(
                    command.at, command.region, command.src, command.ticket
                )
        return Reply(True)

    def located(self) -> list[Locate]:
        with self.lock:
            return [c for c in self.log if isinstance(c, Locate)]


class Host:
    def __init__(self, preloader) -> None:
        self.preloader = preloader
        self.store = SampleStore(preloader)
        # held whole, or on demand when the preloader has no home for it
        self.policy = policy_for(ON_DEMAND if preloader.on_demand else WHOLE)

    def get(self, name, first=None):
        return self


def plan_of(ids: np.ndarray, lengths: np.ndarray, batch: int) -> PlanPart:
    layout = batch_layout(lengths, batch)
    n = len(ids)
    return PlanPart(
        starts=layout.starts,
        positions=np.arange(n, dtype=np.int64),
        ids=ids.astype(np.int64),
        length=lengths.astype(np.int64),
        dst=layout.offsets,
        region=np.full(n, -1, np.int64),
        src=np.zeros(n, np.int64),
        ticket=np.zeros(n, np.int64),
    )


def written(plan: PlanPart, batches: range) -> np.ndarray:
    return np.array([(0, b, 0, 1 << 30) for b in batches], dtype=np.int64).reshape(-1, 4)


def wait(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture
def produced(tmp_path, backend, pool):
    """A share of 300 samples behind a 2 ms-per-file backend, a window of one region, production running."""
    sizes = np.random.default_rng(3).integers(1, 20_000, 300)
    window = ProductionWindow(pool, REGION)
    files, src, pre = make(tmp_path, backend, pool, sizes, uri=f"slowfile://{tmp_path / 'd'}", threads=2)
    feeders = Feeders()
    production = Production(window, Host(pre), feeders.tell, depth=40, threads=3)
    yield files, src, pre, window, feeders, production
    production.stop()


def check_bytes(files, plan: PlanPart, pool, upto: int) -> None:
    keys = sorted(files)
    for k in range(upto):
        assert plan.region[k] >= 0, f"position {k} not resident"
        start, n = int(plan.src[k]), int(plan.length[k])
        assert pool.array(int(plan.region[k]))[start : start + n].tobytes() == files[keys[int(plan.ids[k])]]


def test_the_plan_is_produced_in_order_a_depth_ahead_then_goes_home(produced, pool):
    files, src, pre, window, feeders, production = produced
    ids = np.random.default_rng(4).permutation(300)
    plan = plan_of(ids, pre.index.length[ids], 10)
    production.install("f", 0, ("ds", 0), 0, plan)
    mine = feeders.plans["f", 0]
    wait(lambda: (mine.region[:40] >= 0).all())
    check_bytes(files, mine, pool, 40)  # the first depth of the plan is resident, byte exact
    into_window = np.concatenate([c.ids[c.ticket > 0] for c in feeders.located()])
    assert len(into_window) and set(into_window.tolist()) <= set(ids[:40].tolist())  # never beyond the depth
    assert window.used > 0
    # The client took the first 20 batches: their samples leave the window for home, nothing is read twice.
    production.progress(0, FeedProgress("f", written(mine, range(20)), 0))
    wait(lambda: (pre.residency.of(ids[:200]) == HOME).all())
    pre.preload(timeout=60)
    check_bytes(files, mine, pool, 300)
    assert src.reads.max() == 1 and src.reads.sum() == 300
    production.progress(0, FeedProgress("f", written(mine, range(30)), 0))
    wait(lambda: window.used == 0)
    assert (mine.ticket == 0).all() and window.peak <= window.capacity


def test_a_feeder_is_told_each_region_file_once(produced, pool):
    # A plan used to carry the file of every region of the pool; a commit then cost the server's
    # memory size, for every rank at every epoch boundary. The share's and the window's regions
    # go to a feeder with its first plan, and never again.
    _files, _src, pre, window, feeders, production = produced
    ids = np.arange(300)
    for epoch, feeder in ((0, 0), (1, 0), (2, 1), (3, 0)):
        production.install(f"f{epoch}", feeder, ("ds", 0), epoch, plan_of(ids, pre.index.length[ids], 10))
    told = [(c.epoch, set(c.paths)) for c in feeders.log if isinstance(c, InstallPlan)]
    share = set(pre.pool_indices) | set(window.paths)
    assert told == [(0, share), (1, set()), (2, share), (3, set())]
    assert all(c.paths[i] == str(pool.path(i)) for c in feeders.log if isinstance(c, InstallPlan) for i in c.paths)


def test_a_full_window_holds_production_back_until_samples_are_written(tmp_path, backend, pool):
    sizes = np.full(100, 60_000)
    window = ProductionWindow(pool, REGION)  # 16 chunks of 64 KiB: one sample each
    files, _src, pre = make(tmp_path, backend, pool, sizes, uri=f"slowfile://{tmp_path / 'd'}", threads=1)
    feeders = Feeders()
    production = Production(window, Host(pre), feeders.tell, depth=100, threads=2)
    try:
        ids = np.arange(100)
        pre_start = pre.start
        pre.start = lambda: None  # no preload: only the window can hold samples
        plan = plan_of(ids, pre.index.length[ids], 4)
        production.install("f", 0, ("ds", 0), 0, plan)
        mine = feeders.plans["f", 0]
        wait(lambda: production.window_full > 0)
        assert (mine.region >= 0).sum() <= 16 and window.used <= window.capacity
        for b in range(25):  # the client takes a batch at a time; the window keeps following
            wait(lambda b=b: (mine.region[4 * b : 4 * b + 4] >= 0).all())
            check_bytes(files, mine, pool, 4 * b + 4)
            production.progress(0, FeedProgress("f", written(mine, range(b + 1)), 0))
            assert window.used <= window.capacity
        assert window.peak <= window.capacity
        pre.start = pre_start
    finally:
        production.stop()


def test_a_feed_that_stops_reading_leaves_the_others_their_share(tmp_path, backend, pool):
    sizes = np.full(200, 30_000)
    window = ProductionWindow(pool, REGION)
    _files, _src, pre = make(tmp_path, backend, pool, sizes, uri=f"slowfile://{tmp_path / 'd'}", threads=1)
    pre.start = lambda: None
    feeders = Feeders()
    production = Production(window, Host(pre), feeders.tell, depth=200, threads=2)
    try:
        stuck = plan_of(np.arange(100), pre.index.length[:100], 10)
        moving = plan_of(np.arange(100, 200), pre.index.length[100:], 10)
        production.install("stuck", 0, ("ds", 0), 0, stuck)
        production.install("moving", 1, ("ds", 0), 0, moving)
        mine = feeders.plans["moving", 0]
        for b in range(10):  # "stuck" never reports a write; "moving" still gets every batch
            wait(lambda b=b: (mine.region[10 * b : 10 * b + 10] >= 0).all())
            production.progress(1, FeedProgress("moving", written(mine, range(b + 1)), 0))
        assert window.peak <= window.capacity
    finally:
        production.stop()


def test_a_failed_read_is_told_to_the_feeders_with_its_reason(produced, tmp_path):
    files, _src, pre, _window, feeders, production = produced
    victim = 5
    (tmp_path / "d" / sorted(files)[victim]).unlink()
    production.install("f", 0, ("ds", 0), 0, plan_of(np.arange(50), pre.index.length[:50], 10))
    wait(lambda: any(isinstance(c, Failed) and victim in c.ids.tolist() for c in feeders.log))
    failed = next(c for c in feeders.log if isinstance(c, Failed) and victim in c.ids.tolist())
    assert "deleted" in failed.reasons[failed.ids.tolist().index(victim)] and production.failed_samples >= 1


def test_plan_locations_follow_duplicates_and_window_reads_are_counted():
    plan = plan_of(np.array([7, 3, 7, 9]), np.array([1, 2, 1, 4]), 2)
    old = plan.locate(np.array([7, 9]), np.array([5, 6]), np.array([100, 200]), np.array([11, 12]))
    assert old.tolist() == [0, 0, 0]
    assert plan.region.tolist() == [5, -1, 5, 6] and plan.src.tolist() == [100, 0, 100, 200]
    assert plan.ticket.tolist() == [11, 0, 11, 12]
    events = []
    shared = FeederShared(events.append)
    shared.hold(np.array([11, 11, 12]))
    assert shared.retire([11, 13]) == [11]  # 11 is being read; 13 is free at once
    assert shared.let_go(np.array([11])) == [] and shared.let_go(np.array([11, 12])) == [11]
    assert shared.in_use == {}


def test_a_position_granted_again_is_due_one_more_write_whenever_its_grant_comes():
    # The feeder notes the positions each grant asks for; a second grant of one is reported.
    part = plan_of(np.arange(20), np.full(20, 8), 4)
    assert part.span(1, 0, 1 << 30) == (4, 8) and part.span(1, 1, 3) == (5, 7)
    assert part.grant(4, 8).tolist() == [] and part.grant(0, 4).tolist() == []
    assert part.grant(2, 6).tolist() == [2, 3, 4, 5]  # a re-grant after a fence (2, 3 and 4, 5)
    # Production: positions 0..3 written, then granted again (unwritten again, its next goes back);
    # 4..7 granted again while their first grant still waits (both writes are due).
    state = PlanState(0, part.ids, part.positions, part.starts, np.zeros(20, dtype=bool))
    assert state.mark(0, 0, 1 << 30)[2].tolist() == [0, 1, 2, 3] and state.next == 4
    assert state.granted_again(np.arange(0, 8)).tolist() == [0, 1, 2, 3] and state.next == 0
    assert state.mark(1, 0, 1 << 30)[2].tolist() == []  # the first grant of batch 1: one more is due
    assert state.mark(0, 0, 1 << 30)[2].tolist() == [0, 1, 2, 3] and state.next == 4
    assert state.mark(1, 0, 1 << 30)[2].tolist() == [4, 5, 6, 7] and state.next == 8
    assert not state.extra.any()


def test_a_truncated_plan_state_ends_at_its_cut():
    # The client re-split the plan from batch 2 on into a new pass; it granted batches 0 and 1.
    part = plan_of(np.arange(40), np.full(40, 8), 10)
    state = PlanState(0, part.ids, part.positions, part.starts, np.zeros(40, dtype=bool))
    assert state.mark(0, 0, 1 << 30)[2].tolist() == list(range(10)) and state.next == 10
    assert state.truncate(2).tolist() == list(range(20, 40))  # cut off, none of them written
    assert state.cut == 20 and state.next == 10 and state.truncated == 20
    assert state.ahead(100).tolist() == list(range(10, 20))  # the horizon ends at the cut
    assert state.truncate(3).tolist() == [] and state.cut == 20  # a later cut changes nothing
    assert state.granted_again(np.array([25, 30])).tolist() == [] and state.ahead(100).tolist() == list(range(10, 20))
    assert state.planned == 20 and state.delivered() == 10  # cut off is neither planned nor written
    assert state.mark(1, 0, 1 << 30)[2].tolist() == list(range(10, 20))
    assert state.next == 40 and state.first_grant().tolist() == [] and state.delivered() == 20


def produce_all(production: Production) -> list[int]:
    """Do the producers' work in the test's thread (their threads stopped) until none is left;
    returns the samples produced."""
    made: list[int] = []
    while True:
        with production._lock:
            work = production._next_work()
        if work is None:
            return made
        production._produce(work.share, work.feed_id, work.ids, work.user_epoch, work.epoch)
        made += work.ids.tolist()


def test_a_truncated_plan_is_produced_up_to_its_cut_and_what_was_made_beyond_it_leaves(tmp_path, backend, pool):
    window = ProductionWindow(pool, REGION)
    files, src, pre = make(tmp_path, backend, pool, np.full(100, 2000), threads=1)
    pre.start = lambda: None  # no preload: only production reads
    feeders = Feeders()
    production = Production(window, Host(pre), feeders.tell, depth=40, threads=1)
    production.stop()  # its producers' work is done by the test, step by step
    ids = np.random.default_rng(6).permutation(100)
    production.install("f", 0, ("ds", 0), 0, plan_of(ids, pre.index.length[ids], 10))
    mine = feeders.plans["f", 0]
    assert sorted(produce_all(production)) == sorted(ids[:40].tolist())  # the depth
    # The client re-split the plan from batch 3 on (a new pass); it granted batches 0..2 only.
    production.progress(0, FeedProgress("f", np.zeros((0, 4), np.int64), 3, truncated=((0, 3),)))
    share = production._shares["ds", 0]
    assert sorted(share.slots) == sorted(ids[:30].tolist())  # made for the cut-off part: gone home
    assert (pre.residency.of(ids[30:40]) == HOME).all()
    production.progress(0, FeedProgress("f", written(mine, range(1)), 2))
    assert produce_all(production) == []  # the horizon ends at the cut, however deep
    check_bytes(files, mine, pool, 30)  # the granted batches are served
    production.progress(0, FeedProgress("f", written(mine, range(1, 3)), 0))
    assert produce_all(production) == [] and window.used == 0 and not share.slots
    assert src.reads.sum() == 40 and src.reads[ids[40:]].sum() == 0
    state = production._feeds["f"].plans[0]
    assert state.next == 100 and state.delivered() == 30 and state.truncated == 70


def test_a_truncation_releases_the_processed_slots_of_its_cut_off_positions(tmp_path, backend, pool):
    window = ProductionWindow(pool, REGION)
    _files, _src, pre = make(tmp_path, backend, pool, np.full(40, 1000), threads=1)
    pre.start = lambda: None
    feeders = Feeders()
    production = Production(window, Host(pre), feeders.tell, depth=40, threads=1)
    production.stop()
    part = plan_of(np.arange(40), np.full(40, 512), 10)
    part.processed = np.ones(40, dtype=bool)  # every position run through the server stages here
    production.install("f", 0, ("ds", 0), 0, part, PrepSpec(b"", 1, 0, 0, 512))
    feed, share = production._feeds["f"], production._shares["ds", 0]
    state = feed.plans[0]

    def made(at: list[int]) -> None:
        """As a producer whose preprocessing workers made positions ``at``."""
        got = np.array(at, dtype=np.int64)
        slots = [window.place(512, "f") for _ in at]
        with production._lock:
            state.state[got] = READING
            production._settle_processed(share, feed, state, got, state.ids[got], slots, [512] * len(at))

    made(list(range(30)))
    held = feed.held
    # The client re-split the plan from batch 2 on; it granted batches 0 and 1.
    production.progress(0, FeedProgress("f", np.zeros((0, 4), np.int64), 2, truncated=((0, 2),)))
    assert sorted(state.slots) == list(range(20)) and feed.held == held * 2 // 3
    released = [c for c in feeders.log if isinstance(c, Place) and (c.region < 0).all()]
    assert [c.at.tolist() for c in released] == [list(range(20, 30))]  # the feeder is told they are gone
    assert (state.state[20:30] == ABSENT).all()
    # One cut off while it was being made is let go as it lands, never placed.
    placed = len([c for c in feeders.log if isinstance(c, Place)])
    made([35])
    assert 35 not in state.slots and len([c for c in feeders.log if isinstance(c, Place)]) == placed
    production.progress(0, FeedProgress("f", done(0, range(2)), 0))
    assert not state.slots and feed.held == 0 and window.used == 0 and state.next == 40


def done(epoch: int, batches: range) -> np.ndarray:
    return np.array([(epoch, b, 0, 1 << 30) for b in batches], dtype=np.int64).reshape(-1, 4)


def test_a_share_held_on_demand_is_read_as_consumed_from_the_first_batch_still_needed(tmp_path, backend, pool):
    sizes = np.full(64, 40_000)
    write_tree(tmp_path / "d", sizes)
    src = CountingSource(open_source(backend, "ds", f"slowfile://{tmp_path / 'd'}"))
    pre = Preloader(src, pool, on_demand=True)  # no regions: only the window holds its samples
    window = ProductionWindow(pool, REGION)  # 16 chunks of 64 KiB: one sample each
    feeders = Feeders()
    production = Production(window, Host(pre), feeders.tell, depth=1024, threads=2)
    try:
        rng = np.random.default_rng(5)
        ids0, ids1 = rng.permutation(64), rng.permutation(64)
        # Committed again after a failover: batches 0..4 were delivered by the lost server.
        production.install("f", 0, ("ds", 0), 0, plan_of(ids0, sizes, 4), first_batch=5)
        production.install("f", 0, ("ds", 0), 1, plan_of(ids1, sizes, 4))  # the next epoch, committed early
        for epoch, first in ((0, 5), (1, 0)):
            mine = feeders.plans["f", epoch]
            for b in range(first, 16):  # the client takes a batch at a time
                wait(lambda b=b, mine=mine: (mine.region[4 * b : 4 * b + 4] >= 0).all())
                production.progress(0, FeedProgress("f", done(epoch, range(b, b + 1)), 0))
        # Each sample read at most once per epoch it is needed in (a few of the next epoch's first
        # ones were still in the window), none for the batches delivered before the failover.
        assert src.reads.max() <= 2 and 64 <= src.reads.sum() <= 44 + 64
        assert (src.reads[ids0[:20]] <= 1).all()
        assert pool.regions("ds") == [] and not (pre.residency.of(np.arange(64)) == HOME).any()
        wait(lambda: window.used == 0)
        assert window.peak <= window.capacity
    finally:
        production.stop()


def test_feeders_learn_each_stored_samples_checksum_and_a_corrupt_one_is_read_again(produced, pool):
    files, _src, pre, _window, feeders, production = produced
    keys = sorted(files)
    ids = np.arange(60)
    production.install("f", 0, ("ds", 0), 0, plan_of(ids, pre.index.length[ids], 10))
    mine = feeders.plans["f", 0]
    wait(lambda: (mine.region[:40] >= 0).all())
    for k in range(40):  # every place comes with the checksum its bytes have there
        start, n = int(mine.src[k]), int(mine.length[k])
        assert mine.crc is not None and int(mine.crc[k]) == crc32c(pool.array(int(mine.region[k]))[start : start + n])
    store = production.host.get("ds").store

    # A copy in the window that changed is let go and produced again from the backend.
    (k,) = np.flatnonzero(pre.residency.of(ids[:40]) == WINDOW)[:1]
    start, n = int(mine.src[k]), int(mine.length[k])
    pool.array(int(mine.region[k]))[start : start + n] ^= 0xFF
    production.corrupt("f", [int(ids[k])])
    wait(lambda: mine.region[k] >= 0 and mine.ticket[k] != 0 and store.counters["repaired"] == 1)
    start, n = int(mine.src[k]), int(mine.length[k])
    assert pool.array(int(mine.region[k]))[start : start + n].tobytes() == files[keys[int(ids[k])]]

    # One at home is read again in its place; one intact is placed again as it was, uncounted.
    pre.preload(timeout=60)  # (what the window holds for the feed stays there)
    assert (pre.residency.of(np.array([50, 51])) == HOME).all()
    region, offset = pre.home(np.array([50, 51]))
    home = pool.array(int(region[0]))[int(offset[0]) : int(offset[0]) + len(files[keys[50]])]
    home ^= 0xFF
    production.corrupt("f", [50, 51])
    assert home.tobytes() == files[keys[50]] and store.counters == {
        "crc_mismatches": 2,
        "repaired": 2,
        "backend_reads": 0,
    }
    last = feeders.located()[-1]
    assert last.ids.tolist() == [50, 51] and last.crc is not None
    assert last.crc.tolist() == [int(pre.index.crc[50]), int(pre.index.crc[51])]


class Hanging:
    """A backend read that does not answer until released."""

    def __init__(self) -> None:
        self.entered = threading.Semaphore(0)
        self.release = threading.Event()

    def produce(self, preloader, ids, slots, window):
        self.entered.release()
        self.release.wait(60)
        raise OSError("the backend never answered")


def test_a_stop_waits_for_producers_stuck_in_a_backend_read_once_in_all_and_names_them(
    tmp_path, backend, pool, monkeypatch, caplog
):
    # Each producer thread was joined for 5 s in turn: a server whose backend stopped answering
    # took 5 s per busy producer to stop (10 s for two, behind a bucket gone before the server).
    monkeypatch.setattr("kspeed.server.production.core.STOP_WAIT_S", 0.2)
    window = ProductionWindow(pool, REGION)
    _files, _src, pre = make(tmp_path, backend, pool, np.full(64, 1000), threads=1)
    pre.start = lambda: None  # no preload: every sample is read by a producer
    hanging = Hanging()
    production = Production(window, Host(pre), Feeders().tell, depth=64, threads=3, producer=hanging)
    try:
        for feed in range(3):
            production.install(f"f{feed}", 0, ("ds", 0), 0, plan_of(np.arange(64), pre.index.length, 8))
        for _ in range(3):
            assert hanging.entered.acquire(timeout=20), "a producer never reached the backend"
        with caplog.at_level("WARNING", logger="kspeed.server.production.core"):
            production.stop()
        assert "producer-0, producer-1, producer-2 still busy" in caplog.text
    finally:
        hanging.release.set()
