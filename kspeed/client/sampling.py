"""This rank's ordered sample IDs per epoch, from any torch sampler.

Two kinds of samplers are told apart because the next epoch may be planned early only for one:

* **deterministic in (seed, epoch)**: ``DistributedSampler`` (also what KSpeed builds when no
  sampler is given) and ``SequentialSampler``. The order of any epoch is computed from a *copy* of
  the sampler set to that epoch, so planning epoch ``e + 1`` while ``e`` is consumed never touches
  the user's object.
* **everything else** (``RandomSampler``, weighted samplers, user classes): the order is drawn
  by iterating the user's sampler once when the epoch starts, exactly as a ``DataLoader`` would,
  so its random state is consumed at the same moments and never early.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import numpy as np
from torch.utils.data import Dataset, DistributedSampler, SequentialSampler

from kspeed.errors import ConfigError, DatasetError

__all__ = ["EpochOrders"]

_DETERMINISTIC = (DistributedSampler, SequentialSampler)


class _IdRange(Dataset[int]):
    """Sample IDs ``0..n-1`` as a map-style dataset: what the built-in ``DistributedSampler`` splits."""

    def __init__(self, n: int) -> None:
        self._n = n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index: int) -> int:
        return index


def _describe(sampler: object) -> str:
    cls = type(sampler)
    text = f"{cls.__module__}.{cls.__qualname__}"
    if isinstance(sampler, DistributedSampler):
        text += (
            f"(replicas={sampler.num_replicas},rank={sampler.rank},shuffle={sampler.shuffle},"
            f"seed={sampler.seed},drop_last={sampler.drop_last},total={sampler.total_size})"
        )
    return text


class EpochOrders:
    """The sampler of one dataset and the ID orders it yields.

    Args:
        sampler: a torch sampler, or ``None`` for every sample (shuffled per epoch when ``shuffle``).
        num_samples: samples in the dataset (IDs ``0..num_samples-1``).
        batch_size: samples per batch.
        drop_last: drop the last incomplete batch of each epoch (as ``DataLoader``).
        seed: seed of the built-in shuffle (ignored for a user sampler).
        shuffle: whether the built-in sampler shuffles.
        rank: this rank when the built-in sampler splits the data (``DistributedSampler``).
        world_size: number of ranks sharing each epoch.
        dataset: the dataset's name, for messages.

    Raises:
        ConfigError: ``rank``/``world_size`` given together with a sampler, or out of range.
    """

    def __init__(
        self,
        sampler: Iterable[int] | None,
        *,
        num_samples: int,
        batch_size: int,
        drop_last: bool,
        seed: int,
        shuffle: bool,
        rank: int | None,
        world_size: int | None,
        dataset: str,
    ) -> None:
        self.dataset = dataset
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.seed = seed
        if sampler is not None and (rank is not None or world_size is not None):
            raise ConfigError(
                "give either a sampler or rank/world_size (which build a DistributedSampler), not both",
                field="sampler",
                value=type(sampler).__name__,
            )
        if sampler is None:
            world = 1 if world_size is None else world_size
            me = 0 if rank is None else rank
            if isinstance(world, bool) or not isinstance(world, int) or world < 1:
                raise ConfigError(
                    f"world_size must be a positive integer, got {world_size!r}", field="world_size", value=world_size
                )
            if isinstance(me, bool) or not isinstance(me, int) or not 0 <= me < world:
                raise ConfigError(f"rank must be in 0..{world - 1}, got {rank!r}", field="rank", value=rank)
            sampler = DistributedSampler(
                _IdRange(num_samples), num_replicas=world, rank=me, shuffle=shuffle, seed=seed, drop_last=False
            )
        self.sampler = sampler
        self.deterministic = type(sampler) in _DETERMINISTIC
        self.identity = _describe(sampler)

    def samples_per_epoch(self) -> int:
        """IDs the sampler yields per epoch.

        Raises:
            ConfigError: the sampler has no length.
        """
        try:
            return len(self.sampler)  # type: ignore[arg-type]
        except TypeError as exc:
            raise ConfigError(
                f"sampler {self.identity} has no len(); KSpeed needs the epoch's length",
                field="sampler",
                value=self.identity,
            ) from exc

    def num_batches(self) -> int:
        """Batches per epoch."""
        n = self.samples_per_epoch()
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Keep the user's sampler in step (``set_epoch`` as a DataLoader user would call it)."""
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def order(self, epoch: int) -> np.ndarray:
        """The IDs of ``epoch`` in delivery order (the last partial batch cut with ``drop_last``).

        Deterministic samplers are copied and set to ``epoch``; others are iterated in place.

        Raises:
            DatasetError: the sampler yielded an ID outside the dataset (named).
        """
        if self.deterministic:
            sampler = copy.copy(self.sampler)
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
        else:
            sampler = self.sampler
        ids = np.fromiter((int(i) for i in sampler), dtype=np.int64)
        if self.drop_last:
            ids = ids[: len(ids) - len(ids) % self.batch_size]
        bad = np.flatnonzero((ids < 0) | (ids >= self.num_samples))
        if len(bad):
            sample = int(ids[bad[0]])
            raise DatasetError(
                f"dataset {self.dataset!r} has {self.num_samples} samples (IDs 0.."
                f"{self.num_samples - 1}); the sampler yielded sample {sample}",
                dataset=self.dataset,
                sample=sample,
            )
        return ids
