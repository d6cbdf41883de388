"""Delivery from a device ring: servers write batches straight into GPU memory (GPUDirect RDMA).

On a rail whose capabilities say ``device_memory`` (``verbs``), ``device="cuda"`` can take its
receive ring from GPU memory (:class:`~kspeed.rdma.device_memory.DeviceMemory`: one allocation
exported as a dma-buf, registered with the NIC), so a batch reaches the GPU with no copy:

- before a batch is handed out, the NIC's writes are flushed to the GPU
  (``cuFlushGPUDirectRDMAWrites``, where the GPU does not order them for its kernels anyway): its
  completions say the bytes left the NIC, the flush that the GPU's kernels will see them;
- ``batch.samples`` are views of the ring on the device (through cupy's DLPack export, a view per
  batch whose lifetime the ring follows);
- the ring range is given back once the batch was released (or its last view collected) and an
  event recorded on the consumer's stream at that moment has completed, so no kernel queued on the
  batch reads bytes the NIC already overwrites.

Without GPUDirect (no ``verbs``, no dma-buf support, ``gpudirect: false``) a CUDA device takes one
copy from the pinned host ring (:class:`~kspeed.client.delivery.device.CudaDelivery`), and the builder says
why once. Every device call goes through :class:`RingViews` and the
:class:`~kspeed.client.delivery.device.CudaBackend`, so this runs on a CPU with stand-ins
(``tests/client/test_device_ring.py``); the CUDA path runs only on a GPU (``gpu`` marker).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from kspeed.client.batch import Batch, BatchMeta, make_batch
from kspeed.client.delivery.device import CudaBackend, EventedDelivery
from kspeed.errors import RailUnavailableError, TransportError
from kspeed.rdma.device_memory import CudaDriver, DeviceMemory
from kspeed.rdma.rails import capabilities

__all__ = ["CupyRingViews", "DeviceRingDelivery", "RingViews", "device_ring"]


class RingViews(Protocol):
    """Tensors over ranges of a device ring."""

    def view(self, offset: int, nbytes: int) -> tuple[torch.Tensor, object]:
        """A ``uint8`` tensor of ``nbytes`` at ``offset`` on the device, and an object that lives as
        long as any view of that tensor does (its collection means none is left)."""

    def flush(self) -> None:
        """Make the NIC's writes so far visible to the device's kernels."""


class _Lease:
    """Lives while any view of one batch's ring range does (see :meth:`CupyRingViews.view`)."""

    __slots__ = ("__weakref__", "offset")

    def __init__(self, offset: int) -> None:
        self.offset = offset


class CupyRingViews:
    """:class:`RingViews` of a :class:`DeviceMemory`, through cupy (torch cannot wrap a raw pointer).

    Each view is a cupy array over the range, owned by a :class:`_Lease`, handed to torch through
    DLPack: torch's storage holds the cupy array, which holds the lease, so the lease is collected
    when torch frees the last view.
    """

    def __init__(self, memory: DeviceMemory) -> None:
        import cupy

        self._cupy = cupy
        self._memory = memory

    def view(self, offset: int, nbytes: int) -> tuple[torch.Tensor, object]:
        cupy = self._cupy
        lease = _Lease(offset)
        with cupy.cuda.Device(self._memory.device):
            unowned = cupy.cuda.UnownedMemory(self._memory.ptr + offset, nbytes, lease, self._memory.device)
            array = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(unowned, 0))
            return torch.from_dlpack(array), lease

    def flush(self) -> None:
        self._memory.flush()


class _Done:
    """The event of work that never was (a device ring has no copy to wait for)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class DeviceRingDelivery(EventedDelivery):
    """Batches as views of a device ring: no copy (see the module's docstring).

    Args:
        device: the CUDA device the ring is on.
        views: tensors over the ring (:class:`CupyRingViews` of its memory).
        backend: the consumer-stream events (default :class:`~kspeed.client.delivery.device.TorchCuda`).
    """

    def __init__(self, device: torch.device, views: RingViews, backend: CudaBackend | None = None) -> None:
        super().__init__(device, backend)
        self._views = views

    def attach(self, ring: np.ndarray | None) -> None:
        """Nothing to prepare: the ring is device memory, registered with the NIC by the rail."""

    def deliver(
        self, ring: np.ndarray | None, offset: int, footprint: int, meta: BatchMeta, release: Callable[[int], None]
    ) -> Batch:
        """The batch at ``offset`` of the device ring (``ring``, the host ring, is ``None`` here);
        ``release(offset)`` is called from :meth:`poll` once it may be written again."""
        deferred = self._releases(release)
        self._views.flush()  # the completions came: the bytes are in the GPU's memory, now visible
        base, lease = self._views.view(offset, footprint)
        deferred.add(offset, _Done(), hold=True)
        return make_batch(base, footprint, meta, self._freed_when(deferred, lease, offset))

    def close(self) -> None:
        """Nothing to undo: the rail's receiver gives the memory back when it closes."""


def device_ring(
    enabled: bool, rail: str, device: torch.device, nbytes: int, driver: CudaDriver | None = None
) -> tuple[DeviceMemory | None, str]:
    """A device ring of at least ``nbytes`` on ``device`` for ``rail``, or ``None`` and why not.

    Args:
        enabled: the client's ``gpudirect`` setting.
        rail: the rail the feed uses (its capabilities must say ``device_memory``).
        device: the CUDA device batches go to.
        nbytes: the ring's size.
        driver: the CUDA driver calls (default cuda-python's).
    """
    if not enabled:
        return None, "gpudirect is off"
    if not capabilities(rail).device_memory:
        return None, f"rail {rail} cannot write into GPU memory"
    if importlib.util.find_spec("cupy") is None:  # (what views the ring on the device)
        return None, "cupy is not installed (pip install 'kspeed[gpu]')"
    try:
        return DeviceMemory.allocate(device.index or 0, nbytes, driver), ""
    except (RailUnavailableError, TransportError) as exc:
        return None, str(exc)
