"""Datasets on a real cluster: register, preload, broadcast lookup, read, leases, restart, bad input."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time

import grpc
import numpy as np
import pytest

from kspeed.cli.cluster import wait_for
from kspeed.control.progress import follow_preload
from kspeed.errors import AccessDeniedError, ConflictError, DatasetError, NotFoundError, ProtocolError, StateError
from kspeed.proto import kspeed_pb2, kspeed_pb2_grpc
from tests.helpers import client_for

DS = kspeed_pb2.DatasetState


def held_by_datasets(record) -> int:
    """Regions of a server that datasets hold (all but the free ones and the production window's)."""
    inv = record.inventory
    return inv.regions_total - inv.regions_window - inv.regions_free


def make_tree(root, classes=("ant", "bee", "cat"), per_class=40, seed=0, max_size=64 * 1024):
    """Class folders of files with varied sizes (zero-length included); returns {relpath: bytes} sorted."""
    rng = np.random.default_rng(seed)
    files = {}
    for cls in classes:
        os.makedirs(root / cls, exist_ok=True)
        for i in range(per_class):
            size = 0 if i == 0 else int(np.exp(rng.uniform(np.log(64), np.log(max_size))))
            data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
            (root / cls / f"{i:04d}.bin").write_bytes(data)
            files[f"{cls}/{i:04d}.bin"] = data
    return dict(sorted(files.items()))


def write_shards(root, files: dict[str, bytes], count: int) -> list[str]:
    """``files`` (in their sorted order) as ``count`` WebDataset-style shards under ``root``: per
    sample ``<class>/<name>.bin`` and ``<class>/<name>.cls`` (the class's index); the shard paths."""
    classes = sorted({k.split("/", 1)[0] for k in files})
    keys = list(files)
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for n, part in enumerate(np.array_split(np.arange(len(keys)), count)):
        path = root / f"train-{n:03d}.tar"
        with tarfile.open(path, "w") as tar:
            for i in part.tolist():
                key = keys[i]
                label = str(classes.index(key.split("/", 1)[0])).encode()
                for name, body in ((key, files[key]), (key.rsplit(".", 1)[0] + ".cls", label)):
                    info = tarfile.TarInfo(name)
                    info.size = len(body)
                    tar.addfile(info, io.BytesIO(body))
        paths.append(str(path))
    return paths


def server_stubs(cluster, info):
    from kspeed.control.rpc import channel_options

    return {
        sid: kspeed_pb2_grpc.ServerStub(grpc.insecure_channel(addr, options=channel_options()))
        for sid, addr in info.server_addresses.items()
    }


def broadcast_lookup(stubs, name, ids, chunk=97):
    """Send the epoch's IDs in chunks to every server; return {server: (positions, lengths, labels)}."""
    out = {}
    for sid, stub in stubs.items():
        positions, lengths, labels = [], [], []
        for start in range(0, len(ids), chunk):
            request = kspeed_pb2.LookupRequest(dataset=name, ids=ids[start : start + chunk].astype("<i8").tobytes())
            reply = stub.Lookup(request, timeout=30)
            positions.append(np.frombuffer(reply.positions, "<u4").astype(np.int64) + start)
            lengths.append(np.frombuffer(reply.lengths, "<u4"))
            labels.append(np.frombuffer(reply.labels, "<i8"))
        out[sid] = (np.concatenate(positions), np.concatenate(lengths), np.concatenate(labels))
    return out


@pytest.fixture
def data_cluster(cluster_factory, tmp_path):
    return cluster_factory(
        2, server_args=["--backend-allow", str(tmp_path), "--memory", "16MiB", "--region-size", "1MiB"]
    )


def log_of(daemon) -> str:
    with open(daemon.log_file, encoding="utf-8", errors="replace") as fh:
        return fh.read()


def test_a_share_a_server_dropped_is_noticed_and_taken_again(data_cluster, tmp_path):
    files = make_tree(tmp_path / "imgs", max_size=32 * 1024)
    keys = list(files)
    spec = kspeed_pb2.DatasetSpec(name="imgs", uri=str(tmp_path / "imgs"), labels="dirname")
    with client_for(data_cluster) as client:
        wait_for(lambda: len([r for r in client.servers() if r.state == 2]) == 2, 10, "ready")
        info = client.create_dataset(spec, operator=True).dataset
        assert follow_preload(client, "imgs", out=None).state == DS.DATASET_STATE_READY
        share = info.shares[0]
        stub = server_stubs(data_cluster, info)[share.server_id]
        stub.DropDataset(kspeed_pb2.DatasetRequest(name="imgs"), timeout=5)  # behind the manager's back
        # The next heartbeat lacks the share: the manager assigns it again (the dataset is not ready
        # meanwhile, but the reload and its report may take only milliseconds)...
        noticed = f"server {share.server_id} no longer reports its share {share.first_id}..; assigning it again"
        wait_for(lambda: noticed in log_of(data_cluster.manager), 5, "the missing share noticed")
        # ...and the server takes it again and reloads it.
        wait_for(lambda: client.dataset("imgs").state == DS.DATASET_STATE_READY, 20, "the share taken again")
        assert "took share" in log_of(next(s for s in data_cluster.servers if s.ready["id"] == share.server_id))
        ids = np.arange(share.first_id, share.end_id, dtype=np.int64)
        reply = stub.Read(kspeed_pb2.ReadRequest(dataset="imgs", ids=ids.tobytes()), timeout=5)
        data, offsets = reply.data, [0, *np.cumsum([len(files[keys[i]]) for i in ids]).tolist()]
        assert [data[offsets[k] : offsets[k + 1]] for k in range(len(ids))] == [files[keys[i]] for i in ids]


def test_register_preload_lookup_read(data_cluster, tmp_path):
    files = make_tree(tmp_path / "imgs", max_size=160 * 1024)
    keys = list(files)
    with client_for(data_cluster) as client:
        wait_for(lambda: len([r for r in client.servers() if r.state == 2]) == 2, 10, "ready")
        spec = kspeed_pb2.DatasetSpec(name="imgs", uri=str(tmp_path / "imgs"), labels="dirname")
        reply = client.create_dataset(spec, operator=True)
        assert reply.created and reply.dataset.fingerprint.count == len(files)
        assert list(reply.dataset.class_names) == ["ant", "bee", "cat"]
        assert len(reply.dataset.shares) == 2
        assert reply.dataset.shares[0].first_id == 0
        assert reply.dataset.shares[0].end_id == reply.dataset.shares[1].first_id
        assert reply.dataset.shares[1].end_id == len(files)

        shown = io.StringIO()
        info = follow_preload(client, "imgs", out=shown)
        assert info.state == DS.DATASET_STATE_READY
        assert f"{len(files)}/{len(files)} samples" in shown.getvalue()
        again = client.create_dataset(spec, operator=True)  # attach: cheap, loads nothing
        assert not again.created

        ids = np.random.default_rng(1).permutation(len(files))
        replies = broadcast_lookup(server_stubs(data_cluster, info), "imgs", ids)
        positions = np.concatenate([r[0] for r in replies.values()])
        assert sorted(positions.tolist()) == list(range(len(ids)))  # every ID exactly once across servers
        for pos, lengths, labels in replies.values():
            assert lengths.tolist() == [len(files[keys[i]]) for i in ids[pos]]
            assert labels.tolist() == [["ant", "bee", "cat"].index(keys[i].split("/")[0]) for i in ids[pos]]

        for share in info.shares:
            stub = server_stubs(data_cluster, info)[share.server_id]
            owned = np.arange(share.first_id, share.end_id, dtype="<i8")
            got = stub.Read(kspeed_pb2.ReadRequest(dataset="imgs", ids=owned.tobytes()), timeout=30)
            offsets = np.concatenate(([0], np.cumsum(np.frombuffer(got.lengths, "<u4"), dtype=np.int64)))
            for j, sid in enumerate(owned):
                assert got.data[offsets[j] : offsets[j + 1]] == files[keys[sid]]

        metrics = subprocess.run(
            [
                sys.executable,
                "-c",
                "import urllib.request,sys; sys.stdout.write(urllib.request."
                f"urlopen('http://{data_cluster.servers[0].ready['http']}/metrics').read().decode())",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        assert 'kspeed_server_preload_samples{dataset="imgs",kind="loaded"}' in metrics
        assert 'kspeed_server_regions{state="sealed"}' in metrics
        status = client.status()
        assert [d.spec.name for d in status.datasets] == ["imgs"]

        client.remove_dataset("imgs")
        with pytest.raises(NotFoundError, match="imgs"):
            client.dataset("imgs")


def test_registration_lists_the_backend_once_and_the_holders_fetch_that_listing(data_cluster, tmp_path):
    files = make_tree(tmp_path / "imgs", max_size=160 * 1024)
    keys = list(files)
    with client_for(data_cluster) as client:
        wait_for(lambda: len([r for r in client.servers() if r.state == 2]) == 2, 10, "ready")
        spec = kspeed_pb2.DatasetSpec(name="imgs", uri=str(tmp_path / "imgs"), labels="dirname")
        info = client.create_dataset(spec, operator=True).dataset
        holders = {s.server_id for s in info.shares}
        assert len(holders) == 2  # the tree does not fit one server: both hold a share
        logs = {s.ready["id"]: log_of(s) for s in data_cluster.servers}
        listed = [sid for sid, text in logs.items() if f"dataset imgs: listed {tmp_path / 'imgs'}" in text]
        fetched = [sid for sid, text in logs.items() if "dataset imgs: fetched the listing from" in text]
        assert len(listed) == 1 and fetched == sorted(holders - set(listed))
        # what the fetched listing serves is the files' bytes, in the lister's order
        assert follow_preload(client, "imgs", out=None).state == DS.DATASET_STATE_READY
        for sid, stub in server_stubs(data_cluster, info).items():
            share = next(s for s in info.shares if s.server_id == sid)
            ids = np.arange(share.first_id, min(share.end_id, share.first_id + 20), dtype=np.int64)
            reply = stub.Read(kspeed_pb2.ReadRequest(dataset="imgs", ids=ids.tobytes()), timeout=5)
            offsets = [0, *np.cumsum([len(files[keys[i]]) for i in ids]).tolist()]
            assert [reply.data[offsets[k] : offsets[k + 1]] for k in range(len(ids))] == [files[keys[i]] for i in ids]


def test_bad_input_is_named_and_changes_nothing(data_cluster, tmp_path):
    files = make_tree(tmp_path / "ok", per_class=5)
    with client_for(data_cluster) as client:
        wait_for(lambda: len([r for r in client.servers() if r.state == 2]) == 2, 10, "ready")
        spec = kspeed_pb2.DatasetSpec
        with pytest.raises(DatasetError, match="missing"):
            client.create_dataset(spec(name="gone", uri=str(tmp_path / "missing")), operator=True)
        with pytest.raises(AccessDeniedError, match="--backend-allow"):
            client.create_dataset(spec(name="etc", uri="/etc"), operator=True)
        with pytest.raises(AccessDeniedError):
            client.create_dataset(spec(name="escape", uri=str(tmp_path / "ok" / ".." / ".." / "etc")), operator=True)
        for bad_name in ("../x", "a b", "", "x" * 200, "naïve"):
            with pytest.raises(ProtocolError, match="dataset name"):
                client.create_dataset(spec(name=bad_name, uri=str(tmp_path / "ok")), operator=True)
        assert client.datasets() == []
        assert all(held_by_datasets(r) == 0 for r in client.servers())

        info = client.create_dataset(spec(name="ok", uri=str(tmp_path / "ok")), operator=True).dataset
        with pytest.raises(ConflictError, match="already registered"):
            client.create_dataset(spec(name="ok", uri=str(tmp_path / "other")), operator=True)
        stub = next(iter(server_stubs(data_cluster, info).values()))
        with pytest.raises(grpc.RpcError) as exc:
            stub.Read(kspeed_pb2.ReadRequest(dataset="ok", ids=np.array([len(files)], "<i8").tobytes()), timeout=5)
        assert exc.value.code() == grpc.StatusCode.NOT_FOUND and f"sample {len(files)}" in exc.value.details()
        with pytest.raises(grpc.RpcError) as exc:
            stub.Lookup(kspeed_pb2.LookupRequest(dataset="ok", ids=np.array([-1], "<i8").tobytes()), timeout=5)
        assert exc.value.code() == grpc.StatusCode.NOT_FOUND and "'ok'" in exc.value.details()
        # A name that could not be a dataset's is refused as such before it reaches a log line.
        for call, request in (
            (stub.DropDataset, kspeed_pb2.DatasetRequest(name="ok\nFORGED log line")),
            (stub.StartPreload, kspeed_pb2.DatasetRequest(name="x\x1b[2J")),
        ):
            with pytest.raises(grpc.RpcError) as exc:
                call(request, timeout=5)
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "dataset name" in exc.value.details()
        assert client.dataset("ok").spec.name == "ok"  # nothing was dropped

        job = client.create_dataset(spec(name="jobds", uri=str(tmp_path / "ok")), holder="test")
        with pytest.raises(StateError, match=r"'jobds' is in use: 1 job lease\(s\) hold it \(test\).*--force"):
            client.remove_dataset("jobds")  # a job holds it: refused, and nothing changed
        assert client.dataset("jobds").leases == 1
        client.remove_dataset("jobds", force=True)
        with pytest.raises(NotFoundError, match=r"jobds.*removed"):
            client.renew_lease(job.lease.id)


def test_unreadable_and_changed_files_fail_alone(data_cluster, tmp_path):
    files = make_tree(tmp_path / "mixed", per_class=10)
    keys = list(files)
    with client_for(data_cluster) as client:
        wait_for(lambda: len([r for r in client.servers() if r.state == 2]) == 2, 10, "ready")
        client.create_dataset(kspeed_pb2.DatasetSpec(name="mixed", uri=str(tmp_path / "mixed")), operator=True)
        (tmp_path / "mixed" / keys[5]).unlink()  # disappears after listing
        (tmp_path / "mixed" / keys[20]).write_bytes(b"x" * (len(files[keys[20]]) + 7))  # grows after listing
        with pytest.raises(DatasetError) as exc:
            follow_preload(client, "mixed", out=None, timeout=60)
        assert "2 sample(s) failed" in str(exc.value)
        assert "sample 5" in str(exc.value) and "sample 20" in str(exc.value)
        info = client.dataset("mixed")
        assert info.state == DS.DATASET_STATE_CHANGED  # files changed after the listing: never served stale
        assert any("sample 5" in c and "deleted" in c for c in info.changes)
        assert any("sample 20" in c and "size" in c for c in info.changes)
        assert info.progress.samples_loaded == len(files) - 2
        share = next(s for s in info.shares if s.first_id <= 3 < s.end_id)
        stub = server_stubs(data_cluster, info)[share.server_id]
        got = stub.Read(kspeed_pb2.ReadRequest(dataset="mixed", ids=np.array([3], "<i8").tobytes()), timeout=5)
        assert got.data == files[keys[3]]  # the rest of the dataset stays usable


def test_killed_job_frees_lease_then_memory(data_cluster, tmp_path):
    make_tree(tmp_path / "jobdata", per_class=10)
    script = (
        "import time\nfrom kspeed.config import ClientConfig, load_config\n"
        "from kspeed.control.manager_client import ManagerClient\n"
        "from kspeed.proto import kspeed_pb2\n"
        f"c = ManagerClient(load_config(ClientConfig, environ={{}}, overrides={{'manager': '{data_cluster.address}', "
        "'security.auth': 'none'}))\n"
        f"r = c.create_dataset(kspeed_pb2.DatasetSpec(name='jobds', uri='{tmp_path / 'jobdata'}'), holder='job', "
        "lease_ttl=1.5)\nprint('attached', flush=True)\n"
        "while True:\n    c.renew_lease(r.lease.id)\n    time.sleep(0.3)\n"
    )
    job = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert job.stdout.readline().strip() == "attached"
        with client_for(data_cluster) as client:
            time.sleep(2.5)  # longer than the TTL: the renewing job keeps the dataset alive
            assert client.dataset("jobds").leases == 1
            wait_for(
                lambda: any(held_by_datasets(r) > 0 for r in client.servers()),
                5,
                "memory in use",
            )
            job.send_signal(signal.SIGKILL)
            job.wait(10)
            wait_for(lambda: client.datasets() == [], 10, "the lease to expire and the dataset to go")
            wait_for(
                lambda: all(held_by_datasets(r) == 0 for r in client.servers()),
                10,
                "memory to be freed on the servers",
            )
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()


def test_server_restart_mid_preload_keeps_sealed_regions(cluster_factory, tmp_path):
    files = make_tree(tmp_path / "slow", classes=("a",), per_class=600, max_size=24 * 1024)
    keys = list(files)
    cluster = cluster_factory(
        1,
        server_args=[
            "--backend-allow",
            f"slowfile://{tmp_path}",
            "--memory",
            "16MiB",
            "--region-size",
            "256KiB",
            "--preload-threads",
            "2",
        ],
    )
    with client_for(cluster) as client:
        wait_for(lambda: [r.state for r in client.servers()] == [2], 10, "ready")
        client.create_dataset(kspeed_pb2.DatasetSpec(name="slow", uri=f"slowfile://{tmp_path / 'slow'}"), operator=True)
        client.preload("slow")
        wait_for(lambda: client.dataset("slow").share_status[0].regions_sealed >= 3, 30, "some regions sealed")
        server = cluster.servers[0]
        server.signal(signal.SIGKILL)
        server.process.wait(10)
        cluster.start_server(server)
        # The share status the manager holds is the killed server's until the restarted one (at a
        # new port) has registered and reported.
        wait_for(
            lambda: [r.address for r in client.servers() if r.state == 2] == [server.ready["grpc"]],
            20,
            "the manager to list the restarted server",
        )

        def restarted_status():  # the killed server's last report was mid-preload (running)
            status = client.dataset("slow").share_status[0]
            return status if status.regions_sealed and not status.progress.running else None

        status = wait_for(restarted_status, 20, "the restarted server to report its share")
        adopted = status.progress.samples_loaded
        assert 0 < adopted < len(files)
        info = follow_preload(client, "slow", out=None, timeout=120)
        assert info.state == DS.DATASET_STATE_READY
        assert info.share_status[0].progress.samples_read == len(files) - adopted  # nothing sealed was read again
        stub = server_stubs(cluster, info)[info.shares[0].server_id]
        got = stub.Read(
            kspeed_pb2.ReadRequest(dataset="slow", ids=np.arange(len(files), dtype="<i8").tobytes()), timeout=30
        )
        assert got.data == b"".join(files[k] for k in keys)


def test_corrupt_pool_byte_is_repaired_and_counted(data_cluster, tmp_path):
    # over a quarter of a region, so that it holds regions of its own (a smaller one takes a slice)
    files = make_tree(tmp_path / "crc", classes=("a",), per_class=80)
    keys = list(files)
    with client_for(data_cluster) as client:
        wait_for(lambda: len([r for r in client.servers() if r.state == 2]) == 2, 10, "ready")
        client.create_dataset(kspeed_pb2.DatasetSpec(name="crc", uri=str(tmp_path / "crc")), operator=True)
        info = follow_preload(client, "crc", out=None, timeout=60)
    share = info.shares[0]
    server = next(s for s in data_cluster.servers if s.ready["id"] == share.server_id)
    pool = os.path.join(data_cluster.state_dir, server.name, "pool")
    with open(os.path.join(pool, "pool.json"), encoding="utf-8") as fh:  # which region file holds the share
        regions = json.load(fh)["regions"]
    index = next(i for i, r in enumerate(regions) if r["dataset"] == "crc" and r["vindex"] == share.first_region)
    victim = 1  # sample 1 is the first non-empty one (sample 0 has length 0) and sits at offset 0 of the share
    path = os.path.join(pool, f"region-{index:05d}.bin")
    with open(path, "r+b") as fh:  # flip the sample's first byte behind the server's back
        first = fh.read(1)
        fh.seek(0)
        fh.write(bytes([first[0] ^ 0xFF]))
    stub = server_stubs(data_cluster, info)[share.server_id]
    got = stub.Read(kspeed_pb2.ReadRequest(dataset="crc", ids=np.array([victim], "<i8").tobytes()), timeout=10)
    assert got.data == files[keys[victim]]
    from tests.helpers import http_get

    metrics = http_get(server.ready["http"], "/metrics")[1]
    assert 'kspeed_server_integrity_events_total{dataset="crc",event="crc_mismatches"} 1.0' in metrics
    assert 'kspeed_server_integrity_events_total{dataset="crc",event="repaired"} 1.0' in metrics


def test_policy_cache_refuses_what_does_not_fit_without_leaving_anything(data_cluster, tmp_path):
    make_tree(tmp_path / "big", per_class=30, max_size=128 * 1024)
    with client_for(data_cluster) as client:
        wait_for(lambda: len([r for r in client.servers() if r.state == 2]) == 2, 10, "ready")
        from kspeed.errors import CapacityError

        big = kspeed_pb2.DatasetSpec(name="big", uri=str(tmp_path / "big"), quota_bytes=1 << 20, policy="cache")
        with pytest.raises(CapacityError, match="quota"):
            client.create_dataset(big, operator=True)
        assert client.datasets() == []
        make_tree(tmp_path / "huge", classes=("a",), per_class=700, max_size=1 << 20, seed=3)  # ~75 MB
        huge = kspeed_pb2.DatasetSpec(name="huge", uri=str(tmp_path / "huge"), policy="cache")
        with pytest.raises(CapacityError, match="needs"):  # more than both pools together (2 x 16 MiB)
            client.create_dataset(huge, operator=True)
        assert client.datasets() == []
        # By default ("auto") a dataset that does not fit streams, in at most its quota.
        big.policy, huge.policy = "auto", "auto"
        info = client.create_dataset(big, operator=True).dataset
        assert {s.policy for s in info.shares} == {"stream"} and sum(s.memory_regions for s in info.shares) == 1
        info = client.create_dataset(huge, operator=True).dataset
        assert {s.policy for s in info.shares} == {"stream"}
        assert sum(s.memory_regions for s in info.shares) < sum(s.num_regions for s in info.shares)


def test_manager_restart_keeps_datasets_and_servers_keep_data(data_cluster, tmp_path):
    files = make_tree(tmp_path / "keep", per_class=10)
    keys = list(files)
    with client_for(data_cluster) as client:
        wait_for(lambda: len([r for r in client.servers() if r.state == 2]) == 2, 10, "ready")
        client.create_dataset(kspeed_pb2.DatasetSpec(name="keep", uri=str(tmp_path / "keep")), operator=True)
        before = follow_preload(client, "keep", out=None, timeout=60)
    assert data_cluster.manager.stop() == 0
    data_cluster.start_manager()
    with client_for(data_cluster) as client:
        assert [d.spec.name for d in client.datasets()] == ["keep"]
        info = wait_for(
            lambda: (lambda d: d if d.state == DS.DATASET_STATE_READY else None)(client.dataset("keep")),
            15,
            "the servers to report their shares again",
        )
        assert [s.server_id for s in info.shares] == [s.server_id for s in before.shares]
        # The servers were not told anything new: same shares, no second load job.
        assert [st.progress.samples_read for st in info.share_status] == [
            st.progress.samples_read for st in before.share_status
        ]
        stub = server_stubs(data_cluster, info)[info.shares[0].server_id]
        got = stub.Read(kspeed_pb2.ReadRequest(dataset="keep", ids=np.array([1], "<i8").tobytes()), timeout=10)
        assert got.data == files[keys[1]]


def test_dataset_removed_while_a_server_was_unreachable_is_dropped_when_it_returns(cluster_factory, tmp_path):
    make_tree(tmp_path / "gone", per_class=30, max_size=128 * 1024)
    cluster = cluster_factory(
        2,
        manager_args=["--server-call-timeout", "1s", "--fail-after", "30s", "--suspect-after", "20s"],
        server_args=["--backend-allow", str(tmp_path), "--memory", "16MiB", "--region-size", "1MiB"],
    )
    with client_for(cluster) as client:
        wait_for(lambda: len([r for r in client.servers() if r.state == 2]) == 2, 10, "ready")
        info = client.create_dataset(
            kspeed_pb2.DatasetSpec(name="gone", uri=str(tmp_path / "gone")), operator=True
        ).dataset
        assert len(info.shares) == 2
        frozen = next(s for s in cluster.servers if s.ready["id"] == info.shares[1].server_id)
        frozen.signal(signal.SIGSTOP)
        try:
            client.remove_dataset("gone")  # the frozen server cannot be told
        finally:
            frozen.signal(signal.SIGCONT)
        assert client.datasets() == []
        wait_for(
            lambda: all(held_by_datasets(r) == 0 for r in client.servers()),
            15,
            "the returning server to drop the removed dataset",
        )
