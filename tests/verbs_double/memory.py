"""Protection domains and memory regions of the double (``ibv_alloc_pd(3)``, ``ibv_reg_mr(3)``).

An MR registers real memory of this process: the responder's NIC writes incoming payload into it
with ``recv_into``/``ctypes.memmove`` and the requester's NIC reads from it when it transmits. What
``ibv_reg_mr(3)`` and the kernel's ``ib_umem_get`` refuse is refused here too:

* ``IBV_ACCESS_REMOTE_WRITE`` or ``IBV_ACCESS_REMOTE_ATOMIC`` without ``IBV_ACCESS_LOCAL_WRITE``
  (``EINVAL``, ``ibv_reg_mr(3)``: "then IBV_ACCESS_LOCAL_WRITE must be set too");
* memory that is not mapped (``EFAULT``), or not writable when any write access is asked for
  (pinning for write needs a writable mapping); checked against ``/proc/self/maps``;
* a length over ``max_mr_size``; access bits the double does not simulate (on-demand paging,
  zero-based, memory windows, huge-page hints): ``EINVAL``.

Keys: ``lkey`` and ``rkey`` differ (a rail that sends an lkey as an rkey fails) and are never reused
by a port, so a key of a deregistered MR stays dead (``mr.close()``): later local uses complete
``IBV_WC_LOC_PROT_ERR``, remote ones ``IBV_WC_REM_ACCESS_ERR``. Deregistration waits for the NIC
to stop touching the memory (the port's lock), so the memory may be unmapped as soon as
``close()`` returns, as with pinned pages on hardware.

A **dma-buf MR** (``ibv_reg_dmabuf_mr(3)``: "register a dma-buf based memory region",
``pyverbs.mr.DmaBufMR``, which passes its ``offset`` as the IOVA) stands for GPU memory a NIC
reaches through its exporter: the double maps the file descriptor it is given (a memfd standing in
for the GPU allocation's dma-buf) and addresses it by IOVA, ``offset`` at its first byte, never by
a virtual address of the registering process; an rkey's range is checked against the IOVAs
(``IBV_WC_REM_ACCESS_ERR`` otherwise). A descriptor that cannot be mapped for the whole range is
refused (``EINVAL``, as a file that is not a dma-buf is by ``ib_umem_dmabuf_get``).

Not simulated: memory windows, ``rereg``, implicit/ODP MRs, a dma-buf's move notifications.
Unmapping memory that is still registered is a bug the double cannot survive (the NIC thread
would read freed pages).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
from typing import TYPE_CHECKING

from .base import c_uint, e, fail
from .config import LIMITS

if TYPE_CHECKING:
    from .device import Context
    from .qp import QP
    from .rq import SRQ

__all__ = ["MR", "PD", "DmabufMR", "check_mapped"]

_LOCAL_WRITE = int(e.IBV_ACCESS_LOCAL_WRITE)
_REMOTE_WRITE = int(e.IBV_ACCESS_REMOTE_WRITE)
_REMOTE_READ = int(e.IBV_ACCESS_REMOTE_READ)
_REMOTE_ATOMIC = int(e.IBV_ACCESS_REMOTE_ATOMIC)
_RELAXED = int(e.IBV_ACCESS_RELAXED_ORDERING)
_SUPPORTED_ACCESS = _LOCAL_WRITE | _REMOTE_WRITE | _REMOTE_READ | _REMOTE_ATOMIC | _RELAXED


class PD:
    """A protection domain; ``close()`` refuses with ``EBUSY`` while MRs, SRQs or QPs use it.

    ``ibv_dealloc_pd(3)``: "may fail if any other resource is still associated with the PD". (pyverbs'
    own ``PD.close()`` first closes the objects it created; the double insists on the C order so a
    rail's teardown is right on both: QPs, then SRQs and MRs, then the PD.)
    """

    def __init__(self, context: Context) -> None:
        self.context = context
        self.port = context.port
        self.mrs: set[MR] = set()
        self.srqs: set[SRQ] = set()
        self.qps: set[QP] = set()
        self.closed = False
        context._adopt(self)

    def close(self) -> None:
        with self.port.lock:
            if self.closed:
                return
            users = len(self.mrs) + len(self.srqs) + len(self.qps)
            if users:
                fail(
                    f"Failed to dealloc PD: still used by {len(self.mrs)} MR(s), {len(self.srqs)} SRQ(s), "
                    f"{len(self.qps)} QP(s) (ibv_dealloc_pd(3))",
                    errno.EBUSY,
                )
            self.closed = True
            self.context._release(self)


class MR:
    """A registered memory region: ``lkey``, ``rkey``, ``buf`` (its address), ``length``, ``close()``."""

    def __init__(self, pd: PD, address: int, length: int, access: int, iova: int | None = None) -> None:
        address = c_uint(address, 64, "address")
        length = c_uint(length, 64, "length")
        access = c_uint(access, 32, "access")
        port = pd.port
        with port.lock:
            if pd.closed:
                fail("Failed to register a MR: the PD is closed", errno.EINVAL)
            if access & ~_SUPPORTED_ACCESS:
                fail(
                    f"Failed to register a MR: access bits {access & ~_SUPPORTED_ACCESS:#x} not supported", errno.EINVAL
                )
            if access & (_REMOTE_WRITE | _REMOTE_ATOMIC) and not access & _LOCAL_WRITE:
                fail(
                    "Failed to register a MR: REMOTE_WRITE/REMOTE_ATOMIC need LOCAL_WRITE too (ibv_reg_mr(3))",
                    errno.EINVAL,
                )
            if length > LIMITS.max_mr_size:
                fail(f"Failed to register a MR: length {length} > max_mr_size", errno.EINVAL)
            self._own: ctypes.Array[ctypes.c_char] | None = None
            if not address:  # pyverbs' MR allocates its own buffer when given no address
                self._own = ctypes.create_string_buffer(max(length, 1))
                address = ctypes.addressof(self._own)
            writable = bool(access & (_LOCAL_WRITE | _REMOTE_WRITE | _REMOTE_ATOMIC))
            problem = check_mapped(address, length, writable)
            if problem:
                fail(f"Failed to register a MR: {problem}", errno.EFAULT)
            self.pd = pd
            self.port = port
            self.buf = address
            self.iova = address if iova is None else iova  # what keys address (a plain MR: its address)
            self.length = length
            self.access = access
            self.lkey, self.rkey = port.new_keys()
            self.live = True
            port.mrs_by_lkey[self.lkey] = self
            port.mrs_by_rkey[self.rkey] = self
            pd.mrs.add(self)

    def contains(self, addr: int, length: int) -> bool:
        """Whether ``[addr, addr + length)`` (IOVAs) lies inside the region."""
        return self.iova <= addr and addr + length <= self.iova + self.length

    def host(self, addr: int) -> int:
        """The address in this process of IOVA ``addr`` of the region."""
        return self.buf + (addr - self.iova)

    def close(self) -> None:
        """Deregister: the keys stop working at once; idempotent."""
        with self.port.lock:
            if not self.live:
                return
            self.live = False
            self.port.mr_generation += 1
            self.port.mrs_by_lkey.pop(self.lkey, None)
            self.port.mrs_by_rkey.pop(self.rkey, None)
            self.pd.mrs.discard(self)

    def __repr__(self) -> str:
        return f"<double MR lkey={self.lkey:#x} rkey={self.rkey:#x} [{self.iova:#x}, +{self.length})>"


class DmabufMR(MR):
    """A dma-buf MR (``ibv_reg_dmabuf_mr(3)``): ``length`` bytes of dma-buf ``fd`` from ``offset``,
    at IOVA ``offset`` (pyverbs' ``DmaBufMR``), mapped here as the NIC would reach them."""

    def __init__(self, pd: PD, fd: int, offset: int, length: int, access: int) -> None:
        offset = c_uint(offset, 64, "offset")
        length = c_uint(length, 64, "length")
        try:
            self._map = mmap.mmap(fd, offset + length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError, OverflowError) as exc:
            fail(f"Failed to register a dma-buf MR: fd {fd} cannot be mapped for {offset + length} bytes: {exc}",
                 errno.EINVAL)  # fmt: skip
        self._window = (ctypes.c_char * (offset + length)).from_buffer(self._map)
        super().__init__(pd, ctypes.addressof(self._window) + offset, length, access, iova=offset)

    def close(self) -> None:
        super().close()  # (the NIC stops touching it first: the port's lock)
        window, self._window = self._window, None
        del window
        with contextlib.suppress(BufferError):
            self._map.close()


def check_mapped(address: int, length: int, writable: bool) -> str | None:
    """Why ``[address, address + length)`` cannot be pinned (``None`` if it can), from ``/proc/self/maps``."""
    if length == 0:
        return None
    end = address + length
    cursor = address
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms = line.split(None, 2)[:2]
            lo_text, hi_text = span.split("-")
            lo, hi = int(lo_text, 16), int(hi_text, 16)
            if hi <= cursor:
                continue
            if lo > cursor:
                break
            if "r" not in perms:
                return f"[{cursor:#x}, ...) is mapped without read permission ({perms})"
            if writable and "w" not in perms:
                return f"[{cursor:#x}, ...) is read-only ({perms}) but write access was asked for"
            cursor = hi
            if cursor >= end:
                return None
    return f"[{cursor:#x}, {end:#x}) is not mapped in this process"
