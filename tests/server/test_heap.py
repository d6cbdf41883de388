"""Freed heap memory goes back to the system when asked (glibc), and requests meanwhile share one trim."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kspeed.server.memory import heap


def anon_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon")


@pytest.mark.skipif(heap.malloc_trim() is None, reason="not glibc: nothing to trim")
def test_memory_freed_in_the_heap_is_given_back():
    np.ones(16 << 20, dtype=np.uint8)  # mapped, then unmapped: glibc serves later blocks up to its size from the heap
    blocks = [np.ones(1 << 20, dtype=np.uint8) for _ in range(200)]
    keep = blocks[-1]  # the heap's top stays in use: freeing the rest cannot shrink it
    del blocks
    before = anon_bytes()
    heap.trim()
    assert before - anon_bytes() > 100 << 20 and keep[0] == 1


def test_requests_meanwhile_share_one_trim():
    calls: list[int] = []
    trimmer = heap.Trimmer(calls.append, delay=0.2)
    trimmer.later()
    trimmer.later()
    time.sleep(0.6)
    assert calls == [0]
    trimmer.later()
    time.sleep(0.6)
    assert calls == [0, 0]
    heap.Trimmer(None).later()  # (without glibc: nothing, no thread)
