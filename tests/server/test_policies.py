"""Memory policies: a share held in a window of its own, smaller than the share.

Production runs against feeders that stand in for the feeder processes (they apply what they are
told to their plans) and a counting source, so every backend read is seen.
"""

from __future__ import annotations

import numpy as np
import pytest

from kspeed.server.backend.sources import open_source
from kspeed.server.feeder.protocol import FeedProgress
from kspeed.server.hosting.preload import Preloader
from kspeed.server.memory.residency import WINDOW
from kspeed.server.memory.window import ProductionWindow
from kspeed.server.production.core import Production
from kspeed.server.production.policies import policy_for
from tests.server.datasets import REGION, write_tree
from tests.server.test_preload import CountingSource
from tests.server.test_production import Feeders, plan_of, wait

N = 240
SIZE = 20_000  # 240 samples of 20 kB: 4.8 MB, in a window of 1 MiB


class PolicyHost:
    """One share of ``N`` samples held under ``policy`` in ``regions`` pool regions."""

    def __init__(self, tmp_path, backend, pool, policy: str, regions: int = 1) -> None:
        self.files = write_tree(tmp_path / "d", [SIZE] * N)
        self.source = CountingSource(open_source(backend, "ds", str(tmp_path / "d")))
        self.policy = policy_for(policy)
        self._regions = [info.index for info in pool.allocate("ds", range(regions))]
        self.preloader = Preloader(self.source, pool, on_demand=True)

    def get(self, name, first=None):
        return self

    def window_regions(self) -> list[int]:
        return self._regions

    def count(self, name: str) -> int:
        return N


def serve(production: Production, feeders: Feeders, feed: str, epoch: int, pool, files, batches=None) -> None:
    """Act as a client reading a plan (``batches`` of it, or all): each batch once it is resident,
    byte-checked."""
    plan = feeders.plans[feed, epoch]
    for b in range(len(plan.starts) - 1) if batches is None else batches:
        lo, hi = int(plan.starts[b]), int(plan.starts[b + 1])
        wait(lambda lo=lo, hi=hi: (plan.region[lo:hi] >= 0).all())
        check_batch(feeders, plan, lo, hi, pool, files, (feed, epoch))
        production.progress(0, FeedProgress(feed, np.array([[epoch, b, 0, 1 << 30]]), 0))


def check_batch(feeders: Feeders, plan, lo: int, hi: int, pool, files, where: tuple) -> None:
    """Positions ``lo..hi`` of ``plan`` hold their samples' bytes. Read under the feeders' lock, as a
    feeder holds its read: these stand-ins answer every ``Locate`` at once with no slot still read,
    so a sample moved while it is read (its place and offset changing apart, its old slot given to
    another) would otherwise show bytes that no feeder could have written."""
    keys = sorted(files)
    with feeders.lock:
        for k in range(lo, hi):
            start, n = int(plan.src[k]), int(plan.length[k])
            got = pool.array(int(plan.region[k]))[start : start + n].tobytes()
            assert got == files[keys[int(plan.ids[k])]], (*where, k)


def epochs_of(production: Production, host: PolicyHost, feeders: Feeders, pool, orders: list[np.ndarray]) -> list:
    """Install every epoch's plan up front (a deterministic sampler's are known early), read them in
    turn; returns the share's figures."""
    lengths = host.preloader.index.length
    for epoch, order in enumerate(orders):
        production.install("f", 0, ("ds", 0), epoch, plan_of(order, lengths[order], 10), user_epoch=epoch)
        if epoch >= 1:
            serve(production, feeders, "f", epoch - 1, pool, host.files)
    serve(production, feeders, "f", len(orders) - 1, pool, host.files)
    return production.figures(("ds", 0))


@pytest.fixture
def run(tmp_path, backend, pool):
    made = []

    def start(policy: str):
        host = PolicyHost(tmp_path, backend, pool, policy)
        feeders = Feeders()
        production = Production(ProductionWindow(pool, REGION), host, feeders.tell, depth=64, threads=3)
        made.append(production)
        return host, feeders, production

    yield start
    for production in made:
        production.stop()


ORDERS = [np.random.default_rng(seed).permutation(N) for seed in range(3)]


