"""The random state of a preprocessing stage: a function of ``(seed, epoch, sample, stage)`` only.

A sample gets the same augmentation wherever its stages run (client workers, server workers, the
GPU), because every random draw comes from a generator seeded by the job's seed, the epoch, the
sample's ID and the stage's index in the pipeline, and by nothing else (no global state, no
worker identity, no order of arrival).

A user's own loader and transforms (a wrapped folder dataset's that cannot be sent as a pipeline)
draw from the global generators instead: torch's, Python's ``random`` and numpy's legacy one are
seeded from ``(seed, epoch, sample)`` before each sample (:func:`seed_global_generators`, with
:func:`user_seed`) and put back afterwards (:func:`global_generators_kept`).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

__all__ = ["USER_STAGE", "global_generators_kept", "sample_rng", "seed_global_generators", "torch_seed", "user_seed"]

_MASK = (1 << 64) - 1
#: the stage index a user's own loader and transforms are seeded as (no pipeline has that many stages)
USER_STAGE = _MASK


def _entropy(seed: int, epoch: int, sample: int, stage: int) -> list[int]:
    return [int(seed) & _MASK, int(epoch) & _MASK, int(sample) & _MASK, int(stage) & _MASK]


def sample_rng(seed: int, epoch: int, sample: int, stage: int) -> np.random.Generator:
    """The generator of stage ``stage`` for ``sample`` in ``epoch`` of a job seeded ``seed``."""
    return np.random.Generator(np.random.Philox(np.random.SeedSequence(_entropy(seed, epoch, sample, stage))))


def torch_seed(seed: int, epoch: int, sample: int, stage: int) -> int:
    """A 63-bit seed for ``torch.manual_seed`` (torchvision's transforms draw from torch's generator)."""
    state = np.random.SeedSequence(_entropy(seed, epoch, sample, stage)).generate_state(2, dtype=np.uint32)
    return (int(state[0]) << 31 | int(state[1]) >> 1) & ((1 << 63) - 1)


def user_seed(seed: int, epoch: int, sample: int) -> int:
    """The seed of the global generators for a user's own loader and transforms of ``sample`` in ``epoch``."""
    return torch_seed(seed, epoch, sample, USER_STAGE)


def seed_global_generators(seed: int) -> None:
    """Seed torch's global CPU generator, Python's ``random`` and numpy's legacy global generator
    (what a user's transforms draw from) with ``seed`` (numpy's with its low 32 bits)."""
    import torch  # (here: the servers' workers import this module for numpy's generators alone)

    torch.default_generator.manual_seed(seed)  # (torch.manual_seed seeds every accelerator too, at ~100x the cost)
    random.seed(seed)
    np.random.seed(seed & 0xFFFF_FFFF)


@contextmanager
def global_generators_kept() -> Iterator[None]:
    """torch's global CPU generator, Python's ``random`` and numpy's legacy global generator as they
    were, once the block is done (what it draws or seeds is not seen by the code around it)."""
    import torch

    state, python, legacy = torch.get_rng_state(), random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        torch.set_rng_state(state)
        random.setstate(python)
        np.random.set_state(legacy)
