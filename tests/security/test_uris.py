"""No dataset URI outside a server's allow-list ever makes it connect anywhere, whatever its scheme.

A loopback :class:`~tests.security.web.Trap` stands for the link-local metadata address
(``169.254.169.254``) and records every connection; a loopback :class:`~tests.security.web.Web`
stands for an allowed backend host that turns hostile: it redirects to the trap or out of the
allowed prefix, links out of it from a directory page, and serves a list and a manifest that name
what lies outside. Every way in is tried: the backend as a server builds it (listing and reading
every sample), then the same URIs registered through real daemons.
"""

from __future__ import annotations

import numpy as np
import pytest

from kspeed import DatasetSpec, KSpeedClient
from kspeed.errors import AccessDeniedError, BackendError, KSpeedError
from kspeed.server.backend.access import Backend
from kspeed.server.backend.allowlist import AllowList
from kspeed.server.backend.sources import open_source
from tests.integration.test_client import config_for
from tests.security.web import Trap, Web

pytestmark = [pytest.mark.security, pytest.mark.timeout(120)]

ROWS = np.arange(32 * 16, dtype=np.uint8).reshape(32, 16)


@pytest.fixture
def trap():
    t = Trap()
    yield t
    t.close()


@pytest.fixture
def web(tmp_path, trap):
    """The hostile backend host: ``/data`` is allowed, ``/private`` is not (and holds files a
    request would get)."""
    root = tmp_path / "www"
    for where in ("data/dir", "data/files", "private"):
        (root / where).mkdir(parents=True)
    np.save(root / "data" / "ok.npy", ROWS)
    np.save(root / "private" / "secret.npy", ROWS)
    (root / "private" / "secret.bin").write_bytes(b"s" * 10)
    (root / "data" / "dir" / "a.bin").write_bytes(b"a" * 10)
    (root / "data" / "dir" / "index.html").write_text('<a href="a.bin">a</a> <a href="../../private/">up</a>')
    (root / "data" / "files" / "a.bin").write_bytes(b"a" * 10)
    (root / "data" / "files" / "index.html").write_text(
        '<a href="a.bin">a</a> <a href="%2e%2e/%2e%2e/private/secret.bin">s</a>'
    )
    (root / "data" / "sneaky.manifest").write_text("dir/a.bin 10\n%2e%2e/private/secret.bin 10\n")
    (root / "data" / "out.list").write_text(f"{trap.url}/secret.bin\n")
    w = Web(root)
    w.redirects = {
        "/data/away.npy": f"{trap.url}/latest/meta-data/iam/security-credentials/",
        "/data/away.manifest": f"{trap.url}/latest/meta-data/",
        "/data/bounce.npy": f"{w.url}/private/secret.npy",
    }
    yield w
    w.close()


def hostile_uris(web: Web, trap: Trap) -> list[tuple[str, str]]:
    """``(uri, kind)`` pairs, each of which must fail without a connection outside the allow-list."""
    web_port = web.url.rsplit(":", 1)[1]
    return [
        (f"{web.url}/data/away.npy", "auto"),  # the allowed host redirects to the metadata address
        (f"{web.url}/data/away.manifest", "manifest"),
        (f"{web.url}/data/bounce.npy", "auto"),  # ... or out of the allowed prefix
        (f"{web.url}/data/dir/", "dir"),  # a directory page links out of the prefix
        (f"{web.url}/data/files/", "dir"),
        (f"{web.url}/data/sneaky.manifest", "manifest"),  # a manifest key percent-encodes '..'
        (f"{web.url}/data/out.list", "list"),  # a list names the metadata address
        (f"{web.url}/data/%2e%2e/private/secret.npy", "auto"),
        (f"{web.url}/data/%252e%252e/private/secret.npy", "auto"),
        (f"simplecache::{trap.url}/x.npy", "auto"),  # chained URLs
        (f"zip://x.npy::{trap.url}/a.zip", "auto"),
        (f"simplecache::{web.url}/data/ok.npy", "auto"),
        (f"file://127.0.0.1:{trap.port}/x.npy", "auto"),  # a file URL naming a host
        (f"http://127.0.0.1:{web_port}@127.0.0.1:{trap.port}/data/ok.npy", "auto"),  # userinfo that looks allowed
        (f"http://127.0.0.1:{trap.port}\\@127.0.0.1:{web_port}/data/ok.npy", "auto"),
        (f"{trap.url}/data/ok.npy", "auto"),  # simply not allowed, in every spelling and scheme
        (f"HTTP://127.0.0.1:{trap.port}/data/ok.npy", "auto"),
        (f"https://127.0.0.1:{trap.port}/data/ok.npy", "auto"),
        (f"ftp://127.0.0.1:{trap.port}/x.npy", "auto"),
        (f"webhdfs://127.0.0.1:{trap.port}/x.npy", "auto"),
        (f"s3://127.0.0.1:{trap.port}/x.npy", "auto"),
    ]


