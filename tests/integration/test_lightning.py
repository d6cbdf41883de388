"""A KSpeed dataset returned from a PyTorch Lightning module's ``train_dataloader()``, trained by a
real ``Trainer``: Lightning sets each epoch on the loader's ``sampler`` only, and every epoch used
to arrive in epoch 0's order. Each epoch now delivers every sample once, in an order of its own;
under Lightning's ``ddp`` each of two processes reads its own half."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kspeed import KSpeedClient
from tests.integration.lightning_job import Job, trainer
from tests.integration.test_client import config_for
from tests.integration.test_datasets import make_tree
from tests.integration.test_torchrun import run_job

EPOCHS = 3
SCRIPT = Path(__file__).with_name("lightning_job.py")


def test_a_lightning_trainer_sets_each_epoch_through_the_loaders_sampler(cluster_factory, tmp_path):
    files = make_tree(tmp_path / "imgs", per_class=10, max_size=2000)  # 30 samples
    cluster = cluster_factory(1, server_args=["--backend-allow", str(tmp_path)])
    with KSpeedClient(config=config_for(cluster)) as client:
        model = Job(client, str(tmp_path / "imgs"), "lightning")
        trainer(EPOCHS, str(tmp_path), devices=1).fit(model)
        ds = model.ds
        ds.close()
    assert len(model.seen) == EPOCHS and ds.epoch == EPOCHS - 1 and ds.sampler.epoch == EPOCHS - 1
    for ids in model.seen:
        assert sorted(ids) == list(range(len(files)))  # every sample once in each epoch
    assert len({tuple(ids) for ids in model.seen}) == EPOCHS  # each epoch in an order of its own
    assert len(ds.sampler) == len(files) and ds.sampler.sampler is not None


@pytest.mark.parametrize("where", ["init", "train_dataloader"])
def test_a_two_process_ddp_job_reads_disjoint_halves_in_a_new_order_each_epoch(cluster_factory, tmp_path, where):
    files = make_tree(tmp_path / "imgs", per_class=10, max_size=2000)  # 30 samples
    cluster = cluster_factory(1, server_args=["--backend-allow", str(tmp_path)])
    out = tmp_path / "out"
    out.mkdir()
    run_job(cluster, str(SCRIPT), str(tmp_path / "imgs"), str(out), where)
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]
    assert [(r["rank"], r["world_size"]) for r in ranks] == [(0, 2), (1, 2)]
    for epoch in range(2):
        first, second = (r["epochs"][epoch] for r in ranks)
        assert not set(first) & set(second)  # no sample on both ranks
        assert sorted(first + second) == list(range(len(files)))  # every sample once
    assert all(r["epochs"][0] != r["epochs"][1] for r in ranks)  # a new order each epoch
