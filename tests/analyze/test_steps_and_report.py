"""The analyzer's steps, options, its report from a synthetic analysis, and the command's refusals
(no cluster)."""

from __future__ import annotations

import json
import math
import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from kspeed.analyze.analysis import Analysis, cache_fraction_of, crowded_split_note, curves
from kspeed.analyze.measure import Options, RankFigures, twin
from kspeed.analyze.model import Setup, predict, smallest_cluster
from kspeed.analyze.report import finite, summary, table, write_report
from kspeed.analyze.steps import resolve, samples_of
from kspeed.cli.main import main
from kspeed.client.spec import DatasetSpec
from kspeed.errors import ConfigError
from kspeed.preprocess import Output, Pipeline, Stage
from kspeed.proto import kspeed_pb2
from tests.analyze.test_model import measured


def test_a_sleeping_step_waits_and_a_cpu_step_spins():
    started = time.perf_counter()
    resolve("sleep:30")(None)
    assert time.perf_counter() - started >= 0.03
    started = time.thread_time()
    resolve("cpu:20")(None)
    assert time.thread_time() - started >= 0.02


def test_a_step_is_imported_by_its_path():
    assert resolve("math:sqrt")(16.0) == 4.0
    assert resolve("os.path:join")("a", "b") == "a/b"


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("sleep", "must be"),
        ("sleep:ten", "not a number"),
        ("cpu:-1", "0..60000"),
        ("no_such_module_xyz:step", "cannot be imported"),
        ("math:no_such_function", "no attribute"),
        ("math:pi", "not callable"),
    ],
)
def test_a_bad_step_is_refused_with_what_is_wrong(name, says):
    with pytest.raises(ConfigError, match=says):
        resolve(name)


def test_samples_of_counts_every_batch_shape():
    assert samples_of(torch.zeros(7, 3)) == 7
    assert samples_of([torch.zeros(5, 2), torch.zeros(5)]) == 5
    assert samples_of((np.zeros((4, 1)), np.zeros(4))) == 4
    assert samples_of({"image": torch.zeros(3, 2), "label": torch.zeros(3)}) == 3
    assert samples_of([[b"a", b"b"], [0, 1]]) == 2  # raw samples and their labels
    assert samples_of([b"a", b"b", b"c"]) == 3


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"seconds": 0.1}, "seconds"),
        ({"ranks": 0}, "ranks"),
        ({"warmup_batches": 0}, "warmup_batches"),
        ({"step": "walk:3"}, "step"),
    ],
)
def test_bad_options_are_refused_by_name(changes, field):
    with pytest.raises(ConfigError) as caught:
        Options(**{"step": "sleep:1", "batch_size": 8, **changes})
    assert caught.value.field == field


def test_a_twin_is_the_stored_bytes_under_its_own_name():
    pipeline = Pipeline([Stage("decode_image", output=Output(shape=(4, 4, 3), dtype="uint8"))])
    spec = DatasetSpec(name="imgs", uri="/data/imgs", labels="dirname", pipeline=pipeline, quota_bytes=5)
    raw = twin(spec, "analyze-raw", policy="cache")
    assert (raw.name, raw.uri, raw.labels, raw.pipeline, raw.policy, raw.quota_bytes) == (
        "imgs.analyze-raw",
        "/data/imgs",
        "dirname",
        None,
        "cache",
        0,
    )
    long = twin(DatasetSpec(name="x" * 128, uri="/d"), "analyze-stream", policy="stream", quota_bytes=8)
    assert len(long.name) == 128 and long.name.endswith(".analyze-stream") and long.quota_bytes == 8


