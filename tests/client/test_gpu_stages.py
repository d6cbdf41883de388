"""The step after a prepared dataset's CPU stages: the collated samples move to the dataset's device
and its ``gpu`` stages run there. PyTorch's ``meta`` device stands in for a GPU (no data, real
placement and shapes)."""

from __future__ import annotations

import pytest
import torch

from kspeed.client.prep.gpu_stages import GpuStages
from kspeed.errors import ConfigError
from kspeed.preprocess import Output, Pipeline, Stage

META = torch.device("meta")


def batch() -> list[torch.Tensor]:
    return [torch.zeros((4, 3, 8, 8), dtype=torch.uint8), torch.arange(4)]


def test_on_the_cpu_without_gpu_stages_the_batch_is_left_as_it_is():
    value = batch()
    assert GpuStages(None, 0, "cpu").apply(value, 0, range(4)) is value


def test_the_samples_move_to_the_device_without_gpu_stages_and_the_targets_stay():
    samples, targets = GpuStages(None, 0, META).apply(batch(), 0, range(4))
    assert samples.device == META and samples.shape == (4, 3, 8, 8) and samples.dtype == torch.uint8
    assert targets.device == torch.device("cpu") and targets.tolist() == [0, 1, 2, 3]


def test_gpu_stages_run_on_the_device_the_samples_moved_to():
    pipeline = Pipeline(
        [
            Stage("to_chw", output=Output(shape=(3, 8, 8), dtype="uint8")),
            Stage("cast", {"dtype": "float32"}, place="gpu"),
        ]
    )
    samples, _ = GpuStages(pipeline, 0, META).apply(batch(), 0, range(4))
    assert samples.device == META and samples.dtype == torch.float32


def test_samples_that_are_not_one_tensor_cannot_move_and_say_why():
    per_sample = [[torch.zeros(3), torch.zeros(5)], torch.arange(2)]
    with pytest.raises(ConfigError, match="device='meta' need the collated samples as one tensor") as info:
        GpuStages(None, 0, META).apply(per_sample, 0, range(2))
    assert info.value.field == "device"
    assert GpuStages(None, 0, "cpu").apply(per_sample, 0, range(2)) is per_sample
