"""Pipelines as data, their runner, the per-batch split and the servers' preprocessing workers (no daemon)."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import signal
import threading
import time

import numpy as np
import pytest
from PIL import Image

from kspeed import DatasetSpec
from kspeed.cli.cluster import wait_for
from kspeed.client.options import FeedOptions
from kspeed.client.planning.plans import remote_positions
from kspeed.client.prep.offload import attached_pipeline, plan_prep
from kspeed.control.logs import LogSettings
from kspeed.errors import AccessDeniedError, ConfigError, PreprocessError, StateError
from kspeed.preprocess import Output, Pipeline, Stage
from kspeed.preprocess.pipeline import HEADER, STATUS, read_status
from kspeed.preprocess.runner import Runner
from kspeed.preprocess.versions import libraries
from kspeed.server.prep import workers as prep_workers
from kspeed.server.prep.sandbox import SandboxPolicy
from kspeed.server.prep.workers import PrepTask, PrepWorkers

CROP = Output(shape=(3, 16, 16), dtype="uint8")


def jpeg(seed: int, height: int = 40, width: int = 48) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def augment(**places: str) -> Pipeline:
    return Pipeline(
        [
            Stage("decode_image", {"mode": "RGB"}, places.get("decode", "server")),
            Stage("random_resized_crop", {"size": [16, 16]}, places.get("crop", "server")),
            Stage("flip", {"p": 0.5}, places.get("flip", "server")),
            Stage("to_chw", {}, places.get("chw", "server"), output=CROP),
            Stage("cast", {"dtype": "float32"}, places.get("cast", "client")),
        ]
    )


# -- outputs ----------------------------------------------------------------------------------------


def test_a_fixed_output_round_trips_and_names_a_mismatch():
    array = np.arange(3 * 16 * 16, dtype=np.uint8).reshape(3, 16, 16)
    out = np.zeros(CROP.nbytes, np.uint8)
    assert CROP.encode(array, out) == 768 and np.array_equal(CROP.decode(out), array)
    with pytest.raises(ValueError, match=r"shape \(3, 16, 15\) where \(3, 16, 16\) is declared"):
        CROP.encode(array[:, :, :15], out)
    with pytest.raises(ValueError, match="dtype float32 where uint8"):
        CROP.encode(array.astype(np.float32), out)


def test_a_variable_output_carries_its_shape_in_a_header():
    output = Output(max_bytes=1000, dtype="int16")
    out = np.zeros(output.nbytes, np.uint8)
    array = np.arange(30, dtype=np.int16).reshape(5, 6)
    assert output.nbytes == HEADER + 1000
    assert output.encode(array, out) == HEADER + 60
    assert np.array_equal(output.decode(out), array)
    with pytest.raises(ValueError, match="at most 1000 bytes"):
        output.encode(np.zeros(600, np.int16), out)
    out[:4] = 255  # a size beyond the maximum
    with pytest.raises(ValueError, match="bad sample header"):
        output.decode(out)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({}, "output"),
        ({"shape": (2, 2), "max_bytes": 8}, "output"),
        ({"shape": (2, -1)}, "output.shape"),
        ({"shape": (2,), "dtype": "object"}, "output.dtype"),
        ({"shape": (2,), "kind": "image"}, "output.kind"),
    ],
)
def test_bad_outputs_are_named(kwargs, field):
    with pytest.raises(ConfigError) as caught:
        Output(**kwargs)
    assert caught.value.field == field


# -- stages and pipelines ---------------------------------------------------------------------------


def test_stages_are_checked_when_made():
    with pytest.raises(ConfigError, match=r"not 'package\.module:function'"):
        Stage("os:system;rm")
    with pytest.raises(ConfigError, match="not JSON data"):
        Stage("flip", {"p": object()})
    with pytest.raises(ConfigError, match="flip"):
        Stage("flip", {"probability": 0.5})
    with pytest.raises(ConfigError, match="place 'tpu'"):
        Stage("flip", place="tpu")
    with pytest.raises(ConfigError, match=r"unknown|not one"):
        Stage("sharpen")


def test_places_run_server_then_client_then_gpu_and_the_cut_declares_its_output():
    with pytest.raises(ConfigError, match="server first, then client, then gpu"):
        augment(decode="client")
    with pytest.raises(ConfigError, match=r"stage 2 \(flip\) is the last one on the servers and declares no output"):
        Pipeline([Stage("decode_image"), Stage("random_resized_crop", {"size": 8}), Stage("flip")])
    pipeline = augment()
    assert (pipeline.server_stages, pipeline.gpu_from, pipeline.output(4)) == (4, 5, CROP)


def test_a_pipeline_travels_as_data_and_keeps_its_identity():
    pipeline = augment()
    message = pipeline.to_proto()
    assert all(json.loads(stage.params) is not None for stage in message.stages)  # JSON, never pickles
    back = Pipeline.from_proto(type(message).FromString(message.SerializeToString()), 4)
    assert back == pipeline and back.digest() == pipeline.digest()
    assert augment(cast="gpu").digest() == pipeline.digest()  # places are the rank's, not the identity
    other = Pipeline([*pipeline.stages[:4], Stage("cast", {"dtype": "float16"}, "client")])
    assert other.digest() != pipeline.digest()
    assert attached_pipeline(message) == pipeline  # by name: up to the last declared output on the servers


def test_a_cache_keeps_the_deterministic_leading_stages_up_to_a_declared_output():
    kept = Output(shape=(20, 20, 3), dtype="uint8")
    resized = Pipeline(
        [
            Stage("decode_image", {"mode": "RGB"}),
            Stage("resize", {"size": [24, 24]}),
            Stage("center_crop", {"size": 20}, output=kept),
            Stage("torchvision.transforms:PILToTensor", {}),
            Stage("flip", {"p": 0.5}),
            Stage("to_chw", output=Output(shape=(1, 20, 20), dtype="uint8")),
        ]
    )
    assert resized.cached_stages("preprocessed") == 3  # PILToTensor is not random but declares nothing
    assert resized.cached_stages("") == 0
    with pytest.raises(ConfigError, match="no stage before the first random one declares its output"):
        augment().cached_stages("preprocessed")
    with pytest.raises(ConfigError, match=r"its first stage \(random_resized_crop\) is random"):
        Pipeline([Stage("random_resized_crop", {"size": 4}, output=CROP)]).cached_stages("preprocessed")
    user = Pipeline([Stage("tests.integration.prep_functions:hold", {"gate": "x"}, output=CROP)])
    with pytest.raises(ConfigError, match="is random"):  # nothing says a user function draws nothing
        user.cached_stages("preprocessed")
    with pytest.raises(ConfigError, match="cache 'raw' is not one of"):
        resized.cached_stages("raw")


def test_a_dataset_cached_preprocessed_names_what_does_not_fit():
    kept = Output(shape=(16, 16, 3), dtype="uint8")
    stages = [Stage("decode_image", {"mode": "RGB"}), Stage("center_crop", {"size": 16}, output=kept)]
    spec = DatasetSpec(name="imgs", uri="/data", pipeline=Pipeline(stages), cache="preprocessed")
    assert spec.cached_stages == 2 and spec.to_proto().cache == "preprocessed"
    with pytest.raises(ConfigError, match="needs a pipeline"):
        DatasetSpec(name="imgs", uri="/data", cache="preprocessed")
    on_gpu = Pipeline([Stage("decode_image", {}, "client"), Stage("center_crop", {"size": 16}, "gpu", output=kept)])
    with pytest.raises(ConfigError, match="stage 1 is placed on the gpu"):
        DatasetSpec(name="imgs", uri="/data", pipeline=on_gpu, cache="preprocessed")
    # Every sample arrives past the cached stages: the servers have nothing left to do per epoch.
    assert plan_prep("imgs", spec.pipeline, 2, FeedOptions(batch_size=4), {}) is None


# -- the runner -------------------------------------------------------------------------------------


def test_produced_then_received_equals_run_locally_and_randomness_follows_seed_epoch_sample():
    runner = Runner(augment())
    data = jpeg(1)
    out = np.zeros(CROP.nbytes, np.uint8)
    runner.produce(data, out, seed=7, epoch=2, sample=11, stop=4)
    received = runner.receive(out, 4, sample=11)
    local = runner.run(data, seed=7, epoch=2, sample=11, stop=4)
    assert np.array_equal(received, local)
    finished = runner.run(received, seed=7, epoch=2, sample=11, start=4)
    assert finished.dtype == np.float32 and np.array_equal(finished, local.astype(np.float32) / 255)
    crops = {runner.run(data, seed=7, epoch=e, sample=s, stop=4).tobytes() for e in range(3) for s in range(3)}
    assert len(crops) == 9  # another epoch or another sample: another crop


def test_runner_errors_name_the_sample_the_stage_and_why():
    runner = Runner(augment(), dataset="imgs")
    with pytest.raises(PreprocessError, match=r"dataset 'imgs' sample 5: stage 0 \(decode_image\) failed") as caught:
        runner.run(b"not an image", seed=0, epoch=0, sample=5)
    assert (caught.value.sample, caught.value.stage, caught.value.op) == (5, 0, "decode_image")
    squeezed = Pipeline([Stage("decode_image"), Stage("to_chw", output=CROP)])
    with pytest.raises(PreprocessError, match=r"sample 3: stage 1 \(to_chw\) produced shape \(3, 40, 48\)"):
        Runner(squeezed).produce(jpeg(2), np.zeros(CROP.nbytes, np.uint8), seed=0, epoch=0, sample=3, stop=2)


def test_user_functions_need_the_allow_list():
    pipeline = Pipeline([Stage("tests.integration.prep_functions:fail_on_height", {"height": 7}, output=CROP)])
    with pytest.raises(AccessDeniedError, match=r"'tests\.integration\.prep_functions' is not on this server"):
        Runner(pipeline, allow=("torchvision.transforms",))
    Runner(pipeline, allow=("tests",))  # a package admits its modules
    with pytest.raises(ConfigError, match="cannot import it"):
        Runner(Pipeline([Stage("tests.integration.prep_functions:missing", output=CROP)]), allow=("tests",))


def test_torchvision_stages_get_pil_images_and_match_torchvision():
    from torchvision import transforms

    pipeline = Pipeline(
        [
            Stage("decode_image", {"mode": "RGB"}),
            Stage("torchvision.transforms:CenterCrop", {"size": [16, 16]}),
            Stage("torchvision.transforms:PILToTensor", {}, output=CROP),
        ]
    )
    data = jpeg(3)
    got = Runner(pipeline, allow=("torchvision.transforms",)).run(data, seed=0, epoch=0, sample=0)
    want = transforms.Compose([transforms.CenterCrop(16), transforms.PILToTensor()])(
        Image.open(io.BytesIO(data)).convert("RGB")
    )
    assert got.equal(want)


def test_a_last_pil_to_tensor_writes_what_the_tensor_would_have_written():
    """It writes the PIL image's planes itself (no tensor): the same bytes, the same stage times,
    and a mismatch is reported as the tensor's would be."""
    data = jpeg(4)
    tail = [Stage("torchvision.transforms:RandomResizedCrop", {"size": [16, 16]})]
    variable = Output(max_bytes=3 * 40 * 48)
    for output, crop in ((CROP, tail), (variable, tail), (variable, [])):
        pipeline = Pipeline(
            [
                Stage("decode_image", {"mode": "RGB"}),
                *crop,
                Stage("torchvision.transforms:PILToTensor", {}, output=output),
            ]
        )
        runner = Runner(pipeline, allow=("torchvision.transforms",))
        stop = len(pipeline.stages)
        out, want = np.full(output.nbytes, 9, np.uint8), np.full(output.nbytes, 9, np.uint8)
        seconds: dict[str, float] = {}
        written = runner.produce(data, out, seed=1, epoch=2, sample=3, stop=stop, seconds=seconds)
        tensor = runner.run(data, seed=1, epoch=2, sample=3, stop=stop)
        assert written == runner.write(tensor, want, stop, sample=3) and np.array_equal(out, want)
        assert sorted(seconds) == [runner.stage_name(k) for k in range(stop)]
        assert np.array_equal(runner.receive(out, stop, sample=3), tensor.numpy())
    gray = Pipeline(
        [
            Stage("decode_image", {"mode": "L"}),
            Stage("torchvision.transforms:PILToTensor", {}, output=CROP),
        ]
    )
    with pytest.raises(
        PreprocessError, match=r"stage 1 \(torchvision.transforms:PILToTensor\) produced shape \(1, 40, 48\)"
    ):
        Runner(gray).produce(data, np.zeros(CROP.nbytes, np.uint8), seed=0, epoch=0, sample=0, stop=2)


