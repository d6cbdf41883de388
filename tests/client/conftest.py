"""Fixtures of the client unit tests: datasets fed by in-process fake servers over real rails."""

from __future__ import annotations

import dataclasses

import pytest

from kspeed.client.options import FeedOptions
from tests.client.fakes import FakeServer, client_config, fake_info, make_samples, open_dataset

N_SAMPLES = 203


@pytest.fixture
def samples():
    return make_samples(N_SAMPLES)


@pytest.fixture(params=["off", "on"], ids=["unpaced", "paced"])
def make_ds(samples, request):
    """``make_ds(servers=2, rail="shm", kept=None, **dataset_kwargs) -> (dataset, fakes)``; closed at
    teardown. ``kept``: each fake server's live positions by its ID (those of earlier fakes).

    Every test using it runs unpaced and paced (sub-batches of one sample, a pacing thread).
    """
    made = []
    pacing = {"pacing": request.param, "pace_round": 1e-6}

    def make(servers: int = 2, rail: str = "shm", config=None, kept=None, **kwargs):
        config = dataclasses.replace(config or client_config(), **pacing)
        bounds = [len(samples) * i // servers for i in range(servers + 1)]
        fakes = [FakeServer(f"s{i}", samples, bounds[i], bounds[i + 1]) for i in range(servers)]
        for fake in fakes if kept is not None else ():  # (servers that keep the positions of earlier ones)
            fake.kept = kept[fake.server_id]
        info = fake_info(samples, [(f.server_id, f.lo, f.hi) for f in fakes])
        kwargs.setdefault("batch_size", 16)
        kwargs.setdefault("ring_bytes", 1 << 20)
        ds = open_dataset(info, fakes, config=config, options=FeedOptions.from_kwargs(rail=rail, **kwargs))
        made.append((ds, fakes))
        return ds, fakes

    yield make
    for ds, fakes in made:
        ds.close()
        for fake in fakes:
            fake.close()
