"""A training process that logs at INFO hears nothing from the client library while all goes well.

Training scripts commonly call ``logging.basicConfig(level=logging.INFO)``; every rank would then
print the client's connection, placement, rail and pacing details. The library says those at
DEBUG, and its tcp receiver process (which runs at the training process's level) too.
"""

from __future__ import annotations

import logging

from torchvision.datasets import ImageFolder

from kspeed import DatasetSpec, KSpeedClient
from tests.client.test_wrap import CLASSES, PER_CLASS, jpeg_loader, make_jpegs, to_normalized_tensor
from tests.integration.test_client import config_for


def test_a_training_process_logging_at_info_hears_nothing_from_kspeed(cluster_factory, tmp_path, caplog, capfd):
    root = make_jpegs(tmp_path / "imgs")
    cluster = cluster_factory(1, server_args=["--backend-allow", str(tmp_path), "--memory", "16MiB"])
    caplog.set_level(logging.INFO)  # as logging.basicConfig(level=logging.INFO) in a training script
    client = KSpeedClient(config=config_for(cluster, rail="tcp", pacing="on"))
    try:
        ds = client.dataset(DatasetSpec(name="imgs", uri=str(root)), batch_size=8, ring_bytes=4 << 20)
        ds.preload(quiet=True)
        assert sum(len(batch) for batch in ds) == len(CLASSES) * PER_CLASS
        folder = ImageFolder(str(root), transform=to_normalized_tensor, loader=jpeg_loader)
        wrapped = client.wrap(folder, batch_size=8, num_workers=0, ring_bytes=4 << 20, quiet=True)
        assert sum(len(targets) for _, targets in wrapped) == len(folder)
    finally:
        client.close()
    said = [
        f"{r.name}: {r.getMessage()}"
        for r in caplog.records
        if r.name.startswith("kspeed") and r.levelno >= logging.INFO
    ]
    assert said == [], "\n".join(said)
    printed = capfd.readouterr().err
    assert "kspeed-tcp-receiver" not in printed, printed
