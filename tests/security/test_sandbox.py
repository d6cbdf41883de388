"""An allowed preprocessing function reaches nothing of the server that runs it.

Against a real cluster with token auth, a pipeline stage from :mod:`tests.security.sandbox_functions`
tries to read the token (environment, file, the server's ``/proc`` entries), list the state and
pool directories, read, write and map another dataset's region file, signal the server, connect to
the manager, run a shell and read ``/etc/shadow``; every try is refused, the victim's region is
untouched and its samples are served exact. The directories are made world-readable and the token
file 0644, so that the sandbox, not file modes, is what refuses.

Then each mechanism alone, in a process of its own (no daemon): Landlock keeps a process from a
world-readable file and from TCP, the seccomp filter refuses sockets and programs, the identity
switch drops root and shows the process only what it must import; a worker whose confinement is
incomplete refuses pipelines when the sandbox is required; a worker that writes on its socket what
a worker never sends is replaced, and the server unpickles nothing of it. A mechanism this platform
lacks skips its test, naming it.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from kspeed import DatasetSpec, KSpeedClient
from kspeed.cli.cluster import LocalCluster, wait_for
from kspeed.control.logs import LogSettings
from kspeed.errors import ConfigError
from kspeed.preprocess import Output, Pipeline, Stage
from kspeed.server.memory.pool import WINDOW_OWNER
from kspeed.server.prep.sandbox import SandboxPolicy, landlock
from kspeed.server.prep.workers import PrepTask, PrepWorkers
from tests.conftest import FAST_MANAGER, SERVER_MEMORY
from tests.security.sandbox_functions import OUTPUT, outcomes

pytestmark = [pytest.mark.security, pytest.mark.timeout(180)]

REPO = Path(__file__).resolve().parents[2]
TOKEN = "T0KEN-planted-sandbox-5e1d"
SAMPLE = 1000  # bytes of each raw sample


def landlock_abi() -> int:
    try:
        return landlock.abi_version()
    except OSError:
        return 0


needs_landlock = pytest.mark.skipif(not landlock_abi(), reason="Landlock is not available on this kernel")
needs_seccomp = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "aarch64"), reason=f"no seccomp filter is described for {platform.machine()}"
)
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the identity switch needs the tests to run as root")


@pytest.fixture
def open_dir():
    """A world-readable directory outside pytest's (whose ancestors are closed to other users)."""
    path = Path(tempfile.mkdtemp(prefix="kspeed-sandbox-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def write_samples(root: Path, count: int, seed: int) -> dict[str, bytes]:
    rng = np.random.default_rng(seed)
    files = {}
    for i in range(count):
        key = f"c{i % 2}/{i:03d}.bin"
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        files[key] = rng.integers(0, 256, SAMPLE, dtype=np.uint8).tobytes()
        (root / key).write_bytes(files[key])
    return files


def home_of(pool_dir: Path, data: bytes) -> tuple[Path, int] | None:
    """The region file holding ``data`` (a share's samples, back to back) at home, not in the production
    window, and its offset there; ``None`` while it is not all there."""
    manifest = json.loads((pool_dir / "pool.json").read_text())
    for index, entry in enumerate(manifest["regions"]):
        if entry["dataset"] not in (None, WINDOW_OWNER):
            region = pool_dir / f"region-{index:05d}.bin"
            at = region.read_bytes().find(data)
            if at >= 0:
                return region, at
    return None


def test_an_allowed_function_reaches_nothing_of_the_server(open_dir):
    data = open_dir / "data"
    victim = write_samples(data / "victim", 16, seed=1)
    write_samples(data / "attacker", 4, seed=2)
    token_file = open_dir / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o644)
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    cluster = LocalCluster(
        str(open_dir / "cluster"),
        servers=1,
        token_file=str(token_file),
        manager_args=FAST_MANAGER,
        server_args=[
            *SERVER_MEMORY,
            "--backend-allow",
            str(data),
            "--preprocess-allow",
            "tests.security",
            "--preprocess-workers",
            "1",
        ],
        env={"KSPEED_TOKEN": TOKEN, "PYTHONPATH": path},
        pool_root=str(open_dir / "pools"),
    )
    cluster.start()
    client = None
    try:
        client = KSpeedClient(config=cluster.client_config())
        keys = sorted(victim)
        spec = DatasetSpec(name="victim", uri=str(data / "victim"), labels="dirname")
        victim_feed = client.dataset(spec, 16, shuffle=False, quiet=True)  # held (and so kept) through the attack
        victim_feed.preload(quiet=True)
        assert [bytes(b.numpy(i)) for b in victim_feed for i in range(len(b))] == [victim[k] for k in keys]
        pool_dir = open_dir / "pools" / "server-0"
        stored = b"".join(victim[k] for k in keys)  # the victim's samples at home: back to back in ID order
        region, at = wait_for(lambda: home_of(pool_dir, stored), 30, "the victim's samples at home")
        span = slice(at, at + len(stored))
        server = cluster.servers[0]
        attack = Stage(
            "tests.security.sandbox_functions:attempts",
            {
                "token": TOKEN,
                "token_file": str(token_file),
                "state_dir": str(open_dir / "cluster" / "server-0"),
                "pool_dir": str(pool_dir),
                "region_file": str(region),
                "manager": cluster.address,
                "server_pid": server.process.pid,
            },
            output=OUTPUT,
        )
        attacker = DatasetSpec(name="attacker", uri=str(data / "attacker"), pipeline=Pipeline([attack]))
        with client.dataset(attacker, 4, offload=1.0, shuffle=False, quiet=True) as ds:
            report = outcomes(next(iter(ds))[0].numpy())
        breaches = {what: outcome for what, outcome in report["outcomes"].items() if not outcome.startswith("refused")}
        assert not breaches, f"the sandboxed function got through: {breaches}"
        assert len(report["outcomes"]) == 14
        if os.geteuid() == 0:
            assert report["uid"] not in (0, os.geteuid())  # its own, unprivileged user
        assert region.read_bytes()[span] == stored
        assert [bytes(b.numpy(i)) for b in victim_feed for i in range(len(b))] == [victim[k] for k in keys]
        victim_feed.close()
    finally:
        if client is not None:
            client.close()
        cluster.stop()


# -- each mechanism alone, in a process of its own ------------------------------------------------


def run_python(code: str) -> dict:
    """Run ``code`` in a fresh interpreter with this checkout importable; what it printed as JSON."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": path}
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


TRIES = """
import json, os, socket, subprocess
def attempt(action):
    try:
        action()
    except OSError as exc:
        return type(exc).__name__
    return "DONE"
def read(path):
    with open(path, "rb") as fh:
        fh.read(1)
def connect():
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.connect(("127.0.0.1", 9))
    finally:
        s.close()
"""


@needs_landlock
def test_landlock_alone_keeps_a_process_from_a_world_readable_file(open_dir):
    secret = open_dir / "secret"
    secret.write_text("x")
    secret.chmod(0o644)
    allowed = open_dir / "allowed"
    allowed.write_text("y")
    got = run_python(
        TRIES
        + f"""
import ctypes
from kspeed.server.prep.sandbox import landlock
ctypes.CDLL(None).prctl(38, 1, 0, 0, 0)  # no_new_privs
abi = landlock.restrict([{str(allowed)!r}], [], network=False)
print(json.dumps({{"abi": abi, "secret": attempt(lambda: read({str(secret)!r})),
                  "allowed": attempt(lambda: read({str(allowed)!r})),
                  "exec": attempt(lambda: subprocess.run(["/bin/true"])), "tcp": attempt(connect)}}))
"""
    )
    assert got["secret"] == "PermissionError" and got["allowed"] == "DONE"
    assert got["exec"] == "PermissionError"  # nothing may be executed
    if got["abi"] >= 4:
        assert got["tcp"] == "PermissionError"  # refused before any packet (not "ConnectionRefusedError")


@needs_seccomp
def test_seccomp_alone_refuses_sockets_and_programs():
    got = run_python(
        TRIES
        + """
from kspeed.server.prep.sandbox import seccomp
import ctypes
ctypes.CDLL(None).prctl(38, 1, 0, 0, 0)  # no_new_privs
seccomp.install(network=False)
def unshare_user():
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x10000000) != 0:  # CLONE_NEWUSER
        raise OSError(ctypes.get_errno(), "unshare")