# -- the split --------------------------------------------------------------------------------------


@pytest.mark.parametrize("fraction", [0.0, 0.25, 0.5, 0.3, 0.75, 1.0])
def test_the_split_holds_per_batch(fraction):
    remote = remote_positions(100, 8, fraction)
    for start in range(0, 100, 8):
        batch = remote[start : start + 8]
        assert abs(int(batch.sum()) - fraction * len(batch)) < 1
    assert remote.sum() == (100 if fraction == 1.0 else 0 if fraction == 0.0 else remote.sum())


def test_a_split_that_would_mix_versions_is_refused_naming_them():
    ours = libraries()
    other = {**ours, "Pillow": "0.0.1"}
    options = FeedOptions(batch_size=4, offload=0.5)
    with pytest.raises(ConfigError, match=r"Pillow .* here, 0\.0\.1 there"):
        plan_prep("imgs", augment(), 0, options, {"s1": other})
    prep = plan_prep("imgs", augment(), 0, options, {"s1": ours, "s2": ours})
    assert prep is not None and (prep.server_stages, prep.fraction, prep.nbytes) == (4, 0.5, CROP.nbytes)
    # All on the servers: the client's versions do not matter, the servers' among themselves do.
    assert plan_prep("imgs", augment(), 0, FeedOptions(batch_size=4), {"s1": other}) is not None
    with pytest.raises(ConfigError, match="servers s1 and s2"):
        plan_prep("imgs", augment(), 0, FeedOptions(batch_size=4), {"s1": ours, "s2": other})
    assert plan_prep("imgs", augment(), 0, FeedOptions(batch_size=4, offload=0), {"s1": other}) is None


