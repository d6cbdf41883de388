"""Fixtures of the client unit tests: datasets fed by in-process fake servers over real rails."""

from __future__ import annotations

import pytest

from kspeed.client.dataset import KSpeedDataset
from tests.client.fakes import FakeServer, client_config, fake_info, make_samples

N_SAMPLES = 203


@pytest.fixture
def samples():
    return make_samples(N_SAMPLES)


@pytest.fixture
def make_ds(samples):
    """``make_ds(servers=2, rail="shm", **dataset_kwargs) -> (dataset, fakes)``; closed at teardown."""
    made = []

    def make(servers: int = 2, rail: str = "shm", config=None, **kwargs):
        bounds = [len(samples) * i // servers for i in range(servers + 1)]
        fakes = [FakeServer(f"s{i}", samples, bounds[i], bounds[i + 1]) for i in range(servers)]
        info = fake_info(samples, [(f.server_id, f.lo, f.hi) for f in fakes])
        kwargs.setdefault("batch_size", 16)
        kwargs.setdefault("ring_bytes", 1 << 20)
        ds = KSpeedDataset(info, fakes, config=config or client_config(), rail=rail, **kwargs)
        made.append((ds, fakes))
        return ds, fakes

    yield make
    for ds, fakes in made:
        ds.close()
        for fake in fakes:
            fake.close()
