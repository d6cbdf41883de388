"""Helpers shared by the tests (fixtures live in conftest.py)."""

from __future__ import annotations

import os
import ssl
import urllib.error
import urllib.request

from kspeed.cli.cluster import LocalCluster
from kspeed.config import ClientConfig, load_config
from kspeed.control.manager_client import ManagerClient


def client_for(cluster: LocalCluster) -> ManagerClient:
    """A control-plane client with the cluster's credentials."""
    overrides = {"manager": cluster.address, "security.auth": "none"}
    if cluster.token_file:
        overrides.update({"security.auth": "token", "security.token_file": cluster.token_file})
    return ManagerClient(load_config(ClientConfig, environ={}, overrides=overrides))


def http_get(address: str, path: str, token: str = "", ca: str | None = None) -> tuple[int, str]:
    """GET ``http://address/path`` (with a bearer ``token`` if given) and return (status, body);
    ``https://`` verified against the CA bundle ``ca`` when it is given (a daemon with TLS)."""
    request = urllib.request.Request(f"{'https' if ca else 'http'}://{address}{path}")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    context = ssl.create_default_context(cafile=ca) if ca else None
    try:
        with urllib.request.urlopen(request, timeout=5, context=context) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def pid_alive(pid: int) -> bool:
    """True if a process with ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            return fh.read().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:
        return os.path.exists(f"/proc/{pid}")
