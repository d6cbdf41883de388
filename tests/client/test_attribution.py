"""The arithmetic of a rank's wait by cause, on synthetic completion timelines (no daemon)."""

from __future__ import annotations

import time

import pytest

from kspeed.client.attribution import Attribution, ProductionSplit, shapley_split
from kspeed.proto import kspeed_pb2


def test_one_slow_path_gets_nearly_all_the_wait():
    # both owed from 0; the fast one done at 0.01, the slow one at 1.0
    fast, slow = shapley_split(0.0, 1.0, [0.01, 1.0])
    assert fast == pytest.approx(0.005) and slow == pytest.approx(0.995)
    assert fast + slow == pytest.approx(1.0)


def test_equal_paths_split_evenly_and_finished_paths_get_nothing():
    assert shapley_split(0.0, 0.3, [0.3, 0.3, 0.3]) == pytest.approx([0.1, 0.1, 0.1])
    # a path done before the wait began (its completion came while the loop trained) owes nothing
    assert shapley_split(5.0, 6.0, [4.0, 6.0]) == pytest.approx([0.0, 1.0])
    assert shapley_split(1.0, 1.0, [1.0]) == [0.0]
    assert shapley_split(0.0, 1.0, []) == []


def test_three_paths_airport_shares():
    # intervals: [0,1] by 3, [1,2] by 2, [2,4] by 1
    a, b, c = shapley_split(0.0, 4.0, [1.0, 2.0, 4.0])
    assert a == pytest.approx(1 / 3) and b == pytest.approx(1 / 3 + 1 / 2) and c == pytest.approx(1 / 3 + 1 / 2 + 2)


def rows(attribution: Attribution, held=(0.0, 0.0), latency=(1.0, 1.0)) -> dict:
    return {k: v for k, v in attribution.snapshot(list(held), list(latency)).items() if v}


def run_batch(attribution: Attribution, *args, **kwargs) -> None:
    attribution.enter()
    attribution.batch(*args, **kwargs)
    attribution.leave(8)


def test_pacing_then_the_slow_server_and_the_client_rest():
    a = Attribution(["srv-a", "srv-b"])
    # asked at 0; the batch's grant went at 0.2 (the ring was full); srv-a done at 0.3, srv-b at 1.2
    run_batch(a, 0.0, 0.25, 0.2, {0: 0.3, 1: 1.2}, 1.2)
    got = rows(a, held=(0.0, 0.0), latency=(0.3, 1.0))
    assert got[("pacing", "", "")] == pytest.approx(0.2)
    assert got[("link", "srv-a", "")] == pytest.approx(0.025)  # [0.25, 0.3] shared by two
    assert got[("link", "srv-b", "")] == pytest.approx(0.925)
    assert set(got) <= {("pacing", "", ""), ("link", "srv-a", ""), ("link", "srv-b", ""), ("client", "", "")}


def test_failover_names_the_lost_server_and_the_rest_is_split_after_recovery():
    a = Attribution(["srv-a", "srv-b"])
    run_batch(a, 0.0, 2.1, 0.0, {0: 2.2, 1: 2.2}, 2.2, recovered=(2.0, "srv-b"))
    got = rows(a)
    assert got[("failover", "srv-b", "")] == pytest.approx(2.0)
    assert got[("link", "srv-a", "")] == pytest.approx(0.05)
    assert got[("link", "srv-b", "")] == pytest.approx(0.05)
    assert ("pacing", "", "") not in got


def test_production_and_link_split_by_held_over_latency_and_clamped():
    a = Attribution(["srv-a", "srv-b"])
    run_batch(a, 0.0, 0.0, 0.0, {0: 1.0, 1: 1.0}, 1.0)
    # srv-a: grants held 0.3 of 1.2 s of latency; srv-b: held more than the latency (clocks): all production
    got = rows(a, held=(0.3, 5.0), latency=(1.2, 2.0))
    assert got[("production", "srv-a", "")] == pytest.approx(0.5 * 0.25)
    assert got[("link", "srv-a", "")] == pytest.approx(0.5 * 0.75)
    assert got[("production", "srv-b", "")] == pytest.approx(0.5)
    assert ("link", "srv-b", "") not in got


