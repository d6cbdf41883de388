"""Processes used by the rail conformance suite (started with ``spawn``)."""

from __future__ import annotations

import contextlib
import os
import time

import numpy as np

from kspeed.errors import KSpeedError
from kspeed.rdma.base import RegionKey
from kspeed.rdma.options import RailOptions
from kspeed.rdma.rails import get_rail, use_verbs_api


def _rail(name: str, options: RailOptions):
    """The rail ``name`` as this worker's options configure it (``verbs`` on the tests' double)."""
    use_verbs_api(options.verbs_api)
    return get_rail(name)


def pattern(imm: int, size: int) -> np.ndarray:
    """The bytes a write with immediate ``imm`` carries: checkable from the immediate alone."""
    return ((np.arange(size, dtype=np.uint32) * 7 + imm * 13) & 0xFF).astype(np.uint8)


def write_patterns(rail, material, key_blob, options: RailOptions, first_imm, count, size, queue=None):
    """Write ``count`` patterned writes of ``size`` bytes, imm = first_imm + i, at slot i of the key."""
    writer = _rail(rail, options).connect(material, options)
    key = RegionKey.from_bytes(key_blob)
    if queue is not None:
        queue.put(("conn", writer.conn))
    slots = key.length // size
    for i in range(count):
        imm = first_imm + i
        writer.write(key, pattern(imm, size), (i % slots) * size, imm)
    if queue is not None:
        queue.put(("done", count))
        time.sleep(30)  # stay alive until killed or the test ends
    writer.close()


def stream_forever(rail, material, key_blob, options: RailOptions, size, queue):
    """Write with immediates until killed; reports its connection id first."""
    writer = _rail(rail, options).connect(material, options)
    key = RegionKey.from_bytes(key_blob)
    queue.put(("conn", writer.conn))
    src = np.ones(size, np.uint8)
    slots = key.length // size
    i = 0
    try:
        while True:
            writer.write(key, src, (i % slots) * size, i & 0xFFFFFFFF)
            i += 1
    except KSpeedError as exc:
        queue.put(("error", repr(exc)))


def serve_ring(rail, options: RailOptions, nbytes, queue, poll):
    """Receiver process: publish material and a key, then poll (or not) until killed."""
    receiver = _rail(rail, options).listen(options)
    ring = receiver.register(nbytes)
    queue.put((receiver.material, ring.key.to_bytes(), os.getpid()))
    while True:
        if poll:
            with contextlib.suppress(KSpeedError):
                receiver.poll(0.1)
        else:
            time.sleep(0.1)


def write_pattern_batches(rail, material, key_blob, options: RailOptions, batches, per_batch, size):
    """Write ``batches`` batches with ``write_batch``: batch b fills slots ``b * per_batch ..`` of the key.

    The source holds one pattern per slot (``pattern(slot, size)``); each batch raises one immediate,
    its batch number, so the receiver can check that every byte of the batch is there.
    """
    writer = _rail(rail, options).connect(material, options)
    key = RegionKey.from_bytes(key_blob)
    source = np.concatenate([pattern(slot, size) for slot in range(batches * per_batch)])
    for b in range(batches):
        slots = np.arange(b * per_batch, (b + 1) * per_batch, dtype=np.int64)
        order = slots[::-1].copy()  # destinations descending: nothing adjacent in issue order
        writer.write_batch(key, source, order * size, size, order * size, np.array([b], np.uint32))
    time.sleep(30)  # stay alive until killed or the test ends
