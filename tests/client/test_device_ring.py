"""Device rings (GPUDirect RDMA): the memory, the choice of ring, the delivery, and the ``verbs`` rail
writing into one through the strict double of pyverbs.

On CPU the "GPU" is a host stand-in (``tests/client/device_ring_standin.py``: a memfd plays the
dma-buf); the ``gpu`` test at the end allocates, exports and views real GPU memory and skips
without one. No RDMA NIC is involved anywhere here.
"""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
import torch

from kspeed.client.batch import BatchMeta
from kspeed.client.delivery.device_ring import DeviceRingDelivery, device_ring
from kspeed.client.delivery.ring import RingAllocator
from kspeed.errors import RailUnavailableError
from kspeed.rdma.device_memory import GPU_PAGE, DeviceMemory, gpudirect_unavailable
from kspeed.rdma.rails import get_rail
from tests.client.device_ring_standin import HostDriver, HostRingViews
from tests.client.test_device import META, FakeCuda
from tests.rdma.test_verbs import _options, _poll, fence_and_expect_loss

NO_GPU = not torch.cuda.is_available()


def test_a_device_ring_is_whole_gpu_pages_exported_once_and_freed_once():
    driver = HostDriver()
    memory = DeviceMemory.allocate(0, 3 * GPU_PAGE + 1, driver)
    assert memory.nbytes == 4 * GPU_PAGE and memory.fd >= 0 and memory.flushes
    fd = memory.fd
    memory.flush()
    assert driver.flushes == 1
    with pytest.raises(Exception, match="no host view"):
        memory.array()
    memory.close()
    memory.close()  # once
    assert driver.freed == [memory.ptr] and memory.fd == -1
    with pytest.raises(OSError):
        os.fstat(fd)  # the dma-buf descriptor went with it
    with pytest.raises(RailUnavailableError, match="does not support GPUDirect RDMA"):
        DeviceMemory.allocate(0, 1 << 20, HostDriver("CUDA device 0 does not support GPUDirect RDMA"))


def test_where_a_device_ring_cannot_be_had_the_reason_is_given():
    cuda = torch.device("cuda", 0)
    assert device_ring(False, "verbs", cuda, 1 << 20, HostDriver()) == (None, "gpudirect is off")
    for rail in ("shm", "tcp"):
        assert device_ring(True, rail, cuda, 1 << 20, HostDriver()) == (
            None,
            f"rail {rail} cannot write into GPU memory",
        )
    assert device_ring(True, "verbs", cuda, 1 << 20, HostDriver("no dma-buf here")) == (None, "no dma-buf here")
    memory, why = device_ring(True, "verbs", cuda, 1 << 20, HostDriver())
    assert memory is not None and why == "" and memory.nbytes == GPU_PAGE
    memory.close()
    if NO_GPU:  # without a GPU, cuda-python says so (or is missing): a reason, never a crash
        assert gpudirect_unavailable(0)


def test_a_batch_is_flushed_then_viewed_on_the_device_and_its_range_waits_for_the_consumers_event():
    driver = HostDriver()
    memory = DeviceMemory.allocate(0, 1 << 16, driver)
    events = FakeCuda(not_ready=2)
    delivery = DeviceRingDelivery(torch.device("cuda", 0), HostRingViews(driver, memory), backend=events)
    allocator = RingAllocator(memory.nbytes)
    offset = allocator.reserve(48)
    driver.window(memory, offset, 48)[:] = np.arange(48, dtype=np.uint8)  # as the NIC wrote them
    delivery.attach(None)
    batch = delivery.deliver(None, offset, RingAllocator.footprint(48), BatchMeta(**META), allocator.release_later)
    assert driver.flushes == 1  # before the batch was handed out
    assert batch.samples[1].tolist() == list(range(16, 32)) and batch.samples[2].tolist() == [32, 33, 34]
    delivery.poll()
    allocator.drain()
    assert allocator.reservations == 1 and delivery.pending == 1  # the user holds it
    sample = batch.samples[0]
    batch.release()
    del batch
    gc.collect()
    delivery.poll()
    allocator.drain()
    assert allocator.reservations == 1  # released, but the consumer's event has not completed
    polls = 0
    while allocator.reservations and polls < 10:
        polls += 1
        delivery.poll()
        allocator.drain()
    assert allocator.reservations == 0 and polls == 2 and len(events.consumer) == 1 and not events.copies
    del sample
    gc.collect()
    memory.close()


