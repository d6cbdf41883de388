"""GPU memory a NIC writes into (GPUDirect RDMA): one whole CUDA allocation exported as a dma-buf.

A device ring is one ``cuMemAlloc`` allocation, its size rounded up to whole 2 MiB GPU pages (a
dma-buf covers page-aligned ranges of one allocation, ``cuMemGetHandleForAddressRange``), with
``CU_POINTER_ATTRIBUTE_SYNC_MEMOPS`` set as NVIDIA's GPUDirect RDMA guide asks for memory a
third-party device writes. It is exported once as a dma-buf file descriptor, which the ``verbs``
receiver process registers with ``ibv_reg_dmabuf_mr`` (writers then address it by IOVA: its
offset). Before a kernel reads what the NIC wrote, :meth:`DeviceMemory.flush` calls
``cuFlushGPUDirectRDMAWrites`` unless the device orders such writes for its own kernels anyway
(``CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING``).

Every CUDA driver call goes through a :class:`CudaDriver` (:class:`CudaBindings`: cuda-python's
``cuda.bindings.driver``, the ``gpu`` extra), so the bookkeeping runs on a CPU with a stand-in
(``tests/client/device_ring.py``: a memfd plays the dma-buf). The training process sees the memory
as a ``torch`` tensor through cupy (:mod:`kspeed.client.delivery.device`); nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any, Protocol

from kspeed.errors import RailUnavailableError, TransportError

__all__ = ["GPU_PAGE", "CudaBindings", "CudaDriver", "DeviceMemory", "gpudirect_unavailable"]

log = logging.getLogger(__name__)

#: GPU page size: a device ring's size is rounded up to it.
GPU_PAGE = 2 << 20


class CudaDriver(Protocol):
    """The CUDA driver calls of a device ring (each raises :class:`TransportError` naming the call)."""

    def unavailable(self, device: int) -> str | None:
        """Why the NIC cannot write into device ``device`` (``None``: it can, through a dma-buf)."""

    def allocate(self, device: int, nbytes: int) -> int:
        """A device pointer to ``nbytes`` (whole GPU pages) on ``device``, its context made current."""

    def export_dmabuf(self, ptr: int, nbytes: int) -> int:
        """A dma-buf file descriptor of ``[ptr, ptr + nbytes)`` (the caller closes it)."""

    def needs_flush(self, device: int) -> bool:
        """Whether writes of a NIC must be flushed before this device's kernels see them."""

    def flush(self, device: int) -> None:
        """Make the NIC's writes so far visible to this device's kernels."""

    def free(self, device: int, ptr: int) -> None:
        """Free an allocation of :meth:`allocate`."""


def _fail(call: str, result: Any) -> TransportError:
    return TransportError(f"CUDA {call} failed: {result}")


