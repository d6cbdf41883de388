"""Processed positions of a share held under a memory policy: each read from the backend once per
plan, counted in the share's figures, and produced for a feed's first grant even at its fair share.

Production runs against the feeders' stand-ins and a counting source (:mod:`tests.server.test_policies`),
with preprocessing workers that stand in for the real ones (no worker processes).
"""

from __future__ import annotations

import numpy as np
import pytest

from kspeed.server.feeder.protocol import FeedProgress
from kspeed.server.memory.residency import ABSENT, READING
from kspeed.server.memory.window import ProductionWindow
from kspeed.server.prep.workers import PrepTask
from kspeed.server.production.core import Production
from kspeed.server.production.state import PrepSpec
from tests.server.datasets import REGION
from tests.server.test_policies import ORDERS, SIZE, N, PolicyHost
from tests.server.test_production import Feeders, plan_of, wait

OUT = 4096  # bytes of a processed sample: the first OUT bytes of its stored bytes, reversed


class Prep:
    """Stands in for the preprocessing workers: writes each sample's output into its slot."""

    def __init__(self) -> None:
        self.samples = 0

    def run(self, task: PrepTask, job: str = "") -> list[int | str | bytes]:
        assert task.outputs is not None
        for data, out in zip(task.inputs, task.outputs, strict=True):
            out[:OUT] = np.frombuffer(bytes(data[:OUT])[::-1], np.uint8)
        self.samples += len(task.samples)
        return [OUT] * len(task.samples)

    def close(self) -> None:
        pass


def processed_plan(order: np.ndarray):
    part = plan_of(order, np.full(len(order), OUT), 10)
    part.processed = np.ones(len(order), dtype=bool)  # every position run through the server stages here
    return part


@pytest.fixture
def run(tmp_path, backend, pool):
    made = []

    def start(policy: str, threads: int = 3, window: int = REGION):
        host = PolicyHost(tmp_path, backend, pool, policy)
        feeders = Feeders()
        production = Production(
            ProductionWindow(pool, window), host, feeders.tell, depth=64, threads=threads, prep=Prep()
        )
        made.append(production)
        return host, feeders, production

    yield start
    for production in made:
        production.stop()


def serve(production: Production, feeders: Feeders, feed: str, epoch: int, pool, files) -> None:
    """Act as a client reading a processed plan: each batch once produced, byte-checked."""
    plan = feeders.plans[feed, epoch]
    keys = sorted(files)
    for b in range(len(plan.starts) - 1):
        lo, hi = int(plan.starts[b]), int(plan.starts[b + 1])
        wait(lambda lo=lo, hi=hi: (plan.region[lo:hi] >= 0).all())
        with feeders.lock:
            for k in range(lo, hi):
                start = int(plan.src[k])
                got = pool.array(int(plan.region[k]))[start : start + OUT].tobytes()
                assert got == files[keys[int(plan.ids[k])]][:OUT][::-1], (epoch, k)
        production.progress(0, FeedProgress(feed, np.array([[epoch, b, 0, 1 << 30]]), 0))


@pytest.mark.parametrize("policy", ["stream", "minio"])
def test_processed_positions_read_each_sample_once_per_plan_and_count_the_reads(run, pool, policy):
    # A share with no home keeps no raw copy of a processed position. Its producers used to claim
    # and adopt one all the same: the adoption failed after the read, so each sample was read a
    # second time (half the backend's rate) and left claimed; and the figures counted no read.
    host, feeders, production = run(policy)
    for epoch in (0, 1):
        production.install(
            "f", 0, ("ds", 0), epoch, processed_plan(ORDERS[epoch]), PrepSpec(b"", 1, 0, epoch, OUT), user_epoch=epoch
        )
        serve(production, feeders, "f", epoch, pool, host.files)
    assert host.source.reads.tolist() == [2] * N  # once per epoch: nothing raw is kept
    share = production._shares["ds", 0]
    assert not (share.residency.state == READING).any()
    figures = production.figures(("ds", 0))
    assert [(f.epoch, f.planned, f.written) for f in figures] == [(0, N, N), (1, N, N)]
    assert [(f.misses, f.backend_requests, f.backend_bytes) for f in figures] == [(N, N, N * SIZE)] * 2
    # what GetInfo's ProductionFigures says, and the analyzer reads the backend's rate from
    assert production.fetch_reads["ds"] == (2 * N, 2 * N * SIZE) and production.fetch_seconds["ds"] > 0
    wait(lambda: production.window.used == 0)


