"""Object storage through fsspec: a dataset in an S3 bucket trains exactly like the same files in a directory.

The S3 endpoint is moto's server mode, started on a free loopback port by the ``s3_endpoint``
fixture (``tests/integration/conftest.py``) and stopped after the test. The servers read the bucket
through s3fs with the endpoint and credentials of their own configuration (``--backend-options``);
the client names only the ``s3://`` URI, and the allow-list admits the bucket's prefix only.
"""

from __future__ import annotations

import functools
import http.server
import json
import threading

import pytest

from kspeed import DatasetSpec, KSpeedClient
from kspeed.errors import AccessDeniedError, KSpeedError
from tests.integration.conftest import S3_KEY, S3_SECRET
from tests.integration.test_client import config_for, loader_order
from tests.integration.test_datasets import make_tree, write_shards

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

BATCH = 8
SEED = 2


def upload(fs, files: dict[str, bytes], prefix: str) -> None:
    bucket = prefix.split("/", 1)[0]
    if not fs.exists(bucket):
        fs.mkdir(bucket)
    for rel, data in files.items():
        fs.pipe_file(f"{prefix}/{rel}", data)


def epochs(client, spec, files, epochs=2, **kwargs) -> list[list[tuple[list[int], list[int]]]]:
    """Read ``epochs`` epochs, checking every sample's bytes; per epoch, each batch's IDs and
    labels (-1 where the dataset has none)."""
    keys = list(files)
    ds = client.dataset(spec, batch_size=BATCH, seed=SEED, ring_bytes=2 << 20, quiet=True, **kwargs)
    out = []
    for epoch in range(epochs):
        ds.set_epoch(epoch)
        got = []
        for batch in ds:
            for i, sid in enumerate(batch.ids.tolist()):
                assert batch.numpy(i).tobytes() == files[keys[sid]], (spec.name, epoch, sid)
            got.append((batch.ids.tolist(), batch.labels.tolist()))
        out.append(got)
    ds.close()
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("policy", ["auto", "stream"])
def test_an_s3_bucket_trains_exactly_like_a_directory_of_the_same_files(s3_endpoint, cluster_factory, tmp_path, policy):
    url, fs = s3_endpoint
    files = make_tree(tmp_path / "imgs", per_class=30, max_size=32 * 1024, seed=5)
    upload(fs, files, "train-bucket/imagenet/train")
    options = {"s3": {"key": S3_KEY, "secret": S3_SECRET, "client_kwargs": {"endpoint_url": url}}}
    cluster = cluster_factory(
        2,
        server_args=[
            "--backend-allow",
            f"{tmp_path},s3://train-bucket/imagenet",
            "--backend-options",
            json.dumps(options),
        ],
    )
    quota = (1 << 20) if policy == "stream" else 0
    in_s3 = DatasetSpec(
        name="s3imgs", uri="s3://train-bucket/imagenet/train", labels="dirname", quota_bytes=quota, policy=policy
    )
    local = DatasetSpec(name="localimgs", uri=str(tmp_path / "imgs"), labels="dirname")
    with KSpeedClient(config=config_for(cluster)) as client:
        for spec in (in_s3, local):  # (an operator's: they outlive the jobs, for the checks below)
            client.manager.create_dataset(spec.to_proto(), operator=True)
        from_s3 = epochs(client, in_s3, files)
        from_dir = epochs(client, local, files)
        assert from_s3 == from_dir  # the same IDs (sorted keys), the same order, the same bytes
        assert [ids for ids, _ in from_s3[0]] == loader_order(len(files), 1, 0, True, SEED, False, 0, BATCH)
        s3_info, dir_info = client.manager.dataset("s3imgs"), client.manager.dataset("localimgs")
        assert {s.policy for s in s3_info.shares} == ({"stream"} if policy == "stream" else {""})
        # the labels (each key's parent "directory") and the sizes are the directory's
        assert list(s3_info.class_names) == ["ant", "bee", "cat"] == list(dir_info.class_names)
        assert s3_info.fingerprint.total_bytes == dir_info.fingerprint.total_bytes


