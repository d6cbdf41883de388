"""The offload decision (FastFlow's Algorithm 1), its hysteresis and the meters, on synthetic rates."""

from __future__ import annotations

import math

import pytest

from kspeed.client.tuning.auto import AutoOffload
from kspeed.client.tuning.decision import Cut, Decision, Hysteresis, Rates, decide, predicted
from kspeed.client.tuning.meters import LoopMeter, PrepMeter, Reading, ServerMeter
from kspeed.errors import ConfigError
from kspeed.proto import kspeed_pb2

P = 0.004  # CPU seconds to preprocess a sample on the client


def rates(step: float, *, cores: float = 1.0, step_cpu: float | None = None, local: float = P, common: float = 0.0):
    return Rates(
        step_s=step, step_cpu=step if step_cpu is None else step_cpu, local_cpu=local, common_cpu=common, cores=cores
    )


def cut(remote: float, receive: float = 0.1 * P, nbytes: int = 150_528, stages: int = 4) -> Cut:
    return Cut(stages, nbytes, remote, receive, "after 3:PILToTensor")


def test_no_offload_when_the_loop_does_not_wait():
    # a GPU-bound step (little CPU) on 4 cores: preprocessing here keeps up with the loop
    r = rates(0.004, cores=4, step_cpu=0.0005)
    d = decide(r, [cut(1000.0)])
    assert d.ratio == 0.0 and d.cut is None
    assert "does not wait" in d.reason


def test_no_offload_when_the_gain_is_under_the_threshold():
    # local-only reaches 95% of the loop's rate: under FastFlow's 10% SpeedUpThreshold
    r = rates(0.01, cores=1, step_cpu=0.01 - 0.95 * 0.0, local=0.0005)
    assert r.gthp / r.lthp() < 1.1 and r.gthp > r.lthp()
    d = decide(r, [cut(1000.0)])
    assert d.ratio == 0.0 and "under 10%" in d.reason


def test_cpu_starved_step_offloads_everything_when_the_servers_keep_up():
    # one core; the step costs as much CPU as preprocessing; the servers run 1/P samples/s
    r = rates(P, cores=1)
    d = decide(r, [cut(1.0 / P)])
    assert d.inputs["lower"] < d.inputs["upper"]
    assert d.ratio == pytest.approx(1.0)
    # and the model agrees it is the best fixed split
    best = max((k / 20 for k in range(21)), key=lambda f: predicted(r, d.cut, f))
    assert predicted(r, d.cut, d.ratio) >= 0.95 * predicted(r, d.cut, best)


def test_spare_core_offloads_about_half():
    # two cores, a cheap step (half a sample's preprocessing), servers as fast as one client core
    r = rates(P / 2, cores=2)
    d = decide(r, [cut(1.0 / P)])
    assert d.inputs["lower"] < d.inputs["upper"]
    assert d.ratio == pytest.approx(0.5, abs=0.01)  # Upper / Gthp
    best = max((k / 20 for k in range(21)), key=lambda f: predicted(r, d.cut, f))
    assert 0.4 <= best <= 0.6
    assert predicted(r, d.cut, d.ratio) >= 0.95 * predicted(r, d.cut, best)


def test_upper_below_lower_balances_local_and_remote():
    # slow servers (a quarter of what the loop needs): neither side alone removes the stall
    r = rates(P, cores=1, step_cpu=0.0)  # a GPU-bound step: the core is free for preprocessing
    r = Rates(step_s=P / 4, step_cpu=0.0, local_cpu=P, common_cpu=0.0, cores=1.0)
    d = decide(r, [cut(0.25 / P * 1.0, receive=0.5 * P)])
    assert d.inputs["upper"] <= d.inputs["lower"]
    lthp, rthp = d.inputs["lthp"], d.inputs["rthp"]
    assert d.ratio == pytest.approx(rthp / (lthp + rthp))
    assert 0.0 < d.ratio < 1.0
    assert "balance" in d.reason


