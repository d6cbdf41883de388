"""A server checks a dataset's pipeline without importing its modules in its own process: the
preprocessing workers import them (an import holds an interpreter for seconds, and the server's
process answers health probes and heartbeats). Describing a dataset waits for the workers'
verdict; an assignment (a spare taking a failed server's share) does not wait for their imports."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from kspeed.cli.cluster import wait_for
from kspeed.control.logs import LogSettings
from kspeed.errors import AccessDeniedError, ConfigError
from kspeed.preprocess import Output, Pipeline, Stage
from kspeed.proto import kspeed_pb2
from kspeed.server.backend.sources import open_source
from kspeed.server.hosting.datasets import DatasetHost, fingerprint_pb
from kspeed.server.prep.sandbox import SandboxPolicy
from kspeed.server.prep.workers import PrepWorkers
from tests.server.datasets import REGION, write_tree

PROBE = "tests.preprocess.import_probe"


def spec_with(tmp_path, op: str) -> kspeed_pb2.DatasetSpec:
    pipeline = Pipeline([Stage(op, output=Output(shape=(16,), dtype="uint8"))])
    return kspeed_pb2.DatasetSpec(name="ds", uri=str(tmp_path / "ds"), pipeline=pipeline.to_proto())


def assignment(backend, spec: kspeed_pb2.DatasetSpec) -> kspeed_pb2.AssignShareRequest:
    source = open_source(backend, "ds", spec.uri)
    share = kspeed_pb2.Share(server_id="s", first_id=0, end_id=source.count, num_regions=1)
    return kspeed_pb2.AssignShareRequest(spec=spec, fingerprint=fingerprint_pb(source), region_size=REGION, share=share)


@pytest.fixture
def workers(tmp_path):
    probe = tmp_path / "probe"
    probe.mkdir(mode=0o777)
    os.chmod(probe, 0o777)  # (the sandboxed workers run as nobody when the tests run as root)
    policy = SandboxPolicy(write=(str(probe),))
    prep = PrepWorkers(1, ("tests",), LogSettings(), sandbox=policy, environment=("PREP_PROBE_DIR",))
    yield prep
    prep.close()


def test_the_server_process_never_imports_a_pipelines_modules(tmp_path, backend, pool, workers, monkeypatch):
    write_tree(tmp_path / "ds", [16] * 4)
    probe = tmp_path / "probe"
    monkeypatch.setenv("PREP_PROBE_DIR", str(probe))
    monkeypatch.delitem(sys.modules, PROBE, raising=False)  # imported afresh, wherever it is
    (probe / "hold").touch()  # importing the module takes until the test lets it go
    host = DatasetHost(pool, backend, str(tmp_path), preprocess_allow=("tests",), prep=workers)
    spec = spec_with(tmp_path, f"{PROBE}:same")

    # An assignment does not wait for the workers' import.
    assigned: list = []
    assigning = threading.Thread(target=lambda: assigned.append(host.assign(assignment(backend, spec))), daemon=True)
    assigning.start()
    assigning.join(30)
    assert assigned and assigned[0].first_id == 0, "the assignment waited for the pipeline's import"
    (importer,) = wait_for(lambda: list(probe.glob("imported.*")), 60, "a worker importing the module")
    assert int(importer.name.split(".")[1]) in workers.all_pids()

    # Describing waits for the workers' verdict, here until the import is let go.
    described: list = []
    describing = threading.Thread(target=lambda: described.append(host.describe(spec)), daemon=True)
    describing.start()
    describing.join(0.5)
    assert describing.is_alive() and not described  # the worker is still importing
    (probe / "hold").unlink()
    describing.join(60)
    assert described and described[0].fingerprint.count == 4
    assert not (probe / f"imported.{os.getpid()}").exists() and PROBE not in sys.modules


def test_what_the_workers_cannot_resolve_is_refused_as_they_say(tmp_path, backend, pool, workers):
    write_tree(tmp_path / "ds", [16] * 4)
    host = DatasetHost(pool, backend, str(tmp_path), preprocess_allow=("tests",), prep=workers)
    with pytest.raises(ConfigError, match=r"stage 0 \(tests.no_such_module:f\): cannot import it"):
        host.describe(spec_with(tmp_path, "tests.no_such_module:f"))
    with pytest.raises(AccessDeniedError, match="module 'elsewhere' is not on this server's preprocess allow-list"):
        host.assign(assignment(backend, spec_with(tmp_path, "elsewhere:f")))  # known without importing
    assert host.keys() == [] and pool.regions("ds") == []
