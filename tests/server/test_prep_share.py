"""The preprocessing workers' admission: the active-worker limit from measured throughput (Lobster)
and weighted fair shares between jobs, with a synthetic clock."""

from __future__ import annotations

import threading

from kspeed.server.prep.share import REMEASURE_S, WINDOW_S, FairShare, PrepScheduler, WorkerSizer


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_window(sizer: WorkerSizer, clock: Clock, rate_of) -> int | None:
    """One saturated window at the sizer's limit, running ``rate_of(limit)`` samples/s."""
    clock.now += WINDOW_S
    sizer.note(int(rate_of(sizer.limit) * WINDOW_S))
    sizer.saturated_for(WINDOW_S)
    return sizer.step()


def test_the_limit_settles_on_the_fewest_workers_that_reach_the_peak():
    clock = Clock()
    sizer = WorkerSizer(6, clock)
    peak = {1: 100, 2: 190, 3: 270, 4: 300, 5: 302, 6: 290}  # flattens at 4, worse at 6
    for _ in range(12):
        run_window(sizer, clock, peak.__getitem__)
    assert sizer.limit == 4
    changes = sizer.changes
    for _ in range(6):  # settled: no more changes until the table is measured again
        run_window(sizer, clock, peak.__getitem__)
    assert sizer.changes == changes


def test_the_limit_grows_again_when_what_runs_changes():
    clock = Clock()
    sizer = WorkerSizer(4, clock)
    for _ in range(8):
        run_window(sizer, clock, lambda k: 200 if k >= 2 else 100)
    assert sizer.limit == 2
    clock.now += REMEASURE_S  # later, a pipeline that scales to every worker
    for _ in range(10):
        run_window(sizer, clock, lambda k: 100 * k)
    assert sizer.limit == 4


def test_no_change_from_a_window_that_was_not_saturated():
    clock = Clock()
    sizer = WorkerSizer(4, clock)
    clock.now += WINDOW_S
    sizer.note(1000)
    sizer.saturated_for(WINDOW_S / 2)  # tasks waited half the time: the workers were not the bottleneck
    assert sizer.step() is None and sizer.limit == 4 and not sizer.table


def test_fair_share_follows_the_weights_and_gives_no_credit_for_idle_time():
    share = FairShare({"big": 2.0})
    share.arrive("big")
    share.arrive("small")
    counts = {"big": 0, "small": 0}
    for _ in range(300):
        job = share.next()
        assert job is not None
        counts[job] += 1
        share.served(job, 1.0)  # each task a second of one worker
    assert abs(counts["big"] / counts["small"] - 2.0) < 0.1
    share.leave("small")
    for _ in range(100):
        share.served("big", 1.0)  # alone for a while
    share.arrive("newcomer")  # starts level with the busy job, not 200 seconds ahead of it
    picks = []
    for _ in range(30):
        job = share.next()
        picks.append(job)
        share.served(job, 1.0)
    assert 5 <= picks.count("newcomer") <= 15


def test_the_scheduler_admits_at_most_the_limit_and_reports_each_jobs_share():
    clock = Clock()
    scheduler = PrepScheduler(2, {"a": 1.0, "b": 1.0}, clock)
    assert scheduler.acquire("a") and scheduler.acquire("b")
    assert scheduler.busy == 2
    assert scheduler.acquire("a", timeout=0.0) is False  # both workers busy
    got = threading.Event()

    def third() -> None:
        scheduler.acquire("b")
        got.set()

    thread = threading.Thread(target=third)
    thread.start()
    assert not got.wait(0.1)
    clock.now += 3.0
    scheduler.release("a", 3.0, 10)
    assert got.wait(5.0)
    thread.join()
    scheduler.release("b", 1.0, 4)
    scheduler.release("b", 2.0, 4)
    limit, shares, weights = scheduler.figures()
    assert limit == 2
    assert shares == {"a": 0.5, "b": 0.5} and weights == {"a": 1.0, "b": 1.0}
    # each job's samples, for a client telling its own use of the workers from the others'
    assert (scheduler.samples_of("a"), scheduler.samples_of("b"), scheduler.samples_of("c")) == (10, 8, 0)


def test_the_samples_of_only_the_last_jobs_served_are_kept(monkeypatch):
    monkeypatch.setattr("kspeed.server.prep.share.MAX_JOBS", 3)
    scheduler = PrepScheduler(1, None, Clock())
    for job in ("a", "b", "c", "a", "d"):  # "b" was served longest ago when "d" came
        assert scheduler.acquire(job)
        scheduler.release(job, 0.1, 5)
    assert [scheduler.samples_of(job) for job in "abcd"] == [10, 0, 5, 5]