def test_a_float_cut_is_not_sent_when_a_uint8_cut_gives_the_same():
    r = rates(P, cores=1)
    uint8 = Cut(4, 150_528, 1.0 / P, 0.1 * P, "uint8")
    as_float = Cut(6, 4 * 150_528, 1.0 / P, 0.1 * P, "float")
    assert decide(r, [as_float, uint8]).cut == uint8


def test_a_narrow_rail_prefers_the_cut_that_sends_fewer_bytes():
    # 40 MB/s: the float cut's 600 KB samples would cap the servers' delivery at 66/s
    r = Rates(step_s=P, step_cpu=P, local_cpu=P, common_cpu=0.0, cores=1.0, rail_bytes_per_s=40e6)
    uint8 = Cut(4, 150_528, 1.0 / P, 0.15 * P, "uint8")
    as_float = Cut(6, 4 * 150_528, 1.0 / P, 0.05 * P, "float")
    d = decide(r, [as_float, uint8])
    assert d.cut == uint8
    assert r.remote_capacity(as_float) == pytest.approx(40e6 / (4 * 150_528))


def test_the_rail_limits_the_ratio():
    # the rail carries 100 samples/s at this cut while the loop wants 250/s
    r = Rates(step_s=P, step_cpu=P, local_cpu=P, common_cpu=0.0, cores=1.0, rail_bytes_per_s=100 * 150_528)
    d = decide(r, [cut(1e6)])
    assert d.inputs["upper"] == pytest.approx(100.0)
    assert d.ratio < 0.6


def test_decide_needs_a_cut():
    with pytest.raises(ConfigError, match="cut"):
        decide(rates(P), [])


def test_predicted_is_the_tightest_bound():
    r = rates(P, cores=1)
    c = cut(100.0)  # servers: 100/s
    assert predicted(r, c, 1.0) == pytest.approx(100.0)
    assert predicted(r, c, 0.5) == pytest.approx(min(1 / P, 200.0, 1 / (P + 0.5 * P + 0.05 * P)))
    assert predicted(r, None, 0.0) == pytest.approx(r.lthp())


# -- hysteresis ------------------------------------------------------------------------------------


def _decision(ratio: float, expected: float, c: Cut | None = None) -> Decision:
    return Decision(ratio, c if c is not None else cut(1.0 / P), f"{ratio}", expected)


def test_hysteresis_ignores_small_steps_and_needs_a_settled_answer():
    r = rates(P, cores=1)
    h = Hysteresis(min_step=0.1, min_gain=0.03, settle=2, dwell=3.0)
    assert h.offer(_decision(1.0, 250.0), r, 0.0) is not None  # the first decision is adopted
    assert h.offer(_decision(0.95, 400.0), r, 10.0) is None  # a step under min_step: noise
    assert h.offer(_decision(0.5, 400.0), r, 11.0) is None  # new: seen once
    adopted = h.offer(_decision(0.52, 400.0), r, 12.0)  # the same answer again: adopted
    assert adopted is not None and adopted.ratio == 0.52
    assert h.changes == 2


def test_hysteresis_waits_out_the_dwell_after_a_change():
    r = rates(P, cores=1)
    h = Hysteresis(settle=1, dwell=3.0)
    h.offer(_decision(1.0, 250.0), r, 0.0)
    assert h.offer(_decision(0.3, 1000.0), r, 1.0) is None  # within the dwell
    assert h.offer(_decision(0.3, 1000.0), r, 3.5) is not None


def test_hysteresis_needs_a_predicted_gain():
    r = rates(P, cores=1)
    h = Hysteresis(settle=1, dwell=0.0, min_gain=0.03)
    h.offer(_decision(1.0, 0.0), r, 0.0)
    now = predicted(r, cut(1.0 / P), 1.0)
    assert h.offer(_decision(0.5, now * 1.01), r, 1.0) is None  # 1% better: not worth a change
    assert h.offer(_decision(0.5, now * 1.2), r, 2.0) is not None


