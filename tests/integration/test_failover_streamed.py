"""A holder killed while a dataset larger than its memory streams: every memory policy, every source kind.

Real daemons on loopback: two servers over a backend that takes a few milliseconds a read
(``slowfile``, or moto's S3 read through ``throttled``), a dataset about three times the memory
it is given, not preloaded, so grants wait on production. A holder is SIGKILLed while epoch 0
streams, at a batch that finds grants to it in flight; its share moves to a spare, or to the
survivor; the client fences the dead path and grants again, on every server, each batch it had
not delivered, so the survivor must make resident again samples it had written and let go. Both
epochs arrive whole: every sample exactly
once, in the sampler's order, bytes intact.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import numpy as np
import pytest

from kspeed import DatasetSpec, KSpeedClient
from tests.integration.conftest import S3_KEY, S3_SECRET
from tests.integration.test_client import config_for, loader_order
from tests.integration.test_datasets import make_tree, write_shards
from tests.integration.test_failover import BATCH, SEED, check_epoch

REGION = 256 << 10
MEMORY = ["--memory", "8MiB", "--region-size", "256KiB"]  # 32 regions, 4 of them the server's window
QUOTA = 2 * REGION  # one region on each server, a third of the dataset
# A backend read takes 5 ms, and a server reads 2 MB/s at most: slower than the client consumes,
# so its grants wait for production (under every policy: a whole dataset's preload reads in runs).
SLOW = {"latency": 0.005, "bandwidth": 2e6}


def dataset(kind: str, root, s3=None) -> tuple[dict[str, bytes], str, str]:
    """A dataset of about 1.5 MB as a source of ``kind`` under ``root`` (``s3*`` kinds: uploaded to
    the moto endpoint ``s3``): ``(bytes per key in sample ID order, uri, DatasetSpec kind)``."""
    if kind == "npy":
        rows = np.random.default_rng(7).integers(0, 256, (384, 4096), dtype=np.uint8)
        np.save(root / "rows.npy", rows)
        return {str(i): row.tobytes() for i, row in enumerate(rows)}, f"slowfile://{root / 'rows.npy'}", "npy"
    files = make_tree(root / "imgs", per_class=100, max_size=32 * 1024, seed=12)
    if kind == "dir":
        return files, f"slowfile://{root / 'imgs'}", "dir"
    if kind == "list":  # IDs follow the lines: the keys' sorted order, as the directory's
        (root / "train.txt").write_text("".join(f"imgs/{key}\n" for key in files))
        return files, f"slowfile://{root / 'train.txt'}", "list"
    if kind == "manifest":
        (root / "train.manifest").write_text("".join(f"imgs/{key} {len(data)}\n" for key, data in files.items()))
        return files, f"slowfile://{root / 'train.manifest'}", "manifest"
    if kind == "tar":
        write_shards(root / "shards", files, 4)
        return files, f"slowfile://{root / 'shards'}", "tar"
    fs = s3[1]  # read through ``throttled``: a bucket as slow as ``slowfile``, whatever moto's speed
    fs.mkdir("train-bucket")
    if kind == "s3dir":
        for key, data in files.items():
            fs.pipe_file(f"train-bucket/imgs/{key}", data)
        return files, "throttled://train-bucket/imgs", "dir"
    assert kind == "s3tar", kind
    for path in write_shards(root / "shards", files, 4):
        fs.put_file(path, f"train-bucket/shards/{path.rsplit('/', 1)[-1]}")
    return files, "throttled://train-bucket/shards", "tar"


def slow_servers(cluster_factory, tmp_path, s3=None, manager_args=()):
    """Two servers reading ``tmp_path`` through ``slowfile`` (and the bucket of the moto endpoint ``s3``
    through ``throttled``, as slow: moto alone can answer fast enough that a kill finds no grant in
    flight); ``manager_args``: more flags for the manager."""
    options: dict = {"slowfile": SLOW}
    allow = f"slowfile://{tmp_path}"
    if s3 is not None:
        bucket = {"key": S3_KEY, "secret": S3_SECRET, "client_kwargs": {"endpoint_url": s3[0]}}
        options["throttled"] = {**SLOW, "target_protocol": "s3", "target_options": bucket}
        allow += ",throttled://train-bucket"
    args = ["--backend-allow", allow, "--backend-options", json.dumps(options), "--production-threads", "2"]
    return cluster_factory(2, server_args=[*MEMORY, *args], manager_args=manager_args)


class GrantedKill:
    """An ``on_batch`` for :func:`check_epoch` that SIGKILLs ``victim`` after a batch at which ``ds``'s
    feed has grants outstanding on it (waiting up to 0.2 s for one, then trying at the next batch),
    checked and sent under the feed's lock so that no completion is taken meanwhile. A kill right
    after a given batch can find every grant to the victim answered (the ring full of samples not
    yet consumed), and then no failover has anything in flight to fence."""

    def __init__(self, ds, victim) -> None:
        self.feed, self.victim, self.killed_after = ds._feed, victim, -1
        self.paths = {p.index for p in self.feed.paths if p.link.server_id == victim.ready["id"]}

    def __call__(self, k: int) -> None:
        deadline = time.monotonic() + 0.2
        while self.killed_after < 0 and time.monotonic() < deadline:
            with self.feed.lock:
                if any(entry.path in self.paths for entry in self.feed.outstanding.values()):
                    self.victim.signal(signal.SIGKILL)
                    self.killed_after = k
            time.sleep(0.002)


def kill_while_streaming(
    cluster_factory, tmp_path, policy: str, kind: str, spare: bool, s3=None
) -> tuple[dict, str, set[str]]:
    """Two servers, a dataset of ``kind`` held under ``policy``; a holder killed at the first batch
    of epoch 0 with grants to it in flight (with a ``spare`` registered, or not); epochs 0 and 1
    checked whole (every sample once, in order, intact). Returns the job's stats after epoch 0,
    the killed server's id and the dataset's holders after epoch 1, for the caller to check the
    failover."""
    files, uri, source = dataset(kind, tmp_path, s3)
    cluster = slow_servers(cluster_factory, tmp_path, s3)
    quota = 0 if policy == "cache" else QUOTA
    spec = DatasetSpec(name="big", uri=uri, kind=source, quota_bytes=quota, policy=policy)
    with KSpeedClient(config=config_for(cluster, failover_timeout="60s")) as client:
        ds = client.dataset(spec, batch_size=BATCH, seed=SEED, ring_bytes=1 << 20, quiet=True)
        shares = client.manager.dataset("big").shares
        assert len(shares) == 2 and {s.policy for s in shares} == {"" if policy == "cache" else policy}, shares
        if policy != "cache":  # held in part: each server streams a share three times its window
            assert all(s.num_regions >= 3 * s.memory_regions for s in shares), shares
        if spare:
            cluster.add_server()  # registered after the dataset: it holds nothing
        victim = next(s for s in cluster.servers if s.ready["id"] == shares[0].server_id)

        kill = GrantedKill(ds, victim)
        check_epoch(ds, files, 0, kill)
        assert kill.killed_after >= 0, "no batch of epoch 0 found a grant in flight on the victim"
        stats = ds.stats()
        check_epoch(ds, files, 1)  # the moved share, held by its new server, for a whole epoch
        holders = {s.server_id for s in client.manager.dataset("big").shares}
        ds.close()
    return stats, victim.ready["id"], holders


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("policy", "kind", "spare"),
    [("stream", "tar", True), ("lru", "npy", False)],  # every policy and kind, with and without a spare: -m slow
)
def test_a_holder_killed_while_a_dataset_streams_costs_a_pause_not_a_sample(
    cluster_factory, tmp_path, policy, kind, spare
):
    stats, victim, holders = kill_while_streaming(cluster_factory, tmp_path, policy, kind, spare)
    assert stats["replaced_servers"] == 1 and stats["fenced_grants"] >= 1, stats  # grants were in flight
    assert victim not in holders and len(holders) == (2 if spare else 1), holders


@pytest.mark.timeout(120)
def test_a_holder_killed_while_tar_shards_in_a_bucket_stream_costs_a_pause_not_a_sample(
    s3_endpoint, cluster_factory, tmp_path
):
    stats, victim, holders = kill_while_streaming(cluster_factory, tmp_path, "stream", "s3tar", True, s3_endpoint)
    assert stats["replaced_servers"] == 1 and stats["fenced_grants"] >= 1, stats
    assert victim not in holders and len(holders) == 2, holders  # the spare took the share


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("spare", [False, True], ids=["survivor", "spare"])
@pytest.mark.parametrize("kind", ["dir", "list", "manifest", "npy", "tar", "s3dir", "s3tar"])
@pytest.mark.parametrize("policy", ["stream", "minio", "reuse", "lru", "cache"])
def test_every_policy_and_source_kind_survive_a_holder_killed_while_streaming(tmp_path, request, policy, kind, spare):
    # The bucket first: fixtures end in the reverse order, so the servers stop before it does.
    s3 = request.getfixturevalue("s3_endpoint") if kind.startswith("s3") else None
    stats, victim, holders = kill_while_streaming(
        request.getfixturevalue("cluster_factory"), tmp_path, policy, kind, spare, s3
    )
    assert stats["replaced_servers"] == 1 and stats["fenced_grants"] >= 1, stats
    assert victim not in holders and len(holders) == (2 if spare else 1), holders


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_two_ranks_streaming_at_once_survive_a_holder_killed(cluster_factory, tmp_path):
    # Both ranks' feeds share the survivor's window; each grants again its own batches.
    files, uri, source = dataset("dir", tmp_path)
    cluster = slow_servers(cluster_factory, tmp_path)
    spec = DatasetSpec(name="big", uri=uri, kind=source, quota_bytes=QUOTA, policy="stream")
    with KSpeedClient(config=config_for(cluster)) as client:  # an operator's: it outlives the ranks
        client.manager.create_dataset(spec.to_proto(), operator=True)
        victim_id = client.manager.dataset("big").shares[0].server_id
    victim = next(s for s in cluster.servers if s.ready["id"] == victim_id)
    keys = list(files)
    streaming = threading.Barrier(2, timeout=60)  # both ranks have a batch: the kill finds both streaming
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            with KSpeedClient(config=config_for(cluster, failover_timeout="60s")) as client:
                ds = client.dataset(spec, batch_size=BATCH, seed=SEED, rank=r, world_size=2, quiet=True)
                for epoch in (0, 1):
                    ds.set_epoch(epoch)
                    got = []
                    for k, batch in enumerate(ds):
                        for i, sid in enumerate(batch.ids.tolist()):
                            assert batch.numpy(i).tobytes() == files[keys[sid]], (r, epoch, sid)
                        got.append(batch.ids.tolist())
                        if epoch == 0 and k == 0 and streaming.wait() == 0:
                            victim.signal(signal.SIGKILL)
                    assert got == loader_order(len(files), 2, r, True, SEED, False, epoch, BATCH), (r, epoch)
                assert ds.stats()["replaced_servers"] == 1
                ds.close()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=140)
    assert not any(t.is_alive() for t in threads), "a rank did not finish"
    if errors:
        raise errors[0]
