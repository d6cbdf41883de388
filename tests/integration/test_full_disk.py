"""A server whose state disk fills up, against real daemons: it keeps serving what it holds, refuses a
new dataset with an error naming the file and the space left, preloads without counting the index
it cannot save as a failed sample, starts again while the disk is still full, and takes the refused
dataset once there is room. Its state directory and pool live on a small tmpfs (root only; skipped
otherwise)."""

from __future__ import annotations

import numpy as np
import pytest

from kspeed.control.progress import follow_preload
from kspeed.errors import StateFileError
from kspeed.proto import kspeed_pb2
from tests.fulldisk import fill, small_disk
from tests.helpers import client_for
from tests.integration.test_datasets import DS, log_of, make_tree, server_stubs

MEMORY = 8 << 20  # the tests' server memory (tests/conftest.py)


@pytest.fixture
def disk(tmp_path):
    """A tmpfs with room for the pool and a little more (set up before the cluster, so it is
    unmounted after the cluster stops)."""
    with small_disk(tmp_path / "disk", MEMORY + (1 << 20)) as where:
        yield where


def read_all(info: kspeed_pb2.DatasetInfo, files: dict[str, bytes]) -> None:
    """Every sample of the one-server dataset ``info``, read from its server, is intact."""
    (stub,) = server_stubs(None, info).values()
    ids = np.arange(len(files), dtype=np.int64)
    reply = stub.Read(kspeed_pb2.ReadRequest(dataset=info.spec.name, ids=ids.tobytes()), timeout=30)
    ends = np.cumsum(np.frombuffer(reply.lengths, np.uint32)).tolist()
    assert [reply.data[a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True)] == list(files.values())


@pytest.mark.timeout(180)
def test_a_full_state_disk_costs_new_datasets_only(disk, cluster_factory, tmp_path):
    one = make_tree(tmp_path / "one", per_class=8, max_size=32 * 1024)
    two = make_tree(tmp_path / "two", per_class=8, max_size=32 * 1024, seed=1)
    places = ["--state-dir", str(disk / "state"), "--pool-dir", str(disk / "pool")]
    cluster = cluster_factory(1, server_args=["--backend-allow", str(tmp_path), *places])
    server = cluster.servers[0]
    spec = {name: kspeed_pb2.DatasetSpec(name=name, uri=str(tmp_path / name)) for name in ("one", "two")}
    with client_for(cluster) as client:
        client.create_dataset(spec["one"], operator=True)
        filler = fill(disk)

        # The preload's index and pool manifest cannot be saved: not a failed sample.
        info = follow_preload(client, "one", out=None, timeout=60)
        assert info.state == DS.DATASET_STATE_READY and info.progress.error_count == 0, info.progress.errors
        read_all(info, one)

        with pytest.raises(StateFileError, match=r"cannot write \S+\.json: No space left on device \(0 B free"):
            client.create_dataset(spec["two"], operator=True)
        assert [d.spec.name for d in client.datasets()] == ["one"]
        read_all(client.dataset("one"), one)  # still served

        server.stop()  # and started again, the disk still full
        written = len(log_of(server))
        cluster.start_server(server)
        cluster.wait_members()
        assert "cannot write" in log_of(server)[written:]  # says what it could not write
        read_all(client.dataset("one"), one)

        filler.unlink()
        client.create_dataset(spec["two"], operator=True)
        info = follow_preload(client, "two", out=None, timeout=60)
        assert info.state == DS.DATASET_STATE_READY
        read_all(info, two)
        # What was loaded while the disk was full was not recorded: the restart loads it again.
        assert follow_preload(client, "one", out=None, timeout=60).state == DS.DATASET_STATE_READY
