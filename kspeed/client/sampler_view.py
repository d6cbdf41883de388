"""A KSpeed dataset's ``.sampler``: the epoch control that trainers reach through a loader's sampler.

PyTorch Lightning sets each epoch by calling ``set_epoch`` on the sampler of whatever its
``train_dataloader()`` returned (``loader.sampler``, or ``loader.batch_sampler.sampler``), never on
the loader itself, and scripts written for a ``DataLoader`` over a ``DistributedSampler`` do the
same. A KSpeed dataset returned from ``train_dataloader()`` without this got no epoch: every epoch
was delivered in epoch 0's order. ``ds.sampler.set_epoch(e)`` is ``ds.set_epoch(e)``.

It is not a sampler to iterate: the dataset draws each epoch's order itself, once (a sampler of
the caller's that is not deterministic would draw a different order if iterated here).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["SamplerView"]


class _Epochs(Protocol):
    """What a :class:`SamplerView` drives: a dataset's ``set_epoch`` and ``epoch``."""

    def set_epoch(self, epoch: int) -> None: ...

    @property
    def epoch(self) -> int: ...


class SamplerView:
    """``set_epoch``, ``epoch`` and ``len()`` of a KSpeed dataset, where trainers look for a sampler's.

    Args:
        owner: the dataset whose ``set_epoch`` is called (a :class:`~kspeed.KSpeedDataset`, or the
            :class:`~kspeed.client.prepared.PreparedDataset` over one).
        samples: the samples this rank receives per epoch (what ``len()`` of a ``DistributedSampler`` says).
        sampler: the torch sampler that draws each epoch's order (the caller's, or the built-in one).
    """

    def __init__(self, owner: _Epochs, samples: Callable[[], int], sampler: Any) -> None:
        self._owner = owner
        self._samples = samples
        self.sampler = sampler

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch the next iteration delivers (the dataset's ``set_epoch``)."""
        self._owner.set_epoch(epoch)

    @property
    def epoch(self) -> int:
        """The dataset's current epoch."""
        return self._owner.epoch

    def __len__(self) -> int:
        """Samples this rank receives per epoch."""
        return self._samples()

    def __repr__(self) -> str:
        return f"SamplerView(epoch={self.epoch}, samples={len(self)}, sampler={self.sampler!r})"
