"""Delivery to the training device: the CPU branch, the deferred ring releases, the CUDA branch.

On CPU the CUDA branch (:class:`CudaDelivery`) runs with a fake backend whose copy is a host clone
and whose events report not-ready before ready. The ``gpu`` tests use the real CUDA backend and skip
without a GPU.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

import kspeed.client.feeding.builder as builder_module
from kspeed.client.batch import BatchMeta
from kspeed.client.delivery.device import CpuDelivery, CudaDelivery, DeferredReleases, make_delivery, parse_device
from kspeed.client.delivery.ring import RingAllocator
from kspeed.errors import ConfigError
from tests.client.test_delivery import check_batch

NO_GPU = not torch.cuda.is_available()


class FakeEvent:
    def __init__(self, not_ready: int) -> None:
        self.left = not_ready

    def query(self) -> bool:
        if self.left:
            self.left -= 1
            return False
        return True

    def synchronize(self) -> None:
        self.left = 0


class FakeCuda:
    """The CUDA backend on CPU: copies are clones, events complete after ``not_ready`` queries."""

    def __init__(self, not_ready: int = 2) -> None:
        self.not_ready = not_ready
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []
        self.copies: list[FakeEvent] = []
        self.consumer: list[FakeEvent] = []

    def register(self, ptr: int, nbytes: int) -> None:
        self.registered.append((ptr, nbytes))

    def unregister(self, ptr: int) -> None:
        self.unregistered.append(ptr)

    def copy(self, base: torch.Tensor) -> tuple[torch.Tensor, FakeEvent]:
        self.copies.append(FakeEvent(self.not_ready))
        return base.clone(), self.copies[-1]

    def consumer_event(self) -> FakeEvent:
        self.consumer.append(FakeEvent(self.not_ready))
        return self.consumer[-1]


META = {
    "epoch": 0,
    "index": 0,
    "ids": np.array([5, 6, 7]),
    "labels": np.array([1, 2, 3]),
    "offsets": np.array([0, 16, 32]),
    "lengths": np.array([10, 16, 3]),
}


def ring_and_batch(delivery):
    ring = np.arange(1 << 12, dtype=np.int64).astype(np.uint8)
    allocator = RingAllocator(ring.nbytes)
    delivery.attach(ring)
    offset = allocator.reserve(48)
    batch = delivery.deliver(ring, offset, RingAllocator.footprint(48), BatchMeta(**META), allocator.release_later)
    return ring, allocator, offset, batch


def test_parse_device():
    assert parse_device("cpu") == torch.device("cpu")
    assert isinstance(make_delivery("cpu"), CpuDelivery)
    for bad in ("tpu", "cuda:x", 3.5, "meta"):
        with pytest.raises(ConfigError, match="device"):
            parse_device(bad)
    with pytest.raises(ConfigError, match="no CUDA device is available"):
        parse_device("cuda:0", cuda_available=lambda: False)
    with pytest.raises(ConfigError, match="only 1 CUDA device"):
        parse_device("cuda:3", cuda_available=lambda: True, device_count=lambda: 1)
    assert parse_device("cuda:0", cuda_available=lambda: True, device_count=lambda: 1) == torch.device("cuda", 0)


@pytest.mark.skipif(not NO_GPU, reason="checks the error raised when no GPU is present")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_no_gpu_is_a_config_error_never_a_cpu_fallback(make_ds, device):
    with pytest.raises(ConfigError, match="no CUDA device is available"):
        make_ds(device=device)


def test_cpu_delivery_views_the_ring():
    ring, allocator, offset, batch = ring_and_batch(CpuDelivery())
    assert batch.samples[1].data_ptr() == ring.ctypes.data + offset + 16
    del batch
    gc.collect()
    allocator.drain()
    assert allocator.reservations == 0


def polls_until(deferred, released, offset, limit=20):
    for polls in range(1, limit + 1):
        deferred.poll()
        if offset in released:
            return polls
    return None


def test_deferred_release_waits_for_every_event_and_the_hold():
    released = []
    deferred = DeferredReleases(released.append)
    deferred.add(0, FakeEvent(1))
    deferred.add(64, FakeEvent(0), hold=True)
    assert polls_until(deferred, released, 0) == 2
    assert polls_until(deferred, released, 64) is None  # its event is ready, but the user still holds it
    deferred.unhold(64, FakeEvent(2))
    assert polls_until(deferred, released, 64) == 3
    assert deferred.pending == 0
    deferred.add(128, FakeEvent(5))
    deferred.add(192, FakeEvent(5), hold=True)
    assert deferred.wait() == 1 and released[-1] == 128 and deferred.pending == 1


def test_cuda_branch_reclaims_the_range_only_after_copy_and_consumer_events():
    fake = FakeCuda(not_ready=2)
    delivery = CudaDelivery(torch.device("cuda"), backend=fake)
    ring, allocator, offset, batch = ring_and_batch(delivery)
    assert fake.registered == [(ring.ctypes.data, ring.nbytes)]
    assert len(fake.copies) == 1  # one copy of the whole range
    for i, length in enumerate(META["lengths"]):
        start = offset + int(META["offsets"][i])
        assert batch.numpy(i).tobytes() == ring[start : start + length].tobytes()
        assert batch.samples[i].data_ptr() != ring.ctypes.data + start  # views of the copy, not the ring
    for _ in range(10):  # however often it is polled, the user still holds the batch
        delivery.poll()
        allocator.drain()
    assert allocator.reservations == 1 and fake.consumer == []
    batch.release()
    assert batch.released and len(fake.consumer) == 1
    polls = 0
    while allocator.reservations and polls < 20:
        polls += 1
        delivery.poll()
        allocator.drain()
    assert allocator.reservations == 0 and delivery.pending == 0
    assert polls == 5  # copy event: 2 polls not ready; consumer event: 2 more; then released
    delivery.close()
    assert fake.unregistered == [ring.ctypes.data]


def test_cuda_branch_collected_views_release_like_release():
    fake = FakeCuda(not_ready=1)
    delivery = CudaDelivery(torch.device("cuda"), backend=fake)
    _, allocator, _, batch = ring_and_batch(delivery)
    sample = batch.samples[2]
    del batch
    gc.collect()
    delivery.poll()
    assert fake.consumer == [] and delivery.pending == 1  # a sample view is still alive
    del sample
    gc.collect()
    delivery.make_room()  # waits for the events of ranges nobody holds
    allocator.drain()
    assert allocator.reservations == 0


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = FakeCuda(not_ready=3)
    monkeypatch.setattr(
        builder_module, "make_delivery", lambda device: CudaDelivery(torch.device("cuda"), backend=fake)
    )
    return fake


def test_epochs_through_the_cuda_branch_on_cpu(make_ds, samples, fake_cuda):
    ds, _ = make_ds(ring_bytes=256 << 10, device="cuda")
    assert ds.device == torch.device("cuda")
    assert fake_cuda.registered == [(ds._feed.ring.ctypes.data, ds._feed.ring.nbytes)]
    for epoch in range(3):
        ds.set_epoch(epoch)
        delivered = 0
        for batch in ds:
            check_batch(batch, samples)
            batch.release()
            delivered += 1
        assert delivered == len(ds)
    assert len(fake_cuda.copies) == 3 * len(ds)
    ds.close()
    assert fake_cuda.unregistered == [fake_cuda.registered[0][0]]


@pytest.mark.gpu
@pytest.mark.skipif(NO_GPU, reason="needs a CUDA GPU: torch.cuda.is_available() is False")
def test_gpu_bytes_equal_after_copy(make_ds, samples):
    ds, _ = make_ds(device="cuda")
    for batch in ds:
        assert all(sample.is_cuda for sample in batch.samples)
        for i, sid in enumerate(batch.ids.tolist()):
            assert batch.samples[i].cpu().numpy().tobytes() == samples[sid]


@pytest.mark.gpu
@pytest.mark.skipif(NO_GPU, reason="needs a CUDA GPU: torch.cuda.is_available() is False")
def test_gpu_ring_not_reclaimed_before_the_consumer_event():
    delivery = make_delivery("cuda")
    ring, allocator, _, batch = ring_and_batch(delivery)
    torch.cuda.synchronize()
    torch.cuda._sleep(1 << 30)  # the consumer stream stays busy for a while
    batch.release()
    delivery.poll()
    allocator.drain()
    assert allocator.reservations == 1
    torch.cuda.synchronize()
    delivery.poll()
    allocator.drain()
    assert allocator.reservations == 0
    delivery.close()
    del ring