def test_noisy_rates_do_not_make_the_ratio_oscillate():
    # the same conditions measured with +-10% noise, decided every second for a minute
    import random

    rng = random.Random(7)
    h = Hysteresis()
    h.keep(Decision(1.0, cut(1.0 / P), "start", 0.0))
    for second in range(60):
        noise = 1.0 + rng.uniform(-0.1, 0.1)
        r = Rates(step_s=P / 2 * noise, step_cpu=P / 2 * noise, local_cpu=P, common_cpu=0.0, cores=2.0)
        h.offer(decide(r, [cut(1.0 / P * (2 - noise))]), r, float(second))
    assert h.changes <= 2  # one move to about half, at most one correction


# -- meters ----------------------------------------------------------------------------------------


def test_loop_meter_takes_the_step_net_of_the_run_queue_wait(monkeypatch):
    meter = LoopMeter()
    clock = iter(
        [
            (0.0, 0.0, 0.0),  # asked (first: no step)
            (0.01, 0.0, 0.0),  # handed 10 samples
            (0.05, 0.03, 0.01),  # asked: a 40 ms step, 30 ms CPU, 10 ms waiting for a core
            (0.06, 0.035, 0.01),  # handed 10 samples: 10 ms in next(), 5 ms of it CPU
        ]
    )
    monkeypatch.setattr(LoopMeter, "_now", staticmethod(lambda: next(clock)))
    meter.asked()
    meter.handed(10)
    meter.asked()
    meter.handed(10)
    figures = meter.figures()
    assert figures is not None
    assert figures["step_s"] == pytest.approx(0.003)  # (40 - 10) ms over 10 samples
    assert figures["step_cpu"] == pytest.approx(0.003)
    assert figures["wait_s"] == pytest.approx(0.001)
    assert figures["next_cpu"] == pytest.approx(0.0005)


def test_prep_meter_splits_offloadable_receive_and_common_costs():
    meter = PrepMeter(server_stages=3)
    # a batch of 4 local and 4 remote samples that ran at half speed (CPU = wall / 2)
    seconds = {
        "0:decode_image": 0.016,
        "1:RandomResizedCrop": 0.008,
        "2:PILToTensor": 0.008,
        "receive": 0.004,
        "collate": 0.008,
    }
    meter.record(seconds, cpu_s=0.022, wall_s=0.044, local=4, remote=4)
    assert meter.local_cpu == pytest.approx(0.032 / 2 / 4)
    assert meter.receive_cpu == pytest.approx(0.004 / 2 / 4)
    assert meter.common_cpu == pytest.approx(0.008 / 2 / 8)
    # batches with no local sample keep the last Pcycle
    meter.record({"receive": 0.004, "collate": 0.004}, cpu_s=0.008, wall_s=0.008, local=0, remote=8)
    assert meter.local_cpu == pytest.approx(0.004)


def test_server_meter_measures_capacity_and_what_others_use():
    meter = ServerMeter()
    meter.read("a", Reading(2, 10.0, 1000), now=0.0)
    meter.read("b", Reading(1, 5.0, 500), now=0.0)
    assert meter.left_for(0.0, 2) == math.inf  # one reading each: nothing measured yet
    meter.read("a", Reading(2, 12.0, 1400), now=1.0)  # 400 samples in 2 busy seconds: 200/s per worker
    meter.read("b", Reading(1, 5.5, 600), now=1.0)  # 100 samples in 0.5 s: 200/s
    # capacity 2 * 200 + 1 * 200 = 600/s; they ran 500/s, 300 of them for this job
    assert meter.left_for(300.0, 2) == pytest.approx(600 - (500 - 300))
    meter.forget("b")
    # b's share moved to a server not measured yet: it counts as the average of a and the lost b
    assert meter.left_for(300.0, 2) == pytest.approx(400 + 300 - (400 - 300))
    assert meter.left_for(300.0, 1) == pytest.approx(400 - (400 - 300))
    meter.forget("a")
    assert meter.left_for(0.0, 1) == pytest.approx(300)  # none measured now: like those that left
    assert ServerMeter().left_for(0.0, 2) == math.inf  # none ever measured


