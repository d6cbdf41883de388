"""The random state of a preprocessing stage: a function of ``(seed, epoch, sample, stage)`` only.

A sample gets the same augmentation wherever its stages run (client workers, server workers, the
GPU), because every random draw comes from a generator seeded by the job's seed, the epoch, the
sample's ID and the stage's index in the pipeline, and by nothing else (no global state, no
worker identity, no order of arrival).
"""

from __future__ import annotations

import numpy as np

__all__ = ["sample_rng", "torch_seed"]

_MASK = (1 << 64) - 1


def _entropy(seed: int, epoch: int, sample: int, stage: int) -> list[int]:
    return [int(seed) & _MASK, int(epoch) & _MASK, int(sample) & _MASK, int(stage) & _MASK]


def sample_rng(seed: int, epoch: int, sample: int, stage: int) -> np.random.Generator:
    """The generator of stage ``stage`` for ``sample`` in ``epoch`` of a job seeded ``seed``."""
    return np.random.Generator(np.random.Philox(np.random.SeedSequence(_entropy(seed, epoch, sample, stage))))


def torch_seed(seed: int, epoch: int, sample: int, stage: int) -> int:
    """A 63-bit seed for ``torch.manual_seed`` (torchvision's transforms draw from torch's generator)."""
    state = np.random.SeedSequence(_entropy(seed, epoch, sample, stage)).generate_state(2, dtype=np.uint32)
    return (int(state[0]) << 31 | int(state[1]) >> 1) & ((1 << 63) - 1)
