"""Delivery of batches to the training device from a host ring (or a device ring, :mod:`.device_ring`).

``device="cpu"`` (:class:`CpuDelivery`) hands out the zero-copy ring views as before. For a CUDA
device (:class:`CudaDelivery`):

- the ring's host mapping is page-locked with ``cudaHostRegister`` (and unregistered on close), so
  copies from it are truly asynchronous;
- each batch goes to the device with ONE ``non_blocking`` copy of its whole ring range on a side
  stream; its sample views are splits of the device tensor at the host layout's offsets; an event
  recorded after the copy is waited on by the consumer's current stream before the batch is
  handed out, and the device tensor is marked as used by that stream (``record_stream``);
- the ring range is given back only once the copy's event has completed AND the device batch was
  released or its views collected and an event recorded on the consumer's stream at that moment
  has completed. Until then the range waits in :class:`DeferredReleases`, which the pump polls
  (``event.query()``) on every batch; it waits on an event only when the ring has no room otherwise.

Every CUDA call goes through a small backend object (:class:`TorchCuda`), so the bookkeeping of
:class:`CudaDelivery` runs unchanged on CPU with a fake backend whose copy is a host clone and
whose events report not-ready, then ready. Where the tests ran: ``tests/client/test_device.py``
exercises :class:`CpuDelivery`, :class:`DeferredReleases` and :class:`CudaDelivery` with the fake
backend on CPU; its ``@pytest.mark.gpu`` tests drive :class:`TorchCuda` and skip without a GPU. They
passed on an NVIDIA H200 (``scripts/device-check``, 2026-11-27; ``docs/benchmarks.md``).
"""

from __future__ import annotations

import logging
import weakref
from collections import deque
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from kspeed.client.batch import Batch, BatchMeta, make_batch, ring_batch
from kspeed.errors import CapacityError, ConfigError, StateError

__all__ = [
    "CpuDelivery",
    "CudaBackend",
    "CudaDelivery",
    "DeferredReleases",
    "Delivery",
    "EventedDelivery",
    "TorchCuda",
    "make_delivery",
    "parse_device",
]

log = logging.getLogger(__name__)


class Event(Protocol):
    """What the deferred releases need of a CUDA event."""

    def query(self) -> bool:
        """Whether the work recorded before the event has completed."""

    def synchronize(self) -> None:
        """Wait until it has."""


def parse_device(
    device: str | torch.device,
    *,
    cuda_available: Callable[[], bool] = torch.cuda.is_available,
    device_count: Callable[[], int] = torch.cuda.device_count,
) -> torch.device:
    """Check the device a dataset delivers to: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.

    Raises:
        ConfigError: another kind of device, a malformed name, no CUDA device available, or an index
            beyond the visible devices (never a silent fallback to the CPU).
    """
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(
            f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}: {exc}", field="device", value=device
        ) from exc
    if parsed.type == "cpu":
        return torch.device("cpu")
    if parsed.type != "cuda":
        raise ConfigError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}", field="device", value=device)
    if not cuda_available():
        raise ConfigError(
            f"device={device!r}: no CUDA device is available to this process (torch "
            f"{torch.__version__}, CUDA build {torch.version.cuda or 'none'}); use device='cpu'",
            field="device",
            value=device,
        )
    count = device_count()
    index = parsed.index if parsed.index is not None else torch.cuda.current_device()
    if index >= count:
        raise ConfigError(f"device={device!r}: only {count} CUDA device(s) are visible", field="device", value=device)
    return torch.device("cuda", index)