def test_servers_sharing_their_cpus_count_them_once_at_a_samples_whole_cost():
    meter = ServerMeter()
    # two servers on the same one CPU; each worker busy half the time at 4 ms a sample by its busy
    # time (250/s per worker, 500/s together), but every sample costs their CPU 5 ms in all
    # (workers, production, feeding): that CPU runs at most 200/s for both
    for server_id in ("a", "b"):
        meter.read(server_id, Reading(1, 0.0, 0, 1.0, 1, "boot/0"), now=0.0)
        meter.read(server_id, Reading(1, 0.4, 100, 1.5, 1, "boot/0"), now=1.0)
    assert meter.capacities() == pytest.approx({"a": 100.0, "b": 100.0})
    assert meter.left_for(200.0, 2) == pytest.approx(200.0)
    # the same servers on CPUs of their own: each one's CPU caps only it
    meter = ServerMeter()
    for server_id, group in (("a", "boot/0"), ("b", "boot/1")):
        meter.read(server_id, Reading(1, 0.0, 0, 1.0, 1, group), now=0.0)
        meter.read(server_id, Reading(1, 0.4, 100, 1.5, 1, group), now=1.0)
    assert meter.capacities() == pytest.approx({"a": 200.0, "b": 200.0})
    # servers that report no CPU: their workers' busy time alone
    meter = ServerMeter()
    meter.read("a", Reading(1, 0.0, 0), now=0.0)
    meter.read("a", Reading(1, 0.4, 100), now=1.0)
    assert meter.capacities() == pytest.approx({"a": 250.0})


def test_what_the_other_jobs_run_is_what_each_server_counts_for_them():
    meter = ServerMeter()
    # a server ran 300 samples/s, 250 of them for this job (it produces ahead of what the job
    # received meanwhile, 150/s): the others ran 50/s, not 300 - 150
    meter.read("a", Reading(1, 0.0, 0, job_samples=0), now=0.0)
    meter.read("a", Reading(1, 0.75, 300, job_samples=250), now=1.0)
    assert meter.left_for(150.0, 1) == pytest.approx(400 - 50)
    # a server that does not count per job: what it ran less what this job received
    meter = ServerMeter()
    meter.read("a", Reading(1, 0.0, 0), now=0.0)
    meter.read("a", Reading(1, 0.75, 300), now=1.0)
    assert meter.left_for(150.0, 1) == pytest.approx(400 - 150)


# -- the whole tuner, with servers that report counters ---------------------------------------------


class _Link:
    def __init__(self, server_id: str) -> None:
        self.server_id = server_id
        self.name = f"server {server_id}"
        self.busy = 0.0
        self.cpu = 0.0
        self.samples = 0

    def prep_figures(self, job: str = "") -> kspeed_pb2.PrepFigures:
        return kspeed_pb2.PrepFigures(workers=1, busy_seconds=self.busy, samples=self.samples, cpu_seconds=self.cpu)


