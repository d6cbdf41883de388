"""A server stays a healthy member while it does slow work for a dataset: here, a backend whose
listing takes longer than the manager's ``fail_after`` (2 s under the tests' timers)."""

from __future__ import annotations

import json
import threading

import pytest

from kspeed.cli.cluster import wait_for
from kspeed.control.manager_client import ManagerClient
from kspeed.manager.membership import state_name
from kspeed.proto import kspeed_pb2
from tests.helpers import client_for, http_get
from tests.integration.test_datasets import make_tree
from tests.integration.test_production import metric

LIST_LATENCY = 0.8  # seconds per listing request: a listing of the tree makes about five (4 s)


class StateWatch:
    """Records every state the manager gives one server, polled until :meth:`stop`."""

    def __init__(self, client: ManagerClient, server_id: str) -> None:
        self._client = client
        self._id = server_id
        self.seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            for record in self._client.servers(include_left=True):
                if record.id == self._id:
                    self.seen.add(state_name(record.state))

    def stop(self) -> set[str]:
        self._stop.set()
        self._thread.join(10)
        return self.seen


@pytest.mark.timeout(120)
def test_a_listing_slower_than_fail_after_leaves_its_server_a_member(cluster_factory, tmp_path):
    make_tree(tmp_path / "imgs", per_class=4)
    options = json.dumps({"slowfile": {"list_latency": LIST_LATENCY}})
    cluster = cluster_factory(
        1, server_args=["--backend-allow", f"slowfile://{tmp_path}", "--backend-options", options]
    )
    server = cluster.servers[0]
    spec = kspeed_pb2.DatasetSpec(name="imgs", uri=f"slowfile://{tmp_path / 'imgs'}", labels="dirname")
    with client_for(cluster) as client:
        watch = StateWatch(client, server.ready["id"])
        # The manager has the server list the backend to describe the dataset, then assigns it the
        # share, which it lists again: each listing alone outlasts fail_after.
        created: list = []
        creating = threading.Thread(target=lambda: created.append(client.create_dataset(spec, operator=True)))
        creating.start()
        wait_for(lambda: created or "failed" in watch.seen or None, 90, "the dataset registered")
        seen = watch.stop()
        assert seen == {"ready"}, f"the server went through {sorted(seen)} while listing"
        creating.join(90)
        assert [s.server_id for s in created[0].dataset.shares] == [server.ready["id"]]
        registrations = metric(http_get(server.ready["http"], "/metrics")[1], "kspeed_server_registrations_total")
        assert registrations == 1  # never failed, so never registered again