def test_a_path_without_timed_completions_stays_server():
    a = Attribution(["srv-a"])
    run_batch(a, 0.0, 0.0, 0.0, {0: 1.0}, 1.0)
    assert rows(a, held=(0.0,), latency=(0.0,)) == {("server", "srv-a", ""): pytest.approx(1.0)}


def test_production_split_into_fetch_and_stages_from_server_figures():
    a = Attribution(["srv-a", "srv-old"])
    figures = {
        "srv-a": [
            kspeed_pb2.ProductionFigures(fetch_seconds=1.0, stage_seconds={"0:decode": 4.0}),
            kspeed_pb2.ProductionFigures(fetch_seconds=2.0, stage_seconds={"0:decode": 10.0, "1:resize": 3.0}),
        ]
    }

    def read(server: str):
        return figures[server].pop(0) if server in figures else None  # srv-old predates the figures

    a.refresh(read)
    a.refresh(read)  # the split comes from the interval between the readings: 1 fetch, 6 decode, 3 resize
    run_batch(a, 0.0, 0.0, 0.0, {0: 2.0, 1: 2.0}, 2.0)
    got = rows(a, held=(1.0, 1.0), latency=(1.0, 1.0))
    assert got[("fetch", "srv-a", "")] == pytest.approx(0.1)
    assert got[("prep", "srv-a", "0:decode")] == pytest.approx(0.6)
    assert got[("prep", "srv-a", "1:resize")] == pytest.approx(0.3)
    assert got[("production", "srv-old", "")] == pytest.approx(1.0)  # an old server: unsplit


def test_split_of_an_idle_interval_is_none():
    same = kspeed_pb2.ProductionFigures(fetch_seconds=1.0)
    assert ProductionSplit.between(same, same) is None
    split = ProductionSplit.between(None, same)
    assert split is not None and split.fetch == 1.0


def test_client_prep_and_client_are_the_rest_of_next():
    a = Attribution(["srv-a"])
    a.enter()
    time.sleep(0.06)  # of which 0.05 waiting for the workers
    a.client_prep(0.05)
    a.leave(8)
    got = rows(a)
    assert got[("client_prep", "", "")] == pytest.approx(0.05)
    total = sum(got.values())
    assert total == pytest.approx(a.blocked_s) and a.blocked_s >= 0.05


def test_nested_next_counts_once_and_the_step_is_between():
    a = Attribution(["srv-a"])
    a.enter()
    a.enter()  # a prepared dataset's inner next()
    a.leave(8)
    assert a.blocked_s == 0.0
    a.leave(8)
    outer = a.blocked_s
    assert outer > 0
    a.enter()
    a.leave(8)
    assert a.step_s > 0  # the time between the two next() calls


def test_seconds_already_folded_are_not_split_again():
    a = Attribution(["srv-a"])
    run_batch(a, 0.0, 0.0, 0.0, {0: 1.0}, 1.0)
    first = rows(a, held=(0.0,), latency=(1.0,))
    again = rows(a, held=(1.0,), latency=(2.0,))  # more latency, no new wait: nothing moves
    assert first[("link", "srv-a", "")] == again[("link", "srv-a", "")] == pytest.approx(1.0)


def test_figures_group_by_cause_and_server():
    a = Attribution(["srv-a"])
    run_batch(a, 0.0, 0.0, 0.0, {0: 1.0}, 1.0)
    figures = a.figures([0.5], [1.0])
    assert figures["causes"]["production"] == pytest.approx(0.5)
    assert figures["by_server"]["srv-a"] == pytest.approx({"production": 0.5, "link": 0.5})
    assert {r["cause"] for r in figures["rows"]} >= {"production", "link", "client"}
    assert figures["overhead_s"] >= 0