def test_stream_reads_each_sample_once_per_epoch_through_a_window_a_fifth_of_the_share(run, pool):
    host, feeders, production = run("stream")
    figures = epochs_of(production, host, feeders, pool, ORDERS)
    share = production._shares["ds", 0]
    assert share.window is not production.window and 0.9 * REGION < share.window.capacity <= REGION
    assert share.window.peak <= share.window.capacity
    assert [f.epoch for f in figures] == [0, 1, 2]
    assert [f.written for f in figures] == [N, N, N] and [f.planned for f in figures] == [N, N, N]
    # every read counted for the plan it was made for; three epochs, each sample at most once each
    assert sum(f.misses for f in figures) == int(host.source.reads.sum()) <= 3 * N
    assert host.source.reads.max() <= 3 and all(f.backend_bytes == f.misses * SIZE for f in figures)
    # nothing stays once every plan is written
    wait(lambda: share.window.live_bytes == 0)
    assert not share.slots and not (share.residency.state == WINDOW).any()


def test_a_streamed_window_keeps_the_part_of_the_ranks_not_open_yet(run, pool):
    # Rank 0's client says its job has two ranks: before rank 1's feed opens, rank 0 prefetches
    # into half the window, so rank 1's first grants find room without pushing out samples that
    # rank 0's plan was read for (which would then be read twice in one epoch).
    host, feeders, production = run("stream")
    lengths = host.preloader.index.length
    first, second = ORDERS[0][: N // 2], ORDERS[0][N // 2 :]
    production.install("r0", 0, ("ds", 0), 0, plan_of(first, lengths[first], 10), ranks=2)
    share = production._shares["ds", 0]
    wait(lambda: production._feeds["r0"].held >= production._fair(share) - SIZE)
    alone = share.window.live_bytes
    assert 0 < alone <= share.window.capacity // 2
    production.install("r1", 0, ("ds", 0), 0, plan_of(second, lengths[second], 10), ranks=2)
    serve(production, feeders, "r1", 0, pool, host.files)
    serve(production, feeders, "r0", 0, pool, host.files)
    assert int(host.source.reads.max()) == 1 and production.preempted == 0  # every sample read once


def test_minio_keeps_one_fixed_subset_and_reads_the_rest_every_epoch(run, pool):
    host, feeders, production = run("minio")
    lengths = host.preloader.index.length
    for epoch in (0, 1):
        production.install(
            "f", 0, ("ds", 0), epoch, plan_of(ORDERS[epoch], lengths[ORDERS[epoch]], 10), user_epoch=epoch
        )
    serve(production, feeders, "f", 0, pool, host.files)
    after_first = host.source.reads.copy()
    share = production._shares["ds", 0]
    kept = np.array(sorted(share.cache.kept))
    assert len(kept) and share.cache.kept_bytes <= share.window.capacity * 3 // 4
    production.install("f", 0, ("ds", 0), 2, plan_of(ORDERS[2], lengths[ORDERS[2]], 10), user_epoch=2)
    serve(production, feeders, "f", 1, pool, host.files)
    serve(production, feeders, "f", 2, pool, host.files)
    now = np.array(sorted(share.cache.kept))
    assert len(now) and set(now.tolist()) <= set(kept.tolist())  # the subset is fixed (a tight window may shrink it)
    assert np.array_equal(host.source.reads[now], after_first[now])  # and what it keeps is never read again
    figures = production.figures(("ds", 0))
    assert figures[0].misses >= N - len(kept) and figures[2].misses <= N - len(now)


@pytest.mark.parametrize("policy", ["reuse", "lru"])
def test_evicting_policies_keep_what_fits_and_serve_every_epoch(run, pool, policy):
    host, feeders, production = run(policy)
    figures = epochs_of(production, host, feeders, pool, ORDERS)
    share = production._shares["ds", 0]
    assert share.window.peak <= share.window.capacity and [f.written for f in figures] == [N, N, N]
    assert sum(f.misses for f in figures) == int(host.source.reads.sum())
    assert share.cache.recent  # written samples stay until room is needed


def test_reuse_lets_go_of_the_farthest_next_use_and_lru_of_the_oldest(run, pool):
    host, feeders, production = run("reuse")
    lengths = host.preloader.index.length
    now = np.arange(0, 20)
    later = np.concatenate([np.arange(19, -1, -1), np.arange(20, N)])  # the next epoch wants them backwards
    production.install("f", 0, ("ds", 0), 0, plan_of(now, lengths[now], 10), user_epoch=0)
    serve(production, feeders, "f", 0, pool, host.files)
    production.install("f", 0, ("ds", 0), 1, plan_of(later, lengths[later], 10), user_epoch=1)
    share = production._shares["ds", 0]
    with production._lock:
        uses = production._next_use(share, np.array([0, 5, 19, 200], np.int64))
    assert uses.tolist() == [19, 14, 0, 200]
    # a sample no plan needs again goes first
    assert production._next_use(share, np.array([N - 1]))[0] == N - 1


def serve_ready(production: Production, feeders: Feeders, feed: str, epoch: int, pool, files, grants: list) -> None:
    """Act as a feeder with ``grants`` (batches, a batch granted twice listed twice) waiting: write
    whichever is resident, the oldest first, byte-checked, until none is left."""
    plan = feeders.plans[feed, epoch]
    starts = plan.starts.tolist()

    def ready() -> int | None:
        return next((b for b in grants if (plan.region[starts[b] : starts[b + 1]] >= 0).all()), None)

    while grants:
        wait(lambda: ready() is not None)
        b = ready()
        check_batch(feeders, plan, starts[b], starts[b + 1], pool, files, (feed, epoch))
        production.progress(0, FeedProgress(feed, np.array([[epoch, b, 0, 1 << 30]]), len(grants) - 1))
        grants.remove(b)


@pytest.mark.parametrize("policy", ["stream", "minio", "reuse", "lru"])
def test_positions_granted_again_after_a_fence_are_made_resident_again(run, pool, policy):
    # A client fenced another server and grants again every batch it had not delivered: here
    # batches 6..23, after 0..9 were written and while the grants of 10 and 11 still wait. Batches
    # 6..9 were let go (or kept, as the policy chose): they are made resident again, and each
    # position is held until its last grant is written. (Before, the grant of batch 6 waited
    # forever.)
    host, feeders, production = run(policy)
    lengths = host.preloader.index.length
    order = ORDERS[0]
    production.install("f", 0, ("ds", 0), 0, plan_of(order, lengths[order], 10), user_epoch=0)
    serve(production, feeders, "f", 0, pool, host.files, range(10))
    production.progress(0, FeedProgress("f", np.zeros((0, 4), np.int64), 2, again=((0, np.arange(60, 120)),)))
    serve_ready(production, feeders, "f", 0, pool, host.files, [10, 11, *range(6, 24)])
    plan = production._feeds["f"].plans[0]
    assert plan.written.all() and plan.next == N and plan.extra is not None and not plan.extra.any()
    figures = production.figures(("ds", 0))
    assert figures[0].written == figures[0].planned == N
    assert figures[0].misses == int(host.source.reads.sum())
    share = production._shares["ds", 0]
    if policy == "stream":
        assert (host.source.reads[order[60:100]] >= 2).all()  # let go once written: read again
        wait(lambda: share.window.live_bytes == 0)
        assert not share.slots and (share.uses == 0).all()


def test_a_truncated_plan_lets_go_what_was_read_for_its_cut_off_part_and_counts_only_the_rest(run, pool):
    # The client re-split the plan from batch 5 on into a new pass, while the window held samples
    # read for batches 5 and beyond: they are let go at once, none is read again for this plan,
    # and the epoch's figures count only the positions before the cut.
    host, feeders, production = run("stream")
    lengths = host.preloader.index.length
    order = ORDERS[0]
    production.install("f", 0, ("ds", 0), 0, plan_of(order, lengths[order], 10), user_epoch=0)
    serve(production, feeders, "f", 0, pool, host.files, range(3))
    share = production._shares["ds", 0]
    wait(lambda: int(order[50]) in share.slots)  # the horizon reaches past the cut to come
    production.progress(0, FeedProgress("f", np.zeros((0, 4), np.int64), 2, truncated=((0, 5),)))
    with production._lock:  # (a read in flight for the cut-off part is let go as it lands)
        assert not np.isin(order[50:], list(share.slots)).any()
        assert (share.uses[order[50:]] == 0).all() and share.uses.sum() == 20  # positions 30..49 to write
    serve(production, feeders, "f", 0, pool, host.files, range(3, 5))
    wait(lambda: share.window.live_bytes == 0)
    assert not share.slots and (share.uses == 0).all()
    (figures,) = production.figures(("ds", 0))
    assert figures.planned == figures.written == 50
    assert figures.misses == int(host.source.reads.sum()) and host.source.reads.max() == 1
