"""A KSpeed dataset is a ``torch.distributed.checkpoint`` ``Stateful``: saved by ``dcp.save`` beside a
model's weights, loaded by ``dcp.load`` into a new dataset, it resumes with exactly the batches
not yet consumed (one process, no process group)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

from kspeed import DatasetSpec, KSpeedClient
from tests.integration.test_client import config_for
from tests.integration.test_datasets import make_tree


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # (one process: as meant)
def test_dcp_saves_the_loader_beside_the_model_and_a_new_loader_resumes_from_it(cluster_factory, tmp_path):
    files = make_tree(tmp_path / "imgs", per_class=12, max_size=2000)  # 36 samples
    cluster = cluster_factory(1, server_args=["--backend-allow", str(tmp_path)])
    spec = DatasetSpec(name="dcp", uri=str(tmp_path / "imgs"))
    checkpoint = tmp_path / "checkpoint"
    with KSpeedClient(config=config_for(cluster)) as client:
        ds = client.dataset(spec, batch_size=5, seed=9, quiet=True)
        assert isinstance(ds, Stateful)
        ds.set_epoch(2)
        whole = [batch.ids.tolist() for batch in ds]  # the epoch's batches, for reference
        ds.set_epoch(2)
        it = iter(ds)
        consumed = [next(it).ids.tolist() for _ in range(3)]
        model = torch.nn.Linear(3, 2)
        dcp.save({"model": model.state_dict(), "loader": ds}, checkpoint_id=str(checkpoint))
        ds.close()

        resumed = client.dataset(spec, batch_size=5, seed=9, quiet=True)
        fresh = torch.nn.Linear(3, 2)
        state = {"model": fresh.state_dict(), "loader": resumed}
        dcp.load(state, checkpoint_id=str(checkpoint))
        fresh.load_state_dict(state["model"])
        assert resumed.epoch == 2
        resumed.set_epoch(2)  # (the usual loop's call keeps the loaded position)
        rest = [batch.ids.tolist() for batch in resumed]
        resumed.close()
    assert consumed == whole[:3] and rest == whole[3:]
    assert sorted(i for batch in consumed + rest for i in batch) == list(range(len(files)))
    assert torch.equal(fresh.weight, model.weight)