class CudaBindings:
    """:class:`CudaDriver` on cuda-python's driver bindings (``cuda.bindings.driver``).

    Raises:
        RailUnavailableError: cuda-python is not installed.
    """

    def __init__(self) -> None:
        try:
            from cuda.bindings import driver
        except ImportError as exc:
            raise RailUnavailableError(
                f"cuda-python is not installed ({exc}); install kspeed[gpu] for GPUDirect rings"
            ) from exc
        self._cu = driver
        self._contexts: dict[int, tuple[Any, Any]] = {}  # device -> (its handle, its primary context), retained once

    def _call(self, name: str, *args: Any) -> Any:
        cu = self._cu
        try:
            result = getattr(cu, name)(*args)
        except RuntimeError as exc:  # no driver library (cuda.pathfinder's DynamicLibNotFoundError)
            raise _fail(name, exc) from exc
        error, rest = (result[0], result[1:]) if isinstance(result, tuple) else (result, ())
        if error != cu.CUresult.CUDA_SUCCESS:
            _, text = cu.cuGetErrorString(error)
            raise _fail(name, f"{error.name} ({text.decode() if isinstance(text, bytes) else text})")
        return rest[0] if len(rest) == 1 else rest

    def _context(self, device: int) -> Any:
        """Make ``device``'s primary context (the one torch uses) current in this thread; return its
        device handle. The context is retained once per process, for the process's life."""
        known = self._contexts.get(device)
        if known is None:
            self._call("cuInit", 0)
            handle = self._call("cuDeviceGet", device)
            known = self._contexts[device] = (handle, self._call("cuDevicePrimaryCtxRetain", handle))
        self._call("cuCtxSetCurrent", known[1])
        return known[0]

    def _attribute(self, device: int, name: str) -> int:
        handle = self._context(device)
        return int(self._call("cuDeviceGetAttribute", getattr(self._cu.CUdevice_attribute, name), handle))

    def unavailable(self, device: int) -> str | None:
        try:
            if not self._attribute(device, "CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED"):
                return f"CUDA device {device} does not support GPUDirect RDMA"
            if not self._attribute(device, "CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED"):
                return f"CUDA device {device} cannot export its memory as a dma-buf (driver or kernel too old)"
        except TransportError as exc:
            return str(exc)
        return None

    def allocate(self, device: int, nbytes: int) -> int:
        self._context(device)
        ptr = self._call("cuMemAlloc", nbytes)
        try:
            attribute = self._cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_SYNC_MEMOPS
            self._call("cuPointerSetAttribute", 1, attribute, ptr)
        except TransportError:
            self._call("cuMemFree", ptr)
            raise
        return int(ptr)

    def export_dmabuf(self, ptr: int, nbytes: int) -> int:
        kind = self._cu.CUmemRangeHandleType.CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD
        return int(self._call("cuMemGetHandleForAddressRange", ptr, nbytes, kind, 0))

    def needs_flush(self, device: int) -> bool:
        ordering = self._attribute(device, "CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING")
        owner = int(self._cu.CUGPUDirectRDMAWritesOrdering.CU_GPU_DIRECT_RDMA_WRITES_ORDERING_OWNER)
        return ordering < owner  # ordered for the owning device's kernels already: the flush is a no-op

    def flush(self, device: int) -> None:
        self._context(device)
        cu = self._cu
        self._call(
            "cuFlushGPUDirectRDMAWrites",
            cu.CUflushGPUDirectRDMAWritesTarget.CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX,
            cu.CUflushGPUDirectRDMAWritesScope.CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER,
        )

    def free(self, device: int, ptr: int) -> None:
        self._context(device)
        self._call("cuMemFree", ptr)


def gpudirect_unavailable(device: int, driver: CudaDriver | None = None) -> str | None:
    """Why a device ring cannot be made on CUDA device ``device`` here (``None``: it can)."""
    try:
        driver = driver if driver is not None else CudaBindings()
    except RailUnavailableError as exc:
        return str(exc)
    return driver.unavailable(device)


@dataclass
class DeviceMemory:
    """A device ring's memory: one allocation on CUDA device ``device`` and its dma-buf.

    Obtain one with :meth:`allocate`. It has no host view (``view``/``array`` raise): the training
    process reads it on the device, a NIC writes it through the dma-buf.

    Attributes:
        device: the CUDA device index.
        ptr: the allocation's device pointer.
        nbytes: its size (whole GPU pages).
        fd: its dma-buf file descriptor.
        flushes: whether :meth:`flush` has to call the driver.
    """

    device: int
    ptr: int
    nbytes: int
    fd: int
    flushes: bool
    driver: CudaDriver

    @classmethod
    def allocate(cls, device: int, nbytes: int, driver: CudaDriver | None = None) -> DeviceMemory:
        """Allocate at least ``nbytes`` on ``device`` and export them as a dma-buf.

        Raises:
            RailUnavailableError: the device cannot take a NIC's writes (named why).
            TransportError: a CUDA call failed (named).
        """
        driver = driver if driver is not None else CudaBindings()
        why = driver.unavailable(device)
        if why:
            raise RailUnavailableError(why)
        flushes = driver.needs_flush(device)
        size = -(-max(nbytes, 1) // GPU_PAGE) * GPU_PAGE
        ptr = driver.allocate(device, size)
        try:
            fd = driver.export_dmabuf(ptr, size)
        except BaseException:
            driver.free(device, ptr)
            raise
        memory = cls(device, ptr, size, fd, flushes, driver)
        log.debug("device ring of %d bytes on CUDA device %d, exported as dma-buf %d", size, device, fd)
        return memory

    @property
    def view(self) -> memoryview:
        raise TransportError("a device ring has no host view: read it on the device")

    def array(self) -> Any:
        raise TransportError("a device ring has no host view: read it on the device")

    def flush(self) -> None:
        """Make what the NIC wrote so far visible to the device's kernels."""
        if self.flushes:
            self.driver.flush(self.device)

    def close(self) -> None:
        """Close the dma-buf and free the allocation (once the NIC's registrations are gone)."""
        if self.fd < 0:
            return
        fd, self.fd = self.fd, -1
        with contextlib.suppress(OSError):
            os.close(fd)
        self.driver.free(self.device, self.ptr)