def test_a_feed_at_its_fair_share_still_gets_the_processed_positions_of_its_first_grant(run, pool):
    # Positions of the first batch were given back (their task found the window full) while
    # later ones were made: the feed holds its fair share, so only its first grant may be produced.
    # That path looked only for raw samples, so the batch waited until the grant timed out.
    _host, _feeders, production = run("minio", threads=1, window=4 * REGION)
    production.stop()  # (this test plays the producer)
    production.install("f", 0, ("ds", 0), 0, processed_plan(ORDERS[0]), PrepSpec(b"", 1, 0, 0, OUT))
    feed, share = production._feeds["f"], production._shares["ds", 0]
    plan = feed.plans[0]
    fair = production._fair(share, processed=True)  # (of the production window, where they are made)
    nbytes = 64 << 10
    with production._lock:
        made = np.arange(10, 10 - (-fair // nbytes))
        slots = [production.window.place(nbytes, "f") for _ in made]
        assert None not in slots
        plan.state[made] = READING
        production._settle_processed(share, feed, plan, made, plan.ids[made], slots, [OUT] * len(made))
        assert feed.made >= fair and (plan.state[:10] == ABSENT).all()
        work = production._next_work()
    assert work is not None and work.plan is plan and work.at is not None
    assert work.at.tolist() == list(range(10)) and (plan.state[:10] == READING).all()


def test_a_streamed_shares_processed_positions_take_their_fair_share_of_the_production_window(tmp_path, backend, pool):
    # Processed positions are made in the server's production window, not in a streamed share's
    # own window (which holds its raw samples). Measured against the own window's fair share, the
    # feeds of a streamed dataset were held to about one batch ahead each, and eight jobs apart
    # were served one first grant at a time while the production window stood two thirds empty.
    host = PolicyHost(tmp_path, backend, pool, "stream")  # its own window: one region
    production = Production(ProductionWindow(pool, 4 * REGION), host, Feeders().tell, depth=64, threads=1, prep=Prep())
    production.stop()  # (this test plays the producer)
    production.install("f", 0, ("ds", 0), 0, processed_plan(ORDERS[0]), PrepSpec(b"", 1, 0, 0, OUT))
    feed, share = production._feeds["f"], production._shares["ds", 0]
    plan = feed.plans[0]
    assert share.window is not None and share.window is not production.window
    nbytes = 32 << 10
    raw, made = production._fair(share), production._fair(share, processed=True)
    at = np.arange(raw // nbytes + 1)  # the first grant and more: beyond the own window's share
    assert len(at) * nbytes < made and len(at) < 64  # within the production window's, and the depth
    with production._lock:
        slots = [production.window.place(nbytes, "f") for _ in at]
        plan.state[at] = READING
        production._settle_processed(share, feed, plan, at, plan.ids[at], slots, [OUT] * len(at))
        assert (feed.made, feed.held) == (len(at) * nbytes, 0)
        work = production._next_work()
    assert work is not None and work.plan is plan and work.at is not None
    assert work.at[0] == len(at)  # the next positions, not only a first grant's


@pytest.mark.parametrize("policy", ["stream", "minio"])
def test_a_batch_larger_than_the_production_depth_is_made_whole(run, pool, policy):
    # Producers look ``depth`` positions past a feed's first unwritten one (64 here); the positions
    # of a larger first batch beyond that waited for good unless the feed held its whole share.
    host, feeders, production = run(policy, threads=1, window=4 * REGION)
    part = plan_of(ORDERS[0], np.full(N, OUT), 100)
    part.processed = np.ones(N, dtype=bool)
    production.install("f", 0, ("ds", 0), 0, part, PrepSpec(b"", 1, 0, 0, OUT))
    serve(production, feeders, "f", 0, pool, host.files)
    assert production._feeds["f"].plans[0].written.all()