class DeferredReleases:
    """Ring ranges whose release waits for events; :meth:`poll` gives back the ready ones.

    A range is ready once every event added for it has completed and, when it was added with
    ``hold=True``, :meth:`unhold` was called for it. :meth:`add` and :meth:`poll` run in the owner's
    thread; :meth:`unhold` may come from any thread (garbage-collection finalizers).

    Args:
        release: gives a range back to the ring (called with its offset from :meth:`poll`).
    """

    def __init__(self, release: Callable[[int], None]) -> None:
        self._release = release
        self._pending: dict[int, tuple[list[Event], bool]] = {}
        self._unheld: deque[tuple[int, Event | None]] = deque()

    def add(self, offset: int, event: Event, *, hold: bool = False) -> None:
        """Defer the release of the range at ``offset`` until ``event`` (and :meth:`unhold`, if ``hold``)."""
        self._pending[offset] = ([event], hold)

    def unhold(self, offset: int, event: Event | None = None) -> None:
        """Lift the hold of ``offset``, adding ``event`` to wait for (from any thread)."""
        self._unheld.append((offset, event))

    def _take_unheld(self) -> None:
        while self._unheld:
            offset, event = self._unheld.popleft()
            if offset in self._pending:
                events, _ = self._pending[offset]
                self._pending[offset] = (events + ([event] if event is not None else []), False)

    def poll(self) -> int:
        """Release every range whose events have completed; return how many were released."""
        self._take_unheld()
        done = [
            offset
            for offset, (events, held) in self._pending.items()
            if not held and all(event.query() for event in events)
        ]
        for offset in done:
            del self._pending[offset]
            self._release(offset)
        return len(done)

    def wait(self) -> int:
        """Wait for the events of the ranges not held by the user, then release them; return how many."""
        self._take_unheld()
        for events, held in self._pending.values():
            if not held:
                for event in events:
                    event.synchronize()
        return self.poll()

    @property
    def pending(self) -> int:
        """Ranges not yet released."""
        self._take_unheld()
        return len(self._pending)


class Delivery(Protocol):
    """How batches reach the training device: :class:`CpuDelivery` or :class:`CudaDelivery`."""

    device: torch.device

    def attach(self, ring: np.ndarray | None) -> None:
        """Prepare the host ring (e.g. page-lock it); ``None`` for a device ring."""

    def deliver(
        self, ring: np.ndarray | None, offset: int, footprint: int, meta: BatchMeta, release: Callable[[int], None]
    ) -> Batch:
        """The batch at ``ring[offset:offset + footprint]`` (of the device ring when ``ring`` is
        ``None``); ``release(offset)`` once it may be reused."""

    def poll(self) -> None:
        """Give back the ranges that may be reused now."""

    def make_room(self) -> None:
        """Wait for ranges the user no longer holds."""

    @property
    def pending(self) -> int:
        """Ranges not given back yet."""

    def close(self) -> None:
        """Undo :meth:`attach`."""


class CudaBackend(Protocol):
    """The CUDA calls of :class:`CudaDelivery` (:class:`TorchCuda`, or a fake in tests)."""

    def register(self, ptr: int, nbytes: int) -> None: ...

    def unregister(self, ptr: int) -> None: ...

    def copy(self, base: torch.Tensor) -> tuple[torch.Tensor, Event]: ...

    def consumer_event(self) -> Event: ...


class CpuDelivery:
    """Batches as zero-copy views of the host ring (``device="cpu"``)."""

    device = torch.device("cpu")

    def attach(self, ring: np.ndarray | None) -> None:
        """Nothing to prepare for host views."""

    def deliver(
        self, ring: np.ndarray | None, offset: int, footprint: int, meta: BatchMeta, release: Callable[[int], None]
    ) -> Batch:
        """The batch at ``ring[offset:offset + footprint]``; ``release(offset)`` once its views are gone."""
        return ring_batch(_host(ring), offset, footprint, meta, release)

    def poll(self) -> None:
        """Nothing is ever deferred."""

    def make_room(self) -> None:
        """Nothing is ever deferred."""

    @property
    def pending(self) -> int:
        """Ranges waiting for an event: none."""
        return 0

    def close(self) -> None:
        """Nothing to undo."""