def attempt(backend: Backend, uri: str, kind: str) -> KSpeedError | None:
    """List ``uri`` and read each of its samples as a server does; the error that stopped it, if any."""
    try:
        source = open_source(backend, "ds", uri, kind=kind)
        for i in range(source.count):
            source.read(i)
    except KSpeedError as exc:
        return exc
    return None


def test_no_uri_outside_the_allow_list_makes_a_server_connect(tmp_path, monkeypatch, web, trap):
    (tmp_path / "local" / f"127.0.0.1:{trap.port}").mkdir(parents=True)
    np.save(tmp_path / "local" / f"127.0.0.1:{trap.port}" / "x.npy", ROWS)
    monkeypatch.chdir(tmp_path / "local")  # where a file URL naming a host would resolve
    rules = [f"{web.url}/data", str(tmp_path / "local"), "simplecache://", "zip://"]
    backend = Backend(AllowList(rules))
    source = open_source(backend, "ds", f"{web.url}/data/ok.npy")  # the allowed part works
    assert source.count == len(ROWS) and source.read(5) == ROWS[5].tobytes()
    for uri, kind in hostile_uris(web, trap):
        error = attempt(backend, uri, kind)
        assert error is not None, uri
        assert trap.connections == [], uri
        assert not [p for p in web.paths() if not p.startswith("/data/")], (uri, web.paths())
    refused = attempt(backend, f"{web.url}/data/away.npy", "auto")
    assert isinstance(refused, AccessDeniedError) and "refused before connecting" in str(refused)


def test_a_cluster_refuses_them_and_still_serves_the_allowed_host(cluster_factory, web, trap):
    cluster = cluster_factory(1, server_args=["--backend-allow", f"{web.url}/data"])
    with KSpeedClient(config=config_for(cluster)) as client:
        for uri, kind in hostile_uris(web, trap):
            if "sneaky" in uri:  # listed (its sizes are trusted), refused when the sample is read
                continue
            with pytest.raises(KSpeedError) as refused:
                client.manager.create_dataset(DatasetSpec(name="no", uri=uri, kind=kind).to_proto(), operator=True)
            assert "Exception calling application" not in str(refused.value), uri
            assert trap.connections == [], uri
        assert client.manager.datasets() == []
        with pytest.raises(KSpeedError) as away:
            client.manager.create_dataset(DatasetSpec("no", f"{web.url}/data/away.npy").to_proto(), operator=True)
        assert "refused before connecting" in str(away.value)
        assert "/latest/meta-data/iam/security-credentials/" in str(away.value)
        sneaky = client.dataset(
            DatasetSpec(name="sneaky", uri=f"{web.url}/data/sneaky.manifest", kind="manifest"), batch_size=2, quiet=True
        )
        with pytest.raises(KSpeedError, match="refused before connecting"):
            list(sneaky)
        sneaky.close()
        ds = client.dataset(DatasetSpec(name="ok", uri=f"{web.url}/data/ok.npy"), batch_size=8, seed=0, quiet=True)
        seen = {}
        for batch in ds:
            for i, sid in enumerate(batch.ids.tolist()):
                seen[sid] = batch.numpy(i).tobytes()
        ds.close()
        assert seen == {i: ROWS[i].tobytes() for i in range(len(ROWS))}
    assert trap.connections == [] and not [p for p in web.paths() if not p.startswith("/data/")]


def test_an_allowed_host_that_drops_the_connection_is_a_backend_error(trap):
    backend = Backend(AllowList([trap.url]))
    with pytest.raises(BackendError, match=rf"cannot list {trap.url}/x.manifest: ServerDisconnectedError"):
        open_source(backend, "ds", f"{trap.url}/x.manifest", kind="manifest")
    assert len(trap.connections) >= 1  # (allowed: it was connected to)