# -- the servers' preprocessing workers -------------------------------------------------------------


def shared_dir(tmp_path) -> str:
    """``tmp_path``, where the sandboxed workers (``nobody`` when the tests run as root) may write."""
    os.chmod(tmp_path, 0o777)
    return str(tmp_path)


def workers_for(tmp_path, count: int = 1) -> PrepWorkers:
    """Sandboxed workers that may write in ``tmp_path`` and get ``PREP_PROBE_DIR`` (for the test
    modules' gates and probes)."""
    policy = SandboxPolicy(write=(shared_dir(tmp_path),))
    return PrepWorkers(count, ("tests",), LogSettings(), sandbox=policy, environment=("PREP_PROBE_DIR",))


@pytest.fixture
def pool(tmp_path):
    workers = workers_for(tmp_path)
    yield workers
    workers.close()


def window(slots: int, size: int = CROP.nbytes) -> np.ndarray:
    """A stand-in for production-window slots: one buffer, a slot every ``size`` bytes."""
    return np.zeros(size * slots, dtype=np.uint8)


def task(pipeline: Pipeline, mapped: np.ndarray, inputs: list, stages: int = 4) -> PrepTask:
    return PrepTask(
        "imgs",
        pipeline.to_proto().SerializeToString(),
        stages,
        7,
        1,
        tuple(range(len(inputs))),
        tuple(inputs),
        tuple(mapped[k * CROP.nbytes : (k + 1) * CROP.nbytes] for k in range(len(inputs))),
    )