print(json.dumps({"inet": attempt(lambda: socket.socket(socket.AF_INET)),
                  "inet6": attempt(lambda: socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)),
                  "unix": attempt(lambda: socket.socket(socket.AF_UNIX).close()),
                  "exec": attempt(lambda: subprocess.run(["/bin/sh", "-c", "true"])),
                  "unshare": attempt(unshare_user),
                  "file": attempt(lambda: read("/proc/self/status"))}))
"""
    )
    assert got == {
        "inet": "PermissionError",
        "inet6": "PermissionError",
        "unix": "DONE",
        "exec": "PermissionError",
        "unshare": "PermissionError",
        "file": "DONE",
    }


@needs_seccomp
def test_the_seccomp_filter_lets_the_network_through_when_the_operator_allows_it():
    got = run_python(
        TRIES
        + """
from kspeed.server.prep.sandbox import seccomp
import ctypes
ctypes.CDLL(None).prctl(38, 1, 0, 0, 0)
seccomp.install(network=True)
print(json.dumps({"inet": attempt(lambda: socket.socket(socket.AF_INET).close()),
                  "exec": attempt(lambda: subprocess.run(["/bin/true"]))}))
"""
    )
    assert got == {"inet": "DONE", "exec": "PermissionError"}


@needs_root
def test_the_identity_switch_drops_root_and_shows_only_what_the_worker_imports(tmp_path):
    # tmp_path's ancestors are closed to other users: the switch makes only the imports reachable.
    imports = tmp_path / "imports"
    imports.mkdir()
    (imports / "module.py").write_text("X = 1\n")
    (tmp_path / "beside").write_text("not for the worker")
    got = run_python(
        TRIES
        + f"""
