"""What producers of preprocessed samples read: a sample read from the backend for its server
stages comes home too, so the preload never reads it again (no daemon, no workers)."""

from __future__ import annotations

import numpy as np

from kspeed.server.backend.sources import open_source
from kspeed.server.hosting.preload import Preloader
from kspeed.server.memory.residency import HOME
from kspeed.server.production.processed import ProcessedProduction
from kspeed.server.production.state import ShareState
from tests.server.datasets import write_tree
from tests.server.test_preload import CountingSource


class Producer(ProcessedProduction):
    """Only what :meth:`ProcessedProduction._raw_inputs` uses: where samples that came home are told."""

    def __init__(self) -> None:
        self.came: list[int] = []

    def _came_home(self, share: ShareState, ids: np.ndarray) -> None:
        self.came += ids.tolist()


def test_samples_read_for_their_server_stages_come_home_and_are_not_read_again(backend, pool, tmp_path):
    files = write_tree(tmp_path / "d", [300 + 7 * k for k in range(12)])
    source = CountingSource(open_source(backend, "d", str(tmp_path / "d")))
    pool.allocate("d", range(Preloader.regions_needed(source, pool.region_size)))
    preloader = Preloader(source, pool)
    share = ShareState("d", preloader)
    producer = Producer()
    keys = sorted(files)  # sample IDs follow the sorted paths

    inputs, failed, read = producer._raw_inputs(share, np.array([3, 5, 7]))
    assert failed == {} and [bytes(x) for x in inputs] == [files[keys[k]] for k in (3, 5, 7)]
    assert read.tolist() == [3, 5, 7]
    assert producer.came == [3, 5, 7] and (share.residency.of(np.array([3, 5, 7])) == HOME).all()
    # Now they are home: their input is a view of it (the server copies it to a worker), and the
    # preload reads only the rest.
    region, offsets = preloader.home(np.array([5]))
    (again,), _, read = producer._raw_inputs(share, np.array([5]))
    assert not len(read)
    assert isinstance(again, np.ndarray) and again.tobytes() == files[keys[5]]
    assert np.shares_memory(again, pool.array(int(region[0])))
    assert preloader.preload(timeout=30).complete
    assert source.reads.tolist() == [1] * len(files)  # every sample read from the backend exactly once
    region, offsets = preloader.home(np.arange(len(files)))
    for k, key in enumerate(keys):
        stored = pool.array(int(region[k]))[int(offsets[k]) : int(offsets[k]) + len(files[key])]
        assert stored.tobytes() == files[key]