def test_the_tuner_decides_from_what_it_measures_and_applies_a_change(monkeypatch):
    links = [_Link("a"), _Link("b")]
    now = [0.0]
    applied: list[float] = []
    tuner = AutoOffload(
        dataset="d",
        links=lambda: links,
        server_stages=3,
        nbytes=150_528,
        label="after 2:PILToTensor",
        apply=applied.append,
        ratio=1.0,
        cores=2,
        clock=lambda: now[0],
        hysteresis=Hysteresis(settle=1, dwell=0.0),
    )
    try:
        tuner._stop.set()  # the servers are read by the test, not the thread
        # the loop: 2 ms of CPU per sample; the client measured 4 ms per local sample, 0.2 ms per received one
        steps = iter([(0.0, 0.0, 0.0), (0.0, 0.0, 0.0)] + [(k * 0.1, k * 0.064, 0.0) for k in range(1, 400)])
        monkeypatch.setattr(LoopMeter, "_now", staticmethod(lambda: next(steps)))
        tuner.batch_done({"0:decode_image": 0.016, "receive": 0.0008}, 0.0168, 0.0168, local=4, remote=4)
        tuner.batch_done({"receive": 0.0396}, 0.0396, 0.0396, local=0, remote=396)  # 200/s over 2 s
        for link in links:  # each server: 100 samples per busy second on its one worker
            tuner.servers.read(link.server_id, Reading(1, 0.0, 0), 0.0)
            tuner.servers.read(link.server_id, Reading(1, 1.0, 100), 1.0)
        tuner.loop.asked()
        for _ in range(3):
            tuner.loop.handed(32)
            tuner.loop.asked()
        now[0] = 2.0
        decision = tuner.tick()
        assert decision is not None and 0.0 < decision.ratio < 1.0
        assert applied == [decision.ratio]
        assert tuner.stats()["ratio"] == decision.ratio and tuner.stats()["mode"] == "auto"
        assert tuner.stats()["changes"] == 1
        # one server is lost: half the capacity, the decision moves
        tuner.servers.forget("b")
        links.pop()
        now[0] = 4.0
        tuner.servers.read("a", Reading(1, 2.0, 200), 2.0)
        again = tuner.tick()
        assert again is not None and again.ratio < decision.ratio
    finally:
        tuner.close()


def _quiet_tuner(now: list[float], **given) -> AutoOffload:
    """A tuner on the clock ``now[0]`` whose servers are read by the test, not by its thread."""
    options = dict(
        dataset="d", links=lambda: [], server_stages=3, nbytes=1, label="x", apply=lambda r: None, ratio=1.0, cores=1
    )
    tuner = AutoOffload(**{**options, **given}, clock=lambda: now[0])
    tuner._stop.set()
    return tuner


def test_before_a_sample_ran_here_its_cost_is_the_servers_cpu_per_sample(monkeypatch):
    links = [_Link("a"), _Link("b")]
    now = [0.0]
    tuner = _quiet_tuner(now, links=lambda: links, nbytes=150_528)
    try:
        steps = iter([(0.0, 0.0, 0.0), (0.0, 0.0, 0.0)] + [(k * 0.1, k * 0.05, 0.0) for k in range(1, 50)])
        monkeypatch.setattr(LoopMeter, "_now", staticmethod(lambda: next(steps)))
        tuner.loop.asked()
        for _ in range(3):
            tuner.loop.handed(32)
            tuner.loop.asked()
        assert tuner.rates(now[0]) is None  # no cost known for a sample run here yet
        # busy 3 s for 200 samples (the workers shared their core), of which 1 s of CPU
        for link in links:
            link.busy, link.cpu, link.samples = 1.5, 0.5, 100
        tuner.read_servers()
        rates = tuner.rates(now[0])
        assert rates is not None and rates.local_cpu == pytest.approx(0.005)
        for link in links:  # servers that do not report CPU: their busy seconds
            link.cpu = 0.0
        tuner.read_servers()
        assert tuner.rates(now[0]).local_cpu == pytest.approx(0.015)
        # a sample run here replaces the prior
        tuner.batch_done({"0:decode_image": 0.008}, 0.008, 0.008, local=4, remote=0)
        assert tuner.rates(now[0]).local_cpu == pytest.approx(0.002)
    finally:
        tuner.close()


