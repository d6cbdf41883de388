"""Fixtures for the server storage tests: tiny regions, temporary pools and backends."""

from __future__ import annotations

import pytest

from kspeed.server.backend.access import Backend
from kspeed.server.backend.allowlist import AllowList
from kspeed.server.memory.pool import MemoryPool
from tests.server.datasets import REGION


@pytest.fixture
def pool(tmp_path):
    """A pool of eight 1 MiB regions, destroyed after the test."""
    p = MemoryPool.create(tmp_path / "pool", 8 * REGION, region_size=REGION)
    yield p
    p.destroy()


@pytest.fixture
def backend(tmp_path):
    """A backend admitting the test's directory, locally and through the throttled file system."""
    return Backend(AllowList([str(tmp_path), f"slowfile://{tmp_path}"]), {"slowfile": {"latency": 0.002}})