def test_workers_run_what_the_client_would_compute_and_the_server_copies_it_into_window_slots(pool):
    mapped = window(3)
    data = [jpeg(k) for k in range(3)]
    home = np.frombuffer(b"x" * 100 + data[2], dtype=np.uint8)[100:]  # a view of pool memory
    results = pool.run(task(augment(), mapped, [data[0], b"broken", home]))
    assert results[0] == results[2] == CROP.nbytes
    assert isinstance(results[1], str) and "sample 1: stage 0 (decode_image) failed" in results[1]
    runner = Runner(augment())
    for k in (0, 2):
        got = mapped[k * CROP.nbytes : (k + 1) * CROP.nbytes].reshape(3, 16, 16)
        assert np.array_equal(got, runner.run(data[k], seed=7, epoch=1, sample=k, stop=4))
    assert pool.samples == 3 and set(pool.seconds_of("imgs")) >= {"0:decode_image", "3:to_chw"}
    assert pool.cpu_seconds > 0.0  # what the worker itself measured, beside the busy seconds the pool timed


def test_a_worker_that_dies_is_replaced_and_its_task_done_again(pool, tmp_path):
    mapped = window(1)
    gate = str(tmp_path / "gate")
    pipeline = Pipeline(
        [
            Stage("decode_image"),
            Stage("tests.integration.prep_functions:hold", {"gate": gate}),
            Stage("center_crop", {"size": [16, 16]}),
            Stage("to_chw", output=CROP),
        ]
    )
    answer: list = []
    runner = threading.Thread(target=lambda: answer.append(pool.run(task(pipeline, mapped, [jpeg(4)]))))
    runner.start()
    announced = tmp_path.glob("gate.*")
    for _ in range(500):
        announced = list(tmp_path.glob("gate.*"))
        if announced:
            break
        threading.Event().wait(0.01)
    assert announced, "the worker never started the task"
    first = int(announced[0].name.split(".")[1])
    os.kill(first, signal.SIGKILL)  # mid-task
    (tmp_path / "gate").touch()  # the replacement passes
    runner.join(30)
    assert answer and answer[0] == [CROP.nbytes]
    assert pool.restarts == 1 and first not in pool.pids()