def test_reading_the_tuners_figures_moves_none_of_them():
    now = [0.0]
    tuner = _quiet_tuner(now)
    try:
        tuner.batch_done({"receive": 0.01}, 0.01, 0.01, local=0, remote=100)
        now[0] = 5.0
        for _ in range(3):
            tuner.stats()
        tuner.batch_done({"receive": 0.01}, 0.01, 0.01, local=0, remote=100)
        now[0] = 6.0
        tuner.rates(now[0])  # a decision's read: this job's rate at the servers over the whole span
        assert tuner._remote_rate == pytest.approx(200 / 6.0)
    finally:
        tuner.close()


def test_this_jobs_rate_at_the_servers_is_taken_over_seconds_not_over_a_burst():
    now = [0.0]
    tuner = _quiet_tuner(now)
    try:
        for k in range(1, 9):  # a decision's read every half second; 400 samples arrive at once at 4 s
            now[0] = 0.5 * k
            if k == 8:
                tuner.batch_done({"receive": 0.01}, 0.01, 0.01, local=0, remote=400)
            tuner.rates(now[0])
        assert tuner._remote_rate == pytest.approx(400 / 4.0)  # not 400 / 0.5
    finally:
        tuner.close()


# -- the model signature a decision is kept under ---------------------------------------------------


def test_a_models_signature_is_its_structure_not_its_weights():
    from kspeed.client.tuning.store import model_signature

    torch_nn = pytest.importorskip("torch.nn")
    a = torch_nn.Sequential(torch_nn.Linear(4, 8), torch_nn.ReLU(), torch_nn.Linear(8, 2))
    b = torch_nn.Sequential(torch_nn.Linear(4, 8), torch_nn.ReLU(), torch_nn.Linear(8, 2))  # other weights
    c = torch_nn.Sequential(torch_nn.Linear(4, 16), torch_nn.ReLU(), torch_nn.Linear(16, 2))
    assert model_signature(a, "job", 32) == model_signature(b, "job", 32)
    assert model_signature(a, "job", 32) != model_signature(c, "job", 32)
    assert model_signature(a, "job", 32) != model_signature(a, "job", 64)  # the batch changes the step
    assert model_signature("resnet50", "job", 32) == "name:resnet50/batch32"
    assert model_signature(None, "alice@node1", 32).startswith("job:alice@node1/")
    with pytest.raises(ConfigError, match="model"):
        model_signature(3.5, "job", 32)
    with pytest.raises(ConfigError, match="model"):
        model_signature("", "job", 32)


def test_the_tuner_keeps_its_decision_and_starts_from_a_kept_one():
    kept: list = []
    tuner = AutoOffload(
        dataset="d",
        links=lambda: [],
        server_stages=3,
        nbytes=1000,
        label="x",
        apply=lambda r: None,
        ratio=0.3,
        cores=1,
        keep=kept.append,
        record=lambda ratio, decision: ("kept", ratio, decision),
        kept={"pcycle": 0.002},
    )
    try:
        tuner._stop.set()
        assert tuner._kept_cost == 0.002  # the prior Pcycle, before a sample ran here
        tuner._unsaved = True
    finally:
        tuner.close()
    assert kept == [("kept", 0.3, None)]


def test_where_the_client_cannot_keep_up_with_its_rest_the_model_takes_a_better_ratio():
    # CPU-starved: the step takes the one core; the servers run slightly fewer samples than the
    # loop could take, so FastFlow's Upper/Gthp leaves ~10% to a client with no CPU to spare
    r = Rates(step_s=P, step_cpu=P, local_cpu=P, common_cpu=0.05 * P, cores=1.0)
    c = cut(0.91 / P)
    d = decide(r, [c])
    assert d.inputs["fastflow_ratio"] == pytest.approx(0.91)
    assert d.ratio == pytest.approx(1.0)
    assert "the model predicts" in d.reason
    assert predicted(r, c, d.ratio) > 1.05 * predicted(r, c, d.inputs["fastflow_ratio"])


