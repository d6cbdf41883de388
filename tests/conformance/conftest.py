"""Fixtures of the rail conformance suite: one run per rail available on this host."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from kspeed.rdma.options import RailOptions
from kspeed.rdma.rails import available_rails, use_verbs_api

#: Short timeouts keep the failure-detection tests fast; bounds are asserted against these.
IO_TIMEOUT = 1.0


#: What the ``verbs`` rail drives where this host has no RDMA device: the strict double of pyverbs.
VERBS_DOUBLE = "tests.verbs_double:api"
#: The rails under test: every rail usable here, and ``verbs`` through the double where it is not.
NATIVE_VERBS = "verbs" in available_rails()
RAILS = available_rails() + ([] if NATIVE_VERBS else ["verbs"])


@pytest.fixture(params=RAILS)
def rail(request) -> str:
    """A rail's name; ``verbs`` on the double is made the registry's ``verbs`` for the test."""
    doubled = request.param == "verbs" and not NATIVE_VERBS
    if doubled:
        use_verbs_api(VERBS_DOUBLE)
    yield request.param
    if doubled:
        use_verbs_api(None)


@pytest.fixture
def options(rail) -> RailOptions:
    return RailOptions(
        token=b"conformance-token-0123456789",
        io_timeout=IO_TIMEOUT,
        connect_timeout=3.0,
        keepalive_idle=1.0,
        keepalive_interval=1.0,
        keepalive_count=2,
        verbs_api=VERBS_DOUBLE if rail == "verbs" and not NATIVE_VERBS else None,
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