def probed() -> Pipeline:
    """:func:`augment` with a stage from :mod:`tests.preprocess.import_probe`."""
    stages = list(augment().stages)
    return Pipeline([stages[0], Stage("tests.preprocess.import_probe:same"), *stages[1:]])


def test_warming_resolves_the_pipeline_in_every_worker_before_any_task(tmp_path, monkeypatch):
    monkeypatch.setenv("PREP_PROBE_DIR", str(tmp_path))
    workers = workers_for(tmp_path, 2)
    try:
        pipeline = probed().to_proto().SerializeToString()
        workers.warm("imgs", pipeline, 5)
        workers.warm("imgs", pipeline, 5)  # once per pool
        wait_for(lambda: len(workers.pids()) == 2 and len(list(tmp_path.glob("imported.*"))) == 2, 60, "warm")
        assert {int(p.name.split(".")[1]) for p in tmp_path.glob("imported.*")} == set(workers.pids())
        assert workers.samples == 0 and workers.busy_seconds == 0  # warming is not work
        mapped = window(1)
        results = workers.run(dataclasses.replace(task(probed(), mapped, [jpeg(3)], stages=5), pipeline=pipeline))
        assert results == [CROP.nbytes]
        expected = Runner(probed(), allow=("tests",)).run(jpeg(3), seed=7, epoch=1, sample=0, stop=5)
        assert np.array_equal(mapped[: CROP.nbytes].reshape(3, 16, 16), expected)
        imported = {int(p.name.split(".")[1]) for p in tmp_path.glob("imported.*")} - {os.getpid()}
        assert imported == set(workers.pids())  # the task found the module imported
    finally:
        workers.close()


def test_closing_while_the_workers_warm_kills_them_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv("PREP_PROBE_DIR", str(tmp_path))
    (tmp_path / "hold").touch()  # importing the probe takes a minute
    workers = workers_for(tmp_path, 2)
    workers.warm("imgs", probed().to_proto().SerializeToString(), 5)
    wait_for(lambda: len(list(tmp_path.glob("imported.*"))) == 2, 60, "both workers importing")
    started = time.monotonic()
    workers.close()
    assert time.monotonic() - started < 3  # not the minute, nor the 5 s a running task is given
    pids = [int(p.name.split(".")[1]) for p in tmp_path.glob("imported.*")]
    assert not [pid for pid in pids if os.path.exists(f"/proc/{pid}") and not zombie(pid)]
    with pytest.raises(StateError):
        workers.run(task(augment(), window(1), [jpeg(1)]))


