"""A host stand-in for a GPU that exports its memory as a dma-buf, for the device-ring tests on CPU.

:class:`HostDriver` is a :class:`~kspeed.rdma.device_memory.CudaDriver` whose "device memory" is a
memfd mapped in this process (the memfd plays the dma-buf: the strict double of pyverbs maps what
it is given, as a NIC reaches GPU memory through its exporter); :class:`HostRingViews` gives the
tensors a GPU's views would be, over that mapping. Nothing here pretends to be CUDA beyond the
calls' bookkeeping: the ``gpu`` tests use the real driver.
"""

from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np
import torch

from kspeed.rdma.device_memory import DeviceMemory

__all__ = ["HostDriver", "HostRingViews"]


class HostDriver:
    """:class:`~kspeed.rdma.device_memory.CudaDriver` on host memory (see the module's docstring).

    Args:
        why: what :meth:`unavailable` answers (``None``: the "device" takes a NIC's writes).
    """

    def __init__(self, why: str | None = None) -> None:
        self.why = why
        self.flushes = 0
        self.freed: list[int] = []
        self.maps: dict[int, tuple[int, mmap.mmap, ctypes.c_char]] = {}

    def unavailable(self, device: int) -> str | None:
        return self.why

    def allocate(self, device: int, nbytes: int) -> int:
        fd = os.memfd_create(f"standin-gpu{device}")
        os.ftruncate(fd, nbytes)
        mapping = mmap.mmap(fd, nbytes)
        first = ctypes.c_char.from_buffer(mapping)
        ptr = ctypes.addressof(first)
        self.maps[ptr] = (fd, mapping, first)
        return ptr

    def export_dmabuf(self, ptr: int, nbytes: int) -> int:
        return os.dup(self.maps[ptr][0])

    def needs_flush(self, device: int) -> bool:
        return True

    def flush(self, device: int) -> None:
        self.flushes += 1

    def free(self, device: int, ptr: int) -> None:
        fd, mapping, first = self.maps.pop(ptr)
        del first
        os.close(fd)
        mapping.close()  # (raises BufferError while a view of it is alive: a leak the test would see)
        self.freed.append(ptr)

    def window(self, memory: DeviceMemory, offset: int, nbytes: int) -> np.ndarray:
        """The bytes of ``memory`` at ``offset``, as the device would see them."""
        return np.frombuffer(self.maps[memory.ptr][1], np.uint8, nbytes, offset)


class HostRingViews:
    """:class:`~kspeed.client.delivery.device_ring.RingViews` over a :class:`HostDriver`'s memory."""

    def __init__(self, driver: HostDriver, memory: DeviceMemory) -> None:
        self.driver, self.memory = driver, memory

    def view(self, offset: int, nbytes: int) -> tuple[torch.Tensor, object]:
        window = self.driver.window(self.memory, offset, nbytes)
        return torch.frombuffer(window, dtype=torch.uint8), window  # the tensor keeps the window alive

    def flush(self) -> None:
        self.memory.flush()
