"""A delivered batch: zero-copy tensors over the bytes the servers wrote into the receive ring.

Each batch gets one ``uint8`` base tensor over its own ring range (``torch.frombuffer`` of a numpy
slice); every sample is a ``narrow()`` of it, so the per-sample work is one view. The base tensor's
storage keeps that numpy slice alive, and a ``weakref.finalize`` on the slice gives the range back
to the ring once the last view of the batch (sample tensor, numpy array, DLPack capsule) is
collected, or at once when :meth:`Batch.release` is called.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.utils.dlpack
from torch.utils.data._utils.collate import default_collate_fn_map

from kspeed.errors import DatasetError, StateError

__all__ = ["WAV_HEADER", "Batch", "BatchMeta", "make_batch", "ring_batch", "split_samples"]

#: Bytes of a canonical RIFF/WAVE header before the PCM samples.
WAV_HEADER = 44


class Batch:
    """One batch of samples, in the sampler's order.

    Unpacks as ``samples, labels = batch`` (a training loop's ``inputs, targets``); ``len(batch)`` is
    its number of samples.

    Attributes:
        ids: ``int64`` sample IDs.
        labels: ``int64`` labels (-1 where the dataset has none).
        samples: one ``uint8`` tensor per sample, viewing the received bytes (no copy).
        epoch: the epoch it belongs to.
        index: its batch number within the epoch.
    """

    __slots__ = ("_base", "_finalizer", "_footprint", "_meta", "_source", "epoch", "ids", "index", "labels", "samples")

    def __init__(
        self,
        base: torch.Tensor,
        footprint: int,
        meta: BatchMeta,
        finalizer: weakref.finalize,
        source: Batch | None = None,
    ) -> None:
        self.epoch = meta.epoch
        self.index = meta.index
        self.ids = torch.from_numpy(meta.ids.copy())
        self.labels = torch.from_numpy(meta.labels.copy())
        self.samples = split_samples(base, meta.offsets, meta.lengths, footprint)
        self._base: torch.Tensor | None = base
        self._footprint = footprint
        self._meta = meta
        self._finalizer = finalizer
        self._source = source  # the batch this one was copied from, alive until this one is

    def __len__(self) -> int:
        return len(self.samples)

    def __iter__(self) -> Iterator[list[torch.Tensor] | torch.Tensor]:
        """``samples, labels = batch``."""
        return iter((self.samples, self.labels))

    def __repr__(self) -> str:
        state = "released" if self.released else f"{int(self._meta.lengths.sum())} bytes on {self.device}"
        return f"Batch(epoch={self.epoch}, index={self.index}, samples={len(self)}, {state})"

    @property
    def lengths(self) -> np.ndarray:
        """Sample lengths in bytes."""
        return self._meta.lengths

    @property
    def remote(self) -> np.ndarray:
        """Per sample, whether the servers ran the pipeline's server stages on it (all ``False`` without)."""
        if self._meta.remote is None:
            return np.zeros(len(self._meta.ids), dtype=bool)
        return self._meta.remote

    @property
    def device(self) -> torch.device:
        """Where the batch's bytes are."""
        return self._live_base().device

    @property
    def released(self) -> bool:
        """Whether the ring range was given back (views may then see newer bytes)."""
        return not self._finalizer.alive

    def _live_base(self) -> torch.Tensor:
        if self.released or self._base is None:
            raise StateError(f"batch {self.index} of epoch {self.epoch} was released; its bytes may be overwritten")
        return self._base

    def _sample(self, i: int) -> torch.Tensor:
        self._live_base()
        return self.samples[i]

    def to(self, device: str | torch.device, non_blocking: bool = False) -> Batch:
        """The batch on ``device``: one copy of its whole range, the samples as views of the copy.

        The copy keeps this batch (and so its ring range) alive for as long as it lives itself, so
        a ``non_blocking`` copy never reads bytes the servers are already overwriting. On the
        batch's own device it returns the batch itself.
        """
        target = torch.device(device)
        base = self._live_base()
        if target == base.device or (target.type == base.device.type and target.index is None):
            return self
        moved = base.to(target, non_blocking=non_blocking)
        return Batch(moved, self._footprint, self._meta, weakref.finalize(moved, _nothing), source=self)

    def pin_memory(self) -> Batch:
        """The batch copied into page-locked host memory (what ``DataLoader(pin_memory=True)`` calls)."""
        pinned = self._live_base().pin_memory()
        return Batch(pinned, self._footprint, self._meta, weakref.finalize(pinned, _nothing), source=self)

    def numpy(self, i: int) -> np.ndarray:
        """Sample ``i`` as a ``uint8`` numpy array (no copy)."""
        return self._sample(i).numpy()

    def array(self, i: int) -> np.ndarray:
        """Sample ``i`` as the row it was in an ``.npy`` dataset: its dtype and shape (no copy).

        Raises:
            DatasetError: the dataset declares no dtype (it is not an ``.npy`` array).
        """
        if not self._meta.dtype:
            raise DatasetError(
                f"sample {int(self.ids[i])}: the dataset declares no dtype and shape (only .npy datasets do); "
                "use numpy(i) for its bytes"
            )
        return self.numpy(i).view(np.dtype(self._meta.dtype)).reshape(self._meta.shape)

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
        base = self._live_base()
        lengths = self._meta.lengths
        if len(lengths) == 0:
            return torch.empty((0, 0), dtype=torch.uint8, device=base.device)
        length = int(lengths[0])
        if (lengths != length).any():
            raise StateError(
                f"batch {self.index} of epoch {self.epoch} holds samples of {int(lengths.min())}.."
                f"{int(lengths.max())} bytes; a stacked view needs equal lengths"
            )
        offsets = self._meta.offsets
        stride = int(offsets[1] - offsets[0]) if len(offsets) > 1 else 0
        return base.as_strided((len(lengths), length), (stride, 1))

    def release(self) -> None:
        """Give the ring range back now, without waiting for the views to be collected.

        Views still held afterwards may see the bytes of later batches.
        """
        self._finalizer()
        self.samples = []
        self._base = None
        if self._source is not None:
            self._source.release()


def _nothing() -> None:
    """The finalizer of a batch's copy: its memory is torch's, nothing to give back."""


def _refuse_collate(batch: object, *, collate_fn_map: object = None) -> object:
    raise StateError(
        "DataLoader(dataset, batch_size=N) collates KSpeed batches into batches of batches: a KSpeedDataset "
        "already yields whole batches. Use DataLoader(dataset, batch_size=None) and set the batch size with "
        "client.dataset(..., batch_size=N)"
    )


# DataLoader's default collation meets a Batch only when batch_size is not None: refuse it, naming the fix.
default_collate_fn_map[Batch] = _refuse_collate


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
        remote: per sample, whether the servers ran the pipeline's server stages on it
            (``None``: every sample is the raw one).
        dtype, shape: an ``.npy`` dataset's row dtype and shape ("" and (): none declared).
    """

    epoch: int
    index: int
    ids: np.ndarray
    labels: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    remote: np.ndarray | None = None
    dtype: str = ""
    shape: tuple[int, ...] = ()


def make_batch(base: torch.Tensor, footprint: int, meta: BatchMeta, finalizer: weakref.finalize) -> Batch:
    """A batch of views over ``base``, its ``footprint`` bytes (host ring or device copy).

    Args:
        base: the batch's bytes as one ``uint8`` tensor.
        footprint: bytes reserved for the batch.
        meta: which batch it is and where its samples lie.
        finalizer: gives the range back once the batch is released or no view of it remains.
    """
    return Batch(base, footprint, meta, finalizer)


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