def test_the_cache_fraction_of_a_registration():
    info = kspeed_pb2.DatasetInfo(region_size=100)
    info.shares.add(server_id="a", bytes=400)
    info.shares.add(server_id="b", bytes=400, policy="stream", memory_regions=2)
    assert cache_fraction_of(info) == 0.5  # one share whole, one streamed
    info = kspeed_pb2.DatasetInfo(region_size=100)
    info.shares.add(server_id="a", bytes=400, policy="minio", memory_regions=2)
    assert cache_fraction_of(info) == pytest.approx(0.75 * 200 / 400)  # a quarter of the window prefetches
    assert cache_fraction_of(kspeed_pb2.DatasetInfo()) == 1.0


def test_a_rank_whose_workers_crowd_its_cpus_is_told_splits_are_optimistic():
    base = measured(client_cpus=1)
    (note,) = crowded_split_note(base)
    assert "1 CPU(s)" in note and "1 preprocessing worker(s)" in note and "optimistic" in note
    assert crowded_split_note(replace(base, client_cpus=2)) == []  # a CPU beside the worker
    assert crowded_split_note(replace(base, client_cpus=0)) == []  # not known
    assert crowded_split_note(replace(base, server_prep=None)) == []  # nothing to split


def synthetic() -> Analysis:
    m = measured(server_memory=1 << 20, dataset_bytes=4 << 20)
    setup = Setup.measured(m, offload=1.0, cache_fraction=0.5)
    options = Options(step="sleep:40", batch_size=16, seconds=1.0)
    figures = {name: [RankFigures(0, samples=100, seconds=1.0, wait_s=0.2)] for name in ("step", "as_is")}
    smallest = smallest_cluster(m, setup)
    return Analysis(
        dataset="imgs",
        options=options,
        measured=m,
        phases=figures,
        as_is=setup,
        observed=160.0,
        prediction=predict(m, setup),
        ranks=[
            {
                "rank": 0,
                "observed_samples_per_s": 160.0,
                "observed_wait_share": 0.2,
                "predicted_samples_per_s": 150.0,
                "prep_stall": 0.3,
                "fetch_stall": 0.1,
                "bound": "server_prep",
            }
        ],
        curves=curves(m, setup, smallest),
        smallest=smallest,
        notes=["a note"],
    )


def test_the_table_names_every_rate_the_measured_point_and_the_answer():
    a = synthetic()
    text = table(a)
    for label in ("G", "P_s", "P_c", "C", "S"):
        assert f"\n{label} " in text
    assert "400/s" in text and "150/s" in text and "measured 160 samples/s per rank" in text
    assert a.smallest["line"] in text and "note: a note" in text


def test_the_report_folder_holds_json_a_chart_and_a_summary(tmp_path):
    a = synthetic()
    paths = write_report(a, tmp_path / "out")
    assert [p.name for p in paths] == ["analysis.json", "whatif.png", "summary.md"]
    doc = json.loads(paths[0].read_text())
    assert doc["measured"]["step"] == 400.0 and doc["prediction"]["bound"] == a.prediction.bound
    assert doc["curves"]["servers"][0]["servers"] == 1
    assert paths[1].read_bytes()[:4] == b"\x89PNG"
    assert summary(a, "whatif.png") == paths[2].read_text()


def test_finite_leaves_no_infinity_for_json():
    assert finite({"a": [math.inf, 1.0, {"b": math.nan}], "c": (2, -math.inf)}) == {
        "a": [None, 1.0, {"b": None}],
        "c": [2, None],
    }


@pytest.mark.parametrize(
    "extra",
    [[], ["--step-ms", "5", "--step-cpu-ms", "5"], ["--step", "math:sqrt", "--step-ms", "1"]],
)
def test_the_command_wants_the_step_exactly_once(extra, capsys):
    assert main(["analyze", "--dataset", "imgs", "--batch-size", "8", *extra]) == 1
    assert "give the training step once" in capsys.readouterr().err


def test_the_command_refuses_a_bad_offload(capsys):
    with pytest.raises(SystemExit):
        main(["analyze", "--dataset", "imgs", "--batch-size", "8", "--step-ms", "1", "--offload", "most"])
    assert "--offload must be 'auto' or a number" in capsys.readouterr().err
