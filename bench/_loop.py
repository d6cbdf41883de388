"""The benchmark's training loop: the same cheap touch of every sample and the timing of batch waits.

Every system is driven through one interface, a *source*: ``source.epoch(e)`` returns an iterator
of batches, each with ``samples`` (a list of uint8 tensors, in host memory or all on one CUDA
device) and ``release()``. The loop times each ``next()`` (the batch wait the training step would
see), reads the first byte of every sample (so bytes that were never delivered cannot be counted)
and releases the batch. Whole epochs are measured, so every system delivers exactly the same
samples, and the touched bytes must add up to the sample set's checksum.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

__all__ = ["Measurement", "Source", "measure", "touch", "touch_device"]

_byte_at = ctypes.c_uint8.from_address  # ~0.4 µs a sample; torch indexing costs ~3 µs


class Source(Protocol):
    """What the loop needs from a system under test."""

    def epoch(self, epoch: int) -> Any:
        """An iterable of batches (``.samples``, ``.release()``) covering one epoch."""

    def close(self) -> None:
        """Stop whatever the source started."""


@dataclass
class Measurement:
    """Throughput and batch waits of one system over whole epochs."""

    samples: int
    nbytes: int
    seconds: float
    epochs: int
    waits_s: np.ndarray

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9

    def wait_ms(self, q: float) -> float:
        """The ``q``-th percentile of the batch waits, in milliseconds."""
        return float(np.percentile(self.waits_s, q) * 1e3) if len(self.waits_s) else float("nan")


def touch(samples: list) -> int:
    """Read the first byte of every sample tensor; returns their sum.

    Host samples are read in place through ctypes. CUDA samples are read on their device
    (:func:`touch_device`), and the sum comes back with ``.item()``, which waits for the batch's
    copy as a training step consuming it would.
    """
    if samples and samples[0].is_cuda:  # one branch a batch keeps the host path as fast as it was
        return touch_device(samples)
    return sum(_byte_at(t.data_ptr()).value for t in samples)


def touch_device(samples: list[torch.Tensor]) -> int:
    """The sum of the first bytes of ``uint8`` CUDA tensors, gathered on the device in one indexing op.

    When every sample lies in the first one's allocation (views of one batch copy: KSpeed's and the
    pinned DataLoader's batches), their first bytes are gathered at their offsets into that storage:
    about 0.2 µs a sample on the host, where a ``t[0]`` per sample costs several. Otherwise one
    ``torch.cat`` of one-byte views does the gather.
    """
    first = samples[0]
    storage = first.untyped_storage()
    base, nbytes = storage.data_ptr(), storage.nbytes()
    offsets = np.fromiter((t.data_ptr() for t in samples), dtype=np.int64, count=len(samples)) - base
    if (offsets >= 0).all() and (offsets < nbytes).all():
        whole = first.as_strided((nbytes,), (1,), 0)  # the storage from its start, as uint8
        firsts = whole[torch.from_numpy(offsets).to(first.device)]
    else:
        firsts = torch.cat([t[:1] for t in samples])
    return int(firsts.sum(dtype=torch.int64).item())


def _run_epoch(source: Source, epoch: int, waits: list[float] | None) -> tuple[int, int]:
    """One epoch through the loop; returns (samples, checksum of touched bytes)."""
    count = checksum = 0
    clock = time.perf_counter
    it = iter(source.epoch(epoch))
    while True:
        t0 = clock()
        batch = next(it, None)
        if batch is None:
            break
        if waits is not None:
            waits.append(clock() - t0)
        samples = batch.samples
        checksum += touch(samples)
        count += len(samples)
        batch.release()
    return count, checksum


def measure(
    source: Source,
    *,
    count: int,
    epoch_bytes: int,
    checksum: int,
    seconds: float,
    warmup_epochs: int = 1,
    min_epochs: int = 1,
) -> Measurement:
    """Run whole epochs until ``seconds`` have passed (after the warm-up) and time them.

    Raises:
        RuntimeError: an epoch delivered the wrong number of samples or the wrong bytes.
    """

    def check(epoch: int, got: tuple[int, int]) -> None:
        if got != (count, checksum):
            raise RuntimeError(
                f"epoch {epoch}: {got[0]} samples with touched-byte sum {got[1]}, expected {count} with sum {checksum}"
            )

    for e in range(warmup_epochs):
        check(e, _run_epoch(source, e, None))
    waits: list[float] = []
    epochs = 0
    t0 = time.perf_counter()
    while True:
        check(warmup_epochs + epochs, _run_epoch(source, warmup_epochs + epochs, waits))
        epochs += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds and epochs >= min_epochs:
            break
    return Measurement(
        samples=epochs * count, nbytes=epochs * epoch_bytes, seconds=elapsed, epochs=epochs, waits_s=np.asarray(waits)
    )
