"""A pipeline's ``gpu`` stages: torch ops on the collated batch, on the dataset's device.

The CPU stages of a prepared dataset read the delivered bytes in host memory, so its feed delivers
there whatever the device; the collated batch's samples then move to the device here (with or
without ``gpu`` stages) and the ``gpu`` stages run on them, one op at a time over the whole batch
(:func:`kspeed.preprocess.gpu.apply_batch`), with each sample's random decisions drawn exactly as
the CPU op draws them, from ``(seed, epoch, sample, stage)``. On a ``cpu`` device they run on CPU
tensors (how CI runs them).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from kspeed.errors import ConfigError
from kspeed.preprocess import gpu, ops, rng
from kspeed.preprocess.pipeline import Pipeline

__all__ = ["GpuStages"]


class GpuStages:
    """The ``gpu`` stages of ``pipeline`` (none without one) for a job seeded ``seed``, run on ``device``.

    Raises:
        ConfigError: a ``gpu`` stage is not a built-in op with a torch version.
    """

    def __init__(self, pipeline: Pipeline | None, seed: int, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.seed = seed
        stages = pipeline.stages if pipeline is not None else []
        self.stages = [(k, s) for k, s in enumerate(stages) if s.place == "gpu"]
        for k, stage in self.stages:
            if stage.module or stage.op not in gpu.OPS:
                raise ConfigError(
                    f"pipeline stage {k} ({stage.op}) cannot run on the GPU; GPU stages are built-in ops "
                    f"among {', '.join(sorted(gpu.OPS))}",
                    field="pipeline.place",
                    value=stage.op,
                )
        self.seconds: dict[str, float] = {}

    def apply(self, value: Any, epoch: int, ids: Sequence[int]) -> Any:
        """The batch after the ``gpu`` stages: its samples tensor (the first of a pair) moved to the
        device and transformed (the targets stay in host memory, as every KSpeed batch's labels do).

        Raises:
            ConfigError: the samples are not one tensor, and there are ``gpu`` stages or a device
                other than the CPU to move them to.
        """
        if not self.stages and self.device.type == "cpu":
            return value
        paired = isinstance(value, list | tuple)
        samples = value[0] if paired else value
        if not isinstance(samples, torch.Tensor):
            raise ConfigError(
                f"GPU stages and device={str(self.device)!r} need the collated samples as one tensor "
                "(a fixed-shape output and default collation); use device='cpu' and move them yourself",
                field="pipeline.place" if self.stages else "device",
            )
        tensor = samples.to(self.device, non_blocking=True)
        for k, stage in self.stages:
            begun = time.perf_counter()
            draws = [rng.sample_rng(self.seed, epoch, int(i), k) if ops.get(stage.op).random else None for i in ids]
            tensor = gpu.apply_batch(stage.op, tensor, draws, stage.params)
            name = f"{k}:{stage.op}@gpu"
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - begun
        return [tensor, *value[1:]] if paired else tensor