from kspeed.server.prep.sandbox import identity
user = identity.resolve_user("nobody")
mechanisms = identity.become(user, network=False, read=[{str(imports)!r}], write=[])
print(json.dumps({{"uid": os.getuid(), "euid": os.geteuid(), "groups": os.getgroups(),
                  "module": attempt(lambda: read({str(imports / "module.py")!r})),
                  "beside": attempt(lambda: read({str(tmp_path / "beside")!r})),
                  "shadow": attempt(lambda: read("/etc/shadow")), "tcp": attempt(connect),
                  "mechanisms": mechanisms}}))
"""
    )
    assert got["uid"] == got["euid"] != 0 and got["groups"] == []
    assert got["module"] == "DONE"
    assert got["beside"] in ("FileNotFoundError", "PermissionError")  # hidden by the tmpfs over a closed ancestor
    assert got["shadow"] == "PermissionError"
    assert got["tcp"] == "OSError"  # a network namespace with no interface up: unreachable
    assert "network namespace (no interface up)" in got["mechanisms"]


# -- the workers -------------------------------------------------------------------------------------


SAME = Pipeline([Stage("tests.preprocess.import_probe:same", output=Output(shape=(16,), dtype="uint8"))])


@needs_landlock
def test_a_worker_that_could_reach_a_protected_path_refuses_pipelines_when_the_sandbox_is_required(open_dir):
    shared = open_dir / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    token = shared / "token"  # inside a path the operator let the workers write: reachable
    token.write_text(TOKEN)
    token.chmod(0o666)
    message = SAME.to_proto().SerializeToString()
    policy = SandboxPolicy(write=(str(shared),), protected=(str(token),))
    workers = PrepWorkers(1, ("tests",), LogSettings(), sandbox=policy)
    try:
        with pytest.raises(
            ConfigError, match=rf"the preprocessing sandbox is incomplete: a worker could write {token}"
        ):
            workers.check("ds", message, 1)
    finally:
        workers.close()
    lenient = PrepWorkers(1, ("tests",), LogSettings(), sandbox=SandboxPolicy(mode="best-effort", **_paths(policy)))
    try:
        lenient.check("ds", message, 1)  # runs, and says what it could reach in the log
        out = np.zeros(16, np.uint8)
        assert lenient.run(PrepTask("ds", message, 1, 0, 0, (0,), (bytes(range(16)),), (out,))) == [16]
        assert out.tobytes() == bytes(range(16))
    finally:
        lenient.close()


def _paths(policy: SandboxPolicy) -> dict:
    return {"write": policy.write, "protected": policy.protected}


EVIL = Pipeline([Stage("tests.security.sandbox_functions:forge_reply", output=Output(shape=(16,), dtype="uint8"))])


def test_a_worker_that_sends_what_a_worker_never_sends_is_replaced_and_nothing_of_it_is_unpickled(tmp_path):
    marker = tmp_path / "unpickled"
    workers = PrepWorkers(1, ("tests",), LogSettings())
    try:
        out = np.zeros(16, np.uint8)
        task = PrepTask("ds", EVIL.to_proto().SerializeToString(), 1, 0, 0, (0,), (str(marker).encode(),), (out,))
        results = workers.run(task)
        assert all(isinstance(r, str) and "died twice" in r for r in results)
        assert workers.restarts == 2
        assert not marker.exists()  # the forged pickle was never loaded by this process
    finally:
        workers.close()


LIAR = Pipeline([Stage("tests.security.sandbox_functions:overreport", output=Output(shape=(16,), dtype="uint8"))])


def test_a_worker_that_reports_more_than_its_place_holds_is_replaced_and_nothing_is_copied():
    workers = PrepWorkers(1, ("tests",), LogSettings())
    try:
        message = LIAR.to_proto().SerializeToString()
        first, second = np.ones(16, np.uint8), np.ones(16, np.uint8)
        assert workers.run(PrepTask("ds", message, 1, 0, 0, (0,), (b"x",), (first,))) == [16]  # it lies from now on
        assert workers.run(PrepTask("ds", message, 1, 0, 0, (1,), (b"y",), (second,))) == [16]  # by a new worker
        assert workers.restarts == 1 and not first.any() and not second.any()
    finally:
        workers.close()
