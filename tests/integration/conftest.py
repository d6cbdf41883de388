"""Fixtures of the integration tests beyond the daemons': a local S3 endpoint."""

from __future__ import annotations

import socket
import urllib.request

import pytest

S3_KEY, S3_SECRET = "kspeed-test-key", "kspeed-test-secret"  # what the endpoint's buckets take


@pytest.fixture
def s3_endpoint():
    """A local S3 endpoint (moto's server mode, what s3fs's own tests use) on a free loopback port:
    ``(url, s3fs file system)``; skipped without s3fs and moto. A test names it before
    ``cluster_factory``, so that its servers stop before the endpoint does (fixtures end in the
    reverse order): a server whose backend vanished mid-read waits for that read as it stops."""
    s3fs = pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    url = f"http://127.0.0.1:{port}"
    # moto keeps its buckets per process, not per server: start from none
    urllib.request.urlopen(urllib.request.Request(f"{url}/moto-api/reset", method="POST"), timeout=10).close()
    fs = s3fs.S3FileSystem(key=S3_KEY, secret=S3_SECRET, client_kwargs={"endpoint_url": url}, skip_instance_cache=True)
    try:
        yield url, fs
    finally:
        server.stop()