def test_a_batch_prepared_inside_next_is_not_counted_twice(monkeypatch):
    tuner = AutoOffload(
        dataset="d", links=lambda: [], server_stages=1, nbytes=10, label="x", apply=lambda r: None, ratio=1.0, cores=1
    )
    try:
        tuner._stop.set()
        figures = {"step_s": 0.004, "step_cpu": 0.004, "wait_s": 0.003, "next_cpu": 0.003, "samples": 640.0}
        monkeypatch.setattr(tuner.loop, "figures", lambda: figures)
        # every batch collated in the training thread: 2 ms of its 3 ms of CPU inside next() per sample
        tuner.batch_done({"0:decode_image": 0.0, "receive": 0.032, "collate": 0.032}, 0.064, 0.064, 0, 32, inline=True)
        tuner.batch_done({"0:decode_image": 0.128}, 0.128, 0.128, 32, 0)  # and a worker's batch, for Pcycle
        rates = tuner.rates()
        assert rates is not None
        # common: collation (1 ms, half of the samples' worth over both batches) + next()'s CPU not
        # spent preparing (3 ms - 1 ms: the inline batch's CPU over all samples seen)
        assert rates.common_cpu == pytest.approx(0.032 / 64 + (0.003 - 0.064 / 64))
        assert rates.local_cpu == pytest.approx(0.004)
    finally:
        tuner.close()


def test_a_split_seen_doing_no_better_is_not_taken_again_whatever_the_model_says():
    from kspeed.client.tuning.decision import OBSERVED_S, Observed

    r = rates(P, cores=1)
    observed = Observed()
    observed.record(1.0, 200.0, 0.0)  # in force now
    observed.record(0.5, 190.0, 0.0)  # tried a moment ago: no better
    h = Hysteresis(settle=1, dwell=0.0)
    h.keep(Decision(1.0, cut(1.0 / P), "start", 0.0))
    tempting = _decision(0.5, 10_000.0)  # the model predicts far more
    assert h.offer(tempting, r, 1.0, observed=observed) is None
    assert h.offer(tempting, r, 1.0 + OBSERVED_S + 1, observed=observed) is not None  # forgotten: tried again
    assert observed.get(0.52, 0.0) == 190.0 and observed.get(0.7, 0.0) is None


def test_the_raw_bytes_of_samples_preprocessed_here_cross_the_rail_too():
    # 6.25 MB/s: 41 decoded samples/s (150 KB) or 130 raw JPEGs/s (48 KB); a cheap step
    r = Rates(
        step_s=P / 4, step_cpu=P / 4, local_cpu=P, common_cpu=0.0, cores=1.0, rail_bytes_per_s=6.25e6, raw_bytes=48_000
    )
    c = cut(1e6, nbytes=150_528)
    assert r.lthp() == pytest.approx(6.25e6 / 48_000)
    assert predicted(r, c, 0.5) == pytest.approx(6.25e6 / (0.5 * 48_000 + 0.5 * 150_528))
    d = decide(r, [c])
    assert d.ratio <= 0.1  # sending decoded samples is the narrowest thing here
    assert predicted(r, c, d.ratio) >= 0.95 * max(predicted(r, c, k / 10) for k in range(11))


def test_server_capacity_is_taken_over_seconds_of_readings_not_the_last_half_second():
    from kspeed.client.tuning.meters import WINDOW_S

    meter = ServerMeter()
    busy = samples = 0.0
    for k in range(9):  # every half second: 100 samples in 0.25 busy seconds, but one slow reading
        slow = k == 8
        busy += 0.45 if slow else 0.25
        samples += 100
        meter.read("a", Reading(1, busy, int(samples)), now=0.5 * k)
    # over the window: (8 readings of the last WINDOW_S s) rather than the slow one alone (222/s)
    readings = int(WINDOW_S / 0.5)
    want = 100 * readings / (0.25 * (readings - 1) + 0.45)
    assert meter.left_for(200.0, 1) == pytest.approx(want)  # this job is all it runs: 200/s
    assert meter.left_for(200.0, 1) > 350
