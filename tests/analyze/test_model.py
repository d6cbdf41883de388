"""The what-if model's arithmetic on synthetic rates (no cluster)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from kspeed.analyze.model import Measured, Setup, best_offload, predict, smallest_cluster, sweep
from kspeed.errors import ConfigError


def measured(**changes) -> Measured:
    base = Measured(
        step=400.0,
        memory_fetch=2000.0,
        backend_fetch=100.0,
        server_prep=200.0,
        client_prep=150.0,
        raw_bytes=50_000.0,
        out_bytes=75_000.0,
        servers=2,
        server_cores=2,
        client_cores=1,
    )
    return replace(base, **changes)


def setup(m: Measured, **changes) -> Setup:
    return replace(Setup.measured(m, offload=1.0, cache_fraction=1.0), **changes)


def test_each_term_is_its_rate_scaled_by_the_setup():
    m = measured()
    p = predict(m, setup(m, offload=0.5, cache_fraction=0.5))
    assert p.terms["step"] == 400.0
    assert p.terms["server_prep"] == pytest.approx(200.0 / 0.5)
    assert p.terms["client_prep"] == pytest.approx(150.0 / 0.5)
    # C was measured raw: 2000 samples/s of 50 kB is 100 MB/s; half the samples now carry 75 kB
    assert p.terms["memory"] == pytest.approx(100e6 / (0.5 * 75_000 + 0.5 * 50_000))
    # held in part, the servers' half of the samples is read each epoch: 1 - 0.5 * (1 - 0.5) missed
    assert p.terms["backend"] == pytest.approx(100.0 / 0.75)
    assert p.samples_per_s == pytest.approx(100.0 / 0.75) and p.bound == "backend"


def test_a_dataset_held_in_part_caches_only_what_the_client_preprocesses():
    m = measured(step=10_000.0, server_prep=1e6, client_prep=1e6)
    assert predict(m, setup(m, offload=0.0, cache_fraction=0.6)).terms["backend"] == pytest.approx(100.0 / 0.4)
    assert predict(m, setup(m, offload=1.0, cache_fraction=0.6)).terms["backend"] == pytest.approx(100.0)
    assert math.isinf(predict(m, setup(m, offload=1.0, cache_fraction=1.0)).terms["backend"])  # held whole
    raw = measured(server_prep=None, client_prep=None)
    assert predict(raw, setup(raw, offload=1.0, cache_fraction=0.6)).terms["backend"] == pytest.approx(100.0 / 0.4)


def test_servers_cores_and_ranks_scale_what_they_share():
    m = measured()
    p = predict(m, setup(m, servers=4, server_cores=4, ranks=2, cache_fraction=0.0))
    assert p.terms["server_prep"] == pytest.approx(200.0 * 2 * 2 / 2)  # twice the servers, twice the cores, two ranks
    assert p.terms["backend"] == pytest.approx(100.0 * 2 / 2)
    assert p.terms["memory"] == pytest.approx(100e6 / 75_000)  # a rank's rail is its own


def test_client_cores_scale_the_clients_part_only():
    m = measured()
    p = predict(m, setup(m, offload=0.0, client_cores=3))
    assert p.terms["client_prep"] == pytest.approx(450.0)
    assert math.isinf(p.terms["server_prep"])  # nothing offloaded
    assert p.terms["memory"] == pytest.approx(2000.0)  # raw bytes on the wire


def test_with_the_servers_read_rate_the_share_with_most_to_read_sets_the_pace():
    # 600 samples of 50 kB (30 MB); a server reads 3 MB/s from the backend
    m = measured(server_prep=None, client_prep=None, dataset_bytes=30_000_000, server_read_bytes_per_s=3e6)
    streamed = setup(m, cache_fraction=0.0, shares=((18e6, 0.0), (12e6, 0.0)))
    assert predict(m, streamed).terms["backend"] == pytest.approx(600 / (18e6 / 3e6))  # the larger share: 6 s
    balanced = setup(m, cache_fraction=0.0)
    assert predict(m, balanced).terms["backend"] == pytest.approx(600 / 5.0)  # two shares of 15 MB
    one = setup(m, servers=1, cache_fraction=0.0)
    assert predict(m, one).terms["backend"] == pytest.approx(600 / 10.0)
    cached = setup(m, cache_fraction=0.5, shares=((18e6, 6e6), (12e6, 9e6)))
    assert predict(m, cached).terms["backend"] == pytest.approx(600 / (12e6 / 3e6))  # 12 MB left to read on the first
    whole = setup(m, cache_fraction=1.0, shares=((18e6, 18e6), (12e6, 12e6)))
    assert math.isinf(predict(m, whole).terms["backend"])
    with_prep = replace(m, server_prep=1e6, client_prep=1e6)
    # a share held in part re-reads what the servers preprocess: at offload 1, everything
    assert predict(with_prep, replace(cached, offload=1.0)).terms["backend"] == pytest.approx(600 / 6.0)
    assert predict(with_prep, replace(whole, offload=1.0)).terms["backend"] == math.inf


def test_the_ranks_cpus_are_shared_by_its_step_its_workers_and_receiving():
    m = measured(step_cpu=1e-3, local_cpu=4e-3, remote_cpu=0.5e-3, client_cpus=2)
    p = predict(m, setup(m, offload=0.5))
    assert p.terms["client_cpu"] == pytest.approx(2 / (1e-3 + 0.5 * 4e-3 + 0.5 * 0.5e-3))
    assert predict(m, setup(m, offload=0.0)).terms["client_cpu"] == pytest.approx(2 / 5e-3)
    assert predict(m, setup(m, offload=0.0, client_cores=2)).terms["client_cpu"] == pytest.approx(4 / 5e-3)
    assert math.isinf(predict(measured(), setup(m)).terms["client_cpu"])  # not measured: no limit
    raw = measured(server_prep=None, client_prep=None, remote_cpu=1e-3, client_cpus=1)
    assert predict(raw, setup(raw, offload=0.3)).terms["client_cpu"] == pytest.approx(1000.0)  # receiving only


def test_a_step_faster_than_everything_leaves_stalls_that_add_up():
    m = measured(step=1000.0, backend_fetch=50.0)
    p = predict(m, setup(m, cache_fraction=0.0))
    assert p.bound == "backend" and p.samples_per_s == pytest.approx(50.0)
    prep = min(1000.0, 200.0)  # the servers preprocess everything
    assert p.prep_stall == pytest.approx((1 / prep - 1 / 1000.0) / (1 / 50.0))
    assert p.fetch_stall == pytest.approx((1 / 50.0 - 1 / prep) / (1 / 50.0))
    assert p.prep_stall + p.fetch_stall == pytest.approx(1 - 50.0 / 1000.0)


def test_nothing_stalls_a_slow_step():
    m = measured(step=50.0)
    p = predict(m, setup(m))
    assert p.bound == "step" and p.prep_stall == 0.0 and p.fetch_stall == 0.0


def test_without_a_pipeline_only_fetch_and_step_count():
    m = measured(server_prep=None, client_prep=None)
    p = predict(m, setup(m, offload=0.7, cache_fraction=0.0))
    assert math.isinf(p.terms["server_prep"]) and math.isinf(p.terms["client_prep"])
    assert p.terms["memory"] == pytest.approx(2000.0)  # raw, whatever the offload says
    assert p.samples_per_s == pytest.approx(100.0) and p.bound == "backend"


def test_the_best_offload_balances_the_two_sides():
    m = measured(step=10_000.0, memory_fetch=1e6, backend_fetch=1e6)
    r = best_offload(m, setup(m))
    # the two sides are equal at P_s/(P_s + P_c) = 4/7; the grid's nearest ratio on the better side
    assert abs(r - 200 / 350) <= 0.05
    assert predict(m, setup(m, offload=r)).samples_per_s > predict(m, setup(m, offload=1.0)).samples_per_s


def test_the_smallest_cluster_is_the_first_that_clears_the_step():
    m = measured(step=300.0, client_prep=None, memory_fetch=1e5)  # the servers alone preprocess, 100/s each
    answer = smallest_cluster(m, setup(m))
    assert answer["removes_stall"] and answer["servers"] == 3  # 300/s clears 97% of the step's 300
    assert answer["samples_per_s"] == pytest.approx(300.0)
    assert answer["line"].startswith("3 server(s) of 2 worker(s) each remove the stall")


def test_memory_per_server_makes_more_servers_cache_more():
    m = measured(step=300.0, memory_fetch=1e5, server_memory=100, dataset_bytes=400)
    assert (m.cache_fraction(1), m.cache_fraction(2), m.cache_fraction(4), m.cache_fraction(9)) == (0.25, 0.5, 1.0, 1.0)
    curve = sweep(m, setup(m, offload=0.0, cache_fraction=0.5), "servers", [1, 2, 4])  # raw copies cached
    assert [p["cache_fraction"] for p in curve] == [0.25, 0.5, 1.0]
    assert curve[0]["terms"]["backend"] == pytest.approx(100.0 * 0.5 / 0.75)  # half the readers, 3/4 missed
    assert curve[1]["terms"]["backend"] == pytest.approx(100.0 / 0.5)
    assert curve[2]["terms"]["backend"] is None  # all in memory: no limit
    assert [p["bound"] for p in curve] == ["backend", "client_prep", "client_prep"]
    # the servers alone preprocess: only a dataset held whole escapes the backend
    servers_only = replace(m, client_prep=None)
    answer = smallest_cluster(servers_only, setup(servers_only, cache_fraction=0.5))
    assert answer["servers"] == 4 and answer["cache_fraction"] == 1.0 and answer["offload"] == 1.0


def test_a_bound_no_server_count_lifts_is_named():
    m = measured(step=1000.0, client_prep=None, memory_fetch=300.0)
    answer = smallest_cluster(m, setup(m))
    assert not answer["removes_stall"] and answer["servers"] is None
    assert "memory" in answer["line"] and "faster rail" in answer["line"]


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"step": 0.0}, "step"),
        ({"backend_fetch": -1.0}, "backend_fetch"),
        ({"memory_fetch": math.nan}, "memory_fetch"),
        ({"server_prep": 0.0}, "server_prep"),
        ({"servers": 0}, "servers"),
    ],
)
def test_bad_measurements_are_refused_by_name(changes, field):
    with pytest.raises(ConfigError, match=field):
        measured(**changes)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"offload": 1.5}, "offload"),
        ({"cache_fraction": -0.1}, "cache_fraction"),
        ({"ranks": 0}, "ranks"),
        ({"rail_bytes_per_s": 0.0}, "rail_bytes_per_s"),
    ],
)
def test_bad_setups_are_refused_by_name(changes, field):
    m = measured()
    with pytest.raises(ConfigError, match=field):
        setup(m, **changes)