def test_collected_views_give_the_range_back_and_make_room_waits_for_their_events():
    driver = HostDriver()
    memory = DeviceMemory.allocate(0, 1 << 16, driver)
    delivery = DeviceRingDelivery(torch.device("cuda", 0), HostRingViews(driver, memory), backend=FakeCuda(5))
    allocator = RingAllocator(memory.nbytes)
    offset = allocator.reserve(48)
    batch = delivery.deliver(None, offset, RingAllocator.footprint(48), BatchMeta(**META), allocator.release_later)
    sample = batch.samples[2]
    del batch
    gc.collect()
    delivery.make_room()
    allocator.drain()
    assert allocator.reservations == 1  # a sample view is still alive: nothing to wait for yet
    del sample
    gc.collect()
    delivery.make_room()
    allocator.drain()
    assert allocator.reservations == 0 and delivery.pending == 0
    memory.close()


def test_the_verbs_rail_writes_into_a_device_ring_by_its_iova_and_fencing_revokes_the_writer(verbs):
    driver = HostDriver()
    memory = DeviceMemory.allocate(0, 1 << 20, driver)
    rx = verbs.listen(_options())
    try:
        ring = rx.register_device(memory)
        assert ring.key.addr == 0 and ring.key.length == memory.nbytes  # addressed from 0, not by a pointer
        payload = bytes(range(256)) * 4
        with verbs.connect(rx.material, _options()) as wr:
            wr.write(ring.key, payload, 4096, imm=9)
            assert _poll(rx, 1) == [9]
            assert driver.window(memory, 4096, len(payload)).tobytes() == payload  # in the device's memory
            fence_and_expect_loss(rx, wr, ring.key, b"late", 0)  # its dma-buf MR deregistered
        assert driver.window(memory, 0, 4).tobytes() == bytes(4)  # nothing landed after the fence
    finally:
        rx.close()  # the receiver process deregisters, then the memory is freed
    assert driver.freed == [memory.ptr]


def test_rails_without_gpudirect_refuse_a_device_ring():
    driver = HostDriver()
    memory = DeviceMemory.allocate(0, 1 << 16, driver)
    rx = get_rail("tcp").listen(_options())
    try:
        with pytest.raises(RailUnavailableError, match="rail tcp cannot write into device memory"):
            rx.register_device(memory)
    finally:
        rx.close()
        memory.close()


@pytest.mark.gpu
@pytest.mark.skipif(NO_GPU, reason="needs a CUDA GPU: torch.cuda.is_available() is False")
def test_gpu_device_ring_memory_is_exported_viewed_and_flushed():
    from kspeed.client.delivery.device_ring import CupyRingViews

    why = gpudirect_unavailable(0)
    if why:
        pytest.skip(f"this GPU cannot take a NIC's writes: {why}")
    memory = DeviceMemory.allocate(0, 3 << 20)
    try:
        assert memory.nbytes == 2 * GPU_PAGE and os.fstat(memory.fd).st_size in (0, memory.nbytes)
        views = CupyRingViews(memory)
        tensor, lease = views.view(4096, 64)
        assert tensor.is_cuda and tensor.numel() == 64 and tensor.data_ptr() == memory.ptr + 4096
        tensor.copy_(torch.arange(64, dtype=torch.uint8, device=tensor.device))
        views.flush()
        again, _ = views.view(4096, 64)
        assert again.cpu().tolist() == list(range(64))
        del tensor, again, lease
        torch.cuda.synchronize()
    finally:
        memory.close()
