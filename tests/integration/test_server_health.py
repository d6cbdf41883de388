"""A server stays a healthy member while it does slow work for a dataset: a backend whose listing
takes longer than the manager's ``fail_after`` (2 s under the tests' timers), a pipeline whose
module keeps an interpreter to itself while it imports (as torch's initialisation does)."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from kspeed.cli.cluster import wait_for
from kspeed.control.manager_client import ManagerClient
from kspeed.manager.membership import state_name
from kspeed.preprocess import Output, Pipeline, Stage
from kspeed.proto import kspeed_pb2
from tests.helpers import client_for, http_get
from tests.integration.test_datasets import make_tree
from tests.integration.test_production import metric

REPO = Path(__file__).resolve().parents[2]
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


def heartbeats(server) -> float | None:
    """The heartbeats the server has sent (``None`` while it does not answer)."""
    try:
        text = http_get(server.ready["http"], "/metrics")[1]
    except OSError:
        return None
    return metric(text, "kspeed_server_heartbeats_total", '{result="ok"}')


@pytest.mark.timeout(120)
def test_a_server_importing_a_pipelines_modules_answers_and_stays_a_member(cluster_factory, tmp_path):
    make_tree(tmp_path / "imgs", per_class=4)
    probe = tmp_path / "probe"
    probe.mkdir()
    os.chmod(probe, 0o777)  # the sandboxed workers write there (as nobody when the tests run as root)
    (probe / "spin").touch()  # the module keeps its interpreter to itself until the test lets it go
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    cluster = cluster_factory(
        1,
        server_args=[
            "--backend-allow",
            str(tmp_path),
            "--preprocess-allow",
            "tests.preprocess",
            "--preprocess-workers",
            "1",
            "--preprocess-env",
            "PREP_PROBE_DIR",
            "--preprocess-write-paths",
            str(probe),
        ],
        env={"PREP_PROBE_DIR": str(probe), "PYTHONPATH": path},
    )
    server = cluster.servers[0]
    pipeline = Pipeline([Stage("tests.preprocess.import_probe:same", output=Output(shape=(16,), dtype="uint8"))])
    spec = kspeed_pb2.DatasetSpec(name="imgs", uri=str(tmp_path / "imgs"), pipeline=pipeline.to_proto())
    with client_for(cluster) as client:
        watch = StateWatch(client, server.ready["id"])
        created: list = []
        creating = threading.Thread(target=lambda: created.append(client.create_dataset(spec, operator=True)))
        creating.start()
        wait_for(lambda: list(probe.glob("imported.*")), 60, "the pipeline's module being imported")
        sent = wait_for(lambda: heartbeats(server), 30, "the server's heartbeat count")
        # The import goes on (until the file is gone) while the server heartbeats several times, and
        # answers this HTTP call.
        wait_for(lambda: (heartbeats(server) or 0) >= sent + 5 or watch.seen - {"ready"}, 60, "heartbeats")
        (probe / "spin").unlink()
        creating.join(90)
        seen = watch.stop()
        assert seen == {"ready"}, f"the server went through {sorted(seen)} while the module was imported"
        assert [s.server_id for s in created[0].dataset.shares] == [server.ready["id"]]
        imported = {int(p.name.split(".")[1]) for p in probe.glob("imported.*")}
        assert server.process.pid not in imported  # the workers imported it, never the server's process
