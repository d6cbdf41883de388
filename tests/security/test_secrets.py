"""A secret planted in dataset URIs, and one in the servers' backend options, are found nowhere.

Credentials belong to the servers' configuration (``backend_options``), never to a dataset's URI
(:mod:`kspeed.uris`). A URI carrying one is refused by the client, by the manager (for a client
that skips the client's check) and by the server (for a token holder that skips the manager); the
refusals name where credentials belong and never echo the secret. Then every output of the cluster
is searched for both secrets: the state directories (the manager's SQLite registry, the servers'
assignments and pools), every daemon's log, ``/v1/status`` and ``/metrics`` of every daemon, the
command line's outputs, and the client's errors and log.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import subprocess
import sys

import grpc
import numpy as np
import pytest

from kspeed import DatasetSpec, KSpeedClient
from kspeed.errors import ConfigError, KSpeedError
from kspeed.proto import kspeed_pb2, kspeed_pb2_grpc
from tests.helpers import http_get
from tests.integration.test_client import config_for
from tests.security.web import Web

pytestmark = [pytest.mark.security, pytest.mark.timeout(180)]

SECRET = "S3CRETPW-planted-7f3a"  # in the dataset URIs
BACKEND_SECRET = "B4CKEND-planted-91c2"  # in the servers' backend_options: used, never shown
ROWS = np.arange(24 * 32, dtype=np.uint8).reshape(24, 32)


def planted(url: str) -> list[str]:
    host = url.split("://", 1)[1]
    return [
        f"http://alice:{SECRET}@{host}/data/ok.npy",
        f"{url}/data/ok.npy?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIA&X-Amz-Signature={SECRET}",
        f"{url}/data/ok.npy?token={SECRET}",
        f"https://{SECRET}@{host}/data/ok.npy",
        f"s3://AKIAEXAMPLE:{SECRET}@bucket/train/",
    ]


def cli(cluster, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "kspeed.cli", *args, "--manager", cluster.address, "--auth", "none"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return f"rc={done.returncode}\n{done.stdout}\n{done.stderr}"


def files_under(root: str) -> dict[str, bytes]:
    out = {}
    for where, _, names in os.walk(root):
        for name in names:
            path = os.path.join(where, name)
            with open(path, "rb") as fh:
                out[path] = fh.read()
    return out


def test_a_secret_in_a_dataset_uri_is_refused_everywhere_and_found_nowhere(cluster_factory, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    (tmp_path / "www" / "data").mkdir(parents=True)
    np.save(tmp_path / "www" / "data" / "ok.npy", ROWS)
    web = Web(tmp_path / "www")
    options = {"http": {"headers": {"Authorization": f"Bearer {BACKEND_SECRET}"}}}
    try:
        cluster = cluster_factory(
            1, server_args=["--backend-allow", f"{web.url}/data", "--backend-options", json.dumps(options)]
        )
        server = cluster.servers[0]
        outputs: dict[str, str] = {}
        with KSpeedClient(config=config_for(cluster)) as client:
            # The servers' credentials in use: a dataset over HTTP (operator-owned: it stays), read whole.
            web_spec = DatasetSpec(name="web", uri=f"{web.url}/data/ok.npy")
            client.manager.create_dataset(web_spec.to_proto(), operator=True)
            ds = client.dataset(web_spec, batch_size=8, quiet=True)
            got = {sid: batch.numpy(i).tobytes() for batch in ds for i, sid in enumerate(batch.ids.tolist())}
            assert got == {i: ROWS[i].tobytes() for i in range(len(ROWS))}
            stub = kspeed_pb2_grpc.ServerStub(grpc.insecure_channel(server.ready["grpc"]))
            for n, uri in enumerate(planted(web.url)):
                with pytest.raises(ConfigError) as by_client:
                    DatasetSpec(name=f"p{n}", uri=uri)
                assert "backend_options" in str(by_client.value)
                outputs[f"client {n}"] = f"{by_client.value} {by_client.value.value!r}"
                spec = kspeed_pb2.DatasetSpec(name=f"p{n}", uri=uri)  # a client that skips the check
                for operator in (True, False):
                    with pytest.raises(KSpeedError) as by_manager:
                        client.manager.create_dataset(spec, operator=operator, holder="job")
                    assert "backend_options" in str(by_manager.value)
                    outputs[f"manager {n} {operator}"] = str(by_manager.value)
                # A token holder that skips the manager: the server refuses as well.
                assign = kspeed_pb2.AssignShareRequest(spec=spec, region_size=1 << 20)
                for call, request in ((stub.DescribeDataset, spec), (stub.AssignShare, assign)):
                    with pytest.raises(grpc.RpcError) as by_server:
                        call(request, timeout=30)
                    assert "backend_options" in by_server.value.details()
                    outputs[f"server {n} {call}"] = by_server.value.details()
                outputs[f"cli add {n}"] = cli(cluster, "dataset", "add", f"p{n}", uri)
                assert outputs[f"cli add {n}"].startswith("rc=1") or outputs[f"cli add {n}"].startswith("rc=2")
            assert [d.spec.name for d in client.manager.datasets()] == ["web"]
            ds.close()
        for path in ("/v1/status", "/metrics"):
            outputs[f"manager {path}"] = http_get(cluster.http_address, path)[1]
        outputs["server /metrics"] = http_get(server.ready["http"], "/metrics")[1]
        for args in (("status",), ("status", "--json"), ("dataset", "list", "--json"), ("dataset", "show", "web")):
            outputs[" ".join(args)] = cli(cluster, *args)
        assert '"web"' in outputs["dataset show web"] and "ok.npy" in outputs["manager /v1/status"]
        outputs["client log"] = caplog.text
        cluster.stop()  # every log line and the registry written out
        files = files_under(cluster.state_dir)
        assert any(p.endswith("manager.log") for p in files) and any(p.endswith("assignments.json") for p in files)

        basic = base64.b64encode(f"alice:{SECRET}".encode()).decode()
        for secret in (SECRET, BACKEND_SECRET, basic):
            assert [name for name, text in outputs.items() if secret in text] == [], secret
            assert [path for path, data in files.items() if secret.encode() in data] == [], secret
        # Nothing planted reached the backend; the servers' own credentials did.
        sent = [f"{path} {headers}" for _, path, headers in web.requests]
        assert not [s for s in sent if SECRET in s or basic in s]
        assert all(f"Bearer {BACKEND_SECRET}" == h.get("Authorization") for _, _, h in web.requests)
    finally:
        web.close()