class TorchCuda:
    """The CUDA calls of :class:`CudaDelivery`, through torch.

    Args:
        device: the CUDA device.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream = torch.cuda.Stream(device=device)

    def register(self, ptr: int, nbytes: int) -> None:
        """Page-lock ``nbytes`` of host memory at ``ptr`` for asynchronous copies.

        Raises:
            CapacityError: CUDA refused (e.g. the locked-memory limit), with its error code.
        """
        error = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
        if int(error) != 0:
            raise CapacityError(
                f"cannot page-lock the {nbytes}-byte receive ring for {self.device} "
                f"(cudaHostRegister error {int(error)}); check the locked-memory limit (ulimit -l)"
            )

    def unregister(self, ptr: int) -> None:
        """Undo :meth:`register` after the side stream's copies have finished."""
        self._stream.synchronize()
        error = torch.cuda.cudart().cudaHostUnregister(ptr)
        if int(error) != 0:
            log.warning("cudaHostUnregister of the receive ring failed with error %d", int(error))

    def copy(self, base: torch.Tensor) -> tuple[torch.Tensor, Event]:
        """One asynchronous copy of ``base`` to the device on the side stream, and its event.

        The consumer's current stream waits on the event; the device tensor is marked as used by it,
        so the caching allocator does not reuse its memory before the consumer's queued work is done.
        """
        consumer = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._stream):
            moved = base.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        consumer.wait_event(event)
        moved.record_stream(consumer)
        return moved, event

    def consumer_event(self) -> Event:
        """An event recorded now on the consumer's current stream."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event


class EventedDelivery:
    """What a delivery to a CUDA device shares: ring ranges given back after their events
    (:class:`DeferredReleases`), the consumer's event recorded when the user lets a batch go."""

    def __init__(self, device: torch.device, backend: CudaBackend | None = None) -> None:
        self.device = device
        self._backend: CudaBackend = backend if backend is not None else TorchCuda(device)
        self._deferred: DeferredReleases | None = None

    def _releases(self, release: Callable[[int], None]) -> DeferredReleases:
        if self._deferred is None:
            self._deferred = DeferredReleases(release)
        return self._deferred

    def _freed_when(self, deferred: DeferredReleases, holder: object, offset: int) -> weakref.finalize:
        """Lift the hold of ``offset`` once ``holder`` is collected (the batch's last view went),
        with an event of the consumer's stream at that moment."""
        return weakref.finalize(holder, _device_freed, deferred, self._backend, offset)

    def poll(self) -> None:
        """Give back the ranges whose events have completed (never waits)."""
        if self._deferred is not None:
            self._deferred.poll()

    def make_room(self) -> None:
        """Wait for the events of ranges the user no longer holds (the ring has no room otherwise)."""
        if self._deferred is not None:
            self._deferred.wait()

    @property
    def pending(self) -> int:
        """Ranges waiting for an event or for the user to drop the batch."""
        return self._deferred.pending if self._deferred is not None else 0


class CudaDelivery(EventedDelivery):
    """Batches copied from the host ring to a CUDA device, the ring range reclaimed after the events.

    Args:
        device: the CUDA device.
        backend: the CUDA calls (default :class:`TorchCuda`; tests pass a fake).
    """

    def __init__(self, device: torch.device, backend: CudaBackend | None = None) -> None:
        super().__init__(device, backend)
        self._ptr: int | None = None

    def attach(self, ring: np.ndarray | None) -> None:
        """Page-lock the ring's host mapping.

        Raises:
            CapacityError: it cannot be page-locked.
        """
        ring = _host(ring)
        self._backend.register(ring.ctypes.data, ring.nbytes)
        self._ptr = ring.ctypes.data

    def deliver(
        self, ring: np.ndarray | None, offset: int, footprint: int, meta: BatchMeta, release: Callable[[int], None]
    ) -> Batch:
        """Copy the batch at ``ring[offset:offset + footprint]`` to the device and return its device views.

        ``release(offset)`` is called from :meth:`poll` once the copy's event has completed and the
        batch was released (or its views collected) and the consumer's event of that moment has too.
        """
        deferred = self._releases(release)
        base = torch.frombuffer(_host(ring)[offset : offset + footprint], dtype=torch.uint8)
        moved, copied = self._backend.copy(base)
        del base
        deferred.add(offset, copied, hold=True)
        return make_batch(moved, footprint, meta, self._freed_when(deferred, moved, offset))

    def close(self) -> None:
        """Unregister the ring (after the side stream's copies have finished)."""
        if self._ptr is not None:
            ptr, self._ptr = self._ptr, None
            self._backend.unregister(ptr)


def _host(ring: np.ndarray | None) -> np.ndarray:
    if ring is None:
        raise StateError("this delivery reads a host ring, and the feed has a device ring")
    return ring


def _device_freed(deferred: DeferredReleases, backend: CudaBackend, offset: int) -> None:
    try:
        event = backend.consumer_event()
    except RuntimeError as exc:  # interpreter or CUDA shutting down: nothing is queued any more
        log.debug("no consumer event for the ring range at %d: %s", offset, exc)
        event = None
    deferred.unhold(offset, event)


def make_delivery(device: str | torch.device) -> Delivery:
    """The delivery for ``device`` (checked by :func:`parse_device`).

    Raises:
        ConfigError: the device is not usable here (named).
    """
    parsed = parse_device(device)
    return CpuDelivery() if parsed.type == "cpu" else CudaDelivery(parsed)
