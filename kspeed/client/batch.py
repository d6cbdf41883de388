"""A delivered batch: zero-copy tensors over the bytes the servers wrote into the receive ring.

Each batch gets one ``uint8`` base tensor over its own ring range (``torch.frombuffer`` of a numpy
slice); every sample is a ``narrow()`` of it, so the per-sample work is one view. The base tensor's
storage keeps that numpy slice alive, and a ``weakref.finalize`` on the slice gives the range back
to the ring once the last view of the batch (sample tensor, numpy array, DLPack capsule) is
collected, or at once when :meth:`Batch.release` is called.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.utils.dlpack

from kspeed.errors import DatasetError, StateError

__all__ = ["WAV_HEADER", "Batch", "BatchMeta", "make_batch", "ring_batch", "split_samples"]

#: Bytes of a canonical RIFF/WAVE header before the PCM samples.
WAV_HEADER = 44


class Batch:
    """One batch of samples, in the sampler's order.

    Attributes:
        ids: ``int64`` sample IDs.
        labels: ``int64`` labels (-1 where the dataset has none).
        samples: one ``uint8`` tensor per sample, viewing the received bytes (no copy).
        epoch: the epoch it belongs to.
        index: its batch number within the epoch.
    """

    __slots__ = ("_finalizer", "_lengths", "_stride", "epoch", "ids", "index", "labels", "samples")

    def __init__(
        self,
        *,
        epoch: int,
        index: int,
        ids: torch.Tensor,
        labels: torch.Tensor,
        samples: list[torch.Tensor],
        lengths: np.ndarray,
        finalizer: weakref.finalize,
        stride: int,
    ) -> None:
        self.epoch = epoch
        self.index = index
        self.ids = ids
        self.labels = labels
        self.samples = samples
        self._lengths = lengths
        self._finalizer = finalizer
        self._stride = stride

    def __len__(self) -> int:
        return len(self.samples)

    def __repr__(self) -> str:
        state = "released" if self.released else f"{int(self._lengths.sum())} bytes"
        return f"Batch(epoch={self.epoch}, index={self.index}, samples={len(self)}, {state})"

    @property
    def lengths(self) -> np.ndarray:
        """Sample lengths in bytes."""
        return self._lengths

    @property
    def released(self) -> bool:
        """Whether the ring range was given back (views may then see newer bytes)."""
        return not self._finalizer.alive

    def _sample(self, i: int) -> torch.Tensor:
        if self.released:
            raise StateError(f"batch {self.index} of epoch {self.epoch} was released; its bytes may be overwritten")
        return self.samples[i]

    def numpy(self, i: int) -> np.ndarray:
        """Sample ``i`` as a ``uint8`` numpy array (no copy)."""
        return self._sample(i).numpy()

    def tensor(self, i: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """Sample ``i`` reinterpreted as ``dtype`` (no copy; samples start 8-byte aligned).

        Raises:
            DatasetError: the sample's length is not a multiple of the dtype's size.
        """
        sample = self._sample(i)
        size = torch.empty((), dtype=dtype).element_size()
        if sample.numel() % size:
            raise DatasetError(
                f"sample {int(self.ids[i])} has {sample.numel()} bytes, not a whole number of "
                f"{dtype} values ({size} bytes each)",
                sample=int(self.ids[i]),
            )
        return sample.view(dtype)

    def wav(self, i: int) -> torch.Tensor:
        """The 16-bit PCM samples of a WAV sample: an ``int16`` view past the 44-byte header (no copy).

        Raises:
            DatasetError: the sample is shorter than the header or has an odd number of PCM bytes.
        """
        sample = self._sample(i)
        n = sample.numel() - WAV_HEADER
        if n < 0 or n % 2:
            raise DatasetError(
                f"sample {int(self.ids[i])} of {sample.numel()} bytes is not 16-bit PCM after a "
                f"{WAV_HEADER}-byte WAV header",
                sample=int(self.ids[i]),
            )
        return sample.narrow(0, WAV_HEADER, n).view(torch.int16)

    def dlpack(self, i: int) -> object:
        """A DLPack capsule of sample ``i`` (``torch.utils.dlpack``); it keeps the bytes alive."""
        return torch.utils.dlpack.to_dlpack(self._sample(i))

    @property
    def data(self) -> torch.Tensor:
        """All samples as one ``(B, L)`` ``uint8`` view when they have equal lengths (no copy).

        Raises:
            StateError: the samples' lengths differ (use :attr:`samples`).
        """
        if self.released:
            raise StateError(f"batch {self.index} of epoch {self.epoch} was released")
        if len(self._lengths) == 0:
            return torch.empty((0, 0), dtype=torch.uint8)
        length = int(self._lengths[0])
        if (self._lengths != length).any():
            raise StateError(
                f"batch {self.index} of epoch {self.epoch} holds samples of {int(self._lengths.min())}.."
                f"{int(self._lengths.max())} bytes; a stacked view needs equal lengths"
            )
        base = self.samples[0]
        return base.as_strided((len(self._lengths), length), (self._stride, 1))

    def release(self) -> None:
        """Give the ring range back now, without waiting for the views to be collected.

        Views still held afterwards may see the bytes of later batches.
        """
        self._finalizer()
        self.samples = []


@dataclass(frozen=True)
class BatchMeta:
    """What a ring range holds: which batch, its samples and where each lies in the range.

    Attributes:
        epoch: the batch's epoch.
        index: its batch number within the epoch.
        ids: its sample IDs.
        labels: their labels.
        offsets: each sample's offset within the batch.
        lengths: each sample's length.
    """

    epoch: int
    index: int
    ids: np.ndarray
    labels: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray


def make_batch(base: torch.Tensor, footprint: int, meta: BatchMeta, finalizer: weakref.finalize) -> Batch:
    """A batch of views over ``base``, its ``footprint`` bytes (host ring or device copy).

    Args:
        base: the batch's bytes as one ``uint8`` tensor.
        footprint: bytes reserved for the batch.
        meta: which batch it is and where its samples lie.
        finalizer: gives the range back once the batch is released or no view of it remains.
    """
    offsets = meta.offsets
    return Batch(
        epoch=meta.epoch,
        index=meta.index,
        ids=torch.from_numpy(meta.ids.copy()),
        labels=torch.from_numpy(meta.labels.copy()),
        samples=split_samples(base, offsets, meta.lengths, footprint),
        lengths=meta.lengths,
        finalizer=finalizer,
        stride=int(offsets[1] - offsets[0]) if len(offsets) > 1 else 0,
    )


def ring_batch(ring: np.ndarray, offset: int, footprint: int, meta: BatchMeta, on_free: Callable[[int], None]) -> Batch:
    """A batch of zero-copy views over ``ring[offset:offset + footprint]``.

    ``on_free(offset)`` is called once no view of the batch remains (from any thread).
    """
    window = ring[offset : offset + footprint]
    base = torch.frombuffer(window, dtype=torch.uint8)
    finalizer = weakref.finalize(window, on_free, offset)
    del window
    return make_batch(base, footprint, meta, finalizer)


def split_samples(base: torch.Tensor, offsets: np.ndarray, lengths: np.ndarray, footprint: int) -> list[torch.Tensor]:
    """Views of each sample of a batch whose ``footprint`` bytes are ``base`` (on any device).

    Args:
        base: the batch's bytes as one ``uint8`` tensor of ``footprint`` elements.
        offsets: each sample's offset within the batch (the first is 0).
        lengths: each sample's length.
        footprint: bytes reserved for the batch.
    """
    # One split into [sample, gap, sample, gap, ...] makes every view in one call (narrow() per
    # sample costs about half again as much per view); kspeed.layout.batch_layout starts a batch's
    # first sample at offset 0.
    sizes = np.empty(2 * len(lengths), dtype=np.int64)
    sizes[0::2] = lengths
    sizes[1::2] = np.append(offsets[1:], footprint) - offsets - lengths
    return list(base.split(sizes.tolist())[0::2])
