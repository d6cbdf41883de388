"""Per-rank job statistics kept by the manager (no daemon)."""

from __future__ import annotations

import pytest

from kspeed.errors import NotFoundError, ProtocolError
from kspeed.manager.jobs import JobBoard
from kspeed.proto import kspeed_pb2


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def report(rank, wait, samples=1000, elapsed=10.0, job="train", world=4):
    return kspeed_pb2.RankStats(
        job=job,
        rank=rank,
        world_size=world,
        dataset="imgs",
        samples=samples,
        elapsed_s=elapsed,
        wait_mean_ms=wait,
        wait_p99_ms=wait * 3,
        server_bytes={"srv-a": 10, "srv-b": 30},
    )


def test_spread_across_ranks_names_the_straggler():
    board = JobBoard(wall=Clock())
    for rank, wait in enumerate((1.0, 2.0, 3.0, 40.0)):
        board.report(report(rank, wait, samples=1000 - 200 * (rank == 3)))
    job = board.job("train")
    assert [r.rank for r in job.ranks] == [0, 1, 2, 3]
    assert job.wait_mean_ms.min == 1.0 and job.wait_mean_ms.max == 40.0
    assert job.wait_mean_ms.p50 == pytest.approx(2.5)
    assert job.wait_p99_ms.max == 120.0
    assert job.samples_per_s.min == 80.0 and job.samples_per_s.max == 100.0
    assert dict(job.ranks[0].server_bytes) == {"srv-a": 10, "srv-b": 30}
    assert board.jobs() == ["train"]


def test_latest_report_wins_and_silent_ranks_expire():
    clock = Clock()
    board = JobBoard(wall=clock, ttl=30)
    board.report(report(0, 5.0))
    board.report(report(0, 7.0))
    assert [r.wait_mean_ms for r in board.job("train").ranks] == [7.0]
    clock.now += 31
    board.report(report(1, 1.0, job="other"))
    with pytest.raises(NotFoundError, match="other"):
        board.job("train")


def test_expiry_keeps_every_fresh_report():
    # Reports are kept in the order they arrived and expiry stops at the first fresh one (it no
    # longer scans every report on every report): a rank that reported early and again late must
    # survive the expiry of the ones that arrived in between.
    clock = Clock()
    board = JobBoard(wall=clock, ttl=30)
    for rank in range(4):  # at 1000, 1005, 1010, 1015
        board.report(report(rank, 1.0))
        clock.now += 5
    board.report(report(0, 2.0))  # rank 0 again at 1020, now the freshest
    clock.now += 21  # 1041: ranks 1 and 2 are older than 30 s; rank 3 and rank 0 are not
    board.report(report(1, 3.0, job="other"))
    assert [(r.rank, r.wait_mean_ms) for r in board.job("train").ranks] == [(0, 2.0), (3, 1.0)]
    clock.now += 5  # 1046: rank 3 (1015) expires, rank 0 (1020) and the other job (1041) stay
    assert board.jobs() == ["other", "train"] and [r.rank for r in board.job("train").ranks] == [0]


@pytest.mark.parametrize(
    "bad",
    [
        report(0, 1.0, job=""),
        report(0, 1.0, job="a b"),
        report(4, 1.0, world=4),
        kspeed_pb2.RankStats(job="j", rank=0, world_size=1, dataset="x" * 300),
        kspeed_pb2.RankStats(job="j", rank=0, world_size=1, wait_mean_ms=float("nan")),
        kspeed_pb2.RankStats(job="j", rank=0, world_size=1, elapsed_s=float("inf")),
        kspeed_pb2.RankStats(job="j", rank=0, world_size=1, wait_total_s=-1.0),
        kspeed_pb2.RankStats(job="j", rank=0, world_size=1, dataset="imgs\nFAKE log line"),
        kspeed_pb2.RankStats(job="j", rank=0, world_size=1, host="node\x1b[2J"),
        kspeed_pb2.RankStats(job="j", rank=0, world_size=1, server_bytes={"srv a\n": 1}),
    ],
)
def test_malformed_reports_are_refused(bad):
    board = JobBoard(wall=Clock())
    with pytest.raises(ProtocolError):
        board.report(bad)
    assert board.jobs() == []


def blocked(rows, step=10.0, **kw):
    stats = report(**kw)
    stats.step_s = step
    stats.blocked.extend(kspeed_pb2.BlockedSeconds(cause=c, server=s, stage=st, seconds=v) for c, s, st, v in rows)
    return stats


def test_waits_by_cause_sum_per_job_and_feed_the_metrics():
    board = JobBoard(wall=Clock())
    board.report(blocked([("prep", "srv-a", "0:decode", 3.0), ("link", "srv-b", "", 1.0)], rank=0, wait=1.0))
    board.report(blocked([("prep", "srv-a", "1:resize", 2.0), ("client", "", "", 0.5)], rank=1, wait=1.0))
    job = board.job("train")
    assert {(b.cause, b.server): b.seconds for b in job.blocked} == {
        ("prep", "srv-a"): 5.0,
        ("link", "srv-b"): 1.0,
        ("client", ""): 0.5,
    }
    assert board.blocked()[("train", "prep", "srv-a")] == 5.0
    assert board.steps() == {"train": 20.0}
    assert not job.history  # only when asked for


def test_history_is_kept_per_rank_and_bounded():
    from kspeed.manager.jobs import HISTORY

    clock = Clock()
    board = JobBoard(wall=clock)
    for n in range(HISTORY + 10):
        clock.now += 1
        board.report(blocked([("prep", "srv-a", "0:decode", float(n)), ("fetch", "srv-a", "", 1.0)], rank=0, wait=1.0))
    (history,) = board.job("train", history=True).history
    assert history.rank == 0 and len(history.samples) == HISTORY
    first, last = history.samples[0], history.samples[-1]
    assert last.report_unix - first.report_unix == HISTORY - 1  # the oldest went, in order
    assert {b.cause: b.seconds for b in last.blocked} == {"prep": HISTORY + 9.0, "fetch": 1.0}
    assert last.step_s == 10.0


@pytest.mark.parametrize(
    ("rows", "why"),
    [
        ([("sleeping", "", "", 1.0)], "unknown cause"),
        ([("prep", "srv a\n", "", 1.0)], "server id"),
        ([("prep", "srv-a", "x" * 65, 1.0)], "stage"),
        ([("prep", "srv-a", "0:de\x1bcode", 1.0)], "stage"),
        ([("link", "srv-a", "", float("nan"))], "finite"),
        ([("link", "srv-a", "", -1.0)], "finite"),
        ([("client", "", "", 0.1)] * 1025, "blocked rows"),
    ],
)
def test_malformed_causes_are_refused_with_a_clear_error(rows, why):
    board = JobBoard(wall=Clock())
    with pytest.raises(ProtocolError, match=why):
        board.report(blocked(rows, rank=0, wait=1.0))
    with pytest.raises(ProtocolError, match="step_s"):
        board.report(blocked([], step=float("inf"), rank=0, wait=1.0))
    assert board.jobs() == []