def test_a_worker_that_hangs_while_warming_is_replaced_and_tasks_still_get_their_own_answers(tmp_path, monkeypatch):
    monkeypatch.setenv("PREP_PROBE_DIR", str(tmp_path))
    monkeypatch.setattr(prep_workers, "TASK_TIMEOUT", 0.5)  # no answer within it: hung
    (tmp_path / "hold").touch()  # importing the probe takes a minute
    workers = workers_for(tmp_path, 2)
    try:
        pipeline = probed().to_proto().SerializeToString()
        workers.warm("imgs", pipeline, 5)
        first = set(workers.all_pids())
        assert len(first) == 2
        wait_for(lambda: len(workers.pids()) == 2 and not first & set(workers.pids()), 30, "both replaced")
        assert not [pid for pid in first if os.path.exists(f"/proc/{pid}") and not zombie(pid)]
        assert workers.restarts == 2
        monkeypatch.setattr(prep_workers, "TASK_TIMEOUT", 300.0)
        (tmp_path / "hold").unlink()
        mapped = window(1)
        results = workers.run(dataclasses.replace(task(probed(), mapped, [jpeg(5)], stages=5), pipeline=pipeline))
        assert results == [CROP.nbytes]  # not the late answer of a warming worker
        expected = Runner(probed(), allow=("tests",)).run(jpeg(5), seed=7, epoch=1, sample=0, stop=5)
        assert np.array_equal(mapped[: CROP.nbytes].reshape(3, 16, 16), expected)
    finally:
        workers.close()


def zombie(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] == "Z"


def test_when_skipping_a_failure_travels_in_the_sample_slot(pool):
    size = CROP.nbytes + STATUS
    mapped = window(2, size)
    skipping = PrepTask(
        "imgs",
        augment().to_proto().SerializeToString(),
        4,
        7,
        1,
        (0, 1),
        (jpeg(0), b"broken"),
        (mapped[:size], mapped[size:]),
        skip=True,
    )
    results = pool.run(skipping)
    assert results[0] == size and read_status(mapped[:size]) == ""
    assert isinstance(results[1], str) and "stage 0 (decode_image) failed" in read_status(mapped[size:])
    want = Runner(augment()).run(jpeg(0), seed=7, epoch=1, sample=0, stop=4)
    assert np.array_equal(mapped[STATUS:size].reshape(3, 16, 16), want)


def test_a_task_can_start_past_cached_stages_and_send_its_results_back(pool):
    kept = Output(shape=(24, 24, 3), dtype="uint8")
    pipeline = Pipeline(
        [
            Stage("decode_image", {"mode": "RGB"}),
            Stage("resize", {"size": [24, 24]}, output=kept),
            Stage("random_resized_crop", {"size": [16, 16]}),
            Stage("to_chw", output=CROP),
        ]
    )
    message = pipeline.to_proto().SerializeToString()
    data = [jpeg(k) for k in range(2)]
    caching = PrepTask("imgs", message, 2, 0, 0, (0, 1), tuple(data), None)
    stored = pool.run(caching)  # no window slots: the results come back as their bytes
    assert all(isinstance(r, bytes) and len(r) == kept.nbytes for r in stored)
    mapped = window(2)
    slots = tuple(mapped[k * CROP.nbytes : (k + 1) * CROP.nbytes] for k in range(2))
    epoch = PrepTask("imgs", message, 4, 7, 3, (0, 1), tuple(stored), slots, start=2)
    assert pool.run(epoch) == [CROP.nbytes, CROP.nbytes]
    runner = Runner(pipeline)
    for k in range(2):
        want = runner.run(data[k], seed=7, epoch=3, sample=k)
        assert np.array_equal(mapped[k * CROP.nbytes : (k + 1) * CROP.nbytes].reshape(3, 16, 16), want)
