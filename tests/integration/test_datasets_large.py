"""The servers issue's acceptance run at full size (``make test-slow``): 10,000 files of 1 KiB-2 MiB."""

from __future__ import annotations

import io
import os
import shutil
import tempfile

import numpy as np
import pytest

from kspeed.cli.cluster import wait_for
from kspeed.control.progress import follow_preload
from kspeed.proto import kspeed_pb2
from tests.helpers import client_for
from tests.integration.test_datasets import broadcast_lookup, server_stubs

pytestmark = pytest.mark.slow

N_FILES = 10_000


@pytest.fixture
def shm_root():
    root = tempfile.mkdtemp(prefix="kspeed-slowtest-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_ten_thousand_mixed_files_end_to_end(cluster_factory, tmp_path, shm_root):
    rng = np.random.default_rng(7)
    sizes = np.exp(rng.uniform(np.log(1024), np.log(2 << 20), N_FILES)).astype(np.int64)  # log-uniform
    root = tmp_path / "mixed"
    keys = []
    for i, size in enumerate(sizes.tolist()):
        rel = f"class{i % 10}/{i:05d}.bin"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
        keys.append(rel)
    keys.sort()
    total = int(sizes.sum())
    window = 32 << 20  # one region of production window beside the share
    per_server = f"{(total // 2 + (64 << 20) + window) >> 20}MiB"
    cluster = cluster_factory(
        2,
        pool_root=shm_root,
        server_args=[
            "--backend-allow",
            str(tmp_path),
            "--memory",
            per_server,
            "--region-size",
            "32MiB",
            "--production-window",
            str(window),
        ],
    )
    with client_for(cluster) as client:
        wait_for(lambda: len([r for r in client.servers() if r.state == 2]) == 2, 20, "ready")
        reply = client.create_dataset(
            kspeed_pb2.DatasetSpec(name="mixed", uri=str(root), labels="dirname"), operator=True
        )
        assert reply.dataset.fingerprint.count == N_FILES and reply.dataset.fingerprint.total_bytes == total
        bar = io.StringIO()
        info = follow_preload(client, "mixed", out=bar, timeout=600)
        assert "10000/10000 samples" in bar.getvalue()
        ids = rng.permutation(N_FILES)
        replies = broadcast_lookup(server_stubs(cluster, info), "mixed", ids, chunk=4096)
        positions = np.concatenate([r[0] for r in replies.values()])
        assert np.array_equal(np.sort(positions), np.arange(N_FILES))
        for pos, lengths, _ in replies.values():
            assert np.array_equal(lengths, [os.path.getsize(root / keys[i]) for i in ids[pos]])
        for share in info.shares:
            stub = server_stubs(cluster, info)[share.server_id]
            for start in range(share.first_id, share.end_id, 64):
                batch = np.arange(start, min(start + 64, share.end_id), dtype="<i8")
                got = stub.Read(kspeed_pb2.ReadRequest(dataset="mixed", ids=batch.tobytes()), timeout=60)
                offsets = np.concatenate(([0], np.cumsum(np.frombuffer(got.lengths, "<u4"), dtype=np.int64)))
                for j, sid in enumerate(batch.tolist()):
                    assert got.data[offsets[j] : offsets[j + 1]] == (root / keys[sid]).read_bytes()
        client.remove_dataset("mixed")
