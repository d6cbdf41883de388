"""Fixtures of the rail conformance suite: one run per rail available on this host."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from kspeed.rdma.options import RailOptions
from kspeed.rdma.rails import available_rails

#: Short timeouts keep the failure-detection tests fast; bounds are asserted against these.
IO_TIMEOUT = 1.0


@pytest.fixture(params=available_rails())
def rail(request) -> str:
    return request.param


@pytest.fixture
def options() -> RailOptions:
    return RailOptions(
        token=b"conformance-token-0123456789",
        io_timeout=IO_TIMEOUT,
        connect_timeout=3.0,
        keepalive_idle=1.0,
        keepalive_interval=1.0,
        keepalive_count=2,
    )


@pytest.fixture
def spawn():
    """Start processes with ``spawn``; kill whatever is still running at the end of the test."""
    ctx = mp.get_context("spawn")
    procs: list = []

    def start(target, *args):
        proc = ctx.Process(target=target, args=args, daemon=True)
        proc.start()
        procs.append(proc)
        return proc

    start.ctx = ctx
    yield start
    for proc in procs:
        if proc.is_alive():
            os.kill(proc.pid, 9)
        proc.join(10)