@pytest.mark.timeout(120)
def test_the_allow_list_holds_for_buckets_and_prefixes(s3_endpoint, cluster_factory, tmp_path):
    url, fs = s3_endpoint
    files = make_tree(tmp_path / "imgs", per_class=4, max_size=4096, seed=6)
    upload(fs, files, "train-bucket/imagenet/train")
    upload(fs, files, "train-bucket/private/train")
    upload(fs, files, "other-bucket/imagenet/train")
    options = {"s3": {"key": S3_KEY, "secret": S3_SECRET, "client_kwargs": {"endpoint_url": url}}}
    cluster = cluster_factory(
        1, server_args=["--backend-allow", "s3://train-bucket/imagenet", "--backend-options", json.dumps(options)]
    )
    with KSpeedClient(config=config_for(cluster)) as client:
        for uri in (
            "s3://train-bucket/private/train",
            "s3://other-bucket/imagenet/train",
            "s3://train-bucket/imagenet2",
        ):
            with pytest.raises(KSpeedError) as refused:
                client.manager.create_dataset(DatasetSpec(name="no", uri=uri).to_proto(), operator=True)
            assert isinstance(refused.value, AccessDeniedError) or "allow" in str(refused.value), uri
        assert client.manager.datasets() == []
        ok = client.manager.create_dataset(
            DatasetSpec(name="yes", uri="s3://train-bucket/imagenet/train").to_proto(), operator=True
        )
        assert ok.dataset.fingerprint.count == len(files)


@pytest.fixture
def web_server(tmp_path):
    """A real HTTP server (the standard library's) serving ``tmp_path/www`` on a free loopback port."""
    root = tmp_path / "www"
    root.mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="web-server", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", root
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.mark.timeout(120)
def test_a_manifest_over_http_trains_like_the_directory(web_server, cluster_factory, tmp_path):
    url, root = web_server
    files = make_tree(root / "imgs", per_class=10, max_size=16 * 1024, seed=7)
    (root / "train.manifest").write_text("".join(f"imgs/{k} {len(v)}\n" for k, v in files.items()))
    cluster = cluster_factory(1, server_args=["--backend-allow", f"{tmp_path},{url}"])
    over_http = DatasetSpec(name="web", uri=f"{url}/train.manifest", kind="manifest")
    local = DatasetSpec(name="dir", uri=str(root / "imgs"))
    with KSpeedClient(config=config_for(cluster)) as client:
        assert epochs(client, over_http, files) == epochs(client, local, files)
        missing = DatasetSpec(name="gone", uri=f"{url}/nothing.manifest", kind="manifest")
        with pytest.raises(KSpeedError) as refused:
            client.manager.create_dataset(missing.to_proto(), operator=True)
        assert "nothing.manifest" in str(refused.value) and "Exception calling application" not in str(refused.value)


@pytest.mark.timeout(180)
def test_tar_shards_locally_and_in_a_bucket_train_exactly_like_the_directory(s3_endpoint, cluster_factory, tmp_path):
    url, fs = s3_endpoint
    files = make_tree(tmp_path / "imgs", per_class=25, max_size=32 * 1024, seed=8)
    shards = write_shards(tmp_path / "shards", files, 4)
    for path in shards:
        fs.makedirs("train-bucket/shards", exist_ok=True)
        fs.put_file(path, f"train-bucket/shards/{path.rsplit('/', 1)[-1]}")
    options = {"s3": {"key": S3_KEY, "secret": S3_SECRET, "client_kwargs": {"endpoint_url": url}}}
    cluster = cluster_factory(
        2, server_args=["--backend-allow", f"{tmp_path},s3://train-bucket", "--backend-options", json.dumps(options)]
    )
    local = DatasetSpec(name="dir", uri=str(tmp_path / "imgs"), labels="dirname")
    tar = DatasetSpec(name="tar", uri=str(tmp_path / "shards" / "train-{000..003}.tar"), labels="cls")
    streamed = DatasetSpec(
        name="tarstream", uri=str(tmp_path / "shards"), kind="tar", labels="cls", quota_bytes=1 << 20, policy="stream"
    )
    in_s3 = DatasetSpec(name="s3tar", uri="s3://train-bucket/shards/train-{000..003}.tar", labels="cls")
    with KSpeedClient(config=config_for(cluster)) as client:
        reference = epochs(client, local, files)
        for spec in (tar, streamed, in_s3):
            assert epochs(client, spec, files) == reference, spec.name  # IDs, order, bytes and labels
