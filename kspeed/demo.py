"""``kspeed demo``: a short tour of a local cluster (``make demo``).

It brings up one manager and two servers on loopback, shows the cluster as ``kspeed status``
does, stops one server to show the lifecycle, and shuts everything down, leaving nothing behind.
"""

from __future__ import annotations

import shutil
import tempfile

from kspeed._local import LocalCluster, wait_for
from kspeed.config import ClientConfig, load_config
from kspeed.control import ManagerClient
from kspeed.proto import kspeed_pb2
from kspeed.status import status_table

READY = kspeed_pb2.ServerState.SERVER_STATE_READY
LEFT = kspeed_pb2.ServerState.SERVER_STATE_LEFT


def run(servers: int = 2) -> int:
    """Run the tour; returns the exit status."""
    state_dir = tempfile.mkdtemp(prefix="kspeed-demo-")
    cluster = LocalCluster(state_dir, servers=servers, server_args=["--memory", "256MiB"])
    try:
        print(f"starting a local cluster: 1 manager, {servers} servers (state in {state_dir})", flush=True)
        cluster.start()
        config = load_config(ClientConfig, environ={}, overrides={"manager": cluster.address, "security.auth": "none"})
        with ManagerClient(config, peer_name="kspeed-demo") as client:
            hello = client.handshake()
            print(f"manager {cluster.address} speaks protocol v{hello.protocol_version}; "
                  f"status also at http://{cluster.http_address}/v1/status", flush=True)
            wait_for(lambda: sum(r.state == READY for r in client.servers()) == servers, 30, "servers ready")
            print(status_table(client.status()), flush=True)
            leaving = cluster.servers[-1]
            print(f"\nstopping {leaving.ready['id']} (SIGTERM: it drains and deregisters)", flush=True)
            leaving.stop()
            wait_for(lambda: any(r.state == LEFT for r in client.servers(include_left=True)), 10, "server left")
            print(status_table(client.status()), flush=True)
        return 0
    finally:
        cluster.stop()
        shutil.rmtree(state_dir, ignore_errors=True)
        print("\ncluster stopped; nothing left running", flush=True)
