"""Hugging Face Accelerate (``accelerate`` 1.x) prepares a model, its optimizer and a KSpeed dataset
in a two-process torchrun job on CPU: each process reads its own part of every epoch, every sample
once, a new order each epoch; a DataLoader over the dataset handed to ``prepare()`` is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.test_datasets import make_tree
from tests.integration.test_torchrun import torchrun

JOB = Path(__file__).with_name("accelerate_job.py")


def launch(cluster, tmp_path, mode: str, processes: int) -> list[dict]:
    out = tmp_path / mode
    out.mkdir()
    torchrun(cluster, JOB, str(tmp_path / "imgs"), str(out), mode, processes=processes)
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(processes)]


@pytest.mark.timeout(400)
def test_accelerate_prepares_the_dataset_and_each_process_reads_its_part(cluster_factory, tmp_path):
    files = make_tree(tmp_path / "imgs", per_class=20, max_size=4000)  # 60 samples
    cluster = cluster_factory(1, server_args=["--backend-allow", str(tmp_path)])
    ranks = launch(cluster, tmp_path, "dataset", 2)
    assert [(r["process"], r["rank"], r["world_size"], r["same"]) for r in ranks] == [(0, 0, 2, True), (1, 1, 2, True)]
    for epoch in range(2):
        got = [r["epochs"][epoch] for r in ranks]
        assert len(got[0]) == len(got[1]) == len(files) // 2
        assert sorted(got[0] + got[1]) == list(range(len(files)))  # every sample once, no rank's twice
    assert ranks[0]["epochs"][0] != ranks[0]["epochs"][1]  # the epoch reached the sampler

    refused = launch(cluster, tmp_path, "loader", 1)[0]
    assert refused["error"].startswith("StateError: dataset 'accelerate' is iterated through a DataLoader")
    assert "accelerator.prepare(ds)" in refused["error"]
